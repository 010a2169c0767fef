"""User text in every output channel stays text: the dashboard's Markdown (an uploaded file
name in the model caption), the charts' Plotly pseudo-HTML (a config name in an HTML report
chart title) and CSV cells opened in a spreadsheet (a model name that is a formula).
(views.escaping; the HTML tables' own escaping: test_reliability.py.)
"""

from __future__ import annotations

import csv
import html
import io
from types import SimpleNamespace

import pytest
from markdown_it import MarkdownIt

from app_pages.page_context import model_caption, task_override_note
from app_pages.query_state import decode_with_rejects, rejects_warning
from planner.catalog import catalog_config
from planner.loading import model_shape_for_config
from planner.scenario import Task, scenario_from_values
from planner.strategy import ParallelPlan, Strategy
from reporting.build import build_report, render_report
from runners.history import RunHistory
from tests.conftest import tiny_config
from views.escaping import csv_cell, markdown_text
from views.figures import (
    estimate_vs_measured_scatter,
    memory_vs_batch_figure,
    technique_bars_figure,
)
from views.inputs import DEFAULTS, ModelSource

LINK = '<a href="https://evil.example">click</a>'
MARKDOWN_NAME = "**bold** [click](https://evil.example).json"
FORMULA = '=HYPERLINK("https://evil.example","click")'
HOSTILE_MARKDOWN = [
    MARKDOWN_NAME, LINK, "![img](https://evil.example/x.png)", "`code` ~~gone~~ _it_ *em*", "# heading",
    "- item", "+ item", "1. item", "2) item", "= setext", "> quote", "a | b | c", "line one\n# line two",
    "&lt;b&gt; &amp;", "back\\slash \\*", "<https://evil.example>", "[ref]: https://evil.example",
]
SCENARIO_KEYS = ("batch_size", "seq_len", "optimizer", "precision", "gradient_checkpointing", "grad_accum", "attn",
                 "device", "num_labels")


@pytest.fixture(autouse=True)
def isolated(tmp_path, monkeypatch):
    monkeypatch.setenv("PLANNER_DATA_DIR", str(tmp_path / "data"))


def rendered(markdown: str) -> str:
    """HTML of `markdown` under CommonMark with tables and strikethrough (as GitHub's)."""
    return MarkdownIt("commonmark").enable(["table", "strikethrough"]).render(markdown)


@pytest.mark.parametrize("text", HOSTILE_MARKDOWN)
def test_markdown_text_renders_as_exactly_its_text(text):
    flat = " ".join(text.replace("\n", " ").split())
    # Unescaped, the page is the text itself: markup would have dropped markers or added tags.
    assert html.unescape(rendered(markdown_text(text))) == f"<p>{flat}</p>\n"


@pytest.mark.parametrize(("text", "expected"), [
    ("https://evil.example", "https\\://evil.example"), ("see www.evil.example", "see www\\.evil.example"),
    ("me@evil.example", "me\\@evil.example"), (":red[alarm]", "\\:red\\[alarm\\]"),
    (":material/warning:", "\\:material/warning:"), (":smile:", "\\:smile:"), ("$x^2$", "\\$x^2\\$"),
    ("Model: tiny", "Model: tiny"), ("1.25 GiB", "1.25 GiB"), ("-1.5 %", "-1.5 %"), ("#3 run", "#3 run"),
])
def test_markdown_text_breaks_autolinks_and_streamlit_directives(text, expected):
    # GitHub's autolinks and Streamlit's directives are not CommonMark: the breaks themselves.
    assert markdown_text(text) == expected
    assert html.unescape(rendered(expected)) == f"<p>{text}</p>\n"


def test_uploaded_file_name_in_the_model_caption_is_only_text():
    scenario = scenario_from_values(**({k: DEFAULTS[k] for k in SCENARIO_KEYS} | {"task": "causal-lm"}))
    shape = model_shape_for_config(tiny_config("tiny-llama"), scenario.task, scenario.num_labels, MARKDOWN_NAME)
    page = rendered(model_caption(shape))
    assert "<a" not in page and page.count("<strong>") == 1  # the caption's own bold, around the name
    assert f"<strong>{MARKDOWN_NAME}</strong>" in page
    # With several GPUs the line also names the strategy; the name is still only text.
    page = rendered(model_caption(shape, ParallelPlan(4, Strategy.ZERO2)))
    assert "<a" not in page and f"<strong>{MARKDOWN_NAME}</strong>" in page and "4 GPUs, zero2" in page


def test_the_task_override_note_quotes_the_configs_architecture_as_text():
    """The architecture the note names is the uploaded config's own string."""
    hostile = "[click](https://evil.example)ForCausalLM"
    context = SimpleNamespace(values=SimpleNamespace(model_source=ModelSource.UPLOAD.value),
                              config={"architectures": [hostile]},
                              scenario=SimpleNamespace(task=Task.SEQUENCE_CLASSIFICATION))
    page = rendered(task_override_note(context))
    assert "<a" not in page and hostile in html.unescape(page)


def test_a_links_strategy_is_one_of_its_choices_and_its_warning_quotes_none_of_the_link():
    values, rejected = decode_with_rejects({"strategy": LINK, "gpu_count": "4"})
    assert values == {"gpu_count": 4} and list(rejected) == ["strategy"]
    assert "evil" not in rejects_warning(rejected)
    assert decode_with_rejects({"strategy": "zero3"}) == ({"strategy": "zero3"}, {})


def _report_with_runs(name: str):
    config = catalog_config("gpt2")  # planned from its shipped tables: escaping, not probing, is tested here
    values = {k: DEFAULTS[k] for k in SCENARIO_KEYS} | {"task": "causal-lm"}
    scenario = scenario_from_values(**values)
    shape = model_shape_for_config(config, scenario.task, scenario.num_labels, name)
    history = RunHistory()
    run_id = history.start_run(name, "simulate", {**values, "model_config": config}, {"peak_bytes": 2**20})
    history.finish_run(run_id, "ok", measurement={"peak_bytes": 2**20}, reason=None)
    run_id = history.start_run(name, "simulate", {**values, "model_config": config}, {"peak_bytes": 2**20})
    history.finish_run(run_id, "failed", reason=f"{FORMULA} +1 -2 @SUM(A1)")
    return build_report(shape, values, 16 * 2**30, "16 GiB", 1, history.list_runs(limit=None), config,
                        search_adapters=False)  # escaping, not What fits' LoRA search, is tested here


def _strings(node) -> list[str]:
    if isinstance(node, str):
        return [node]
    if isinstance(node, dict):
        return [s for value in node.values() for s in _strings(value)]
    if isinstance(node, (list, tuple)):
        return [s for value in node for s in _strings(value)]
    return []


def test_config_name_in_html_report_charts_is_not_a_live_link():
    page = render_report(_report_with_runs(LINK), "html")
    # Plotly's JSON writes "<" as \u003c; the tables' html.escape writes "&lt;".
    assert "\\u003ca href" not in page and '<a href="https://evil' not in page
    assert "&lt;a href" in page  # drawn, as text


def test_figure_builders_escape_titles_labels_and_hover_text():
    figures = [memory_vs_batch_figure({LINK: [(1, 2**20)]}, title=LINK),
               technique_bars_figure([LINK], [2**20], [2**20], title=LINK),
               estimate_vs_measured_scatter([2**20], [2**20], [LINK], title=LINK)]
    for figure in figures:
        texts = _strings(figure.to_plotly_json())
        assert not [s for s in texts if "<a" in s], texts


def test_csv_report_has_no_formula_cells():
    text = render_report(_report_with_runs(FORMULA), "csv")
    cells = [cell for row in csv.reader(io.StringIO(text)) for cell in row]
    assert f"'{FORMULA}" in cells
    formulas = [c for c in cells if c[:1] in ("=", "+", "-", "@", "\t", "\r") and not _is_number(c)]
    assert formulas == []


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


@pytest.mark.parametrize(("value", "expected"), [
    ("=1+1", "'=1+1"), ("+1+1", "'+1+1"), ("-1+1", "'-1+1"), ("@SUM(A1)", "'@SUM(A1)"), ("\t=1", "'\t=1"),
    ("\r=1", "'\r=1"), ("-1.5", "-1.5"), ("+3", "+3"), ("plain", "plain"), ("a=b", "a=b"), (-2, -2), (None, None),
])
def test_csv_cell_neutralises_formula_prefixes_only(value, expected):
    assert csv_cell(value) == expected


@pytest.mark.parametrize("name", [LINK, MARKDOWN_NAME, "x' onload='alert(1)", "</svg><script>alert(1)</script>",
                                  "two\n\n[click](https://evil.example) lines"])
def test_svg_charts_draw_names_as_text(name):
    """The Plan page's SVG charts (views.svg_charts) reach the browser through st.markdown with
    HTML allowed: a name in a title, a legend or a hover must stay text, never an element or
    an attribute of its own."""
    import xml.etree.ElementTree as ET

    from views.svg_charts import memory_vs_batch_svg

    svg = memory_vs_batch_svg({name: [(1, 2**20), (2, 2**21)]}, 2**30, title=name, current=(1, 2**20))
    root = ET.fromstring(svg)  # one well-formed element: nothing closed it early
    tags = {element.tag.split("}")[-1] for element in root.iter()}
    assert tags <= {"svg", "text", "line", "g", "polyline", "circle", "polygon", "title", "rect"}, tags
    assert not [e for e in root.iter() if set(e.attrib) - {"x", "y", "x1", "x2", "y1", "y2", "cx", "cy", "r",
                                                              "points", "fill", "stroke", "stroke-width",
                                                              "stroke-dasharray", "font-size", "font-family",
                                                              "font-weight", "text-anchor", "transform", "class",
                                                              "data-name", "data-batches", "data-batch",
                                                              "data-bytes", "viewBox", "width", "height",
                                                              "role", "aria-label", "style"}]
    shown = " ".join(name.split())  # a line break drawn as a space
    assert " ".join(root.get("aria-label").split()) == shown and shown in " ".join("".join(root.itertext()).split())
    page = MarkdownIt("commonmark", {"html": True}).render(svg)  # as the page's Markdown passes it on
    assert "<a " not in page and "<script" not in page
