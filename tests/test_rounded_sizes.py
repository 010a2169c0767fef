"""Sizes CUDA's memory-efficient attention rounds the sequence up to, probed exactly on CUDA's kernels.

Its log-sum-exp is (b, h, ceil(s/32) * 32) fp32 (torch/_meta_registrations.py,
meta__efficient_attention_forward): 32 at every probe size (s = 7, 12, 15). A mask whose
rows are not 8-aligned is copied into one padded to a multiple of 8 columns (attention.cpp,
preprocess_mask / pad_bias<8>), which backward keeps; an aligned one is kept as it is. So
the kernel announces both (planner.probe.fake_cuda) and the table keeps ceil32(s) and
ceil8(s). Each estimate is checked against a full-depth simulated step on the same kernels
at sequences the probes never ran, a multiple of 8 among them."""

import json

import pytest

from conftest import tiny_config
from planner.estimate import Confidence, estimate
from planner.loading import model_shape_for_config
from planner.probe import cache
from planner.probe.cache import CUDA_PROBE_ARCH, probe_table
from planner.probe.table import monomial_value, poly_value, rounded_exponent
from planner.scenario import scenario_from_values
from runners.simulate_measure import simulate_step

# A Mistral small enough to simulate, its window short enough for the probe to reach it.
TINY_MISTRAL = {"model_type": "mistral", "architectures": ["MistralForCausalLM"], "vocab_size": 1000,
                "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 4, "num_attention_heads": 4,
                "num_key_value_heads": 2, "max_position_embeddings": 256, "sliding_window": 16,
                "bos_token_id": 1, "eos_token_id": 2, "tie_word_embeddings": False}


@pytest.fixture(autouse=True)
def _isolated(tmp_path, monkeypatch):
    monkeypatch.setenv("PLANNER_DATA_DIR", str(tmp_path))
    monkeypatch.setattr(cache, "_MEMORY", {})


def test_a_rounded_monomial_is_the_size_the_kernel_derives():
    assert [monomial_value(0, rounded_exponent("ceil32"), 1, s) for s in (1, 32, 33, 100)] == [32, 32, 64, 128]
    assert [monomial_value(0, rounded_exponent("ceil8"), 1, s) for s in (7, 8, 9, 15, 16)] == [8, 8, 16, 16, 16]
    # b * s * pad8(s) * ceil32(s)^2, as products of rounded dimensions multiply out
    j = 1 + rounded_exponent("ceil8") + 2 * rounded_exponent("ceil32")
    assert poly_value(((1, j, 3),), 2, 33) == 3 * 2 * 33 * 40 * 64 * 64


def _estimate_and_simulated(config: dict, values: dict):
    scenario = scenario_from_values(device="cuda", **values)
    shape = model_shape_for_config(config, scenario.task, 2, "tiny")
    result = estimate(shape, scenario)
    assert result.confidence is Confidence.PROBED, result.notes
    measured = simulate_step(config, dict(device="cuda", **values), gpu=CUDA_PROBE_ARCH)
    return shape, scenario, result, measured


@pytest.mark.parametrize("config,values", [
    (tiny_config("tiny-gpt2"), dict(task="causal-lm", batch_size=2, seq_len=100, precision="fp32")),
    (TINY_MISTRAL, dict(task="causal-lm", batch_size=2, seq_len=45, precision="bf16-mixed")),
    (TINY_MISTRAL, dict(task="causal-lm", batch_size=3, seq_len=48, precision="bf16-mixed")),
], ids=["gpt2-fp32-logsumexp", "mistral-window-reached-padded-mask", "mistral-window-reached-aligned-mask"])
def test_rounded_sizes_are_estimated_as_a_simulated_cuda_step_measures_them(config, values):
    shape, scenario, result, measured = _estimate_and_simulated(config, values)
    assert set(measured["attention_backends"]) == {"efficient"}
    # The estimate rounds each weight, gradient and AdamW state tensor to the caching
    # allocator's 512-byte blocks; the simulated step counts them at their exact size.
    rounding = 4 * 511 * len(shape.params)
    assert 0 <= result.peak_bytes - measured["peak_bytes"] <= rounding, (result.peak_bytes, measured["peak_bytes"])
    table = probe_table(shape, scenario)
    exponents = {j for poly in table.trace.polys for _, j, _ in poly}
    assert any(j // rounded_exponent("ceil32") for j in exponents)  # the log-sum-exp, announced
    if scenario.seq_len >= (config.get("sliding_window") or 10**9):
        assert any((j // rounded_exponent("ceil8")) % 100 for j in exponents)  # the padded mask, announced


def test_a_table_with_rounded_sizes_loads_as_it_was_stored():
    config = tiny_config("tiny-gpt2")
    scenario = scenario_from_values(task="causal-lm", batch_size=2, seq_len=40, device="cuda", precision="fp32")
    shape = model_shape_for_config(config, scenario.task, 2, "tiny")
    table = probe_table(shape, scenario)
    from planner.probe.table import ProbeTable

    again = ProbeTable.from_json(json.loads(json.dumps(table.to_json())))
    assert again == table
    assert again.walk(3, 77, 1) == table.walk(3, 77, 1)
