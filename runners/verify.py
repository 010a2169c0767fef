"""One verification run, end to end: what the CLI (`python -m runners verify`) and the
dashboard call.

`verify(request)`:
1. computes the planner's estimate for the scenario (the same ModelShape path as
   `python -m planner estimate`);
2. resolves the measurement mode: `auto` is cuda when torch sees a GPU, else cpu when a
   real CPU run fits in the machine's available RAM, else simulate. An explicit `cpu`
   run that does not fit, an explicit `cuda` run without a GPU, or an `auto` Trainer run
   that fits neither (the Trainer cannot be simulated), is refused (status "refused")
   without starting a child;
3. sets the scenario's device to the kind that measures it (cuda for cuda; cpu for cpu
   and simulate, which runs CPU kernels on fake tensors), so estimate and measurement
   describe the same kernels;
4. records the run in the RunHistory before the child starts and closes the record with
   every outcome (ok, oom, refused, timeout, killed, failed; "killed" too when the caller
   is interrupted);
5. runs the request in a child process (runners.isolation) and answers one dict:
   run_id, status, mode, engine, measured, estimated (Estimate.to_json()), errors_pct,
   environment, reason, oom_requested_bytes, child, unrecorded, memory_limit_bytes (the
   child's limit, runners.memory_limit: from this estimate and the free RAM; None for cuda).

`unrecorded` is None once the outcome is in the history. When the history cannot store it
(its database deleted, replaced or damaged during the run) the outcome is kept in a file
beside the database (runners.unrecorded) and `unrecorded` says why and where:
{"error", "kept_in"}. A history that cannot be opened at all is a HistoryError before
anything runs.

"Fits in RAM" (`cpu_ram_needed_bytes`): the planner's CPU peak (models are built
directly in their training dtype, so the build never exceeds it), times 1.25 for allocator fragmentation and estimate error,
plus 1 GiB for the interpreter, torch, transformers and MemTracker's own bookkeeping,
compared with /proc/meminfo MemAvailable (memory the kernel can hand out without
swapping). Known limitations: where /proc/meminfo is missing (not Linux) free RAM is
unknown: `auto` then simulates, and an explicit `cpu` run is allowed (the user asked).
The check is made once, before the run; other processes can use the RAM meanwhile,
which is what the child's isolation is for.

errors_pct: (estimated - measured) / measured * 100 per category of the breakdown at each
side's own peak (positive: the planner over-estimates), for the peak and for the
optimizer state (constant over the step, so it is also the planner's exact figure);
None where the measured value is missing, or zero while the estimate is not.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import threading
from dataclasses import dataclass
from typing import Callable

from planner.accuracy import error_pct
from planner.estimate import Estimate, estimate
from planner.loading import model_shape_for_config
from planner.scenario import Device
from planner.units import GIB, format_bytes
from runners.history import RunHistory, RunMode, RunStatus
from runners.isolation import run_in_child
from runners.memory_limit import memory_limit_for
from runners.request import SIMULATE_NEEDS_ACCELERATE, Engine, Mode, VerifyRequest, scenario_measured_on
from runners.unrecorded import finish_or_keep

DEFAULT_TIMEOUT_S = 600.0
RAM_SAFETY_FACTOR = 1.25  # allocator fragmentation and the estimate's own error
RAM_FIXED_OVERHEAD_BYTES = 1 * GIB  # interpreter + torch + transformers + MemTracker, measured ~0.6 GiB
CATEGORIES = ("weights", "gradients", "optimizer_state", "activations", "temporaries")
MEMINFO = "/proc/meminfo"


def available_ram_bytes(meminfo_path: str = MEMINFO) -> int | None:
    """MemAvailable from /proc/meminfo, in bytes; None where it cannot be read."""
    try:
        with open(meminfo_path, encoding="ascii") as lines:
            for line in lines:
                if line.startswith("MemAvailable:"):
                    value, unit = line.split()[1:3]
                    return int(value) * (1024 if unit.lower() == "kb" else 1)  # /proc's "kB" is KiB
    except (OSError, ValueError, IndexError):
        return None
    return None


def ram_needed_for_peak(peak_bytes: int) -> int:
    """RAM one CPU process with this planner peak needs, safety margin included (module docstring)."""
    return int(peak_bytes * RAM_SAFETY_FACTOR) + RAM_FIXED_OVERHEAD_BYTES


def cpu_ram_needed_bytes(cpu_estimate: Estimate) -> int:
    """RAM a real CPU run of this scenario needs, safety margin included (module docstring)."""
    return ram_needed_for_peak(cpu_estimate.peak_bytes)


def cuda_is_available() -> bool:
    import torch

    return torch.cuda.is_available()


NVIDIA_DRIVER = "/proc/driver/nvidia/version"


def cuda_is_likely_available(driver_path: str = NVIDIA_DRIVER) -> bool:
    """torch's answer when torch is already imported, else whether an NVIDIA driver is
    loaded: lets a page say which estimate an `auto` run compares against without
    importing torch (seconds). A CPU-only torch build on a GPU machine reads True here."""
    torch = sys.modules.get("torch")
    if torch is not None:
        return torch.cuda.is_available()
    return os.path.exists(driver_path)


@dataclass(frozen=True)
class RunPlan:
    request: VerifyRequest  # mode resolved (never auto), scenario device set to the measured kind
    estimate: Estimate  # the planner's estimate for exactly that scenario
    refusal: str | None  # why the run must not start; None when it may


def _with_device(request: VerifyRequest, mode: Mode) -> VerifyRequest:
    device = Device.CUDA if mode is Mode.CUDA else Device.CPU
    return dataclasses.replace(request, mode=mode, scenario=scenario_measured_on(request.scenario, device))


_THIS_MACHINE = object()  # plan_run's default: read this machine's free RAM


def plan_run(request: VerifyRequest, *, cuda_available: bool | None = None,
             available_bytes: int | None | object = _THIS_MACHINE) -> RunPlan:
    """Resolve the mode and compute the estimate; nothing runs. `cuda_available` and
    `available_bytes` default to this machine's (pass them to plan for another).
    Raises PlannerInputError for a config or scenario the planner cannot take."""
    scenario = request.parsed_scenario()
    shape = model_shape_for_config(request.config, scenario.task, scenario.num_labels, request.model_name)

    def estimate_for(mode: Mode) -> tuple[VerifyRequest, Estimate]:
        planned = _with_device(request, mode)
        return planned, estimate(shape, planned.parsed_scenario())

    mode = request.mode
    # QLoRA simulates too: its 4-bit base is built on fake tensors as the real load builds it
    # (planner.probe.fake_quantized; tests/test_qlora.py measures both alike).
    if mode is Mode.SIMULATE:
        return RunPlan(*estimate_for(mode), refusal=None)
    if mode in (Mode.AUTO, Mode.CUDA):
        if cuda_available is None:
            cuda_available = cuda_is_available()
        if cuda_available:
            return RunPlan(*estimate_for(Mode.CUDA), refusal=None)
        if mode is Mode.CUDA:
            return RunPlan(*estimate_for(Mode.CUDA),
                           refusal="CUDA is not available on this machine: use --mode cpu or --mode simulate")
    if available_bytes is _THIS_MACHINE:
        available_bytes = available_ram_bytes()
    planned, cpu_estimate = estimate_for(Mode.CPU)
    needed = cpu_ram_needed_bytes(cpu_estimate)
    fits = available_bytes is not None and needed <= available_bytes
    too_big = (f"a real CPU run needs about {format_bytes(needed)} (planner peak "
               f"{format_bytes(cpu_estimate.peak_bytes)} plus a safety margin) but "
               + ("this machine's free RAM is unknown" if available_bytes is None
                  else f"only {format_bytes(available_bytes)} of RAM is available"))
    if mode is Mode.AUTO:
        if fits:
            return RunPlan(planned, cpu_estimate, None)
        if request.engine is Engine.TRAINER:  # the Trainer cannot run on fake tensors
            return RunPlan(planned, cpu_estimate, refusal=f"{too_big}, and {SIMULATE_NEEDS_ACCELERATE}")
        return RunPlan(*estimate_for(Mode.SIMULATE), refusal=None)
    if fits or available_bytes is None:  # explicit cpu; unknown free RAM: the user's call
        return RunPlan(planned, cpu_estimate, None)
    return RunPlan(planned, cpu_estimate, refusal=f"{too_big}: use --mode simulate to measure it without allocating")


def errors_pct(estimated: dict, measured: dict | None) -> dict | None:
    """Per category (at each side's peak), plus peak; None without a measurement."""
    if not measured:
        return None
    breakdown = estimated["peak_breakdown_bytes"]
    errors = {c: error_pct(breakdown[c], measured.get(f"{c}_bytes")) for c in CATEGORIES}
    errors["optimizer_state"] = error_pct(estimated["optimizer_state_bytes"], measured.get("optimizer_state_bytes"))
    errors["peak"] = error_pct(estimated["peak_bytes"], measured.get("peak_bytes"))
    return errors


def _scenario_record(plan: RunPlan, requested: VerifyRequest) -> dict:
    """What the history stores as the run's scenario: enough to run it again."""
    run = plan.request
    return {**run.scenario, "engine": run.engine.value, "steps": run.steps, "local_sgd_steps": run.local_sgd_steps,
            "seed": run.seed, "requested_mode": requested.mode.value, "inject_fault": run.inject_fault,
            "cuda_alloc_conf": run.cuda_alloc_conf, "model_config": run.config}


def _measurement_record(outcome: dict) -> dict | None:
    measured = outcome.get("measured")
    if measured:
        return dict(measured)
    if outcome.get("oom_requested_bytes") is not None:
        return {"oom_requested_bytes": outcome["oom_requested_bytes"]}
    return None


def verify(request: VerifyRequest, timeout_s: float = DEFAULT_TIMEOUT_S,
           on_progress: Callable[[dict], None] | None = None, history: RunHistory | None = None, *,
           on_start: Callable[[int], None] | None = None, cancel: threading.Event | None = None) -> dict:
    """Plan, record, run in a child, record the outcome; see the module docstring.

    `history=None` uses the default store (RunHistory(): $PLANNER_DATA_DIR or ./data).
    Never raises for what the run does; raises PlannerInputError for bad input and
    HistoryError for a history that cannot be opened (nothing is recorded or run then),
    and re-raises the caller's own interruption after recording it.
    """
    history = history if history is not None else RunHistory()  # a database fault stops us before any work
    plan = plan_run(request)
    estimated = plan.estimate.to_json()
    run_mode = RunMode(plan.request.mode.value)
    scenario_record = _scenario_record(plan, request)
    run_id = history.start_run(request.model_name, run_mode, scenario_record, estimated)
    started = {"model_name": request.model_name, "mode": run_mode.value, "scenario": scenario_record,
               "estimate": estimated}
    base = {"run_id": run_id, "mode": plan.request.mode.value, "engine": plan.request.engine.value,
            "measured": None, "estimated": estimated, "errors_pct": None, "environment": None,
            "oom_requested_bytes": None, "child": None, "memory_limit_bytes": None}
    if plan.refusal is not None:
        unrecorded = finish_or_keep(history, run_id, RunStatus.REFUSED, started, reason=plan.refusal)
        return {**base, "status": RunStatus.REFUSED.value, "reason": plan.refusal, "unrecorded": unrecorded}
    needed = cpu_ram_needed_bytes(plan.estimate) if plan.request.mode is Mode.CPU else None
    limit = memory_limit_for(plan.request.mode.value, needed, available_ram_bytes())
    base["memory_limit_bytes"] = limit
    try:
        outcome = run_in_child(plan.request, timeout_s, on_progress, on_start=on_start, cancel=cancel,
                               memory_limit_bytes=limit)
    except BaseException as error:
        status = RunStatus.FAILED if isinstance(error, Exception) else RunStatus.KILLED
        finish_or_keep(history, run_id, status, started,
                       reason=f"the caller stopped: {type(error).__name__}: {error}"[:500])
        raise
    answer = {**base, **{k: outcome.get(k) for k in ("status", "measured", "environment", "reason",
                                                      "oom_requested_bytes", "child")}}
    answer["errors_pct"] = errors_pct(estimated, answer["measured"]) if answer["status"] == "ok" else None
    try:
        answer["unrecorded"] = finish_or_keep(history, run_id, answer["status"], started,
                                              measurement=_measurement_record(answer),
                                              environment=answer["environment"], reason=answer["reason"])
    except ValueError as error:  # a measurement the store cannot hold (not JSON, NaN): still record the run
        answer.update(status=RunStatus.FAILED.value, reason=f"the result could not be stored: {error}")
        answer["unrecorded"] = finish_or_keep(history, run_id, RunStatus.FAILED, started,
                                              reason=answer["reason"][:500])
    return answer
