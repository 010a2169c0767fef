"""Every dashboard page through AppTest (Plan additions, Techniques, Verify, Report) and the
shared controls (query string, GPU count). Numbers shown are checked against the planner
and the plain app_pages modules called directly, never against the page's own arithmetic.

The run history is a fresh SQLite file per test (PLANNER_DATA_DIR). The Verify page's runs
go through a fake runner except one real run: a tiny Llama config, simulated, 2 steps.
"""

import dataclasses
import hashlib
import json
from pathlib import Path

import pytest
from streamlit.testing.v1 import AppTest

from app_pages import run_queue
from planner.fit import fit_limits
from planner.catalog import CATALOG_DIR
from planner.config_source import config_from_bytes
from planner.cuda_overheads import cuda_overheads
from planner.errors import PlannerInputError
from planner.estimate import estimate
from planner.gpus import GPUS, capability_values, scenario_on
from planner.loading import load_model_shape, model_shape_for_config
from planner.parallel import parallel_estimate
from planner.scenario import Task, scenario_from_values
from planner.strategy import ParallelPlan, Strategy
from planner.units import format_bytes
from runners import verify
from runners.history import RunHistory
from runners.verify import cuda_is_likely_available, plan_run
from tests.conftest import CONFIGS
from views.comparison import TECHNIQUES, compare_techniques
from views.escaping import markdown_text
from views.inputs import CUSTOM_GPU, DEFAULTS, GPU_PRESET_KEYS, GPU_PRESETS
from views.verify_results import measured_device, plan_request

from page_elements import chart, plan_charts

APP = Path(__file__).resolve().parents[1] / "app.py"
TIMEOUT_S = 60
SCENARIO_KEYS = ("task", "batch_size", "seq_len", "optimizer", "precision", "gradient_checkpointing",
                 "grad_accum", "attn", "device", "num_labels")
PAGES = ("plan", "techniques", "verify", "report")
TABLE_WIDTH_PX = 980  # a table's width in a 1,440 px browser window beside the sidebar (wide layout)


@pytest.fixture(autouse=True)
def isolated(tmp_path, monkeypatch):
    monkeypatch.setenv("PLANNER_DATA_DIR", str(tmp_path / "data"))
    yield
    run_queue.set_queue(None)


DEFAULT_GPU_KERNELS = capability_values("cuda", GPUS[GPU_PRESET_KEYS[DEFAULTS["gpu_preset"]]])


def app(page: str = "plan", query: dict | None = None) -> AppTest:
    at = AppTest.from_file(str(APP), default_timeout=TIMEOUT_S)
    if query:
        at.query_params.update(query)
    # The report's What fits section without LoRA plans: their first search probes a model
    # not shipped (an upload) once per technique class, tens of seconds here.
    at.session_state["fit_search_adapters"] = False
    at.run()
    if page != "plan":
        at.switch_page(f"app_pages/{page}.py").run()
    assert not at.exception, at.exception
    return at


def values(**overrides) -> dict:
    """The sidebar's default scenario, on the default GPU's kernels (views.inputs.capability_values)."""
    return {key: DEFAULTS[key] for key in SCENARIO_KEYS} | DEFAULT_GPU_KERNELS | overrides


def shape_for(model: str = DEFAULTS["catalog_model"], **overrides):
    scenario = scenario_from_values(**values(**overrides))
    return load_model_shape(model, scenario.task, scenario.num_labels), scenario


def metric(at: AppTest, label: str) -> str:
    return next(m.value for m in at.metric if m.label == label)


def shown_peak(at: AppTest, page: str) -> str | int:
    """The headline number each page shows for the sidebar's scenario."""
    if page == "plan":
        return metric(at, "Peak")
    if page == "techniques":
        return int(at.dataframe[0].value["estimated peak (bytes)"].iloc[0])
    if page == "verify":
        return metric(at, "Estimated peak a run is compared with")
    return metric(at, "Peak of this plan")


def expected_peak(page: str, model: str = DEFAULTS["catalog_model"], config: dict | None = None,
                  name: str | None = None, **overrides):
    scenario = scenario_from_values(**values(**overrides))
    shape = (model_shape_for_config(config, scenario.task, scenario.num_labels, name) if config is not None
             else load_model_shape(model, scenario.task, scenario.num_labels))
    if page == "verify":  # an auto run measures CUDA kernels where there is a GPU, else CPU ones
        scenario = dataclasses.replace(scenario, device=measured_device("auto", cuda_is_likely_available()))
    if page == "techniques":
        return compare_techniques(shape, values(**overrides))[0].peak_bytes
    return format_bytes(estimate(shape, scenario).peak_bytes)


def upload(at: AppTest, data: bytes) -> AppTest:
    if at.radio(key="model_source").value != "upload":
        at.radio(key="model_source").set_value("upload").run()
    return at.file_uploader(key="config_upload").set_value(("config.json", data, "application/json")).run()


# --- every page: render, a widget, an upload, a bad upload ------------------------------------

@pytest.mark.parametrize("page", PAGES)
def test_page_renders_by_default(page):
    at = app(page)
    assert not at.error, [e.value for e in at.error]
    assert at.title[0].value == page.capitalize()
    assert shown_peak(at, page) == expected_peak(page)


@pytest.mark.parametrize("page", PAGES)
def test_batch_size_widget_changes_the_numbers(page):
    at = app(page)
    before = shown_peak(at, page)
    at.number_input(key="batch_size").set_value(32).run()
    assert not at.exception and not at.error
    assert shown_peak(at, page) == expected_peak(page, batch_size=32) != before


@pytest.mark.parametrize("page", PAGES)
def test_uploaded_config_is_used(page):
    data = (CATALOG_DIR / "opt-125m.json").read_bytes()
    at = upload(app(page), data)
    assert not at.exception and not at.error
    # The task its architectures name; the model named by its config and the upload's short hash.
    assert at.caption[0].value.startswith(f"**OPTForCausalLM · {hashlib.sha256(data).hexdigest()[:12]}**: "
                                          "OPTForCausalLM")
    assert shown_peak(at, page) == expected_peak(page, config=json.loads(data), name="config.json", task="causal-lm")


@pytest.mark.parametrize("page", PAGES)
def test_bad_upload_shows_an_error_and_the_page_recovers(page):
    data = b'{"model_type": "no-such-architecture"}'
    with pytest.raises(PlannerInputError) as raised:
        model_shape_for_config(config_from_bytes(data, "config.json"), Task.SEQUENCE_CLASSIFICATION, 2, "c")
    at = upload(app(page), data)
    assert not at.exception
    assert [e.value for e in at.error] == [markdown_text(raised.value)]  # shown as text (views.escaping)
    good = (CATALOG_DIR / "opt-125m.json").read_bytes()
    at = upload(at, good)
    assert not at.exception and not at.error
    assert shown_peak(at, page) == expected_peak(page, config=json.loads(good), name="config.json", task="causal-lm")


# --- Plan page additions ----------------------------------------------------------------------

def _room_for_tensors(preset: str) -> int:
    """A CUDA plan's live tensors get the capacity less the overheads outside the caching
    allocator and torch's blocks inside it (planner.cuda_overheads, for the preset's GPU)."""
    overheads = cuda_overheads(GPUS[GPU_PRESET_KEYS[preset]])
    return GPU_PRESETS[preset] - overheads.total_bytes - overheads.allocator_bytes


def _replayed_check(preset: str):
    from planner.device_fit import reserved_check
    from planner.scenario import Device

    return reserved_check(GPU_PRESETS[preset], Device.CUDA, GPUS[GPU_PRESET_KEYS[preset]])


def test_plan_shows_the_largest_batch_and_sequence_that_fit():
    at = app()
    shape, scenario = shape_for()
    # The searches stop where the verdict does: live tensors in the room the overheads leave,
    # then the caching allocator replayed (planner.device_fit).
    limits = fit_limits(shape, scenario, _room_for_tensors(DEFAULTS["gpu_preset"]),
                        check=_replayed_check(DEFAULTS["gpu_preset"]))
    assert metric(at, "Largest batch size that fits") == f"{limits.batch_size:,}"
    assert metric(at, "Largest sequence length that fits") == f"{limits.seq_len:,}"
    at.selectbox(key="gpu_preset").set_value("H200 · 141 GB").run()
    bigger = fit_limits(shape, scenario_on(scenario, GPUS["h200"]), _room_for_tensors("H200 · 141 GB"),
                        check=_replayed_check("H200 · 141 GB"))
    assert metric(at, "Largest batch size that fits") == f"{bigger.batch_size:,}"
    assert bigger.batch_size > limits.batch_size


def test_plan_charts_memory_against_batch_per_technique():
    at = app()
    assert len(plan_charts(at)) == 2 and not at.get("plotly_chart")  # drawn as SVG: no chart library to fetch
    drawn = chart(at, 1)
    names = drawn["legend"]
    # One line per technique but plain accumulation, your plan's marker, then the capacity line's legend entry.
    assert names[0] == "AdamW fp32 (baseline)" and len(names) == (len(TECHNIQUES) - 1) + 2
    assert list(drawn["series"]) == names[:-2]
    assert names[-2] == f"your plan (batch {DEFAULTS['batch_size']})"
    assert names[-1].startswith("capacity ") and drawn["capacity_bytes"] > 0


# --- shared controls: the link and the GPU count ----------------------------------------------

def test_a_link_restores_the_plan_and_widgets_write_the_link():
    at = app(query={"catalog_model": "gpt2", "task": "causal-lm", "batch_size": "3", "gpu_count": "4",
                    "strategy": "zero2", "optimizer": "nonsense"})
    assert at.selectbox(key="catalog_model").value == "gpt2"
    assert at.number_input(key="batch_size").value == 3
    assert at.selectbox(key="optimizer").value == DEFAULTS["optimizer"]  # a bad value keeps the default
    assert at.selectbox(key="strategy").value == "zero2"
    shape, scenario = shape_for("gpt2", task="causal-lm", batch_size=3)
    per_gpu = parallel_estimate(shape, scenario, ParallelPlan(4, Strategy.ZERO2)).per_device_peak_bytes
    assert metric(at, "Peak per GPU") == format_bytes(per_gpu)
    assert at.caption[0].value.endswith("; 4 GPUs, zero2")
    at.number_input(key="seq_len").set_value(128).run()
    assert at.query_params["seq_len"] == ["128"] or at.query_params["seq_len"] == "128"
    assert "optimizer" not in at.query_params  # defaults stay out of the link


# --- Techniques -------------------------------------------------------------------------------

def test_techniques_at_batch_1_say_why_accumulation_saves_nothing():
    at = app("techniques", query={"batch_size": "1"})
    assert not at.exception and not at.error
    table = at.dataframe[0].value.set_index("technique")
    accumulated = table.loc["Gradient accumulation (same effective batch)"]
    assert accumulated["micro-batch × accumulation"] == "1 × 1"
    assert accumulated["estimated peak (bytes)"] == table.loc["AdamW fp32 (baseline)", "estimated peak (bytes)"]
    [note] = [i.value for i in at.info if "accumulation" in i.value]
    assert note.startswith("A batch of 1 cannot be split") and "divisible by 2 or 4" in note
    # Every column has a width and together they fit the page (see TABLE_WIDTH_PX): none cut off.
    columns = json.loads(at.dataframe[0].proto.columns)
    columns.pop("_index", None)  # the hidden index
    assert set(columns) == set(table.reset_index().columns)
    assert sum(c["width"] for c in columns.values()) <= TABLE_WIDTH_PX
    at.number_input(key="batch_size").set_value(8).run()
    assert not [i for i in at.info if "cannot be split" in i.value]


def test_techniques_show_a_measured_peak_from_the_history():
    shape, scenario = shape_for()
    rows = compare_techniques(shape, values())
    history = RunHistory()
    baseline = rows[0]
    config = json.loads((CATALOG_DIR / f"{shape.name}.json").read_text())
    run_id = history.start_run(shape.name, "simulate", {**baseline.values, "engine": "accelerate",
                                                        "model_config": config}, baseline.estimate.to_json())
    other = history.start_run(shape.name, "simulate", {**baseline.values, "engine": "accelerate",
                                                       "model_config": {**config, "n_layers": 1}},
                              baseline.estimate.to_json())
    history.finish_run(other, "ok", measurement={"peak_bytes": 1})  # another config: not this scenario
    history.finish_run(run_id, "ok", measurement={"peak_bytes": 123_456_789})
    at = app("techniques")
    table = at.dataframe[0].value
    assert list(table["technique"]) == [t.label for t in TECHNIQUES]
    assert int(table["measured peak (bytes)"].iloc[0]) == 123_456_789
    assert table["measured by"].iloc[0] == "simulate"
    assert table["measured peak"].iloc[1] == "no run"


# --- Verify -----------------------------------------------------------------------------------

def test_verify_headline_is_the_estimate_the_run_is_compared_with(monkeypatch):
    monkeypatch.setattr(verify, "cuda_is_likely_available", lambda: False)  # a machine without a GPU
    at = app("verify")
    assert not at.exception and not at.error
    request = plan_request(json.loads((CATALOG_DIR / f"{DEFAULTS['catalog_model']}.json").read_text()),
                           DEFAULTS["catalog_model"], values(), "auto", 3)
    compared = plan_run(request, cuda_available=False, available_bytes=1 << 50).estimate  # what the run compares
    assert compared.scenario.device.value == "cpu" != DEFAULTS["device"]
    assert metric(at, "Estimated peak a run is compared with") == format_bytes(compared.peak_bytes)
    assert f"the sidebar's cuda estimate is {expected_peak('plan')}" in " ".join(c.value for c in at.caption)


def test_verify_queues_every_technique_and_shows_results():
    def fake(request, timeout_s, on_progress, history, cancel=None):
        on_progress({"stage": "step", "step": 2, "steps": 2})
        estimated = {"peak_bytes": 1000, "peak_breakdown_bytes": {c: 200 for c in
                     ("weights", "gradients", "optimizer_state", "activations", "temporaries")}}
        return {"status": "ok", "mode": "simulate", "estimated": estimated,
                "measured": {"peak_bytes": 990, "weights_bytes": 200}, "reason": None}

    queue = run_queue.RunQueue(runner=fake)
    run_queue.set_queue(queue)
    at = app("verify")
    at.button(key="verify_techniques").click().run()
    assert queue.wait_idle(10)
    at.run()
    assert not at.exception and not at.error
    assert len(at.get("progress")) == len(TECHNIQUES)
    assert at.selectbox(key="verify_result_choice").options[0].startswith(TECHNIQUES[0].label)
    assert len(at.get("plotly_chart")) == 2  # per technique, per category


def test_verify_a_tiny_plan_for_real_in_simulate_mode():
    run_queue.set_queue(run_queue.RunQueue(timeout_s=120))
    at = upload(app("verify"), (CONFIGS / "tiny-llama.json").read_bytes())
    at.selectbox(key="task").set_value("causal-lm").run()
    at.number_input(key="batch_size").set_value(2).run()
    at.number_input(key="seq_len").set_value(64).run()
    at.selectbox(key="verify_mode").set_value("simulate").run()
    at.number_input(key="verify_steps").set_value(2).run()
    at.button(key="verify_plan").click().run()
    assert run_queue.get_queue().wait_idle(120)
    at.run()
    assert not at.exception and not at.error, [e.value for e in at.error]
    [view] = run_queue.get_queue().jobs(at.session_state["verify_session_id"])
    assert view.job.status == "ok", view.job.log
    assert view.job.result["mode"] == "simulate"
    history = at.dataframe[0].value
    assert list(history["status"]) == ["ok"] and list(history["mode"]) == ["simulate"]
    assert int(history["measured peak (bytes)"].iloc[0]) == view.job.result["measured"]["peak_bytes"]
    assert len(at.get("plotly_chart")) == 3  # session bars, categories, history scatter
    at.multiselect(key="history_statuses").set_value(["failed"]).run()
    assert at.dataframe[0].value.empty


# --- Report -----------------------------------------------------------------------------------

def test_report_offers_four_downloads_and_previews_the_plan():
    at = app("report")
    buttons = at.get("download_button")
    # Labels short enough for a quarter of the page (what each holds is in its help).
    assert [b.proto.label for b in buttons] == ["HTML", "Markdown", "CSV", "JSON"]
    assert "opens with no network" in buttons[0].proto.help
    shape, scenario = shape_for()
    peak = estimate(shape, scenario).peak_bytes
    # The preview scrolls in a box of fixed height inside the expander, so its wide tables
    # stay inside the border instead of running past it.
    [box] = at.expander[0].children.values()
    assert box.proto.height_config.pixel_height > 0
    preview = list(box.children.values())[-1].value
    assert f"| Peak (total) | {peak} |" in preview
    assert "AdamW fp32 (baseline)" in preview


def test_the_report_tells_its_search_s_progress_and_leaves_no_bar(monkeypatch):
    """The report's What fits search moves a progress bar (reporting.build_report's
    `progress`, told by planner.fit.find_fits from 0 to its combinations), gone once the
    report is drawn."""
    import reporting

    told = []
    real = reporting.build_report

    def counted(*args, progress=None, **kwargs):
        def tell(done, total):
            told.append((done, total))
            progress(done, total)

        return real(*args, progress=tell, **kwargs)

    monkeypatch.setattr(reporting, "build_report", counted)
    at = app("report")
    assert not at.exception
    assert told and told[0][0] == 0 and told[-1][0] == told[-1][1] > 0
    assert not [e for e in at.main if type(e).__name__ == "Progress"]


def test_verify_cancels_a_waiting_run():
    import threading
    gate = threading.Event()

    def slow(request, timeout_s, on_progress, history, cancel=None):
        gate.wait(10)
        return {"status": "killed" if cancel.is_set() else "ok", "mode": "simulate", "reason": "stopped",
                "estimated": {"peak_bytes": 1, "peak_breakdown_bytes": {}}, "measured": None}

    queue = run_queue.RunQueue(runner=slow)
    run_queue.set_queue(queue)
    at = app("verify")
    at.button(key="verify_plan").click().run()
    at.button(key="verify_plan").click().run()
    [running, waiting] = queue.jobs(at.session_state["verify_session_id"])
    assert "waiting, 1 ahead" in at.get("progress")[1].proto.text
    at.button(key=f"cancel_{waiting.job.id}").click().run()
    gate.set()
    assert queue.wait_idle(10)
    at.run()
    states = [v.job.state for v in queue.jobs(at.session_state["verify_session_id"])]
    assert states == ["done", "cancelled"]
    assert any("cancelled" in w.value for w in at.warning)


@pytest.mark.parametrize("query", [{"batch_size": "²"}, {"seq_len": "9" * 5000}, {"batch_size": str(10**20)},
                                   {"gpu_preset": CUSTOM_GPU, "gpu_custom_gib": "1e308"}],
                         ids=["superscript two", "5000-digit seq_len", "batch 10^20", "1e308 GiB"])
def test_a_hostile_link_keeps_the_defaults_and_says_why(query):
    """Issue 15 item 4: each gave a traceback with server paths; now the page renders with
    the widget's default and one warning naming the dropped key."""
    at = app(query=query)
    key = next(k for k in query if k != "gpu_preset")
    assert at.number_input(key=key).value == DEFAULTS[key]
    assert [w.value for w in at.warning if key in w.value and "kept their defaults" in w.value]
    shown = " ".join(str(e.value) for e in [*at.error, *at.warning, *at.markdown, *at.caption])
    assert "Traceback" not in shown and str(APP.parent) not in shown
    assert metric(at, "Peak")  # the plan itself still renders


@pytest.mark.parametrize("config", [
    {"model_type": "t5", "num_layers": 100_000, "d_model": 64, "num_heads": 2},
    {"model_type": "bart", "encoder_layers": 100_000, "d_model": 64},
    {"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
     "num_key_value_heads": 3, "intermediate_size": 128},
    {"model_type": "mamba", "hidden_size": 64, "num_hidden_layers": 2},
], ids=["t5 100,000 layers", "bart 100,000 encoder layers", "kv heads 3 of 4", "mamba"])
def test_an_upload_beyond_any_model_or_outside_the_planner_is_one_error(config):
    """Issue 15 items 1 and 2 on the page: the T5 upload grew the server to 6.3 GB; the others
    raised outside PlannerInputError. Now each is refused before anything is built."""
    at = upload(app(), json.dumps(config).encode())
    assert not at.exception
    assert len(at.error) == 1 and "\n" not in at.error[0].value
    assert any(markdown_text(word) in at.error[0].value  # shown as text (views.escaping)
               for word in ("beyond any real model", "num_key_value_heads", "no num_attention_heads"))


def test_an_error_quotes_at_most_500_characters_of_what_it_refuses():
    """Issue 15 item 8: a field of hundreds of KB came back whole in its error."""
    config = {**json.loads((CONFIGS / "tiny-gpt2.json").read_text()), "model_type": "m" * 300_000}
    at = upload(app(), json.dumps(config).encode())
    assert not at.exception
    assert len(at.error) == 1 and "architecture 'mmm" in at.error[0].value and len(at.error[0].value) <= 500
