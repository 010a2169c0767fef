"""Both training paths of the lessons, run for real on CPU: the measured optimizer state
equals the planner's exact figure, and the Trainer and the Accelerate loop agree on it."""

import tempfile

import pytest

from conftest import tiny_config
from planner.estimate import estimate
from planner.loading import model_shape_for_config
from planner.scenario import Optimizer, scenario_from_values
from runners.engines import trainer_builds_optimizer
from runners.measure import measure_in_process
from runners.request import Engine, Mode


def _values(optimizer: Optimizer, **overrides) -> dict:
    return dict(task="causal-lm", batch_size=2, seq_len=64, device="cpu", optimizer=optimizer.value, **overrides)


@pytest.mark.parametrize("optimizer", list(Optimizer))
def test_measured_state_equals_planner(optimizer):
    config = tiny_config("tiny-llama")
    values = _values(optimizer)
    measured = measure_in_process(config, "tiny-llama", values, Mode.CPU)["measured"]
    scenario = scenario_from_values(**values)
    planned = estimate(model_shape_for_config(config, scenario.task, 2, "tiny-llama"), scenario)
    assert measured["optimizer_state_bytes"] == planned.optimizer_state_bytes


@pytest.mark.parametrize("optimizer", [Optimizer.ADAMW, Optimizer.ADAMW_FUSED, Optimizer.HF_ADAFACTOR,
                                       Optimizer.ADAM8BIT, Optimizer.SGD])
def test_trainer_and_accelerate_agree_on_state(optimizer, tmp_path, monkeypatch):
    config = tiny_config("tiny-gpt2")
    values = _values(optimizer, grad_accum=2)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # what the Trainer's run leaves in the temp folder
    through_trainer = measure_in_process(config, "tiny-gpt2", values, Mode.CPU, engine=Engine.TRAINER)
    assert [p.name for p in tmp_path.glob("planner-trainer-*")] == []  # its output_dir went with the run
    through_loop = measure_in_process(config, "tiny-gpt2", values, Mode.CPU, engine=Engine.ACCELERATE)
    assert through_trainer["engine"] == "trainer" and through_loop["engine"] == "accelerate"
    assert through_trainer["measured"]["optimizer_state_bytes"] == through_loop["measured"]["optimizer_state_bytes"]
    assert through_trainer["measured"]["weights_bytes"] == through_loop["measured"]["weights_bytes"]


@pytest.mark.parametrize("optimizer", [Optimizer.ADAMW8BIT, Optimizer.PAGED_ADAMW8BIT])
def test_trainer_keeps_embeddings_in_32_bit_for_bnb_optim_strings(optimizer):
    """Trainer(optim="adamw_bnb_8bit") registers nn.Embedding weights for 32-bit state; the
    lessons' hand-built 8-bit optimizer does not. Both paths match the planner."""
    config = tiny_config("tiny-llama")  # untied embeddings: the input table alone is overridden
    values = _values(optimizer)
    states = {}
    for engine in (Engine.TRAINER, Engine.ACCELERATE):
        measured = measure_in_process(config, "tiny-llama", values, Mode.CPU, engine=engine)["measured"]
        scenario = scenario_from_values(**values, engine=engine.value)
        planned = estimate(model_shape_for_config(config, scenario.task, 2, "tiny-llama"), scenario)
        assert measured["optimizer_state_bytes"] == planned.optimizer_state_bytes
        states[engine] = measured["optimizer_state_bytes"]
    embedding = 3000 * 128  # tiny-llama's vocabulary x hidden
    # 32-bit: 2 x 4 bytes per element; 8-bit: 2 x 1 byte + 2 absmax per 256 elements.
    assert states[Engine.TRAINER] - states[Engine.ACCELERATE] == 8 * embedding - (2 * embedding + 2 * 4 * (embedding // 256))


def test_trainer_builds_the_training_arguments_optimizers_itself():
    assert trainer_builds_optimizer(scenario_from_values(task="causal-lm", batch_size=1, seq_len=8, optimizer="adafactor")) is False
    assert trainer_builds_optimizer(scenario_from_values(task="causal-lm", batch_size=1, seq_len=8, optimizer="hf-adafactor"))


def test_measured_phase_and_environment_are_reported():
    result = measure_in_process(tiny_config("tiny-distilbert"), "tiny-distilbert",
                                dict(task="sequence-classification", batch_size=2, seq_len=32, device="cpu",
                                     gradient_checkpointing=True), Mode.CPU, steps=3)
    measured = result["measured"]
    assert measured["peak_phase"] in ("forward", "backward", "optimizer-step")
    assert measured["step_wall_s"] > 0
    assert {"torch", "transformers", "accelerate", "device"} <= set(result["environment"])
