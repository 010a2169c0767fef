"""Run one VerifyRequest in a child process (`python -m runners.child`) with a time limit,
so that a crash, a hang or an out-of-memory kill never takes down the caller.

`run_in_child` never raises for anything the child does; it always answers a result
dict with one of these statuses:
- what the child reported: "ok", "oom" (a valid answer: the scenario did not fit) or
  "failed" (an exception in the run, reason "Type: message");
- "timeout": no result within the limit; the child's whole process group was killed;
- "killed": the child died by a signal (SIGKILL from the OOM killer or a user, a
  segfault...) or `cancel` was set; the reason names the signal;
- "failed": the child exited without a result line; the reason quotes its last stderr.

The child runs in its own session (start_new_session), so its process group holds it
and anything it starts (data loader workers, compile workers); that group is killed
once the run is over, whatever the outcome, and the child is always reaped (no zombies).
A terminal's Ctrl-C does not reach the child's group; if the caller is interrupted
(KeyboardInterrupt, or an exception from its own `on_progress`), the group is killed and
reaped before the exception propagates.

The child dies with this process even when this one is SIGKILLed and cannot clean up
(runners.parent_death: it is told this pid and asks the kernel for SIGKILL when its parent
goes), runs under `memory_limit_bytes` (runners.memory_limit), and gets a private
TMPDIR (runners.scratch) removed after the run: a run leaves no temporary files. A
request's `cuda_alloc_conf` becomes the child's PYTORCH_CUDA_ALLOC_CONF (expandable
segments on or off), set before the child starts, so before CUDA initialises there.

Known limitations: a process that moves itself into another session escapes the group
kill. The group is signalled while its leader is not yet reaped, so its id cannot have
been reused by then.
"""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from collections import deque
from pathlib import Path
from typing import Callable

from runners.memory_limit import env_with_limit
from runners.parent_death import PARENT_PID_ENV
from runners.request import CUDA_ALLOC_CONF_ENV, VerifyRequest
from runners.scratch import env_with_tmpdir, scratch_dir

PROJECT_ROOT = Path(__file__).resolve().parents[1]
STDERR_TAIL_LINES = 20  # kept in the result, for the reason and for debugging
REASON_STDERR_CHARS = 400
EXIT_GRACE_S = 10.0  # after its result line, the child's time to exit before it is killed
_POLL_S = 0.05
_EOF = object()

_SIGNAL_HINTS = {
    signal.SIGKILL: "the kernel's out-of-memory killer or a user sends it",
    signal.SIGTERM: "the process was asked to stop",
    signal.SIGINT: "the process was interrupted",
    signal.SIGSEGV: "the process crashed",
    signal.SIGBUS: "the process crashed",
    signal.SIGABRT: "the process aborted, e.g. a failed check in native code",
}


def _child_command() -> list[str]:
    return [sys.executable, "-m", "runners.child"]


def _child_env(scratch: Path, memory_limit_bytes: int | None, cuda_alloc_conf: str | None = None) -> dict:
    env = dict(os.environ)
    if cuda_alloc_conf is not None:  # read by torch once, at CUDA's initialisation in the child
        env[CUDA_ALLOC_CONF_ENV] = cuda_alloc_conf
    paths = [str(PROJECT_ROOT)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else [])
    env["PYTHONPATH"] = os.pathsep.join(paths)
    env[PARENT_PID_ENV] = str(os.getpid())
    return env_with_limit(env_with_tmpdir(env, scratch), memory_limit_bytes)


def _read_events(stream, events: queue.Queue) -> None:
    """Protocol lines from the child's stdout; anything that is not an event is dropped."""
    try:
        for raw in iter(stream.readline, b""):
            try:
                item = json.loads(raw.decode("utf-8", errors="replace"))
            except ValueError:
                continue
            if isinstance(item, dict) and item.get("event") in ("progress", "result"):
                events.put(item)
    except (OSError, ValueError):  # the pipe was closed under us
        pass
    finally:
        events.put(_EOF)


def read_tail(stream, tail: deque) -> None:
    """Non-empty lines of `stream` into `tail` (a bounded deque), until it closes."""
    try:
        for raw in iter(stream.readline, b""):
            line = raw.decode("utf-8", errors="replace").rstrip()
            if line.strip():
                tail.append(line)
    except (OSError, ValueError):
        pass


def exited(pid: int) -> bool:
    """Whether the child has exited, without reaping it (its pid, and so the process
    group id, stays reserved until `Popen.wait`)."""
    try:
        return os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None
    except ChildProcessError:  # already reaped
        return True


def _wait_exit(pid: int, until: float) -> bool:
    while not exited(pid):
        if time.monotonic() >= until:
            return False
        time.sleep(_POLL_S)
    return True


def _kill_group_and_reap(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):  # the group is already gone
        pass
    proc.wait()


def _stderr_reason(tail: deque) -> str:
    text = " | ".join(list(tail)[-3:])
    if len(text) > REASON_STDERR_CHARS:
        text = "..." + text[-(REASON_STDERR_CHARS - 3):]
    return text or "nothing on stderr"


def _describe_progress(event: dict | None) -> str:
    if event is None:
        return "no progress reported"
    stage = event.get("stage", "?")
    if stage == "step" and event.get("step") is not None:
        steps = event.get("steps")
        return f"last progress: step {event['step']}" + (f" of {steps}" if steps else "")
    return f"last progress: {stage}"


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def _result(request: VerifyRequest, status: str, reason: str) -> dict:
    return {"status": status, "mode": request.mode.value, "engine": request.engine.value, "measured": None,
            "environment": None, "reason": reason, "oom_requested_bytes": None}


def run_in_child(request: VerifyRequest, timeout_s: float,
                 on_progress: Callable[[dict], None] | None = None, *,
                 on_start: Callable[[int], None] | None = None,
                 cancel: threading.Event | None = None, memory_limit_bytes: int | None = None) -> dict:
    """Run `request` in a fresh child process; progress events go to `on_progress` (in
    this thread) as they arrive. `on_start(pid)` is called once the child exists (its
    pid is also its process group id). Setting `cancel` stops the run: status "killed".
    `memory_limit_bytes`: the child's limit (runners.memory_limit); None: none.

    Returns the child's result (status, mode, engine, measured, environment, reason,
    oom_requested_bytes) plus "child": {pid, returncode, wall_s, stderr_tail}.
    """
    if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or not timeout_s > 0:
        raise ValueError(f"timeout_s must be a positive number of seconds, got {timeout_s!r}")
    with scratch_dir("run") as scratch:
        env = _child_env(scratch, memory_limit_bytes, request.cuda_alloc_conf)
        return _run(request, timeout_s, on_progress, on_start, cancel, env)


def _run(request: VerifyRequest, timeout_s: float, on_progress, on_start, cancel, env: dict) -> dict:
    started = time.monotonic()
    deadline = started + timeout_s
    try:
        proc = subprocess.Popen(_child_command(), stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=PROJECT_ROOT,
                                env=env, start_new_session=True)
    except OSError as error:
        return {**_result(request, "failed", f"could not start the run process: {error}"), "child": None}

    events: queue.Queue = queue.Queue()
    tail: deque = deque(maxlen=STDERR_TAIL_LINES)
    readers = [threading.Thread(target=_read_events, args=(proc.stdout, events), daemon=True),
               threading.Thread(target=read_tail, args=(proc.stderr, tail), daemon=True)]
    for reader in readers:
        reader.start()

    result: dict | None = None
    stopped: tuple[str, str] | None = None  # (status, reason) when this side ended the run
    last_progress: dict | None = None
    try:
        if on_start is not None:
            on_start(proc.pid)
        try:
            proc.stdin.write(json.dumps(request.to_json()).encode("utf-8"))
            proc.stdin.close()
        except OSError:  # the child died before reading: its exit status says why
            pass
        while True:
            if cancel is not None and cancel.is_set():
                stopped = ("killed", f"stopped by the user ({_describe_progress(last_progress)})")
                break
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                stopped = ("timeout", f"no result within the {timeout_s:g} s time limit "
                                      f"({_describe_progress(last_progress)}); the run was killed")
                break
            try:
                item = events.get(timeout=min(remaining, 0.2))
            except queue.Empty:
                continue
            if item is _EOF:
                break
            if item["event"] == "result":
                result = item
                break
            last_progress = item
            if on_progress is not None:
                on_progress(item)
        if stopped is None:
            # Stdout is closed or the result is in: the child should be exiting. A child
            # that still has its result to give gets the rest of the time limit; one that
            # gave it gets a grace period for teardown, then its result stands anyway.
            until = time.monotonic() + EXIT_GRACE_S if result is not None else deadline
            if not _wait_exit(proc.pid, until) and result is None:
                stopped = ("timeout", f"no result within the {timeout_s:g} s time limit "
                                      f"({_describe_progress(last_progress)}); the run was killed")
    finally:
        _kill_group_and_reap(proc)
        for reader in readers:
            reader.join(timeout=5.0)
        for stream in (proc.stdin, proc.stdout, proc.stderr):
            try:
                stream.close()
            except OSError:
                pass

    child = {"pid": proc.pid, "returncode": proc.returncode, "wall_s": round(time.monotonic() - started, 3),
             "stderr_tail": list(tail)}
    if stopped is not None:
        return {**_result(request, *stopped), "child": child}
    if result is not None:
        answer = {**_result(request, "failed", None), **result, "child": child}
        answer.pop("event", None)
        return answer
    if proc.returncode < 0:
        number = -proc.returncode
        name = _signal_name(number)
        hint = _SIGNAL_HINTS.get(number)
        reason = (f"the run process was killed by {name}" + (f" ({hint})" if hint else "")
                  + f"; {_describe_progress(last_progress)}; stderr: {_stderr_reason(tail)}")
        return {**_result(request, "killed", reason), "child": child}
    return {**_result(request, "failed", f"the run process exited with status {proc.returncode} without a "
                                         f"result: {_stderr_reason(tail)}"), "child": child}
