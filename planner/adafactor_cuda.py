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
- torch's Adafactor (torch/optim/_adafactor.py `_single_tensor_adafactor`, one parameter
  group: the planner's loops pass `model.parameters()`), at `torch.norm(grad, dim=-2,
  keepdim=True)`. Its loop's locals stay bound from one tensor to the next until rebound, so
  the whole loop is replayed (`torch_loop_events`), per tensor in parameter order: `param.norm(2)`
  (one element, made and let go); for a factored tensor `row_mean` (the new one before the old
  is let go), the column norm's output with its workspace and semaphores (made and freed at
  its launch) before the previous factored tensor's `col_mean` is let go, `var_estimate = row_var
  @ col_var` (the tensor's size) and `row_var.mean(dim=-2)` (made and let go); for a vector
  `grad_squared` (the new one before the old) and `var_estimate = variance.clone()`; then the
  previous tensor's `var_estimate` is let go (`update` is the same tensor, bound until
  `update = var_estimate.clamp_(...)` rebinds it), and `update.norm(2)` is made and let go.
  Checked request by request against the loop on real tensors (tests/test_adafactor_cuda.py);
  the workspace's moment has not been measured on a GPU.
  `row_var.mean(dim=-2)` reduces a (rows, 1) tensor, which TensorIterator makes a reduction
  along its fastest dimension: at most a few hundred bytes of workspace, not modelled.
What MemTracker, and so a simulated step, counts is the live tensors (`step_peak_bytes(...,
workspaces=False)`): the estimate's step. The caching allocator counts the workspaces too: the
replay (planner.reserved) makes these requests, and a verdict that is not replayed adds what
they add (`step_peak_bytes(..., workspaces=True)`). Row reductions (dim -1) reduce along the
fastest dimension inside each block and are not counted.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Hashable, Sequence

from planner.cuda_allocator import FREE
from planner.cuda_reduction import largest_column_reduction_requests
from planner.optimizer_state import FP32_BYTES, allocation
from planner.scenario import Device, Optimizer

ACCUMULATOR_BYTES = FP32_BYTES  # both reductions accumulate in fp32 (float for fp32, bf16 and fp16)
WORKSPACE_KINDS = frozenset({"reduction-workspace", "reduction-semaphores"})  # a kernel's, not a tensor

Event = tuple[Hashable, int]  # (key, bytes) allocates; (key, FREE) frees


def step_events(shapes: Sequence[tuple[int, ...]], param_bytes: int, optimizer: Optimizer) -> tuple[Event, ...]:
    """The step's requests on CUDA as planner.reserved replays them: torch's Adafactor's whole
    loop (`torch_loop_events`), transformers' Adafactor's largest tensor (`hf_moment_events`);
    () for any other optimizer or a model without a factored tensor."""
    return _step_events(tuple(tuple(shape) for shape in shapes), param_bytes, optimizer)


@functools.lru_cache(maxsize=256)  # every plan of a search asks again for the same tensors
def _step_events(shapes: tuple[tuple[int, ...], ...], param_bytes: int, optimizer: Optimizer) -> tuple[Event, ...]:
    if not any(len(shape) >= 2 for shape in shapes):
        return ()
    if optimizer is Optimizer.ADAFACTOR:
        return tuple(torch_loop_events(shapes, param_bytes))
    if optimizer is Optimizer.HF_ADAFACTOR:
        return tuple(hf_moment_events(shapes, param_bytes))
    return ()


def step_peak_bytes(shapes: Sequence[tuple[int, ...]], param_bytes: int, optimizer: Optimizer,
                    workspaces: bool) -> int:
    """The most `step_events` hold at once, each request in the caching allocator's 512-byte
    blocks: with the reductions' workspaces (what `max_memory_allocated` counts), or without
    them (the live tensors: what MemTracker and a simulated step count). 0 when there are none."""
    return _step_peak_bytes(tuple(tuple(shape) for shape in shapes), param_bytes, optimizer, workspaces)


@functools.lru_cache(maxsize=1024)
def _step_peak_bytes(shapes: tuple[tuple[int, ...], ...], param_bytes: int, optimizer: Optimizer,
                     workspaces: bool) -> int:
    on_cuda = allocation(Device.CUDA)
    live, peak, sizes = 0, 0, {}
    for key, nbytes in _step_events(shapes, param_bytes, optimizer):
        if not workspaces and event_kind(key) in WORKSPACE_KINDS:
            continue
        if nbytes == FREE:
            live -= sizes.pop(key)
        else:
            sizes[key] = on_cuda(nbytes)
            live += sizes[key]
            peak = max(peak, live)
    return peak


def event_kind(key: Hashable) -> str:
    """What a `step_events` key names: torch's loop keys `(kind, tensor index)`, transformers'
    moment keys the kind alone."""
    return key if isinstance(key, str) else key[0]


def torch_loop_events(shapes: Sequence[tuple[int, ...]], param_bytes: int) -> list[Event]:
    """torch's Adafactor's requests over its whole loop, in order (module doc); what is still
    bound when the loop ends is freed at its return."""
    events: list[Event] = []
    bound: dict[str, tuple[str, int]] = {}  # local variable -> the key of the tensor it holds

    def rebind(name: str, key: tuple[str, int], nbytes: int) -> None:
        events.append((key, nbytes))
        if name in bound:
            events.append((bound[name], FREE))
        bound[name] = key

    for i, shape in enumerate(shapes):
        numel = math.prod(shape)
        events += [(("param-norm", i), param_bytes), (("param-norm", i), FREE)]  # param.norm(2).item()
        if len(shape) >= 2:
            rebind("row_mean", ("row-mean", i), math.prod(shape[:-1]) * param_bytes)
            events.append((("column-mean", i), math.prod(shape[:-2]) * shape[-1] * param_bytes))
            workspace, semaphores = largest_column_reduction_requests(shape, ACCUMULATOR_BYTES)
            if workspace:
                events += [(("reduction-workspace", i), workspace), (("reduction-semaphores", i), semaphores),
                           (("reduction-semaphores", i), FREE), (("reduction-workspace", i), FREE)]
            if "col_mean" in bound:
                events.append((bound["col_mean"], FREE))
            bound["col_mean"] = ("column-mean", i)
            events.append((("var-estimate", i), numel * param_bytes))  # row_var @ col_var
            events += [(("row-var-mean", i), math.prod(shape[:-2]) * param_bytes), (("row-var-mean", i), FREE)]
        else:
            rebind("grad_squared", ("grad-squared", i), numel * param_bytes)
            events.append((("var-estimate", i), numel * param_bytes))  # variance.clone()
        # `update = var_estimate.clamp_(...)` is the same tensor: rebinding `var_estimate` leaves
        # the previous one bound to `update` until this line rebinds it.
        if "update" in bound:
            events.append((bound["update"], FREE))
        bound["update"] = ("var-estimate", i)
        events += [(("update-norm", i), param_bytes), (("update-norm", i), FREE)]  # update.norm(2).item()
    # At the return CPython clears the frame's locals in the order the code first names them.
    return events + [(bound[name], FREE) for name in ("row_mean", "col_mean", "grad_squared", "update")
                     if name in bound]


def _hf_moment(shape: tuple[int, ...], param_bytes: int) -> tuple[int, ...]:
    """transformers' Adafactor's live requests at one tensor's `update.mean(dim=-2)`."""
    numel = math.prod(shape)
    row = math.prod(shape[:-2]) * shape[-1]  # the reduction's output
    copies = [numel * FP32_BYTES] * 2 if param_bytes < FP32_BYTES else []  # grad, p
    live = copies + [numel * FP32_BYTES, row * FP32_BYTES]  # update, its mean
    return tuple(live) + largest_column_reduction_requests(shape, ACCUMULATOR_BYTES)


def hf_moment_events(shapes: Sequence[tuple[int, ...]], param_bytes: int) -> list[Event]:
    """transformers' Adafactor's requests around its largest column reduction, in the order
    its step makes them (module doc): (name, bytes) allocates, (name, FREE) frees; what is still
    alive at the end is freed last made first. [] when the step has no factored tensor."""
    factored = [tuple(shape) for shape in shapes if len(shape) >= 2]
    if not factored:
        return []
    shape = max(factored, key=lambda shape: sum(_hf_moment(shape, param_bytes)))  # the first of the largest
    numel = math.prod(shape)
    rows = numel // shape[-1]  # update.mean(dim=-1)'s output
    columns = math.prod(shape[:-2]) * shape[-1]  # update.mean(dim=-2)'s output
    workspace, semaphores = largest_column_reduction_requests(shape, ACCUMULATOR_BYTES)
    events: list[Event] = []
    if param_bytes < FP32_BYTES:
        events += [("grad-fp32", numel * FP32_BYTES), ("param-fp32", numel * FP32_BYTES)]
    events += [("grad-squared", numel * FP32_BYTES), ("update", numel * FP32_BYTES), ("grad-squared", FREE),
               ("row-mean", rows * FP32_BYTES), ("row-mean", FREE), ("column-mean", columns * FP32_BYTES)]
    if workspace:
        events += [("reduction-workspace", workspace), ("reduction-semaphores", semaphores),
                   ("reduction-semaphores", FREE), ("reduction-workspace", FREE)]
    factor_mean = math.prod(shape[:-2]) * FP32_BYTES  # exp_avg_sq_row.mean(dim=-1, keepdim=True)
    events += [("column-mean", FREE),
               ("row-factor-mean", factor_mean), ("row-factor", rows * FP32_BYTES), ("row-factor-mean", FREE),
               ("column-factor", columns * FP32_BYTES), ("new-update", numel * FP32_BYTES),
               ("row-factor", FREE), ("column-factor", FREE), ("update", FREE)]
    alive = [name for name, nbytes in events if nbytes != FREE and (name, FREE) not in events]
    return events + [(name, FREE) for name in reversed(alive)]
