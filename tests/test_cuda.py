"""CUDA measurement (skipped without a GPU): the allocator-based probe reports the
optimizer state and weights exactly and a peak at least as large as what it can name."""

import pytest
import torch

from conftest import tiny_config
from planner.estimate import estimate
from planner.loading import model_shape_for_config
from planner.scenario import scenario_from_values
from runners.measure import measure_in_process
from runners.request import Mode

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.mark.parametrize("precision", ["fp32", "bf16-mixed"])
def test_cuda_probe_measures_state_and_peak(precision):
    values = dict(task="causal-lm", batch_size=4, seq_len=128, device="cuda", precision=precision)
    result = measure_in_process(tiny_config("tiny-llama"), "tiny-llama", values, Mode.CUDA)
    measured = result["measured"]
    planned = estimate(model_shape_for_config(tiny_config("tiny-llama"), scenario_from_values(**values).task, 2,
                                              "tiny-llama"), scenario_from_values(**values))
    assert measured["optimizer_state_bytes"] == planned.optimizer_state_bytes
    assert measured["weights_bytes"] == planned.weights_bytes
    assert measured["peak_bytes"] >= measured["weights_bytes"] + measured["optimizer_state_bytes"]
    assert measured["after_load_bytes"] >= measured["weights_bytes"]
    assert measured["cuda_context_bytes"] > 0
