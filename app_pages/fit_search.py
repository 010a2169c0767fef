"""The largest batch size and sequence length that fit a device, searched on the analytic
planner (no Streamlit here): doubling until the peak exceeds the capacity, then bisection.

Peak memory grows monotonically with batch size and with sequence length (every category
is a non-decreasing function of both), which is what makes bisection exact. Estimates
take well under a millisecond, so a search (about 2·log2(limit) estimates) is instant.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

from planner.errors import PlannerInputError
from planner.estimate import estimate
from planner.model_shape import ModelShape
from planner.scenario import Scenario

BATCH_SEARCH_LIMIT = 1 << 20  # sequences per micro-batch; a bound, not a recommendation
SEQ_SEARCH_LIMIT = 1 << 20  # tokens, for models without a position limit (rotary, ALiBi)


def largest_fitting(peak_for: Callable[[int], int | None], capacity_bytes: int, limit: int) -> int | None:
    """Largest n in [1, limit] with peak_for(n) <= capacity_bytes, assuming the peak is
    non-decreasing in n; None when even n = 1 does not fit. peak_for may answer None for
    an n the model cannot take (treated as not fitting)."""

    def fits(n: int) -> bool:
        peak = peak_for(n)
        return peak is not None and peak <= capacity_bytes

    if limit < 1 or not fits(1):
        return None
    good = 1
    bad = None
    while bad is None:  # doubling: good fits, probe 2·good
        probe = min(2 * good, limit)
        if probe == good:
            return good
        if fits(probe):
            good = probe
        else:
            bad = probe
    while bad - good > 1:  # invariant: good fits, bad does not
        middle = (good + bad) // 2
        if fits(middle):
            good = middle
        else:
            bad = middle
    return good


def _peak_or_none(shape: ModelShape, scenario: Scenario) -> int | None:
    try:
        return estimate(shape, scenario).peak_bytes
    except PlannerInputError:  # e.g. a sequence longer than the model's positions
        return None


def max_batch_size(shape: ModelShape, scenario: Scenario, capacity_bytes: int,
                   limit: int = BATCH_SEARCH_LIMIT) -> int | None:
    """Largest micro-batch (sequences) of `scenario` that fits; None when batch 1 does not."""
    return largest_fitting(lambda b: _peak_or_none(shape, dataclasses.replace(scenario, batch_size=b)),
                           capacity_bytes, limit)


def max_seq_len(shape: ModelShape, scenario: Scenario, capacity_bytes: int,
                limit: int = SEQ_SEARCH_LIMIT) -> int | None:
    """Largest sequence length (tokens) of `scenario` that fits, capped by the model's
    positions; None when one token does not."""
    if shape.max_positions is not None:
        limit = min(limit, shape.max_positions)
    return largest_fitting(lambda s: _peak_or_none(shape, dataclasses.replace(scenario, seq_len=s)),
                           capacity_bytes, limit)


@dataclasses.dataclass(frozen=True)
class FitLimits:
    batch_size: int | None  # at the scenario's sequence length
    seq_len: int | None  # at the scenario's batch size
    seq_len_capped_by_positions: bool  # the model's positions, not memory, stopped the search


def fit_limits(shape: ModelShape, scenario: Scenario, capacity_bytes: int) -> FitLimits:
    seq = max_seq_len(shape, scenario, capacity_bytes)
    capped = seq is not None and shape.max_positions is not None and seq == shape.max_positions
    return FitLimits(max_batch_size(shape, scenario, capacity_bytes), seq, capped)
