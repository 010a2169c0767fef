"""The simulated measurement: the CPU steady-state step of runners.cpu_measure, run on fake tensors.

Under torch's FakeTensorMode every tensor has a shape, dtype, device and storage size but
no data, so MemTracker's bookkeeping is exact and nothing is allocated: a 7B or 70B plan
can be checked on a laptop (../shared/DESIGN.md, "What measured means"). The model,
batches and step are the real run's own (runners.model_factory, runners.optimizers,
runners.cpu_measure.measure_steady_state_step); what fake tensors change about the
path taken is undone by runners.fake_mode_patches, so the simulated peak equals the real
CPU peak to the byte.
"""

from __future__ import annotations

import torch
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

from planner.scenario import Scenario
from runners.cpu_measure import CpuMeasurement, measure_steady_state_step
from runners.fake_mode_patches import all_ones_padding_masks, scalar_stand_ins
from runners.model_factory import build_model, synthetic_batch
from runners.optimizers import build_optimizer


def _fake_quantile_maps(optimizer, fake_mode: FakeTensorMode) -> None:
    """bitsandbytes' 8-bit optimizers build their two 256-entry quantile maps in the
    constructor, as real tensors, and put them into the state at the first step; fake
    copies keep them countable (they are optimizer state in the real run) and keep the
    8-bit update kernel's inputs all fake."""
    qmaps = getattr(optimizer, "name2qmap", None)
    if qmaps:
        for name, qmap in qmaps.items():
            if isinstance(qmap, torch.Tensor) and not isinstance(qmap, FakeTensor):
                qmaps[name] = fake_mode.from_tensor(qmap)


def measure_simulated_step(config_dict: dict, scenario: Scenario, seed: int = 0) -> CpuMeasurement:
    """Peak and categories of one steady-state step of `scenario` (step 1 untracked, step 2
    measured), with fake tensors on the CPU device kind."""
    # Batches are made real and small, checked, then faked: the mask patch is only valid
    # for all-ones masks (runners.fake_mode_patches, contract of all_ones_padding_masks).
    real_batches = [synthetic_batch(config_dict, scenario, seed=i) for i in range(scenario.grad_accum_steps)]
    for batch in real_batches:
        if not bool((batch["attention_mask"] == 1).all()):
            raise ValueError("the simulator reproduces unpadded batches only (all-ones attention_mask)")

    fake_mode = FakeTensorMode()
    with fake_mode:
        model = build_model(config_dict, scenario, seed=seed)
    batches = [{name: fake_mode.from_tensor(tensor) for name, tensor in batch.items()} for batch in real_batches]
    # bitsandbytes' constructor must run outside fake mode (DESIGN, Known facts); torch's
    # constructors only record the parameters, so every optimizer is built here alike.
    optimizer = build_optimizer(model, scenario.optimizer)
    _fake_quantile_maps(optimizer, fake_mode)

    with fake_mode, scalar_stand_ins(), all_ones_padding_masks():
        return measure_steady_state_step(model, optimizer, batches, scenario)
