"""The report's "Multiple GPUs" section: the plan's micro-batch on N data-parallel GPUs under
each strategy (per-GPU memory, traffic per optimizer step), DDP against local SGD, and this
model's distributed runs from the history beside their estimates.

The numbers and tables come from views.multi_gpu_figures (the dashboard's page builds
the same ones); this file only gathers them once for the four renderings and lays out the
JSON. Raw bytes everywhere, binary units (GiB = 2**30) beside them for reading.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass

import pandas as pd

from planner.errors import PlannerInputError
from planner.estimate import Estimate
from planner.loading import model_shape_for_config
from planner.model_shape import ModelShape
from planner.parallel import ParallelEstimate
from planner.scenario import Scenario, Task
from planner.strategy import Strategy
from views.multi_gpu_figures import (
    DEFAULT_RUN_STEPS,
    LOCAL_SGD_PERIODS,
    LocalSgdComparison,
    communication_table,
    local_sgd_comparison,
    local_sgd_table,
    measured_runs_table,
    memory_by_strategy_figure,
    memory_table,
    strategy_estimates,
)


@dataclass(frozen=True)
class MultiGpuSection:
    num_devices: int
    capacity_bytes: int  # per GPU
    run_steps: int  # optimizer steps the local SGD comparison counts over
    estimates: dict[Strategy, ParallelEstimate]
    local_sgd: LocalSgdComparison
    memory: pd.DataFrame  # multi_gpu_figures.memory_table, plus the gathered unit's raw bytes
    traffic: pd.DataFrame  # multi_gpu_figures.communication_table
    local_sgd_rows: pd.DataFrame  # multi_gpu_figures.local_sgd_table
    measured: pd.DataFrame  # multi_gpu_figures.measured_runs_table: empty without distributed runs


def _whole_bytes(table: pd.DataFrame) -> pd.DataFrame:
    """Byte columns (whole numbers: multi_gpu_figures.whole_bytes) as nullable integers, so
    Markdown and CSV print 26953662976, not 26953662976.0, even beside a missing value."""
    table = table.copy()
    for column in table.columns:
        values = table[column]
        if str(column).endswith("(bytes)") and pd.api.types.is_float_dtype(values) \
                and (values.dropna() % 1 == 0).all():
            table[column] = values.round().astype("Int64")
    return table


def local_sgd_periods(extra: int | None) -> tuple[int, ...]:
    """The comparison's K values, with the user's own K (--local-sgd-steps) among them."""
    return tuple(sorted(set(LOCAL_SGD_PERIODS) | ({extra} if extra is not None else set())))


def _shape_for(report_shape: ModelShape):
    """measured_runs_table's shape builder without Streamlit's cache. A run that recorded no
    model config (older rows) is estimated on the report's own model when its task matches."""
    def shape_for(config: dict | None, name: str, scenario: Scenario) -> ModelShape:
        if config is not None:
            return model_shape_for_config(config, scenario.task, scenario.num_labels, name)
        same_head = not scenario.task.uses_labels or scenario.num_labels == report_shape.num_labels
        if scenario.task is report_shape.task and same_head:
            return report_shape
        raise PlannerInputError("the run recorded no model config for its task")
    return shape_for


def multi_gpu_section(shape: ModelShape, scenario: Scenario, base: Estimate, num_devices: int, capacity_bytes: int,
                      records: Iterable = (), config: dict | None = None, run_steps: int = DEFAULT_RUN_STEPS,
                      local_sgd_steps: int | None = None) -> MultiGpuSection | None:
    """The section for `num_devices` GPUs; None for one GPU (nothing is replicated or sent).
    `records`: this model's runs, newest first; only finished distributed ones are listed."""
    if num_devices <= 1:
        return None
    if isinstance(run_steps, bool) or not isinstance(run_steps, int) or run_steps < 1:
        raise PlannerInputError(f"run steps must be a positive integer, got {run_steps!r}")
    estimates = strategy_estimates(shape, scenario, num_devices, base)
    comparison = local_sgd_comparison(shape, scenario, num_devices, run_steps, local_sgd_periods(local_sgd_steps),
                                      base)
    memory = memory_table(estimates, capacity_bytes)
    # The table shows the gathered unit formatted; the report keeps its bytes too (0: none gathered).
    memory.insert(list(memory.columns).index("largest gathered unit") + 1, "largest gathered unit (bytes)",
                  pd.array([r.largest_gathered_unit_bytes or None for r in estimates.values()], dtype="Int64"))
    finished = [r for r in records if getattr(r.status, "value", r.status) == "ok"]
    tables = (memory, communication_table(estimates, run_steps), local_sgd_table(comparison),
              measured_runs_table(finished, config, _shape_for(shape)))
    return MultiGpuSection(num_devices, capacity_bytes, run_steps, estimates, comparison,
                           *(_whole_bytes(t) for t in tables))


def section_json(section: MultiGpuSection) -> dict:
    comparison = section.local_sgd
    return {
        "num_devices": section.num_devices,
        "capacity_bytes": section.capacity_bytes,
        "run_steps": section.run_steps,
        "strategies": {strategy.value: {**result.to_json(),
                                        "fits": result.per_device_peak_bytes <= section.capacity_bytes}
                       for strategy, result in section.estimates.items()},
        "local_sgd": {
            "run_steps": comparison.run_steps,
            "ddp": {"payload_per_step_bytes": comparison.ddp_per_step,
                    "wire_per_step_bytes": comparison.ddp_wire_per_step,
                    "payload_over_run_bytes": comparison.ddp_over_run},
            "periods": [{"k": p.k, "payload_per_step_bytes": p.payload_per_step,
                         "wire_per_step_bytes": p.wire_per_step, "payload_over_run_bytes": p.payload_over_run,
                         "saving_vs_ddp_per_step_pct": p.saving_per_step_pct,
                         "saving_vs_ddp_over_run_pct": p.saving_over_run_pct} for p in comparison.points],
        },
        "measured_runs": json.loads(section.measured.to_json(orient="records")),
    }


def csv_sections(section: MultiGpuSection) -> list[pd.DataFrame]:
    """The section's tables, each tagged with the CSV's `section` column."""
    tables = [section.memory.assign(section="multi-GPU memory"),
              section.traffic.assign(section="multi-GPU traffic"),
              section.local_sgd_rows.assign(section="multi-GPU local SGD")]
    if not section.measured.empty:
        tables.append(section.measured.assign(section="multi-GPU runs"))
    return tables


def memory_figure(section: MultiGpuSection):
    return memory_by_strategy_figure(section.estimates, section.capacity_bytes,
                                     title=f"Per-GPU memory at the peak on {section.num_devices} GPUs, by strategy")


def intro_lines(section: MultiGpuSection, scenario: Scenario) -> list[str]:
    """What the tables assume, in sentences (no arithmetic beyond formatting)."""
    from planner.units import format_bytes

    c = section.local_sgd
    return [
        f"Each of the {section.num_devices} GPUs trains its own micro-batch of {scenario.batch_size} × "
        f"{scenario.seq_len:,} tokens; the strategy decides what each holds of the weights, gradients and optimizer "
        "state. Figures are for rank 0 (the largest when rows do not split evenly).",
        "ZeRO stages are modelled from the ZeRO paper with DeepSpeed's defaults and not verified by a run; DDP and "
        "FSDP2 are checked against two-rank runs.",
        "Payload: what one GPU hands to a collective per optimizer step. Wire: what a ring algorithm sends per GPU "
        "(2(N−1)/N of the payload for an all-reduce, (N−1)/N for all-gather and reduce-scatter).",
        f"Local SGD averages the parameters every K micro-batches (and once at the end) instead of all-reducing "
        f"gradients every optimizer step. DDP: {format_bytes(round(c.ddp_per_step))} per step "
        f"({round(c.ddp_per_step):,} bytes), {format_bytes(c.ddp_over_run)} over {c.run_steps:,} steps "
        f"({c.ddp_over_run:,} bytes).",
    ]
