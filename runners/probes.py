"""Memory probes: what watches the measured optimizer step, one per measurement mode.

An engine calls `track(model, optimizer)` before the step ahead of the measured one,
`begin()` before the measured step, `micro_batch()` before each micro-batch,
`mark(phase)` at the end of each phase (forward, backward, optimizer step) and `end()`
after `zero_grad`. Tracking starts a step early because MemTracker only sees tensors
created while it tracks, and tensors from the previous step (the lessons' loop keeps
its `outputs`) are alive during the measured one. The peak's phase is the phase during
which the running peak last rose (../shared/DESIGN.md, "What measured means").

- MemTrackerProbe: torch's MemTracker over live tensors, by category; with real tensors
  it is the `cpu` mode, under FakeTensorMode the `simulate` mode.
- CudaProbe: `torch.cuda.max_memory_allocated()` after `reset_peak_memory_stats()`;
  categories that the allocator cannot attribute are left out (None), never guessed.
  `reserved_peak_bytes` is `max_memory_reserved()` over the same step (the highest of
  its phases': each phase boundary resets both peaks).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from planner.estimate import Phase

# MemTracker's reference types, in the planner's category vocabulary.
_CATEGORY = {"Parameter": "weights", "Buffer": "weights", "Gradient": "gradients", "Optstate": "optimizer_state",
             "Activation": "activations", "Temp": "temporaries", "Other": "temporaries"}
CATEGORIES = ("weights", "gradients", "optimizer_state", "activations", "temporaries")


@dataclass
class StepMeasurement:
    """The measured step: peak, its phase, the breakdown at the peak (None where unknown)."""

    peak_bytes: int
    peak_phase: Phase
    breakdown: dict[str, int | None]
    step_wall_s: float
    phase_peaks: dict[Phase, int] = field(default_factory=dict)  # highest total within each phase
    extras: dict = field(default_factory=dict)

    def to_json(self) -> dict:
        data = {f"{name}_bytes": self.breakdown.get(name) for name in CATEGORIES}
        data.update(peak_bytes=self.peak_bytes, peak_phase=self.peak_phase.value, step_wall_s=self.step_wall_s,
                    phase_peak_bytes={phase.value: peak for phase, peak in self.phase_peaks.items()})
        data.update(self.extras)
        return data


class MemTrackerProbe:
    """`cuda_kernels`: a simulated step on CUDA's kernels takes CUDA's path as the probe does
    (planner.probe.memtracker: the autograd engine's gradient sums in place, softmax backward's
    temporary, dropout's mask first), calibrated and watched from `track` to `end`.
    Known limitation: per-phase peaks restart MemTracker's running peak at every phase
    boundary through its private `_peak_mem` / `_peak_mem_snap` (torch 2.13); the overall
    peak is the largest phase peak, and its snapshot the breakdown."""

    def __init__(self, cuda_kernels: bool = False) -> None:
        self._cuda_kernels = cuda_kernels
        self._watching = None  # planner.probe.accumulation.watching_backward, while tracking
        self._tracker = None
        self._optimizer = None
        self._segments: list[tuple[Phase, int, dict]] = []
        self._started = 0.0
        self.result: StepMeasurement | None = None

    def track(self, model: torch.nn.Module, optimizer) -> None:
        from planner.probe.accumulation import InputBufferSums, watching_backward
        from planner.probe.memtracker import TrainableMemTracker

        self._optimizer = optimizer
        sums = None
        if self._cuda_kernels:
            sums = InputBufferSums()
            sums.calibrate()  # under the simulation's modes, before the tracker's
            self._watching = watching_backward(sums)
            self._watching.__enter__()
        self._tracker = TrainableMemTracker(sums)
        self._tracker.track_external(model, optimizer)
        self._tracker.__enter__()

    def begin(self) -> None:
        self._segments.clear()
        self._restart_peak()
        self._started = time.perf_counter()

    def _restart_peak(self) -> None:
        import copy

        current = self._tracker.get_tracker_snapshot("current")
        self._tracker._peak_mem = {device: snap["Total"] for device, snap in current.items()}
        self._tracker._peak_mem_snap = copy.deepcopy(current)

    def micro_batch(self) -> None:
        # MemTracker refuses a second root forward in one context unless its per-module
        # stats are cleared; the global peak survives the reset.
        self._tracker.reset_mod_stats()

    def _snapshot(self, kind: str) -> dict:
        snapshots = self._tracker.get_tracker_snapshot(kind)
        return max(snapshots.values(), key=lambda snap: snap["Total"]) if snapshots else {"Total": 0}

    def mark(self, phase: Phase) -> None:
        """Close the phase that just ended: keep its peak, restart the running peak."""
        peak = self._snapshot("peak")
        self._segments.append((phase, peak["Total"], peak))
        if phase is Phase.BACKWARD:
            # Backward has run the tracker's gradient hooks: let them go now, as a run without
            # a tracker frees what they hold (planner.probe.memtracker), before the step.
            self._tracker.release_grad_hooks()
        self._restart_peak()

    def close(self) -> None:
        """Put torch.autograd.backward back (CUDA's path); also after a step that failed."""
        if self._watching is not None:
            self._watching.__exit__(None, None, None)
            self._watching = None

    def end(self) -> StepMeasurement:
        wall = time.perf_counter() - self._started
        self._tracker.__exit__(None, None, None)
        self.close()
        phase, _, snapshot = max(self._segments, key=lambda segment: segment[1])
        phase_peaks: dict[Phase, int] = {}
        for segment_phase, total, _ in self._segments:
            phase_peaks[segment_phase] = max(phase_peaks.get(segment_phase, 0), total)
        breakdown = dict.fromkeys(CATEGORIES, 0)
        for ref_type, value in snapshot.items():
            if ref_type != "Total":
                breakdown[_CATEGORY[ref_type.value]] += value
        # MemTracker files every tensor allocated inside optimizer.step() as optimizer
        # state, the step's temporaries included; the state itself is what the optimizer holds.
        state = _tensor_bytes(optimizer_state_tensors(self._optimizer))
        if breakdown["optimizer_state"] > state:
            breakdown["temporaries"] += breakdown["optimizer_state"] - state
            breakdown["optimizer_state"] = state
        self.result = StepMeasurement(snapshot["Total"], phase, breakdown, wall, phase_peaks)
        return self.result


def _tensor_bytes(tensors) -> int:
    """Bytes of the distinct storages behind `tensors` (shared storages count once).

    Keyed by the storage's C++ object, which fake tensors have too (they have no data_ptr).
    """
    seen, total = set(), 0
    for tensor in tensors:
        storage = tensor.untyped_storage()
        if storage._cdata not in seen:
            seen.add(storage._cdata)
            total += storage.nbytes()
    return total


def optimizer_state_tensors(optimizer):
    inner = getattr(optimizer, "optimizer", optimizer)  # accelerate wraps the optimizer
    return [v for state in inner.state.values() for v in state.values() if isinstance(v, torch.Tensor)]


class CudaProbe:
    """Allocator statistics over the measured step (CUDA mode)."""

    def __init__(self) -> None:
        self._phase_peaks: dict[Phase, int] = {}
        self._peak_phase = Phase.FORWARD
        self._model = None
        self._optimizer = None
        self._started = 0.0
        self._gradient_bytes = 0
        self._reserved_peak = 0
        self.result: StepMeasurement | None = None

    def track(self, model: torch.nn.Module, optimizer) -> None:
        self._model, self._optimizer = model, optimizer

    def begin(self) -> None:
        self._phase_peaks.clear()
        self._reserved_peak = 0
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        self._started = time.perf_counter()

    def micro_batch(self) -> None:
        pass

    def mark(self, phase: Phase) -> None:
        torch.cuda.synchronize()
        if phase is Phase.BACKWARD:
            self._gradient_bytes = _tensor_bytes(p.grad for p in self._model.parameters() if p.grad is not None)
        # Allocator peaks restart at each phase boundary, so each phase has its own.
        peak = torch.cuda.max_memory_allocated()
        if peak > max(self._phase_peaks.values(), default=-1):
            self._peak_phase = phase
        self._phase_peaks[phase] = max(self._phase_peaks.get(phase, 0), peak)
        # The reset below restarts the reserved peak too: keep the step's highest.
        self._reserved_peak = max(self._reserved_peak, torch.cuda.max_memory_reserved())
        torch.cuda.reset_peak_memory_stats()

    def end(self) -> StepMeasurement:
        torch.cuda.synchronize()
        wall = time.perf_counter() - self._started
        peak = max(self._phase_peaks.values())
        weights = _tensor_bytes(list(self._model.parameters()) + list(self._model.buffers()))
        state = _tensor_bytes(optimizer_state_tensors(self._optimizer))
        # The allocator cannot say which gradients were alive at the peak, nor split
        # activations from temporaries: those stay None rather than guessed.
        breakdown = {"weights": weights, "gradients": None, "optimizer_state": state,
                     "activations": None, "temporaries": None}
        extras = {"gradients_after_backward_bytes": self._gradient_bytes,
                  "reserved_peak_bytes": max(self._reserved_peak, torch.cuda.max_memory_reserved())}
        self.result = StepMeasurement(peak, self._peak_phase, breakdown, wall, dict(self._phase_peaks), extras)
        return self.result
