"""views.figures: the phase breakdown figure, checked against the estimate it draws."""

import pytest

from planner.estimate import estimate
from planner.loading import load_model_shape
from planner.scenario import scenario_from_values
from planner.units import GIB
from views.breakdown import CATEGORY_LABELS
from views.figures import CAPACITY_PREFIX, phase_breakdown_figure


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
