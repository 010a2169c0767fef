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
CURRENT_COLOR = "#dc2626"  # the user's own plan, marked on "peak against batch size"

# A log y-axis when one trace dwarfs the rest: the tallest trace's top over the lowest
# trace's top (non-zero values only), across the data traces of a chart with several of them
# (the capacity line and the user's marker excluded). Trace tops, not all points: a line
# rising 50x from batch 1 to 64 dwarfs no other line, and its chart stays linear.
LOG_SCALE_RATIO = 20.0
LOG_SCALE_NOTE = " (log scale)"


def wants_log_y(traces_values) -> bool:
    """Whether a chart of several traces (each an iterable of y values, None for a gap; a
    bar chart passes one per bar) needs a log y-axis: its tallest trace reaches more than
    LOG_SCALE_RATIO x as high as its lowest non-zero one."""
    tops = [max((v for v in values if v is not None and v > 0), default=None) for values in traces_values]
    tops = [top for top in tops if top is not None]
    return len(tops) >= 2 and max(tops) > LOG_SCALE_RATIO * min(tops)


def _log_y_when_dwarfed(figure: go.Figure, log_y: bool | None, traces=None) -> go.Figure:
    """Switch `figure`'s y-axis to log when `log_y` (None: when wants_log_y over its data
    traces, or over `traces` when given), saying so in the axis title."""
    if log_y is None:
        if traces is None:
            traces = [t.y or () for t in figure.data if not (t.name or "").startswith(CAPACITY_PREFIX)]
        log_y = wants_log_y(traces)
    if log_y:
        title = figure.layout.yaxis.title.text or ""
        figure.update_yaxes(type="log", title_text=title + LOG_SCALE_NOTE)
    return figure

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
        title=plotly_text(phase_title(result)),
        yaxis_title="GiB (2^30 bytes)",
        xaxis_title="phase of one optimizer step",
        legend_title_text="category",
        margin=dict(t=60, b=40),
    )
    return figure


def phase_title(result: Estimate | ParallelEstimate) -> str:
    """The memory-by-phase chart's title, as plain text (each renderer escapes it)."""
    if isinstance(result, ParallelEstimate):
        plan = result.plan
        return (f"{result.base.model_name} on {plan.num_devices} GPUs, {plan.strategy.value}: "
                f"memory per GPU by phase, peak {format_bytes(peak_bytes(result))}")
    return f"{result.model_name}: memory by phase, peak {format_bytes(result.peak_bytes)}"


CAPACITY_PREFIX = "capacity "  # the legend entry of the capacity line: "capacity 15.00 GiB"


def capacity_label(capacity_bytes: int) -> str:
    """The capacity line's legend entry (Plotly's and the Plan page's SVG charts)."""
    return f"{CAPACITY_PREFIX}{bytes_to_gib(capacity_bytes):,.2f} GiB"


def _capacity_line(figure: go.Figure, capacity_bytes: int | None) -> None:
    """The capacity as a dashed line across the plot, named in the legend: a label on the
    line itself sits over the bars that reach it."""
    if capacity_bytes is None:
        return
    line = dict(color=CAPACITY_COLOR, dash="dash", width=2)
    figure.add_hline(y=bytes_to_gib(capacity_bytes), line=line)
    figure.add_scatter(x=[None], y=[None], mode="lines", line=line, hoverinfo="skip",
                       name=capacity_label(capacity_bytes))


CURRENT_PREFIX = "your plan"  # the legend entry of the user's own scenario on memory_vs_batch_figure


def current_label(effective_batch: int) -> str:
    """The legend entry of the user's own scenario (Plotly's and the Plan page's SVG chart)."""
    return f"{CURRENT_PREFIX} (batch {effective_batch:,})"


def memory_vs_batch_figure(series: dict[str, list[tuple[int, int | None]]], capacity_bytes: int | None = None,
                           title: str = "Peak memory against batch size",
                           current: tuple[int, int] | None = None, log_y: bool | None = None) -> go.Figure:
    """One line per technique: peak (GiB) against effective batch size (log2 axis), and the capacity line.
    A None peak (not estimable) leaves a gap. `current` (effective batch, peak bytes): the
    user's own scenario, a labelled marker. `log_y` None: a log y-axis when one line dwarfs
    the rest (wants_log_y)."""
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
    lines = [list(t.y) for t in figure.data]
    if current is not None:
        _current_marker(figure, *current)
    _capacity_line(figure, capacity_bytes)
    figure.update_layout(
        title=plotly_text(title),
        xaxis=dict(title="effective batch size (sequences per optimizer step)", type="log", dtick=0.30102999566),
        yaxis_title="peak GiB (2^30 bytes)", legend_title_text="technique", margin=dict(t=60, b=40),
    )
    return _log_y_when_dwarfed(figure, log_y, lines)


def _current_marker(figure: go.Figure, effective_batch: int, peak: int) -> None:
    """The user's scenario as one labelled star, its hover in bytes with units."""
    text = f"{CURRENT_PREFIX}: {format_bytes(peak)}"
    figure.add_scatter(
        name=current_label(effective_batch), x=[effective_batch], y=[bytes_to_gib(peak)],
        mode="markers+text", text=[text], textposition="top center", textfont={"color": CURRENT_COLOR},
        marker={"symbol": "star", "size": 16, "color": CURRENT_COLOR, "line": {"color": "#ffffff", "width": 1}},
        customdata=[[f"{peak:,}", format_bytes(peak)]],
        hovertemplate=(f"{CURRENT_PREFIX}<br>effective batch %{{x:,}}: peak %{{customdata[1]}} "
                       "(%{customdata[0]} bytes)<extra></extra>"),
    )


def technique_bars_figure(labels: list[str], estimated: list[int | None], measured: list[int | None],
                          capacity_bytes: int | None = None, title: str = "Peak by technique",
                          log_y: bool | None = None) -> go.Figure:
    """Grouped bars per technique: estimated and measured peak (GiB), and the capacity line;
    a log y-axis when one bar dwarfs the rest (`log_y` None: wants_log_y over the bars)."""
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
    # Several bars, measured or not: one technique's bar can dwarf the others' alone.
    bars = [[v] for v in (*estimated, *measured) if v is not None]
    return _log_y_when_dwarfed(figure, log_y, bars)


def category_comparison_figure(estimated: dict[str, int | None], measured: dict[str, int | None],
                               title: str = "Estimated against measured, by category") -> go.Figure:
    """Grouped bars per memory category (keys of CATEGORY_LABELS, plus "peak"), in GiB."""
    keys = [k for k in (*CATEGORY_LABELS, "peak") if k in estimated or k in measured]
    labels = [CATEGORY_LABELS.get(k, "Peak (total)") for k in keys]
    figure = technique_bars_figure(labels, [estimated.get(k) for k in keys], [measured.get(k) for k in keys],
                                   title=title)
    return figure.update_layout(xaxis_title="category")


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


# What fits' scatter: colour by optimizer, symbol by precision, a legend group per strategy.
OPTIMIZER_COLORS = ("#2563eb", "#f59e0b", "#10b981", "#8b5cf6", "#ef4444", "#0891b2", "#db2777", "#65a30d")
PRECISION_SYMBOLS = ("circle", "square", "diamond", "triangle-up", "cross", "x")
BEST_NAME = "best (#1)"


def _palette(values, choices) -> dict:
    """One choice per distinct value, in first-seen order (cycling when there are more)."""
    distinct = list(dict.fromkeys(values))
    return {value: choices[i % len(choices)] for i, value in enumerate(distinct)}


def fit_palettes(options) -> tuple[dict, dict]:
    """(optimizer -> colour, precision -> marker symbol) for What fits' scatter, in rank order."""
    return (_palette([o.scenario.optimizer.value for o in options], OPTIMIZER_COLORS),
            _palette([o.scenario.precision.value for o in options], PRECISION_SYMBOLS))


def fit_groups(options) -> dict[tuple[str, str, str, str], list[tuple[int, object]]]:
    """(strategy, optimizer, precision, fine-tuning method) -> [(rank from 0, option)], in rank
    order: one legend entry each on What fits' scatter."""
    groups: dict[tuple[str, str, str, str], list[tuple[int, object]]] = {}
    for rank, option in enumerate(options):
        s = option.scenario
        groups.setdefault((option.strategy.value, s.optimizer.value, s.precision.value, s.finetune.method.value),
                          []).append((rank, option))
    return groups


def fit_group_name(optimizer: str, precision: str, method: str) -> str:
    return f"{optimizer}, {precision}" + ("" if method == "full" else f", {method}")


def fit_hover_text(rank: int, option) -> str:
    """One plan in words, as the scatter's hover shows it (`rank` from 0)."""
    s = option.scenario
    checkpointing = "on" if s.checkpointing.value != "none" else "off"
    method = f"{s.finetune.method.value}, " if s.finetune.uses_adapters else ""
    return (f"#{rank + 1}: {option.strategy.value}, {method}{s.optimizer.value}, {s.precision.value}, checkpointing "
            f"{checkpointing}, {s.batch_size} x {s.grad_accum_steps}; peak {format_bytes(option.peak_bytes)} "
            f"({option.peak_bytes:,} bytes), step {option.step_time_s:.3g} s")


def fit_options_figure(result, title: str = "Technique combinations: peak against step time",
                       log_y: bool | None = None) -> go.Figure:
    """One point per combination that fits (planner.fit.FitResult): estimated step time
    against peak (GiB), the capacity line, and the best ringed. One trace per optimizer,
    precision and strategy: colour by optimizer, symbol by precision, grouped in the legend
    by strategy, so the plans can be told apart."""
    figure = go.Figure()
    options = result.options
    colors, symbols = fit_palettes(options)
    for (strategy, optimizer, precision, method), members in fit_groups(options).items():
        figure.add_scatter(
            x=[o.step_time_s for _, o in members],
            y=[bytes_to_gib(o.peak_bytes) for _, o in members],
            mode="markers",
            name=fit_group_name(optimizer, precision, method),
            legendgroup=strategy, legendgrouptitle_text=f"strategy: {strategy}",
            marker={"size": 10, "color": colors[optimizer], "symbol": symbols[precision]},
            customdata=[_fit_hover(rank, o) for rank, o in members],
            hovertemplate=_FIT_HOVER,
        )
    if options:
        best = options[0]
        figure.add_scatter(x=[best.step_time_s], y=[bytes_to_gib(best.peak_bytes)], mode="markers", name=BEST_NAME,
                           marker={"size": 18, "color": "rgba(0,0,0,0)", "line": {"color": CAPACITY_COLOR, "width": 2}},
                           customdata=[_fit_hover(0, best)], hovertemplate=_FIT_HOVER)
    _capacity_line(figure, result.capacity_bytes)
    figure.update_layout(title=plotly_text(title), xaxis_title="estimated step time (s)",
                         yaxis_title="peak GiB (2^30 bytes)", showlegend=True,
                         legend_title_text="optimizer, precision (colour, symbol)")
    points = [[bytes_to_gib(o.peak_bytes)] for o in options]
    return _log_y_when_dwarfed(figure, log_y, points)


_FIT_HOVER = ("#%{customdata[0]}: %{customdata[7]}, %{customdata[1]}, %{customdata[2]}, checkpointing "
              "%{customdata[3]}, %{customdata[4]} x %{customdata[5]}<br>peak %{customdata[6]} "
              "(%{customdata[8]} bytes), step %{x:.3g} s<extra></extra>")


def _fit_hover(rank: int, option) -> list:
    s = option.scenario
    return [rank + 1, s.optimizer.value, s.precision.value, "on" if s.checkpointing.value != "none" else "off",
            s.batch_size, s.grad_accum_steps, format_bytes(option.peak_bytes), option.strategy.value,
            f"{option.peak_bytes:,}"]
