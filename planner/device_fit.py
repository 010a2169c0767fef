"""Does a plan fit one GPU as the driver sees it: the verdict with the caching allocator
replayed on the plan's own step where it can be (planner.reserved), and the same test for
the fit searches, so that a plan they propose is one this verdict passes.

The replay needs the step's allocation trace, which a probe on CUDA's kernels keeps
(planner.probe.cache), of one GPU's step: it is run for single-GPU plans on CUDA (full
fine-tuning, LoRA, QLoRA) and for each rank of a DDP plan, local SGD included: a DDP rank
runs the single-GPU step on its own micro-batch and holds DDP's gradient buckets besides
(planner.parallel.ddp_buckets), allocated when the model is wrapped, after its weights and
before the first matmul; gradients are copied into them (`gradient_as_bucket_view=False`),
so the step's own allocations are the single GPU's. It is given the usable capacity (the
driver's total less what lives outside the allocator), so, as torch does, it releases
cached blocks and retries before it runs out of memory; a plan fits when it never does.
Elsewhere (ZeRO and FSDP, whose ranks gather and free parameter shards per unit, which no
single-GPU trace holds) the verdict compares the allocated peak and says that the
allocator's slack is not in it, and why.

Known limitations: DDP rebuilds its buckets in the order gradients first became ready, at
the second step's forward (reducer.cpp `rebuild_buckets`); they are replayed as allocated
once, in reverse parameter order, which is also the order the per-rank estimate counts.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from planner.attention_scratch import DEFAULT_BUILD, CudaBuild
from planner.cuda_allocator import ReplayResult
from planner.errors import PlannerInputError
from planner.estimate import Estimate, Phase, estimate
from planner.gpus import GpuSpec
from planner.kernel_target import KernelTarget
from planner.model_shape import ModelShape
from planner.parallel import ParallelEstimate, parallel_estimate
from planner.probe.cache import kernel_class
from planner.reserved import replayed_step
from planner.scenario import CudaSegments, Device, Scenario
from planner.strategy import ParallelPlan, Strategy
from planner.verdict import DeviceVerdict, device_overheads

MULTI_GPU_NOT_REPLAYED = ("it is replayed for single-GPU and DDP plans only (a sharded strategy's ranks gather "
                          "and free parameter shards per unit, which the probe's single-GPU trace does not hold)")


def plan_verdict(shape: ModelShape, result: Estimate | ParallelEstimate, capacity_bytes: int,
                 gpu: GpuSpec | None, plan: ParallelPlan | None = None, figures: bool = True,
                 build: CudaBuild = DEFAULT_BUILD) -> DeviceVerdict:
    """The verdict on one GPU of capacity `capacity_bytes` (the driver's total), with the
    overheads of `gpu` (None: a custom size, their larger figures) under `plan`, torch's CUDA
    `build` choosing the attention kernels (planner.attention_scratch). `figures`
    False: only whether it fits is wanted (the fit searches), so a plan that runs out of memory
    within the capacity is not replayed again without a bound for the reserved peak to show."""
    return _verdict_and_replay(shape, result, capacity_bytes, gpu, plan, figures, build)[0]


def _check_kernels(scenario: Scenario, gpu: GpuSpec | None) -> None:
    """A CUDA plan is judged on the GPU whose kernels it was estimated with (planner.probe.cache
    kernel_class): SDPA keeps other tensors on other GPUs (a T4's math path)."""
    if gpu is None or scenario.device is not Device.CUDA:
        return
    planned, judged = kernel_class(scenario.compute_capability), kernel_class(gpu.compute_capability)
    if planned != judged:
        raise ValueError(f"the plan was estimated with {planned}'s kernels and is judged on a {gpu.label} ({judged}'s): "
                         "estimate it with planner.gpus.scenario_on(scenario, gpu)")


def _verdict_and_replay(shape: ModelShape, result: Estimate | ParallelEstimate, capacity_bytes: int,
                        gpu: GpuSpec | None, plan: ParallelPlan | None, figures: bool,
                        build: CudaBuild = DEFAULT_BUILD) -> tuple[DeviceVerdict, ReplayResult | None]:
    """plan_verdict's verdict, and the replay within the usable capacity it rests on (None: not replayed)."""
    single = result.base if isinstance(result, ParallelEstimate) else result
    _check_kernels(single.scenario, gpu)
    peak = result.per_device_peak_bytes if isinstance(result, ParallelEstimate) else result.peak_bytes
    overheads = device_overheads(single.scenario.device, gpu, plan)
    if overheads is None:
        return DeviceVerdict(peak, capacity_bytes, None), None
    if plan is not None and plan.distributed and plan.strategy is not Strategy.DDP:
        return DeviceVerdict(peak, capacity_bytes, overheads, reserved_not_replayed=MULTI_GPU_NOT_REPLAYED), None
    buckets = tuple(result.ddp_bucket_bytes if isinstance(result, ParallelEstimate) else ())
    workspaces = tuple(item.bytes for item in overheads.allocator_items)  # the cuBLAS workspaces, per thread
    usable = overheads.usable_capacity_bytes(capacity_bytes)
    kernels = KernelTarget(gpu.compute_capability, build, gpu.multiprocessors) if gpu is not None \
        else KernelTarget(build=build)
    within = replayed_step(shape, single, buckets, capacity_bytes=max(usable, 0), cublas_workspaces=workspaces,
                           kernels=kernels)
    if isinstance(within, str):
        # The step's kernel workspaces are the allocator's, not in the live tensors' peak: the
        # replay would have made them (planner.adafactor_cuda). A DDP rank's buckets are there
        # in every phase.
        step = next(p for p in single.phases if p.phase is Phase.OPTIMIZER_STEP)
        excess = max(0, step.total + single.step_workspace_bytes - single.peak_bytes)
        return DeviceVerdict(peak, capacity_bytes, overheads, reserved_not_replayed=within,
                             step_workspace_excess_bytes=excess), None
    expandable = single.scenario.cuda_segments is CudaSegments.EXPANDABLE
    if not within.out_of_memory:
        return DeviceVerdict(peak, capacity_bytes, overheads, reserved_peak_bytes=within.peak_reserved_bytes,
                             expandable_segments=expandable,
                             replayed_allocated_peak_bytes=within.peak_allocated_bytes), within
    if not figures:
        return DeviceVerdict(peak, capacity_bytes, overheads, replay_out_of_memory=True,
                             expandable_segments=expandable), within
    unbounded = replayed_step(shape, single, buckets, cublas_workspaces=workspaces,  # with room to spare
                              kernels=kernels)
    return DeviceVerdict(peak, capacity_bytes, overheads, reserved_peak_bytes=unbounded.peak_reserved_bytes,
                         replay_out_of_memory=True, expandable_segments=expandable,
                         replayed_allocated_peak_bytes=unbounded.peak_allocated_bytes), within


@dataclasses.dataclass(frozen=True)
class Headroom:
    """A fit search's test of one plan: whether the verdict passes it, and by how much
    (`bytes`: what is left at its tightest, negative when short by that much; None when not
    measured). Its truth value is `fits`."""

    fits: bool
    bytes: int | None = None

    def __bool__(self) -> bool:
        return self.fits


FitsCheck = Callable[[ModelShape, Scenario, ParallelPlan | None], Headroom]


def reserved_check(capacity_bytes: int, device: Device, gpu: GpuSpec | None,
                   build: CudaBuild = DEFAULT_BUILD) -> FitsCheck | None:
    """For the fit searches, which find the largest plan whose live tensors fit the room the
    overheads leave (planner.verdict.tensor_budget_bytes): whether the verdict, replayed,
    passes it too, with the replay's headroom (planner.cuda_allocator, Headroom) or, where
    nothing is replayed, the verdict's margin, to guide the search. None on CPU, where the
    two are the same test. `build`: the torch CUDA build whose attention kernels are replayed."""
    if device is not Device.CUDA:
        return None

    def passes(shape: ModelShape, scenario: Scenario, plan: ParallelPlan | None = None) -> Headroom:
        if plan is not None and plan.distributed and plan.strategy is not Strategy.DDP:
            return Headroom(True)  # not replayed: the live-tensor test the search made is the verdict's
        try:
            result = estimate(shape, scenario)
            if plan is not None and plan.distributed:
                result = parallel_estimate(shape, scenario, plan, base=result)
        except PlannerInputError:
            return Headroom(False)
        verdict, within = _verdict_and_replay(shape, result, capacity_bytes, gpu, plan, False, build)
        if within is None:  # the verdict's own figures: its margin is exact
            return Headroom(verdict.fits, verdict.margin_bytes)
        return Headroom(verdict.fits, within.headroom_bytes)

    return passes
