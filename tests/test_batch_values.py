"""Ops sized by the batch's values, on fake tensors (planner.probe.fake_mode.batch_values).

DeBERTa-v2's sequence classifier keeps its labelled rows with `(labels >= 0).nonzero()`: a
fake tensor has no values, so its probe and simulation raised DynamicOutputShapeException.
On the CPU the probe fell back to real tensors; on CUDA's kernels (fake only) the family
recipe stood in. Fake batches now carry the real batch's values, and the ops that read them
run on those values. Checked against a real-tensor probe (equal to the byte), a simulated
CUDA step, and against what must still refuse (values no batch gives)."""

import json

import pytest
import torch
from torch._subclasses.fake_tensor import DynamicOutputShapeException, FakeTensorMode

from planner.estimate import Confidence, estimate
from planner.loading import model_shape_for_config
from planner.probe import cache
from planner.probe.cache import CUDA_PROBE_ARCH, technique_key
from planner.probe.fake_mode import fake_batch, simulation
from planner.probe.run import layout_for, record_probes
from planner.probe.solve import solve
from planner.scenario import scenario_from_values
from planner.shapes_from_config import load_transformers_config
from runners.simulate_measure import simulate_step

TINY_DEBERTA = {"model_type": "deberta-v2", "architectures": ["DebertaV2ForSequenceClassification"],
                "hidden_act": "gelu", "hidden_size": 64, "intermediate_size": 128, "max_position_embeddings": 128,
                "relative_attention": True, "position_buckets": 32, "norm_rel_ebd": "layer_norm",
                "share_att_key": True, "pos_att_type": "p2c|c2p", "max_relative_positions": -1,
                "position_biased_input": False, "num_attention_heads": 4, "num_hidden_layers": 5,
                "type_vocab_size": 0, "vocab_size": 1000}
VALUES = dict(task="sequence-classification", batch_size=3, seq_len=20)


@pytest.fixture(autouse=True)
def _isolated(tmp_path, monkeypatch):
    monkeypatch.setenv("PLANNER_DATA_DIR", str(tmp_path))
    monkeypatch.setattr(cache, "_MEMORY", {})


def _table(scenario, real: bool):
    shape = model_shape_for_config(TINY_DEBERTA, scenario.task, scenario.num_labels, "tiny-deberta")
    config = load_transformers_config(TINY_DEBERTA, scenario.task, scenario.num_labels)
    layout = layout_for(config)
    recordings = record_probes(TINY_DEBERTA, config, scenario, layout, False, real=real,
                               gpu=cache.probe_gpu(scenario))
    return solve(recordings, layout, technique_key(shape, scenario), on_real_tensors=real)


def test_deberta_probed_on_fake_tensors_equals_its_probe_on_real_tensors():
    scenario = scenario_from_values(device="cpu", attn="eager", **VALUES)
    fake, real = _table(scenario, real=False).to_json(), _table(scenario, real=True).to_json()
    assert (fake.pop("on_real_tensors"), real.pop("on_real_tensors")) == (False, True)
    assert fake == real


def test_deberta_on_cuda_is_probed_and_matches_a_simulated_cuda_step():
    values = dict(device="cuda", attn="eager", **VALUES)
    scenario = scenario_from_values(**values)
    shape = model_shape_for_config(TINY_DEBERTA, scenario.task, scenario.num_labels, "tiny-deberta")
    result = estimate(shape, scenario)
    assert result.confidence is Confidence.PROBED, result.notes
    measured = simulate_step(TINY_DEBERTA, dict(values), gpu=CUDA_PROBE_ARCH)  # full depth
    # The estimate rounds each weight, gradient and AdamW state tensor to the caching
    # allocator's 512-byte blocks; the simulated step counts them at their exact size.
    rounding = 4 * 511 * len(shape.params)
    assert 0 <= result.peak_bytes - measured["peak_bytes"] <= rounding, (result.peak_bytes, measured["peak_bytes"])


def test_values_follow_the_batch_and_nothing_else():
    mode = FakeTensorMode()
    labels = torch.tensor([2, -100, 0, 1])
    batch = fake_batch(mode, {"labels": labels})
    with simulation(mode):
        kept = (batch["labels"] >= 0).nonzero()
        assert tuple(kept.shape) == (3, 1)  # the real count, from the values
        assert int((batch["labels"] >= 0).sum().item()) == 3  # an integer .item() is answered too
        weights = torch.randn(4)  # made in fake mode: no values
        with pytest.raises(DynamicOutputShapeException):
            (weights > 0).nonzero()  # a router's choice: still refused
        labels_copy = batch["labels"].clone()
        labels_copy.add_(weights.long())  # written from a tensor without values
        with pytest.raises(DynamicOutputShapeException):
            labels_copy.nonzero()


def test_an_output_too_large_to_compute_for_real_gets_no_values(monkeypatch):
    from planner.probe import fake_mode

    monkeypatch.setattr(fake_mode, "MAX_VALUE_ELEMENTS", 100)
    mode = FakeTensorMode()
    batch = fake_batch(mode, {"attention_mask": torch.ones(2, 8, dtype=torch.long)})
    with simulation(mode):
        mask = batch["attention_mask"]
        assert tuple((mask > 0).nonzero().shape) == (16, 2)  # 16 elements: values kept
        square = mask[:, :, None] * mask[:, None, :]  # (2, 8, 8): 128 elements, over the limit
        with pytest.raises(DynamicOutputShapeException):
            square.nonzero()
