"""How a run on several processes (runners.launch) is recorded in the run history, for the
command line (`verify --num-processes`) and the dashboard's queue alike: what is stored as
its scenario, estimate and measurement, and `verify_distributed`, which plans, records,
runs and records the outcome.

Bytes throughout; nothing here formats for display.
"""

from __future__ import annotations

import threading
from typing import Callable

from planner.strategy import Strategy
from runners.history import RunHistory, RunStatus
from runners.request import VerifyRequest
from runners.unrecorded import finish_or_keep


def _distributed_estimate_json(request: VerifyRequest, strategy: Strategy, num_processes: int) -> dict:
    """The planner's estimate for one rank of this multi-device run (single-device keys plus
    per_device_peak_bytes, comm_bytes_per_step, ...), stored with the run in the history."""
    from planner.loading import model_shape_for_config
    from planner.parallel import parallel_estimate
    from planner.strategy import ParallelPlan

    scenario = request.parsed_scenario()
    shape = model_shape_for_config(request.config, scenario.task, scenario.num_labels, request.model_name)
    plan = ParallelPlan(num_processes, strategy, request.local_sgd_steps)
    result = parallel_estimate(shape, scenario, plan)
    return {**result.base.to_json(), **result.to_json(),
            "comm_bytes_over_run": result.comm_bytes_over_run(request.steps)}


def _distributed_scenario_record(request: VerifyRequest, requested: VerifyRequest, strategy: Strategy,
                                 num_processes: int) -> dict:
    """What the history stores as the run's scenario: enough to run it again."""
    return {**request.scenario, "engine": request.engine.value, "steps": request.steps,
            "local_sgd_steps": request.local_sgd_steps, "seed": request.seed, "requested_mode": requested.mode.value,
            "inject_fault": request.inject_fault, "model_config": request.config, "strategy": strategy.value,
            "num_devices": num_processes}


def _distributed_measurement_record(result: dict) -> dict:
    """The result without what is bulky or stored elsewhere (stderr tail, each rank's environment)."""
    record = {k: v for k, v in result.items() if k not in ("stderr_tail", "ranks", "run_id")}
    record["ranks"] = [{k: v for k, v in rank.items() if k != "environment"} for rank in result["ranks"]]
    # `history` lists measurement["peak_bytes"]: for N ranks, the largest rank's peak.
    record["peak_bytes"] = result["max_rank_peak_bytes"]
    return record


def verify_distributed(request: VerifyRequest, strategy: Strategy, num_processes: int, timeout_s: float,
                       on_progress: Callable[[dict], None] | None = None, history: RunHistory | None = None, *,
                       cancel: threading.Event | None = None) -> dict:
    """Plan, record as running, run on `num_processes` ranks (runners.launch.run_distributed),
    record the outcome; answers run_distributed's dict plus run_id, estimated and unrecorded
    (as runners.verify.verify's: None once recorded, else why and the file that keeps it).

    A refused plan is recorded as refused and starts no process. Raises PlannerInputError
    for bad input (nothing is recorded then); the caller's own interruption is recorded
    (failed or killed) and re-raised. `history=None`: the default store."""
    from runners.launch import plan_distributed, run_planned

    plan = plan_distributed(request, strategy, num_processes)
    history = history if history is not None else RunHistory()
    estimated = _distributed_estimate_json(plan.request, strategy, num_processes)
    scenario_record = _distributed_scenario_record(plan.request, request, strategy, num_processes)
    run_id = history.start_run(request.model_name, plan.request.mode.value, scenario_record, estimated)
    started = {"model_name": request.model_name, "mode": plan.request.mode.value, "scenario": scenario_record,
               "estimate": estimated}
    try:
        result = run_planned(plan, timeout_s, on_progress=on_progress, cancel=cancel)
    except BaseException as error:
        status = RunStatus.FAILED if isinstance(error, Exception) else RunStatus.KILLED
        finish_or_keep(history, run_id, status, started,
                       reason=f"the caller stopped: {type(error).__name__}: {error}"[:500])
        raise
    result["run_id"] = run_id
    result["estimated"] = estimated
    environment = result["ranks"][0].get("environment") if result["ranks"] else None
    try:
        result["unrecorded"] = finish_or_keep(history, run_id, result["status"], started,
                                              measurement=_distributed_measurement_record(result),
                                              environment=environment, reason=result["reason"])
    except ValueError as error:  # a measurement the store cannot hold (not JSON, NaN): still record the run
        result.update(status=RunStatus.FAILED.value, reason=f"the result could not be stored: {error}")
        result["unrecorded"] = finish_or_keep(history, run_id, RunStatus.FAILED, started,
                                              reason=result["reason"][:500])
    return result
