"""The What fits page through AppTest: the default render shows the fit finder's ranking
for the sidebar's scenario (checked against planner.fit called directly), and "apply
this plan" writes the chosen combination into the shared sidebar controls."""

import json
from pathlib import Path

import pytest
from streamlit.testing.v1 import AppTest

from app_pages.fit_view import gpu_for, option_label, plan_state, target_for
from planner.cuda_overheads import cuda_overheads
from planner.estimate import estimate
from planner.fit import find_fits
from planner.gpus import GPUS
from planner.loading import load_model_shape
from planner.parallel import parallel_estimate
from planner.scenario import Task, scenario_from_values
from planner.strategy import ParallelPlan
from planner.units import format_bytes
from views.inputs import (
    DEFAULTS,
    GPU_PRESET_KEYS,
    SidebarValues,
    capability_values,
    capacity_bytes,
    scenario_for,
)

from page_elements import SVG, markdown_tables, plan_charts

APP = Path(__file__).resolve().parents[1] / "app.py"
TABLE_WIDTH_PX = 980  # a table's width in a 1,440 px browser window beside the sidebar (wide layout)


@pytest.fixture(autouse=True)
def isolated(tmp_path, monkeypatch):
    monkeypatch.setenv("PLANNER_DATA_DIR", str(tmp_path / "data"))


def expected_result(kind: str = "effective-batch", allow_risky: bool = False, **overrides):
    values = SidebarValues.from_state({**DEFAULTS, **overrides})
    scenario = scenario_for(values)
    shape = load_model_shape(values.catalog_model, scenario.task, scenario.num_labels)
    capacity = capacity_bytes(values)
    return find_fits(shape, scenario, capacity, target_for(values, kind), gpu_for(values, capacity),
                     values.gpu_count, 0.4, allow_risky=allow_risky, room_for=room_for(values),
                     check=replayed_check(values))


def replayed_check(values: SidebarValues):
    """On CUDA a plan must also pass the caching allocator's replay (planner.device_fit)."""
    from planner.device_fit import reserved_check
    from planner.scenario import Device

    gpu = GPUS[GPU_PRESET_KEYS[values.gpu_preset]] if values.device == "cuda" else None
    return reserved_check(capacity_bytes(values), Device(values.device), gpu)


def room_for(values: SidebarValues):
    """What a plan's tensors get on each GPU: on CUDA the capacity less the overheads of the
    preset's GPU under that plan (planner.cuda_overheads)."""
    capacity = capacity_bytes(values)
    if values.device != "cuda":
        return lambda plan: capacity
    gpu = GPUS[GPU_PRESET_KEYS[values.gpu_preset]]
    return lambda plan: (capacity - cuda_overheads(gpu, plan).total_bytes - cuda_overheads(gpu, plan).allocator_bytes)


def what_fits() -> AppTest:
    at = AppTest.from_file(str(APP), default_timeout=60)
    at.run()
    at.switch_page("app_pages/what_fits.py").run()
    assert not at.exception, at.exception
    return at


def test_default_render_shows_the_ranking():
    at = what_fits()
    assert at.title[0].value == "What fits" and not at.error
    expected = expected_result()
    assert expected.options
    table = at.dataframe[0].value
    assert list(table["peak (bytes)"]) == [o.peak_bytes for o in expected.options]
    assert list(table["optimizer"]) == [o.scenario.optimizer.value for o in expected.options]
    assert len(plan_charts(at)) == 1 and not at.get("plotly_chart")  # SVG: no chart library to fetch
    # The default GPU is a T4: Turing has no bf16 tensor cores, so 16-bit plans are fp16-mixed.
    assert set(table["precision"]) == {"fp32", "fp16-mixed"}
    # Every column has a width, and together they fit the page's table width in a 1,440 px
    # window (about 980 px beside the sidebar), so none is cut off at the right edge.
    columns = json.loads(at.dataframe[0].proto.columns)
    columns.pop("_index", None)  # the hidden index
    assert set(columns) == set(table.columns)
    shown = {name: c for name, c in columns.items() if not c.get("hidden")}
    assert set(shown) == set(table.columns) - {"peak (bytes)"}  # raw bytes hidden (the report keeps them)
    assert sum(c["width"] for c in shown.values()) <= TABLE_WIDTH_PX
    # The sidebar's own plan fits the T4: it is first, changing nothing.
    assert table["changes"][0] == "none (your plan)" and not expected.options[0].changes


def test_apply_writes_the_plan_into_the_sidebar():
    at = what_fits()
    expected = expected_result()
    chosen = plan_state(expected.options[1])
    assert any(at.session_state[key] != value for key, value in chosen.items())
    at.selectbox(key="fit_choice").set_value(option_label(2, expected.options[1])).run()
    at.button(key="fit_apply").click().run()
    assert not at.exception and not at.error
    for key, value in chosen.items():
        assert at.session_state[key] == value
    assert at.selectbox(key="optimizer").value == chosen["optimizer"]
    assert at.number_input(key="batch_size").value == chosen["batch_size"]
    assert at.success[0].value.startswith("Plan applied")


def test_largest_batch_target():
    at = what_fits()
    at.radio(key="fit_target").set_value("largest").run()
    assert not at.exception and not at.error
    expected = expected_result("largest")
    assert list(at.dataframe[0].value["largest micro-batch"]) == [o.max_batch_size for o in expected.options]


def test_an_applied_sharded_plan_shows_on_plan_per_gpu_under_its_strategy():
    at = AppTest.from_file(str(APP), default_timeout=60)
    at.run()
    at.selectbox(key="catalog_model").set_value("llama-2-7b").run()
    at.selectbox(key="task").set_value("causal-lm").run()
    at.number_input(key="gpu_count").set_value(8).run()
    at.switch_page("app_pages/what_fits.py").run()
    assert not at.exception, at.exception
    expected = expected_result(catalog_model="llama-2-7b", task="causal-lm", gpu_count=8)
    table = at.dataframe[0].value
    assert list(table["strategy"]) == [o.strategy.value for o in expected.options]
    sharded = next(i for i, o in enumerate(expected.options) if o.strategy.value.startswith("fsdp"))
    at.selectbox(key="fit_choice").set_value(option_label(sharded + 1, expected.options[sharded])).run()
    at.button(key="fit_apply").click().run()
    assert not at.exception and at.success[0].value.startswith("Plan applied")
    option = expected.options[sharded]
    assert at.selectbox(key="strategy").value == option.strategy.value
    assert at.query_params["strategy"] == option.strategy.value  # the link carries it
    at.switch_page("app_pages/plan.py").run()
    assert not at.exception and not at.error, [e.value for e in at.error]
    assert not [m for m in at.markdown if "later version" in m.value]
    table = markdown_tables(at)[0]  # Plan's breakdown: a static table, bytes as text with separators
    shown = dict(zip(table["category"], (int(b.replace(",", "")) for b in table["bytes"])))
    assert shown["Peak (total)"] == option.peak_bytes
    assert shown["Communication buffers"] == parallel_estimate(
        load_model_shape("llama-2-7b", Task.CAUSAL_LM, 2), option.scenario,
        ParallelPlan(8, option.strategy)).peak.communication_buffers
    assert next(m.value for m in at.metric if m.label == "Peak per GPU") == format_bytes(option.peak_bytes)
    assert f"with **{option.strategy.value}**" in " ".join(m.value for m in at.markdown)


def shown_in_browser(before, after) -> str:
    """The label a browser shows in a selectbox after a rerun: the value the server sends
    when it sets one, else what the same widget showed before (the browser keeps its own
    selection), else the default of a new widget."""
    if after.proto.set_value:
        return after.proto.raw_value
    if before is not None and before.proto.id == after.proto.id:
        return shown_in_browser(None, before)
    return after.options[after.proto.default]


def test_plan_to_apply_follows_a_sidebar_change_and_applies_what_it_shows():
    at = what_fits()
    before = at.selectbox(key="fit_choice")
    at.number_input(key="batch_size").set_value(1).run()  # a new target: a new first plan
    assert not at.exception and not at.error
    first = expected_result(batch_size=1).options[0]
    after = at.selectbox(key="fit_choice")
    assert after.options[0] != before.options[0]
    assert shown_in_browser(before, after) == option_label(1, first)
    at.button(key="fit_apply").click().run()
    for key, value in plan_state(first).items():
        assert at.session_state[key] == value


def test_risky_changes_only_when_allowed_and_labelled():
    at = what_fits()
    table = at.dataframe[0].value
    assert "sgd" not in set(table["optimizer"]) and not any(table["risks"])
    at.checkbox(key="fit_allow_risky").check().run()
    assert not at.exception and not at.error
    expected = expected_result(allow_risky=True)
    table = at.dataframe[0].value
    assert list(table["peak (bytes)"]) == [o.peak_bytes for o in expected.options]
    for optimizer, risks in zip(table["optimizer"], table["risks"]):
        assert (optimizer == "sgd") == ("SGD for a language model" in risks)
    assert "sgd" in set(table["optimizer"])


def test_nothing_fits_shows_the_nearest_plans_and_their_misses():
    at = AppTest.from_file(str(APP), default_timeout=60)
    at.run()
    at.selectbox(key="catalog_model").set_value("llama-2-7b").run()
    at.selectbox(key="task").set_value("causal-lm").run()
    # Full fine-tuning's nearest plans: LoRA's would probe the 7B model first (a minute or more here).
    at.session_state["fit_search_adapters"] = False
    at.switch_page("app_pages/what_fits.py").run()
    assert not at.exception, at.exception
    assert at.warning[0].value.startswith("Nothing fits")
    table = at.dataframe[0].value
    values = SidebarValues.from_state({**DEFAULTS, "catalog_model": "llama-2-7b", "task": "causal-lm"})
    shape = load_model_shape("llama-2-7b", Task.CAUSAL_LM)
    capacity = room_for(values)(ParallelPlan())
    assert len(table) and list(table["over by (%)"]) == sorted(table["over by (%)"])
    for row in table.to_dict("records"):
        plan = scenario_from_values(task="causal-lm", batch_size=int(row["micro-batch"]), seq_len=values.seq_len,
                                    optimizer=row["optimizer"], precision=row["precision"],
                                    gradient_checkpointing=bool(row["checkpointing"]),
                                    grad_accum=int(row["accumulation"]), **capability_values(values))
        over = estimate(shape, plan).peak_bytes - capacity
        assert int(row["over by (bytes)"]) == over > 0
        assert row["over by (%)"] == pytest.approx(100 * over / capacity)
    assert any("LoRA and QLoRA plans not searched" in c.value for c in at.caption)


def test_the_chart_tells_the_plans_apart_by_optimizer_precision_and_strategy():
    at = what_fits()
    result = expected_result()
    [chart] = plan_charts(at)
    plans = [g for g in chart.iter(f"{SVG}g") if g.get("class") == "series"]
    points = [p for g in plans for p in g.iter(f"{SVG}g") if p.get("class") == "option"]
    assert sorted(int(p.get("data-rank")) for p in points) == list(range(1, len(result.options) + 1))
    expected = {(o.strategy.value, f"{o.scenario.optimizer.value}, {o.scenario.precision.value}")
                for o in result.options if not o.scenario.finetune.uses_adapters}
    assert expected <= {(g.get("data-group"), g.get("data-name")) for g in plans}
    legend = {g.get("data-name") for g in chart.iter(f"{SVG}g") if g.get("class") == "legend-entry"}
    assert {g.get("data-name") for g in plans} <= legend
    colours = {}
    for group in plans:
        [mark] = {e.get("fill") for p in group.iter(f"{SVG}g") if p.get("class") == "option"
                  for e in p if e.tag != f"{SVG}title"}
        colours.setdefault(group.get("data-name").split(",")[0], set()).add(mark)
    assert all(len(c) == 1 for c in colours.values())  # one colour per optimizer
    assert len({c for cs in colours.values() for c in cs}) == len(colours)


def test_the_search_reports_progress_and_runs_once_per_server(monkeypatch):
    """The search tells a progress bar how many combinations it has done (a 7B model's first
    search on CUDA replays for a minute or more): the counts rise to the combinations it
    reports; the bar is gone once the table is drawn; and a second session with the same
    sidebar gets the first one's search without searching again (app_pages.page_context
    searched_with_progress)."""
    import app_pages.page_context as page_context
    import planner.fit
    from app_pages.shared_results import SharedResults

    monkeypatch.setattr(page_context, "_SEARCHES", SharedResults(kept=64))
    told, searches = [], []
    real = planner.fit.find_fits

    def counted(*args, progress=None, **kwargs):
        def tell(done, total):
            told.append((done, total))
            progress(done, total)

        result = real(*args, progress=tell, **kwargs)
        searches.append(result)
        return result

    monkeypatch.setattr(planner.fit, "find_fits", counted)
    first = what_fits()
    assert len(searches) == 1
    combinations = searches[0].combinations
    assert told[0] == (0, combinations) and told[-1] == (combinations, combinations)
    assert [done for done, _ in told] == sorted(done for done, _ in told)
    assert {total for _, total in told} == {combinations}
    assert not [e for e in first.main if type(e).__name__ == "Progress"]
    what_fits()
    assert len(searches) == 1


def test_the_chart_follows_the_lora_checkbox():
    """The scatter is cached per search inputs, the LoRA checkbox among them: ticked after an
    unticked search, the chart shows the LoRA and QLoRA plans the table gains (it was served
    the unticked search's chart before)."""
    at = AppTest.from_file(str(APP), default_timeout=180)
    at.session_state["catalog_model"] = "gpt2"
    at.session_state["task"] = "causal-lm"
    at.session_state["fit_search_adapters"] = False
    at.run()
    at.switch_page("app_pages/what_fits.py").run()
    assert not at.exception, at.exception

    def drawn_methods():
        [chart] = plan_charts(at)
        names = [g.get("data-name") for g in chart.iter(f"{SVG}g") if g.get("class") == "series"]
        return {name.split(", ")[2] if name.count(", ") == 2 else "full" for name in names}

    def table_methods():
        return {method.split()[0] for method in at.dataframe[0].value["method"]}  # "lora r16": lora

    assert drawn_methods() == {"full"} == table_methods()
    at.checkbox(key="fit_search_adapters").check().run()
    assert not at.exception, at.exception
    table_methods = table_methods()
    assert {"lora", "qlora"} & table_methods
    assert drawn_methods() == table_methods
