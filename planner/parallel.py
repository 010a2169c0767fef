"""Memory per device and traffic per optimizer step when training runs on several devices.

Every rank runs the single-device scenario on its own micro-batch (planner.estimate gives
its activations and temporaries); the strategy (planner.strategy) decides what each rank
holds of the weights, gradients and optimizer state, which buffers communication adds,
and which collectives run. Figures are for rank 0, the largest when a tensor's rows do
not split evenly. Bytes are payloads: what a rank hands to the collective (the reduced
tensor of an all-reduce, the gathered output of an all-gather, the full input of a
reduce-scatter); `wire_bytes` is what a ring algorithm sends per rank
(all-reduce 2(N-1)/N of the payload, all-gather and reduce-scatter (N-1)/N; Patarasuk &
Yuan 2009; NCCL's docs/performance notes use the same factors).

What each strategy holds, per rank (P parameters, G gradients, S optimizer state):
- ddp: P, G, S replicated, plus DDP's gradient buckets: a flat copy of every gradient,
  grouped in reverse parameter order, the first bucket closed at 1 MiB and the others
  at 25 MiB (torch/nn/parallel/distributed.py `_DEFAULT_FIRST_BUCKET_BYTES`,
  `bucket_cap_mb=25`; reducer.cpp `compute_bucket_assignment_by_size`). One all-reduce
  per bucket and optimizer step (accumulating micro-batches run under `no_sync`), and a
  broadcast of the module buffers before the synchronising forward (`broadcast_buffers`).
- local SGD (accelerate.local_sgd.LocalSGD on DDP): the model stays in `no_sync`, so no
  gradient all-reduce; every K calls of `local_sgd.step()` (one per micro-batch in the
  lessons' loop) each parameter tensor is averaged by its own all-reduce, and once more
  when the context exits.
- zero1 / zero2 / zero3 (DeepSpeed): S, then G, then P split N ways; gradients are
  reduce-scattered and updated parameters all-gathered. ZeRO-3 gathers each layer's
  parameters in the forward and again in the backward. Modelled from the ZeRO paper
  (Rajbhandari et al. 2020, section 5) with DeepSpeed's default bucket of 5e8 elements;
  DeepSpeed is not a dependency here, so these are not verified by a run.
- fsdp-full-shard / fsdp-shard-grad-op (torch FSDP2 as Accelerate's plugin applies it):
  each parameter's first dimension padded to a multiple of N and split; units as
  `ModelShape.fsdp_units` (the importer mirrors Accelerate's `fsdp2_prepare_model`: each
  module of a `_no_split_modules` class, the untied input embedding, [final norm, output
  embedding], the root). Blocks and the input embedding are resharded after forward with
  FULL_SHARD; the tail and the root stay gathered from forward to backward. All-gathers:
  every unit in the forward, the resharded ones again in the backward; a reduce-scatter
  of each unit's gradients every micro-batch (FSDP2 modules have no `no_sync`, so
  Accelerate's `accumulate` cannot skip it). Under mixed precision Accelerate sets a
  16-bit MixedPrecisionPolicy: 16-bit gathers, reductions and compute, fp32 shards and
  state. The per-rank peak is the largest of a few moments: the forward's end (kept units
  and one more copy of the largest), the loss's backward, entering the last block (the
  tail's unsharded gradients beside their reduce-scatter input, two units re-gathered),
  the end of backward (the last unit's gradients reduced), and for shard grad op the
  head's backward with every unit still gathered.

Known limitations: FSDP's transient buffers are placed at those moments from FSDP2's
code and two-rank CPU runs, not derived from its allocator: on 28 runs of 6 families the
per-rank peak came out -3.1% to +6.8% (median 0.00%; benchmarks/results/distributed_memory.md).
Whether an asynchronous collective's buffer (one unit) is still alive at the peak depends
on timing: the same GPT-NeoX bf16 run measured 11.08 MiB and 11.82 MiB on two occasions.
The optimizer step of some runs held one more embedding-sized gathered unit than
modelled (never the peak there). CUDA stream-ordered frees and NCCL's own buffers are
not modelled. ZeRO-1/2 under mixed precision are modelled as torch AMP (fp32 weights and
gradients on every device), not DeepSpeed's 16-bit copies.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass

from planner.errors import PlannerInputError
from planner.estimate import PROBE_ONLY_TASKS, Estimate, Phase, PhaseMemory, estimate
from planner.model_shape import FsdpUnitKind, ModelShape, ParamTensor
from planner.optimizer_state import (allocation, optimizer_state_bytes, parameter_bytes_per_element,
                                     parameter_tensor_bytes)
from planner.scenario import Checkpointing, Precision, Scenario
from planner.strategy import ParallelPlan, Strategy

DDP_FIRST_BUCKET_BYTES = 1024 * 1024  # torch.distributed._DEFAULT_FIRST_BUCKET_BYTES
DDP_BUCKET_BYTES = 25 * 1024 * 1024  # DistributedDataParallel(bucket_cap_mb=25)
DEEPSPEED_BUCKET_ELEMENTS = 500_000_000  # reduce_bucket_size / allgather_bucket_size defaults


@dataclass(frozen=True)
class Collective:
    """One kind of collective over one optimizer step (averaged over a local SGD period)."""

    kind: str  # all_reduce, all_gather, reduce_scatter, broadcast
    what: str  # gradients, parameters, buffers
    calls_per_step: float
    bytes_per_step: float  # payload bytes per rank
    wire_factor: float  # bytes on the wire per payload byte, per rank (ring algorithm)

    @property
    def wire_bytes_per_step(self) -> float:
        return self.bytes_per_step * self.wire_factor

    def to_json(self) -> dict:
        return {"kind": self.kind, "what": self.what, "calls_per_step": self.calls_per_step,
                "bytes_per_step": self.bytes_per_step, "wire_bytes_per_step": self.wire_bytes_per_step}


@dataclass(frozen=True)
class DevicePhase:
    """Live bytes on one rank at the high point of one phase."""

    phase: Phase
    weights: int  # own shard (or replica), buffers, and gathered parameters
    gradients: int
    optimizer_state: int
    activations: int
    temporaries: int
    communication_buffers: int  # DDP's gradient buckets, DeepSpeed's reduce bucket

    @property
    def total(self) -> int:
        return (self.weights + self.gradients + self.optimizer_state + self.activations + self.temporaries
                + self.communication_buffers)


@dataclass(frozen=True)
class ParallelEstimate:
    base: Estimate  # one rank's micro-batch on one device
    plan: ParallelPlan
    phases: tuple[DevicePhase, ...]
    placement: dict  # category -> "replicated" | "sharded N ways"
    ddp_bucket_bytes: tuple[int, ...]
    largest_gathered_unit_bytes: int  # the biggest set of parameters gathered at once (ZeRO-3, FSDP)
    collectives: tuple[Collective, ...]
    local_sgd_sync_bytes: int  # one parameter averaging (local SGD), payload

    @property
    def peak(self) -> DevicePhase:
        return max(self.phases, key=lambda p: p.total)

    @property
    def per_device_peak_bytes(self) -> int:
        return self.peak.total

    @property
    def comm_bytes_per_step(self) -> float:
        return sum(c.bytes_per_step for c in self.collectives)

    @property
    def comm_wire_bytes_per_step(self) -> float:
        return sum(c.wire_bytes_per_step for c in self.collectives)

    def comm_bytes_over_run(self, optimizer_steps: int) -> int:
        """Payload bytes over `optimizer_steps` steps of the lessons' loop (set-up excluded).

        Local SGD averages at every K-th micro-batch and once more on leaving its context.
        """
        plan, scenario = self.plan, self.base.scenario
        if not plan.distributed:
            return 0
        if plan.local_sgd_steps is not None:
            syncs = optimizer_steps * scenario.grad_accum_steps // plan.local_sgd_steps + 1
            return syncs * self.local_sgd_sync_bytes
        return round(optimizer_steps * self.comm_bytes_per_step)

    def to_json(self) -> dict:
        peak = self.peak
        return {
            "num_devices": self.plan.num_devices,
            "strategy": self.plan.strategy.value,
            "local_sgd_steps": self.plan.local_sgd_steps,
            "per_device_peak_bytes": peak.total,
            "per_device_peak_phase": peak.phase.value,
            "per_device_breakdown_bytes": {
                "weights": peak.weights, "gradients": peak.gradients, "optimizer_state": peak.optimizer_state,
                "activations": peak.activations, "temporaries": peak.temporaries,
                "communication_buffers": peak.communication_buffers,
            },
            "per_device_phases": {p.phase.value: p.total for p in self.phases},
            "placement": dict(self.placement),
            "ddp_bucket_bytes": list(self.ddp_bucket_bytes),
            "largest_gathered_unit_bytes": self.largest_gathered_unit_bytes,
            "comm_bytes_per_step": self.comm_bytes_per_step,
            "comm_wire_bytes_per_step": self.comm_wire_bytes_per_step,
            "collectives": [c.to_json() for c in self.collectives],
            "local_sgd_sync_bytes": self.local_sgd_sync_bytes,
        }


# --- Shards and units ------------------------------------------------------------------

def _shard_rows(rows: int, n: int) -> int:
    """Rows rank 0 holds: torch.chunk's split of dim 0 (FSDP2 pads the rest to this size)."""
    return -(-rows // n)


@functools.lru_cache(maxsize=256)
def sharded_shape(shape: ModelShape, n: int) -> ModelShape:
    """The model as rank 0 of N sees it: every parameter cut to its dim-0 shard."""
    params = tuple(ParamTensor(p.name, (_shard_rows(p.shape[0], n),) + tuple(p.shape[1:])) for p in shape.params)
    return dataclasses.replace(shape, params=params)


@dataclass(frozen=True)
class _Units:
    resharded: tuple[int, ...]  # gathered bytes of each unit resharded after forward (blocks, embedding)
    largest_block: int
    tail: int  # gathered bytes of the tail (final norm, output embedding), kept from forward to backward
    root: int  # gathered bytes of the root's own parameters, kept likewise
    kept_calls: int  # how many of those two units have parameters: one collective each
    last_reduced: int  # the largest unit reduced at the very end: the first the forward uses, or the root

    @property
    def kept(self) -> int:
        return self.tail + self.root


@functools.lru_cache(maxsize=256)
def _fsdp_units(shape: ModelShape, n: int, element: int) -> _Units:
    """Gathered bytes of each FSDP unit (ModelShape.fsdp_units): every parameter's dim 0
    padded to a multiple of N, as FSDP2 pads its shards."""
    padded = {p.name: _shard_rows(p.shape[0], n) * n * math.prod(p.shape[1:]) * element for p in shape.params}
    sizes = [(unit.kind, sum(padded[name] for name in unit.param_names)) for unit in shape.fsdp_units]
    resharded = tuple(size for kind, size in sizes if kind.follows_reshard_setting)
    by_kind = {kind: size for kind, size in sizes if not kind.follows_reshard_setting}
    blocks = [size for kind, size in sizes if kind is FsdpUnitKind.BLOCK]
    root = by_kind.get(FsdpUnitKind.ROOT, 0)
    # The root's gradients are complete only when backward ends, like the first unit's.
    last = max(sizes[0][1] if sizes else 0, root)
    return _Units(resharded, max(blocks, default=0), by_kind.get(FsdpUnitKind.TAIL, 0), root, len(by_kind), last)


def ddp_buckets(shape: ModelShape, gradient_element_bytes: int) -> tuple[int, ...]:
    """DDP's rebuilt buckets: reverse parameter order (when their gradients become ready),
    closed once they reach 1 MiB (the first) or 25 MiB (the others)."""
    buckets, current = [], 0
    for p in reversed(shape.params):
        current += p.numel * gradient_element_bytes
        if current >= (DDP_FIRST_BUCKET_BYTES if not buckets else DDP_BUCKET_BYTES):
            buckets.append(current)
            current = 0
    if current:
        buckets.append(current)
    return tuple(buckets)


# --- The estimate ----------------------------------------------------------------------

def _ring(kind: str, n: int) -> float:
    if kind == "all_reduce":
        return 2 * (n - 1) / n
    if kind in ("all_gather", "reduce_scatter"):
        return (n - 1) / n
    return 1.0  # broadcast: every other rank receives the payload once


def parallel_estimate(shape: ModelShape, scenario: Scenario, plan: ParallelPlan,
                      base: Estimate | None = None) -> ParallelEstimate:
    """Per-rank memory and per-step traffic of `scenario` (per-rank micro-batch) under `plan`."""
    if plan.distributed and plan.strategy.shards_parameters and scenario.task in PROBE_ONLY_TASKS:
        # Sharded parameters' moments are read from the family recipe's activation terms, which
        # no recipe gives for these tasks (planner.estimate.PROBE_ONLY_TASKS).
        raise PlannerInputError(f"{PROBE_ONLY_TASKS[scenario.task]} with {plan.strategy.value} is not planned yet: "
                                "use ddp, zero1 or zero2, or one GPU")
    base = base if base is not None else estimate(shape, scenario)
    n, strategy = plan.num_devices, plan.strategy
    on_device = allocation(scenario.device)
    element = parameter_bytes_per_element(scenario.precision)
    params = parameter_tensor_bytes(shape, scenario.precision, scenario.device)
    payload = shape.stats.num_elements * element  # what a collective carries: no allocator rounding
    buffers = base.weights_bytes - params
    accumulation = scenario.grad_accum_steps
    placement = {"weights": "replicated", "gradients": "replicated", "optimizer_state": "replicated",
                 "activations": "per device (its own micro-batch)"}
    collectives: list[Collective] = []

    def collective(kind: str, what: str, calls: float, nbytes: float) -> None:
        collectives.append(Collective(kind, what, calls, nbytes, _ring(kind, n)))

    if not plan.distributed:
        return ParallelEstimate(base, plan, tuple(_with(p) for p in base.phases), placement, (), 0, (), 0)

    shard = sharded_shape(shape, n)
    shard_params = parameter_tensor_bytes(shard, scenario.precision, scenario.device)
    shard_state = optimizer_state_bytes(shard, scenario.optimizer, scenario.precision, scenario.device,
                                        scenario.engine)
    fraction = shard_params / params if params else 0.0

    if strategy is Strategy.DDP:
        buckets = tuple(on_device(b) for b in ddp_buckets(shape, element))
        phases = tuple(_with(p, communication_buffers=sum(buckets)) for p in base.phases)
        if plan.local_sgd_steps is not None:
            # One all-reduce per parameter tensor, every K micro-batches.
            per_step = accumulation / plan.local_sgd_steps
            collective("all_reduce", "parameters", shape.stats.num_tensors * per_step, payload * per_step)
        else:
            collective("all_reduce", "gradients", len(buckets), payload)  # the buckets hold every gradient
            if buffers:
                collective("broadcast", "buffers", 1, shape.float_buffer_elements * 4 + shape.other_buffer_bytes)
        return ParallelEstimate(base, plan, phases, placement, buckets, 0, tuple(collectives), payload)

    placement["optimizer_state"] = f"sharded {n} ways"
    if strategy.shards_gradients:
        placement["gradients"] = f"sharded {n} ways"
    if strategy.shards_parameters:
        placement["weights"] = f"sharded {n} ways"
    forward, backward, step = base.phases
    shard_gradients = shard_params if strategy.shards_gradients else params
    # Accumulating micro-batches keep whole (unsharded) gradients until the last one.
    early_gradients = params if accumulation > 1 else 0
    step_temporaries = round(step.temporaries * fraction) if strategy.shards_optimizer_state else step.temporaries
    optimizer_phase = DevicePhase(Phase.OPTIMIZER_STEP, (shard_params if strategy.shards_parameters else params)
                                  + buffers, shard_gradients, shard_state, step.activations, step_temporaries, 0)

    if strategy in (Strategy.ZERO1, Strategy.ZERO2):
        bucket = on_device(min(params, DEEPSPEED_BUCKET_ELEMENTS * element))
        phases = (
            _with(forward, optimizer_state=shard_state, communication_buffers=bucket,
                  gradients=min(forward.gradients, early_gradients)),
            _with(backward, optimizer_state=shard_state, communication_buffers=bucket,
                  gradients=min(backward.gradients, shard_gradients + bucket)),
            dataclasses.replace(optimizer_phase, communication_buffers=bucket),
        )
        reductions = 1 if strategy is Strategy.ZERO1 else accumulation
        collective("reduce_scatter", "gradients", reductions, payload * reductions)
        collective("all_gather", "parameters", 1, payload)
        return ParallelEstimate(base, plan, phases, placement, (), 0, tuple(collectives), payload)

    # Accelerate's FSDP plugin under mixed precision sets MixedPrecisionPolicy(param_dtype,
    # reduce_dtype, output_dtype = the 16-bit type): parameters are gathered and gradients
    # reduced in 16 bits and the model computes as a pure 16-bit one (autocast has nothing
    # left to cast), while shards, their gradients and the optimizer state stay fp32.
    mixed = scenario.precision in (Precision.BF16_MIXED, Precision.FP16_MIXED)
    gathered_element = 2 if mixed else element
    computed = estimate(shape, dataclasses.replace(scenario, precision=Precision.BF16)) if mixed else base
    if mixed:
        forward, backward, _ = computed.phases
    logits_kept = computed.phases[2].activations
    embedding_activations = computed.profile.embedding_bytes
    optimizer_phase = dataclasses.replace(optimizer_phase, activations=logits_kept)
    # FSDP2 modules have no `no_sync`, so Accelerate's `accumulate` reduce-scatters every
    # micro-batch: accumulating micro-batches carry gradient shards, not whole gradients.
    early_gradients = shard_params if accumulation > 1 else 0
    units = _fsdp_units(shape, n, gathered_element)
    largest = max(units.resharded + (units.kept,))
    everything = sum(units.resharded) + units.kept
    keeps_all = strategy is Strategy.FSDP_SHARD_GRAD_OP
    kept_after_forward = everything if keeps_all else units.kept
    own = shard_params + buffers
    # Forward: the units kept gathered, and one more copy of the largest unit (its gathered
    # output beside the unsharded parameters it is copied into).
    forward_phase = DevicePhase(Phase.FORWARD, own + kept_after_forward + largest, early_gradients, shard_state,
                                forward.activations, forward.temporaries, 0)
    # Backward's own high point (the loss's gradients, everything saved still alive), with
    # what the forward left gathered.
    backward_peak = DevicePhase(Phase.BACKWARD, own + kept_after_forward, early_gradients, shard_state,
                                backward.activations, backward.temporaries, 0)
    # End of backward: the last unit reduced is gathered, its unsharded gradients and the
    # reduce-scatter's input copy alive, every gradient shard made.
    backward_end = DevicePhase(Phase.BACKWARD, own + units.last_reduced,
                               shard_params, shard_state,
                               embedding_activations + logits_kept, 2 * units.last_reduced, 0)
    # Entering the last block's backward: the head's activations freed, its unsharded
    # gradients beside their reduce-scatter input, the last resharded unit re-gathered and
    # the one before it prefetched (two blocks; the embedding when no block is wrapped);
    # with checkpointing, the last block recomputed beside every kept input.
    profile = computed.profile
    if scenario.checkpointing is Checkpointing.NONE:
        entering = (computed.activations_bytes - profile.output_logits_bytes - profile.head_bytes
                    - profile.block_tail_bytes + logits_kept)
        entering_temporaries = profile.block_backward_start_transient_bytes
    else:
        entering = (profile.embedding_bytes + profile.checkpoint_mask_bytes
                    + shape.num_layers * profile.checkpoint_input_bytes + profile.per_layer_bytes + logits_kept)
        entering_temporaries = profile.block_entry_transient_bytes
    backward_start = DevicePhase(Phase.BACKWARD,
                                 own + kept_after_forward + (0 if keeps_all else sum(units.resharded[-2:])),
                                 early_gradients + 2 * units.tail, shard_state, entering, entering_temporaries, 0)
    candidates = [backward_peak, backward_end, backward_start]
    if keeps_all:
        # Shard grad op keeps every unit gathered into backward, so the head's backward, with
        # the forward's activations still alive (an upper bound on them), can be the peak.
        candidates.append(DevicePhase(Phase.BACKWARD, own + kept_after_forward, early_gradients + 2 * units.tail,
                                      shard_state, forward.activations, forward.temporaries, 0))
    phases = (forward_phase, max(candidates, key=lambda p: p.total), optimizer_phase)
    gathers = len(units.resharded) + units.kept_calls
    regathers = 0 if keeps_all else len(units.resharded)
    collective("all_gather", "parameters", accumulation * (gathers + regathers),
               accumulation * (everything + (0 if keeps_all else sum(units.resharded))))
    collective("reduce_scatter", "gradients", accumulation * gathers, accumulation * everything)
    return ParallelEstimate(base, plan, phases, placement, (), largest, tuple(collectives), payload)


def _with(phase: PhaseMemory | DevicePhase, **changes) -> DevicePhase:
    values = {"phase": phase.phase, "weights": phase.weights, "gradients": phase.gradients,
              "optimizer_state": phase.optimizer_state, "activations": phase.activations,
              "temporaries": phase.temporaries, "communication_buffers": 0}
    values.update(changes)
    return DevicePhase(**values)
