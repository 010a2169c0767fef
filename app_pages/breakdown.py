"""What the Plan page shows, computed here so the page only lays it out: the peak's
breakdown by memory category as a table, and the fits / does-not-fit verdict.

Raw bytes first, formatted last (binary units, planner.units).
"""

from __future__ import annotations

from dataclasses import dataclass

import pandas as pd

from planner.estimate import Estimate
from planner.units import bytes_to_gib, format_bytes

# PhaseMemory field -> label, in the order the planner and the runners list them.
CATEGORY_LABELS = {
    "weights": "Weights",
    "gradients": "Gradients",
    "optimizer_state": "Optimizer state",
    "activations": "Activations",
    "temporaries": "Temporaries",
}
PEAK_LABEL = "Peak (total)"


def breakdown_table(result: Estimate) -> pd.DataFrame:
    """One row per category live at the peak, then the peak itself (their sum)."""
    peak = result.peak
    labels = [*CATEGORY_LABELS.values(), PEAK_LABEL]
    sizes = [getattr(peak, field) for field in CATEGORY_LABELS] + [peak.total]
    return pd.DataFrame({
        "category": labels,
        "bytes": pd.Series(sizes, dtype="int64"),
        "size": [format_bytes(size) for size in sizes],
    })


@dataclass(frozen=True)
class Verdict:
    peak_bytes: int
    capacity_bytes: int

    @property
    def fits(self) -> bool:
        return self.peak_bytes <= self.capacity_bytes

    @property
    def margin_bytes(self) -> int:
        """Capacity left over at the peak; negative when the peak does not fit."""
        return self.capacity_bytes - self.peak_bytes

    @property
    def margin_gib(self) -> float:
        return bytes_to_gib(self.margin_bytes)

    @property
    def headline(self) -> str:
        capacity = f"{bytes_to_gib(self.capacity_bytes):,.2f} GiB"
        if self.fits:
            return (f"Fits: the peak of {format_bytes(self.peak_bytes)} leaves "
                    f"{self.margin_gib:,.2f} GiB of the {capacity} free.")
        return (f"Does not fit: the peak of {format_bytes(self.peak_bytes)} exceeds "
                f"the {capacity} by {-self.margin_gib:,.2f} GiB.")


def verdict_for(result: Estimate, capacity_bytes: int) -> Verdict:
    return Verdict(peak_bytes=result.peak_bytes, capacity_bytes=capacity_bytes)
