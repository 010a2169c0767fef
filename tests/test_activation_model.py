"""The first activation model against measured CPU runs of small models (MemTracker over
real tensors, one steady-state step). The tolerance is the one the issue "Planner core"
asks of a first model; the accuracy issue tightens it across techniques."""

import pytest

from conftest import tiny_config
from planner.estimate import estimate
from planner.loading import model_shape_for_config
from planner.scenario import scenario_from_values
from runners.cpu_measure import measure_steady_state_step
from runners.model_factory import build_model, synthetic_batch
from runners.optimizers import build_optimizer

TOLERANCE = 0.03

CASES = [
    ("tiny-distilbert", "sequence-classification", {}),
    ("tiny-distilbert", "sequence-classification", {"optimizer": "sgd"}),
    ("tiny-gpt2", "causal-lm", {}),
    ("tiny-gpt2", "causal-lm", {"gradient_checkpointing": True}),
    ("tiny-gpt2", "causal-lm", {"grad_accum": 2}),
    ("tiny-gpt2", "causal-lm", {"attn": "eager"}),
    ("tiny-llama", "causal-lm", {}),
    ("tiny-llama", "causal-lm", {"gradient_checkpointing": True}),
    ("tiny-llama", "causal-lm", {"grad_accum": 2, "optimizer": "sgd"}),
]


@pytest.mark.parametrize("name,task,overrides", CASES)
def test_peak_within_tolerance_of_measured_cpu_run(name, task, overrides):
    config = tiny_config(name)
    values = {"task": task, "batch_size": 4, "seq_len": 128, "device": "cpu", **overrides}
    scenario = scenario_from_values(**values)
    model = build_model(config, scenario)
    optimizer = build_optimizer(model, scenario.optimizer)
    batches = [synthetic_batch(config, scenario, seed=i) for i in range(scenario.grad_accum_steps)]
    measured = measure_steady_state_step(model, optimizer, batches, scenario)

    planned = estimate(model_shape_for_config(config, scenario.task, 2, name), scenario)
    assert planned.weights_bytes == measured.by_category.get("weights", 0) or planned.peak_phase.value != "optimizer-step"
    assert abs(planned.peak_bytes - measured.peak_bytes) / measured.peak_bytes <= TOLERANCE, (
        planned.peak_bytes, measured.peak_bytes, measured.by_category)
