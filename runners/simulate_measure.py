"""What the simulated measurement needs beyond fake tensors themselves.

Under torch's FakeTensorMode every tensor has a shape, dtype, device and storage size but
no data, so MemTracker's bookkeeping is exact and nothing is allocated: a 7B or 70B plan
can be checked on a laptop (../shared/DESIGN.md, "What measured means"). runners.measure
runs the real run's own model, batches and engine on fake tensors; what fake tensors
change about the path taken is undone by runners.fake_mode_patches, so the simulated
peak equals the real CPU peak to the byte (tests/test_simulate.py).
"""

from __future__ import annotations

import torch
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode



def fake_quantile_maps(optimizer, fake_mode: FakeTensorMode) -> None:
    """bitsandbytes' 8-bit optimizers build their two 256-entry quantile maps in the
    constructor, as real tensors, and put them into the state at the first step; fake
    copies keep them countable (they are optimizer state in the real run) and keep the
    8-bit update kernel's inputs all fake."""
    qmaps = getattr(optimizer, "name2qmap", None)
    if qmaps:
        for name, qmap in qmaps.items():
            if isinstance(qmap, torch.Tensor) and not isinstance(qmap, FakeTensor):
                qmaps[name] = fake_mode.from_tensor(qmap)


def fake_batches(real_batches: list[dict], fake_mode: FakeTensorMode) -> list[dict]:
    """Fake copies of real (small) batches, after checking the masks the patch relies on."""
    for batch in real_batches:
        if not bool((batch["attention_mask"] == 1).all()):
            raise ValueError("the simulator reproduces unpadded batches only (all-ones attention_mask)")
    return [{name: fake_mode.from_tensor(tensor) for name, tensor in batch.items()} for batch in real_batches]
