"""Reliability and security of the dashboard and its files: failed runs on the Verify queue,
several sessions at once, escaping in the HTML report, export names, no code-executing
loads, localhost-only serving. (Bad input: test_bad_input_properties.py; concurrent
writers and kills mid-transaction: test_history.py.)
"""

from __future__ import annotations

import dataclasses
import json
import re
import threading
import time
import tomllib
from pathlib import Path

import pytest
from streamlit.testing.v1 import AppTest

from app_pages import run_queue
from planner.catalog import catalog_config
from planner.config_source import config_from_bytes
from planner.errors import PlannerInputError
from planner.loading import model_shape_for_config
from planner.scenario import MAX_NUM_LABELS, scenario_from_values
from reporting.build import FORMATS, build_report, export_file_name, render_report
from runners.history import RunHistory
from runners.verify import verify
from tests.conftest import tiny_config
from views.inputs import DEFAULTS
from views.verify_results import plan_request

ROOT = Path(__file__).resolve().parents[1]
APP = ROOT / "app.py"
FAULTS_SURVIVED: list[str] = []  # shown in the terminal summary (conftest)
SCRIPT = "<script>alert('x')</script>"


@pytest.fixture(autouse=True)
def isolated(tmp_path, monkeypatch):
    monkeypatch.setenv("PLANNER_DATA_DIR", str(tmp_path / "data"))
    yield
    run_queue.set_queue(None)


def verify_page() -> AppTest:
    at = AppTest.from_file(str(APP), default_timeout=60).run()
    at.switch_page("app_pages/verify.py").run()
    assert not at.exception, at.exception
    return at


def tiny_request(fault: str | None, steps: int = 2):
    values = {"task": "causal-lm", "batch_size": 1, "seq_len": 16, "optimizer": "adamw", "precision": "fp32",
              "gradient_checkpointing": False, "grad_accum": 1, "attn": "sdpa", "device": "cpu", "num_labels": 2}
    request = plan_request(tiny_config("tiny-llama"), f"tiny-{fault or 'ok'}", values, "simulate", steps)
    return dataclasses.replace(request, inject_fault=fault)


# --- failed runs ------------------------------------------------------------------------------

# fault -> (status the history and the page show, words its reason must hold)
FAULTS = {
    "cuda-oom": ("oom", "out of memory"),
    "hang": ("timeout", "time"),
    "sigkill-self": ("killed", "SIGKILL"),
    "import-error": ("failed", "runners_injected_missing_dependency"),
    "raise": ("failed", "injected fault"),
}
HANG_TIMEOUT_S = 6.0


def test_verify_queue_records_each_failed_run_shows_it_and_goes_on():
    def runner(request, timeout_s, on_progress, history, cancel=None):  # the real verify, a short time-out for the hang
        return verify(request, HANG_TIMEOUT_S if request.inject_fault == "hang" else 120.0, on_progress, history,
                      cancel=cancel)

    queue = run_queue.RunQueue(runner=runner)
    run_queue.set_queue(queue)
    at = verify_page()
    session = at.session_state["verify_session_id"]
    for fault in FAULTS:
        queue.submit(session, f"fault {fault}", tiny_request(fault))
    queue.submit(session, "after the faults", tiny_request(None))  # the queue must reach it
    assert queue.wait_idle(240)
    at.run()
    assert not at.exception
    jobs = {view.job.label: view.job for view in queue.jobs(session)}
    records = {record.id: record for record in RunHistory().list_runs(limit=None)}
    warnings = "\n".join(w.value for w in at.warning)
    for fault, (status, words) in FAULTS.items():
        job = jobs[f"fault {fault}"]
        assert job.status == status, (fault, job.result, job.log)
        reason = job.result["reason"]
        assert words.lower() in reason.lower(), (fault, reason)
        record = records[job.result["run_id"]]
        assert record.status.value == status and record.reason == reason  # recorded, with its reason
        assert f"fault {fault}: {status}." in warnings  # the page shows it
        FAULTS_SURVIVED.append(f"{fault}->{status}")
    last = jobs["after the faults"]
    assert last.status == "ok" and last.result["measured"]["peak_bytes"] > 0, last.log
    assert records[last.result["run_id"]].status.value == "ok"
    assert list(at.dataframe[0].value["status"]).count("ok") == 1  # history table lists all six


# --- several users ----------------------------------------------------------------------------

def test_two_sessions_enqueue_at_once_each_sees_its_own_position_one_run_at_a_time():
    gate, running, most = threading.Event(), [0], [0]
    lock = threading.Lock()

    def fake(request, timeout_s, on_progress, history, cancel=None):
        with lock:
            running[0] += 1
            most[0] = max(most[0], running[0])
        gate.wait(20)
        time.sleep(0.01)
        with lock:
            running[0] -= 1
        return {"status": "ok", "mode": "simulate", "reason": None, "measured": None,
                "estimated": {"peak_bytes": 1, "peak_breakdown_bytes": {}}}

    queue = run_queue.RunQueue(runner=fake)
    run_queue.set_queue(queue)
    # AppTest is not thread-safe (two runs at once break its script compilation), so the two
    # pages click one after the other, both while the first run holds the device; the
    # threads below submit truly at once, as two server sessions' script threads do.
    alice, bob = verify_page(), verify_page()
    alice.button(key="verify_plan").click().run()
    bob.button(key="verify_plan").click().run()
    alice.run()
    bob.run()
    a_id, b_id = alice.session_state["verify_session_id"], bob.session_state["verify_session_id"]
    [a_view], [b_view] = queue.jobs(a_id), queue.jobs(b_id)  # each sees only its own run
    assert sorted([a_view.position, b_view.position]) == [0, 1]  # one runs, the other waits behind it
    for at, view in ((alice, a_view), (bob, b_view)):
        [bar] = at.get("progress")
        assert ("running now" if view.position == 0 else "waiting, 1 ahead in the queue") in bar.proto.text
    # More sessions submit at once from threads: positions stay distinct, runs never overlap.
    sessions = [f"s{i}" for i in range(8)]
    start = threading.Barrier(len(sessions))

    def submit(session):
        start.wait(10)
        queue.submit(session, session, tiny_request(None))

    threads = [threading.Thread(target=submit, args=(s,)) for s in sessions]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(10)
    positions = [view.position for s in sessions for view in queue.jobs(s)]
    assert sorted(positions) == list(range(2, 2 + len(sessions)))
    gate.set()
    assert queue.wait_idle(20)
    assert most[0] == 1


# --- security ---------------------------------------------------------------------------------

def hostile_config() -> bytes:
    # GPT-2's catalog config under hostile names: the names are not what transformers builds, so it
    # is planned from GPT-2's shipped tables (planner.config_identity) and nothing is probed here.
    config = catalog_config("gpt2")
    config.update({"_name_or_path": f"<img src=x onerror=alert(1)>{SCRIPT}", "architectures": [SCRIPT]})
    return json.dumps(config).encode()


def test_html_report_escapes_a_hostile_upload_name_and_fields(tmp_path):
    name = f"{SCRIPT}.json"
    config = config_from_bytes(hostile_config(), name)
    values = {k: DEFAULTS[k] for k in ("batch_size", "seq_len", "optimizer", "precision", "gradient_checkpointing",
                                       "grad_accum", "attn", "device", "num_labels")} | {"task": "causal-lm"}
    scenario = scenario_from_values(**values)
    shape = model_shape_for_config(config, scenario.task, scenario.num_labels, name)
    history = RunHistory()
    run_id = history.start_run(name, "simulate", {**values, "model_config": config}, {"peak_bytes": 1})
    history.finish_run(run_id, "failed", reason=f"child said {SCRIPT}")
    report = build_report(shape, values, 16 * 2**30, f"GPU {SCRIPT}", 1, history.list_runs(limit=None), config,
                          search_adapters=False)  # escaping, not What fits' LoRA search, is tested here
    html = render_report(report, "html")
    for raw in (SCRIPT, "<img src=x", "<script>alert"):
        assert raw not in html, raw
    assert "&lt;script&gt;alert(&#x27;x&#x27;)&lt;/script&gt;" in html  # shown, escaped
    # The upload through the dashboard: its report page renders, downloads carry a safe name. Its
    # architectures name no head the planner knows: the sidebar's task (GPT-2's own) is used.
    at = AppTest.from_file(str(APP), default_timeout=60)
    at.session_state["fit_search_adapters"] = False  # What fits' LoRA search is not what this tests
    at.run()
    at.selectbox(key="task").set_value("causal-lm").run()
    at.radio(key="model_source").set_value("upload").run()
    at.file_uploader(key="config_upload").set_value((name, hostile_config(), "application/json")).run()
    at.switch_page("app_pages/report.py").run()
    assert not at.exception and not at.error, [e.value for e in at.error]
    assert len(at.get("download_button")) == len(FORMATS)
    assert SCRIPT not in "".join(m.value for m in at.markdown)  # the preview shows it as text, escaped


@pytest.mark.parametrize("name", ["../../etc/passwd", "/etc/passwd", "..", ".", "", "..\\..\\windows\\x",
                                  "a/../../b.json", "\x00evil", SCRIPT, "~/.bashrc", ".hidden.json", "x" * 1000])
def test_export_file_names_stay_in_the_output_directory(name, tmp_path):
    for fmt in FORMATS:
        file_name = export_file_name(name, fmt)
        target = (tmp_path / file_name).resolve()
        assert target.parent == tmp_path.resolve() and not file_name.startswith(".")
        assert re.fullmatch(r"[A-Za-z0-9_-]+-memory-plan\." + fmt, file_name), file_name
        assert len(file_name) < 120


CODE_DIRS = ("planner", "runners", "views", "reporting", "app_pages", "benchmarks", "scripts", "tests")
FORBIDDEN = ("pickle" + ".load", "torch" + ".load", "trust_remote_code" + "=True", "weights_only" + "=False",
             "yaml" + ".load(", "marshal" + ".load", "shelve" + ".open", "dill" + ".load", "joblib" + ".load")


def test_no_code_executing_load_anywhere_in_the_source():
    files = [ROOT / "app.py", *(p for d in CODE_DIRS for p in (ROOT / d).rglob("*.py"))]
    assert len(files) > 40
    found = [f"{path.relative_to(ROOT)}: {bad}" for path in files
             for bad in FORBIDDEN if bad in path.read_text(encoding="utf-8", errors="replace")]
    assert found == []


def test_server_binds_to_localhost_and_uploads_are_small():
    settings = tomllib.loads((ROOT / ".streamlit" / "config.toml").read_text())
    assert settings["server"]["address"] in ("localhost", "127.0.0.1")
    assert settings["server"]["maxUploadSize"] <= 1
    assert settings["browser"]["gatherUsageStats"] is False


# --- bad input on the dashboard ---------------------------------------------------------------

@pytest.mark.parametrize("data", [
    b'{"model_type": "llama", "hidden_size": ' + b"9" * 5000 + b"}",  # over Python's int-conversion limit
    b'{"model_type": "llama", "x": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",
    b'{"model_type": "llama", "num_hidden_layers": -3, "hidden_size": 1e400}',
])
def test_bad_upload_is_an_error_box_and_the_page_keeps_working(data):
    at = AppTest.from_file(str(APP), default_timeout=60).run()
    at.radio(key="model_source").set_value("upload").run()
    at.file_uploader(key="config_upload").set_value(("config.json", data, "application/json")).run()
    assert not at.exception
    [box] = at.error
    assert "\n" not in box.value
    good = json.dumps(catalog_config("gpt2")).encode()  # its classes ship: the page plans it at once
    at.file_uploader(key="config_upload").set_value(("config.json", good, "application/json")).run()
    assert not at.exception and not at.error and at.metric


def test_absurd_label_count_is_bounded_not_a_hang():
    # The widget holds the planner's own limit (a bigger id2label dict takes minutes to
    # build), so an absurd count never reaches a build; the planner refuses it too.
    at = AppTest.from_file(str(APP), default_timeout=60).run()
    at.selectbox(key="task").set_value("sequence-classification").run()
    assert at.number_input(key="num_labels").max == MAX_NUM_LABELS
    at.number_input(key="num_labels").set_value(10**12).run()
    assert not at.exception and at.number_input(key="num_labels").value <= MAX_NUM_LABELS and at.metric
    with pytest.raises(PlannerInputError, match="number of labels must be at most"):
        scenario_from_values(task="sequence-classification", batch_size=1, seq_len=8, num_labels=10**12)
    at.number_input(key="num_labels").set_value(2).run()  # back to a usual head (its probe tables ship)
    assert not at.exception and not at.error and at.metric
