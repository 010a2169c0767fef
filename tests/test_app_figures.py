"""app_pages.figures: the phase breakdown figure, checked against the estimate it draws."""

import pytest

from app_pages.breakdown import CATEGORY_LABELS
from app_pages.figures import phase_breakdown_figure
from planner.estimate import estimate
from planner.loading import load_model_shape
from planner.scenario import scenario_from_values
from planner.units import GIB


@pytest.fixture(scope="module")
def checkpointed_gpt2():
    # Checkpointing moves the peak to the optimizer step (DESIGN.md): a non-forward peak to mark.
    scenario = scenario_from_values(task="causal-lm", batch_size=2, seq_len=512, gradient_checkpointing=True)
    return estimate(load_model_shape("gpt2", scenario.task), scenario)


def test_bars_stack_each_category_per_phase_in_gib(checkpointed_gpt2):
    result = checkpointed_gpt2
    figure = phase_breakdown_figure(result, 16 * GIB)
    assert figure.layout.barmode == "stack"
    assert [trace.name for trace in figure.data] == list(CATEGORY_LABELS.values())
    for trace, field in zip(figure.data, CATEGORY_LABELS):
        assert list(trace.y) == pytest.approx([getattr(p, field) / GIB for p in result.phases])
        assert [row[0] for row in trace.customdata] == [f"{getattr(p, field):,}" for p in result.phases]
    totals = [sum(trace.y[i] for trace in figure.data) for i in range(len(result.phases))]
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
    assert "capacity 40.00 GiB" in with_line.layout.annotations[0].text
    assert not phase_breakdown_figure(checkpointed_gpt2).layout.shapes
