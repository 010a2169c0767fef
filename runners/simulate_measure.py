"""What the simulated measurement needs beyond fake tensors themselves.

Under torch's FakeTensorMode every tensor has a shape, dtype, device and storage size but
no data, so MemTracker's bookkeeping is exact and nothing is allocated: a 7B or 70B plan
can be checked on a laptop (../shared/DESIGN.md, "What measured means"). runners.measure
runs the real run's own model, batches and engine on fake tensors; what fake tensors
change about the path taken is undone by planner.probe.fake_mode (shared with the probe), so the simulated
peak equals the real CPU peak to the byte (tests/test_simulate.py).
"""

from __future__ import annotations

from torch._subclasses.fake_tensor import FakeTensorMode

from planner.probe.fake_mode import fake_quantile_maps  # noqa: F401  (shared with the probe)



def fake_batches(real_batches: list[dict], fake_mode: FakeTensorMode) -> list[dict]:
    """Fake copies of real (small) batches, after checking the masks the patch relies on."""
    for batch in real_batches:
        if not bool((batch["attention_mask"] == 1).all()):
            raise ValueError("the simulator reproduces unpadded batches only (all-ones attention_mask)")
    return [{name: fake_mode.from_tensor(tensor) for name, tensor in batch.items()} for batch in real_batches]
