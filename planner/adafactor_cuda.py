"""Adafactor's step on CUDA: its column reductions' workspace, at the loop's moment it is taken.

Both Adafactors run a per-tensor loop, the same Python on CUDA as on the CPU, so their step is
probed on the CPU (planner.probe.step). On CUDA each factored tensor's reduction over dim -2
also takes a workspace from the caching allocator for its launch (planner.cuda_reduction),
which no fake kernel allocates. It is live with what the loop holds at that moment:
- transformers' Adafactor (transformers/optimization.py `Adafactor.step`), at
  `update.mean(dim=-2)`: `update` ((grad**2) + eps, fp32, the tensor's size), the fp32 copies
  of a 16-bit gradient and parameter (`grad.float()`, `p.float()`), the mean's output (one
  row, fp32). Measured on an H200 (DistilBERT, fp32, Trainer): 89,075,712 B of `update`
  and 138,412,032 B of workspace live together at the step's peak. For the allocator's
  replay, `hf_moment_events` gives that tensor's requests in the loop's order, transients
  included: `(grad**2) + eps` makes `grad**2` and then the sum before it frees `grad**2` (two
  update-sized blocks: the H200 run took a segment for each, benchmarks/results/gpu_runs/
  2026-12-04-d/traces), `update.mean(dim=-1)` makes and frees its output, the column
  mean's launch takes its workspace and semaphores after its output and frees them on return,
  and `_approx_sq_grad` makes its row and column factors and the new `update` before the old
  one is let go.
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

from planner.cuda_reduction import largest_column_reduction_requests, largest_column_reduction_workspace_bytes
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
    if optimizer is Optimizer.HF_ADAFACTOR:
        return max((_hf_moment(shape, param_bytes) for shape in factored), key=sum)
    largest_update = max(on_cuda(math.prod(shape) * param_bytes) for shape in shapes)
    moments = []
    for shape in factored:
        row = math.prod(shape[:-2]) * shape[-1]  # the reduction's output
        workspace = largest_column_reduction_workspace_bytes(shape, ACCUMULATOR_BYTES)
        column = math.prod(shape[:-1])  # row_mean, keepdim
        moments.append((largest_update, on_cuda(column * param_bytes), on_cuda(row * param_bytes), workspace))
    return max(moments, key=sum)


def _hf_moment(shape: tuple[int, ...], param_bytes: int) -> tuple[int, ...]:
    """transformers' Adafactor's live temporaries at one tensor's `update.mean(dim=-2)`."""
    on_cuda = allocation(Device.CUDA)
    numel = math.prod(shape)
    row = math.prod(shape[:-2]) * shape[-1]  # the reduction's output
    copies = [on_cuda(numel * FP32_BYTES)] * 2 if param_bytes < FP32_BYTES else []  # grad, p
    live = copies + [on_cuda(numel * FP32_BYTES), on_cuda(row * FP32_BYTES)]  # update, its mean
    return tuple(live) + (largest_column_reduction_workspace_bytes(shape, ACCUMULATOR_BYTES),)


def hf_moment_events(shapes: Sequence[tuple[int, ...]], param_bytes: int) -> list[tuple[str, int]]:
    """transformers' Adafactor's requests around its largest column reduction, in the order
    its step makes them (module doc): (name, bytes) allocates, (name, -1) frees; what is still
    alive at the end is freed last made first. [] when the step has no factored tensor."""
    factored = [tuple(shape) for shape in shapes if len(shape) >= 2]
    if not factored:
        return []
    shape = max(factored, key=lambda shape: sum(_hf_moment(shape, param_bytes)))  # the first of the largest
    numel = math.prod(shape)
    rows = numel // shape[-1]  # update.mean(dim=-1)'s output
    columns = math.prod(shape[:-2]) * shape[-1]  # update.mean(dim=-2)'s output
    workspace, semaphores = largest_column_reduction_requests(shape, ACCUMULATOR_BYTES)
    events: list[tuple[str, int]] = []
    if param_bytes < FP32_BYTES:
        events += [("grad-fp32", numel * FP32_BYTES), ("param-fp32", numel * FP32_BYTES)]
    events += [("grad-squared", numel * FP32_BYTES), ("update", numel * FP32_BYTES), ("grad-squared", -1),
               ("row-mean", rows * FP32_BYTES), ("row-mean", -1), ("column-mean", columns * FP32_BYTES)]
    if workspace:
        events += [("reduction-workspace", workspace), ("reduction-semaphores", semaphores),
                   ("reduction-semaphores", -1), ("reduction-workspace", -1)]
    factor_mean = math.prod(shape[:-2]) * FP32_BYTES  # exp_avg_sq_row.mean(dim=-1, keepdim=True)
    events += [("column-mean", -1),
               ("row-factor-mean", factor_mean), ("row-factor", rows * FP32_BYTES), ("row-factor-mean", -1),
               ("column-factor", columns * FP32_BYTES), ("new-update", numel * FP32_BYTES),
               ("row-factor", -1), ("column-factor", -1), ("update", -1)]
    alive = [name for name, nbytes in events if nbytes > 0 and (name, -1) not in events]
    return events + [(name, -1) for name in reversed(alive)]
