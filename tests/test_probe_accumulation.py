"""The probe's input-buffer sums (planner.probe.accumulation) against the autograd engine's own.

Where several consumers send gradients to one tensor, the engine sums them in its input
buffer, in place on real tensors when the buffer holds the last reference, out of place
under any dispatch mode. A real backward with no mode active is the reference: at every
tensor with more than one consumer, a consumer's pre-hook reads the summed gradient's
version counter (each in-place `add_` bumps it; an out-of-place sum is a fresh tensor at
version 0). The recorder taking CUDA's path (planner.probe.recorder with an InputBufferSums)
must reach the same version at every such place, on real tensors and on fake ones, for
tiny models of five families with tied and untied embeddings.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import transformers
from torch._subclasses.fake_tensor import FakeTensorMode

from planner.probe.accumulation import InputBufferSums, graph_nodes
from planner.probe.recorder import Recorder, Recording

CONFIGS = Path(__file__).parent / "configs"


def _model(name: str, tie: bool, fake: FakeTensorMode | None = None):
    values = {k: v for k, v in json.loads((CONFIGS / f"{name}.json").read_text()).items() if k != "architectures"}
    config = transformers.AutoConfig.for_model(**values)
    config.tie_word_embeddings = tie
    torch.manual_seed(0)
    if fake is None:
        model = transformers.AutoModelForCausalLM.from_config(config)
    else:
        with fake:
            model = transformers.AutoModelForCausalLM.from_config(config)
    model.train()
    return model, config


def _summed_versions(loss) -> tuple[list, list]:
    """Pre-hooks on every node that receives more than one gradient somewhere: they append
    (node, input, shape, version) of each summed gradient when the node runs."""
    nodes = graph_nodes(loss.grad_fn)
    fan_in: dict[tuple[int, int], int] = {}
    for node in nodes:
        for target, number in node.next_functions:
            if target is not None:
                fan_in[(id(target), number)] = fan_in.get((id(target), number), 0) + 1
    seen, hooks = [], []
    for node in nodes:
        inputs = sorted(number for (target, number), count in fan_in.items() if target == id(node) and count > 1)
        if inputs:
            def read(grads, node=node, inputs=inputs):
                seen.extend((node.name(), n, tuple(grads[n].shape), grads[n]._version) for n in inputs)
            hooks.append(node.register_prehook(read))
    return seen, hooks


def _backward(model, ids, recorder: Recorder | None = None, sums: InputBufferSums | None = None) -> list:
    outputs = model(input_ids=ids, labels=ids)
    seen, hooks = _summed_versions(outputs.loss)
    if recorder is None:
        outputs.loss.backward()
    else:
        sums.watch(outputs.loss)
        with recorder:
            outputs.loss.backward()
        sums.release()
    for hook in hooks:
        hook.remove()
    return seen


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-gpt2", "tiny-neox", "tiny-opt", "tiny-phi"])
@pytest.mark.parametrize("tie", [True, False])
def test_the_recorder_sums_in_place_exactly_where_the_engine_does(name, tie):
    model, config = _model(name, tie)
    ids = torch.randint(0, config.vocab_size, (2, 7), generator=torch.Generator().manual_seed(1))
    engine = _backward(model, ids)
    model.zero_grad(set_to_none=True)
    assert any(version for *_, version in engine), "no sum was made in place: nothing is checked"

    sums = InputBufferSums()
    sums.calibrate()
    real = _backward(model, ids, Recorder(Recording(2, 7), (), sums), sums)
    assert real == engine
    assert sums.sums_in_place
    if tie:  # the tied weight's two gradients: the LM head's is a transposed view whose base lives
        assert sums.sums_out_of_place

    fake = FakeTensorMode()
    fake_model, _ = _model(name, tie, fake)
    fake_sums = InputBufferSums()
    with fake:
        fake_sums.calibrate()
        on_fake = _backward(fake_model, fake.from_tensor(ids), Recorder(Recording(2, 7), (), fake_sums), fake_sums)
    assert on_fake == engine
    assert (fake_sums.sums_in_place, fake_sums.sums_out_of_place) == (sums.sums_in_place, sums.sums_out_of_place)


def test_without_a_calibration_nothing_is_summed_in_place_by_guess():
    sums = InputBufferSums()
    leaf = torch.ones(2, requires_grad=True)
    with pytest.raises(RuntimeError, match="calibrate"):
        sums.watch((leaf * 2).sum())
