"""A model type without a hand-written activation recipe: on CPU its estimate is probed
from its own code and matches a simulated run; where the probe does not apply (CUDA
kernels), the generic recipe stands in, labelled as such, never a silent guess. Parameter
and optimizer figures stay exact either way."""

from planner.estimate import Confidence, estimate
from planner.loading import model_shape_for_config
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


def test_unknown_family_on_cuda_is_labelled_generic_with_a_way_to_measure():
    scenario = scenario_from_values(task="causal-lm", batch_size=2, seq_len=32, device="cuda")
    shape = model_shape_for_config(FALCON, scenario.task, 2, "falcon-tiny")
    result = estimate(shape, scenario)
    assert result.confidence is Confidence.GENERIC
    assert result.to_json()["confidence"] == "generic"
    assert any("runners verify --mode simulate" in note for note in result.notes)
    assert result.activations_bytes > 0 and result.peak_bytes > result.weights_bytes


def test_known_families_on_cuda_are_modelled():
    scenario = scenario_from_values(task="causal-lm", batch_size=2, seq_len=32, device="cuda")
    from conftest import tiny_config

    shape = model_shape_for_config(tiny_config("tiny-llama"), scenario.task, 2, "tiny-llama")
    assert estimate(shape, scenario).confidence is Confidence.MODELLED
