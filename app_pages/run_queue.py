"""Verification runs queued one at a time, process-wide, with no Streamlit here.

Each dashboard session submits jobs under its own session id and sees only its own jobs,
with their position in the one queue (0: running now). One worker thread takes the jobs in
order and calls runners.verify.verify for each (which runs the measurement in a child
process and records it in the run history), or, for a job submitted with `distributed`,
runners.distributed_record.verify_distributed (N ranks under torchrun, recorded likewise),
so two runs never compete for one device. Progress events from the child (rank 0 for a
distributed run) become a fraction, a stage and a log line per change.

Known limitations: the queue lives in the Streamlit server's process: restarting the
server drops queued jobs (a run in progress dies with it, its child too, and the next
opening of the run history marks it killed: RunHistory.mark_runs_of_dead_owners).
"""

from __future__ import annotations

import collections
import itertools
import threading
import time
from dataclasses import dataclass, field, replace
from typing import Callable

from planner.errors import PlannerInputError
from planner.strategy import Strategy
from runners.history_errors import HistoryError
from runners.request import VerifyRequest
from runners.unrecorded import unrecorded_note

QUEUED, RUNNING, DONE, CANCELLED = "queued", "running", "done", "cancelled"
DEFAULT_TIMEOUT_S = 900.0
MAX_LOG_LINES = 200


def progress_fraction(event: dict) -> tuple[float, str]:
    """(fraction of the run done, stage text) from one child progress event."""
    stage = event.get("stage", "")
    step, steps = event.get("step"), event.get("steps")
    if stage == "step" and isinstance(step, int) and isinstance(steps, int) and steps > 0:
        return min(step / steps, 1.0) * 0.9, f"step {step} of {steps}"
    if stage == "measuring":
        return 0.95, "measuring"
    return 0.05, str(stage or "working")


@dataclass(frozen=True)
class Distributed:
    """What makes a job a run on several processes."""

    strategy: Strategy
    num_processes: int


@dataclass
class Job:
    id: str
    session_id: str
    label: str
    request: VerifyRequest
    state: str = QUEUED
    fraction: float = 0.0
    stage: str = "queued"
    log: list[str] = field(default_factory=list)
    result: dict | None = None  # verify()'s answer
    error: str | None = None  # why verify() could not even start
    submitted_at: float = field(default_factory=time.time)
    cancel: threading.Event = field(default_factory=threading.Event)
    distributed: Distributed | None = None  # None: one process (runners.verify)

    @property
    def finished(self) -> bool:
        return self.state in (DONE, CANCELLED)

    @property
    def status(self) -> str:
        """The run's status once finished (ok, oom, refused, ...), else the queue state."""
        if self.result is not None:
            return self.result.get("status", DONE)
        if self.error is not None:
            return "error"
        return self.state


@dataclass(frozen=True)
class JobView:
    """A snapshot of one job for a page: safe to read while the worker goes on."""

    job: Job
    position: int | None  # 0 running, n: n-th waiting; None when finished


Runner = Callable[..., dict]


class RunQueue:
    def __init__(self, runner: Runner | None = None, timeout_s: float = DEFAULT_TIMEOUT_S,
                 distributed_runner: Runner | None = None):
        """`runner(request, timeout_s, on_progress, history, cancel=)` runs a one-process job;
        `distributed_runner(request, strategy, num_processes, timeout_s, on_progress, history,
        cancel=)` a distributed one (each loaded on first use when not given)."""
        self._runner = runner
        self._distributed_runner = distributed_runner
        self._timeout_s = timeout_s
        self._lock = threading.Lock()
        self._wakeup = threading.Condition(self._lock)
        self._waiting: collections.deque[Job] = collections.deque()
        self._jobs: dict[str, Job] = {}
        self._running: Job | None = None
        self._ids = itertools.count(1)
        self._worker: threading.Thread | None = None

    # --- for pages ------------------------------------------------------------------------

    def submit(self, session_id: str, label: str, request: VerifyRequest,
               distributed: Distributed | None = None) -> str:
        with self._lock:
            job = Job(id=f"job-{next(self._ids)}", session_id=session_id, label=label, request=request,
                      distributed=distributed)
            job.log.append(f"queued: {label}")
            self._jobs[job.id] = job
            self._waiting.append(job)
            if self._worker is None or not self._worker.is_alive():
                self._worker = threading.Thread(target=self._work, name="verify-queue", daemon=True)
                self._worker.start()
            self._wakeup.notify()
            return job.id

    def jobs(self, session_id: str) -> list[JobView]:
        """This session's jobs, oldest first, each with its place in the whole queue."""
        with self._lock:
            order = {job.id: i + 1 for i, job in enumerate(self._waiting)}
            if self._running is not None:
                order[self._running.id] = 0
            return [JobView(replace(job, log=list(job.log)), order.get(job.id))
                    for job in self._jobs.values() if job.session_id == session_id]

    def cancel(self, session_id: str, job_id: str) -> bool:
        """Drop a waiting job, or stop a running one (its child is killed); False if not this session's."""
        with self._lock:
            job = self._jobs.get(job_id)
            if job is None or job.session_id != session_id or job.finished:
                return False
            job.cancel.set()
            if job in self._waiting:
                self._waiting.remove(job)
                job.state, job.stage = CANCELLED, "cancelled before it started"
                job.log.append("cancelled before it started")
            return True

    def clear_finished(self, session_id: str) -> None:
        with self._lock:
            for job_id in [j.id for j in self._jobs.values() if j.session_id == session_id and j.finished]:
                del self._jobs[job_id]

    def idle(self) -> bool:
        with self._lock:
            return self._running is None and not self._waiting

    def wait_idle(self, timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.idle():
                return True
            time.sleep(0.05)
        return self.idle()

    # --- the worker -----------------------------------------------------------------------

    def _work(self) -> None:
        while True:
            with self._lock:
                while not self._waiting:
                    self._wakeup.wait()
                job = self._waiting.popleft()
                self._running = job
                job.state, job.stage, job.fraction = RUNNING, "starting", 0.02
                job.log.append("started")
            try:
                self._run(job)
            finally:
                with self._lock:
                    self._running = None

    def _one_process_runner(self) -> Runner:
        if self._runner is None:
            from runners.verify import (
                verify,  # torch-free import, but kept off the page's path
            )

            self._runner = verify
        return self._runner

    def _distributed(self) -> Runner:
        if self._distributed_runner is None:
            from runners.distributed_record import verify_distributed

            self._distributed_runner = verify_distributed
        return self._distributed_runner

    def _run(self, job: Job) -> None:
        def on_progress(event: dict) -> None:
            fraction, stage = progress_fraction(event)
            with self._lock:
                if stage != job.stage:
                    job.log.append(stage)
                job.fraction, job.stage = max(job.fraction, fraction), stage

        try:
            if job.distributed is None:
                result = self._one_process_runner()(job.request, self._timeout_s, on_progress, None,
                                                    cancel=job.cancel)
            else:
                result = self._distributed()(job.request, job.distributed.strategy, job.distributed.num_processes,
                                             self._timeout_s, on_progress, None, cancel=job.cancel)
        except (PlannerInputError, HistoryError) as error:  # one line already, saying what to do
            result, error_text = None, str(error)
        except Exception as error:  # the page must keep working whatever a run does
            result, error_text = None, f"{type(error).__name__}: {error}"
        else:
            error_text = None
        with self._lock:
            job.result, job.error = result, error_text
            job.state, job.fraction = DONE, 1.0
            job.stage = error_text or f"finished: {result.get('status')}" + (
                f" ({result['reason']})" if result.get("reason") else "")
            job.log.append(job.stage)
            note = unrecorded_note(result or {})
            if note is not None:
                job.log.append(note)


_QUEUE: RunQueue | None = None
_QUEUE_LOCK = threading.Lock()


def get_queue() -> RunQueue:
    """The one queue of this process (every session of the Streamlit server shares it)."""
    global _QUEUE
    with _QUEUE_LOCK:
        if _QUEUE is None:
            _QUEUE = RunQueue()
        return _QUEUE


def set_queue(queue: RunQueue | None) -> None:
    """Replace the process's queue (tests)."""
    global _QUEUE
    with _QUEUE_LOCK:
        _QUEUE = queue
