"""planner.cuda_reduction against the GPU: the workspace torch's reduction kernel took for a
column mean on an H200, as the allocator history recorded it
(benchmarks/results/gpu_memory_snapshot.json), and the rules of Reduce.cuh's setReduceConfig
it follows."""

import json
from pathlib import Path

from planner.cuda_reduction import (
    SmGrid,
    column_reduction_workspace_bytes,
    largest_column_reduction_workspace_bytes,
    sm_grids,
)
from planner.gpus import GPUS, Runtime

SNAPSHOT = Path(__file__).resolve().parents[1] / "benchmarks" / "results" / "gpu_memory_snapshot.json"
SEMAPHORE_BLOCK = 512  # 4 B per output block, in one 512-byte block


def test_the_h200s_workspace_for_adafactors_column_mean_is_the_measured_one():
    """transformers' Adafactor's `update.mean(dim=-2)` over DistilBERT's 28,996 x 768 fp32 word
    embeddings, at transformers/optimization.py:1267 on the H200."""
    record = next(r for r in json.loads(SNAPSHOT.read_text()) if r["id"] == "distilbert-hf-adafactor-trainer")
    (measured,) = [item["bytes"] for item in record["largest"]
                   if item["frames"] and "transformers/optimization.py:1267" in item["frames"][0]]
    assert sm_grids()["h200"] == SmGrid(132, 2048)
    assert column_reduction_workspace_bytes((28996, 768), sm_grids()["h200"]) == measured + SEMAPHORE_BLOCK


def test_every_cuda_gpu_has_a_grid_and_a_smaller_grid_never_takes_more():
    grids = sm_grids()
    assert set(grids) == {key for key, gpu in GPUS.items() if gpu.runtime is Runtime.CUDA}
    for shape in [(28996, 768), (4096, 14336), (50257, 768), (8, 1024, 512)]:
        sizes = sorted((grid.sm_count * grid.max_threads_per_sm, column_reduction_workspace_bytes(shape, grid))
                       for grid in grids.values())
        assert [size for _, size in sizes] == sorted(size for _, size in sizes), shape
        assert largest_column_reduction_workspace_bytes(shape) == sizes[-1][1]


def test_a_short_reduction_stays_in_one_block():
    # Few rows per output: each warp sums its outputs' rows alone (no split of the inputs), or
    # fewer than 256 values per thread: no blocks meet in global memory.
    h200 = sm_grids()["h200"]
    assert column_reduction_workspace_bytes((16, 768), h200) == 0
    assert column_reduction_workspace_bytes((1000, 768), h200) == 0
    assert column_reduction_workspace_bytes((768,), h200) == 0  # a vector has no dim -2 to reduce
    assert column_reduction_workspace_bytes((2048, 768), h200) > 0


def test_the_h200s_workspace_for_a_whole_tensors_norm_is_the_recorded_one():
    """`tensor.norm()` in transformers' Adafactor's `_rms`, as the H200's allocator record of
    DistilBERT's Trainer run has it (torch/functional.py:1839): the workspace and semaphore
    requests after the norm's 4-byte output, by the tensor's elements."""
    import gzip
    from collections import Counter

    from planner.cuda_reduction import full_reduction_requests

    record = Path(__file__).resolve().parents[1] / "benchmarks/results/gpu_runs/2026-12-04-d/traces"
    events = json.loads(gzip.open(record / "distilbert-hf-adafactor-trainer.json.gz", "rt").read())["events"]
    allocations = [size for action, _, size, frame in events if action == "alloc" and "functional.py:1839" in frame]
    recorded = Counter(size for size in allocations if size > 4)  # the 4-byte outputs and semaphores aside
    # DistilBERT's tensors by elements: embeddings, position embeddings, 768 x 768, 3072 x 768, vectors.
    h200 = sm_grids()["h200"]
    expected = {numel: full_reduction_requests(numel, h200) for numel in (28996 * 768, 512 * 768, 768 * 768,
                                                                           3072 * 768, 768, 3072, 2)}
    assert expected[768] == expected[3072] == expected[2] == (0, 0)
    assert {workspace for workspace, _ in expected.values() if workspace} == set(recorded)
    assert all(semaphores == 4 for workspace, semaphores in expected.values() if workspace)
