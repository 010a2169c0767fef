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


def _fit_option(optimizer, precision, strategy, peak, step_s, method="full", rank_checkpointing=False):
    import dataclasses
    from types import SimpleNamespace

    from planner.finetune import Method

    scenario = scenario_from_values(task="causal-lm", batch_size=2, seq_len=128, optimizer=optimizer,
                                    precision=precision, gradient_checkpointing=rank_checkpointing)
    scenario = dataclasses.replace(scenario, finetune=dataclasses.replace(scenario.finetune, method=Method(method)))
    return SimpleNamespace(scenario=scenario, strategy=strategy, peak_bytes=peak, step_time_s=step_s)


def _fit_result(options, capacity=16 * GIB):
    from types import SimpleNamespace

    return SimpleNamespace(options=options, capacity_bytes=capacity)


def test_fit_scatter_holds_the_plotly_chart_s_points_legend_and_best():
    """What fits' SVG scatter against fit_options_figure (the report's chart) on the same plans:
    each trace's points in the same group, at the same step time and peak, the best ringed."""
    from planner.strategy import Strategy
    from views.figures import BEST_NAME, fit_options_figure
    from views.svg_charts import fit_options_svg

    options = [_fit_option("adamw", "bf16-mixed", Strategy.DDP, 10 * GIB, 1.0),
               _fit_option("adamw", "bf16-mixed", Strategy.DDP, 11 * GIB, 1.2, rank_checkpointing=True),
               _fit_option("adamw8bit", "bf16-mixed", Strategy.DDP, 8 * GIB, 1.1),
               _fit_option("adamw", "fp32", Strategy.ZERO3, 12 * GIB, 2.0),
               _fit_option("adamw", "fp32", Strategy.ZERO3, 6 * GIB, 2.5, method="lora")]
    result = _fit_result(options)
    root = ET.fromstring(fit_options_svg(result))
    figure = fit_options_figure(result)
    traces = [t for t in figure.data if t.name not in (BEST_NAME,) and t.legendgroup]
    drawn = groups(root, "series")
    assert [(g.get("data-group"), g.get("data-name")) for g in drawn] == [(t.legendgroup, t.name) for t in traces]
    for group, trace in zip(drawn, traces):
        points = groups(group, "option")
        assert [float(p.get("data-step")) for p in points] == list(trace.x)
        assert [int(p.get("data-bytes")) / GIB for p in points] == list(trace.y)
    ranks = [int(p.get("data-rank")) for p in groups(root, "option")]
    assert sorted(ranks) == list(range(1, len(options) + 1))
    # The legend names every group (two strategies: each entry says which), the best and the capacity.
    legend = [g.get("data-name") for g in groups(root, "legend-entry")]
    assert legend[:4] == ["ddp: adamw, bf16-mixed", "ddp: adamw8bit, bf16-mixed", "zero3: adamw, fp32",
                          "zero3: adamw, fp32, lora"]
    assert legend[4] == BEST_NAME and legend[5].endswith("16.00 GiB")
    [best] = [c for c in root.iter(f"{SVG}circle") if c.get("class") == "best"]
    [first] = [p for p in groups(root, "option") if p.get("data-rank") == "1"]
    assert hover(best) == hover(first)
    assert hover(first) == f"#1: ddp, adamw, bf16-mixed, checkpointing off, 2 x 1; peak 10.00 GiB ({10 * GIB:,} bytes), step 1 s"
    lora = [p for p in groups(root, "option") if p.get("data-rank") == "5"][0]
    assert "zero3, lora, adamw, fp32" in hover(lora)


def test_fit_scatter_colours_by_optimizer_and_shapes_by_precision():
    from planner.strategy import Strategy
    from views.svg_charts import fit_options_svg

    options = [_fit_option("adamw", "bf16-mixed", Strategy.SINGLE, 10 * GIB, 1.0),
               _fit_option("adamw", "fp32", Strategy.SINGLE, 12 * GIB, 2.0),
               _fit_option("sgd", "bf16-mixed", Strategy.SINGLE, 8 * GIB, 1.1)]
    root = ET.fromstring(fit_options_svg(_fit_result(options)))

    def mark(rank):
        [point] = [p for p in groups(root, "option") if p.get("data-rank") == str(rank)]
        [shape] = [e for e in point if e.tag != f"{SVG}title"]
        return shape.tag.split("}")[1], shape.get("fill")

    assert mark(1)[1] == mark(2)[1] != mark(3)[1]  # colour: the optimizer
    assert mark(1)[0] == mark(3)[0] != mark(2)[0]  # symbol: the precision
    # One strategy: the legend entries are the groups' own names.
    assert [g.get("data-name") for g in groups(root, "legend-entry")][:3] == [
        "adamw, bf16-mixed", "adamw, fp32", "sgd, bf16-mixed"]


def test_fit_scatter_grows_to_hold_a_long_legend_and_switches_to_log_when_a_plan_dwarfs_another():
    from planner.strategy import Strategy
    from views.svg_charts import fit_options_svg

    optimizers = ["adamw", "adafactor", "hf-adafactor", "adamw8bit", "sgd"]
    precisions = ["fp32", "bf16-mixed", "bf16"]
    methods = ["full", "lora", "qlora"]
    options = [_fit_option(o, p, Strategy.SINGLE, (1 + i) * GIB // 4, 1.0 + i, method=m)
               for i, (o, p, m) in enumerate((o, p, m) for o in optimizers for p in precisions for m in methods)]
    root = ET.fromstring(fit_options_svg(_fit_result(options)))
    height = float(root.get("viewBox").split()[3])
    entries = groups(root, "legend-entry")
    assert len(entries) == len(options) + 2  # every group, the best, the capacity
    lowest = max(float(t.get("y")) for g in entries for t in g.iter(f"{SVG}text"))
    assert lowest < height
    assert LOG_SCALE_NOTE in "".join(root.itertext())  # 45 plans from 0.25 to 11.25 GiB: over 20x
