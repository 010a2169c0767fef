"""What the Plan page shows, computed here so the page only lays it out: the peak's
breakdown by memory category as a table, and the fits / does-not-fit verdict (planner.verdict)
with what it adds on CUDA as a table.

Raw bytes first, formatted last (binary units, planner.units).
"""

from __future__ import annotations

import pandas as pd

from planner.device_fit import plan_verdict
from planner.estimate import Estimate
from planner.gpus import GpuSpec
from planner.model_shape import ModelShape
from planner.parallel import ParallelEstimate
from planner.strategy import ParallelPlan
from planner.units import format_bytes
from planner.verdict import DeviceVerdict

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


def with_byte_separators(frame: pd.DataFrame, columns: tuple[str, ...] = ("bytes",)) -> pd.DataFrame:
    """`frame` for a static table (st.table): byte counts as text with thousands separators, an
    absent one (a figure not replayed) as a dash. Text, not a pandas Styler: a Styler cost the
    page 7 ms a table on every render."""
    return frame.assign(**{c: ["–" if pd.isna(v) else f"{int(v):,}" for v in frame[c]] for c in columns if c in frame})


def verdict_for(shape: ModelShape, result: Estimate | ParallelEstimate, capacity_bytes: int,
                gpu: GpuSpec | None = None, plan: ParallelPlan | None = None) -> DeviceVerdict:
    """The verdict on one GPU (planner.device_fit): on CUDA with the overheads of `gpu` (None:
    a custom size, their larger figures) under `plan`, the caching allocator replayed where
    the plan's step can be."""
    return plan_verdict(shape, result, capacity_bytes, gpu, plan)


def verdict_table(verdict: DeviceVerdict) -> pd.DataFrame:
    """Allocated, reserved and overheads side by side, then the usable capacity and the margin."""
    rows = verdict.rows()
    return pd.DataFrame({
        "item": [r[0] for r in rows],
        "bytes": pd.Series([r[1] for r in rows], dtype="Int64"),
        "size": [format_bytes(r[1]) if r[1] is not None else "not replayed" for r in rows],
        "source": [r[2] for r in rows],
    })
