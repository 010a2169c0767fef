"""What the Plan page shows, computed here so the page only lays it out: the peak's
breakdown by memory category as a table, and the fits / does-not-fit verdict.

Raw bytes first, formatted last (binary units, planner.units).
"""

from __future__ import annotations

from dataclasses import dataclass

import pandas as pd

from planner.estimate import Estimate
from planner.parallel import ParallelEstimate
from planner.units import bytes_to_gib, format_bytes

# PhaseMemory field -> label, in the order the planner and the runners list them.
CATEGORY_LABELS = {
    "weights": "Weights",
    "gradients": "Gradients",
    "optimizer_state": "Optimizer state",
    "activations": "Activations",
    "temporaries": "Temporaries",
}
# planner.parallel.DevicePhase adds what communication holds on each GPU.
DEVICE_CATEGORY_LABELS = {**CATEGORY_LABELS, "communication_buffers": "Communication buffers"}
PEAK_LABEL = "Peak (total)"


def category_labels(result: Estimate | ParallelEstimate) -> dict[str, str]:
    """The categories `result`'s phases carry: one device's, or one GPU's under a strategy."""
    return DEVICE_CATEGORY_LABELS if isinstance(result, ParallelEstimate) else CATEGORY_LABELS


def peak_bytes(result: Estimate | ParallelEstimate) -> int:
    return result.per_device_peak_bytes if isinstance(result, ParallelEstimate) else result.peak_bytes


def breakdown_table(result: Estimate | ParallelEstimate) -> pd.DataFrame:
    """One row per category live at the peak (of one device, or of one GPU under a
    strategy), then the peak itself (their sum)."""
    peak = result.peak
    categories = category_labels(result)
    labels = [*categories.values(), PEAK_LABEL]
    sizes = [getattr(peak, field) for field in categories] + [peak.total]
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


def verdict_for(result: Estimate | ParallelEstimate, capacity_bytes: int) -> Verdict:
    return Verdict(peak_bytes=peak_bytes(result), capacity_bytes=capacity_bytes)
