"""Verification requests and results for the Verify page and the report, with no Streamlit
here: which requests a button queues, estimated-vs-measured values per category, the run
history as a table and as scatter points."""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import pandas as pd

from planner.accuracy import error_pct
from planner.scenario import Device
from planner.units import format_bytes
from runners.request import Engine, Mode, VerifyRequest
from runners.verify import CATEGORIES
from views.comparison import TECHNIQUES, technique_values

MODES = tuple(m.value for m in Mode)


def measured_device(mode: str, cuda_available: bool) -> Device:
    """The device kind whose kernels a run in `mode` measures, as runners.verify.plan_run
    resolves it: CUDA for cuda, and for auto with a GPU; CPU for cpu, simulate (CPU kernels
    on fake tensors) and auto without one. The run is compared with that kind's estimate."""
    if Mode(mode) is Mode.CUDA or (Mode(mode) is Mode.AUTO and cuda_available):
        return Device.CUDA
    return Device.CPU


def plan_request(config: dict, name: str, values: Mapping[str, object], mode: str, steps: int) -> VerifyRequest:
    """The sidebar's plan as a verification request (PlannerInputError for bad values). Its
    PYTORCH_CUDA_ALLOC_CONF (`cuda_alloc_conf`) becomes the run's environment, not a
    scenario value: a run measured on the CPU has no caching allocator."""
    scenario = dict(values)
    alloc_conf = scenario.pop("cuda_alloc_conf", None)
    return VerifyRequest(config=config, model_name=name, scenario=scenario, mode=Mode(mode),
                         engine=Engine.ACCELERATE, steps=steps, cuda_alloc_conf=alloc_conf)


def technique_requests(config: dict, name: str, base: Mapping[str, object], mode: str,
                       steps: int) -> list[tuple[str, VerifyRequest]]:
    """One (label, request) per technique of the Techniques page, in its order."""
    return [(t.label, plan_request(config, name, technique_values(base, t), mode, steps)) for t in TECHNIQUES]


def category_values(estimated: Mapping | None, measured: Mapping | None) -> tuple[dict, dict]:
    """(estimated, measured) bytes per category at each side's peak, plus "peak"."""
    est, meas = {}, {}
    if estimated:
        est = {c: estimated["peak_breakdown_bytes"].get(c) for c in CATEGORIES} | {"peak": estimated.get("peak_bytes")}
    if measured:
        meas = {c: measured.get(f"{c}_bytes") for c in CATEGORIES} | {"peak": measured.get("peak_bytes")}
    return est, meas


def _scenario_text(scenario: Mapping) -> str:
    parts = [f"b{scenario.get('batch_size')}×{scenario.get('seq_len')}", str(scenario.get("optimizer")),
             str(scenario.get("precision"))]
    if scenario.get("gradient_checkpointing"):
        parts.append("ckpt")
    if int(scenario.get("grad_accum") or 1) > 1:
        parts.append(f"accum {scenario.get('grad_accum')}")
    return " ".join(parts)


def history_table(records: Iterable) -> pd.DataFrame:
    """One row per run, newest first: what ran, how, its estimated and measured peaks, the error."""
    rows = []
    for r in records:
        estimated = (r.estimate or {}).get("peak_bytes")
        measured = (r.measurement or {}).get("peak_bytes")
        rows.append({
            "created (UTC)": r.created_at.strftime("%Y-%m-%d %H:%M:%S"),
            "model": r.model_name,
            "scenario": _scenario_text(r.scenario),
            "mode": r.mode.value,
            "status": r.status.value,
            "estimated peak (bytes)": estimated,
            "measured peak (bytes)": measured,
            "estimated peak": format_bytes(estimated),
            "measured peak": format_bytes(measured),
            "error (%)": error_pct(estimated, measured),
            "reason": r.reason or "",
            "run id": r.id,
        })
    columns = ["created (UTC)", "model", "scenario", "mode", "status", "estimated peak (bytes)",
               "measured peak (bytes)", "estimated peak", "measured peak", "error (%)", "reason", "run id"]
    table = pd.DataFrame(rows, columns=columns)
    for column in ("estimated peak (bytes)", "measured peak (bytes)"):
        table[column] = table[column].astype("Int64")
    return table


def filter_history(table: pd.DataFrame, models: Iterable[str] = (), statuses: Iterable[str] = (),
                   modes: Iterable[str] = ()) -> pd.DataFrame:
    """Rows whose model, status and mode are among those given (an empty choice keeps all)."""
    keep = pd.Series(True, index=table.index)
    for column, chosen in (("model", list(models)), ("status", list(statuses)), ("mode", list(modes))):
        if chosen:
            keep &= table[column].isin(chosen)
    return table[keep]


def scatter_points(table: pd.DataFrame) -> tuple[list[int], list[int], list[str]]:
    """(estimated, measured, label) of the runs that have both peaks."""
    both = table.dropna(subset=["estimated peak (bytes)", "measured peak (bytes)"])
    labels = [f"{m} {s} ({mode})" for m, s, mode in zip(both["model"], both["scenario"], both["mode"])]
    return ([int(v) for v in both["estimated peak (bytes)"]], [int(v) for v in both["measured peak (bytes)"]],
            labels)
