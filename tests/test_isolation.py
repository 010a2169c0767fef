"""Run isolation, through a real child process: every failure a run can have (hang, self
SIGKILL, broken import, exception, CUDA out-of-memory, SIGKILL from outside, exit
without a result) becomes a status and a recorded run, never an exception or a zombie;
and the mode planning that decides whether a run may start at all."""

import json
import os
import signal
import sys
import threading
import time
from pathlib import Path

import pytest

from conftest import tiny_config
from planner.accuracy import error_pct
from planner.config_source import resolve_config
from planner.units import GIB
from runners import isolation, verify as verify_module
from runners.child import MISSING_MODULE_FOR_FAULT, requested_bytes
from runners.history import RunHistory, RunMode, RunStatus
from runners.isolation import run_in_child
from runners.request import Engine, Mode, VerifyRequest
from runners.verify import (RAM_FIXED_OVERHEAD_BYTES, available_ram_bytes, cpu_ram_needed_bytes, errors_pct,
                            plan_run, verify)

SCENARIO = {"task": "causal-lm", "batch_size": 2, "seq_len": 16}


@pytest.fixture
def history(tmp_path, monkeypatch) -> RunHistory:
    monkeypatch.setenv("PLANNER_DATA_DIR", str(tmp_path / "data"))
    return RunHistory()  # the default store, so the environment variable is what routes it


def tiny_request(fault: str | None = None, mode: Mode = Mode.CPU, **kwargs) -> VerifyRequest:
    return VerifyRequest(config=tiny_config("tiny-llama"), model_name="tiny-llama", scenario=dict(SCENARIO),
                         mode=mode, inject_fault=fault, **kwargs)


def assert_gone(pid: int) -> None:
    """Not running and not a zombie (a zombie still has /proc/PID, state Z)."""
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except (FileNotFoundError, ProcessLookupError):
            return
        state, ppid = fields[0], int(fields[1])
        # A zombie re-parented to init is init's to reap; an unreaped one of ours has our pid as parent.
        if state in ("Z", "X") and ppid != os.getpid():
            return
        time.sleep(0.05)
    raise AssertionError(f"process {pid} is still alive or an unreaped child of ours")


def assert_recorded(history: RunHistory, result: dict, status: RunStatus) -> None:
    record = history.get(result["run_id"])
    assert record is not None
    assert record.status is status
    assert record.finished_at is not None
    assert record.reason == result["reason"]
    assert history.integrity_ok()


@pytest.mark.parametrize("fault, timeout_s, status, reason_part", [
    ("hang", 3, RunStatus.TIMEOUT, "3 s time limit"),
    ("sigkill-self", 30, RunStatus.KILLED, "SIGKILL"),
    ("import-error", 30, RunStatus.FAILED, MISSING_MODULE_FOR_FAULT),
    ("raise", 30, RunStatus.FAILED, "RuntimeError: injected fault"),
    ("cuda-oom", 30, RunStatus.OOM, "Tried to allocate 2.00 GiB"),
])
def test_each_fault_is_a_recorded_status(history, fault, timeout_s, status, reason_part):
    events = []
    result = verify(tiny_request(fault), timeout_s=timeout_s, on_progress=events.append, history=history)
    assert result["status"] == status.value
    assert reason_part in result["reason"]
    assert "\n" not in result["reason"]
    assert result["mode"] == "cpu" and result["measured"] is None and result["errors_pct"] is None
    assert result["estimated"]["peak_bytes"] > 0
    assert_recorded(history, result, status)
    assert result["child"]["returncode"] is not None  # reaped
    assert_gone(result["child"]["pid"])
    if fault != "import-error":
        assert events and all(e["event"] == "progress" for e in events)
    if fault == "hang":
        assert timeout_s <= result["child"]["wall_s"] < timeout_s + 2  # killed at the limit, not after
    if fault == "cuda-oom":
        assert result["oom_requested_bytes"] == 2 * GIB
        assert history.get(result["run_id"]).measurement == {"oom_requested_bytes": 2 * GIB}
        assert result["environment"]["torch"]


def test_sigkill_from_outside_mid_run_is_recorded_as_killed(history):
    pids, running, results = [], threading.Event(), []
    worker = threading.Thread(target=lambda: results.append(verify(
        tiny_request("hang"), timeout_s=60, history=history, on_start=pids.append,
        on_progress=lambda event: running.set())))
    worker.start()
    assert running.wait(30), "the child never reported progress"
    assert [r.status for r in history.list_runs()] == [RunStatus.RUNNING]
    os.kill(pids[0], signal.SIGKILL)  # as the OOM killer would: the child only
    worker.join(30)
    assert not worker.is_alive()
    (result,) = results
    assert result["status"] == "killed"
    assert "SIGKILL" in result["reason"] and "building model" in result["reason"]
    assert_recorded(history, result, RunStatus.KILLED)
    assert_gone(pids[0])


def test_cancel_stops_the_run(history):
    cancel = threading.Event()
    result = verify(tiny_request("hang"), timeout_s=60, history=history, cancel=cancel,
                    on_progress=lambda event: cancel.set())
    assert result["status"] == "killed" and "stopped by the user" in result["reason"]
    assert_recorded(history, result, RunStatus.KILLED)
    assert_gone(result["child"]["pid"])


def test_caller_interrupt_kills_the_child_and_records_the_run(history):
    pids = []

    def interrupt(event):
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        verify(tiny_request("hang"), timeout_s=60, history=history, on_start=pids.append, on_progress=interrupt)
    (record,) = history.list_runs()
    assert record.status is RunStatus.KILLED and "KeyboardInterrupt" in record.reason
    assert history.integrity_ok()
    assert_gone(pids[0])


def _fake_child(monkeypatch, code: str) -> None:
    monkeypatch.setattr(isolation, "_child_command", lambda: [sys.executable, "-c", code])


def test_exit_without_a_result_is_failed_with_the_last_stderr_line(monkeypatch, history):
    _fake_child(monkeypatch, "import sys; sys.stderr.write('noise\\nlibfoo.so: cannot open shared object\\n'); "
                             "sys.exit(3)")
    result = verify(tiny_request(), timeout_s=30, history=history)
    assert result["status"] == "failed"
    assert "exited with status 3" in result["reason"] and "libfoo.so" in result["reason"]
    assert_recorded(history, result, RunStatus.FAILED)


def test_stdout_noise_is_ignored_and_the_result_line_counts(monkeypatch):
    result_line = {"event": "result", "status": "ok", "mode": "cpu", "engine": "accelerate",
                   "measured": {"peak_bytes": 10}, "environment": {}, "reason": None, "oom_requested_bytes": None}
    _fake_child(monkeypatch, "import json, sys; sys.stdin.read(); print('loading weights...'); "
                             f"print({json.dumps(json.dumps(result_line))})")
    result = run_in_child(tiny_request(), 30)
    assert result["status"] == "ok" and result["measured"] == {"peak_bytes": 10}
    assert "event" not in result


def test_timeout_kills_the_whole_process_group(monkeypatch):
    code = ("import json, subprocess, sys, time; sys.stdin.read(); "
            "p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); "
            "print(json.dumps({'event': 'progress', 'stage': 'building model', 'grandchild': p.pid}), flush=True); "
            "time.sleep(60)")
    _fake_child(monkeypatch, code)
    events = []
    result = run_in_child(tiny_request(), 2, events.append)
    assert result["status"] == "timeout"
    assert_gone(result["child"]["pid"])
    assert_gone(events[0]["grandchild"])


def test_refuses_a_cpu_run_too_big_for_ram_without_a_child(monkeypatch, history):
    monkeypatch.setattr(verify_module, "run_in_child", lambda *a, **k: pytest.fail("a child was started"))
    config, name = resolve_config("llama-2-70b")
    request = VerifyRequest(config=config, model_name=name, scenario={"task": "causal-lm", "batch_size": 1,
                                                                      "seq_len": 512}, mode=Mode.CPU)
    result = verify(request, history=history)
    assert result["status"] == "refused" and result["mode"] == "cpu"
    assert "--mode simulate" in result["reason"]
    assert result["estimated"]["peak_bytes"] > 100 * GIB
    assert_recorded(history, result, RunStatus.REFUSED)
    assert history.get(result["run_id"]).mode is RunMode.CPU


def test_auto_mode_and_device_follow_the_machine():
    small = tiny_request(mode=Mode.AUTO)
    plan = plan_run(small, cuda_available=True)
    assert plan.request.mode is Mode.CUDA and plan.request.scenario["device"] == "cuda"
    assert plan.estimate.scenario.device.value == "cuda"
    plan = plan_run(small, cuda_available=False, available_bytes=64 * GIB)
    assert plan.request.mode is Mode.CPU and plan.request.scenario["device"] == "cpu" and plan.refusal is None
    plan = plan_run(small, cuda_available=False, available_bytes=RAM_FIXED_OVERHEAD_BYTES)  # does not fit
    assert plan.request.mode is Mode.SIMULATE and plan.request.scenario["device"] == "cpu"
    plan = plan_run(small, cuda_available=False, available_bytes=None)  # free RAM unknown: never risk it
    assert plan.request.mode is Mode.SIMULATE
    # An explicit choice is kept, or refused with what to do instead.
    assert plan_run(tiny_request(mode=Mode.CPU), available_bytes=None).refusal is None
    assert "--mode cpu or --mode simulate" in plan_run(tiny_request(mode=Mode.CUDA), cuda_available=False).refusal
    assert plan_run(tiny_request(mode=Mode.SIMULATE)).request.mode is Mode.SIMULATE
    assert small.mode is Mode.AUTO  # the caller's request is not changed


def test_auto_trainer_run_too_big_for_ram_is_refused_not_simulated():
    request = tiny_request(mode=Mode.AUTO, engine=Engine.TRAINER)
    plan = plan_run(request, cuda_available=False, available_bytes=RAM_FIXED_OVERHEAD_BYTES)
    assert plan.request.mode is Mode.CPU and "Trainer" in plan.refusal
    assert plan_run(request, cuda_available=False, available_bytes=64 * GIB).refusal is None


def test_ram_needed_has_a_safety_margin():
    plan = plan_run(tiny_request(mode=Mode.CPU), available_bytes=None)
    needed = cpu_ram_needed_bytes(plan.estimate)
    assert needed == int(plan.estimate.peak_bytes * 1.25) + RAM_FIXED_OVERHEAD_BYTES


def test_available_ram_reads_meminfo(tmp_path):
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       32000000 kB\nMemFree:         1000 kB\nMemAvailable:   24193180 kB\n")
    assert available_ram_bytes(str(meminfo)) == 24193180 * 1024
    assert available_ram_bytes(str(tmp_path / "missing")) is None
    assert available_ram_bytes() is None or available_ram_bytes() > 0


def test_errors_pct():
    assert error_pct(110, 100) == 10.0 and error_pct(90, 100) == -10.0
    assert error_pct(0, 0) == 0.0 and error_pct(5, 0) is None and error_pct(5, None) is None
    estimated = {"peak_breakdown_bytes": {"weights": 100, "gradients": 0, "optimizer_state": 200,
                                          "activations": 50, "temporaries": 10},
                 "optimizer_state_bytes": 200, "peak_bytes": 360}
    measured = {"weights_bytes": 100, "gradients_bytes": 0, "optimizer_state_bytes": 200, "activations_bytes": 40,
                "temporaries_bytes": 20, "peak_bytes": 360}
    assert errors_pct(estimated, measured) == {"weights": 0.0, "gradients": 0.0, "optimizer_state": 0.0,
                                               "activations": 25.0, "temporaries": -50.0, "peak": 0.0}
    assert errors_pct(estimated, None) is None


def test_requested_bytes_from_oom_messages():
    assert requested_bytes("CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 ...") == 2 * GIB
    assert requested_bytes("Tried to allocate 20.00 MiB") == 20 * 2**20
    assert requested_bytes("DefaultCPUAllocator: can't allocate memory: you tried to allocate 4096 bytes.") == 4096
    assert requested_bytes("something else") is None


def test_child_keeps_stdout_for_the_protocol():
    """Python prints and native writes to fd 1 in the child land on stderr, not in the protocol."""
    import subprocess

    code = ("import os, runners.child as child; print('library chatter'); os.write(1, b'native chatter\\n'); "
            "child.emit({'event': 'result', 'status': 'ok'})")
    done = subprocess.run([sys.executable, "-c", code], cwd=Path(__file__).resolve().parents[1],
                          capture_output=True, text=True, timeout=60)
    assert done.stdout.splitlines() == [json.dumps({"event": "result", "status": "ok"})]
    assert "library chatter" in done.stderr and "native chatter" in done.stderr
