"""The Plan page's two charts and What fits' scatter as inline SVG drawn on the server: memory
by phase (stacked bars), peak against batch size (a line per technique) and peak against step
time (a point per plan), with the same data, colours, capacity line, log-scale rule and marks
as their Plotly versions in views.figures (which the report and the other pages draw).

Why not Plotly here: the Plan page is the first page of every session. Plotly's chunk is
4.5 MiB of JavaScript that each new browser session fetched and compiled before its charts
could draw, and redrawing two Plotly charts took most of the browser's part of every sidebar
change (benchmarks/browser_speed.py: a first Plan page 2.9 s with them, 1.6 s without; a
sidebar change 0.30-0.35 s, 0.11-0.16 s without). An SVG needs no script at all.

What a chart library gives and these keep: every value on hover (an SVG `<title>`: the
browser's own tooltip, in bytes with units), axis titles with units, a legend. Every drawn
element also carries its values as `data-` attributes (the tests read them). No Streamlit
here: plain functions from planner results to markup.
"""

from __future__ import annotations

import math

from plotly.colors import qualitative

from planner.estimate import Estimate
from planner.parallel import ParallelEstimate
from planner.units import bytes_to_gib, format_bytes
from views.breakdown import category_labels
from views.escaping import svg_text
from views.figures import (
    BEST_NAME,
    CAPACITY_COLOR,
    CATEGORY_COLORS,
    CURRENT_COLOR,
    CURRENT_PREFIX,
    LOG_SCALE_NOTE,
    capacity_label,
    current_label,
    fit_group_name,
    fit_groups,
    fit_hover_text,
    fit_palettes,
    phase_title,
    wants_log_y,
)

WIDTH, HEIGHT = 800, 380
LEFT, RIGHT, TOP, BOTTOM = 64, 270, 44, 56  # the plot's margins; the legend sits in the right one
LEGEND_CHARACTERS = 34  # a longer legend label is cut with an ellipsis (its whole text on hover)
FONT = "font-family='sans-serif'"
# Plotly's default colour sequence, so a technique keeps its colour between this chart and
# the report's and Techniques' Plotly charts.
LINE_COLORS = tuple(qualitative.Plotly)


class _Axis:
    """A linear or log10 value axis onto a pixel range (`low` pixel for the smallest value)."""

    def __init__(self, values: list[float], low_px: float, high_px: float, log: bool) -> None:
        self.log, self.low_px, self.high_px = log, low_px, high_px
        positive = [v for v in values if v > 0]
        if log and positive:
            self.start = 10 ** math.floor(math.log10(min(positive)))
            self.stop = 10 ** math.ceil(math.log10(max(positive)))
            if self.stop <= self.start:
                self.stop = self.start * 10
        else:
            self.log = False
            self.start, self.step = 0.0, _nice_step(max(values, default=0.0))
            self.stop = self.step * math.ceil(max(max(values, default=0.0), self.step) / self.step)

    def px(self, value: float) -> float:
        if self.log:
            value = max(value, self.start)
            share = (math.log10(value) - math.log10(self.start)) / (math.log10(self.stop) - math.log10(self.start))
        else:
            share = (value - self.start) / (self.stop - self.start)
        return self.low_px + share * (self.high_px - self.low_px)

    def ticks(self) -> list[float]:
        if self.log:
            decades = round(math.log10(self.stop / self.start))
            return [self.start * 10 ** k for k in range(decades + 1)]
        count = round((self.stop - self.start) / self.step)
        return [self.start + k * self.step for k in range(count + 1)]


def _nice_step(top: float, ticks: int = 5) -> float:
    """A 1, 2 or 5 x 10^k step giving about `ticks` intervals up to `top`."""
    if top <= 0:
        return 1.0
    raw = top / ticks
    power = 10 ** math.floor(math.log10(raw))
    return next(m * power for m in (1, 2, 5, 10) if m * power >= raw)


def _tick_label(value: float) -> str:
    if value == 0:
        return "0"
    if abs(value) >= 100 or float(value).is_integer():
        return f"{value:,.0f}"
    return f"{value:,.3g}"


def _frame(title: str, x_title: str, y_title: str, y_axis: _Axis, x_ticks: list[tuple[float, str]],
           height: int = HEIGHT) -> list[str]:
    """Title, gridlines with y labels, x tick labels and axis titles."""
    bottom, right = height - BOTTOM, WIDTH - RIGHT
    parts = [f"<text x='{LEFT}' y='22' font-size='15' fill='#1f2937' {FONT}>{svg_text(title)}</text>"]
    for value in y_axis.ticks():
        y = y_axis.px(value)
        parts.append(f"<line x1='{LEFT}' x2='{right}' y1='{y:.1f}' y2='{y:.1f}' stroke='#e5e7eb'/>")
        parts.append(f"<text x='{LEFT - 6}' y='{y + 4:.1f}' font-size='11' text-anchor='end' fill='#4b5563' "
                     f"{FONT}>{svg_text(_tick_label(value))}</text>")
    parts.append(f"<line x1='{LEFT}' x2='{right}' y1='{bottom}' y2='{bottom}' stroke='#9ca3af'/>")
    for x, label in x_ticks:
        parts.append(f"<text x='{x:.1f}' y='{bottom + 16}' font-size='11' text-anchor='middle' fill='#4b5563' "
                     f"{FONT}>{svg_text(label)}</text>")
    parts.append(f"<text x='{(LEFT + right) / 2:.1f}' y='{height - 12}' font-size='12' text-anchor='middle' "
                 f"fill='#374151' {FONT}>{svg_text(x_title)}</text>")
    middle = (TOP + bottom) / 2
    parts.append(f"<text x='14' y='{middle:.1f}' font-size='12' text-anchor='middle' fill='#374151' {FONT} "
                 f"transform='rotate(-90 14 {middle:.1f})'>{svg_text(y_title)}</text>")
    return parts


def _legend(title: str, entries: list[tuple[str, str, str]]) -> list[str]:
    """Entries (label, colour, kind: 'box', 'line', 'dash' or 'star') down the right margin."""
    x = WIDTH - RIGHT + 18
    parts = [f"<text x='{x}' y='{TOP + 4}' font-size='12' fill='#374151' font-weight='bold' {FONT}>"
             f"{svg_text(title)}</text>"]
    for row, (label, color, kind) in enumerate(entries):
        y = TOP + 24 + 20 * row
        if kind == "box":
            swatch = f"<rect x='{x}' y='{y - 9}' width='14' height='10' fill='{color}'/>"
        elif kind == "star":
            swatch = _star(x + 7, y - 4, 6, color)
        elif kind.startswith("marker:"):
            swatch = _marker(x + 7, y - 4, 5, color, kind.split(":", 1)[1])
        elif kind == "ring":
            swatch = f"<circle cx='{x + 7}' cy='{y - 4}' r='6' fill='none' stroke='{color}' stroke-width='2'/>"
        else:
            dash = " stroke-dasharray='5 3'" if kind == "dash" else ""
            swatch = f"<line x1='{x}' x2='{x + 16}' y1='{y - 4}' y2='{y - 4}' stroke='{color}' stroke-width='2'{dash}/>"
        shown = label if len(label) <= LEGEND_CHARACTERS else label[:LEGEND_CHARACTERS - 1].rstrip() + "…"
        parts.append(f"<g class='legend-entry' data-name='{svg_text(label)}'>{swatch}<text x='{x + 22}' y='{y}' "
                     f"font-size='12' fill='#1f2937' {FONT}>{svg_text(shown)}</text><title>{svg_text(label)}</title></g>")
    return parts


def _capacity(y_axis: _Axis, capacity_bytes: int | None) -> tuple[list[str], list[tuple[str, str, str]]]:
    if capacity_bytes is None:
        return [], []
    label = capacity_label(capacity_bytes)
    y = y_axis.px(bytes_to_gib(capacity_bytes))
    line = (f"<line class='capacity' data-bytes='{capacity_bytes}' x1='{LEFT}' x2='{WIDTH - RIGHT}' y1='{y:.1f}' "
            f"y2='{y:.1f}' stroke='{CAPACITY_COLOR}' stroke-width='2' stroke-dasharray='6 4'>"
            f"<title>{svg_text(f'{label} ({capacity_bytes:,} bytes)')}</title></line>")
    return [line], [(label, CAPACITY_COLOR, "dash")]


def _marker(cx: float, cy: float, radius: float, color: str, symbol: str) -> str:
    """One of views.figures.PRECISION_SYMBOLS (Plotly's names) at (cx, cy)."""
    r = radius
    if symbol == "square":
        return f"<rect x='{cx - r:.1f}' y='{cy - r:.1f}' width='{2 * r:.1f}' height='{2 * r:.1f}' fill='{color}'/>"
    if symbol == "diamond":
        points = f"{cx:.1f},{cy - r * 1.3:.1f} {cx + r * 1.3:.1f},{cy:.1f} {cx:.1f},{cy + r * 1.3:.1f} {cx - r * 1.3:.1f},{cy:.1f}"
        return f"<polygon points='{points}' fill='{color}'/>"
    if symbol == "triangle-up":
        points = f"{cx:.1f},{cy - r * 1.2:.1f} {cx + r * 1.2:.1f},{cy + r:.1f} {cx - r * 1.2:.1f},{cy + r:.1f}"
        return f"<polygon points='{points}' fill='{color}'/>"
    if symbol in ("cross", "x"):
        turn = f" transform='rotate(45 {cx:.1f} {cy:.1f})'" if symbol == "x" else ""
        return (f"<polygon points='{cx - r / 3:.1f},{cy - r:.1f} {cx + r / 3:.1f},{cy - r:.1f} {cx + r / 3:.1f},"
                f"{cy - r / 3:.1f} {cx + r:.1f},{cy - r / 3:.1f} {cx + r:.1f},{cy + r / 3:.1f} {cx + r / 3:.1f},"
                f"{cy + r / 3:.1f} {cx + r / 3:.1f},{cy + r:.1f} {cx - r / 3:.1f},{cy + r:.1f} {cx - r / 3:.1f},"
                f"{cy + r / 3:.1f} {cx - r:.1f},{cy + r / 3:.1f} {cx - r:.1f},{cy - r / 3:.1f} {cx - r / 3:.1f},"
                f"{cy - r / 3:.1f}' fill='{color}'{turn}/>")
    return f"<circle cx='{cx:.1f}' cy='{cy:.1f}' r='{r:.1f}' fill='{color}'/>"


def _star(cx: float, cy: float, radius: float, color: str) -> str:
    points = []
    for k in range(10):
        r = radius if k % 2 == 0 else radius * 0.45
        angle = math.pi / 2 + k * math.pi / 5
        points.append(f"{cx + r * math.cos(angle):.1f},{cy - r * math.sin(angle):.1f}")
    return f"<polygon points='{' '.join(points)}' fill='{color}' stroke='#ffffff' stroke-width='1'/>"


def _svg(label: str, parts: list[str], height: int = HEIGHT) -> str:
    """The chart as one CommonMark HTML block (type 7: an open tag alone on its first line, no
    blank line until its end), so that a Markdown renderer passes it on whole: on one line it
    would be a paragraph, and Markdown in a name (`[text](url)`) would become a link inside it."""
    return (f"<svg class='plan-chart' xmlns='http://www.w3.org/2000/svg' viewBox='0 0 {WIDTH} {height}' "
            f"width='100%' role='img' aria-label='{svg_text(label)}' style='max-width:{WIDTH * 1.4:.0f}px'>\n"
            + "\n".join(parts) + "\n</svg>")


def phase_breakdown_svg(result: Estimate | ParallelEstimate, capacity_bytes: int | None = None) -> str:
    """Stacked bars of live memory by category at each phase of one optimizer step (GiB),
    on one device or on one GPU under a strategy, the peak phase marked, and the capacity
    as a dashed line (views.figures.phase_breakdown_figure's chart)."""
    peak = result.peak
    categories = category_labels(result)
    totals = [bytes_to_gib(p.total) for p in result.phases]
    y_axis = _Axis(totals + ([bytes_to_gib(capacity_bytes)] if capacity_bytes is not None else []),
                   HEIGHT - BOTTOM, TOP, log=False)
    slot = (WIDTH - RIGHT - LEFT) / max(len(result.phases), 1)
    names = [f"{p.phase.value} (peak)" if p is peak else p.phase.value for p in result.phases]
    title = phase_title(result)
    parts = _frame(title, "phase of one optimizer step", "GiB (2^30 bytes)", y_axis,
                   [(LEFT + slot * (i + 0.5), name) for i, name in enumerate(names)])
    for i, (phase, name) in enumerate(zip(result.phases, names)):
        x, height_so_far = LEFT + slot * (i + 0.2), 0
        parts.append(f"<g class='bar' data-phase='{svg_text(name)}' data-total='{phase.total}'>")
        for field, label in categories.items():
            size = getattr(phase, field)
            if size <= 0:
                continue
            top, bottom = y_axis.px(bytes_to_gib(height_so_far + size)), y_axis.px(bytes_to_gib(height_so_far))
            parts.append(f"<rect data-category='{svg_text(label)}' data-bytes='{size}' x='{x:.1f}' y='{top:.1f}' "
                         f"width='{slot * 0.6:.1f}' height='{max(bottom - top, 0.5):.1f}' "
                         f"fill='{CATEGORY_COLORS[field]}'><title>{svg_text(f'{name}: {label} {format_bytes(size)} ({size:,} bytes)')}"
                         f"</title></rect>")
            height_so_far += size
        parts.append("</g>")
    capacity, capacity_entry = _capacity(y_axis, capacity_bytes)
    parts += capacity
    parts += _legend("category", [(label, CATEGORY_COLORS[field], "box") for field, label in categories.items()]
                     + capacity_entry)
    return _svg(title, parts)


def memory_vs_batch_svg(series: dict[str, list[tuple[int, int | None]]], capacity_bytes: int | None = None,
                        title: str = "Peak memory against batch size",
                        current: tuple[int, int] | None = None, log_y: bool | None = None) -> str:
    """One line per technique: peak (GiB) against effective batch size on a log2 axis, the
    capacity line, and `current` (effective batch, peak bytes), the user's own plan, as a
    labelled star (views.figures.memory_vs_batch_figure's chart). A None peak leaves a gap.
    `log_y` None: a log y-axis when one line dwarfs the rest (views.figures.wants_log_y)."""
    lines = [[None if peak is None else bytes_to_gib(peak) for _, peak in points] for points in series.values()]
    if log_y is None:
        log_y = wants_log_y(lines)
    values = [v for line in lines for v in line if v is not None]
    values += [bytes_to_gib(capacity_bytes)] if capacity_bytes is not None else []
    values += [bytes_to_gib(current[1])] if current is not None else []
    y_axis = _Axis(values, HEIGHT - BOTTOM, TOP, log=log_y)
    drawn_batches = {b for points in series.values() for b, _ in points}
    batches = sorted(drawn_batches | ({current[0]} if current else set()))
    low, high = math.log2(min(batches, default=1)), math.log2(max(batches, default=2))
    high = high if high > low else low + 1

    def x_px(batch: int) -> float:
        return LEFT + 16 + (math.log2(batch) - low) / (high - low) * (WIDTH - RIGHT - LEFT - 32)

    y_title = "peak GiB (2^30 bytes)" + (LOG_SCALE_NOTE if y_axis.log else "")
    parts = _frame(title, "effective batch size (sequences per optimizer step)", y_title, y_axis,
                   [(x_px(b), f"{b:,}") for b in batches if b in drawn_batches])
    entries = []
    for k, (label, points) in enumerate(series.items()):
        color = LINE_COLORS[k % len(LINE_COLORS)]
        entries.append((label, color, "line"))
        parts.append(f"<g class='series' data-name='{svg_text(label)}' data-batches='{' '.join(str(b) for b, _ in points)}'>")
        run: list[str] = []
        for batch, peak in [*points, (None, None)]:
            if peak is None:
                if len(run) > 1:
                    parts.append(f"<polyline points='{' '.join(run)}' fill='none' stroke='{color}' stroke-width='2'/>")
                run = []
                continue
            x, y = x_px(batch), y_axis.px(bytes_to_gib(peak))
            run.append(f"{x:.1f},{y:.1f}")
        for batch, peak in points:
            if peak is None:
                continue
            x, y = x_px(batch), y_axis.px(bytes_to_gib(peak))
            parts.append(f"<circle data-batch='{batch}' data-bytes='{peak}' cx='{x:.1f}' cy='{y:.1f}' r='3.5' "
                         f"fill='{color}'><title>{svg_text(f'{label}: batch {batch:,}, {format_bytes(peak)} ({peak:,} bytes)')}"
                         f"</title></circle>")
        parts.append("</g>")
    capacity, capacity_entry = _capacity(y_axis, capacity_bytes)
    parts += capacity
    if current is not None:
        batch, peak = current
        x, y = x_px(batch), y_axis.px(bytes_to_gib(peak))
        text = f"{CURRENT_PREFIX}: {format_bytes(peak)}"
        parts.append(f"<g class='current' data-batch='{batch}' data-bytes='{peak}'>{_star(x, y, 9, CURRENT_COLOR)}"
                     f"<text x='{x:.1f}' y='{y - 13:.1f}' font-size='12' text-anchor='middle' fill='{CURRENT_COLOR}' "
                     f"{FONT}>{svg_text(text)}</text><title>{svg_text(f'{text} ({peak:,} bytes), effective batch {batch:,}')}"
                     f"</title></g>")
        entries.append((current_label(batch), CURRENT_COLOR, "star"))
    parts += _legend("technique", entries + capacity_entry)
    return _svg(title, parts)


def fit_options_svg(result, title: str = "Technique combinations: peak against step time") -> str:
    """What fits' scatter (views.figures.fit_options_figure's chart): one point per combination
    that fits (planner.fit.FitResult), estimated step time against peak (GiB), colour by
    optimizer, symbol by precision, a legend entry per strategy, optimizer, precision and
    method (the Plotly chart's traces), the best plan ringed and the capacity line. The chart
    grows taller when its legend needs the room."""
    options = result.options
    colors, symbols = fit_palettes(options)
    groups = fit_groups(options)
    several = len({strategy for strategy, *_ in groups}) > 1  # then each entry names its strategy
    legend = [((f"{strategy}: " if several else "") + fit_group_name(optimizer, precision, method),
               colors[optimizer], f"marker:{symbols[precision]}")
              for strategy, optimizer, precision, method in groups]
    height = max(HEIGHT, TOP + 24 + 20 * (len(legend) + 2) + 8)  # every group, the best, the capacity
    gib = [bytes_to_gib(o.peak_bytes) for o in options]
    capacity = result.capacity_bytes
    y_axis = _Axis(gib + ([bytes_to_gib(capacity)] if capacity is not None else []), height - BOTTOM, TOP,
                   log=wants_log_y([[v] for v in gib]))
    x_axis = _Axis([o.step_time_s for o in options], LEFT + 16, WIDTH - RIGHT - 16, log=False)
    y_title = "peak GiB (2^30 bytes)" + (LOG_SCALE_NOTE if y_axis.log else "")
    parts = _frame(title, "estimated step time (s)", y_title, y_axis,
                   [(x_axis.px(t), _tick_label(t)) for t in x_axis.ticks()], height)
    for (strategy, optimizer, precision, method), members in groups.items():
        name = fit_group_name(optimizer, precision, method)
        parts.append(f"<g class='series' data-name='{svg_text(name)}' data-group='{svg_text(strategy)}'>")
        for rank, option in members:
            x, y = x_axis.px(option.step_time_s), y_axis.px(bytes_to_gib(option.peak_bytes))
            parts.append(f"<g class='option' data-rank='{rank + 1}' data-bytes='{option.peak_bytes}' "
                         f"data-step='{option.step_time_s!r}'>{_marker(x, y, 5, colors[optimizer], symbols[precision])}"
                         f"<title>{svg_text(fit_hover_text(rank, option))}</title></g>")
        parts.append("</g>")
    if options:
        best = options[0]
        x, y = x_axis.px(best.step_time_s), y_axis.px(bytes_to_gib(best.peak_bytes))
        parts.append(f"<circle class='best' data-rank='1' cx='{x:.1f}' cy='{y:.1f}' r='10' fill='none' "
                     f"stroke='{CAPACITY_COLOR}' stroke-width='2'><title>{svg_text(fit_hover_text(0, best))}</title>"
                     "</circle>")
    capacity_parts, capacity_entry = _capacity(y_axis, capacity)
    parts += capacity_parts
    parts += _legend("optimizer, precision", legend + [(BEST_NAME, CAPACITY_COLOR, "ring")] + capacity_entry)
    return _svg(title, parts, height)
