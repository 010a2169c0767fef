"""The optimizer step's temporaries on CUDA, against simulated CUDA steps.

torch's Adafactor keeps its per-tensor loop on CUDA unless foreach is asked for
(torch/optim/_adafactor.py), and transformers' Adafactor is a per-tensor loop everywhere:
the same code as on the CPU, so the CPU's probed step holds on CUDA. Read from torch's code
as two largest-tensor temporaries, a RoBERTa-base step was 154 MB (13%) high in the
randomized CUDA benchmark (seed 1027361093). A foreach step (AdamW's default on CUDA) still
comes from torch's code: it holds a temporary for every tensor at once, which the reduced
model cannot show. Column reductions' workspaces are the caching allocator's, not tensors: the
estimate's phases, like the simulated step, leave them out (Estimate.step_workspace_bytes).
"""

import pytest

from conftest import tiny_config
from planner.estimate import Confidence, estimate
from planner.loading import model_shape_for_config
from planner.probe import cache
from planner.probe.cache import CUDA_PROBE_ARCH
from planner.scenario import scenario_from_values
from runners.simulate_measure import simulate_step


@pytest.fixture(autouse=True)
def _isolated(tmp_path, monkeypatch):
    monkeypatch.setenv("PLANNER_DATA_DIR", str(tmp_path))
    monkeypatch.setattr(cache, "_MEMORY", {})


@pytest.mark.parametrize("optimizer,precision", [("adafactor", "fp32"), ("adafactor", "bf16-mixed"),
                                                 ("hf-adafactor", "bf16"), ("adamw", "fp32")])
def test_the_step_on_cuda_is_what_a_simulated_cuda_step_holds(optimizer, precision):
    config = tiny_config("tiny-llama")
    values = dict(task="causal-lm", batch_size=2, seq_len=24, optimizer=optimizer, precision=precision,
                  device="cuda")
    scenario = scenario_from_values(**values)
    shape = model_shape_for_config(config, scenario.task, 2, "tiny-llama")
    result = estimate(shape, scenario)
    assert result.confidence is Confidence.PROBED, result.notes
    measured = simulate_step(config, dict(values), gpu=CUDA_PROBE_ARCH)
    assert result.peak_phase.value == measured["peak_phase"] == "optimizer-step"
    # The plan rounds each weight, gradient and state tensor up to the caching allocator's 512 B;
    # the simulated step counts them exactly, and counts the CPU-hosted `step` scalars of torch's
    # Adafactor and AdamW (4 B a tensor), which a GPU does not hold.
    rounding, hosted = 4 * 511 * len(shape.params), 4 * len(shape.params)
    # A simulated step has no kernel workspaces and neither has the estimate's step (they are the
    # caching allocator's, replayed by planner.reserved and checked in tests/test_adafactor_cuda.py
    # and tests/test_cuda_reduction.py): tiny-llama's 3000 x 128 embeddings take one.
    assert (result.step_workspace_bytes > 0) == (optimizer != "adamw")
    difference = result.peak_bytes - measured["peak_bytes"]
    assert -hosted <= difference <= rounding, (result.peak_bytes, measured["peak_bytes"])
