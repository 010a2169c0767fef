"""The dashboard through Streamlit's AppTest: app.py's sidebar, router and the Plan page.

Every number the page shows is checked against planner.estimate called directly on the
same scenario, never against the page's own arithmetic.
"""

import hashlib
import http.server
import json
import socket
import threading
import time
import tomllib
from pathlib import Path

import pytest
import streamlit as st
from streamlit.testing.v1 import AppTest

from app_pages.query_state import encode
from planner.catalog import CATALOG_DIR
from planner.config_source import config_from_bytes
from planner.cuda_overheads import cuda_overheads
from planner.errors import PlannerInputError
from planner.estimate import estimate
from planner.gpus import GPUS, capability_values
from planner.loading import load_model_shape, model_shape_for_config
from planner.reserved import replayed_step
from planner.scenario import Task, scenario_from_values
from planner.units import GIB, format_bytes
from views.escaping import markdown_text

from page_elements import chart, markdown_tables
from views.inputs import DEFAULTS, GPU_PRESET_KEYS, GPU_PRESETS

APP = Path(__file__).resolve().parents[1] / "app.py"
TIMEOUT_S = 60  # the first run imports transformers and builds a shape on the meta device
# A run that meets a technique class nobody has probed yet (a new label count, an upload) probes
# it, on CUDA as on CPU (5-10 s per class on a loaded 2-core machine with a cold cache,
# planner.probe.cache); "Probe and draw the rest" probes up to 8 of the chart's classes.
PROBING_TIMEOUT_S = 240
SCENARIO_KEYS = ("task", "batch_size", "seq_len", "optimizer", "precision", "gradient_checkpointing",
                 "grad_accum", "attn", "device", "num_labels")


@pytest.fixture(autouse=True)
def isolated_data_dir(tmp_path, monkeypatch):
    # Uploads are stored by hash in the data directory (runners.config_store): a fresh one per test.
    monkeypatch.setenv("PLANNER_DATA_DIR", str(tmp_path / "data"))


DEFAULT_GPU_KERNELS = capability_values("cuda", GPUS[GPU_PRESET_KEYS[DEFAULTS["gpu_preset"]]])


def run_app() -> AppTest:
    at = AppTest.from_file(str(APP), default_timeout=TIMEOUT_S).run()
    assert not at.exception
    return at


def expected_estimate(model: str = DEFAULTS["catalog_model"], **overrides):
    """The sidebar's default scenario's estimate, on the default GPU's kernels."""
    values = {key: DEFAULTS[key] for key in SCENARIO_KEYS} | DEFAULT_GPU_KERNELS | overrides
    scenario = scenario_from_values(**values)
    return estimate(load_model_shape(model, scenario.task, scenario.num_labels), scenario)


def shown_bytes(at: AppTest) -> dict[str, int]:
    table = markdown_tables(at)[0]
    return dict(zip(table["category"], (int(b.replace(",", "")) for b in table["bytes"])))


def assert_page_shows(at: AppTest, result) -> None:
    assert not at.exception
    assert not at.error, [e.value for e in at.error]
    peak = result.peak
    assert shown_bytes(at) == {
        "Weights": peak.weights, "Gradients": peak.gradients, "Optimizer state": peak.optimizer_state,
        "Activations": peak.activations, "Temporaries": peak.temporaries, "Peak (total)": result.peak_bytes,
    }
    # The first markdown after any probe's progress lines (a status box above the page).
    where = next(m.value for m in at.markdown if m.value.startswith("The peak is in"))
    assert f"**{result.peak_phase.value}**" in where
    assert result.peak_reason in where


def verdict_text(at: AppTest) -> str:
    shown = [element.value for element in (*at.success, *at.warning)]
    assert len(shown) == 1, shown
    return shown[0]


def test_default_render_shows_the_estimate_and_a_verdict():
    at = run_app()
    result = expected_estimate()
    assert_page_shows(at, result)
    capacity = GPU_PRESETS[DEFAULTS["gpu_preset"]]
    assert result.peak_bytes < capacity  # the lessons' DistilBERT fits a T4
    assert verdict_text(at).startswith("Fits")
    # On CUDA the context is outside the allocator and the cuBLAS workspaces inside it
    # (planner.cuda_overheads); the margin is what the caching allocator, replayed on the step
    # with those workspaces (made at each thread's first matmul) within the usable capacity,
    # leaves of it (planner.reserved).
    overheads = cuda_overheads(GPUS[GPU_PRESET_KEYS[DEFAULTS["gpu_preset"]]])
    usable = capacity - overheads.total_bytes
    shape = load_model_shape(DEFAULTS["catalog_model"], result.scenario.task, result.scenario.num_labels)
    replayed = replayed_step(shape, result, (), usable,
                             cublas_workspaces=tuple(i.bytes for i in overheads.allocator_items))
    assert not replayed.out_of_memory
    assert replayed.peak_reserved_bytes >= result.peak_bytes + overheads.allocator_bytes
    margin = next(m.value for m in at.metric if m.label == "Margin")
    assert margin == f"{(usable - replayed.peak_reserved_bytes) / GIB:+,.2f} GiB"


def test_batch_size_changes_the_peak():
    at = run_app()
    before = shown_bytes(at)["Peak (total)"]
    at.number_input(key="batch_size").set_value(32).run()
    result = expected_estimate(batch_size=32)
    assert_page_shows(at, result)
    assert result.peak_bytes != before


def test_another_catalog_model_changes_the_numbers_and_its_task():
    at = run_app()
    before = shown_bytes(at)
    at.selectbox(key="catalog_model").set_value("gpt2").run()
    # gpt2 is a decoder: picking it switches the task to causal LM.
    assert at.selectbox(key="task").value == Task.CAUSAL_LM.value
    result = expected_estimate("gpt2", task="causal-lm")
    assert_page_shows(at, result)
    assert shown_bytes(at) != before
    assert "GPT2LMHeadModel" in at.caption[0].value


@pytest.mark.parametrize(("key", "value"), [
    ("optimizer", "adamw8bit"),
    ("optimizer", "adafactor"),
    ("precision", "bf16-mixed"),
    ("gradient_checkpointing", True),
    ("grad_accum", 4),
    ("attn", "eager"),
    ("device", "cpu"),
    ("num_labels", 7),
    ("seq_len", 128),
])
def test_each_scenario_widget_reaches_the_estimate(key, value):
    at = run_app()
    widget = at.toggle(key=key) if isinstance(value, bool) else next(
        w for w in (*at.selectbox, *at.number_input, *at.radio) if w.key == key)
    widget.set_value(value).run(timeout=PROBING_TIMEOUT_S)
    assert_page_shows(at, expected_estimate(**{key: value}))


def test_sequence_longer_than_the_positions_shows_an_error_and_the_page_recovers():
    at = run_app()
    at.number_input(key="seq_len").set_value(4096).run()
    assert not at.exception
    assert len(at.error) == 1
    assert "4,096 exceeds" in at.error[0].value and "512 positions" in at.error[0].value
    assert not markdown_tables(at)
    at.number_input(key="seq_len").set_value(256).run()
    assert_page_shows(at, expected_estimate(seq_len=256))


def test_custom_capacity_below_the_peak_does_not_fit():
    at = run_app()
    at.selectbox(key="gpu_preset").set_value("Custom").run()
    at.number_input(key="gpu_custom_gib").set_value(1.0).run()
    result = expected_estimate()
    assert_page_shows(at, result)
    assert verdict_text(at).startswith("Does not fit")
    # A custom size names no GPU: the overheads take their larger figures (planner.cuda_overheads).
    # The replay within the usable capacity runs out of memory, so the shortfall is what the
    # step would reserve with room to spare, less the usable capacity.
    overheads = cuda_overheads(None)
    shape = load_model_shape(DEFAULTS["catalog_model"], result.scenario.task, result.scenario.num_labels)
    workspaces = tuple(i.bytes for i in overheads.allocator_items)
    assert replayed_step(shape, result, (), GIB - overheads.total_bytes, cublas_workspaces=workspaces).out_of_memory
    short = replayed_step(shape, result, (), cublas_workspaces=workspaces).peak_reserved_bytes - (GIB - overheads.total_bytes)
    assert f"by {short / GIB:,.2f} GiB" in verdict_text(at)
    margin = next(m.value for m in at.metric if m.label == "Margin")
    assert margin == f"{-short / GIB:+,.2f} GiB"


def test_gpu_preset_sets_the_capacity():
    at = run_app()
    at.selectbox(key="gpu_preset").set_value("H200 · 141 GB").run()
    capacity = next(m.value for m in at.metric if m.label == "Capacity")
    assert capacity == f"{143771 * 2**20 / GIB:,.2f} GiB"


def upload(at: AppTest, data: bytes) -> AppTest:
    if at.radio(key="model_source").value != "upload":
        at.radio(key="model_source").set_value("upload").run()
    return at.file_uploader(key="config_upload").set_value(("config.json", data, "application/json")).run()


def test_upload_source_waits_for_a_file_without_an_error():
    at = run_app()
    at.radio(key="model_source").set_value("upload").run()
    assert not at.exception and not at.error
    assert "Upload" in at.info[0].value


def test_uploaded_config_is_estimated_as_the_task_its_architectures_name():
    data = (CATALOG_DIR / "opt-125m.json").read_bytes()  # architectures: OPTForCausalLM
    at = upload(run_app(), data)
    assert at.selectbox(key="task").value == "causal-lm"
    scenario = scenario_from_values(**{key: DEFAULTS[key] for key in SCENARIO_KEYS} | {"task": "causal-lm"})
    shape = model_shape_for_config(json.loads(data), scenario.task, scenario.num_labels, "config.json")
    assert_page_shows(at, estimate(shape, scenario))
    # Named by its model (no _name_or_path: its architecture) and the upload's short hash.
    assert at.caption[0].value.startswith(f"**OPTForCausalLM · {hashlib.sha256(data).hexdigest()[:12]}**: "
                                          "OPTForCausalLM")
    assert not [i for i in at.info if "architectures" in i.value]  # planned as the config says: nothing to note


def test_a_task_chosen_over_the_uploaded_configs_is_noted():
    # DistilBERT: the tables of its masked LM (its architectures) and of its classifier both ship.
    data = (CATALOG_DIR / "distilbert-base-cased.json").read_bytes()  # architectures: DistilBertForMaskedLM
    at = upload(run_app(), data)
    label = f"DistilBertForMaskedLM · {hashlib.sha256(data).hexdigest()[:12]}"
    assert at.caption[0].value.startswith(f"**{label}**: DistilBertForMaskedLM")
    at.selectbox(key="task").set_value("sequence-classification").run()
    assert not at.exception and not at.error
    assert at.caption[0].value.startswith(f"**{label}**: DistilBertForSequenceClassification")
    assert at.info[0].value == ("The config's architectures name DistilBertForMaskedLM (masked-lm); planned as "
                                "sequence-classification, the task chosen in the sidebar.")


@pytest.mark.parametrize("data", [
    b"not json",
    b"[1, 2]",
    b'{"hidden_size": 768}',
    b'{"model_type": "no-such-architecture"}',
    b"\xff\xfe",
])
def test_bad_upload_shows_its_one_line_error_and_the_page_recovers(data):
    with pytest.raises(PlannerInputError) as raised:
        config = config_from_bytes(data, "config.json")
        model_shape_for_config(config, Task.SEQUENCE_CLASSIFICATION, 2, "config.json")
    at = upload(run_app(), data)
    assert not at.exception
    assert [e.value for e in at.error] == [markdown_text(raised.value)]  # shown as text (views.escaping)
    assert "\n" not in str(raised.value)
    good = (CATALOG_DIR / DEFAULTS["catalog_model"]).with_suffix(".json").read_bytes()
    at = upload(at, good)
    assert not at.error and markdown_tables(at)


def test_the_page_needs_no_network_and_shows_no_deploy_button(monkeypatch):
    # The browser fetches a ":material/...:" favicon from fonts.gstatic.com (an emoji is an
    # inline SVG; an image file is served by this server), so the icon must not be one.
    calls = []
    original = st.set_page_config
    monkeypatch.setattr(st, "set_page_config", lambda **kwargs: calls.append(kwargs) or original(**kwargs))
    run_app()
    [config] = calls
    icon = str(config.get("page_icon") or "")
    assert not icon.startswith(":material") and "://" not in icon
    settings = tomllib.loads((APP.parent / ".streamlit" / "config.toml").read_text())
    assert settings["client"]["toolbarMode"] == "minimal"  # hides Deploy and the developer menu


# --- Uploads kept for links, hub model ids (issue 14) ---------------------------------------

def test_an_upload_s_link_restores_it_without_the_file():
    data = (CATALOG_DIR / "llama-2-7b.json").read_bytes()  # _name_or_path: meta-llama/Llama-2-7b-hf
    at = upload(run_app(), data)
    digest = hashlib.sha256(data).hexdigest()
    assert at.session_state["config_hash"] == digest
    assert encode({key: at.session_state[key] for key in DEFAULTS if key in at.session_state})["config_hash"] == digest
    caption = at.caption[0].value
    assert caption.startswith(f"**{markdown_text(json.loads(data)['_name_or_path'])} · {digest[:12]}**: ")
    shown = shown_bytes(at)
    # A new session from the shared link: no file uploaded, the same model and numbers.
    shared = AppTest.from_file(str(APP), default_timeout=TIMEOUT_S)
    shared.query_params.update({"model_source": "upload", "config_hash": digest, "task": "causal-lm"})
    shared.run()
    assert not shared.exception and not shared.error, [e.value for e in shared.error]
    assert shared.caption[0].value == caption and shown_bytes(shared) == shown


def test_a_link_to_an_upload_stored_elsewhere_says_so_in_one_line():
    at = AppTest.from_file(str(APP), default_timeout=TIMEOUT_S)
    at.query_params.update({"model_source": "upload", "config_hash": "cd" * 32})
    at.run()
    assert not at.exception
    assert [e.value for e in at.error] == [markdown_text(
        "no uploaded config cdcdcdcdcdcd… is stored on this machine: upload its config.json again "
        "(a link restores an upload only where it was made)")]
    assert at.file_uploader(key="config_upload") is not None  # the sidebar waits for the file


def test_a_bad_hash_in_a_link_is_dropped_before_any_file_is_read(tmp_path):
    at = AppTest.from_file(str(APP), default_timeout=TIMEOUT_S)
    at.query_params.update({"model_source": "upload", "config_hash": "../../../etc/passwd"})
    at.run()
    assert not at.exception and not at.error
    assert "config_hash must be 64 hexadecimal digits" in at.warning[0].value
    assert "Upload" in at.info[0].value and not (tmp_path / "data").exists()


class _FakeHub(http.server.BaseHTTPRequestHandler):
    configs: dict = {}  # "/<id>/resolve/main/config.json" -> bytes
    requests: list = []

    def do_GET(self):  # noqa: N802 (http.server's name)
        type(self).requests.append(self.path)
        data = self.configs.get(self.path)
        self.send_response(200 if data is not None else 404)
        self.end_headers()
        if data is not None:
            self.wfile.write(data)

    def log_message(self, *args):
        pass


@pytest.fixture
def fake_hub(monkeypatch):
    """A local hub serving the catalog's Mistral and DistilBERT configs under their hub ids."""
    st.cache_data.clear()
    _FakeHub.configs = {"/mistralai/Mistral-7B-v0.1/resolve/main/config.json":
                        (CATALOG_DIR / "mistral-7b-v0.1.json").read_bytes(),
                        "/distilbert/distilbert-base-cased/resolve/main/config.json":
                        (CATALOG_DIR / "distilbert-base-cased.json").read_bytes()}
    _FakeHub.requests = []
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _FakeHub)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    monkeypatch.setenv("PLANNER_HUB_URL", f"http://127.0.0.1:{server.server_address[1]}")
    yield _FakeHub
    server.shutdown()
    server.server_close()
    st.cache_data.clear()


def hub_model(at: AppTest, model_id: str) -> AppTest:
    if at.radio(key="model_source").value != "hub":
        at.radio(key="model_source").set_value("hub").run()
    return at.text_input(key="hub_model_id").input(model_id).run()


def test_a_hub_model_id_is_fetched_once_and_planned_as_its_architectures_name(fake_hub):
    at = run_app()
    at.radio(key="model_source").set_value("hub").run()
    assert not at.error and "hub model id" in at.info[0].value
    at = hub_model(at, "mistralai/Mistral-7B-v0.1")
    assert not at.exception and not at.error, [e.value for e in at.error]
    assert at.selectbox(key="task").value == "causal-lm"  # MistralForCausalLM
    assert at.caption[0].value.startswith("**mistralai/Mistral-7B-v0.1**: MistralForCausalLM")
    data = fake_hub.configs["/mistralai/Mistral-7B-v0.1/resolve/main/config.json"]
    scenario = scenario_from_values(**{key: DEFAULTS[key] for key in SCENARIO_KEYS} | {"task": "causal-lm"})
    shape = model_shape_for_config(json.loads(data), scenario.task, scenario.num_labels, "mistral")
    assert_page_shows(at, estimate(shape, scenario))
    at.number_input(key="batch_size").set_value(2).run()  # reruns reuse the fetched config
    assert not at.error
    assert fake_hub.requests == ["/mistralai/Mistral-7B-v0.1/resolve/main/config.json"]
    assert at.session_state["hub_model_id"] == "mistralai/Mistral-7B-v0.1"  # and the link carries it
    assert encode({"model_source": "hub", "hub_model_id": "mistralai/Mistral-7B-v0.1"})["hub_model_id"]
    # A task chosen over the config's is noted (DistilBERT: both of its tasks' tables ship, no probe).
    at = hub_model(at, "distilbert/distilbert-base-cased")
    assert at.selectbox(key="task").value == "masked-lm" and not at.error  # DistilBertForMaskedLM
    at.selectbox(key="task").set_value("sequence-classification").run()
    assert at.info[0].value.startswith("The config's architectures name DistilBertForMaskedLM (masked-lm)")


def test_an_unknown_hub_id_is_one_line_and_the_page_recovers(fake_hub):
    at = hub_model(run_app(), "nobody/nothing")
    assert not at.exception
    assert [e.value for e in at.error] == [markdown_text("the hub has no config.json for 'nobody/nothing' (HTTP 404)")]
    at = hub_model(at, "mistralai/Mistral-7B-v0.1")
    assert not at.error and markdown_tables(at)


def test_offline_the_hub_source_says_so_quickly_and_the_page_stays(monkeypatch):
    st.cache_data.clear()
    with socket.socket() as probe:  # a port nobody listens on: refused at once, as offline
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    monkeypatch.setenv("PLANNER_HUB_URL", f"http://127.0.0.1:{port}")
    at = run_app()
    started = time.monotonic()
    at = hub_model(at, "owner/model")
    assert time.monotonic() - started < 10  # never a hang
    assert not at.exception
    [error] = at.error
    assert error.value.startswith(markdown_text("cannot reach the Hugging Face hub for 'owner/model' ("))
    assert "upload it" in error.value and "\n" not in error.value
    assert at.title[0].value == "Plan" and at.selectbox(key="gpu_preset") is not None  # the page otherwise intact
    at.radio(key="model_source").set_value("catalog").run()
    assert not at.error and markdown_tables(at)
    st.cache_data.clear()


def test_the_plan_page_marks_your_plan_on_peak_against_batch_size():
    at = run_app()
    at.number_input(key="batch_size").set_value(4).run()
    at.number_input(key="grad_accum").set_value(2).run()
    result = expected_estimate(batch_size=4, grad_accum=2)
    drawn = chart(at, 1)  # the second chart: peak against batch size
    assert "your plan (batch 8)" in drawn["legend"]  # the effective batch: 4 x 2 micro-batches
    assert drawn["current"]["batch"] == 8 and drawn["current"]["bytes"] == result.peak_bytes
    assert f"{result.peak_bytes:,} bytes" in drawn["current"]["hover"]
    assert format_bytes(result.peak_bytes) in drawn["current"]["hover"]


def test_a_failed_hub_fetch_is_remembered_for_a_while_only(fake_hub):
    from app_pages import model_cache
    assert model_cache._hub_attempt._info.ttl == model_cache.HUB_RETRY_S == 30  # an error expires
    assert model_cache._hub_config._info.ttl is None  # a config is kept
    path = "/someone/later/resolve/main/config.json"
    at = hub_model(run_app(), "someone/later")
    assert "HTTP 404" in at.error[0].value
    fake_hub.configs[path] = (CATALOG_DIR / "gpt2.json").read_bytes()  # the id appears on the hub
    at.number_input(key="batch_size").set_value(2).run()
    assert "HTTP 404" in at.error[0].value and fake_hub.requests == [path]  # within the ttl: no refetch
    model_cache._hub_attempt.clear()  # the ttl running out
    at.number_input(key="batch_size").set_value(3).run()
    assert not at.error and markdown_tables(at) and fake_hub.requests == [path, path]


def test_a_catalog_models_plan_page_on_cuda_probes_nothing(monkeypatch):
    """The Plan page at the sidebar's defaults (CUDA) walks the catalog's shipped tables, its
    technique chart's checkpointing classes included (scripts/build_probe_tables.py
    --checkpointing): before they shipped, a model's first Plan page probed four classes,
    about 25 s on 2 cores."""
    from planner.probe import cache, run

    probed = []
    monkeypatch.setattr(cache, "_MEMORY", {})
    monkeypatch.setattr(run, "record_probes", lambda *args, **kwargs: probed.append(args) or 1 / 0)
    at = AppTest.from_file(str(APP), default_timeout=TIMEOUT_S)
    at.query_params.update({"catalog_model": "bert-base-uncased", "task": "sequence-classification"})
    at.run()
    assert not at.exception and not probed
    # ... and its technique chart is drawn whole on the default T4 (sm75's bf16 autocast classes,
    # with and without checkpointing, ship too: scripts/ship_kernel_classes.py).
    assert DEFAULTS["gpu_preset"].startswith("T4")
    assert not [i.value for i in at.info if i.value.startswith("Not drawn yet")]


def test_a_new_model_s_plan_page_probes_only_its_own_class_and_draws_the_rest_on_request():
    """An upload nobody has probed: the page answers after probing the sidebar's technique
    class alone (its batch fits, so the batch search never plans batch 1, a class of its own),
    draws the chart lines those tables give, and names the rest; the button probes them and
    the chart then equals memory_vs_batch called directly."""
    from planner.probe import cache
    from tests.conftest import CONFIGS
    from views.comparison import CHART_TECHNIQUES, chart_base, memory_vs_batch, technique_values

    data = (CONFIGS / "tiny-gpt2.json").read_bytes()  # 256 positions
    at = run_app()
    at.number_input(key="seq_len").set_value(128).run()
    at = upload(at, data)
    at.run(timeout=PROBING_TIMEOUT_S)
    assert not at.exception and not at.error
    values = {key: DEFAULTS[key] for key in SCENARIO_KEYS} | DEFAULT_GPU_KERNELS | {"task": "causal-lm", "seq_len": 128}
    scenario = scenario_from_values(**values)
    shape = model_shape_for_config(json.loads(data), scenario.task, scenario.num_labels, "config.json")
    assert_page_shows(at, estimate(shape, scenario))

    def probed(technique, batch):
        return cache.is_ready(shape, scenario_from_values(**technique_values({**values, "batch_size": batch}, technique)))

    baseline, bf16 = CHART_TECHNIQUES[0], next(t for t in CHART_TECHNIQUES if t.key == "bf16")
    assert probed(baseline, 2) and not probed(baseline, 1) and not probed(bf16, 2)
    drawn = chart(at, 1)["series"]
    assert baseline.label in drawn and drawn[baseline.label]["x"][0] == 2  # batch 1 is not probed yet
    assert bf16.label not in drawn
    [note] = [i.value for i in at.info if i.value.startswith("Not drawn yet")]
    assert bf16.label in note and f"batch 1 of {baseline.label}" in note

    at.button(key="probe_chart_techniques").click().run(timeout=PROBING_TIMEOUT_S)
    assert not at.exception and not at.error
    assert not [i for i in at.info if i.value.startswith("Not drawn yet")]
    drawn = chart(at, 1)["series"]
    sizes = next(iter(drawn.values()))["x"]
    expected = memory_vs_batch(shape, dict(chart_base(values)), sizes)  # stored now: no probe
    assert set(drawn) == {t.label for t in CHART_TECHNIQUES}
    for label, points in expected.items():
        assert drawn[label]["x"] == [b for b, _ in points]
        assert drawn[label]["bytes"] == [p for _, p in points]
