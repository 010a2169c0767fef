"""Optimizer state bytes, exact: what `optimizer.state` holds after the first step.

Each formula was checked byte for byte against the real optimizer (tests/test_optimizer_state.py
builds it, takes a step and sums the unique storages):
- torch AdamW / Adam: exp_avg and exp_avg_sq in the parameter's dtype, plus a 0-d fp32
  `step` tensor per parameter tensor (torch/optim/adamw.py, `_init_group`).
- torch SGD, momentum 0.9: one momentum_buffer in the parameter's dtype.
- torch Adafactor: row and column variances (parameter dtype) for tensors with >= 2
  dims, a full variance otherwise, plus a 0-d fp32 `step` (torch/optim/_adafactor.py).
- transformers Adafactor (TrainingArguments optim="adafactor": scale_parameter=False,
  relative_step=False): exp_avg_sq_row/col or exp_avg_sq, always fp32 (it upcasts 16-bit
  gradients first), plus a 0-d fp32 `RMS`; its `step` is a Python int (no storage).
- bitsandbytes Adam8bit / AdamW8bit / PagedAdamW8bit (bnb 0.50, Optimizer2State.init_state):
  tensors under 4,096 elements keep two fp32 states; larger ones two uint8 states plus
  one fp32 absmax per 256-element block per state; the two 256-entry fp32 quantile maps
  (`qmap1`, `qmap2`) are shared by every tensor, so they count once. `step` is an int.
"""

from __future__ import annotations

from planner.model_shape import ParameterStats
from planner.scenario import Optimizer, Precision

FP32_BYTES = 4
BNB_QMAP_BYTES = 2 * 256 * FP32_BYTES  # qmap1 + qmap2, shared


def parameter_bytes_per_element(precision: Precision) -> int:
    """Bytes per parameter element: pure bf16 stores 16-bit parameters, the rest fp32 masters."""
    return 2 if precision is Precision.BF16 else 4


def optimizer_state_bytes(stats: ParameterStats, optimizer: Optimizer, precision: Precision) -> int:
    """Bytes of distinct storage in `optimizer.state` at steady state."""
    param_bytes = parameter_bytes_per_element(precision)
    step_tensors = stats.num_tensors * FP32_BYTES
    if optimizer in (Optimizer.ADAMW, Optimizer.ADAM):
        return 2 * stats.num_elements * param_bytes + step_tensors
    if optimizer is Optimizer.SGD:
        return stats.num_elements * param_bytes
    if optimizer is Optimizer.ADAFACTOR:
        return stats.adafactor_factored_elements * param_bytes + step_tensors
    if optimizer is Optimizer.HF_ADAFACTOR:
        return stats.adafactor_factored_elements * FP32_BYTES + stats.num_tensors * FP32_BYTES
    if optimizer in (Optimizer.ADAM8BIT, Optimizer.ADAMW8BIT, Optimizer.PAGED_ADAMW8BIT):
        small = 2 * stats.bnb_small_elements * FP32_BYTES
        large = 2 * stats.bnb_large_elements + 2 * stats.bnb_absmax_blocks * FP32_BYTES
        shared_maps = BNB_QMAP_BYTES if stats.bnb_large_tensors else 0
        return small + large + shared_maps
    raise ValueError(f"no state model for optimizer {optimizer}")


def optimizer_state_elements(stats: ParameterStats, optimizer: Optimizer) -> int:
    """Tensor elements in the state, counting shared quantile maps once (no Python ints)."""
    if optimizer in (Optimizer.ADAMW, Optimizer.ADAM):
        return 2 * stats.num_elements + stats.num_tensors
    if optimizer is Optimizer.SGD:
        return stats.num_elements
    if optimizer in (Optimizer.ADAFACTOR, Optimizer.HF_ADAFACTOR):
        return stats.adafactor_factored_elements + stats.num_tensors
    if optimizer in (Optimizer.ADAM8BIT, Optimizer.ADAMW8BIT, Optimizer.PAGED_ADAMW8BIT):
        return (2 * stats.num_elements + 2 * stats.bnb_absmax_blocks
                + (2 * 256 if stats.bnb_large_tensors else 0))
    raise ValueError(f"no state model for optimizer {optimizer}")
