"""What the Multiple GPUs page shows, with no Streamlit here: per-GPU memory and traffic of
each multi-device strategy (planner.parallel), DDP against local SGD, and distributed runs
from the history set beside their estimates; as tables (pandas) and plotly figures.

Raw bytes first, formatted last (binary units, planner.units). Payload bytes are what a
rank hands to a collective; wire bytes what a ring algorithm sends per rank
(planner.parallel's module docstring has the factors and their sources).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

import pandas as pd
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from planner.errors import PlannerInputError
from planner.estimate import Estimate
from planner.model_shape import ModelShape
from planner.parallel import ParallelEstimate, parallel_estimate
from planner.scenario import Scenario, scenario_from_values
from planner.strategy import ParallelPlan, Strategy, parse_strategy
from planner.units import GIB, MIB, bytes_to_gib, format_bytes
from views.breakdown import DEVICE_CATEGORY_LABELS
from views.figures import (
    CAPACITY_COLOR,
    CATEGORY_COLORS,
    _capacity_line,
    _log_y_when_dwarfed,
)

# The order the page lists them: replicas first, then more and more sharded.
STRATEGY_ORDER = (Strategy.DDP, Strategy.ZERO1, Strategy.ZERO2, Strategy.ZERO3, Strategy.FSDP_SHARD_GRAD_OP,
                  Strategy.FSDP_FULL_SHARD)
LOCAL_SGD_PERIODS = (1, 2, 4, 8, 16, 32)
DEFAULT_RUN_STEPS = 1000
DEFAULT_GPUS = 2  # what the page's "plan for several GPUs" sets the sidebar's count to

DDP_COLOR = "#2563eb"
LOCAL_SGD_COLOR = "#10b981"
# The scenario values a recorded run carries that planner.scenario.scenario_from_values takes.
SCENARIO_VALUE_KEYS = ("task", "batch_size", "seq_len", "optimizer", "precision", "gradient_checkpointing",
                       "grad_accum", "attn", "device", "num_labels", "engine", "compute_capability")


# --- Memory per GPU ---------------------------------------------------------------------

def whole_bytes(value: float | None) -> int | None:
    """Bytes as a table shows them: whole. A payload per step is an average (local SGD's
    period, DeepSpeed's buckets) and can fall between two integers."""
    return None if value is None else round(value)


@dataclass(frozen=True)
class StrategyPlans:
    planned: dict[Strategy, ParallelEstimate]
    refused: dict[Strategy, str]  # the planner's one-line reason per strategy it does not plan here

    def not_planned_line(self) -> str | None:
        """One line naming the strategies left out, with the first one's reason; None if none."""
        if not self.refused:
            return None
        return f"Not planned: {', '.join(s.value for s in self.refused)} ({next(iter(self.refused.values()))})."


def strategy_plans(shape: ModelShape, scenario: Scenario, num_devices: int,
                   base: Estimate | None = None) -> StrategyPlans:
    """Every multi-device strategy on `num_devices` GPUs, each with the scenario's micro-batch per
    GPU, where the planner plans it; the refusal of all of them is the scenario's own: raised."""
    planned, refused = {}, {}
    for strategy in STRATEGY_ORDER:
        try:
            planned[strategy] = parallel_estimate(shape, scenario, ParallelPlan(num_devices, strategy), base)
        except PlannerInputError as error:
            refused[strategy] = str(error)
    if not planned:
        raise PlannerInputError(refused[STRATEGY_ORDER[0]])
    return StrategyPlans(planned, refused)


def strategy_estimates(shape: ModelShape, scenario: Scenario, num_devices: int,
                       base: Estimate | None = None) -> dict[Strategy, ParallelEstimate]:
    """The strategies strategy_plans plans, by strategy."""
    return strategy_plans(shape, scenario, num_devices, base).planned


def memory_table(estimates: Mapping[Strategy, ParallelEstimate], capacity_bytes: int) -> pd.DataFrame:
    """One row per strategy: per-GPU peak, what is replicated or sharded, the largest gathered unit, fits."""
    rows = []
    for strategy, result in estimates.items():
        peak = result.peak
        gathered = result.largest_gathered_unit_bytes or None  # 0: nothing is gathered (ddp, zero1/2)
        rows.append({
            "strategy": strategy.value,
            "per-GPU peak": format_bytes(peak.total),
            "per-GPU peak (bytes)": peak.total,
            "peak phase": peak.phase.value,
            "weights": result.placement["weights"],
            "gradients": result.placement["gradients"],
            "optimizer state": result.placement["optimizer_state"],
            "largest gathered unit": format_bytes(gathered) if gathered is not None else "none",
            "fits": "yes" if peak.total <= capacity_bytes else "no",
        })
    table = pd.DataFrame(rows)
    table["per-GPU peak (bytes)"] = table["per-GPU peak (bytes)"].astype("int64")
    return table


def memory_by_strategy_figure(estimates: Mapping[Strategy, ParallelEstimate], capacity_bytes: int | None = None,
                              title: str = "Per-GPU memory at the peak, by strategy") -> go.Figure:
    """One stacked bar per strategy (GiB): the peak phase's bytes by category, and the capacity line."""
    x = [s.value for s in estimates]
    peaks = [r.peak for r in estimates.values()]
    figure = go.Figure()
    for field, label in DEVICE_CATEGORY_LABELS.items():
        sizes = [getattr(p, field) for p in peaks]
        figure.add_bar(
            name=label, x=x, y=[bytes_to_gib(size) for size in sizes], marker_color=CATEGORY_COLORS[field],
            customdata=[[size, format_bytes(size)] for size in sizes],
            hovertemplate=f"{label}: %{{customdata[1]}} (%{{customdata[0]:,}} bytes)<extra></extra>",
        )
    _capacity_line(figure, capacity_bytes)
    figure.update_layout(barmode="stack", title=title, yaxis_title="GiB (2^30 bytes)",
                         xaxis_title="strategy", legend_title_text="category", margin=dict(t=60, b=40))
    return figure


# --- Communication ----------------------------------------------------------------------

def communication_table(estimates: Mapping[Strategy, ParallelEstimate], run_steps: int) -> pd.DataFrame:
    """One row per strategy: payload and ring wire bytes per optimizer step and payload over `run_steps`."""
    rows = []
    for strategy, result in estimates.items():
        rows.append({
            "strategy": strategy.value,
            "payload per step": format_bytes(round(result.comm_bytes_per_step)),
            "payload per step (bytes)": whole_bytes(result.comm_bytes_per_step),
            "wire per step (ring)": format_bytes(round(result.comm_wire_bytes_per_step)),
            "wire per step (bytes)": whole_bytes(result.comm_wire_bytes_per_step),
            f"payload over {run_steps:,} steps": format_bytes(result.comm_bytes_over_run(run_steps)),
            "collective calls per step": sum(c.calls_per_step for c in result.collectives),
        })
    return pd.DataFrame(rows)


def collectives_table(estimates: Mapping[Strategy, ParallelEstimate]) -> pd.DataFrame:
    """One row per collective of each strategy, per optimizer step."""
    rows = [{
        "strategy": strategy.value,
        "collective": c.kind,
        "of": c.what,
        "calls per step": c.calls_per_step,
        "payload per step": format_bytes(round(c.bytes_per_step)),
        "payload per step (bytes)": whole_bytes(c.bytes_per_step),
        "wire per step (bytes)": whole_bytes(c.wire_bytes_per_step),
        "wire bytes per payload byte": c.wire_factor,
    } for strategy, result in estimates.items() for c in result.collectives]
    return pd.DataFrame(rows, columns=["strategy", "collective", "of", "calls per step", "payload per step",
                                       "payload per step (bytes)", "wire per step (bytes)",
                                       "wire bytes per payload byte"])


def _display_unit(largest_bytes: float) -> tuple[str, int]:
    return ("GiB (2^30 bytes)", GIB) if largest_bytes >= GIB else ("MiB (2^20 bytes)", MIB)


def communication_figure(estimates: Mapping[Strategy, ParallelEstimate],
                         title: str = "Traffic per optimizer step, by strategy") -> go.Figure:
    """Grouped bars per strategy: payload and ring wire bytes per optimizer step, per GPU."""
    payload = [r.comm_bytes_per_step for r in estimates.values()]
    wire = [r.comm_wire_bytes_per_step for r in estimates.values()]
    unit, size = _display_unit(max([*payload, *wire, 0]))
    x = [s.value for s in estimates]
    figure = go.Figure()
    for name, values, color in (("payload", payload, DDP_COLOR), ("wire (ring)", wire, "#f59e0b")):
        figure.add_bar(name=name, x=x, y=[v / size for v in values], marker_color=color,
                       customdata=[[v, format_bytes(round(v))] for v in values],
                       hovertemplate=f"{name}: %{{customdata[1]}} (%{{customdata[0]:,.0f}} bytes)<extra></extra>")
    figure.update_layout(barmode="group", title=title, yaxis_title=f"per GPU, {unit}",
                         xaxis_title="strategy", margin=dict(t=60, b=40))
    # ZeRO-3 and FSDP gather the parameters too: their bars can dwarf DDP's.
    return _log_y_when_dwarfed(figure, None, [[v] for v in (*payload, *wire)])


@dataclass(frozen=True)
class LocalSgdPoint:
    k: int  # parameters averaged every k micro-batches
    payload_per_step: float  # bytes per optimizer step, averaged over the period
    wire_per_step: float
    payload_over_run: int
    saving_per_step_pct: float | None  # against DDP; None when DDP sends nothing
    saving_over_run_pct: float | None


@dataclass(frozen=True)
class LocalSgdComparison:
    run_steps: int
    ddp_per_step: float
    ddp_wire_per_step: float
    ddp_over_run: int
    points: tuple[LocalSgdPoint, ...]


def _saving_pct(value: float, reference: float) -> float | None:
    return (1 - value / reference) * 100 if reference else None


def local_sgd_comparison(shape: ModelShape, scenario: Scenario, num_devices: int, run_steps: int,
                         periods: Iterable[int] = LOCAL_SGD_PERIODS,
                         base: Estimate | None = None) -> LocalSgdComparison:
    """DDP's traffic against local SGD's for each averaging period K, per step and over `run_steps`."""
    ddp = parallel_estimate(shape, scenario, ParallelPlan(num_devices, Strategy.DDP), base)
    ddp_run = ddp.comm_bytes_over_run(run_steps)
    points = []
    for k in periods:
        local = parallel_estimate(shape, scenario, ParallelPlan(num_devices, Strategy.DDP, k), ddp.base)
        over_run = local.comm_bytes_over_run(run_steps)
        points.append(LocalSgdPoint(k, local.comm_bytes_per_step, local.comm_wire_bytes_per_step, over_run,
                                    _saving_pct(local.comm_bytes_per_step, ddp.comm_bytes_per_step),
                                    _saving_pct(over_run, ddp_run)))
    return LocalSgdComparison(run_steps, ddp.comm_bytes_per_step, ddp.comm_wire_bytes_per_step, ddp_run,
                              tuple(points))


def local_sgd_table(comparison: LocalSgdComparison) -> pd.DataFrame:
    steps = comparison.run_steps
    rows = [{
        "average every K micro-batches": p.k,
        "payload per step": format_bytes(round(p.payload_per_step)),
        "payload per step (bytes)": whole_bytes(p.payload_per_step),
        "wire per step (bytes)": whole_bytes(p.wire_per_step),
        f"payload over {steps:,} steps": format_bytes(p.payload_over_run),
        f"payload over {steps:,} steps (bytes)": p.payload_over_run,
        "saving vs DDP per step (%)": p.saving_per_step_pct,
        f"saving vs DDP over {steps:,} steps (%)": p.saving_over_run_pct,
    } for p in comparison.points]
    return pd.DataFrame(rows)


def local_sgd_figure(comparison: LocalSgdComparison, title: str = "DDP against local SGD") -> go.Figure:
    """Two panels: payload per optimizer step, and over the run, against K; DDP as a dashed line."""
    steps = comparison.run_steps
    figure = make_subplots(rows=1, cols=2, subplot_titles=("per optimizer step", f"over {steps:,} optimizer steps"))
    x = [str(p.k) for p in comparison.points]
    panels = (
        ([p.payload_per_step for p in comparison.points], [p.saving_per_step_pct for p in comparison.points],
         comparison.ddp_per_step, "local SGD, per optimizer step"),
        ([p.payload_over_run for p in comparison.points], [p.saving_over_run_pct for p in comparison.points],
         comparison.ddp_over_run, f"local SGD, over {steps:,} steps"),
    )
    for col, (values, savings, ddp, name) in enumerate(panels, start=1):
        unit, size = _display_unit(max([*values, ddp, 0]))
        figure.add_bar(
            name=name, x=x, y=[v / size for v in values], marker_color=LOCAL_SGD_COLOR, showlegend=False,
            customdata=[[v, format_bytes(round(v)), "n/a" if s is None else f"{s:.1f}%"]
                        for v, s in zip(values, savings)],
            hovertemplate="K = %{x}: %{customdata[1]} (%{customdata[0]:,.0f} bytes), "
                          "saving vs DDP %{customdata[2]}<extra></extra>",
            row=1, col=col)
        figure.add_hline(y=ddp / size, line=dict(color=CAPACITY_COLOR, dash="dash", width=2),
                         annotation_text=f"DDP {format_bytes(round(ddp))}", annotation_position="top right",
                         row=1, col=col)
        figure.update_yaxes(title_text=f"payload per GPU, {unit}", row=1, col=col)
        figure.update_xaxes(title_text="K (micro-batches between averagings)", type="category", row=1, col=col)
    figure.update_layout(title=title, margin=dict(t=80, b=40))
    return figure


# --- Estimated against measured ----------------------------------------------------------

def is_distributed_run(record) -> bool:
    """A finished run the rank launcher recorded: a strategy on several devices and per-rank results."""
    scenario, measurement = record.scenario or {}, record.measurement or {}
    devices = scenario.get("num_devices")
    return (scenario.get("strategy") is not None and isinstance(devices, int) and devices > 1
            and bool(measurement.get("ranks")) and measurement.get("max_rank_peak_bytes") is not None)


def _error_pct(estimated: float | None, measured: float | None) -> float | None:
    if estimated is None or not measured:
        return None
    return (estimated - measured) / measured * 100


def measured_comm_bytes_per_step(measurement: Mapping) -> float | None:
    """Rank 0's steady-state payload per step, summed over collective kinds."""
    per_kind = measurement.get("comm_per_step")
    if not per_kind:
        return None
    return sum(float(v.get("bytes", 0)) for v in per_kind.values())


def run_estimate(record, config: dict, shape_for: Callable[[dict, str, Scenario], ModelShape]) -> ParallelEstimate:
    """What the planner estimates now for the run's own scenario, plan and model config."""
    recorded = record.scenario
    scenario = scenario_from_values(**{k: recorded[k] for k in SCENARIO_VALUE_KEYS if k in recorded})
    plan = ParallelPlan(recorded["num_devices"], parse_strategy(recorded["strategy"]), recorded.get("local_sgd_steps"))
    shape = shape_for(recorded.get("model_config") or config, record.model_name, scenario)
    return parallel_estimate(shape, scenario, plan)


def measured_runs_table(records: Iterable, config: dict,
                        shape_for: Callable[[dict, str, Scenario], ModelShape]) -> pd.DataFrame:
    """One row per distributed run: estimated per-GPU peak against the largest rank's measured
    peak, and estimated payload per step against rank 0's counted collectives."""
    rows = []
    for record in records:
        if not is_distributed_run(record):
            continue
        measurement = record.measurement
        try:
            result = run_estimate(record, config, shape_for)
            estimated_peak, estimated_comm, note = result.per_device_peak_bytes, result.comm_bytes_per_step, ""
        except (PlannerInputError, KeyError, TypeError, ValueError) as error:
            estimated_peak, estimated_comm, note = None, None, f"not estimable: {error}"
        measured_peak = int(measurement["max_rank_peak_bytes"])
        measured_comm = measured_comm_bytes_per_step(measurement)
        rows.append({
            "created (UTC)": record.created_at.strftime("%Y-%m-%d %H:%M:%S"),
            "strategy": str(record.scenario["strategy"]),
            "ranks": len(measurement["ranks"]),
            "local SGD K": record.scenario.get("local_sgd_steps"),
            "mode": record.mode.value,
            "estimated per-GPU peak": format_bytes(estimated_peak),
            "measured max rank peak": format_bytes(measured_peak),
            "estimated per-GPU peak (bytes)": estimated_peak,
            "measured max rank peak (bytes)": measured_peak,
            "peak error (%)": _error_pct(estimated_peak, measured_peak),
            "estimated payload per step (bytes)": whole_bytes(estimated_comm),
            "measured payload per step (bytes)": whole_bytes(measured_comm),
            "payload error (%)": _error_pct(estimated_comm, measured_comm),
            "note": note,
        })
    return pd.DataFrame(rows)
