"""A model type without a hand-written activation recipe: its estimate is probed from its
own code (CPU's kernels, or CUDA's on fake tensors) and matches a simulated run; where the
probe cannot run, the generic recipe stands in, labelled as such, never a silent guess.
Parameter and optimizer figures stay exact either way."""

import pytest

from planner.estimate import Confidence, estimate
from planner.loading import model_shape_for_config
from planner.probe.cache import CUDA_PROBE_ARCH
from planner.scenario import scenario_from_values
from runners.measure import measure_in_process
from runners.request import Mode

# Falcon is built natively by transformers but has no recipe in planner.activations.
FALCON = {"model_type": "falcon", "vocab_size": 1000, "hidden_size": 64, "num_hidden_layers": 5,
          "num_attention_heads": 4, "new_decoder_architecture": False, "multi_query": True}


def test_unknown_family_on_cpu_is_probed_and_matches_a_simulated_run():
    values = dict(task="causal-lm", batch_size=2, seq_len=32, device="cpu")
    shape = model_shape_for_config(FALCON, scenario_from_values(**values).task, 2, "falcon-tiny")
    result = estimate(shape, scenario_from_values(**values))
    assert result.confidence is Confidence.PROBED
    assert result.to_json()["confidence"] == "probed"
    measured = measure_in_process(FALCON, "falcon-tiny", values, Mode.SIMULATE)["measured"]
    assert abs(result.peak_bytes - measured["peak_bytes"]) <= 0.001 * measured["peak_bytes"]


def test_unknown_family_on_cuda_is_probed_with_cuda_kernels_and_matches_a_simulated_cuda_step():
    from runners.simulate_measure import simulate_step

    values = {"task": "causal-lm", "batch_size": 2, "seq_len": 32, "device": "cuda", "precision": "bf16-mixed"}
    scenario = scenario_from_values(**values)
    shape = model_shape_for_config(FALCON, scenario.task, 2, "falcon-tiny")
    result = estimate(shape, scenario)
    assert result.confidence is Confidence.PROBED
    assert any("probed with sm80's CUDA kernels" in note and "on fake tensors" in note for note in result.notes)
    measured = simulate_step(FALCON, dict(values), gpu=CUDA_PROBE_ARCH)  # full depth, the runner's own loop
    # The estimate rounds each weight, gradient and AdamW state tensor to the caching
    # allocator's 512-byte blocks; the simulated step counts them at their exact size.
    rounding = 4 * 511 * len(shape.params)
    assert 0 <= result.peak_bytes - measured["peak_bytes"] <= rounding
    assert result.peak_phase.value == measured["peak_phase"]


def _probe_fails(monkeypatch):
    from planner.probe import cache
    from planner.probe import run

    monkeypatch.setattr(cache, "_MEMORY", {})
    monkeypatch.setattr(run, "record_probes", lambda *a, **k: (_ for _ in ()).throw(RuntimeError("no fake kernel")))


def test_unknown_family_the_probe_cannot_run_is_labelled_generic_with_a_way_to_measure(monkeypatch, tmp_path):
    monkeypatch.setenv("PLANNER_DATA_DIR", str(tmp_path))
    _probe_fails(monkeypatch)
    scenario = scenario_from_values(task="causal-lm", batch_size=2, seq_len=32, device="cuda")
    shape = model_shape_for_config(FALCON, scenario.task, 2, "falcon-tiny")
    result = estimate(shape, scenario)
    assert result.confidence is Confidence.GENERIC
    assert result.to_json()["confidence"] == "generic"
    assert any("no fake kernel" in note and "recipe stands in" in note for note in result.notes)
    assert any("runners verify --mode simulate" in note for note in result.notes)
    assert result.activations_bytes > 0 and result.peak_bytes > result.weights_bytes


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_known_family_the_probe_cannot_run_falls_back_to_its_recipe(monkeypatch, tmp_path, device):
    from conftest import tiny_config

    monkeypatch.setenv("PLANNER_DATA_DIR", str(tmp_path))
    _probe_fails(monkeypatch)
    scenario = scenario_from_values(task="causal-lm", batch_size=2, seq_len=32, device=device)
    shape = model_shape_for_config(tiny_config("tiny-llama"), scenario.task, 2, "tiny-llama")
    result = estimate(shape, scenario)
    assert result.confidence is Confidence.MODELLED
    assert any("the family recipe stands in" in note for note in result.notes)
