"""planner.cuda_overheads: every fixed CUDA overhead has a source and a kind, the figures
equal the arithmetic of the code or readings they cite (written out here, independently of
the module's constants), multi-GPU plans add NCCL and one GPU does not, and nothing inside
the caching allocator is subtracted from the capacity a second time."""

import dataclasses
import json
import re
from pathlib import Path

import pytest

from planner.cuda_overheads import (
    ROCM_STAND_IN,
    CudaOverheads,
    OverheadItem,
    OverheadKind,
    Placement,
    cublas_workspace_bytes,
    cuda_overheads,
    nccl_communicators,
)
from planner.gpus import GPUS, GpuSpec, Runtime
from planner.strategy import MULTI_DEVICE_STRATEGIES, ParallelPlan, Strategy

MIB = 2**20
GIB = 2**30
SOURCE = re.compile(r"^(https?://\S+|[\w.-]+(/[\w.-]+)+)")  # a URL, or a path like a/b/c.py

PLANS = [ParallelPlan()] + [ParallelPlan(n, s) for s in MULTI_DEVICE_STRATEGIES for n in (2, 4)]


MEASURED_RUN = Path(__file__).resolve().parents[1] / "benchmarks" / "results" / "gpu_check.json"
MEASURED_GPUS = {"h200"}  # GPUs benchmarks/gpu_check.sh has measured (the committed results)


def measured_run() -> dict:
    return json.loads(MEASURED_RUN.read_text())


def all_overheads():
    for gpu in [*GPUS.values(), None]:
        for plan in PLANS:
            yield gpu, plan, cuda_overheads(gpu, plan)


def test_every_item_is_documented_with_a_source():
    for gpu, _, o in all_overheads():
        for item in o.items + o.allocator_items:
            if item.kind is OverheadKind.MEASURED:  # only figures the committed GPU check measured
                assert gpu is not None and gpu.key in MEASURED_GPUS and item.source == "benchmarks/results/gpu_check.json"
                assert (MEASURED_RUN.parents[2] / item.source).exists()
            else:
                assert item.kind is OverheadKind.DOCUMENTED
            assert SOURCE.match(item.source), item.source
            assert item.note and item.name
            assert 0 < item.low_bytes <= item.bytes <= item.high_bytes


def test_cublas_workspace_is_torchs_arithmetic():
    # aten/src/ATen/cuda/CublasHandlePool.cpp, parseChosenWorkspaceSize() (torch 2.13):
    #   default_size = use32mb ? 4096 * 8 * 1024 : 4096 * 1024 * 2 + 16 * 1024 * 8;
    #   use32mb = major == 9 || major == 10 || major == 12
    assert cublas_workspace_bytes((8, 0)) == 4096 * 1024 * 2 + 16 * 1024 * 8
    assert cublas_workspace_bytes((9, 0)) == 4096 * 8 * 1024
    assert cublas_workspace_bytes((7, 5)) == 4096 * 1024 * 2 + 16 * 1024 * 8
    # pytorch/pytorch#95668 saw exactly this many bytes stay allocated after one
    # nn.Linear forward on an A10G (compute capability 8.6).
    assert cublas_workspace_bytes((8, 6)) == 8_519_680
    assert cublas_workspace_bytes(None) == 32 * MIB  # unknown GPU: the larger size


def test_workspaces_differ_by_architecture_as_the_source_says():
    def workspaces(key):
        return cuda_overheads(GPUS[key]).allocator_items

    for key in ("t4", "l4", "a10", "rtx4090", "a100-40gb", "a100-80gb"):
        assert [w.bytes for w in workspaces(key)] == [8_519_680, 8_519_680], key
    for key in ("h100", "h200"):  # Hopper, compute capability 9.0
        assert [w.bytes for w in workspaces(key)] == [32 * MIB, 32 * MIB], key


def test_one_workspace_per_thread_inside_the_allocator_not_in_the_total():
    o = cuda_overheads(GPUS["h100"], ParallelPlan(4, Strategy.DDP))
    assert len(o.allocator_items) == 2  # main thread (forward) and autograd device thread (backward)
    assert all(w.placement is Placement.INSIDE_ALLOCATOR for w in o.allocator_items)
    assert all(i.placement is Placement.OUTSIDE_ALLOCATOR for i in o.items)
    assert o.allocator_bytes == 2 * 32 * MIB
    assert o.total_bytes == sum(i.bytes for i in o.items)  # no workspace in it
    assert not any("cuBLAS" in i.name for i in o.items)
    assert o.usable_capacity_bytes(GPUS["h100"].capacity_bytes) == GPUS["h100"].capacity_bytes - o.total_bytes


def test_one_gpu_has_no_nccl_and_several_do():
    for gpu, plan, o in all_overheads():
        nccl = [i for i in o.items if i.name.startswith("NCCL")]
        if plan.distributed:
            assert nccl, (gpu, plan)
            assert all(i.source == "https://github.com/NVIDIA/nccl/issues/964" for i in nccl)
        else:
            assert not nccl, (gpu, plan)


def test_nccl_figure_per_group_size_and_communicators_per_strategy():
    # NVIDIA/nccl#964 (4 x A100, NVLink): 544 MB for a 2-rank group, 688 MB for more ranks.
    def nccl(plan):
        return [i.bytes for i in cuda_overheads(GPUS["a100-80gb"], plan).items if i.name.startswith("NCCL")]

    assert nccl(ParallelPlan(2, Strategy.DDP)) == [544 * MIB]
    assert nccl(ParallelPlan(4, Strategy.DDP)) == [688 * MIB]
    assert nccl(ParallelPlan(8, Strategy.FSDP_FULL_SHARD)) == [688 * MIB]
    assert nccl(ParallelPlan(2, Strategy.ZERO3)) == [544 * MIB, 544 * MIB]  # default group + DeepSpeed's clone
    assert len(nccl_communicators(Strategy.SINGLE)) == 0
    for s in (Strategy.DDP, Strategy.FSDP_FULL_SHARD, Strategy.FSDP_SHARD_GRAD_OP):
        assert len(nccl_communicators(s)) == 1
    for s in (Strategy.ZERO1, Strategy.ZERO2, Strategy.ZERO3):
        assert len(nccl_communicators(s)) == 2


def test_context_is_the_upper_published_reading():
    # LMCache/LMCache#4019: ~616 MiB for a bare context; the lowest reading, 256 MiB on an
    # RTX 3090 (invoke-ai/InvokeAI#9413), bounds the range.
    for key, gpu in GPUS.items():
        if key in MEASURED_GPUS:
            continue
        (context,) = [i for i in cuda_overheads(gpu).items if i.name.startswith("CUDA context")]
        assert (context.bytes, context.low_bytes, context.high_bytes) == (616 * MIB, 256 * MIB, 616 * MIB), key


def test_a_measured_gpus_context_is_its_largest_after_a_step():
    """The H200's context, read from the committed GPU check: the largest after a run's steps
    (runs holding paged optimizer state excluded: their unified memory reads as context),
    ranging down to the context at a run's start."""
    run = measured_run()
    assert run["environment"]["gpu_name"] == "NVIDIA H200" and run["gpu"] == "h200"
    ok = [r for r in run["scenarios"] if r["status"] == "ok" and r["scenario"].get("optimizer") != "paged-adamw8bit"]
    after = max(r["measured"]["cuda_context_after_run_bytes"] for r in ok)
    start = min(r["measured"]["cuda_context_bytes"] for r in ok)
    (context,) = [i for i in cuda_overheads(GPUS["h200"]).items if i.name.startswith("CUDA context")]
    assert context.kind is OverheadKind.MEASURED
    assert (context.bytes, context.low_bytes, context.high_bytes) == (after, start, after)
    assert context.bytes > 616 * MIB  # a step's kernels loaded: above the published idle readings


def test_a_measured_gpus_driver_reservation_is_nvidia_smis_total_less_the_runtimes():
    run = measured_run()
    (item,) = [i for i in cuda_overheads(GPUS["h200"]).items if i.name.startswith("Driver")]
    assert item.kind is OverheadKind.MEASURED
    assert item.bytes == GPUS["h200"].capacity_bytes - run["probe"]["total_bytes"]


def test_h100_driver_reservation_is_the_gap_between_two_readings():
    # nvidia-smi memory.total 81559 MiB (vllm-project/vllm#55169) less cudaMemGetInfo's total,
    # printed as 79.22 GiB (vllm-project/vllm#12126), i.e. 79.215..79.225 GiB.
    (item,) = [i for i in cuda_overheads(GPUS["h100"]).items if i.name.startswith("Driver")]
    assert item.low_bytes == 81559 * MIB - int(79.225 * GIB)
    assert item.bytes == item.high_bytes == 81559 * MIB - int(79.215 * GIB)
    assert 432 * MIB < item.low_bytes < item.high_bytes < 443 * MIB
    for key in GPUS.keys() - {"h100"} - MEASURED_GPUS:  # no published or measured figure: not itemised
        assert not [i for i in cuda_overheads(GPUS[key]).items if i.name.startswith("Driver")], key


def test_single_gpu_totals():
    assert cuda_overheads(GPUS["a100-80gb"]).total_bytes == 616 * MIB
    h100 = cuda_overheads(GPUS["h100"], ParallelPlan(2, Strategy.DDP))
    assert h100.total_bytes == 616 * MIB + (81559 * MIB - int(79.215 * GIB)) + 544 * MIB
    assert cuda_overheads(None).total_bytes == 616 * MIB  # only a capacity known


def test_json_has_the_names_the_cli_will_print():
    j = cuda_overheads(GPUS["l4"], ParallelPlan(2, Strategy.DDP)).to_json()
    assert j["cuda_overhead_bytes"] == 616 * MIB + 544 * MIB
    assert [i["kind"] for i in j["cuda_overhead_items"]] == ["documented", "documented"]
    assert j["allocator_overhead_bytes"] == 2 * 8_519_680


def test_items_are_frozen_and_checked():
    item = cuda_overheads(GPUS["t4"]).items[0]
    with pytest.raises(dataclasses.FrozenInstanceError):
        item.bytes = 1
    good = {"name": "x", "bytes": 1, "source": "https://example.org", "kind": OverheadKind.DOCUMENTED}
    OverheadItem(**good)
    for bad in ({"bytes": 0}, {"bytes": -5}, {"bytes": 1.5}, {"bytes": True}, {"source": ""},
                {"source": "a report"}, {"name": " "}, {"low_bytes": 2}, {"high_bytes": 0}):
        with pytest.raises((ValueError, TypeError)):
            OverheadItem(**{**good, **bad})
    with pytest.raises(TypeError):
        OverheadItem(**{**good, "kind": "documented"})
    inside = OverheadItem(**good, placement=Placement.INSIDE_ALLOCATOR)
    with pytest.raises(ValueError):
        CudaOverheads(None, ParallelPlan(), (inside,), ())  # an allocator block among the outside items
    with pytest.raises(ValueError):
        CudaOverheads(None, ParallelPlan(), (), (OverheadItem(**good),))


def test_gpu_specs_carry_compute_capability():
    # NVIDIA's table, https://developer.nvidia.com/cuda-gpus
    expected = {"t4": (7, 5), "l4": (8, 9), "a10": (8, 6), "rtx4090": (8, 9), "a100-40gb": (8, 0),
                "a100-80gb": (8, 0), "h100": (9, 0), "h200": (9, 0),
                "rtx4060": (8, 9), "rtx3060": (8, 6), "rtx4060ti-16gb": (8, 9), "rtx4080": (8, 9),
                "rtx3090": (8, 6), "v100-16gb": (7, 0), "v100-32gb": (7, 0), "a6000": (8, 6), "l40s": (8, 9),
                "mi300x": None}  # ROCm: a gfx942, no CUDA compute capability
    assert {k: g.compute_capability for k, g in GPUS.items()} == expected
    plain = GpuSpec("x", "X", 1, 1.0, 1.0, 1.0, 1.0)  # built without one, as before
    assert plain.compute_capability is None
    for bad in ((9,), (9, -1), ("9", "0"), (0, 0), [9, 0], (True, 0)):
        with pytest.raises(ValueError):
            GpuSpec("x", "X", 1, 1.0, 1.0, 1.0, 1.0, compute_capability=bad)


def test_a_rocm_gpu_gets_cuda_figures_only_as_labelled_stand_ins():
    # The MI300X runs ROCm (HIP): no HIP context, hipBLASLt or RCCL figure is sourced, so every
    # item says it is CUDA's figure standing in; NVIDIA GPUs' items say nothing of the kind.
    mi300x = GPUS["mi300x"]
    assert mi300x.runtime is Runtime.ROCM and mi300x.compute_capability is None
    for plan in PLANS:
        o = cuda_overheads(mi300x, plan)
        for item in o.items + o.allocator_items:
            assert ROCM_STAND_IN in item.name and "runs ROCm" in item.name, item.name
            assert item.note.startswith("ROCm GPU: no ROCm figure is sourced"), item.note
    for key, gpu in GPUS.items():
        if gpu.runtime is Runtime.CUDA:
            o = cuda_overheads(gpu, ParallelPlan(2, Strategy.ZERO3))
            assert not [i for i in o.items + o.allocator_items if ROCM_STAND_IN in i.name], key
    with pytest.raises(ValueError):  # a compute capability is CUDA's
        GpuSpec("x", "X", 1, 1.0, 1.0, 1.0, 1.0, compute_capability=(9, 0), runtime=Runtime.ROCM)


def test_every_gpu_row_says_where_its_capacity_comes_from():
    # Rows added for issue 14 name their source; a datasheet figure says it is one.
    first_rows = {"t4", "l4", "a10", "a100-40gb", "a100-80gb", "h200"}  # readings not recorded with them
    for key, gpu in GPUS.items():
        if key not in first_rows:
            assert gpu.capacity_source, key
        if gpu.capacity_from_datasheet:
            assert "datasheet" in gpu.capacity_basis and "datasheet" in gpu.capacity_source, key
        else:
            assert "reports it" in gpu.capacity_basis, key
        assert gpu.capacity_bytes % MIB == 0, key  # the drivers report whole MiB
    assert [k for k, g in GPUS.items() if g.capacity_from_datasheet] == ["rtx4060ti-16gb"]
    assert GPUS["mi300x"].capacity_bytes == 206_141_652_992  # rocm-smi's VRAM Total Memory
    with pytest.raises(ValueError):
        GpuSpec("x", "X", 1, 1.0, 1.0, 1.0, 1.0, capacity_from_datasheet=True)  # which datasheet?
