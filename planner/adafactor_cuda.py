"""Adafactor's step on CUDA: its column reductions' workspace, at the loop's moment it is taken.

Both Adafactors run a per-tensor loop, the same Python on CUDA as on the CPU, so their step is
probed on the CPU (planner.probe.step). On CUDA each factored tensor's reduction over dim -2
also takes a workspace from the caching allocator for its launch (planner.cuda_reduction),
which no fake kernel allocates. It is live with what the loop holds at that moment:
- transformers' Adafactor (transformers/optimization.py `Adafactor.step`), at
  `update.mean(dim=-2)`: `update` ((grad**2) + eps, fp32, the tensor's size), the fp32 copies
  of a 16-bit gradient and parameter (`grad.float()`, `p.float()`), the mean's output (one
  row, fp32). Measured on an H200 (DistilBERT, fp32, Trainer): 89,075,712 B of `update`
  and 138,412,032 B of workspace live together at the step's peak.
- torch's Adafactor (torch/optim/_adafactor.py `_single_tensor_adafactor`), at
  `torch.norm(grad, dim=-2, keepdim=True)`: the previous tensor's `update` (its
  var_estimate, bound until this tensor's is made), `row_mean` (one column) and the norm's
  output (one row), in the parameter's dtype. The previous tensor is taken as the largest:
  its place in the loop is the optimizer's parameter order, which this does not follow, so
  the moment is an upper bound (not measured on a GPU).
The step's temporaries on CUDA are the larger of the CPU probe's and these moments. Row
reductions (dim -1) reduce along the fastest dimension inside each block and are not counted.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence

from planner.cuda_reduction import largest_column_reduction_workspace_bytes
from planner.optimizer_state import FP32_BYTES, allocation
from planner.scenario import Device, Optimizer

ACCUMULATOR_BYTES = FP32_BYTES  # both reductions accumulate in fp32 (float for fp32, bf16 and fp16)


def reduction_moment_bytes(shapes: Sequence[tuple[int, ...]], param_bytes: int, optimizer: Optimizer) -> int:
    """The largest live temporaries of the step at a column reduction, workspace included
    (module doc); 0 for an optimizer without one or tensors that are not factored."""
    return sum(reduction_moment_requests(shapes, param_bytes, optimizer))


def reduction_moment_requests(shapes: Sequence[tuple[int, ...]], param_bytes: int,
                              optimizer: Optimizer) -> list[int]:
    """The allocations live at the largest such moment, in the order the loop makes them
    (the caching allocator serves each on its own: planner.reserved replays them so); []
    when there is none."""
    return list(_moment_requests(tuple(tuple(shape) for shape in shapes), param_bytes, optimizer))


@functools.lru_cache(maxsize=1024)  # every plan of a search asks again for the same tensors
def _moment_requests(shapes: tuple[tuple[int, ...], ...], param_bytes: int, optimizer: Optimizer) -> tuple[int, ...]:
    on_cuda = allocation(Device.CUDA)
    factored = [shape for shape in shapes if len(shape) >= 2]
    if optimizer not in (Optimizer.HF_ADAFACTOR, Optimizer.ADAFACTOR) or not factored:
        return ()
    largest_update = max(on_cuda(math.prod(shape) * param_bytes) for shape in shapes)
    moments = []
    for shape in factored:
        numel = math.prod(shape)
        row = math.prod(shape[:-2]) * shape[-1]  # the reduction's output
        workspace = largest_column_reduction_workspace_bytes(shape, ACCUMULATOR_BYTES)
        if optimizer is Optimizer.HF_ADAFACTOR:
            copies = [on_cuda(numel * FP32_BYTES)] * 2 if param_bytes < FP32_BYTES else []  # grad, p
            live = copies + [on_cuda(numel * FP32_BYTES), on_cuda(row * FP32_BYTES)]  # update, its mean
        else:
            column = math.prod(shape[:-1])  # row_mean, keepdim
            live = [largest_update, on_cuda(column * param_bytes), on_cuda(row * param_bytes)]
        moments.append(tuple(live) + (workspace,))
    return max(moments, key=sum)
