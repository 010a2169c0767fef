"""A model type without an activation recipe still gets an estimate, labelled as generic,
never a silent guess; its parameter and optimizer figures stay exact."""

from planner.estimate import Confidence, estimate
from planner.loading import model_shape_for_config
from planner.scenario import scenario_from_values

# Falcon is built natively by transformers but has no recipe in planner.activations.
FALCON = {"model_type": "falcon", "vocab_size": 1000, "hidden_size": 64, "num_hidden_layers": 2,
          "num_attention_heads": 4, "new_decoder_architecture": False, "multi_query": True}


def test_unknown_family_is_labelled_generic_with_a_way_to_measure():
    scenario = scenario_from_values(task="causal-lm", batch_size=2, seq_len=32, device="cpu")
    shape = model_shape_for_config(FALCON, scenario.task, 2, "falcon-tiny")
    result = estimate(shape, scenario)
    assert result.confidence is Confidence.GENERIC
    assert result.to_json()["confidence"] == "generic"
    assert any("runners verify --mode simulate" in note for note in result.notes)
    assert result.activations_bytes > 0 and result.peak_bytes > result.weights_bytes


def test_known_families_are_modelled():
    scenario = scenario_from_values(task="causal-lm", batch_size=2, seq_len=32, device="cpu")
    from conftest import tiny_config

    shape = model_shape_for_config(tiny_config("tiny-llama"), scenario.task, 2, "tiny-llama")
    assert estimate(shape, scenario).confidence is Confidence.MODELLED
