"""The child side of a verification run: `python -m runners.child`.

Reads one VerifyRequest JSON object from stdin, runs it (runners.measure.execute) and
writes JSON lines to stdout: progress events, then exactly one `{"event": "result", ...}`
line. runners.isolation starts this process and reads those lines; nothing else may
reach stdout, so fd 1 is pointed at stderr before anything is imported (transformers,
accelerate and C extensions print) and the protocol writes go to a private copy of the
original stdout.

Before anything else the child binds its life to its parent's (runners.parent_death: a
SIGKILLed parent takes it along) and puts itself under the run's memory limit
(runners.memory_limit, from $PLANNER_MEMORY_LIMIT_BYTES).

Every failure becomes a result, not a traceback: an exception is status "failed" with a
one-line reason ("Type: message"); torch.OutOfMemoryError is status "oom" with the size
the allocator was asked for, and so is an allocation refused under the memory limit (its
reason starts "over the run's memory limit"). Only a signal (SIGKILL, the OOM killer, a
segfault) ends the process without a result line; the parent reports those.

`request.inject_fault` (tests only, runners.request.INJECTABLE_FAULTS) stages a failure
before the real work starts, so every failure path runs through a real process.
"""

from __future__ import annotations

import os
import sys

# Before any other import: whatever prints from here on lands on stderr.
_PROTOCOL_FD = os.dup(1)
os.dup2(2, 1)
sys.stdout = sys.stderr

from runners.parent_death import die_with_parent, expected_parent_from_env  # noqa: E402

die_with_parent(expected_parent_from_env())  # before the slow imports: a dead parent ends us at once

from runners import memory_limit  # noqa: E402

MEMORY_LIMIT_BYTES = memory_limit.apply_from_env()  # before torch: every allocation counts

import faulthandler  # noqa: E402
import json  # noqa: E402
import platform  # noqa: E402
import re  # noqa: E402
import signal  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402
from decimal import Decimal  # noqa: E402

MAX_REASON_CHARS = 500
# A module no install has: "import-error" fails exactly as a missing dependency would.
MISSING_MODULE_FOR_FAULT = "runners_injected_missing_dependency"

_UNIT_BYTES = {"B": 1, "bytes": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "TiB": 2**40}
# torch's CUDA caching allocator: "Tried to allocate 2.00 GiB" (value rounded to 2 decimals
# by torch's format_size); CPU allocator: "you tried to allocate 1234 bytes".
_REQUESTED = re.compile(r"[Tt]ried to allocate\s+([0-9]+(?:\.[0-9]+)?)\s*(B|bytes|KiB|MiB|GiB|TiB)\b")

_protocol = os.fdopen(_PROTOCOL_FD, "w", encoding="utf-8", buffering=1)
_protocol_lock = threading.Lock()


def emit(event: dict) -> None:
    """One JSON line on the protocol stream, flushed at once (the parent reads it live)."""
    line = json.dumps(event, allow_nan=False)
    with _protocol_lock:
        _protocol.write(line + "\n")
        _protocol.flush()


def progress(event: dict) -> None:
    emit({**event, "event": "progress"})


def one_line_reason(error: BaseException) -> str:
    text = " ".join(str(error).split())
    reason = f"{type(error).__name__}: {text}" if text else type(error).__name__
    return reason if len(reason) <= MAX_REASON_CHARS else reason[: MAX_REASON_CHARS - 3] + "..."


def requested_bytes(message: str) -> int | None:
    """Bytes an out-of-memory message says were requested (rounded as torch printed them)."""
    match = _REQUESTED.search(message)
    if match is None:
        return None
    return int(Decimal(match.group(1)) * _UNIT_BYTES[match.group(2)])


def environment() -> dict:
    env = {"python": platform.python_version(), "platform": platform.platform(), "pid": os.getpid(),
           "memory_limit_bytes": MEMORY_LIMIT_BYTES, "max_rss_bytes": _max_rss_bytes(),
           "cuda_alloc_conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF")}
    torch = sys.modules.get("torch")
    if torch is not None:
        env["torch"] = torch.__version__
    transformers = sys.modules.get("transformers")
    if transformers is not None:
        env["transformers"] = transformers.__version__
    return env


def _max_rss_bytes() -> int | None:
    """This process's peak resident memory so far (VmHWM), in bytes; None without /proc."""
    try:
        with open("/proc/self/status", encoding="ascii") as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def _is_out_of_memory(error: BaseException) -> bool:
    torch = sys.modules.get("torch")  # never import torch just to classify an error
    return torch is not None and isinstance(error, torch.OutOfMemoryError)


def _stage_fault(fault: str, steps: int) -> None:
    if fault == "hang":
        progress({"stage": "building model", "step": 0, "steps": steps, "message": "injected fault: hanging"})
        while True:
            time.sleep(3600)
    if fault == "sigkill-self":
        progress({"stage": "building model", "step": 0, "steps": steps, "message": "injected fault: killing myself"})
        os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(60)  # the signal is asynchronous; never reach the real run
    if fault == "import-error":
        import importlib

        importlib.import_module(MISSING_MODULE_FOR_FAULT)
    if fault == "raise":
        progress({"stage": "step", "step": 1, "steps": steps, "message": "injected fault: raising"})
        raise RuntimeError("injected fault: the run raised mid-way")
    if fault == "hog-memory":
        if MEMORY_LIMIT_BYTES is None:
            raise RuntimeError("injected fault hog-memory needs a memory limit: it would take the machine's RAM")
        progress({"stage": "step", "step": 1, "steps": steps, "message": "injected fault: allocating without end"})
        held = []
        try:
            while True:  # 64 MiB at a time, every page touched, as a growing run's tensors are
                held.append(bytearray(64 * 2**20))
        except MemoryError:
            held.clear()  # room to report
            raise
    if fault == "cuda-oom":
        import torch

        progress({"stage": "step", "step": 1, "steps": steps, "message": "injected fault: CUDA out of memory"})
        raise torch.OutOfMemoryError(
            "CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 15.74 GiB of which "
            "1.12 GiB is free. Of the allocated memory 13.90 GiB is allocated by PyTorch, and 120.00 MiB is "
            "reserved by PyTorch but unallocated.")


def run(request_json: dict) -> dict:
    """The result object (without "event") for one request; never raises."""
    mode = request_json.get("mode") if isinstance(request_json, dict) else None
    engine = request_json.get("engine") if isinstance(request_json, dict) else None
    base = {"status": "failed", "mode": mode, "engine": engine, "measured": None, "reason": None,
            "oom_requested_bytes": None}
    try:
        from runners.request import Mode, VerifyRequest

        request = VerifyRequest.from_json(request_json)
        base.update(mode=request.mode.value, engine=request.engine.value)
        if request.mode is Mode.AUTO:
            raise ValueError("the parent must resolve mode 'auto' to cuda, cpu or simulate before starting a run")
        if request.inject_fault is not None:
            _stage_fault(request.inject_fault, request.steps)
        from runners.measure import execute

        result = execute(request, progress)
        if not isinstance(result, dict) or result.get("status") not in ("ok", "oom", "failed"):
            raise TypeError(f"runners.measure.execute returned {type(result).__name__} without a valid status")
        return {**base, "environment": environment(), **result}
    except BaseException as error:  # noqa: BLE001: every failure (SystemExit, SIGINT too) is reported
        reason = one_line_reason(error)
        if MEMORY_LIMIT_BYTES is not None and memory_limit.is_allocation_failure(error):
            error.__traceback__ = None  # frees the run's tensors its frames hold: room to report
            return {**base, "status": "oom", "environment": environment(),
                    "reason": memory_limit.over_limit_reason(MEMORY_LIMIT_BYTES, reason)[:MAX_REASON_CHARS],
                    "oom_requested_bytes": requested_bytes(str(error)), "memory_limit_bytes": MEMORY_LIMIT_BYTES}
        if _is_out_of_memory(error):
            return {**base, "status": "oom", "environment": environment(), "reason": reason,
                    "oom_requested_bytes": requested_bytes(str(error))}
        return {**base, "environment": environment(), "reason": reason}


def main() -> int:
    faulthandler.enable(file=sys.stderr)  # a segfault leaves a traceback in the parent's stderr tail
    try:
        request_json = json.loads(sys.stdin.read())
    except (ValueError, UnicodeDecodeError) as error:
        request_json = None
        result = {"status": "failed", "mode": None, "engine": None, "measured": None,
                  "environment": environment(), "reason": f"the request on stdin is not JSON ({error})",
                  "oom_requested_bytes": None}
    if request_json is not None:
        result = run(request_json)
    try:
        emit({**result, "event": "result"})
    except (TypeError, ValueError) as error:  # not JSON-able, or NaN: a bug in the measurement
        emit({"event": "result", "status": "failed", "mode": result.get("mode"), "engine": result.get("engine"),
              "measured": None, "environment": environment(), "oom_requested_bytes": None,
              "reason": f"the result is not valid JSON ({error})"})
    return 0 if result["status"] in ("ok", "oom") else 1


if __name__ == "__main__":
    sys.exit(main())
