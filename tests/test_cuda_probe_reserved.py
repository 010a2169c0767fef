"""CudaProbe's reserved peak covers the whole measured step: each phase boundary resets
the allocator's peak statistics, so the probe keeps the highest reading of every phase
(torch.cuda faked here: no GPU needed)."""

import torch

from planner.estimate import Phase
from runners import probes


class FakeAllocator:
    """max_memory_* as the caching allocator keeps them: peaks since the last reset."""

    def __init__(self):
        self.allocated = self.reserved = 0
        self.peak_allocated = self.peak_reserved = 0

    def set(self, allocated: int, reserved: int) -> None:
        self.allocated, self.reserved = allocated, reserved
        self.peak_allocated = max(self.peak_allocated, allocated)
        self.peak_reserved = max(self.peak_reserved, reserved)

    def reset(self) -> None:
        self.peak_allocated, self.peak_reserved = self.allocated, self.reserved


def test_reserved_peak_is_the_highest_of_the_steps_phases(monkeypatch):
    fake = FakeAllocator()
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", fake.reset)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda: fake.peak_allocated)
    monkeypatch.setattr(torch.cuda, "max_memory_reserved", lambda: fake.peak_reserved)
    model = torch.nn.Linear(2, 2)
    probe = probes.CudaProbe()
    probe.track(model, torch.optim.SGD(model.parameters()))
    probe.begin()
    fake.set(100, 200)
    fake.set(300, 600)  # the forward's high point: reserved peaks here
    fake.set(150, 600)
    probe.mark(Phase.FORWARD)
    fake.set(250, 400)  # backward: reserved released (empty_cache) and lower
    probe.mark(Phase.BACKWARD)
    fake.set(120, 400)
    probe.mark(Phase.OPTIMIZER_STEP)
    result = probe.end().to_json()
    assert result["peak_bytes"] == 300 and result["peak_phase"] == Phase.FORWARD.value
    assert result["reserved_peak_bytes"] == 600
