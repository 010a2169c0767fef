"""Fixed CUDA overheads a training process has on each GPU, itemised, each figure with its
source: the CUDA context, the driver's reserved memory, the cuBLAS/cuBLASLt workspaces and,
on several GPUs, NCCL's communicator buffers.

Two kinds of item, kept apart so nothing is counted twice:
- `CudaOverheads.items`: memory outside PyTorch's caching allocator. `memory_reserved()`
  never sees it; `nvidia-smi` does. `total_bytes` sums these, and
  `usable_capacity_bytes(capacity)` is what is left of the driver's total for the
  allocator's reserved memory.
- `CudaOverheads.allocator_items`: persistent blocks that torch itself requests from the
  caching allocator (the cuBLAS workspaces). They are inside reserved memory (and inside
  `memory_allocated()`), so they are NOT subtracted from the capacity; but the probe's
  trace of a step (CPU or fake tensors) has no such blocks, so a replay of the allocator
  must add them as allocations that live for the whole run.

What does not change the figures, and so is not an input: the precision (no item depends
on a dtype) and the engine (Trainer and the Accelerate loop both run the forward on the
main thread and the backward on the autograd engine's device thread, on one stream, and
both create their process groups through Accelerate). What does: the GPU (its compute
capability, for the cuBLAS workspace; its model, for the driver's reservation), the
number of ranks and the strategy (NCCL communicators).

Items are DOCUMENTED (documentation, source code, or a published report) except where
benchmarks/gpu_check.sh has measured them on that GPU: MEASURED, the H200's context and
driver reservation (2026-12-04). docs/cuda_overheads.md tables every item.

Known limitations:
- The CUDA context grows as lazy loading (CUDA_MODULE_LOADING=LAZY, torch's default since
  1.13, CUDA's own since 12.2) loads the modules a step uses; the published figures are
  for an idle context after initialisation, so the upper report is taken.
- NCCL's memory depends on the NCCL version, the channels it picks for the links
  (NVLink, PCIe, network), the algorithms a run uses and NCCL_BUFFSIZE; the figures are
  published totals per communicator, not derived from NCCL's allocation code.
- A later CublasHandlePool.cpp than torch 2.13's (with TORCH_CUBLAS_WORKSPACE_CACHE, not
  in 2.13's headers) makes workspace caching opt-in; without it cuBLAS uses its own
  default workspace, allocated outside the caching allocator. The items follow torch 2.13
  (the version read is the one whose declarations match 2.13's ATen/cuda/CUDAContextLight.h).
- A ROCm GPU (planner.gpus.Runtime.ROCM: the MI300X) gets CUDA's figures as stand-ins,
  each item labelled so in its name and note: no HIP context, hipBLASLt workspace or RCCL
  reading is sourced here, and the CUDA figures are not claimed for it.
- The driver's reservation is known for the H100 80 GB only (from two published readings);
  for the other GPUs it is not itemised (no published figure), and the capacity is the
  driver's total as `nvidia-smi` reports it (planner.gpus).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, replace

from planner.gpus import GpuSpec, Runtime
from planner.strategy import ParallelPlan, Strategy
from planner.units import GIB, KIB, MIB

TORCH_CUBLAS_SOURCE = ("https://github.com/pytorch/pytorch/blob/main/aten/src/ATen/cuda/CublasHandlePool.cpp"
                       " (parseChosenWorkspaceSize, getCUDABlasLtWorkspace)")


class OverheadKind(enum.Enum):
    MEASURED = "measured"  # measured on a GPU by this project
    DOCUMENTED = "documented"  # documentation, source code or a published report


class Placement(enum.Enum):
    OUTSIDE_ALLOCATOR = "outside the caching allocator"  # nvidia-smi sees it, memory_reserved() does not
    INSIDE_ALLOCATOR = "inside the caching allocator's reserved memory"


@dataclass(frozen=True)
class OverheadItem:
    """One fixed overhead on one GPU: `bytes` is the figure used, `low_bytes`..`high_bytes`
    the range the sources give (equal when the figure is exact arithmetic from code)."""

    name: str
    bytes: int
    source: str  # a URL or a source path, naming where the figure comes from
    kind: OverheadKind
    placement: Placement = Placement.OUTSIDE_ALLOCATOR
    low_bytes: int | None = None  # None: the same as `bytes`
    high_bytes: int | None = None
    note: str = ""  # why this figure (which report, which rule)

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name.strip():
            raise ValueError("OverheadItem.name must be non-empty text")
        if isinstance(self.bytes, bool) or not isinstance(self.bytes, int) or self.bytes <= 0:
            raise ValueError(f"OverheadItem.bytes must be a positive integer, got {self.bytes!r}")
        if not isinstance(self.source, str) or (not self.source.startswith(("https://", "http://"))
                                                and "/" not in self.source):
            raise ValueError(f"OverheadItem.source must be a URL or a source path, got {self.source!r}")
        if not isinstance(self.kind, OverheadKind) or not isinstance(self.placement, Placement):
            raise TypeError("OverheadItem.kind and .placement must be enum members")
        low = self.bytes if self.low_bytes is None else self.low_bytes
        high = self.bytes if self.high_bytes is None else self.high_bytes
        if not 0 < low <= self.bytes <= high:
            raise ValueError(f"OverheadItem {self.name!r}: need 0 < low <= bytes <= high, got {low}, "
                             f"{self.bytes}, {high}")
        object.__setattr__(self, "low_bytes", low)
        object.__setattr__(self, "high_bytes", high)

    def to_json(self) -> dict:
        return {"name": self.name, "bytes": self.bytes, "low_bytes": self.low_bytes,
                "high_bytes": self.high_bytes, "source": self.source, "kind": self.kind.value,
                "placement": self.placement.value, "note": self.note}


@dataclass(frozen=True)
class CudaOverheads:
    gpu_key: str | None  # planner.gpus key, None when only a capacity was given
    plan: ParallelPlan
    items: tuple[OverheadItem, ...]  # outside the caching allocator, on each GPU
    allocator_items: tuple[OverheadItem, ...]  # persistent blocks inside reserved memory

    def __post_init__(self) -> None:
        if any(i.placement is not Placement.OUTSIDE_ALLOCATOR for i in self.items):
            raise ValueError("CudaOverheads.items holds only memory outside the caching allocator")
        if any(i.placement is not Placement.INSIDE_ALLOCATOR for i in self.allocator_items):
            raise ValueError("CudaOverheads.allocator_items holds only blocks inside the caching allocator")

    @property
    def total_bytes(self) -> int:
        """Bytes on each GPU beyond the caching allocator's reserved memory."""
        return sum(i.bytes for i in self.items)

    @property
    def allocator_bytes(self) -> int:
        """Bytes torch itself keeps allocated through the caching allocator (already part of
        reserved memory once a replay adds them; never add them to `total_bytes`)."""
        return sum(i.bytes for i in self.allocator_items)

    def usable_capacity_bytes(self, capacity_bytes: int) -> int:
        """What the caching allocator can reserve on a GPU whose driver reports
        `capacity_bytes` (nvidia-smi's memory.total): the capacity less the items outside it.
        Negative when the overheads alone do not fit."""
        return capacity_bytes - self.total_bytes

    def to_json(self) -> dict:
        return {"cuda_overhead_bytes": self.total_bytes,
                "cuda_overhead_items": [i.to_json() for i in self.items],
                "allocator_overhead_bytes": self.allocator_bytes,
                "allocator_overhead_items": [i.to_json() for i in self.allocator_items]}


# --- The CUDA context ------------------------------------------------------------------
# Idle context after initialisation, with lazy loading (torch sets CUDA_MODULE_LOADING=LAZY
# when unset since 1.13, pytorch/pytorch#86509; CUDA's default on Linux since 12.2,
# https://docs.nvidia.com/cuda/cuda-programming-guide/04-special-topics/lazy-loading.html).
# Published readings (nvidia-smi or cudaMemGetInfo of a process holding nothing else):
#   256 MiB  RTX 3090, torch 2.7.1+cu128          https://github.com/invoke-ai/InvokeAI/issues/9413
#   ~300 MB  ptrblck (NVIDIA), lazy loading         https://github.com/pytorch/pytorch/issues/107667
#   ~400 MB  ptrblck (NVIDIA), CUDA >= 11.7 lazy    https://github.com/pytorch/pytorch/issues/109888
#   426 MiB  RTX 6000 Ada, torch 2.10+cu130         https://github.com/unslothai/unsloth-zoo/pull/1053
#   616 MiB  a bare context on cuda:0 (GPU not named) https://github.com/LMCache/LMCache/issues/4019
# Of planner.gpus' rows only the RTX 3090 is named by a report (256 MiB, idle), and the
# context grows during a step as lazy loading brings in the kernels used, so every GPU gets
# the upper report: a "fits" verdict must not be optimistic. The range keeps the lowest report.
CONTEXT_BYTES = 616 * MIB
CONTEXT_LOW_BYTES = 256 * MIB
CONTEXT_SOURCE = "https://github.com/LMCache/LMCache/issues/4019"


CONTEXT_READINGS_BY_GPU = {"rtx3090": "256 MiB idle on this GPU (invoke-ai/InvokeAI#9413)"}

# Measured by this project (benchmarks/gpu_check.sh; benchmarks/results/gpu_check.json): the
# context as torch.cuda.mem_get_info's total less its free less memory_reserved(), at a run's
# start and after its three training steps. On an H200 (driver 580.159.04, torch
# 2.11.0+cu130, CUDA 13.0, 2026-12-04): 552,402,944 B at every start, at most 804,061,184 B
# after the 15 runs that hold no unified memory (the paged 8-bit AdamW run read 2.68 GB, its
# paged state counted in). The figure is the largest after a step: lazy loading has brought
# in the step's kernels by then.
MEASURED_CONTEXT_BY_GPU: dict[str, tuple[int, int, str]] = {
    "h200": (804_061_184, 552_402_944, "H200, driver 580.159.04, torch 2.11.0+cu130: 552,402,944 B at a run's "
                                       "start, at most 804,061,184 B after three training steps (15 runs)"),
}
MEASURED_SOURCE = "benchmarks/results/gpu_check.json"


def _context_item(gpu: GpuSpec | None = None) -> OverheadItem:
    if gpu is not None and gpu.key in MEASURED_CONTEXT_BY_GPU:
        after_steps, at_start, reading = MEASURED_CONTEXT_BY_GPU[gpu.key]
        return OverheadItem("CUDA context (lazy module loading)", after_steps, MEASURED_SOURCE,
                            OverheadKind.MEASURED, low_bytes=at_start, high_bytes=after_steps,
                            note=f"measured by benchmarks/gpu_check.sh on this GPU ({reading}); the figure is "
                                 "the context after the steps, their kernels loaded")
    named = CONTEXT_READINGS_BY_GPU.get(gpu.key) if gpu is not None else None
    this_gpu = (f"one report names this GPU, {named}, but" if named is not None
                else "no report names this GPU, and")
    return OverheadItem(
        "CUDA context (lazy module loading)", CONTEXT_BYTES, CONTEXT_SOURCE, OverheadKind.DOCUMENTED,
        low_bytes=CONTEXT_LOW_BYTES, high_bytes=CONTEXT_BYTES,
        note="upper published reading of an idle context (256 MiB RTX 3090, invoke-ai/InvokeAI#9413; "
             "~300-400 MB, pytorch/pytorch#107667 and #109888; 426 MiB RTX 6000 Ada, "
             f"unslothai/unsloth-zoo#1053; 616 MiB, LMCache/LMCache#4019); {this_gpu} "
             "lazy loading adds the kernels a step uses")


# --- Memory the driver keeps for itself ------------------------------------------------
# NVML: `reserved` is "device memory reserved for system use (driver or firmware)"
# (https://docs.nvidia.com/deploy/nvml-api/structnvmlMemory__v2__t.html). On the H100 80 GB
# HBM3, nvidia-smi's memory.total reads 81559 MiB (vllm-project/vllm#55169, as planner.gpus)
# while cudaMemGetInfo's total, what the CUDA runtime will hand out, reads 79.22 GiB
# (vllm-project/vllm#12126, "H100-80G"; printed to 0.01 GiB, so +-5.12 MiB).
_H100_SMI_TOTAL_BYTES = 81559 * MIB
_H100_CUDA_TOTAL_CENTI_GIB = 7922  # 79.22 GiB, printed to 0.01 GiB


def _reserved_range(smi_total_bytes: int, cuda_total_centi_gib: int) -> tuple[int, int, int]:
    """(figure, low, high) of nvidia-smi's total less the CUDA runtime's, the latter read to
    0.01 GiB; the figure is the high end (the runtime's total can be that much lower)."""
    low = smi_total_bytes - (cuda_total_centi_gib * GIB + GIB // 2) // 100
    high = smi_total_bytes - (cuda_total_centi_gib * GIB - GIB // 2) // 100
    return high, low, high


DRIVER_RESERVED_BYTES: dict[str, tuple[int, int, int]] = {
    "h100": _reserved_range(_H100_SMI_TOTAL_BYTES, _H100_CUDA_TOTAL_CENTI_GIB),
}
DRIVER_RESERVED_SOURCE = "https://github.com/vllm-project/vllm/pull/12126"


# Measured by this project: nvidia-smi's memory.total less torch.cuda.mem_get_info's total
# (benchmarks/results/gpu_check.json: `total_bytes` of the probe against planner.gpus'
# capacity, which is nvidia-smi's figure). H200: 143,771 MiB less 150,109,880,320 B.
MEASURED_DRIVER_RESERVED_BYTES: dict[str, tuple[int, str]] = {
    "h200": (143771 * MIB - 150_109_880_320, "H200, driver 580.159.04: nvidia-smi memory.total 143,771 MiB, "
                                            "cudaMemGetInfo total 150,109,880,320 B"),
}


def _driver_item(gpu: GpuSpec | None) -> OverheadItem | None:
    if gpu is not None and gpu.key in MEASURED_DRIVER_RESERVED_BYTES:
        figure, reading = MEASURED_DRIVER_RESERVED_BYTES[gpu.key]
        return OverheadItem(
            "Driver and firmware reservation (nvidia-smi total less the CUDA runtime's total)", figure,
            MEASURED_SOURCE, OverheadKind.MEASURED, note=f"measured by benchmarks/gpu_check.sh ({reading})")
    if gpu is None or gpu.key not in DRIVER_RESERVED_BYTES:
        return None  # no published figure: not itemised
    figure, low, high = DRIVER_RESERVED_BYTES[gpu.key]
    return OverheadItem(
        "Driver and firmware reservation (nvidia-smi total less the CUDA runtime's total)", figure,
        DRIVER_RESERVED_SOURCE, OverheadKind.DOCUMENTED, low_bytes=low, high_bytes=high,
        note="nvidia-smi memory.total 81559 MiB (vllm-project/vllm#55169) less cudaMemGetInfo total "
             "79.22 GiB (vllm-project/vllm#12126), the upper end of the rounding")


# --- cuBLAS / cuBLASLt workspaces ------------------------------------------------------
# torch 2.13, aten/src/ATen/cuda/CublasHandlePool.cpp, parseChosenWorkspaceSize():
#   /* :4096:2:16:8 default, 32MiB for Hopper and Blackwell */
#   use32mb = properties->major == 9 || properties->major == 10 || properties->major == 12;
#   default_size = use32mb ? 4096 * 8 * 1024 : 4096 * 1024 * 2 + 16 * 1024 * 8;
# (CUBLAS_WORKSPACE_CONFIG overrides it; not modelled.) The workspace is
# `CUDACachingAllocator::get()->allocate(getChosenWorkspaceSize())`: a block in the
# caching allocator, kept in a map keyed by (cuBLAS handle, stream) for the life of the
# process. cuBLASLt shares it: unless TORCH_CUBLASLT_UNIFIED_WORKSPACE=0 the Lt workspace
# is the cuBLAS one of the same (handle, stream). pytorch/pytorch#95668 saw exactly
# 8,519,680 B stay allocated after one nn.Linear forward on an A10G.
CUBLAS_32MIB_MAJORS = frozenset({9, 10, 12})
CUBLAS_DEFAULT_BYTES = 4096 * KIB * 2 + 16 * KIB * 8  # 8 MiB + 128 KiB = 8,519,680 B
CUBLAS_32MIB_BYTES = 4096 * 8 * KIB  # 32 MiB
# Handles come from a per-thread pool (aten/src/ATen/cuda/detail/DeviceThreadHandles.h:
# "one handle per host thread"), and the autograd engine runs a device's backward on its own
# thread ("a thread per CUDA device", torch/csrc/autograd/engine.cpp, Note [Allocating GPUs
# to autograd threads]). Forward and backward use one stream, the current one. So a step
# uses two (handle, stream) keys (two workspaces also with per-thread workspace maps,
# pytorch/pytorch#180283): the main thread's (forward, loss, recomputation outside
# autograd) and the autograd device thread's (backward, with checkpointing's recompute).
# The optimizer step (foreach/fused kernels), DDP's reducer and FSDP's collectives call no
# cuBLAS routine.
CUBLAS_WORKSPACES_PER_STEP = 2


def cublas_workspace_bytes(compute_capability: tuple[int, int] | None) -> int:
    """One cuBLAS workspace as torch 2.13 sizes it; an unknown GPU gets the larger size."""
    if compute_capability is None or compute_capability[0] in CUBLAS_32MIB_MAJORS:
        return CUBLAS_32MIB_BYTES
    return CUBLAS_DEFAULT_BYTES


def _cublas_items(gpu: GpuSpec | None) -> tuple[OverheadItem, ...]:
    cc = gpu.compute_capability if gpu is not None else None
    size = cublas_workspace_bytes(cc)
    which = (("GPU not known" if gpu is None else f"{gpu.label}: no CUDA compute capability") + ": the larger size"
             if cc is None
             else f"compute capability {cc[0]}.{cc[1]}: "
                  + ("32 MiB" if cc[0] in CUBLAS_32MIB_MAJORS else "8 MiB + 128 KiB"))
    threads = ("main thread (forward)", "autograd device thread (backward)")
    return tuple(OverheadItem(f"cuBLAS/cuBLASLt workspace, {thread}", size, TORCH_CUBLAS_SOURCE,
                              OverheadKind.DOCUMENTED, Placement.INSIDE_ALLOCATOR,
                              note=f"{which}; one per (handle, stream), allocated through the caching "
                                   "allocator at the first matmul and never freed")
                 for thread in threads[:CUBLAS_WORKSPACES_PER_STEP])


# --- NCCL ------------------------------------------------------------------------------
# Per communicator, the rise in GPU memory once it is created and has run a collective
# (NCCL's buffers: NCCL_BUFFSIZE, 4 MiB by default, per channel, peer and protocol, and its
# kernels loaded into the context). NCCL allocates them itself (cuMem*/cudaMalloc), outside
# PyTorch's caching allocator. Published readings:
#   544 MB  A100 x4 NVLink, torch, a 2-rank group after a 4 MB all-reduce
#   688 MB  the same, a group of 3 or 4 ranks          https://github.com/NVIDIA/nccl/issues/964
# Cross-checks, not used as figures: on 8 x H100, context plus NCCL read 1.06 GB before the
# first all-to-all, PyTorch's memory excluded (NVIDIA/nccl#1685), below the context item
# plus one 688 MB communicator here; "about 1.6GB" with one communicator after an all-reduce
# (NVIDIA/nccl#864, GPU not named) is a whole process's reading, context included. NCCL's
# maintainer (in #864, quoted in NVIDIA/nccl#986): memory is linear in the channels, which
# grow with link bandwidth, and a ring has 2 connections at any scale. "MB" is read as MiB
# (nvidia-smi's unit), the larger reading.
NCCL_TWO_RANKS_BYTES = 544 * MIB
NCCL_MORE_RANKS_BYTES = 688 * MIB
NCCL_SOURCE = "https://github.com/NVIDIA/nccl/issues/964"


def nccl_communicator_bytes(num_ranks: int) -> int:
    """One NCCL communicator spanning `num_ranks` GPUs, as NVIDIA/nccl#964 reads it."""
    return NCCL_TWO_RANKS_BYTES if num_ranks == 2 else NCCL_MORE_RANKS_BYTES


def nccl_communicators(strategy: Strategy) -> tuple[str, ...]:
    """The NCCL communicators each rank holds under `strategy` (one per process group that
    runs a collective; ProcessGroupNCCL creates a group's communicator at its first one).
    - ddp: the default group (DistributedDataParallel(process_group=None); Accelerate's
      barriers use it too).
    - fsdp: the default group: fully_shard without a mesh (Accelerate passes none without a
      parallelism config) builds a 1-D mesh over the world, and DeviceMesh reuses the
      default group for it (torch/distributed/device_mesh.py, _init_process_groups).
    - zero1/2/3: DeepSpeed runs its data-parallel collectives on a clone of the world group
      (deepspeed/utils/groups.py, _clone_world_group: dist.new_group(ranks=range(world)))
      while Accelerate's wait_for_everyone() barriers, DEEPSPEED included, run on the
      default group (accelerate/state.py, wait_for_everyone): two.
    """
    if strategy is Strategy.SINGLE:
        return ()
    if strategy in (Strategy.ZERO1, Strategy.ZERO2, Strategy.ZERO3):
        return ("default process group", "DeepSpeed's clone of the world group")
    return ("default process group",)


def _nccl_items(plan: ParallelPlan) -> tuple[OverheadItem, ...]:
    size = nccl_communicator_bytes(plan.num_devices)
    why = ("A100 NVLink, 2-rank group: 544 MB" if plan.num_devices == 2
           else "A100 NVLink, group of more than 2 ranks: 688 MB") + " (NVIDIA/nccl#964); no report per GPU model"
    return tuple(OverheadItem(f"NCCL communicator, {group} ({plan.num_devices} ranks)", size, NCCL_SOURCE,
                              OverheadKind.DOCUMENTED, low_bytes=NCCL_TWO_RANKS_BYTES,
                              high_bytes=NCCL_MORE_RANKS_BYTES, note=why)
                 for group in nccl_communicators(plan.strategy))


def cuda_overheads(gpu: GpuSpec | None, plan: ParallelPlan | None = None) -> CudaOverheads:
    """The fixed overheads on each GPU of a training run of `plan` (default: one GPU) on
    `gpu` (None: only a capacity is known, and every figure takes its larger value).

    Not items, and why: DDP's gradient buckets and DeepSpeed's reduce bucket are tensors in
    the caching allocator, already in planner.parallel's `communication_buffers`; cuDNN,
    flash and memory-efficient attention workspaces are per-call tensors from the caching
    allocator (kernel paths, not fixed overheads); CUDA graph pools are not used by the
    Trainer or the Accelerate loop; the allocator's segment rounding and expandable
    segments belong to the allocator's replay."""
    plan = plan if plan is not None else ParallelPlan()
    outside = [_context_item(gpu)]
    driver = _driver_item(gpu)
    if driver is not None:
        outside.append(driver)
    outside.extend(_nccl_items(plan))
    inside = _cublas_items(gpu)
    if gpu is not None and gpu.runtime is not Runtime.CUDA:
        outside, inside = [_stand_in(i, gpu) for i in outside], tuple(_stand_in(i, gpu) for i in inside)
    return CudaOverheads(gpu.key if gpu is not None else None, plan, tuple(outside), inside)


ROCM_STAND_IN = "CUDA's figure standing in"


def _stand_in(item: OverheadItem, gpu: GpuSpec) -> OverheadItem:
    """`item` labelled as CUDA's figure used for a GPU that does not run CUDA (ROCm's HIP
    context, hipBLASLt workspace and RCCL communicators have no sourced figure here)."""
    runtime = _RUNTIME_NAMES[gpu.runtime]
    return replace(item, name=f"{item.name} ({ROCM_STAND_IN}: {gpu.label} runs {runtime})",
                   note=f"{runtime} GPU: no {runtime} figure is sourced, so CUDA's stands in, unverified "
                        f"for it; {item.note}")


_RUNTIME_NAMES = {Runtime.CUDA: "CUDA", Runtime.ROCM: "ROCm"}
