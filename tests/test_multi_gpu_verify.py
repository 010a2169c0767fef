"""The Multiple GPUs page's "Verify across processes" through AppTest: a real two-rank DDP
run of a tiny Llama on CPU (gloo) queued from the page, followed to its end, found in the
run history and in the estimated-against-measured table; refusals (ZeRO, simulate, not
enough RAM) shown as one error line with nothing queued and no process started; a failed
run shown as one error line.

The run history is a fresh SQLite file per test (PLANNER_DATA_DIR); each test has its own queue.
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import pytest
from streamlit.testing.v1 import AppTest

from app_pages import run_queue
from planner.loading import model_shape_for_config
from planner.parallel import parallel_estimate
from planner.scenario import scenario_from_values
from planner.strategy import ParallelPlan, Strategy
from runners import launch
from runners.history import RunHistory
from tests.conftest import CONFIGS
from views.inputs import DEFAULTS

APP = Path(__file__).resolve().parents[1] / "app.py"
PAGE = "app_pages/multi_gpu.py"
TIMEOUT_S = 60
RUN_LIMIT_S = 90  # the whole two-rank run: torchrun, two interpreters importing torch, four steps
MODEL = "tiny-llama.json"
SIDEBAR_REST = ("optimizer", "precision", "gradient_checkpointing", "grad_accum", "attn", "num_labels")


@pytest.fixture(autouse=True)
def isolated(tmp_path, monkeypatch):
    monkeypatch.setenv("PLANNER_DATA_DIR", str(tmp_path / "data"))
    yield
    run_queue.set_queue(None)


def page_with_tiny_llama(refused: bool = False) -> AppTest:
    """The page with tests/configs/tiny-llama.json uploaded and a small micro-batch on CPU."""
    at = AppTest.from_file(str(APP), default_timeout=TIMEOUT_S).run()
    at.radio(key="model_source").set_value("upload").run()
    data = (CONFIGS / MODEL).read_bytes()
    at.file_uploader(key="config_upload").set_value((MODEL, data, "application/json")).run()
    at.selectbox(key="task").set_value("causal-lm").run()
    at.number_input(key="batch_size").set_value(1).run()
    at.number_input(key="seq_len").set_value(16).run()
    at.radio(key="device").set_value("cpu").run()
    at.number_input(key="gpu_count").set_value(2).run()
    at.switch_page(PAGE).run()
    assert not at.exception, at.exception
    assert refused or not at.error, [e.value for e in at.error]
    return at


def no_process_may_start(monkeypatch) -> None:
    def refuse(*args, **kwargs):
        raise AssertionError("a refused run started a process")

    monkeypatch.setattr(launch.subprocess, "Popen", refuse)


def test_a_two_process_ddp_run_is_queued_followed_and_shown_beside_its_estimate():
    queue = run_queue.RunQueue(timeout_s=RUN_LIMIT_S)
    run_queue.set_queue(queue)
    at = page_with_tiny_llama()
    assert at.selectbox(key="mgpu_verify_strategy").value == "ddp"
    assert at.number_input(key="mgpu_verify_processes").value == 2
    assert at.number_input(key="mgpu_verify_steps").value == 4
    assert at.info and "No distributed runs" in at.info[-1].value
    at.button(key="mgpu_verify_run").click().run()
    session = at.session_state["verify_session_id"]
    [view] = queue.jobs(session)
    assert view.job.distributed == run_queue.Distributed(Strategy.DDP, 2)
    bars = []
    deadline = time.monotonic() + RUN_LIMIT_S + 30
    while not queue.jobs(session)[0].job.finished and time.monotonic() < deadline:
        at.run()
        bars += [bar.proto.text for bar in at.get("progress")]
        time.sleep(0.5)
    job = queue.jobs(session)[0].job
    assert job.finished, job.log
    assert job.status == "ok", (job.result or {}).get("reason") or job.error
    assert any("running now" in text for text in bars), bars  # live progress while it ran
    assert "step 4 of 4" in job.log  # rank 0's steps reached the queue
    at.run()
    assert not at.exception and not at.error, [e.value for e in at.error]

    [record] = RunHistory().list_runs(limit=None)
    result = job.result
    assert record.id == result["run_id"] and record.status.value == "ok" and record.mode.value == "cpu"
    assert record.scenario["strategy"] == "ddp" and record.scenario["num_devices"] == 2
    assert record.scenario["steps"] == 4 and record.scenario["batch_size"] == 1
    assert record.measurement["max_rank_peak_bytes"] == result["max_rank_peak_bytes"] > 0
    assert len(record.measurement["ranks"]) == 2 and record.measurement["replicas_equal"] is True
    assert any(result["run_id"] in s.value for s in at.success)

    measured = at.dataframe[-1].value
    assert len(measured) == 1
    row = measured.iloc[0]
    assert row["strategy"] == "ddp" and row["ranks"] == 2 and row["mode"] == "cpu"
    assert int(row["measured max rank peak (bytes)"]) == result["max_rank_peak_bytes"]
    # The planner called directly on the scenario the run measured (the sidebar's, on cpu).
    scenario = scenario_from_values(task="causal-lm", batch_size=1, seq_len=16, device="cpu",
                                    **{k: DEFAULTS[k] for k in SIDEBAR_REST})
    shape = model_shape_for_config(json.loads((CONFIGS / MODEL).read_bytes()), scenario.task, scenario.num_labels,
                                   MODEL)
    expected = parallel_estimate(shape, scenario, ParallelPlan(2, Strategy.DDP))
    assert record.estimate["per_device_peak_bytes"] == expected.per_device_peak_bytes
    assert int(row["estimated per-GPU peak (bytes)"]) == expected.per_device_peak_bytes
    assert row["estimated payload per step (bytes)"] == pytest.approx(expected.comm_bytes_per_step)
    assert row["measured payload per step (bytes)"] == pytest.approx(
        sum(kind["bytes"] for kind in result["comm_per_step"].values()))


@pytest.mark.parametrize(("choices", "words"), [
    ({"mgpu_verify_strategy": "zero3"}, launch.ZERO_REFUSAL),
    ({"mgpu_verify_mode": "simulate"}, launch.SIMULATE_REFUSAL),
])
def test_a_refused_request_shows_the_reason_and_starts_nothing(choices, words, monkeypatch):
    queue = run_queue.RunQueue(timeout_s=RUN_LIMIT_S)
    run_queue.set_queue(queue)
    no_process_may_start(monkeypatch)
    at = page_with_tiny_llama()
    for key, value in choices.items():
        at.selectbox(key=key).set_value(value).run()
    assert not at.exception
    assert [e.value for e in at.error] == [f"Not verifiable as chosen: {words}"]
    assert at.button(key="mgpu_verify_run").disabled  # a browser cannot click it (AppTest refuses too)
    at.run()
    assert queue.jobs(at.session_state["verify_session_id"]) == [] and queue.idle()
    assert RunHistory().list_runs(limit=None) == []


def test_a_cpu_run_too_big_for_free_ram_is_refused_with_the_reason(monkeypatch):
    import runners.verify

    queue = run_queue.RunQueue(timeout_s=RUN_LIMIT_S)
    run_queue.set_queue(queue)
    no_process_may_start(monkeypatch)
    monkeypatch.setattr(runners.verify, "available_ram_bytes", lambda: 1024 * 1024)
    at = page_with_tiny_llama(refused=True)
    assert not at.error  # nothing asked yet: the reason is a caption beside the disabled button
    [refusal] = [c.value for c in at.caption if c.value.startswith("Not verifiable as chosen: ")]
    assert "2 CPU processes need about" in refusal and "of RAM" in refusal
    assert at.button(key="mgpu_verify_run").disabled


def test_a_failed_run_is_one_error_line_with_its_reason():
    reason = "rank 1 exited with status 1 at step 2 of 4 (RuntimeError: injected); torchrun stopped the other ranks"

    def failing(request, strategy, num_processes, timeout_s, on_progress, history, cancel=None):
        on_progress({"stage": "step", "step": 1, "steps": request.steps})
        return {"status": "failed", "reason": reason, "ranks": [], "run_id": "r1"}

    queue = run_queue.RunQueue(distributed_runner=failing)
    run_queue.set_queue(queue)
    at = page_with_tiny_llama()
    at.selectbox(key="mgpu_verify_strategy").set_value("fsdp-full-shard").run()
    at.button(key="mgpu_verify_run").click().run()
    assert queue.wait_idle(10)
    at.run()
    assert not at.exception
    [error] = at.error
    assert error.value.endswith(f": failed. {reason}") and "fsdp-full-shard × 2" in error.value
    # Nothing lost: the choices stay, and another run can be queued.
    assert at.selectbox(key="mgpu_verify_strategy").value == "fsdp-full-shard"
    assert not at.button(key="mgpu_verify_run").disabled


def test_a_running_distributed_run_shows_its_step_and_can_be_cancelled():
    started = threading.Event()

    def until_cancelled(request, strategy, num_processes, timeout_s, on_progress, history, cancel=None):
        on_progress({"stage": "step", "step": 1, "steps": request.steps})
        started.set()
        cancel.wait(20)
        return {"status": "killed", "reason": "stopped by the user at step 1 of 4; every rank was killed",
                "ranks": [], "run_id": "r2"}

    queue = run_queue.RunQueue(distributed_runner=until_cancelled)
    run_queue.set_queue(queue)
    at = page_with_tiny_llama()
    at.button(key="mgpu_verify_run").click().run()
    assert started.wait(10)
    at.run()
    [bar] = at.get("progress")
    assert "running now · step 1 of 4" in bar.proto.text
    [job] = queue.jobs(at.session_state["verify_session_id"])
    at.button(key=f"mgpu_cancel_{job.job.id}").click().run()
    assert queue.wait_idle(10)
    at.run()
    [error] = at.error
    assert "killed. stopped by the user" in error.value
