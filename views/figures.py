"""Plotly figure builders for the dashboard: plain functions from planner results to
figures, with no Streamlit here, so they are tested (and reused by a report export) alone.

Plotly parses every text it draws as pseudo-HTML, so each builder passes the text it is
given (titles, labels: model names and run labels among them) through
views.escaping.plotly_text; its own markup (`<br>` in hover templates) is added after.
"""

from __future__ import annotations

import plotly.graph_objects as go
import plotly.io as pio

from planner.estimate import Estimate
from planner.parallel import ParallelEstimate
from planner.units import bytes_to_gib, format_bytes
from views.breakdown import CATEGORY_LABELS, category_labels, peak_bytes
from views.escaping import plotly_text

CATEGORY_COLORS = {
    "weights": "#2563eb",
    "gradients": "#f59e0b",
    "optimizer_state": "#10b981",
    "activations": "#ef4444",
    "temporaries": "#8b5cf6",
    "communication_buffers": "#64748b",
}
CAPACITY_COLOR = "#111827"

# Every figure is drawn on plotly_white. Named per figure (update_layout(template=...)),
# plotly validates and deep-copies the whole template each time: 40 ms a figure, most of a
# page's render on 2 cores. As the default it is applied once, when a figure is serialised,
# to the same JSON.
pio.templates.default = "plotly_white"


def phase_breakdown_figure(result: Estimate | ParallelEstimate, capacity_bytes: int | None = None) -> go.Figure:
    """Stacked bars of live memory by category at each phase of one optimizer step (GiB),
    on one device or on one GPU under a strategy, the peak phase marked, and the device
    capacity as a horizontal line."""
    peak = result.peak
    x = [f"{p.phase.value} (peak)" if p is peak else p.phase.value for p in result.phases]
    figure = go.Figure()
    for field, label in category_labels(result).items():
        sizes = [getattr(phase, field) for phase in result.phases]
        figure.add_bar(
            name=label,
            x=x,
            y=[bytes_to_gib(size) for size in sizes],
            marker_color=CATEGORY_COLORS[field],
            customdata=[[f"{size:,}", format_bytes(size)] for size in sizes],
            hovertemplate=f"{label}: %{{customdata[1]}} (%{{customdata[0]}} bytes)<extra></extra>",
        )
    _capacity_line(figure, capacity_bytes)
    figure.update_layout(
        barmode="stack",
        title=_phase_title(result),
        yaxis_title="GiB (2^30 bytes)",
        xaxis_title="phase of one optimizer step",
        legend_title_text="category",
        margin=dict(t=60, b=40),
    )
    return figure


def _phase_title(result: Estimate | ParallelEstimate) -> str:
    if isinstance(result, ParallelEstimate):
        plan = result.plan
        return (f"{plotly_text(result.base.model_name)} on {plan.num_devices} GPUs, {plan.strategy.value}: "
                f"memory per GPU by phase, peak {format_bytes(peak_bytes(result))}")
    return f"{plotly_text(result.model_name)}: memory by phase, peak {format_bytes(result.peak_bytes)}"


CAPACITY_PREFIX = "capacity "  # the legend entry of the capacity line: "capacity 15.00 GiB"


def _capacity_line(figure: go.Figure, capacity_bytes: int | None) -> None:
    """The capacity as a dashed line across the plot, named in the legend: a label on the
    line itself sits over the bars that reach it."""
    if capacity_bytes is None:
        return
    line = dict(color=CAPACITY_COLOR, dash="dash", width=2)
    figure.add_hline(y=bytes_to_gib(capacity_bytes), line=line)
    figure.add_scatter(x=[None], y=[None], mode="lines", line=line, hoverinfo="skip",
                       name=f"{CAPACITY_PREFIX}{bytes_to_gib(capacity_bytes):,.2f} GiB")


def memory_vs_batch_figure(series: dict[str, list[tuple[int, int | None]]], capacity_bytes: int | None = None,
                           title: str = "Peak memory against batch size") -> go.Figure:
    """One line per technique: peak (GiB) against effective batch size (log2 axis), and the capacity line.
    A None peak (not estimable) leaves a gap."""
    figure = go.Figure()
    for raw_label, points in series.items():
        label = plotly_text(raw_label)
        figure.add_scatter(
            name=label, mode="lines+markers",
            x=[b for b, _ in points],
            y=[None if peak is None else bytes_to_gib(peak) for _, peak in points],
            customdata=[format_bytes(peak) for _, peak in points],
            hovertemplate=f"{label}<br>batch %{{x}}: %{{customdata}}<extra></extra>",
        )
    _capacity_line(figure, capacity_bytes)
    figure.update_layout(
        title=plotly_text(title),
        xaxis=dict(title="effective batch size (sequences per optimizer step)", type="log", dtick=0.30102999566),
        yaxis_title="peak GiB (2^30 bytes)", legend_title_text="technique", margin=dict(t=60, b=40),
    )
    return figure


def technique_bars_figure(labels: list[str], estimated: list[int | None], measured: list[int | None],
                          capacity_bytes: int | None = None, title: str = "Peak by technique") -> go.Figure:
    """Grouped bars per technique: estimated and measured peak (GiB), and the capacity line."""
    labels = [plotly_text(label) for label in labels]
    figure = go.Figure()
    figure.add_bar(name="estimated", x=labels, y=[None if v is None else bytes_to_gib(v) for v in estimated],
                   marker_color="#2563eb", customdata=[format_bytes(v) for v in estimated],
                   hovertemplate="estimated %{customdata}<extra></extra>")
    figure.add_bar(name="measured", x=labels, y=[None if v is None else bytes_to_gib(v) for v in measured],
                   marker_color="#f59e0b", customdata=[format_bytes(v) for v in measured],
                   hovertemplate="measured %{customdata}<extra></extra>")
    _capacity_line(figure, capacity_bytes)
    figure.update_layout(barmode="group", title=plotly_text(title),
                         yaxis_title="peak GiB (2^30 bytes)", xaxis_title="technique", margin=dict(t=60, b=40))
    return figure


def category_comparison_figure(estimated: dict[str, int | None], measured: dict[str, int | None],
                               title: str = "Estimated against measured, by category") -> go.Figure:
    """Grouped bars per memory category (keys of CATEGORY_LABELS, plus "peak"), in GiB."""
    keys = [k for k in (*CATEGORY_LABELS, "peak") if k in estimated or k in measured]
    labels = [CATEGORY_LABELS.get(k, "Peak (total)") for k in keys]
    return technique_bars_figure(labels, [estimated.get(k) for k in keys], [measured.get(k) for k in keys],
                                 title=title).update_layout(xaxis_title="category")


def estimate_vs_measured_scatter(estimated: list[int], measured: list[int], labels: list[str],
                                 band_pct: float = 3.0, title: str = "Estimated against measured peak") -> go.Figure:
    """One point per run (x measured, y estimated, GiB), the y = x line and a ±band_pct% band."""
    figure = go.Figure()
    xs = [bytes_to_gib(m) for m in measured]
    top = max([*xs, *(bytes_to_gib(e) for e in estimated), 0.001]) * 1.1
    line_x = [0.0, top]
    figure.add_scatter(name=f"+{band_pct:g}%", x=line_x, y=[x * (1 + band_pct / 100) for x in line_x], mode="lines",
                       line=dict(width=0), showlegend=False, hoverinfo="skip")
    figure.add_scatter(name=f"±{band_pct:g}% band", x=line_x, y=[x * (1 - band_pct / 100) for x in line_x],
                       mode="lines", line=dict(width=0), fill="tonexty", fillcolor="rgba(37,99,235,0.15)",
                       hoverinfo="skip")
    figure.add_scatter(name="y = x", x=line_x, y=line_x, mode="lines", line=dict(color=CAPACITY_COLOR, dash="dot"))
    figure.add_scatter(name="runs", x=xs, y=[bytes_to_gib(e) for e in estimated], mode="markers",
                       text=[plotly_text(label) for label in labels],
                       marker=dict(size=9, color="#ef4444"),
                       hovertemplate="%{text}<br>measured %{x:.3f} GiB<br>estimated %{y:.3f} GiB<extra></extra>")
    figure.update_layout(title=plotly_text(title), xaxis_title="measured peak GiB (2^30 bytes)",
                         yaxis_title="estimated peak GiB (2^30 bytes)", margin=dict(t=60, b=40))
    return figure


def fit_options_figure(result, title: str = "Technique combinations: peak against step time") -> go.Figure:
    """One point per combination that fits (planner.fit.FitResult): estimated step time
    against peak (GiB), the best marked, and the capacity line."""
    figure = go.Figure()
    options = result.options
    figure.add_scatter(
        x=[o.step_time_s for o in options],
        y=[bytes_to_gib(o.peak_bytes) for o in options],
        mode="markers",
        name="fits",
        marker={"size": [14 if rank == 0 else 9 for rank in range(len(options))],
                "color": ["#10b981" if rank == 0 else "#2563eb" for rank in range(len(options))]},
        customdata=[[rank + 1, o.scenario.optimizer.value, o.scenario.precision.value,
                     "on" if o.scenario.checkpointing.value != "none" else "off", o.scenario.batch_size,
                     o.scenario.grad_accum_steps, format_bytes(o.peak_bytes)] for rank, o in enumerate(options)],
        hovertemplate=("#%{customdata[0]}: %{customdata[1]}, %{customdata[2]}, checkpointing %{customdata[3]}, "
                       "%{customdata[4]} x %{customdata[5]}<br>peak %{customdata[6]}, step %{x:.3g} s<extra></extra>"),
    )
    _capacity_line(figure, result.capacity_bytes)
    figure.update_layout(title=plotly_text(title), xaxis_title="estimated step time (s)", yaxis_title="peak (GiB)",
                         showlegend=False)
    return figure
