"""Fits or does not fit, on what the driver sees: the peak of live tensors, the blocks torch
itself keeps in the caching allocator, the allocator's reserved memory where it is replayed,
and the fixed CUDA overheads outside it, against the capacity the driver reports.

On CUDA (planner.cuda_overheads):
  usable capacity = the driver's total - what lives outside the caching allocator
                    (CUDA context, the driver's own reservation, NCCL communicators)
  allocated peak  = the step's live-tensor peak (planner.estimate) + torch's persistent
                    allocator blocks (the cuBLAS workspaces, one per thread that runs matmuls);
                    where the allocator is replayed, the replay's max_memory_allocated: the
                    same tensors in the blocks the allocator hands out (512-byte multiples, and
                    without expandable segments a cached block up to 1 MiB larger than asked
                    when its remainder is too small to split: 1-2% of a step, measured on an H200)
  required        = the reserved peak when the allocator is replayed on the step's trace
                    (planner.device_fit, planner.reserved), else the allocated peak: then the
                    verdict says that the caching allocator's slack above it is not in the figure
  fits            = required <= usable capacity, and a replay given the usable capacity
                    does not run out of memory (it releases its cache and retries first)
On CPU there is no caching allocator or context: required = the peak, usable = the capacity.

`tensor_budget_bytes` is what the live tensors may take for the verdict to hold: the fit
searches (largest batch, sequence, the fit finder) compare peaks with it, so a plan they
propose is one this verdict passes.
"""

from __future__ import annotations

from dataclasses import dataclass

from planner.cuda_overheads import CudaOverheads, cuda_overheads
from planner.errors import PlannerInputError
from planner.gpus import GpuSpec
from planner.scenario import Device
from planner.strategy import ParallelPlan
from planner.units import bytes_to_gib, format_bytes

RESERVED_NOT_IN_FIGURE = "the caching allocator's reserved memory above the allocated peak is not in this figure"
RESERVED_NOT_REPLAYED = (f"{RESERVED_NOT_IN_FIGURE}: its replay needs the plan's step on one GPU, probed on CUDA's "
                         "kernels (planner.device_fit)")


@dataclass(frozen=True)
class DeviceVerdict:
    peak_bytes: int  # live tensors at the step's peak, on one device
    capacity_bytes: int  # the device's total as the driver reports it (nvidia-smi memory.total)
    overheads: CudaOverheads | None  # None on CPU
    reserved_peak_bytes: int | None = None  # the allocator replay's max_memory_reserved; None: not replayed
    reserved_not_replayed: str | None = None  # why there is no replay, in words (None: the general reason)
    replay_out_of_memory: bool = False  # the replay, given the usable capacity, ran out of memory
    expandable_segments: bool = False  # the replay's PYTORCH_CUDA_ALLOC_CONF (planner.scenario.CudaSegments)
    replayed_allocated_peak_bytes: int | None = None  # the replay's max_memory_allocated; None: not replayed
    # Not replayed: what the optimizer step's kernel workspaces lift the allocated peak above the
    # live tensors' (planner.estimate.Estimate.step_workspace_bytes); a replay makes them itself.
    step_workspace_excess_bytes: int = 0

    def __post_init__(self) -> None:
        if self.peak_bytes < 0 or self.capacity_bytes <= 0:
            raise ValueError("DeviceVerdict needs a peak >= 0 and a positive capacity")
        if self.step_workspace_excess_bytes and self.replayed_allocated_peak_bytes is not None:
            raise ValueError("a replayed verdict makes the step's workspaces itself: no excess to add")
        if self.reserved_peak_bytes is not None and self.reserved_peak_bytes < self.allocated_peak_bytes:
            raise ValueError("a reserved peak below the allocated peak is not a caching allocator's")

    @property
    def allocator_blocks_bytes(self) -> int:
        return self.overheads.allocator_bytes if self.overheads is not None else 0

    @property
    def allocated_peak_bytes(self) -> int:
        if self.replayed_allocated_peak_bytes is not None:
            return self.replayed_allocated_peak_bytes
        return self.peak_bytes + self.step_workspace_excess_bytes + self.allocator_blocks_bytes

    @property
    def overhead_bytes(self) -> int:
        return self.overheads.total_bytes if self.overheads is not None else 0

    @property
    def usable_capacity_bytes(self) -> int:
        return self.capacity_bytes - self.overhead_bytes

    @property
    def required_bytes(self) -> int:
        return self.reserved_peak_bytes if self.reserved_peak_bytes is not None else self.allocated_peak_bytes

    @property
    def fits(self) -> bool:
        # A replay under the usable capacity releases the allocator's cache and retries before
        # it fails, as torch does: an out-of-memory there does not fit whatever the figures say.
        return self.required_bytes <= self.usable_capacity_bytes and not self.replay_out_of_memory

    @property
    def margin_bytes(self) -> int:
        """Usable capacity left at the peak; negative when it does not fit."""
        return self.usable_capacity_bytes - self.required_bytes

    @property
    def margin_gib(self) -> float:
        return bytes_to_gib(self.margin_bytes)

    @property
    def caveat(self) -> str | None:
        """What the figure leaves out, in words (None when nothing)."""
        if self.overheads is not None and self.reserved_peak_bytes is None:
            if self.reserved_not_replayed is not None:
                return f"{RESERVED_NOT_IN_FIGURE}: {self.reserved_not_replayed}"
            return RESERVED_NOT_REPLAYED
        if self.replay_out_of_memory:
            return ("the caching allocator, replayed within the usable capacity, runs out of memory even after "
                    "releasing its cache: the reserved peak shown is what the step would reserve on a larger GPU")
        return None

    @property
    def headline(self) -> str:
        room = f"{bytes_to_gib(self.usable_capacity_bytes):,.2f} GiB"
        if self.overheads is None:
            what, room = "the peak", f"the {room}"
        else:
            what = "the reserved peak" if self.reserved_peak_bytes is not None else "the allocated peak"
            room = f"the {room} the CUDA overheads leave"
        if self.fits:
            return f"Fits: {what} of {format_bytes(self.required_bytes)} leaves {self.margin_gib:,.2f} GiB of {room} free."
        return (f"Does not fit: {what} of {format_bytes(self.required_bytes)} exceeds {room} "
                f"by {-self.margin_gib:,.2f} GiB.")

    def rows(self) -> list[tuple[str, int | None, str]]:
        """(item, bytes or None when not replayed, where it comes from), in the order the
        verdict adds them up: what the Plan page, the report and the CLI list."""
        rows = [("Live tensors at the peak", self.peak_bytes, "the step's peak")]
        if self.overheads is not None:
            rows += [(item.name, item.bytes, f"inside reserved memory; {item.kind.value}: {item.source}")
                     for item in self.overheads.allocator_items]
            if self.step_workspace_excess_bytes:
                rows.append(("Optimizer step's kernel workspaces", self.step_workspace_excess_bytes,
                             "inside reserved memory; what Adafactor's column reductions add to its step's high point "
                             "(planner/cuda_reduction.py, from torch's Reduce.cuh)"))
            rows.append(("Allocated peak", self.allocated_peak_bytes, "live tensors + torch's allocator blocks" + (
                ", in the blocks the replayed allocator hands out" if self.replayed_allocated_peak_bytes is not None
                else "")))
            rows.append(("Reserved peak", self.reserved_peak_bytes, self.caveat or (
                "the caching allocator replayed on the step's allocations"
                + (" with expandable segments" if self.expandable_segments else "")
                + ", within the usable capacity")))
            rows += [(item.name, item.bytes, f"outside the allocator; {item.kind.value}: {item.source}")
                     for item in self.overheads.items]
        rows += [("Capacity (driver's total)", self.capacity_bytes, "nvidia-smi memory.total"),
                 ("Usable capacity", self.usable_capacity_bytes, "capacity less what lives outside the allocator"),
                 ("Margin", self.margin_bytes, "usable capacity less " + (
                     "the peak" if self.overheads is None else
                     "the reserved peak" if self.reserved_peak_bytes is not None else "the allocated peak"))]
        return rows

    def to_json(self) -> dict:
        """The JSON keys of DESIGN.md's interface: integer bytes, overheads itemised."""
        data = {"capacity_bytes": self.capacity_bytes, "usable_capacity_bytes": self.usable_capacity_bytes,
                "allocated_peak_bytes": self.allocated_peak_bytes, "reserved_peak_bytes": self.reserved_peak_bytes,
                "required_bytes": self.required_bytes, "margin_bytes": self.margin_bytes, "fits": self.fits,
                "cuda_overhead_bytes": self.overhead_bytes}
        if self.overheads is not None:
            data.update(self.overheads.to_json())
        if self.step_workspace_excess_bytes:
            data["step_workspace_bytes"] = self.step_workspace_excess_bytes  # in allocated_peak_bytes
        if self.replay_out_of_memory:
            data["replay_out_of_memory"] = True
        if self.caveat is not None:
            data["caveat"] = self.caveat
        return data


def device_overheads(device: Device, gpu: GpuSpec | None, plan: ParallelPlan | None = None) -> CudaOverheads | None:
    return cuda_overheads(gpu, plan) if device is Device.CUDA else None


def device_verdict(peak_bytes: int, capacity_bytes: int, device: Device, gpu: GpuSpec | None,
                   plan: ParallelPlan | None = None, reserved_peak_bytes: int | None = None) -> DeviceVerdict:
    """The verdict without a replay (planner.device_fit replays the allocator where it can)."""
    return DeviceVerdict(peak_bytes, capacity_bytes, device_overheads(device, gpu, plan), reserved_peak_bytes)


def tensor_budget_bytes(capacity_bytes: int, device: Device, gpu: GpuSpec | None,
                        plan: ParallelPlan | None = None) -> int:
    """The largest live-tensor peak `device_verdict` passes on this device (may be <= 0 when
    the overheads alone fill it)."""
    overheads = device_overheads(device, gpu, plan)
    if overheads is None:
        return capacity_bytes
    return overheads.usable_capacity_bytes(capacity_bytes) - overheads.allocator_bytes


def searchable_budget_bytes(capacity_bytes: int, device: Device, gpu: GpuSpec | None,
                            plan: ParallelPlan | None = None) -> int:
    """`tensor_budget_bytes`, for a search that needs room to search in: a one-line error
    when the CUDA overheads alone fill the GPU."""
    budget = tensor_budget_bytes(capacity_bytes, device, gpu, plan)
    if budget <= 0:
        overheads = device_overheads(device, gpu, plan)
        raise PlannerInputError(
            f"the CUDA overheads alone ({format_bytes(overheads.total_bytes + overheads.allocator_bytes)}: context, "
            f"workspaces{', NCCL' if plan is not None and plan.distributed else ''}) fill a "
            f"{format_bytes(capacity_bytes)} GPU: choose a larger one")
    return budget


def room_for_plans(capacity_bytes: int, device: Device, gpu: GpuSpec | None):
    """For the fit finder: each strategy's room (`tensor_budget_bytes` under that plan: ZeRO
    holds one NCCL communicator more than DDP or FSDP)."""
    return lambda plan: tensor_budget_bytes(capacity_bytes, device, gpu, plan)
