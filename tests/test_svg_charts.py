"""views.svg_charts: the Plan page's charts drawn as SVG, checked against the estimate they
draw and against their Plotly versions in views.figures (the report's): the same values, the
same legend, the same log-scale rule, every value on hover with units, and names drawn as text.
"""

import xml.etree.ElementTree as ET

import pytest

from planner.estimate import estimate
from planner.loading import load_model_shape
from planner.scenario import scenario_from_values
from planner.units import GIB, format_bytes
from views.breakdown import CATEGORY_LABELS
from views.figures import CAPACITY_PREFIX, LOG_SCALE_NOTE, memory_vs_batch_figure
from views.svg_charts import BOTTOM, HEIGHT, TOP, memory_vs_batch_svg, phase_breakdown_svg

SVG = "{http://www.w3.org/2000/svg}"


@pytest.fixture(scope="module")
def checkpointed_gpt2():
    # Checkpointing moves the peak to the optimizer step (DESIGN.md): a non-forward peak to mark.
    scenario = scenario_from_values(task="causal-lm", batch_size=2, seq_len=512, gradient_checkpointing=True)
    return estimate(load_model_shape("gpt2", scenario.task), scenario)


def groups(root, kind: str) -> list:
    return [g for g in root.iter(f"{SVG}g") if g.get("class") == kind]


def hover(element) -> str:
    return element.find(f"{SVG}title").text


def test_bars_stack_each_category_per_phase_to_the_phase_total(checkpointed_gpt2):
    result = checkpointed_gpt2
    root = ET.fromstring(phase_breakdown_svg(result, 16 * GIB))
    bars = groups(root, "bar")
    assert [int(bar.get("data-total")) for bar in bars] == [p.total for p in result.phases]
    for bar, phase in zip(bars, result.phases):
        drawn = {rect.get("data-category"): int(rect.get("data-bytes")) for rect in bar.iter(f"{SVG}rect")}
        expected = {label: getattr(phase, field) for field, label in CATEGORY_LABELS.items() if getattr(phase, field)}
        assert drawn == expected
        for rect in bar.iter(f"{SVG}rect"):  # each on hover: its phase, category, size with units and bytes
            size = int(rect.get("data-bytes"))
            assert hover(rect).endswith(f"{format_bytes(size)} ({size:,} bytes)")
    # Heights in proportion: the peak phase's stack is the tallest, and reaches its own total.
    tops = [min(float(r.get("y")) for r in bar.iter(f"{SVG}rect")) for bar in bars]
    assert tops.index(min(tops)) == list(result.phases).index(result.peak)
    marked = [bar.get("data-phase") for bar in bars if bar.get("data-phase").endswith("(peak)")]
    assert marked == [f"{result.peak_phase.value} (peak)"]


def test_capacity_line_sits_at_the_capacity_and_only_when_given(checkpointed_gpt2):
    drawn = ET.fromstring(phase_breakdown_svg(checkpointed_gpt2, 16 * GIB))
    [line] = [line for line in drawn.iter(f"{SVG}line") if line.get("class") == "capacity"]
    assert int(line.get("data-bytes")) == 16 * GIB
    assert TOP <= float(line.get("y1")) < HEIGHT - BOTTOM
    assert [g.get("data-name") for g in groups(drawn, "legend-entry")][-1] == f"{CAPACITY_PREFIX}16.00 GiB"
    bare = ET.fromstring(phase_breakdown_svg(checkpointed_gpt2))
    assert not [line for line in bare.iter(f"{SVG}line") if line.get("class") == "capacity"]


SERIES = {"AdamW fp32 (baseline)": [(1, 3 * GIB), (2, 5 * GIB), (4, None), (8, 13 * GIB)],
          "8-bit Adam + bf16 mixed + checkpointing + accumulation": [(1, 2 * GIB), (2, 2 * GIB + 1), (4, 3 * GIB),
                                                                    (8, 4 * GIB)]}


def test_lines_hold_the_values_and_legend_of_the_plotly_chart():
    current = (4, 3 * GIB + 12345)
    root = ET.fromstring(memory_vs_batch_svg(SERIES, 24 * GIB, title="gpt2 <b>x</b>", current=current))
    figure = memory_vs_batch_figure(SERIES, 24 * GIB, title="gpt2 <b>x</b>", current=current)
    assert [g.get("data-name") for g in groups(root, "legend-entry")] == [trace.name for trace in figure.data]
    for group, (label, points) in zip(groups(root, "series"), SERIES.items()):
        assert group.get("data-name") == label
        assert [int(b) for b in group.get("data-batches").split()] == [b for b, _ in points]
        drawn = [(int(c.get("data-batch")), int(c.get("data-bytes"))) for c in group.iter(f"{SVG}circle")]
        assert drawn == [(b, p) for b, p in points if p is not None]  # a None peak is a gap
    # The gap splits the baseline's line in two: batch 4 is not joined to its neighbours.
    assert len(list(groups(root, "series")[0].iter(f"{SVG}polyline"))) == 1  # 1-2; 8 alone is a point
    [marker] = groups(root, "current")
    assert (int(marker.get("data-batch")), int(marker.get("data-bytes"))) == current
    assert f"{current[1]:,} bytes" in hover(marker) and format_bytes(current[1]) in hover(marker)
    assert root.get("aria-label") == "gpt2 <b>x</b>"  # a name is text, never markup


def test_log_scale_follows_the_plotly_rule():
    dwarfed = {"large": [(1, 40 * GIB), (2, 80 * GIB)], "small": [(1, GIB // 10), (2, GIB // 5)]}
    close = {"a": [(1, 4 * GIB), (2, 8 * GIB)], "b": [(1, 2 * GIB), (2, 3 * GIB)]}
    for series in (dwarfed, close):
        text = "".join(ET.fromstring(memory_vs_batch_svg(series)).itertext())
        plotly_log = memory_vs_batch_figure(series).layout.yaxis.type == "log"
        assert (LOG_SCALE_NOTE in text) == plotly_log
    assert LOG_SCALE_NOTE in "".join(ET.fromstring(memory_vs_batch_svg(dwarfed)).itertext())


def test_a_long_legend_label_is_cut_and_whole_on_hover():
    root = ET.fromstring(memory_vs_batch_svg(SERIES))
    entry = groups(root, "legend-entry")[1]
    label = "8-bit Adam + bf16 mixed + checkpointing + accumulation"
    assert entry.get("data-name") == label and hover(entry) == label
    assert entry.find(f"{SVG}text").text.endswith("…") and len(entry.find(f"{SVG}text").text) < len(label)
