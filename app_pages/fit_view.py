"""The "What fits" page's plain logic, with no Streamlit: the fit finder's target and GPU
from the sidebar, and an option as the sidebar values that "apply this plan" writes back.
The table rows are views.fit_table's, shared with the report."""

from __future__ import annotations

import enum

from planner.finetune import Method
from planner.fit import FitOption, FitTarget
from planner.gpus import GpuSpec, nearest_gpu
from planner.scenario import Checkpointing
from planner.strategy import Strategy
from views.inputs import SidebarValues, preset_gpu


class TargetKind(enum.Enum):
    EFFECTIVE_BATCH = "effective-batch"  # the sidebar's batch × accumulation × GPUs, per optimizer step
    BATCH = "batch"  # the sidebar's micro-batch, no accumulation
    LARGEST = "largest"  # as large a batch as fits, ranked by time per sequence


TARGET_LABELS = {
    TargetKind.EFFECTIVE_BATCH.value: "The sidebar's effective batch (accumulation allowed)",
    TargetKind.BATCH.value: "The sidebar's batch size, no accumulation",
    TargetKind.LARGEST.value: "The largest batch each combination fits",
}

# Which row of planner.gpus gives each sidebar preset its throughput. The 24 GB preset
# takes the A10 (its capacity is the A10's, and its throughput sits between L4 and 4090).
def gpu_for(values: SidebarValues, capacity_bytes: int) -> GpuSpec:
    """The GPU whose throughput step times assume: the preset's, or the nearest in memory for a custom size."""
    return preset_gpu(values) or nearest_gpu(capacity_bytes)


def target_for(values: SidebarValues, kind: str) -> FitTarget:
    kind = TargetKind(kind)
    if kind is TargetKind.EFFECTIVE_BATCH:
        return FitTarget(values.seq_len, effective_batch=values.batch_size * values.grad_accum * values.gpu_count)
    if kind is TargetKind.BATCH:
        return FitTarget(values.seq_len, batch_size=values.batch_size)
    return FitTarget(values.seq_len)


def option_label(rank: int, option: FitOption) -> str:
    s = option.scenario
    checkpointing = ", checkpointing" if s.checkpointing is Checkpointing.EVERY_LAYER else ""
    strategy = "" if option.strategy in (Strategy.SINGLE, Strategy.DDP) else f"{option.strategy.value}, "
    method = f"{s.finetune.method.value} r{s.finetune.lora_r}, " if s.finetune.uses_adapters else ""
    return (f"#{rank}: {strategy}{method}{s.optimizer.value}, {s.precision.value}{checkpointing}, "
            f"{s.batch_size} x {s.grad_accum_steps} accumulation")


def plan_state(option: FitOption) -> dict:
    """The sidebar session-state values that make `option` the current plan (its strategy
    too, with several GPUs, so Plan shows what each GPU holds under it)."""
    s = option.scenario
    state = {"optimizer": s.optimizer.value, "precision": s.precision.value,
             "gradient_checkpointing": s.checkpointing is Checkpointing.EVERY_LAYER,
             "batch_size": s.batch_size, "grad_accum": s.grad_accum_steps, "seq_len": s.seq_len}
    if option.strategy is not Strategy.SINGLE:
        state["strategy"] = option.strategy.value
    method = s.finetune
    state["finetune"] = method.method.value
    if method.uses_adapters:
        state.update(lora_r=method.lora_r, lora_alpha=method.lora_alpha, lora_dropout=method.lora_dropout,
                     lora_targets=method.targets_text)
    if method.method is Method.QLORA:
        state.update(quant_type=method.quant_type, double_quant=method.double_quant)
    return state
