"""views.figures: the phase breakdown figure, checked against the estimate it draws;
the log scale, the current-scenario marker and What fits' legend on the figure objects.
(The Plan page's SVG versions: test_svg_charts.py.)"""

import dataclasses
from types import SimpleNamespace

import pytest

from planner.estimate import estimate
from planner.finetune import Method
from planner.loading import load_model_shape
from planner.scenario import scenario_from_values
from planner.strategy import Strategy
from planner.units import GIB, format_bytes
from views.breakdown import CATEGORY_LABELS
from views.figures import (
    BEST_NAME,
    CAPACITY_PREFIX,
    CURRENT_PREFIX,
    LOG_SCALE_NOTE,
    LOG_SCALE_RATIO,
    fit_options_figure,
    phase_breakdown_figure,
    wants_log_y,
)


@pytest.fixture(scope="module")
def checkpointed_gpt2():
    # Checkpointing moves the peak to the optimizer step (DESIGN.md): a non-forward peak to mark.
    scenario = scenario_from_values(task="causal-lm", batch_size=2, seq_len=512, gradient_checkpointing=True)
    return estimate(load_model_shape("gpt2", scenario.task), scenario)


def data_traces(figure) -> list:
    """The figure's traces but the capacity line's legend entry (no data of its own)."""
    return [trace for trace in figure.data if not trace.name.startswith(CAPACITY_PREFIX)]


def test_bars_stack_each_category_per_phase_in_gib(checkpointed_gpt2):
    result = checkpointed_gpt2
    figure = phase_breakdown_figure(result, 16 * GIB)
    assert figure.layout.barmode == "stack"
    assert [trace.name for trace in data_traces(figure)] == list(CATEGORY_LABELS.values())
    for trace, field in zip(data_traces(figure), CATEGORY_LABELS):
        assert list(trace.y) == pytest.approx([getattr(p, field) / GIB for p in result.phases])
        assert [row[0] for row in trace.customdata] == [f"{getattr(p, field):,}" for p in result.phases]
    totals = [sum(trace.y[i] for trace in data_traces(figure)) for i in range(len(result.phases))]
    assert totals == pytest.approx([p.total / GIB for p in result.phases])
    assert max(totals) == pytest.approx(result.peak_bytes / GIB)


def test_peak_phase_is_marked(checkpointed_gpt2):
    result = checkpointed_gpt2
    x = list(phase_breakdown_figure(result).data[0].x)
    marked = [label for label in x if label.endswith("(peak)")]
    assert marked == [f"{result.peak_phase.value} (peak)"]
    assert len(x) == len(result.phases)


def test_capacity_line_only_when_given(checkpointed_gpt2):
    with_line = phase_breakdown_figure(checkpointed_gpt2, 40 * GIB)
    assert [shape.y0 for shape in with_line.layout.shapes] == [40.0]
    # Named in the legend, not by a label on the line that the bars reaching it would cover.
    assert not with_line.layout.annotations
    [entry] = [t for t in with_line.data if t.name == "capacity 40.00 GiB"]
    assert entry.line.dash == "dash" and list(entry.y) == [None]
    without = phase_breakdown_figure(checkpointed_gpt2)
    assert not without.layout.shapes and data_traces(without) == list(without.data)


# --- figures of the Plan, Techniques and Verify pages -----------------------------------------

from views.figures import (  # noqa: E402
    category_comparison_figure,
    estimate_vs_measured_scatter,
    memory_vs_batch_figure,
    technique_bars_figure,
)


def _capacity_lines(figure):
    return [shape for shape in figure.layout.shapes if shape.type == "line" and shape.y0 == shape.y1]


def test_memory_vs_batch_has_a_line_per_technique_and_the_capacity():
    series = {"AdamW": [(1, GIB), (2, 2 * GIB), (4, None)], "8-bit": [(1, GIB // 2), (2, GIB), (4, 2 * GIB)]}
    figure = memory_vs_batch_figure(series, 3 * GIB)
    assert [t.name for t in data_traces(figure)] == ["AdamW", "8-bit"]
    assert list(figure.data[0].x) == [1, 2, 4] and list(figure.data[0].y) == [1.0, 2.0, None]
    assert figure.layout.xaxis.type == "log" and "batch" in figure.layout.xaxis.title.text
    assert "GiB" in figure.layout.yaxis.title.text
    assert [line.y0 for line in _capacity_lines(figure)] == [3.0]
    assert not _capacity_lines(memory_vs_batch_figure(series))


def test_technique_bars_group_estimated_and_measured():
    figure = technique_bars_figure(["a", "b"], [GIB, 2 * GIB], [None, GIB], 4 * GIB)
    assert figure.layout.barmode == "group"
    assert [t.name for t in data_traces(figure)] == ["estimated", "measured"]
    assert list(figure.data[0].y) == [1.0, 2.0] and list(figure.data[1].y) == [None, 1.0]
    assert "GiB" in figure.layout.yaxis.title.text
    assert [line.y0 for line in _capacity_lines(figure)] == [4.0]


def test_category_comparison_uses_the_category_labels():
    figure = category_comparison_figure({"weights": GIB, "peak": 2 * GIB}, {"weights": GIB // 2, "peak": GIB})
    assert list(figure.data[0].x) == ["Weights", "Peak (total)"]
    assert list(figure.data[1].y) == [0.5, 1.0]
    assert figure.layout.xaxis.title.text == "category"


def test_scatter_has_y_equals_x_and_a_three_percent_band():
    figure = estimate_vs_measured_scatter([GIB, 2 * GIB], [GIB, GIB], ["r1", "r2"])
    names = [t.name for t in figure.data]
    assert "y = x" in names and "±3% band" in names and "runs" in names
    identity = figure.data[names.index("y = x")]
    assert list(identity.x) == list(identity.y)
    upper, lower = figure.data[0], figure.data[names.index("±3% band")]
    assert upper.y[1] == pytest.approx(upper.x[1] * 1.03) and lower.y[1] == pytest.approx(lower.x[1] * 0.97)
    assert lower.fill == "tonexty"
    runs = figure.data[names.index("runs")]
    assert list(runs.x) == [1.0, 1.0] and list(runs.y) == [1.0, 2.0]
    assert "measured" in figure.layout.xaxis.title.text and "GiB" in figure.layout.yaxis.title.text


# --- A log scale where one line dwarfs the rest (issue 14) ---------------------------------

def test_log_y_axis_when_one_line_dwarfs_the_rest():
    dwarfed = {"AdamW": [(1, 50 * GIB), (2, 100 * GIB)], "LoRA": [(1, GIB), (2, 2 * GIB)]}  # 100x
    figure = memory_vs_batch_figure(dwarfed, 3 * GIB)
    assert figure.layout.yaxis.type == "log"
    assert figure.layout.yaxis.title.text == "peak GiB (2^30 bytes)" + LOG_SCALE_NOTE
    even = {"AdamW": [(1, 2 * GIB), (2, 4 * GIB)], "LoRA": [(1, GIB), (2, 2 * GIB)]}  # 4x
    assert memory_vs_batch_figure(even).layout.yaxis.type != "log"
    assert memory_vs_batch_figure({"AdamW": dwarfed["AdamW"] + [(4, GIB // 100)]}).layout.yaxis.type != "log"
    # Lines that each rise 100x with the batch, neither dwarfing the other: linear.
    rising = {"AdamW": [(1, GIB), (64, 100 * GIB)], "8-bit": [(1, GIB // 2), (64, 60 * GIB)]}
    assert memory_vs_batch_figure(rising).layout.yaxis.type != "log"
    assert memory_vs_batch_figure(dwarfed, log_y=False).layout.yaxis.type != "log"  # the caller may say
    assert memory_vs_batch_figure(even, log_y=True).layout.yaxis.type == "log"


def test_log_y_axis_on_bars_counts_non_zero_bars_only():
    assert technique_bars_figure(["a", "b"], [40 * GIB, GIB], [None, None]).layout.yaxis.type == "log"
    assert technique_bars_figure(["a", "b"], [4 * GIB, GIB], [None, 0]).layout.yaxis.type != "log"
    figure = category_comparison_figure({"weights": 30 * GIB, "temporaries": GIB // 10}, {})
    assert figure.layout.yaxis.type == "log" and figure.layout.xaxis.title.text == "category"
    assert wants_log_y([[1.0, None, 0.0], [LOG_SCALE_RATIO + 0.5]]) and not wants_log_y([[1.0], [LOG_SCALE_RATIO]])
    assert not wants_log_y([[1.0, 100.0]])  # one trace: nothing to dwarf


# --- The user's own scenario on "peak against batch size" --------------------------------

def test_the_current_scenario_is_a_labelled_marker_with_bytes_in_its_hover():
    series = {"AdamW": [(1, GIB), (2, 2 * GIB), (4, 4 * GIB)], "8-bit": [(1, GIB // 2), (2, GIB), (4, 2 * GIB)]}
    peak = 3 * GIB + 12_345
    figure = memory_vs_batch_figure(series, 8 * GIB, current=(2, peak))
    [marker] = [t for t in figure.data if t.name.startswith(CURRENT_PREFIX)]
    assert marker.name == f"{CURRENT_PREFIX} (batch 2)"
    assert list(marker.x) == [2] and list(marker.y) == pytest.approx([peak / GIB])
    assert marker.marker.symbol == "star" and marker.mode == "markers+text"
    assert list(marker.text) == [f"{CURRENT_PREFIX}: {format_bytes(peak)}"]
    assert list(marker.customdata[0]) == [f"{peak:,}", format_bytes(peak)]
    assert "bytes" in marker.hovertemplate and "%{customdata[1]}" in marker.hovertemplate
    assert not [t for t in memory_vs_batch_figure(series).data if t.name.startswith(CURRENT_PREFIX)]
    # The marker is no line: the log-scale choice reads the technique lines only.
    assert memory_vs_batch_figure(series, current=(2, 1000 * GIB)).layout.yaxis.type != "log"


# --- What fits' scatter: a legend by optimizer, precision and strategy --------------------

def _option(optimizer: str, precision: str, strategy: Strategy, peak: int, step_s: float, method: str = "full"):
    scenario = scenario_from_values(task="causal-lm", batch_size=2, seq_len=128, optimizer=optimizer,
                                    precision=precision)
    scenario = dataclasses.replace(scenario, finetune=dataclasses.replace(scenario.finetune, method=Method(method)))
    return SimpleNamespace(scenario=scenario, strategy=strategy, peak_bytes=peak, step_time_s=step_s)


def test_fit_scatter_has_a_legend_by_optimizer_precision_and_strategy():
    options = [_option("adamw", "bf16-mixed", Strategy.DDP, 10 * GIB, 1.0),
               _option("adamw", "bf16-mixed", Strategy.DDP, 11 * GIB, 1.2),
               _option("adam8bit", "bf16-mixed", Strategy.DDP, 8 * GIB, 1.1),
               _option("adamw", "fp32", Strategy.ZERO3, 12 * GIB, 2.0),
               _option("adamw", "fp32", Strategy.ZERO3, 6 * GIB, 2.5, method="lora")]
    figure = fit_options_figure(SimpleNamespace(options=options, capacity_bytes=16 * GIB))
    plans = [t for t in data_traces(figure) if t.name != BEST_NAME]
    assert [(t.legendgroup, t.name, len(t.x)) for t in plans] == [
        ("ddp", "adamw, bf16-mixed", 2), ("ddp", "adam8bit, bf16-mixed", 1),
        ("zero3", "adamw, fp32", 1), ("zero3", "adamw, fp32, lora", 1)]
    assert plans[0].legendgrouptitle.text == "strategy: ddp"
    assert plans[0].marker.color == plans[2].marker.color != plans[1].marker.color  # colour: the optimizer
    assert plans[0].marker.symbol == plans[1].marker.symbol != plans[2].marker.symbol  # symbol: the precision
    assert figure.layout.showlegend is True
    [best] = [t for t in figure.data if t.name == BEST_NAME]
    assert list(best.x) == [1.0] and list(best.y) == [10.0]
    assert f"{10 * GIB:,}" in list(plans[0].customdata[0]) and "bytes" in plans[0].hovertemplate
    assert sum(len(t.x) for t in plans) == len(options)
