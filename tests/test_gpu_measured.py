"""The planner against what the GPU check measured on a GPU (benchmarks/results/gpu_check.json,
committed: an H200, 2026-12-04). Each measured scenario's estimate is recomputed with the
planner as it is now, on the run's GPU, and must read the allocated peak within 1% and the
reserved peak within 3% of the measured ones (issue 16). Where it does not, the cause found
is named and the case is an expected failure (strict: it fails when the cause is fixed, so
the entry is then removed)."""

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import gpu_check  # noqa: E402

RUN = json.loads((ROOT / "benchmarks" / "results" / "gpu_check.json").read_text())
MEASURED = [r for r in RUN["scenarios"] if r["status"] == "ok"]
ALLOCATED_WITHIN_PCT, RESERVED_WITHIN_PCT = 1.0, 3.0

# (scenario id, figure) -> the cause, as found on the GPU (README, "Measured on a GPU").
EXPECTED_MISSES = {
    ("smollm2-adamw-bf16-exp", "reserved"):
        "the check measures step 3, and with expandable segments this run's reserved memory still grows "
        "after it: through step 3 the planner's requests equal the record's, cuDNN's attention workspaces "
        "included, and its replay reserves the measured 10,322,182,144 B to the byte "
        "(tests/test_gpu_traces.py); the planner reports the replay's next steps (4 and 5: this step is "
        "replayed as two), where the mapped segments grow to 10,720,641,024 B and stay (+3.9%). Not measured "
        "past step 3 yet",
}


@pytest.fixture(scope="module")
def planned():
    return {}


@pytest.mark.parametrize("record", MEASURED, ids=[r["id"] for r in MEASURED])
@pytest.mark.parametrize("figure", ["allocated", "reserved"])
def test_the_estimate_reads_the_measured_peak(record, figure, planned, request):
    cause = EXPECTED_MISSES.get((record["id"], figure))
    if cause is not None:
        request.applymarker(pytest.mark.xfail(reason=cause, strict=True))
    spec = next(s for s in gpu_check.SCENARIOS if s["id"] == record["id"])
    if spec["id"] not in planned:
        planned[spec["id"]] = gpu_check.planner_record(spec, "cuda", RUN["gpu"],
                                                             RUN["environment"]["cudnn_version"])
    estimate = planned[spec["id"]]
    measured = record["measured"][f"{figure}_peak_bytes"]
    error = (estimate[f"{figure}_peak_bytes"] - measured) / measured * 100
    within = ALLOCATED_WITHIN_PCT if figure == "allocated" else RESERVED_WITHIN_PCT
    assert abs(error) <= within, f"{record['id']}: {figure} peak {error:+.2f}% (measured {measured:,} B)"


# Scenarios added to the GPU check after the committed H200 run: the next run measures them, and
# this test then fails until they leave this list.
NOT_YET_MEASURED = {
    "gpt2-adamw-fp16": "fp16 autocast, planned under autocast on CUDA's kernels since 2026-12-05; no GPU lent since",
}


def test_the_measured_run_is_a_gpu_run_of_every_scenario():
    assert RUN["mode"] == "cuda" and RUN["environment"]["gpu_name"] == "NVIDIA H200"
    assert {r["id"] for r in MEASURED} == {s["id"] for s in gpu_check.SCENARIOS} - set(NOT_YET_MEASURED)
