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
    ("distilbert-adam8bit-exp", "allocated"):
        "backward reads 10.5 MB above the estimate on DistilBERT (the AdamW run's backward too): 1 MiB is "
        "torch 2.11's separate cuBLASLt workspace, the rest not yet found (the memory-efficient attention "
        "backward's workspace is suspected): -1.3%",
    ("llama-3.2-1b-adamw8bit-bf16-ckpt-exp", "allocated"):
        "the tied embedding's two gradients (lm_head's, cast back from bf16, and the embedding's) are "
        "summed in the autograd engine's input buffer in place on real tensors (InputBuffer accumulate: "
        "can_accumulate_inplace), out of place on fake tensors (a tensor subclass) and under MemTracker: "
        "one fp32 embedding-sized tensor, 1.05 GB, too many at the end of backward "
        "(benchmarks/results/gpu_memory_snapshot.md: two such buffers live at the real peak): +7.1%",
    ("llama-3.2-1b-adamw8bit-bf16-ckpt-exp", "reserved"):
        "the same out-of-place gradient sum, replayed: +6.7%",
    ("gpt2-lora-bf16", "reserved"):
        "not yet found: the allocated peak is exact (-0.04%) but the real run reserves 380 MB more than "
        "the replay of the probe's trace; the order of the real allocations differs somewhere (LoRA's "
        "wrapping or loading is suspected): -7.6%",
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
        planned[spec["id"]] = gpu_check.planner_record(spec, "cuda", RUN["gpu"])
    estimate = planned[spec["id"]]
    measured = record["measured"][f"{figure}_peak_bytes"]
    error = (estimate[f"{figure}_peak_bytes"] - measured) / measured * 100
    within = ALLOCATED_WITHIN_PCT if figure == "allocated" else RESERVED_WITHIN_PCT
    assert abs(error) <= within, f"{record['id']}: {figure} peak {error:+.2f}% (measured {measured:,} B)"


def test_the_measured_run_is_a_gpu_run_of_every_scenario():
    assert RUN["mode"] == "cuda" and RUN["environment"]["gpu_name"] == "NVIDIA H200"
    assert {r["id"] for r in MEASURED} == {s["id"] for s in gpu_check.SCENARIOS}
