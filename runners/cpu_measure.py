"""One steady-state optimizer step on CPU, measured by torch's MemTracker.

Definitions from ../shared/DESIGN.md: optimizer state is created at the first step, so
step 1 runs untracked and step 2 is measured; the peak is the highest total of live
tensor bytes over the whole step (every micro-batch, `optimizer.step()` and
`zero_grad(set_to_none=True)`).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from planner.scenario import Precision, Scenario

# MemTracker's categories mapped onto the planner's vocabulary.
_CATEGORY = {"Parameter": "weights", "Buffer": "weights", "Gradient": "gradients", "Optstate": "optimizer_state",
             "Activation": "activations", "Temp": "temporaries", "Other": "temporaries"}


@dataclass(frozen=True)
class CpuMeasurement:
    peak_bytes: int
    by_category: dict[str, int]  # at the peak, in the planner's category names


def _autocast(scenario: Scenario):
    if scenario.precision is Precision.BF16_MIXED:
        return torch.autocast("cpu", dtype=torch.bfloat16)
    if scenario.precision is Precision.FP16_MIXED:
        return torch.autocast("cpu", dtype=torch.float16)
    return contextlib.nullcontext()


def training_step(model, optimizer, batches: list[dict], scenario: Scenario, before_micro_batch=None) -> None:
    """One optimizer step over the micro-batches of one accumulation cycle.

    As the lessons' loop writes it (`outputs = model(...); loss = outputs.loss;
    accelerator.backward(loss)`), `outputs`, and so the logits, stay alive through backward.
    """
    for batch in batches:
        if before_micro_batch is not None:
            before_micro_batch()
        with _autocast(scenario):
            outputs = model(**batch)
            loss = outputs.loss / len(batches)
        loss.backward()
        del outputs, loss
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def measure_steady_state_step(model, optimizer, batches: list[dict], scenario: Scenario) -> CpuMeasurement:
    from torch.distributed._tools.mem_tracker import MemTracker

    training_step(model, optimizer, batches, scenario)  # creates the optimizer state
    tracker = MemTracker()
    tracker.track_external(model, optimizer)
    with tracker:
        # MemTracker refuses a second root forward in one context unless its per-module
        # stats are cleared; the global peak it reports survives the reset.
        training_step(model, optimizer, batches, scenario, before_micro_batch=tracker.reset_mod_stats)
    snapshot = tracker.get_tracker_snapshot("peak")[torch.device("cpu")]
    by_category: dict[str, int] = {}
    for ref_type, value in snapshot.items():
        if ref_type == "Total":
            continue
        name = _CATEGORY[ref_type.value]
        by_category[name] = by_category.get(name, 0) + value
    return CpuMeasurement(peak_bytes=snapshot["Total"], by_category=by_category)
