"""Run one VerifyRequest on N processes with torchrun (runners.rank_worker per rank), with
a time limit, and answer one dict: the per-rank measurements, or why there are none.

`run_distributed(request, strategy, num_processes, timeout_s)` never raises for anything
the processes do; its statuses:
- "refused": not started (fewer than 2 processes, a strategy the rank worker cannot run,
  simulate mode, too few GPUs, too many CPU processes, not enough free RAM); the reason
  says what to do instead;
- "ok": every rank wrote rank<R>.json;
- "timeout" / "killed": the limit passed or `cancel` was set (every process is killed),
  or the failing rank died by a signal;
- "failed": a rank exited with an error status, or a rank file is missing; the reason
  names the rank, how it ended and the last step rank 0 reported, from torchrun's error
  summary ("Root Cause (first observed failure)") on stderr.

Processes: torchrun runs in its own session (start_new_session), but torch elastic
starts every rank in a session of its own too (subprocess_handler: start_new_session),
so killing torchrun's group does not reach the ranks, and a SIGKILLed torchrun leaves
them orphaned. Clean-up therefore kills, after every run, the process group of every
process whose command line holds this run's private temp dir (torchrun and each rank
carry the JOB.json path in their argv), then torchrun's own group, and reaps torchrun.
A rank's own children share its group, so they go with it.

When this process is SIGKILLed and cannot clean up, the kernel does it: torchrun is
started through runners.parent_death (SIGKILL when this process dies) and each rank asks
the same of torchrun, so the whole run dies with its starter. The private temp dir is a
runners.scratch folder, also every process's TMPDIR (torch elastic's logs land in it): it
is removed after the run, and a SIGKILLed starter's is swept by the next run.

Each CPU rank runs under a memory limit (runners.memory_limit) from the planner's
per-device peak with the one-process safety margin and the free RAM shared by N; a rank
whose allocation fails under it makes the run "oom", "over the run's memory limit".

Known limitations: a process that moves itself into another session and drops the job
path from its argv escapes the clean-up. The RAM pre-flight check is N times the
planner's per-device peak (planner.parallel) with the one-process safety margin.
comm_per_step is rank 0's: ranks issue the same collectives.
"""

from __future__ import annotations

import dataclasses
import json
import os
import queue
import re
import signal
import subprocess
import threading
import time
from collections import deque
from pathlib import Path
from typing import Callable

from planner.scenario import Device
from planner.strategy import ParallelPlan, Strategy
from planner.units import format_bytes
from runners.isolation import exited, read_tail
from runners.memory_limit import (
    ALLOCATION_FAILURES,
    env_with_limit,
    memory_limit_for,
    over_limit_reason,
)
from runners.parent_death import PARENT_PID_ENV, wrapper_command
from runners.request import VERIFIED_STRATEGIES, Mode, VerifyRequest, scenario_measured_on
from runners.scratch import env_with_tmpdir, scratch_dir

PROJECT_ROOT = Path(__file__).resolve().parents[1]
TAIL_LINES = 400  # stderr + stdout lines read for the reason (a rank's traceback precedes torchrun's own)
RESULT_TAIL_LINES = 40  # of those, the last ones kept in the result
MAX_PROCESSES_PER_CPU = 4  # beyond this, CPU ranks mostly wait for each other's cores
_POLL_S = 0.1
_EOF = object()

ZERO_REFUSAL = ("DeepSpeed ZeRO is not a dependency: verify fsdp-shard-grad-op (like ZeRO-2) or "
                "fsdp-full-shard (like ZeRO-3), or use the planner's estimate")
SIMULATE_REFUSAL = "distributed runs measure real tensors: use --mode cpu or cuda"
ONE_PROCESS_REFUSAL = "use `verify` without --num-processes for one process"


@dataclasses.dataclass(frozen=True)
class DistributedPlan:
    request: VerifyRequest  # mode resolved (cpu, cuda or simulate), scenario device set to match
    strategy: Strategy
    num_processes: int
    refusal: str | None  # why the run must not start; None when it may
    memory_limit_bytes: int | None = None  # each CPU rank's (runners.memory_limit); None: none


def _cuda_device_count() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def _with_mode(request: VerifyRequest, mode: Mode) -> VerifyRequest:
    if mode is Mode.SIMULATE:
        return dataclasses.replace(request, mode=mode)
    device = Device.CUDA if mode is Mode.CUDA else Device.CPU
    return dataclasses.replace(request, mode=mode, scenario=scenario_measured_on(request.scenario, device))


def _ram_check(request: VerifyRequest, parallel: ParallelPlan) -> tuple[str | None, int | None]:
    """(why N CPU ranks do not fit in free RAM or None, each rank's memory limit or None)."""
    from planner.loading import model_shape_for_config
    from planner.parallel import parallel_estimate
    from runners.verify import available_ram_bytes, ram_needed_for_peak

    available = available_ram_bytes()
    scenario = request.parsed_scenario()
    shape = model_shape_for_config(request.config, scenario.task, scenario.num_labels, request.model_name)
    per_process = ram_needed_for_peak(parallel_estimate(shape, scenario, parallel).per_device_peak_bytes)
    limit = memory_limit_for("cpu", per_process, None if available is None else available // parallel.num_devices)
    needed = parallel.num_devices * per_process
    if available is None or needed <= available:  # unknown (not Linux): the user asked for cpu
        return None, limit
    return (f"{parallel.num_devices} CPU processes need about {format_bytes(needed)} of RAM (the planner's "
            f"per-device peak plus a safety margin, per process) but only {format_bytes(available)} is "
            "available: use fewer processes or a smaller scenario"), limit


def plan_distributed(request: VerifyRequest, strategy: Strategy, num_processes: int, *,
                     cuda_devices: int | None = None, check_ram: bool = True) -> DistributedPlan:
    """Resolve the mode and decide whether the run may start; nothing runs. `cuda_devices`
    defaults to this machine's GPU count (read only when the mode needs it). Raises
    PlannerInputError for a plan the planner rejects (e.g. local SGD with FSDP)."""
    counted = isinstance(num_processes, int) and not isinstance(num_processes, bool)
    mode = request.mode
    if mode in (Mode.AUTO, Mode.CUDA) and cuda_devices is None:
        cuda_devices = _cuda_device_count()
    if mode is Mode.AUTO:
        mode = Mode.CUDA if counted and cuda_devices >= max(num_processes, 1) else Mode.CPU
    planned = _with_mode(request, mode)

    def answer(refusal: str | None, memory_limit_bytes: int | None = None) -> DistributedPlan:
        return DistributedPlan(planned, strategy, num_processes, refusal, memory_limit_bytes)

    if not counted or num_processes < 2:
        return answer(ONE_PROCESS_REFUSAL)
    if strategy in (Strategy.ZERO1, Strategy.ZERO2, Strategy.ZERO3):
        return answer(ZERO_REFUSAL)
    if strategy not in VERIFIED_STRATEGIES:
        return answer(f"strategy {strategy.value} cannot be verified on several processes: use one of "
                      + ", ".join(s.value for s in VERIFIED_STRATEGIES))
    # Validates the combination (PlannerInputError, e.g. local SGD with FSDP) and sizes the RAM check.
    parallel = ParallelPlan(num_devices=num_processes, strategy=strategy, local_sgd_steps=request.local_sgd_steps)
    if mode is Mode.SIMULATE:
        return answer(SIMULATE_REFUSAL)
    if mode is Mode.CUDA and cuda_devices < num_processes:
        return answer(f"{num_processes} processes need {num_processes} GPUs; this machine has {cuda_devices}")
    if mode is Mode.CPU:
        cores = os.cpu_count() or 1
        if num_processes > MAX_PROCESSES_PER_CPU * cores:
            return answer(f"{num_processes} CPU processes on {cores} CPU cores is too many (at most "
                          f"{MAX_PROCESSES_PER_CPU * cores}): use fewer processes")
        if check_ram:
            return answer(*_ram_check(planned, parallel))
    return answer(None)


# --- processes ---------------------------------------------------------------------------

def _torchrun_command(num_processes: int, job: Path, out: Path) -> list[str]:
    return wrapper_command(os.getpid(), [
        "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(num_processes),
        "--max_restarts", "0", "-m", "runners.rank_worker", str(job), str(out)])


def _env(workdir: Path, memory_limit_bytes: int | None) -> dict:
    """The environment of torchrun and (inherited) every rank: its TMPDIR the run's scratch
    folder, each rank's memory limit (a rank applies it to itself; torchrun does not)."""
    env = {k: v for k, v in os.environ.items() if k != PARENT_PID_ENV}  # a rank's parent is torchrun
    env.setdefault("OMP_NUM_THREADS", "1")  # N ranks share the cores; torchrun would say the same
    env["PYTHONPATH"] = os.pathsep.join([str(PROJECT_ROOT)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    return env_with_limit(env_with_tmpdir(env, workdir), memory_limit_bytes)


def _read_stdout(stream, events: queue.Queue, tail: deque) -> None:
    """Progress events from rank 0; every other line only joins the tail."""
    try:
        for raw in iter(stream.readline, b""):
            line = raw.decode("utf-8", errors="replace").rstrip()
            try:
                item = json.loads(line)
            except ValueError:
                item = None
            if isinstance(item, dict) and "event" in item:
                if item["event"] == "progress":
                    events.put(item)
            elif line.strip():
                tail.append(line)
    except (OSError, ValueError):  # the pipe was closed under us
        pass
    finally:
        events.put(_EOF)


def processes_holding(marker: str) -> list[tuple[int, int]]:
    """(pid, process group id) of every live process whose argv contains `marker`."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as handle:
                argv = handle.read().decode("utf-8", errors="replace")
            with open(f"/proc/{entry}/stat", encoding="utf-8", errors="replace") as handle:
                stat = handle.read()
        except OSError:  # gone meanwhile, or not ours to read
            continue
        fields = stat[stat.rfind(")") + 2:].split()  # after "pid (comm) ": state ppid pgrp ...
        if marker in argv and fields and fields[0] != "Z":
            found.append((int(entry), int(fields[2])))
    return found


def _kill_everything(proc: subprocess.Popen, marker: str) -> None:
    """SIGKILL every rank's group and torchrun's group, then reap torchrun (module docstring)."""
    try:
        os.killpg(proc.pid, signal.SIGSTOP)  # torchrun starts or restarts nothing from here on
    except (ProcessLookupError, PermissionError):
        pass
    for _ in range(3):  # a process caught mid-fork shows up on the next pass
        groups = {pgid for pid, pgid in processes_holding(marker) if pgid > 1 and pgid != os.getpgrp()}
        for pgid in groups:
            try:
                os.killpg(pgid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        if not groups:
            break
        time.sleep(_POLL_S)
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    proc.wait()


# --- reasons -----------------------------------------------------------------------------

_ROOT_CAUSE = re.compile(r"Root Cause")
_RANK = re.compile(r"^\s*rank\s*:\s*(\d+)")
_EXITCODE = re.compile(r"^\s*exitcode\s*:\s*(-?\d+)")
_ERROR_LINE = re.compile(r"^(?:\[rank\d+\]:\s*)?([A-Za-z_][\w.]*(?:Error|Exception|Interrupt)): (.+)$")


def parse_torchrun_failure(lines: list[str]) -> tuple[int | None, int | None]:
    """(rank, exit code) of torchrun's "Root Cause" entry, else of its first failure;
    a negative exit code is a signal number. (None, None) when there is no summary."""
    start = next((i for i, line in enumerate(lines) if _ROOT_CAUSE.search(line)), None)
    section = lines[start:] if start is not None else lines
    rank = code = None
    for line in section:
        if rank is None and (match := _RANK.match(line)):
            rank = int(match.group(1))
        elif rank is not None and code is None and (match := _EXITCODE.match(line)):
            code = int(match.group(1))
            break
    return rank, code


def _rank_error(lines: list[str], rank: int | None) -> str | None:
    """The last 'SomeError: message' line the failing rank printed (torch prefixes a rank's
    lines with "[rankN]:"); without a rank, the last one any process printed but torchrun."""
    for line in reversed(lines):
        text = line.strip()
        if rank is not None and not text.startswith(f"[rank{rank}]:"):
            continue
        match = _ERROR_LINE.match(text)
        if match and not match.group(1).endswith("ChildFailedError"):
            return f"{match.group(1).rsplit('.', 1)[-1]}: {match.group(2)}"[:300]
    return None


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def _where(progress: dict | None) -> str:
    if progress is None:
        return "before the process group formed"
    if progress.get("stage") == "step" and progress.get("step") is not None:
        steps = progress.get("steps")
        return f"at step {progress['step']}" + (f" of {steps}" if steps else "")
    return f"after '{progress.get('stage', '?')}'"


def _failure(returncode: int, tail: list[str], progress: dict | None,
             memory_limit_bytes: int | None = None) -> tuple[str, str]:
    """(status, one-line reason) for a torchrun that exited with `returncode` != 0; a rank
    whose allocation failed under its memory limit makes it "oom" (runners.memory_limit)."""
    status, reason = _torchrun_failure(returncode, tail, progress)
    error = _rank_error(tail, parse_torchrun_failure(tail)[0])
    if memory_limit_bytes is not None and status == "failed" and error is not None \
            and any(text in error for text in ALLOCATION_FAILURES + ("MemoryError",)):
        return "oom", over_limit_reason(memory_limit_bytes, reason)
    return status, reason


def _torchrun_failure(returncode: int, tail: list[str], progress: dict | None) -> tuple[str, str]:
    rank, code = parse_torchrun_failure(tail)
    where = _where(progress)
    if rank is None or code is None:
        if returncode < 0:
            return "killed", f"torchrun was killed by {_signal_name(-returncode)} {where}"
        error = _rank_error(tail, None)
        last = " | ".join(tail[-3:])[-300:] or "nothing on stderr"
        return "failed", f"torchrun exited with status {returncode} {where}: {error or last}"
    if code < 0:
        return "killed", f"rank {rank} died ({_signal_name(-code)}) {where}; torchrun stopped the other ranks"
    error = _rank_error(tail, rank)
    return "failed", (f"rank {rank} exited with status {code} {where}"
                      + (f" ({error})" if error else "") + "; torchrun stopped the other ranks")


# --- results -----------------------------------------------------------------------------

def steady_state_per_step(per_step: list[dict]) -> dict:
    """Mean calls and bytes per kind over steps 2..N (step 1 includes the set-up)."""
    steady = per_step[1:]
    if not steady:
        return {}
    kinds = sorted({kind for step in steady for kind in step})
    return {kind: {"calls": sum(step.get(kind, {}).get("calls", 0) for step in steady) / len(steady),
                   "bytes": sum(step.get(kind, {}).get("bytes", 0) for step in steady) / len(steady)}
            for kind in kinds}


def _read_ranks(out: Path, num_processes: int) -> tuple[list[dict], list[int]]:
    ranks, missing = [], []
    for rank in range(num_processes):
        try:
            ranks.append(json.loads((out / f"rank{rank}.json").read_text()))
        except (OSError, ValueError):
            missing.append(rank)
    return sorted(ranks, key=lambda r: r["rank"]), missing


def _base(plan: DistributedPlan, status: str, reason: str | None) -> dict:
    return {"status": status, "mode": plan.request.mode.value, "strategy": plan.strategy.value,
            "num_processes": plan.num_processes, "ranks": [], "replicas_equal": None, "max_rank_peak_bytes": None,
            "comm_per_step": None, "comm_total": None, "reason": reason, "wall_s": None, "returncode": None,
            "stderr_tail": []}


def run_distributed(request: VerifyRequest, strategy: Strategy, num_processes: int, timeout_s: float,
                    on_progress: Callable[[dict], None] | None = None,
                    cancel: threading.Event | None = None) -> dict:
    """Plan, then run `request` on `num_processes` ranks under torchrun; rank 0's progress
    events go to `on_progress` (in this thread). See the module docstring for statuses.
    Raises PlannerInputError for bad input; if the caller is interrupted (its own
    `on_progress` raising, KeyboardInterrupt) every process is killed before it propagates."""
    return run_planned(plan_distributed(request, strategy, num_processes), timeout_s, on_progress, cancel)


def run_planned(plan: DistributedPlan, timeout_s: float, on_progress: Callable[[dict], None] | None = None,
                cancel: threading.Event | None = None) -> dict:
    """`run_distributed` for a plan already made by `plan_distributed` (refused plans start nothing)."""
    if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or not timeout_s > 0:
        raise ValueError(f"timeout_s must be a positive number of seconds, got {timeout_s!r}")
    if plan.refusal is not None:
        return _base(plan, "refused", plan.refusal)
    started = time.monotonic()
    deadline = started + timeout_s
    with scratch_dir("launch") as workdir:
        job, out = workdir / "job.json", workdir / "out"
        write_job(plan.request, plan.strategy, job)
        return _launch(plan, job, out, started, deadline, timeout_s, on_progress, cancel)


def write_job(request: VerifyRequest, strategy: Strategy, path: Path) -> Path:
    """The rank worker's job file: the request and the strategy, as runners.rank_worker reads them."""
    path.write_text(json.dumps({"request": request.to_json(), "strategy": strategy.value}))
    return path


def _launch(plan: DistributedPlan, job: Path, out: Path, started: float, deadline: float, timeout_s: float,
            on_progress, cancel) -> dict:
    try:
        proc = subprocess.Popen(_torchrun_command(plan.num_processes, job, out), stdin=subprocess.DEVNULL,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=PROJECT_ROOT,
                                env=_env(job.parent, plan.memory_limit_bytes), start_new_session=True)
    except OSError as error:
        return _base(plan, "failed", f"could not start torchrun: {error}")
    events: queue.Queue = queue.Queue()
    tail: deque = deque(maxlen=TAIL_LINES)
    readers = [threading.Thread(target=_read_stdout, args=(proc.stdout, events, tail), daemon=True),
               threading.Thread(target=read_tail, args=(proc.stderr, tail), daemon=True)]
    for reader in readers:
        reader.start()
    stopped: tuple[str, str] | None = None
    last_progress: dict | None = None

    def forward(item) -> None:
        nonlocal last_progress
        last_progress = item
        if on_progress is not None:
            on_progress(item)

    try:
        stdout_open = True
        while True:
            if cancel is not None and cancel.is_set():
                stopped = ("killed", f"stopped by the user {_where(last_progress)}; every rank was killed")
                break
            now = time.monotonic()
            if now >= deadline:
                stopped = ("timeout", f"no result within the {timeout_s:g} s time limit "
                                      f"({_where(last_progress)}); every rank was killed")
                break
            if exited(proc.pid) and (not stdout_open or events.empty()):
                break
            try:
                item = events.get(timeout=min(deadline - now, _POLL_S))
            except queue.Empty:
                continue
            if item is _EOF:
                stdout_open = False
                continue
            forward(item)
    finally:
        _kill_everything(proc, str(job.parent))
        for reader in readers:
            reader.join(timeout=5.0)
        for stream in (proc.stdout, proc.stderr):
            try:
                stream.close()
            except OSError:
                pass
    while True:  # progress that arrived while torchrun was exiting
        try:
            item = events.get_nowait()
        except queue.Empty:
            break
        if item is not _EOF:
            forward(item)

    result = _base(plan, "failed", None)
    result.update(wall_s=round(time.monotonic() - started, 3), returncode=proc.returncode, stderr_tail=list(tail)[-RESULT_TAIL_LINES:])
    if stopped is not None:
        result.update(status=stopped[0], reason=stopped[1])
        return result
    if proc.returncode != 0:
        status, reason = _failure(proc.returncode, list(tail), last_progress, plan.memory_limit_bytes)
        result.update(status=status, reason=reason)
        return result
    ranks, missing = _read_ranks(out, plan.num_processes)
    if missing:
        result["reason"] = ("torchrun exited 0 but rank " + ", ".join(map(str, missing))
                            + " wrote no result file")
        return result
    equal = [r.get("replicas_equal") for r in ranks]
    result.update(status="ok", ranks=ranks, stderr_tail=[],
                  replicas_equal=None if any(e is None for e in equal) else all(equal),
                  max_rank_peak_bytes=max(r["measured"]["peak_bytes"] for r in ranks),
                  comm_per_step=steady_state_per_step(ranks[0]["collectives_per_step"]),
                  comm_total=ranks[0]["collectives_total"])
    return result
