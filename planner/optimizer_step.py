"""Temporaries alive during `optimizer.step()` at steady state, beyond the state itself.

Which implementation runs decides it (torch/optim/optimizer.py `_default_to_fused_or_foreach`:
foreach only when every tensor is on CUDA; CPU runs the per-tensor loop):
- AdamW/Adam per-tensor (CPU): `denom = (exp_avg_sq.sqrt() / bc2_sqrt).add_(eps)` holds
  two tensors of the current parameter's size at once (torch/optim/adamw.py `_single_tensor_adam`).
- AdamW/Adam foreach (CUDA default): `torch._foreach_sqrt(exp_avg_sqs)` materialises a
  square root of every state tensor at once (`_multi_tensor_adam`): one parameter-sized copy.
- SGD with momentum: in place in both paths; fused AdamW: one kernel, no temporaries.
- Adafactor (torch and transformers): per tensor, the squared gradient and the
  reconstructed second moment, in fp32 for transformers' version, which under pure bf16
  also holds fp32 copies of the gradient and the parameter.
- bitsandbytes 8-bit: fused kernels update in place (CUDA); on CPU, measured with
  bitsandbytes 0.50, the step allocates nothing that outlives a single small op.
"""

from __future__ import annotations

from planner.model_shape import ParameterStats
from planner.optimizer_state import FP32_BYTES, parameter_bytes_per_element
from planner.scenario import Device, Optimizer, Precision


def optimizer_step_transient_bytes(stats: ParameterStats, optimizer: Optimizer, precision: Precision,
                                   device: Device) -> int:
    param_bytes = parameter_bytes_per_element(precision)
    largest = stats.largest_tensor_elements
    if optimizer in (Optimizer.ADAMW, Optimizer.ADAM):
        if device is Device.CUDA:
            return stats.num_elements * param_bytes
        return 2 * largest * param_bytes
    if optimizer in (Optimizer.SGD, Optimizer.ADAMW_FUSED):
        return 0  # SGD updates in place; fused AdamW is one kernel per tensor group
    if optimizer is Optimizer.ADAFACTOR:
        return 2 * largest * param_bytes
    if optimizer is Optimizer.HF_ADAFACTOR:
        # Pure bf16: transformers' Adafactor also works on fp32 copies of the gradient and
        # the parameter (`grad.float()`, `p.float()`, copied back at the end). Simulated on
        # Llama-2-7B at batch 1: 2 x 131M x 4 bytes more, to within 4 KB of the measured peak.
        copies = 2 * largest * FP32_BYTES if precision is Precision.BF16 else 0
        return 2 * largest * FP32_BYTES + copies
    if optimizer in (Optimizer.ADAM8BIT, Optimizer.ADAMW8BIT, Optimizer.PAGED_ADAMW8BIT):
        return 0  # measured on CPU (bitsandbytes 0.50): no temporaries beyond a few bytes
    raise ValueError(f"no step model for optimizer {optimizer}")
