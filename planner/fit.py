"""What fits a GPU, searched on the analytic planner (never by trial runs):
- the largest batch size and sequence length of one scenario (doubling until the peak
  exceeds the capacity, then bisection), which the Plan page and the report show;
- the fit finder (`find_fits`): every technique combination the product knows
  (optimizer, precision, checkpointing, accumulation, strategy), each one's largest
  micro-batch, those that reach a target, ranked by estimated step time (planner.step_time).

Peak memory grows monotonically with batch size and with sequence length (every category
is a non-decreasing function of both), which is what makes bisection exact. Estimates
take tens of microseconds, so a search (about 2·log2(limit) estimates) is instant, and
the whole finder for a 7B model answers in milliseconds (benchmarks/fit_speed.py).

FIT_ERROR_MARGIN is the planner's stated error on a peak: within it, a measured peak
may differ from the estimate (benchmarks/accuracy.py checks 2%; 3% leaves room for
shapes not benchmarked). The finder reports the largest batch whose *estimate* fits, so
the measured peak at the next batch up is above the capacity less this margin (it is not
wasteful by more than the margin), and tests/test_fit.py checks the reported batch against
simulated (fake-tensor) runs.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

from planner.errors import PlannerInputError
from planner.estimate import estimate
from planner.gpus import GpuSpec
from planner.model_shape import ModelShape
from planner.parallel import parallel_estimate
from planner.strategy import ParallelPlan, Strategy
from planner.scenario import Checkpointing, Optimizer, Precision, Scenario
from planner.step_time import DEFAULT_UTILISATION, StepTime, step_time

FIT_ERROR_MARGIN = 0.03  # the planner's stated error on a peak, as a fraction of it (see above)

BATCH_SEARCH_LIMIT = 1 << 20  # sequences per micro-batch; a bound, not a recommendation
SEQ_SEARCH_LIMIT = 1 << 20  # tokens, for models without a position limit (rotary, ALiBi)


def largest_fitting(peak_for: Callable[[int], int | None], capacity_bytes: int, limit: int,
                    known_fit: int = 1) -> int | None:
    """Largest n in [1, limit] with peak_for(n) <= capacity_bytes, assuming the peak is
    non-decreasing in n; None when even n = 1 does not fit. peak_for may answer None for
    an n the model cannot take (treated as not fitting). `known_fit`: an n the caller
    knows fits (the doubling starts there, saving its first probes)."""

    def fits(n: int) -> bool:
        peak = peak_for(n)
        return peak is not None and peak <= capacity_bytes

    if known_fit > 1:
        good = min(known_fit, limit)
    elif limit < 1 or not fits(1):
        return None
    else:
        good = 1
    bad = None
    while bad is None:  # doubling: good fits, probe 2·good
        probe = min(2 * good, limit)
        if probe == good:
            return good
        if fits(probe):
            good = probe
        else:
            bad = probe
    while bad - good > 1:  # invariant: good fits, bad does not
        middle = (good + bad) // 2
        if fits(middle):
            good = middle
        else:
            bad = middle
    return good


def per_device_peak(shape: ModelShape, scenario: Scenario, plan: ParallelPlan | None = None) -> int:
    """One device's peak: the single-device estimate, or under `plan` (DDP's buckets, shards)."""
    if plan is None or not plan.distributed:
        return estimate(shape, scenario).peak_bytes
    return parallel_estimate(shape, scenario, plan).per_device_peak_bytes


def _peak_or_none(shape: ModelShape, scenario: Scenario, plan: ParallelPlan | None = None) -> int | None:
    try:
        return per_device_peak(shape, scenario, plan)
    except PlannerInputError:  # e.g. a sequence longer than the model's positions
        return None


def max_batch_size(shape: ModelShape, scenario: Scenario, capacity_bytes: int,
                   limit: int = BATCH_SEARCH_LIMIT, plan: ParallelPlan | None = None) -> int | None:
    """Largest micro-batch (sequences) of `scenario` that fits; None when batch 1 does not."""
    return largest_fitting(lambda b: _peak_or_none(shape, dataclasses.replace(scenario, batch_size=b), plan),
                           capacity_bytes, limit)


def max_seq_len(shape: ModelShape, scenario: Scenario, capacity_bytes: int,
                limit: int = SEQ_SEARCH_LIMIT, known_fit: int = 1, plan: ParallelPlan | None = None) -> int | None:
    """Largest sequence length (tokens) of `scenario` that fits, capped by the model's
    positions; None when one token does not."""
    if shape.max_positions is not None:
        limit = min(limit, shape.max_positions)
    return largest_fitting(lambda s: _peak_or_none(shape, dataclasses.replace(scenario, seq_len=s), plan),
                           capacity_bytes, limit, known_fit)


@dataclasses.dataclass(frozen=True)
class FitLimits:
    batch_size: int | None  # at the scenario's sequence length
    seq_len: int | None  # at the scenario's batch size
    seq_len_capped_by_positions: bool  # the model's positions, not memory, stopped the search


def fit_limits(shape: ModelShape, scenario: Scenario, capacity_bytes: int,
               plan: ParallelPlan | None = None) -> FitLimits:
    """Largest batch and sequence on one device, or per GPU under `plan`."""
    seq = max_seq_len(shape, scenario, capacity_bytes, plan=plan)
    capped = seq is not None and shape.max_positions is not None and seq == shape.max_positions
    return FitLimits(max_batch_size(shape, scenario, capacity_bytes, plan=plan), seq, capped)


# --- The fit finder -------------------------------------------------------------------

# The combinations searched. Adam, the other 8-bit variants and torch's Adafactor hold
# the same memory as one of these (or more) at the same cost, so they add rows, not choices.
SEARCH_OPTIMIZERS = (Optimizer.ADAMW, Optimizer.ADAMW8BIT, Optimizer.HF_ADAFACTOR, Optimizer.SGD)
SEARCH_PRECISIONS = (Precision.FP32, Precision.BF16_MIXED, Precision.BF16)
# A GPU without bf16 tensor cores (Turing) trains 16-bit as fp16 autocast with fp32 masters
# and a loss scaler; pure fp16 training is not offered (it diverges without fp32 masters).
SEARCH_PRECISIONS_WITHOUT_BF16 = (Precision.FP32, Precision.FP16_MIXED)


def search_precisions(gpu: GpuSpec) -> tuple[Precision, ...]:
    """The precisions worth ranking on `gpu`: never one its tensor cores lack."""
    return SEARCH_PRECISIONS if gpu.supports_bf16 else SEARCH_PRECISIONS_WITHOUT_BF16
SEARCH_CHECKPOINTING = (Checkpointing.NONE, Checkpointing.EVERY_LAYER)
# With several GPUs: data parallel, and the sharded strategies that change what fits.
# ZeRO-3 is left out: the planner models it as FSDP full shard (same memory and traffic).
SEARCH_STRATEGIES = (Strategy.DDP, Strategy.ZERO1, Strategy.ZERO2, Strategy.FSDP_SHARD_GRAD_OP,
                     Strategy.FSDP_FULL_SHARD)
SHARDING_NOTE = ("several GPUs: DDP (a full replica plus DDP's gradient buckets per GPU), DeepSpeed ZeRO-1/2 "
                 "and FSDP (shard grad op, full shard) are searched; ZeRO-3 holds what FSDP full shard holds. "
                 "ZeRO is estimated only: `runners verify --num-processes N` measures DDP and FSDP")


@dataclasses.dataclass(frozen=True)
class FitTarget:
    """What the job needs. At most one of batch_size / effective_batch; neither means
    "as large a batch as fits", ranked by throughput instead of step time."""

    seq_len: int  # tokens per sequence
    batch_size: int | None = None  # sequences per micro-batch per GPU, no accumulation
    effective_batch: int | None = None  # sequences per optimizer step, all GPUs together

    def __post_init__(self) -> None:
        for name in ("seq_len", "batch_size", "effective_batch"):
            value = getattr(self, name)
            if value is None and name != "seq_len":
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise PlannerInputError(f"{name.replace('_', ' ')} must be a positive integer, got {value!r}")
        if self.batch_size is not None and self.effective_batch is not None:
            raise PlannerInputError("give a batch size or an effective batch, not both")


@dataclasses.dataclass(frozen=True)
class FitOption:
    """One combination that reaches the target: the plan (per GPU) and what it costs."""

    scenario: Scenario  # micro-batch, accumulation and techniques, per GPU
    strategy: Strategy
    num_devices: int
    max_batch_size: int  # largest micro-batch at this seq_len and accumulation
    max_seq_len: int | None  # largest sequence at this micro-batch (None: not searched)
    peak_bytes: int  # estimated, at the plan
    peak_phase: str
    step: StepTime

    @property
    def effective_batch(self) -> int:
        return self.scenario.batch_size * self.scenario.grad_accum_steps * self.num_devices

    @property
    def step_time_s(self) -> float:
        return self.step.total_s

    @property
    def seconds_per_sequence(self) -> float:
        return self.step.total_s / self.effective_batch

    def to_json(self) -> dict:
        s = self.scenario
        return {
            "optimizer": s.optimizer.value, "precision": s.precision.value,
            "gradient_checkpointing": s.checkpointing is Checkpointing.EVERY_LAYER,
            "grad_accum": s.grad_accum_steps, "strategy": self.strategy.value, "num_devices": self.num_devices,
            "batch_size": s.batch_size, "seq_len": s.seq_len, "effective_batch": self.effective_batch,
            "max_batch_size": self.max_batch_size, "max_seq_len": self.max_seq_len,
            "peak_bytes": self.peak_bytes, "peak_phase": self.peak_phase,
            "step_time_s": self.step.total_s, "compute_s": self.step.compute_s,
            "optimizer_step_s": self.step.optimizer_s, "communication_s": self.step.communication_s,
            "tokens_per_s": self.effective_batch * s.seq_len / self.step.total_s,
        }


@dataclasses.dataclass(frozen=True)
class FitResult:
    options: tuple[FitOption, ...]  # those that reach the target, best first
    combinations: int  # technique combinations tried
    capacity_bytes: int
    gpu: GpuSpec  # whose throughput the step times assume
    num_devices: int
    target: FitTarget
    utilisation: float
    ranked_by: str  # "step time" or "time per sequence"
    notes: tuple[str, ...]


def _accumulation_choices(per_device_batch: int) -> list[int]:
    """Powers of two dividing the per-GPU batch: 1, 2, 4, ..."""
    choices, k = [], 1
    while per_device_batch % k == 0 and k <= per_device_batch:
        choices.append(k)
        k *= 2
    return choices


def find_fits(shape: ModelShape, base: Scenario, capacity_bytes: int, target: FitTarget, gpu: GpuSpec,
              num_devices: int = 1, utilisation: float = DEFAULT_UTILISATION,
              with_max_seq_len: bool = True) -> FitResult:
    """Every technique combination that fits `capacity_bytes` per GPU and reaches `target`,
    ranked by estimated step time at the target (time per sequence when no batch is
    targeted), best first. `base` gives what is not searched: task, labels, attention,
    device kind, training loop. Peaks are the planner's (planner.estimate)."""
    if isinstance(num_devices, bool) or not isinstance(num_devices, int) or num_devices < 1:
        raise PlannerInputError(f"number of devices must be a positive integer, got {num_devices!r}")
    if capacity_bytes <= 0:
        raise PlannerInputError(f"GPU capacity must be positive, got {capacity_bytes!r} bytes")
    if target.effective_batch is not None:
        if target.effective_batch % num_devices:
            raise PlannerInputError(f"effective batch {target.effective_batch} is not divisible by "
                                    f"{num_devices} GPUs: give a multiple of {num_devices}")
        per_device = target.effective_batch // num_devices
        accumulations = _accumulation_choices(per_device)
    else:
        per_device = target.batch_size  # None: as large as fits
        accumulations = [1]
    strategies = (Strategy.SINGLE,) if num_devices == 1 else SEARCH_STRATEGIES
    base = dataclasses.replace(base, seq_len=target.seq_len, batch_size=1, grad_accum_steps=1)

    # The peak depends on accumulation only through "is there more than one micro-batch"
    # (gradients live across them), so one search serves K = 2, 4, 8, ...
    largest: dict[tuple, int | None] = {}
    options, combinations = [], 0
    for strategy in strategies:
        parallel = ParallelPlan(num_devices, strategy)
        for optimizer in SEARCH_OPTIMIZERS:
            for precision in search_precisions(gpu):
                for checkpointing in SEARCH_CHECKPOINTING:
                    for k in accumulations:
                        combinations += 1
                        combo = dataclasses.replace(base, optimizer=optimizer, precision=precision,
                                                    checkpointing=checkpointing, grad_accum_steps=min(k, 2))
                        key = (strategy, optimizer, precision, checkpointing, min(k, 2))
                        if key not in largest:
                            largest[key] = max_batch_size(shape, combo, capacity_bytes, plan=parallel)
                        best = largest[key]
                        micro = per_device // k if per_device is not None else best
                        if best is None or micro > best:
                            continue
                        plan = dataclasses.replace(combo, batch_size=micro, grad_accum_steps=k)
                        result = parallel_estimate(shape, plan, parallel)
                        seq = (max_seq_len(shape, plan, capacity_bytes, known_fit=plan.seq_len, plan=parallel)
                               if with_max_seq_len else None)
                        timing = step_time(shape, plan, gpu, num_devices, utilisation,
                                           result if parallel.distributed else None)
                        options.append(FitOption(plan, strategy, num_devices, best, seq,
                                                 result.per_device_peak_bytes, result.peak.phase.value, timing))
    by_sequence = target.batch_size is None and target.effective_batch is None
    options.sort(key=lambda o: (o.seconds_per_sequence if by_sequence else o.step_time_s, o.peak_bytes))
    notes = [f"step times assume {gpu.label} throughput at {utilisation:.0%} utilisation (planner.step_time)"]
    if gpu.supports_bf16:
        notes.append("pure bf16 keeps no fp32 master weights: updates smaller than bf16's resolution are lost; "
                     "bf16-mixed is the safe choice when accuracy matters")
    else:
        notes.append(f"{gpu.label} has no bf16 tensor cores: 16-bit plans are fp16-mixed (autocast with fp32 "
                     "masters and a loss scaler)")
    if num_devices > 1:
        notes.append(SHARDING_NOTE)
    return FitResult(tuple(options), combinations, capacity_bytes, gpu, num_devices, target, utilisation,
                     "time per sequence" if by_sequence else "step time", tuple(notes))


def best_options_with_max_seq_len(shape: ModelShape, result: FitResult, count: int) -> FitResult:
    """`result` cut to its `count` best options, each with its largest sequence searched:
    what a report lists, without searching sequences for the options it leaves out (on CPU
    kernels each search probes new sequence lengths, seconds per option)."""
    best = tuple(dataclasses.replace(option, max_seq_len=max_seq_len(
        shape, option.scenario, result.capacity_bytes, known_fit=option.scenario.seq_len,
        plan=ParallelPlan(option.num_devices, option.strategy))) for option in result.options[:count])
    return dataclasses.replace(result, options=best)


def micro_batch_bound(result: FitResult) -> tuple[int, int] | None:
    """(micro-batches the target splits into at most, sequences in each) when the target's
    batch per GPU is what stops every plan, None when no batch is targeted."""
    target = result.target
    if target.effective_batch is not None:
        per_device = target.effective_batch // result.num_devices
        splits = _accumulation_choices(per_device)[-1]
        return splits, per_device // splits
    if target.batch_size is not None:
        return 1, target.batch_size
    return None


def smallest_plan(shape: ModelShape, base: Scenario, seq_len: int,
                  num_devices: int = 1, gpu: GpuSpec | None = None) -> tuple[int, Scenario, Strategy]:
    """The searched combination (and strategy, with several GPUs) with the lowest per-GPU
    peak at one sequence per micro-batch: how far from fitting a job is when nothing fits.
    With `gpu`, only the precisions it supports."""
    base = dataclasses.replace(base, seq_len=seq_len, batch_size=1, grad_accum_steps=1)
    precisions = SEARCH_PRECISIONS if gpu is None else search_precisions(gpu)
    plans = [dataclasses.replace(base, optimizer=o, precision=p, checkpointing=c)
             for o in SEARCH_OPTIMIZERS for p in precisions for c in SEARCH_CHECKPOINTING]
    strategies = (Strategy.SINGLE,) if num_devices == 1 else SEARCH_STRATEGIES
    return min(((per_device_peak(shape, plan, ParallelPlan(num_devices, strategy)), plan, strategy)
                for plan in plans for strategy in strategies), key=lambda found: found[0])
