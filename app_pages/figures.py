"""Plotly figure builders for the dashboard: plain functions from planner results to
figures, with no Streamlit here, so they are tested (and reused by a report export) alone.
"""

from __future__ import annotations

import plotly.graph_objects as go

from app_pages.breakdown import CATEGORY_LABELS
from planner.estimate import Estimate
from planner.units import bytes_to_gib, format_bytes

CATEGORY_COLORS = {
    "weights": "#2563eb",
    "gradients": "#f59e0b",
    "optimizer_state": "#10b981",
    "activations": "#ef4444",
    "temporaries": "#8b5cf6",
}
CAPACITY_COLOR = "#111827"


def phase_breakdown_figure(result: Estimate, capacity_bytes: int | None = None) -> go.Figure:
    """Stacked bars of live memory by category at each phase of one optimizer step (GiB),
    the peak phase marked, and the device capacity as a horizontal line."""
    peak = result.peak
    x = [f"{p.phase.value} (peak)" if p is peak else p.phase.value for p in result.phases]
    figure = go.Figure()
    for field, label in CATEGORY_LABELS.items():
        sizes = [getattr(phase, field) for phase in result.phases]
        figure.add_bar(
            name=label,
            x=x,
            y=[bytes_to_gib(size) for size in sizes],
            marker_color=CATEGORY_COLORS[field],
            customdata=[[f"{size:,}", format_bytes(size)] for size in sizes],
            hovertemplate=f"{label}: %{{customdata[1]}} (%{{customdata[0]}} bytes)<extra></extra>",
        )
    if capacity_bytes is not None:
        figure.add_hline(
            y=bytes_to_gib(capacity_bytes),
            line=dict(color=CAPACITY_COLOR, dash="dash", width=2),
            annotation_text=f"capacity {bytes_to_gib(capacity_bytes):,.2f} GiB",
            annotation_position="top left",
        )
    figure.update_layout(
        barmode="stack",
        template="plotly_white",
        title=f"{result.model_name}: memory by phase, peak {format_bytes(result.peak_bytes)}",
        yaxis_title="GiB (2^30 bytes)",
        xaxis_title="phase of one optimizer step",
        legend_title_text="category",
        margin=dict(t=60, b=40),
    )
    return figure
