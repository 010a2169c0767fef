"""Memory probes: what watches the measured optimizer step, one per measurement mode.

An engine calls `begin(model, optimizer)` before the measured step, `micro_batch()`
before each micro-batch, `mark(phase)` at the end of each phase (forward, backward,
optimizer step) and `end()` after `zero_grad`. The peak's phase is the phase during
which the running peak last rose (../shared/DESIGN.md, "What measured means").

- MemTrackerProbe: torch's MemTracker over live tensors, by category; with real tensors
  it is the `cpu` mode, under FakeTensorMode the `simulate` mode.
- CudaProbe: `torch.cuda.max_memory_allocated()` after `reset_peak_memory_stats()`;
  categories that the allocator cannot attribute are left out (None), never guessed.
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
    extras: dict = field(default_factory=dict)

    def to_json(self) -> dict:
        data = {f"{name}_bytes": self.breakdown.get(name) for name in CATEGORIES}
        data.update(peak_bytes=self.peak_bytes, peak_phase=self.peak_phase.value, step_wall_s=self.step_wall_s)
        data.update(self.extras)
        return data


class _PhaseTimeline:
    """Running peak at the end of each phase; the peak's phase is where it last rose."""

    def __init__(self) -> None:
        self.marks: list[tuple[Phase, int]] = []

    def record(self, phase: Phase, running_peak: int) -> None:
        self.marks.append((phase, running_peak))

    def phase_of(self, peak: int) -> Phase:
        for phase, running_peak in self.marks:
            if running_peak >= peak:
                return phase
        return self.marks[-1][0] if self.marks else Phase.OPTIMIZER_STEP


class MemTrackerProbe:
    def __init__(self) -> None:
        self._tracker = None
        self._optimizer = None
        self._timeline = _PhaseTimeline()
        self._started = 0.0
        self.result: StepMeasurement | None = None

    def begin(self, model: torch.nn.Module, optimizer) -> None:
        from torch.distributed._tools.mem_tracker import MemTracker

        self._optimizer = optimizer
        self._tracker = MemTracker()
        self._tracker.track_external(model, optimizer)
        self._tracker.__enter__()
        self._started = time.perf_counter()

    def micro_batch(self) -> None:
        # MemTracker refuses a second root forward in one context unless its per-module
        # stats are cleared; the global peak survives the reset.
        self._tracker.reset_mod_stats()

    def _peak_snapshot(self) -> dict:
        snapshots = self._tracker.get_tracker_snapshot("peak")
        return max(snapshots.values(), key=lambda snap: snap["Total"]) if snapshots else {"Total": 0}

    def mark(self, phase: Phase) -> None:
        self._timeline.record(phase, self._peak_snapshot()["Total"])

    def end(self) -> StepMeasurement:
        wall = time.perf_counter() - self._started
        self._tracker.__exit__(None, None, None)
        snapshot = self._peak_snapshot()
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
        peak = snapshot["Total"]
        self.result = StepMeasurement(peak, self._timeline.phase_of(peak), breakdown, wall)
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
        self._timeline = _PhaseTimeline()
        self._model = None
        self._optimizer = None
        self._started = 0.0
        self._gradient_bytes = 0
        self.result: StepMeasurement | None = None

    def begin(self, model: torch.nn.Module, optimizer) -> None:
        self._model, self._optimizer = model, optimizer
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        self._started = time.perf_counter()

    def micro_batch(self) -> None:
        pass

    def mark(self, phase: Phase) -> None:
        torch.cuda.synchronize()
        if phase is Phase.BACKWARD:
            self._gradient_bytes = _tensor_bytes(p.grad for p in self._model.parameters() if p.grad is not None)
        self._timeline.record(phase, torch.cuda.max_memory_allocated())

    def end(self) -> StepMeasurement:
        torch.cuda.synchronize()
        wall = time.perf_counter() - self._started
        peak = torch.cuda.max_memory_allocated()
        weights = _tensor_bytes(list(self._model.parameters()) + list(self._model.buffers()))
        state = _tensor_bytes(optimizer_state_tensors(self._optimizer))
        # The allocator cannot say which gradients were alive at the peak, nor split
        # activations from temporaries: those stay None rather than guessed.
        breakdown = {"weights": weights, "gradients": None, "optimizer_state": state,
                     "activations": None, "temporaries": None}
        extras = {"gradients_after_backward_bytes": self._gradient_bytes,
                  "reserved_peak_bytes": torch.cuda.max_memory_reserved()}
        self.result = StepMeasurement(peak, self._timeline.phase_of(peak), breakdown, wall, extras)
        return self.result
