"""The simulated measurement (fake tensors) against the real CPU measurement: the same
steady-state step, so the same peak and categories to the byte; and a 7B plan checked
without allocating its memory."""

import json
import resource
from pathlib import Path

import pytest
import torch
from torch._subclasses.fake_tensor import DataDependentOutputException, FakeTensorMode

from conftest import tiny_config
from planner.probe import fake_mode as fake_mode_patches
from runners.measure import measure_in_process
from runners.request import Mode

CATALOG = Path(__file__).resolve().parents[1] / "planner" / "catalog"
GiB = 2**30

CASES = [
    ("tiny-distilbert", "sequence-classification", {}),
    ("tiny-distilbert", "sequence-classification", {"optimizer": "sgd"}),
    ("tiny-llama", "causal-lm", {}),  # grouped-query attention: 4 query heads, 2 key/value heads
    ("tiny-llama", "causal-lm", {"optimizer": "sgd"}),
    ("tiny-gpt2", "causal-lm", {}),
    ("tiny-gpt2", "causal-lm", {"optimizer": "sgd"}),
    # Beyond the fp32 AdamW/SGD core: each exercises one more thing fake tensors change.
    ("tiny-llama", "causal-lm", {"optimizer": "adafactor"}),  # .item() stand-ins
    ("tiny-llama", "causal-lm", {"optimizer": "hf-adafactor"}),
    ("tiny-distilbert", "sequence-classification", {"optimizer": "adamw8bit"}),  # bnb quantile maps
    ("tiny-llama", "causal-lm", {"gradient_checkpointing": True}),
    ("tiny-llama", "causal-lm", {"grad_accum": 2}),
    ("tiny-llama", "causal-lm", {"attn": "eager"}),
    ("tiny-llama", "causal-lm", {"precision": "bf16-mixed"}),
]


def _scenario(task, **overrides):
    return dict(task=task, batch_size=4, seq_len=128, device="cpu", **overrides)


def _measured(config, scenario, mode):
    return measure_in_process(config, "tiny", scenario, mode)["measured"]


@pytest.mark.parametrize("name,task,overrides", CASES,
                         ids=[f"{n}-{'-'.join(f'{k}={v}' for k, v in o.items()) or 'adamw'}" for n, _, o in CASES])
def test_simulated_step_equals_real_cpu_step_to_the_byte(name, task, overrides):
    config = tiny_config(name)
    scenario = _scenario(task, **overrides)
    real = _measured(config, scenario, Mode.CPU)
    simulated = _measured(config, scenario, Mode.SIMULATE)
    assert real["peak_bytes"] > 0
    for key in ("peak_bytes", "peak_phase", "weights_bytes", "gradients_bytes", "optimizer_state_bytes",
                "activations_bytes", "temporaries_bytes"):
        assert simulated[key] == real[key], key


def test_without_the_mask_patch_gqa_simulation_takes_another_path(monkeypatch):
    """Why planner.probe.fake_mode.all_ones_padding_masks exists: without it the fake
    all-ones mask is kept, the K/V heads are repeated and the peak grows. If this starts
    failing after a transformers upgrade, the patch may have become unnecessary (or now
    patches the wrong functions): re-check masking_utils."""
    import contextlib

    config = tiny_config("tiny-llama")
    scenario = _scenario("causal-lm")
    patched = _measured(config, scenario, Mode.SIMULATE)
    monkeypatch.setattr(fake_mode_patches, "all_ones_padding_masks", contextlib.nullcontext)
    unpatched = _measured(config, scenario, Mode.SIMULATE)
    assert unpatched["peak_bytes"] > patched["peak_bytes"]


def test_mask_patch_is_scoped_to_its_context():
    from transformers import masking_utils

    before = (masking_utils._ignore_causal_mask_sdpa, masking_utils._ignore_bidirectional_mask_sdpa)
    with fake_mode_patches.all_ones_padding_masks():
        assert masking_utils._ignore_causal_mask_sdpa is not before[0]
        with FakeTensorMode() as mode:
            mask = mode.from_tensor(torch.ones(2, 8, dtype=torch.bool))
            assert masking_utils._ignore_causal_mask_sdpa(mask, 8, 8, 0, 0) is True
            assert masking_utils._ignore_bidirectional_mask_sdpa(mask, 8) is True
    assert (masking_utils._ignore_causal_mask_sdpa, masking_utils._ignore_bidirectional_mask_sdpa) == before


def test_scalar_stand_ins_cover_floats_only():
    with FakeTensorMode() as mode:
        as_float = mode.from_tensor(torch.tensor([2.0])).sum()
        as_int = mode.from_tensor(torch.tensor([2])).sum()
        with fake_mode_patches.scalar_stand_ins():
            assert as_float.item() == fake_mode_patches.STAND_IN_FLOAT
            with pytest.raises(DataDependentOutputException):
                as_int.item()


def test_llama_2_7b_step_is_simulated_without_allocating_it():
    config = json.loads((CATALOG / "llama-2-7b.json").read_text())
    # The catalog file says torch_dtype float16; runs build fp32 masters regardless (27 GB of weights).
    scenario = dict(task="causal-lm", batch_size=1, seq_len=128, device="cpu")
    simulated = _measured(config, scenario, Mode.SIMULATE)

    parameters = 6_738_415_616  # Llama-2-7B
    assert simulated["weights_bytes"] >= 4 * parameters
    assert simulated["optimizer_state_bytes"] >= 8 * parameters  # AdamW exp_avg + exp_avg_sq
    assert simulated["peak_bytes"] > 100 * 10**9
    # ru_maxrss is the process's high-water mark in KiB on Linux, whatever ran before.
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 < 4 * GiB
