"""Plans for GPUs before Ampere (sm80), whose torch has no flash attention.

CUDA plans are probed on sm80's kernels whatever the GPU (planner.probe.cache.CUDA_PROBE_ARCH).
Before sm80 torch has no flash attention (sdp_utils.cpp `check_flash_attention_hardware_support`),
so an SDPA call that sm80 ran on flash runs on the memory-efficient kernel there, which keeps
the same tensors (benchmarks/results/pre_ampere_attention.md: DistilBERT and GPT-2 in fp16 on
a simulated T4 and V100 within 100 B of sm80), unless that kernel refuses the call. In torch
2.13 its filter refuses grouped-query attention (`check_batch_size_and_num_heads_dense` without
GQA support; planner.probe.fake_cuda follows it, docs/cuda_kernels.md section 4), and SDPA runs the
math path, which keeps every layer's attention matrix for the backward: a step the plan does
not hold, 11-27% above it for Llama-3.2-1B, Qwen2.5-0.5B and SmolLM2-135M in fp16 at 4 x 512
tokens (same table); the plan with eager attention, which keeps those matrices too, is 2-5%
above the simulated T4 there. Until plans are probed on the GPU's own kernels, such a plan
says so (`math_attention_warning`; What fits names the plans it applies to, `low_options`),
and the fit searches still size such plans by sm80's figures.
"""

from __future__ import annotations

from planner.attention_scratch import FLASH
from planner.estimate import Confidence, Estimate, estimate
from planner.gpus import GpuSpec
from planner.model_shape import ModelShape
from planner.scenario import Device, Precision

FLASH_FROM = (8, 0)  # the first compute capability with flash attention in torch


def _lacks_flash(gpu: GpuSpec | None) -> bool:
    return gpu is not None and gpu.compute_capability is not None and gpu.compute_capability < FLASH_FROM


def math_attention_warning(shape: ModelShape, result: Estimate, gpu: GpuSpec | None) -> str | None:
    """Why the plan `result` (probed on sm80's kernels) is low on `gpu`, when that GPU has no
    flash attention and the step's grouped-query attention then takes SDPA's math path; None
    when it does not (module doc)."""
    from planner.probe.cache import probe_table
    from planner.reserved import attention_calls

    if not _lacks_flash(gpu):
        return None
    scenario = result.scenario
    if scenario.device is not Device.CUDA or result.confidence is not Confidence.PROBED:
        return None
    table = probe_table(shape, scenario)  # the one the estimate read
    if isinstance(table, str) or table.trace is None:
        return None
    grouped = [call for call in attention_calls(table, scenario.batch_size, scenario.seq_len).values()
               if call.backend == FLASH and call.heads_kv != call.heads_q]
    if not grouped:
        return None
    major, minor = gpu.compute_capability
    call = grouped[0]
    return (f"on a {gpu.label} (sm{major}{minor}) torch has no flash attention, and its memory-efficient kernel "
            f"refuses grouped-query attention ({call.heads_q} query heads, {call.heads_kv} key/value heads), so "
            "SDPA runs the math path, which keeps every layer's attention matrix for the backward. This plan was "
            "probed on sm80's flash kernels and does not hold them: in fp16 at 4 x 512 tokens a step simulated on a "
            "T4 keeps 11% (Llama-3.2-1B) to 27% (SmolLM2-135M) more (benchmarks/results/pre_ampere_attention.md). "
            "Plan it with eager attention for a bound: that keeps the matrices and a little more (2-5% above the "
            "simulated T4 for those models)")


def low_options(shape: ModelShape, options, gpu: GpuSpec | None) -> tuple[list[int], str | None]:
    """The ranks (from 1) of the fit finder's `options` (planner.fit.FitOption) whose plans
    `math_attention_warning` flags on `gpu`, and the first warning; ([], None) when none is."""
    ranks, first = [], None
    if not _lacks_flash(gpu):
        return ranks, first
    for rank, option in enumerate(options, 1):
        if option.scenario.device is not Device.CUDA or option.scenario.precision is Precision.FP32:
            continue  # fp32 takes no flash kernel on sm80 either: nothing moves
        warning = math_attention_warning(shape, estimate(shape, option.scenario), gpu)
        if warning is not None:
            ranks.append(rank)
            first = first or warning
    return ranks, first
