"""Adafactor's step on CUDA, request by request: both Adafactors' loops and their reductions' workspaces.

Both Adafactors run a per-tensor loop, the same Python on CUDA as on the CPU, so their step is
probed on the CPU (planner.probe.step). On CUDA each tensor's reductions (the factored second
moment's over dim -2, and the norm of the whole tensor) also take a workspace from the caching
allocator for their launch (planner.cuda_reduction), which no fake kernel allocates. Each loop
keeps its locals bound from one tensor to the next until they are rebound, so what is live at
a reduction depends on the tensors before it: each loop is replayed whole, its tensors in the
order the step visits them (`optimizer_order`).
- transformers' Adafactor (transformers/optimization.py `Adafactor.step`), `hf_loop_events`,
  per tensor: a 16-bit gradient's and parameter's fp32 copies (`grad.float()`, `p.float()`,
  each made after the previous tensor's is let go by rebinding); `state["RMS"] = _rms(p)`
  (the norm's output, workspace and semaphores, its division, the old RMS let go);
  `update = (grad**2) + eps` (`grad**2`, then the sum, then `grad**2` let go, then the
  previous tensor's update); for a factored tensor `update.mean(dim=-1)` (made and freed),
  `update.mean(dim=-2)` with its workspace and semaphores, and `_approx_sq_grad` (the row
  factor's mean and the row factor, the column factor, their product; both factors let go
  at its return, then the old update); for a vector `exp_avg_sq.rsqrt()` before the old
  update goes; `_rms(update)` and the clip's scalar; `-update` for `p_data_fp32.add_`. What
  `step()` holds at its return goes then (`grad`, `p_data_fp32`, `update`). Checked against
  the H200's record of DistilBERT's Trainer run, every allocation and free of the step in
  order (tests/test_gpu_traces.py): 89,075,712 B of the word embeddings' `update` and
  138,412,032 B of its column mean's workspace live together at the step's peak.
- torch's Adafactor (torch/optim/_adafactor.py `_single_tensor_adafactor`, one parameter
  group: the planner's loops pass `model.parameters()`), `torch_loop_events`, per tensor:
  `param.norm(2)` (its output in the parameter's dtype, workspace and semaphores, let go after
  `.item()`); for a factored tensor `row_mean` (the new one before the old is let go), the
  column norm's output with its workspace and semaphores before the previous factored
  tensor's `col_mean` is let go, `var_estimate = row_var @ col_var` (the tensor's size) and
  `row_var.mean(dim=-2)` (made and let go); for a vector `grad_squared` (the new one before
  the old) and `var_estimate = variance.clone()`; then the previous tensor's `var_estimate` is
  let go (`update` is the same tensor, bound until `update = var_estimate.clamp_(...)` rebinds
  it), and `update.norm(2)` is made and let go. Checked request by request against the loop on
  real tensors (tests/test_adafactor_cuda.py); no GPU record of it has been taken.
  `row_var.mean(dim=-2)` reduces a (rows, 1) tensor: for a matrix, a whole vector reduced to
  one value (`full_reduction_requests`, workspace from 131,072 rows); for more dimensions one
  value per leading index, whose workspace is not modelled.
What MemTracker, and so a simulated step, counts is the live tensors (`step_peak_bytes(...,
workspaces=False)`): the estimate's step. The caching allocator counts the workspaces too: the
replay (planner.reserved) makes these requests, and a verdict that is not replayed adds what
they add (`step_peak_bytes(..., workspaces=True)`). Row reductions (dim -1 of a matrix)
reduce along the fastest dimension inside each block and take none.
"""

from __future__ import annotations

import functools
import math
import re
from collections.abc import Hashable, Sequence

from planner.cuda_allocator import FREE, Event
from planner.cuda_reduction import (largest_column_reduction_requests, largest_full_reduction_requests,
                                    launch_events)
from planner.model_shape import ParamTensor
from planner.optimizer_state import FP32_BYTES, allocation
from planner.scenario import Device, Engine, Optimizer

ACCUMULATOR_BYTES = FP32_BYTES  # both reductions accumulate in fp32 (float for fp32, bf16 and fp16)
WORKSPACE_KINDS = frozenset({"reduction-workspace", "reduction-semaphores"})  # a kernel's, not a tensor

# Trainer.get_decay_parameter_names' patterns (transformers/trainer.py), searched in the lower-cased name
_NO_DECAY_NAMES = tuple(re.compile(pattern) for pattern in
                        (r"bias", r"layernorm", r"rmsnorm", r"(?:^|\.)norm(?:$|\.)", r"_norm(?:$|\.)"))


def optimizer_order(params: Sequence[ParamTensor], optimizer: Optimizer, engine: Engine) -> tuple[tuple[int, ...], ...]:
    """The shapes of `params` (the trained tensors, in the model's order) in the order the step
    visits them: the model's, but for transformers' Adafactor built by the Trainer, whose two
    groups (planner.probe.optimizers.trainer_parameter_groups) put the tensors that decay first.
    A tensor decays unless its name matches Trainer.get_decay_parameter_names' patterns or it
    sits in an nn.LayerNorm, which a ModelShape does not record: a vector whose name matches
    none is taken as a LayerNorm's weight (GPT-2's `ln_1.weight`: every such tensor in the
    catalog is one)."""
    if optimizer is not Optimizer.HF_ADAFACTOR or engine is not Engine.TRAINER:
        return tuple(tuple(p.shape) for p in params)

    def decays(param: ParamTensor) -> bool:
        return len(param.shape) >= 2 and not any(pattern.search(param.name.lower()) for pattern in _NO_DECAY_NAMES)

    return (tuple(tuple(p.shape) for p in params if decays(p))
            + tuple(tuple(p.shape) for p in params if not decays(p)))


def step_events(shapes: Sequence[tuple[int, ...]], param_bytes: int, optimizer: Optimizer) -> tuple[Event, ...]:
    """The step's requests on CUDA as planner.reserved replays them, over `shapes` in the order
    the step visits them (`optimizer_order`): torch's Adafactor's loop (`torch_loop_events`),
    transformers' (`hf_loop_events`); () for any other optimizer or a model without a factored
    tensor."""
    return _step_events(tuple(tuple(shape) for shape in shapes), param_bytes, optimizer)


@functools.lru_cache(maxsize=32)  # every plan of a search asks again; a 70B loop is ~10k events
def _step_events(shapes: tuple[tuple[int, ...], ...], param_bytes: int, optimizer: Optimizer) -> tuple[Event, ...]:
    if not any(len(shape) >= 2 for shape in shapes):
        return ()
    if optimizer is Optimizer.ADAFACTOR:
        return tuple(torch_loop_events(shapes, param_bytes))
    if optimizer is Optimizer.HF_ADAFACTOR:
        return tuple(hf_loop_events(shapes, param_bytes))
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
    """What a `step_events` key names: keys are `(kind, tensor index)`, a workspace's
    `(kind, the key of the output its launch made)`."""
    return key[0]


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
        events += _full_norm_events(("param-norm", i), numel, param_bytes) + [(("param-norm", i), FREE)]  # .item()
        if len(shape) >= 2:
            rebind("row_mean", ("row-mean", i), math.prod(shape[:-1]) * param_bytes)
            events.append((("column-mean", i), math.prod(shape[:-2]) * shape[-1] * param_bytes))
            events += launch_events(("column-mean", i), *largest_column_reduction_requests(shape, ACCUMULATOR_BYTES))
            if "col_mean" in bound:
                events.append((bound["col_mean"], FREE))
            bound["col_mean"] = ("column-mean", i)
            events.append((("var-estimate", i), numel * param_bytes))  # row_var @ col_var
            events += [(("row-var-mean", i), math.prod(shape[:-2]) * param_bytes)]
            events += _factor_mean_workspace(("row-var-mean", i), shape)
            events.append((("row-var-mean", i), FREE))
        else:
            rebind("grad_squared", ("grad-squared", i), numel * param_bytes)
            events.append((("var-estimate", i), numel * param_bytes))  # variance.clone()
        # `update = var_estimate.clamp_(...)` is the same tensor: rebinding `var_estimate` leaves
        # the previous one bound to `update` until this line rebinds it.
        if "update" in bound:
            events.append((bound["update"], FREE))
        bound["update"] = ("var-estimate", i)
        events += _full_norm_events(("update-norm", i), numel, param_bytes) + [(("update-norm", i), FREE)]
    # At the return CPython clears the frame's locals in the order the code first names them.
    return events + [(bound[name], FREE) for name in ("row_mean", "col_mean", "grad_squared", "update")
                     if name in bound]


def hf_loop_events(shapes: Sequence[tuple[int, ...]], param_bytes: int) -> list[Event]:
    """transformers' Adafactor's requests over its whole step, the tensors in the optimizer's
    order (`optimizer_order`), as the module doc says; what `step()` still holds when it
    returns is freed then, in the order its code first names it."""
    events: list[Event] = []
    bound: dict[str, tuple[str, int]] = {}  # step()'s locals -> the key of the tensor each holds

    def let_go(name: str) -> None:
        if name in bound:
            events.append((bound.pop(name), FREE))

    for i, shape in enumerate(shapes):
        numel = math.prod(shape)
        full = numel * FP32_BYTES
        let_go("grad")  # `grad = p.grad`: a 16-bit tensor's previous fp32 copy goes
        if param_bytes < FP32_BYTES:
            events.append((("grad-fp32", i), full))  # grad.float()
            bound["grad"] = ("grad-fp32", i)
        let_go("p_data_fp32")
        if param_bytes < FP32_BYTES:
            events.append((("param-fp32", i), full))  # p.float()
            bound["p_data_fp32"] = ("param-fp32", i)
        # state["RMS"] = self._rms(p_data_fp32): the norm, its division, the old RMS let go
        # (the new RMS is freed here in the old one's place: the same 4 bytes in the small pool, and
        # the state keeps its key in planner.reserved)
        events += _full_norm_events(("param-norm", i), numel, FP32_BYTES)
        events += [(("rms", i), FP32_BYTES), (("param-norm", i), FREE), (("rms", i), FREE)]
        # update = (grad**2) + eps
        events += [(("grad-squared", i), full), (("update", i), full), (("grad-squared", i), FREE)]
        let_go("update")
        bound["update"] = ("update", i)
        if len(shape) >= 2:
            rows = numel // shape[-1]
            columns = math.prod(shape[:-2]) * shape[-1]
            events += [(("row-mean", i), rows * FP32_BYTES), (("row-mean", i), FREE),  # update.mean(dim=-1)
                       (("column-mean", i), columns * FP32_BYTES)]  # update.mean(dim=-2)
            events += launch_events(("column-mean", i), *largest_column_reduction_requests(shape, ACCUMULATOR_BYTES))
            events += [(("column-mean", i), FREE),
                       # _approx_sq_grad: exp_avg_sq_row.mean(dim=-1, keepdim=True), the row factor,
                       # the column factor, their product; both factors go at its return
                       (("row-factor-mean", i), math.prod(shape[:-2]) * FP32_BYTES)]
            events += _factor_mean_workspace(("row-factor-mean", i), shape)
            events += [(("row-factor", i), rows * FP32_BYTES), (("row-factor-mean", i), FREE),
                       (("column-factor", i), columns * FP32_BYTES), (("factored-update", i), full),
                       (("row-factor", i), FREE), (("column-factor", i), FREE)]
            new_update = ("factored-update", i)
        else:
            events.append((("rsqrt-update", i), full))  # exp_avg_sq.rsqrt()
            new_update = ("rsqrt-update", i)
        let_go("update")
        bound["update"] = new_update
        # update.div_((self._rms(update) / clip_threshold).clamp_(min=1.0))
        events += _full_norm_events(("update-norm", i), numel, FP32_BYTES)
        events += [(("update-rms", i), FP32_BYTES), (("update-norm", i), FREE), (("clip", i), FP32_BYTES),
                   (("update-rms", i), FREE), (("clip", i), FREE)]
        events += [(("negative-update", i), full), (("negative-update", i), FREE)]  # p_data_fp32.add_(-update)
    return events + [(bound[name], FREE) for name in ("grad", "p_data_fp32", "update") if name in bound]


def _full_norm_events(key: tuple[str, int], numel: int, output_bytes: int) -> list[Event]:
    """`tensor.norm()` of a tensor of `numel` elements: its output, then the launch's workspace
    and semaphores, made and freed (planner.cuda_reduction.full_reduction_requests)."""
    workspace, semaphores = largest_full_reduction_requests(numel, ACCUMULATOR_BYTES)
    return [(key, output_bytes)] + launch_events(key, workspace, semaphores)


def _factor_mean_workspace(owner: Hashable, shape: tuple[int, ...]) -> list[Event]:
    """The workspace of the mean of a factored tensor's row statistics (torch's
    `row_var.mean(dim=-2)`, transformers' `exp_avg_sq_row.mean(dim=-1)`): for a matrix, a whole
    vector of its rows reduced to one value; for more dimensions, one value per leading index,
    not modelled (module doc)."""
    if len(shape) != 2:
        return []
    return launch_events(owner, *largest_full_reduction_requests(shape[0], ACCUMULATOR_BYTES))
