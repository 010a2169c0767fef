"""Weights and gradients per precision against a real model's tensors after backward."""

import pytest
import torch

from conftest import tiny_config
from planner.estimate import estimate
from planner.loading import model_shape_for_config
from planner.scenario import scenario_from_values
from runners.model_factory import build_model, synthetic_batch


@pytest.mark.parametrize("name,task", [("tiny-distilbert", "sequence-classification"), ("tiny-llama", "causal-lm"),
                                       ("tiny-gpt2", "causal-lm")])
@pytest.mark.parametrize("precision", ["fp32", "bf16-mixed", "bf16"])
def test_weights_and_gradients_equal_real_tensors(name, task, precision):
    config = tiny_config(name)
    scenario = scenario_from_values(task=task, batch_size=2, seq_len=16, precision=precision, device="cpu")
    model = build_model(config, scenario)
    context = torch.autocast("cpu", dtype=torch.bfloat16) if precision == "bf16-mixed" else torch.enable_grad()
    with context:
        loss = model(**synthetic_batch(config, scenario)).loss
    loss.backward()
    real_weights = sum(p.numel() * p.element_size() for p in model.parameters())
    real_weights += sum(b.numel() * b.element_size() for b in model.buffers())
    real_gradients = sum(p.grad.numel() * p.grad.element_size() for p in model.parameters())

    result = estimate(model_shape_for_config(config, scenario.task, 2, name), scenario)
    assert result.weights_bytes == real_weights
    assert result.gradients_bytes == real_gradients


def test_runs_build_fp32_masters_whatever_the_config_dtype():
    config = dict(tiny_config("tiny-llama"), torch_dtype="float16")
    scenario = scenario_from_values(task="causal-lm", batch_size=1, seq_len=8, device="cpu")
    assert {p.dtype for p in build_model(config, scenario).parameters()} == {torch.float32}
