"""What fits a GPU, searched on the analytic planner (never by trial runs):
- the largest batch size and sequence length of one scenario (doubling until the peak
  exceeds the capacity, then bisection), which the Plan page and the report show;
- the fit finder (`find_fits`): every technique combination the product knows
  (fine-tuning method, optimizer, precision, checkpointing, accumulation, strategy), each
  one's largest micro-batch, those that reach a target, ranked by the fewest and safest
  changes to the user's own plan first and estimated step time (planner.step_time) second;
  when nothing fits, the nearest plans and by how much each misses.

The ranking. Each difference between the user's plan and a candidate is a Change with a
cost class (Cost), and candidates are ordered by how many changes of each class they
make, the costliest class compared first, then by step time (time per sequence when no
batch is targeted), then by peak:
  0. none: the user's own plan, when it fits, is first. Hugging Face's "Methods and tools
     for efficient training on a single GPU" (transformers docs, perf_train_gpu_one): "if
     the preferred batch size fits into memory, there's no reason to apply
     memory-optimizing techniques because they can slow down the training".
  1. KEEPS_MATHS: memory techniques that leave the updates as they were: gradient
     checkpointing (recomputes the same activations; torch.utils.checkpoint restores the
     RNG state for dropout), another micro-batch x accumulation split of the same effective
     batch, ZeRO / FSDP sharding instead of DDP (the same all-reduced gradients, the state
     split across GPUs). The same guide's table lists accumulation, checkpointing and
     DeepSpeed ZeRO as memory techniques; the course lessons (../shared/seeds/, lesson 3:
     checkpointing with accumulation) teach them so.
  2. SWAP: a documented optimizer or precision swap, other numerics for the same model:
     8-bit AdamW (Dettmers et al. 2022, "8-bit Optimizers via Block-wise Quantization":
     32-bit Adam's results), transformers' Adafactor (Shazeer & Stern 2018; the course's
     lesson 1, with its trade-off table against AdamW and 8-bit Adam), bf16 / fp16 autocast
     with fp32 master weights (Micikevicius et al. 2018, "Mixed Precision Training"; the
     course's lesson 2), and the way back to fp32 or AdamW.
  3. METHOD: another fine-tuning method, which trains other parameters (full <-> LoRA: Hu
     et al. 2022, on par with full fine-tuning on the tasks it reports, but not the same
     model). LoRA plans keep the rank, alpha and targets asked for (PEFT's defaults, r 16,
     for a full plan): the finder never proposes a lower rank.
  4. RISKY: changes that risk model quality, labelled (Risk) and left out unless the
     caller allows them: pure bf16 (no fp32 master weights: an update below half a bf16
     ulp of its weight is rounded away, Micikevicius et al. 2018 §3.1), and SGD for a
     transformer language model (Zhang et al. 2020, "Why are Adaptive Methods Good for
     Attention Models?": SGD trails Adam on attention models). A risky choice the user
     made themselves is their plan, not a change.
So one optimizer swap ranks below any number of changes that keep the maths, and
fewer changes of the same class rank above more.

LoRA and QLoRA plans are searched where planner.estimate plans them; where it refuses
the result says so in one line per method (`left_out`, the estimate's own reason), and
shows no numbers for them. LoRA plans are searched on one device (planner.parallel
models full fine-tuning), in the user's precision and, where the GPU has bf16, with the
frozen base in bf16 (LORA_BASE_PRECISION). That is a SWAP, not the pure-bf16 risk: PEFT
keeps the adapters, the only weights updated, in fp32 (`get_peft_model`'s
`autocast_adapter_dtype`: "only cast adapter weights using float16 and bfloat16 to
float32, as this is typically required for stable training"), so their gradients,
optimizer state and updates are fp32; it is how PEFT's and the QLoRA paper's examples
load a 7B base (Dettmers et al. 2023 compute in bf16 over a frozen base). Other
precisions are not searched for LoRA: each is one more probe of the PEFT-wrapped model
(seconds on first use), and bf16 autocast over an fp32 base holds more than either.

Peak memory grows monotonically with batch size and with sequence length (every category
is a non-decreasing function of both), which is what makes bisection exact. Estimates
take tens of microseconds, so a search (about 2·log2(limit) estimates) is instant. On
CUDA each answer is also tested by the caching allocator's replay (planner.device_fit),
about 0.15 s for a 7B step: the finder's first search of a 7B model replays a few
hundred plans, later ones are cached (benchmarks/fit_speed.py).

FIT_ERROR_MARGIN is the planner's stated error on a peak: within it, a measured peak
may differ from the estimate (benchmarks/accuracy.py checks 2%; 3% leaves room for
shapes not benchmarked). The finder reports the largest batch whose *estimate* fits, so
the measured peak at the next batch up is above the capacity less this margin (it is not
wasteful by more than the margin), and tests/test_fit.py checks the reported batch against
simulated (fake-tensor) runs.
"""

from __future__ import annotations

import dataclasses
import enum
import math
from collections.abc import Callable
from typing import NamedTuple

from planner.device_fit import FitsCheck
from planner.errors import PlannerInputError
from planner.estimate import estimate
from planner.finetune import FineTune, Method
from planner.gpus import GpuSpec
from planner.model_shape import ModelShape
from planner.parallel import parallel_estimate
from planner.scenario import Checkpointing, Optimizer, Precision, Scenario
from planner.step_time import DEFAULT_UTILISATION, StepTime, step_time
from planner.strategy import ParallelPlan, Strategy

FIT_ERROR_MARGIN = 0.03  # the planner's stated error on a peak, as a fraction of it (see above)

BATCH_SEARCH_LIMIT = 1 << 20  # sequences per micro-batch; a bound, not a recommendation
SEQ_SEARCH_LIMIT = 1 << 20  # tokens, for models without a position limit (rotary, ALiBi)


def largest_fitting(peak_for: Callable[[int], int | None], capacity_bytes: int, limit: int,
                    known_fit: int = 1, passes: Callable[[int], object] | None = None) -> int | None:
    """Largest n in [1, limit] with peak_for(n) <= capacity_bytes, assuming the peak is
    non-decreasing in n; None when even n = 1 does not fit. peak_for may answer None for
    an n the model cannot take (treated as not fitting). `known_fit`: an n the caller
    knows fits, and passes `passes` (the doubling starts there, saving its first probes). `passes`: a further,
    costlier test an n must pass (the caching allocator replayed, planner.device_fit), made
    at the answer and, where it fails there, searched below it (`_largest_passing`). Its
    answer's truth value is the test's; where it also has `bytes` (planner.device_fit.Headroom:
    the room left, negative when short), those guide the search."""
    found = _largest_by_peak(peak_for, capacity_bytes, limit, known_fit)
    if found is None or passes is None or (found == known_fit > 1):
        return found  # (the caller's known fit passed both tests: not replayed again)
    at_found = passes(found)
    if at_found:
        return found
    # invariant: bad fails; good passes (0: none known; the caller's known fit passed both tests)
    good = known_fit if 1 < known_fit < found else 0
    return _largest_passing(peak_for, passes, good, found, _room(at_found)) or None


def _room(answer: object) -> int | None:
    return getattr(answer, "bytes", None)


def _largest_passing(peak_for: Callable[[int], int | None], passes: Callable[[int], object],
                     good: int, bad: int, bad_room: int | None) -> int:
    """An n in (good, bad) that passes `passes` while n + 1 fails (good passes, bad fails; 0
    when none passed yet), in few tests: each is a replay of the step, about 0.15 s for a
    7B model. Near the answer the replay's verdict need not be monotone (where the
    allocator starts releasing its cache, one more token can fit where the last did not):
    any such n is an answer, as it is bisection's."""
    if bad_room is None:
        return _stepping_down(passes, good, bad)
    return _regula_falsi(peak_for, passes, good, bad, bad_room)


def _stepping_down(passes: Callable[[int], object], good: int, bad: int) -> int:
    """Without rooms: the test fails only a little below the peak's answer where it fails
    (the caching allocator's rounding and fragmentation are a few percent of a peak): step
    down from it, doubling the step, then bisect what is left, log2 of the distance to the
    answer in tests where bisecting from the known fit took log2 of the whole range (7
    replays, 30 ms, for DistilBERT's largest batch on a T4: benchmarks/browser_speed.py)."""
    step = 1
    while bad - step > good:
        if passes(bad - step):
            good = bad - step
            break
        bad, step = bad - step, 2 * step
    return _bisected(passes, good, bad)


def _bisected(passes: Callable[[int], object], good: int, bad: int) -> int:
    while bad - good > 1:
        middle = (good + bad) // 2
        if passes(middle):
            good = middle
        else:
            bad = middle
    return good


def _regula_falsi(peak_for: Callable[[int], int | None], passes: Callable[[int], object],
                  good: int, bad: int, bad_room: int) -> int:
    """With rooms (bytes left, negative when short: planner.device_fit.Headroom). A failing
    replay's room is the shortfall of the request that ran out, which the whole step may
    exceed (planner.cuda_allocator, Headroom), so until a test passes the search steps down
    from the failing end by at least the distance that shortfall implies on the live peak's
    slope, doubling the step; then each test aims where the room crosses zero, on the line
    between the bracket's ends (regula falsi, with Illinois' halving of an end's room when
    that end is kept twice in a row, so that the aims do not creep from one side). A replay's
    room is close to linear in the batch or the sequence (the step's tensors are) but not
    exactly: which cached blocks it releases and reuses differs from one n to the next, by a
    few hundred MB on a 7B step. So the rooms only choose where to test, and after two aims
    in a row that do not halve the bracket the next test bisects it."""
    step = _implied_distance(peak_for, bad, bad_room)
    good_room: float | None = None  # None until a test passes (good is the caller's, its room unknown)
    kept, slow = 1, 0  # kept: 1 when the last test moved good, -1 when it moved bad
    while bad - good > 1:
        width = bad - good
        aimed = good_room is not None and slow < _SLOW_AIMS
        if good_room is None:
            n, step = bad - step, 2 * step
        elif aimed:
            n = int(good + (bad - good) * good_room / (good_room - bad_room))
        else:
            n, slow = (good + bad) // 2, 0
        n = min(max(n, good + 1), bad - 1)
        answer = passes(n)
        room = _room(answer)
        if room is None:  # no measure: bisect the rest
            return _bisected(passes, *((n, bad) if answer else (good, n)))
        if answer:
            if good_room is not None and kept == 1:  # Illinois: the failing end kept twice, its weight halves
                bad_room /= 2
            good, good_room, kept = n, room, 1
        else:
            if good_room is not None and kept == -1:
                good_room /= 2
            bad, bad_room, kept = n, room, -1
        if aimed:
            slow = slow + 1 if 2 * (bad - good) > width else 0
    return good


# Aims in a row that do not halve the bracket before one bisection: where the room jumps
# between two lengths (a tensor crossing into another segment size, or the allocator starting
# to release its cache) there is nothing to interpolate.
_SLOW_AIMS = 2


def _implied_distance(peak_for: Callable[[int], int | None], bad: int, shortfall: float) -> int:
    """How far below `bad` the live peak is lower by `shortfall` (bytes, negative), on the
    peak's slope at `bad` (the live peak is close to linear in the batch and the sequence);
    at least 1."""
    peak, below = peak_for(bad), peak_for(bad - 1) if bad > 1 else None
    if peak is None or below is None or peak <= below:
        return 1
    return max(1, math.ceil(-shortfall / (peak - below)))


def _largest_by_peak(peak_for: Callable[[int], int | None], capacity_bytes: int, limit: int,
                     known_fit: int) -> int | None:

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


def _passes_at(check: FitsCheck | None, shape: ModelShape, scenario: Scenario, field: str,
               plan: ParallelPlan | None) -> Callable[[int], bool] | None:
    if check is None:
        return None
    return lambda n: check(shape, dataclasses.replace(scenario, **{field: n}), plan)


def max_batch_size(shape: ModelShape, scenario: Scenario, capacity_bytes: int,
                   limit: int = BATCH_SEARCH_LIMIT, plan: ParallelPlan | None = None,
                   check: FitsCheck | None = None, known_fit: int = 1) -> int | None:
    """Largest micro-batch (sequences) of `scenario` whose peak fits `capacity_bytes` (the
    room for the step's tensors) and that passes `check` (planner.device_fit.reserved_check);
    None when batch 1 does not. `known_fit`: a batch the caller knows fits and passes (the
    search starts there, and never plans batch 1, its own probe class, when that is above 1)."""
    return largest_fitting(lambda b: _peak_or_none(shape, dataclasses.replace(scenario, batch_size=b), plan),
                           capacity_bytes, limit, known_fit, _passes_at(check, shape, scenario, "batch_size", plan))


def max_seq_len(shape: ModelShape, scenario: Scenario, capacity_bytes: int,
                limit: int = SEQ_SEARCH_LIMIT, known_fit: int = 1, plan: ParallelPlan | None = None,
                check: FitsCheck | None = None) -> int | None:
    """Largest sequence length (tokens) of `scenario` that fits, capped by the model's
    positions; None when one token does not."""
    if shape.max_positions is not None:
        limit = min(limit, shape.max_positions)
    return largest_fitting(lambda s: _peak_or_none(shape, dataclasses.replace(scenario, seq_len=s), plan),
                           capacity_bytes, limit, known_fit, _passes_at(check, shape, scenario, "seq_len", plan))


@dataclasses.dataclass(frozen=True)
class FitLimits:
    batch_size: int | None  # at the scenario's sequence length
    seq_len: int | None  # at the scenario's batch size
    seq_len_capped_by_positions: bool  # the model's positions, not memory, stopped the search


def fit_limits(shape: ModelShape, scenario: Scenario, capacity_bytes: int,
               plan: ParallelPlan | None = None, check: FitsCheck | None = None,
               scenario_fits: bool = False) -> FitLimits:
    """Largest batch and sequence on one device, or per GPU under `plan`. `scenario_fits`: the
    caller has found `scenario` itself to fit and pass `check` (both searches start from it)."""
    known_batch, known_seq = (scenario.batch_size, scenario.seq_len) if scenario_fits else (1, 1)
    return FitLimits(max_batch_size(shape, scenario, capacity_bytes, plan=plan, check=check, known_fit=known_batch),
                     *longest_sequence(shape, scenario, capacity_bytes, plan=plan, check=check, known_fit=known_seq))


def longest_sequence(shape: ModelShape, scenario: Scenario, capacity_bytes: int, plan: ParallelPlan | None = None,
                     check: FitsCheck | None = None, known_fit: int = 1) -> tuple[int | None, bool]:
    """(max_seq_len, whether the model's positions rather than memory stopped it): FitLimits'
    sequence fields."""
    seq = max_seq_len(shape, scenario, capacity_bytes, plan=plan, check=check, known_fit=known_fit)
    return seq, seq is not None and shape.max_positions is not None and seq == shape.max_positions


# --- The fit finder -------------------------------------------------------------------

# The combinations searched. Adam, the other 8-bit variants and torch's Adafactor hold
# the same memory as one of these (or more) at the same cost, so they add rows, not choices;
# the user's own optimizer is searched too, so their own plan is always a candidate.
SEARCH_OPTIMIZERS = (Optimizer.ADAMW, Optimizer.ADAMW8BIT, Optimizer.HF_ADAFACTOR, Optimizer.SGD)
SEARCH_PRECISIONS = (Precision.FP32, Precision.BF16_MIXED, Precision.BF16)
# A GPU without bf16 tensor cores (Turing) trains 16-bit as fp16 autocast with fp32 masters
# and a loss scaler; pure fp16 training is not offered (it diverges without fp32 masters).
SEARCH_PRECISIONS_WITHOUT_BF16 = (Precision.FP32, Precision.FP16_MIXED)
_BF16_KINDS = (Precision.BF16, Precision.BF16_MIXED)


def search_precisions(gpu: GpuSpec) -> tuple[Precision, ...]:
    """The precisions worth ranking on `gpu`: never one its tensor cores lack."""
    return SEARCH_PRECISIONS if gpu.supports_bf16 else SEARCH_PRECISIONS_WITHOUT_BF16


# LoRA / QLoRA: the frozen base in bf16, the adapters fp32 (PEFT), searched next to the user's precision.
LORA_BASE_PRECISION = Precision.BF16


def adapter_precisions(gpu: GpuSpec, own: Precision) -> tuple[Precision, ...]:
    """The precisions a LoRA / QLoRA plan is searched in: the user's, and a bf16 base where `gpu` has bf16."""
    return _with_own((LORA_BASE_PRECISION,) if gpu.supports_bf16 else (), own)


SEARCH_CHECKPOINTING = (Checkpointing.NONE, Checkpointing.EVERY_LAYER)
# With several GPUs: data parallel, and the sharded strategies that change what fits.
# ZeRO-3 is left out: the planner models it as FSDP full shard (same memory and traffic).
SEARCH_STRATEGIES = (Strategy.DDP, Strategy.ZERO1, Strategy.ZERO2, Strategy.FSDP_SHARD_GRAD_OP,
                     Strategy.FSDP_FULL_SHARD)
SHARDING_NOTE = ("several GPUs: DDP (a full replica plus DDP's gradient buckets per GPU), DeepSpeed ZeRO-1/2 "
                 "and FSDP (shard grad op, full shard) are searched; ZeRO-3 holds what FSDP full shard holds. "
                 "ZeRO is estimated only: `runners verify --num-processes N` measures DDP and FSDP")
NEAREST_SHOWN = 5  # plans listed when nothing fits, nearest first


class Cost(enum.IntEnum):
    """How much a change to the user's plan costs them (the module docstring says why), safest first."""

    KEEPS_MATHS = 1  # a memory technique: the same updates (checkpointing, accumulation, sharding)
    SWAP = 2  # a documented optimizer or precision swap: other numerics, the same model trained
    METHOD = 3  # another fine-tuning method: other parameters trained (full <-> LoRA)
    RISKY = 4  # risks model quality: left out unless allowed


COST_WORDS = {Cost.KEEPS_MATHS: "keeps the maths", Cost.SWAP: "documented swap",
              Cost.METHOD: "trains other parameters", Cost.RISKY: "risks model quality"}


class ChangeKind(enum.Enum):
    METHOD = "fine-tuning"
    OPTIMIZER = "optimizer"
    PRECISION = "precision"
    STRATEGY = "strategy"
    CHECKPOINTING = "checkpointing"
    SPLIT = "micro-batch x accumulation"


class Risk(enum.Enum):
    """Changes that risk model quality, in words (the module docstring gives the sources)."""

    PURE_BF16 = "pure bf16: no fp32 master weights, small updates are lost"
    SGD = "SGD for a language model: trails Adam-type optimizers"
    # No lower-rank risk: LoRA plans keep the rank asked for (16, PEFT's examples', for a full plan).


@dataclasses.dataclass(frozen=True)
class Change:
    """One difference between the user's plan and a proposed one."""

    kind: ChangeKind
    before: str
    after: str
    cost: Cost
    risk: Risk | None = None  # set exactly when cost is RISKY

    def __post_init__(self) -> None:
        if (self.risk is not None) != (self.cost is Cost.RISKY):
            raise ValueError("a change carries a risk exactly when its cost is RISKY")

    @property
    def text(self) -> str:
        return f"{self.kind.value} {self.before} -> {self.after}"


def _method_text(scenario: Scenario) -> str:
    method = scenario.finetune
    return method.method.value if not method.uses_adapters else f"{method.method.value} r{method.lora_r}"


def _ckpt_text(scenario: Scenario) -> str:
    return "on" if scenario.checkpointing is Checkpointing.EVERY_LAYER else "off"


def plan_changes(own: Scenario, own_strategy: Strategy, plan: Scenario, strategy: Strategy,
                 own_split: tuple[int, int] | None) -> tuple[Change, ...]:
    """The changes that turn the user's plan (`own` under `own_strategy`) into `plan` (a
    Scenario, or anything with its technique fields) under `strategy`, most costly first. `own_split`: the user's (micro-batch, accumulation) when
    the target keeps their effective batch (a different split is then a change), else None."""
    changes = []
    if _method_text(own) != _method_text(plan):
        changes.append(Change(ChangeKind.METHOD, _method_text(own), _method_text(plan), Cost.METHOD))
    if plan.optimizer is not own.optimizer:
        risky = plan.optimizer is Optimizer.SGD  # every model here is a transformer language model
        changes.append(Change(ChangeKind.OPTIMIZER, own.optimizer.value, plan.optimizer.value,
                              Cost.RISKY if risky else Cost.SWAP, Risk.SGD if risky else None))
    if plan.precision is not own.precision:
        adapters = plan.finetune.uses_adapters
        # Pure bf16 risks quality only where the trained weights are bf16: LoRA's adapters stay fp32.
        risky = plan.precision is Precision.BF16 and not adapters
        after = f"{plan.precision.value} frozen base (adapters fp32)" if adapters else plan.precision.value
        changes.append(Change(ChangeKind.PRECISION, own.precision.value, after,
                              Cost.RISKY if risky else Cost.SWAP, Risk.PURE_BF16 if risky else None))
    if strategy is not own_strategy:
        changes.append(Change(ChangeKind.STRATEGY, own_strategy.value, strategy.value, Cost.KEEPS_MATHS))
    if plan.checkpointing is not own.checkpointing:
        changes.append(Change(ChangeKind.CHECKPOINTING, _ckpt_text(own), _ckpt_text(plan), Cost.KEEPS_MATHS))
    split = (plan.batch_size, plan.grad_accum_steps)
    if own_split is not None and split != own_split:
        changes.append(Change(ChangeKind.SPLIT, "{} x {}".format(*own_split), "{} x {}".format(*split),
                              Cost.KEEPS_MATHS))
    return tuple(sorted(changes, key=lambda c: -c.cost))


def change_rank(changes: tuple[Change, ...]) -> tuple[int, ...]:
    """The ranking's first key: how many changes of each cost, the costliest counted first
    (one optimizer swap ranks below any number of changes that keep the maths)."""
    return tuple(sum(1 for c in changes if c.cost is cost) for cost in sorted(Cost, reverse=True))


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


def _changes_json(changes: tuple[Change, ...]) -> dict:
    return {"changes": [c.text for c in changes], "change_costs": [COST_WORDS[c.cost] for c in changes],
            "risks": [c.risk.value for c in changes if c.risk is not None]}


@dataclasses.dataclass(frozen=True)
class FitOption:
    """One combination that reaches the target: the plan (per GPU), what it costs, and what
    it changes in the user's plan."""

    scenario: Scenario  # micro-batch, accumulation and techniques, per GPU
    strategy: Strategy
    num_devices: int
    max_batch_size: int  # largest micro-batch at this seq_len and accumulation
    max_seq_len: int | None  # largest sequence at this micro-batch (None: not searched)
    peak_bytes: int  # estimated, at the plan
    peak_phase: str
    step: StepTime
    changes: tuple[Change, ...] = ()  # from the user's plan, costliest first

    @property
    def effective_batch(self) -> int:
        return self.scenario.batch_size * self.scenario.grad_accum_steps * self.num_devices

    @property
    def step_time_s(self) -> float:
        return self.step.total_s

    @property
    def seconds_per_sequence(self) -> float:
        return self.step.total_s / self.effective_batch

    @property
    def risks(self) -> tuple[Risk, ...]:
        return tuple(c.risk for c in self.changes if c.risk is not None)

    def to_json(self) -> dict:
        s = self.scenario
        return {
            "finetune": _method_text(s),
            "optimizer": s.optimizer.value, "precision": s.precision.value,
            "gradient_checkpointing": s.checkpointing is Checkpointing.EVERY_LAYER,
            "grad_accum": s.grad_accum_steps, "strategy": self.strategy.value, "num_devices": self.num_devices,
            "batch_size": s.batch_size, "seq_len": s.seq_len, "effective_batch": self.effective_batch,
            "max_batch_size": self.max_batch_size, "max_seq_len": self.max_seq_len,
            "peak_bytes": self.peak_bytes, "peak_phase": self.peak_phase,
            "step_time_s": self.step.total_s, "compute_s": self.step.compute_s,
            "optimizer_step_s": self.step.optimizer_s, "communication_s": self.step.communication_s,
            "tokens_per_s": self.effective_batch * s.seq_len / self.step.total_s,
            **_changes_json(self.changes),
        }


@dataclasses.dataclass(frozen=True)
class NearMiss:
    """A plan that does not fit, when nothing does: its per-GPU peak at the target's smallest
    micro-batch for its combination, and how far over the capacity that is."""

    scenario: Scenario
    strategy: Strategy
    num_devices: int
    peak_bytes: int
    capacity_bytes: int
    changes: tuple[Change, ...]

    @property
    def over_bytes(self) -> int:
        return self.peak_bytes - self.capacity_bytes

    @property
    def over_pct(self) -> float:
        return 100.0 * self.over_bytes / self.capacity_bytes

    @property
    def risks(self) -> tuple[Risk, ...]:
        return tuple(c.risk for c in self.changes if c.risk is not None)

    def to_json(self) -> dict:
        s = self.scenario
        return {"finetune": _method_text(s), "optimizer": s.optimizer.value, "precision": s.precision.value,
                "gradient_checkpointing": s.checkpointing is Checkpointing.EVERY_LAYER,
                "grad_accum": s.grad_accum_steps, "strategy": self.strategy.value, "num_devices": self.num_devices,
                "batch_size": s.batch_size, "seq_len": s.seq_len, "peak_bytes": self.peak_bytes,
                "capacity_bytes": self.capacity_bytes, "over_bytes": self.over_bytes, "over_pct": self.over_pct,
                **_changes_json(self.changes)}


@dataclasses.dataclass(frozen=True)
class FitResult:
    options: tuple[FitOption, ...]  # those that reach the target, best first
    combinations: int  # technique combinations considered (the risky ones left out included)
    capacity_bytes: int  # per GPU for the user's own strategy (less its CUDA overheads with `room_for`)
    gpu: GpuSpec  # whose throughput the step times assume
    num_devices: int
    target: FitTarget
    utilisation: float
    ranked_by: str  # "fewest and safest changes, then step time" (or "... time per sequence")
    notes: tuple[str, ...]
    allow_risky: bool = False
    risky_left_out: int = 0  # combinations not searched: they risk model quality and were not allowed
    nearest: tuple[NearMiss, ...] = ()  # when nothing fits: the nearest plans, nearest first
    left_out: tuple[str, ...] = ()  # fine-tuning methods not searched, each with the estimate's reason
    rooms: tuple[tuple[Strategy, int], ...] = ()  # per strategy searched: bytes its tensors may take per GPU

    def room_bytes(self, strategy: Strategy) -> int:
        return dict(self.rooms).get(strategy, self.capacity_bytes)


def _accumulation_choices(per_device_batch: int) -> list[int]:
    """Powers of two dividing the per-GPU batch: 1, 2, 4, ..."""
    choices, k = [], 1
    while per_device_batch % k == 0 and k <= per_device_batch:
        choices.append(k)
        k *= 2
    return choices


def _with_own(searched: tuple, own) -> tuple:
    return searched if own in searched else (*searched, own)


def _adapter_methods(shape: ModelShape, base: Scenario, num_devices: int, lora: bool) -> tuple[list, list[str]]:
    """(the adapter FineTunes to search, one line per method left out and why). The reason is
    the estimate's own refusal, so the finder never shows numbers the estimate would not."""
    own = base.finetune
    methods, left_out = [], []
    for method, label in ((Method.LORA, "LoRA"), (Method.QLORA, "QLoRA")):
        # The rank, alpha and targets asked for (never a lower rank); defaults for a full plan.
        wanted = dataclasses.replace(own if own.uses_adapters else FineTune(), method=method)
        if not lora and method is not own.method:
            continue
        if num_devices > 1:  # before estimating: a model's first LoRA estimate probes its step
            left_out.append(f"{label} plans left out: the multi-GPU planner models full fine-tuning only "
                            "(plan LoRA on one device)")
            continue
        try:
            estimate(shape, dataclasses.replace(base, finetune=wanted, batch_size=1, grad_accum_steps=1))
        except PlannerInputError as error:
            left_out.append(f"{label} plans left out: {error}")
            continue
        except Exception as error:  # noqa: BLE001 - a bug in building the adapters must not cost the full plans
            # Seen: PEFT refusing all-linear on DistilBERT's classifier (modules_to_save, a TypeError).
            left_out.append(f"{label} plans left out: the estimate failed ({type(error).__name__}: "
                            f"{str(error)[:200]})")
            continue
        methods.append(wanted)
    return methods, left_out


def find_fits(shape: ModelShape, base: Scenario, capacity_bytes: int, target: FitTarget, gpu: GpuSpec,
              num_devices: int = 1, utilisation: float = DEFAULT_UTILISATION,
              with_max_seq_len: bool = True, allow_risky: bool = False, strategy: Strategy | None = None,
              lora: bool = True, room_for: Callable[[ParallelPlan], int] | None = None,
              check: FitsCheck | None = None,
              progress: Callable[[int, int], None] | None = None) -> FitResult:
    """Every technique combination that fits `capacity_bytes` per GPU and reaches `target`,
    ranked by the fewest and safest changes to the user's plan (`base`, under `strategy`,
    DDP by default with several GPUs), then by estimated step time at the target (time per
    sequence when no batch is targeted), best first. Changes that risk model quality (pure
    bf16, SGD) are left out unless `allow_risky`. LoRA / QLoRA plans are searched where the
    estimate plans them (`lora=False`: full fine-tuning and the user's own method only).
    When nothing fits, `nearest` lists the plans that miss by least. `base` also gives what
    is not searched: task, labels, attention, device kind, training loop. `room_for(plan)`:
    what the step's tensors may take per GPU under each strategy, when less than the
    capacity (planner.verdict: CUDA overheads, NCCL communicators per strategy); `check`: the
    verdict's further test of a plan (planner.device_fit.reserved_check: the caching
    allocator replayed); `progress(done, total)`: told after each combination (a 7B model's
    first search on CUDA replays for a minute or more), `total` being `combinations`."""
    if isinstance(num_devices, bool) or not isinstance(num_devices, int) or num_devices < 1:
        raise PlannerInputError(f"number of devices must be a positive integer, got {num_devices!r}")
    if capacity_bytes <= 0:
        raise PlannerInputError(f"GPU capacity must be positive, got {capacity_bytes!r} bytes")
    own_split = None
    if target.effective_batch is not None:
        if target.effective_batch % num_devices:
            raise PlannerInputError(f"effective batch {target.effective_batch} is not divisible by "
                                    f"{num_devices} GPUs: give a multiple of {num_devices}")
        per_device = target.effective_batch // num_devices
        accumulations = _accumulation_choices(per_device)
        # The user's own split when it makes this batch, else the whole batch in one micro-batch.
        own_split = ((base.batch_size, base.grad_accum_steps)
                     if base.batch_size * base.grad_accum_steps == per_device else (per_device, 1))
        if own_split[1] not in accumulations:
            accumulations.append(own_split[1])
    else:
        per_device = target.batch_size  # None: as large as fits
        accumulations = [1]
    own_strategy = Strategy.SINGLE if num_devices == 1 else (strategy or Strategy.DDP)
    strategies = (Strategy.SINGLE,) if num_devices == 1 else _with_own(SEARCH_STRATEGIES, own_strategy)
    own = base
    base = dataclasses.replace(base, seq_len=target.seq_len, batch_size=1, grad_accum_steps=1)
    optimizers = _with_own(SEARCH_OPTIMIZERS, own.optimizer)
    precisions = search_precisions(gpu)
    if gpu.supports_bf16 or own.precision not in _BF16_KINDS:
        precisions = _with_own(precisions, own.precision)
    adapters, left_out = _adapter_methods(shape, base, num_devices, lora)
    lora_precisions = adapter_precisions(gpu, own.precision)
    finetunes = ([FineTune()] if own.finetune.uses_adapters else [own.finetune]) + adapters

    # The peak depends on accumulation only through "is there more than one micro-batch"
    # (gradients live across them), so one search serves K = 2, 4, 8, ...
    largest: dict[tuple, int | None] = {}
    options, misses, combinations, risky_left_out = [], {}, 0, 0
    rooms = {s: room_for(ParallelPlan(num_devices, s)) if room_for is not None else capacity_bytes
             for s in strategies}
    per_strategy = len(optimizers) * len(SEARCH_CHECKPOINTING) * len(accumulations) * sum(
        len(precisions if finetune.method is Method.FULL else lora_precisions) for finetune in finetunes)
    total = per_strategy * sum(room > 0 for room in rooms.values())
    for plan_strategy in strategies:
        parallel = ParallelPlan(num_devices, plan_strategy)
        room = rooms[plan_strategy]
        if room <= 0:  # this strategy's overheads alone fill the GPU: no plan of it fits or comes near
            continue
        for finetune in finetunes:
            for optimizer in optimizers:
                # LoRA in the user's precision and with a bf16 base only: each precision is one
                # more probe of the PEFT-wrapped model (seconds on first use).
                for precision in (precisions if finetune.method is Method.FULL else lora_precisions):
                    for checkpointing in SEARCH_CHECKPOINTING:
                        for k in accumulations:
                            if progress is not None:
                                progress(combinations, total)
                            combinations += 1
                            micro = per_device // k if per_device is not None else None
                            # Fields only (no Scenario built) until the combination is searched.
                            probe = _Combo(finetune, optimizer, precision, checkpointing, micro or 1, k)
                            changes = plan_changes(own, own_strategy, probe, plan_strategy, own_split)
                            if not allow_risky and any(c.risk is not None for c in changes):
                                risky_left_out += 1
                                continue
                            key = (plan_strategy, finetune, optimizer, precision, checkpointing, min(k, 2))
                            if key not in largest:
                                combo = probe.scenario(base, batch_size=1, grad_accum_steps=min(k, 2))
                                largest[key] = max_batch_size(shape, combo, room, plan=parallel, check=check)
                            best = largest[key]
                            if best is None or (micro is not None and micro > best):
                                misses.setdefault(key[:5], []).append((probe, changes))
                                continue
                            micro = best if micro is None else micro
                            plan = probe.scenario(base, batch_size=micro)
                            if per_device is None:  # the largest batch: its micro-batch is found, not asked for
                                changes = plan_changes(own, own_strategy, plan, plan_strategy, own_split)
                            result = parallel_estimate(shape, plan, parallel)
                            seq = (max_seq_len(shape, plan, room, known_fit=plan.seq_len,
                                               plan=parallel, check=check) if with_max_seq_len else None)
                            timing = step_time(shape, plan, gpu, num_devices, utilisation,
                                               result if parallel.distributed else None,
                                               result.base.trainable_parameters)
                            options.append(FitOption(plan, plan_strategy, num_devices, best, seq,
                                                     result.per_device_peak_bytes, result.peak.phase.value,
                                                     timing, changes))
    if progress is not None:
        progress(combinations, total)
    by_sequence = target.batch_size is None and target.effective_batch is None
    options.sort(key=lambda o: (change_rank(o.changes), o.seconds_per_sequence if by_sequence else o.step_time_s,
                                o.peak_bytes))
    nearest = () if options else _nearest(shape, base, misses, rooms, num_devices)
    notes = [f"step times assume {gpu.label} throughput at {utilisation:.0%} utilisation (planner.step_time)"]
    if risky_left_out:
        notes.append(f"{risky_left_out} combinations left out: they change the plan in ways that risk model "
                     "quality (pure bf16 without fp32 master weights, SGD for a language model); allow them "
                     "to see them")
    elif gpu.supports_bf16:
        notes.append("pure bf16 keeps no fp32 master weights: updates smaller than bf16's resolution are lost; "
                     "bf16-mixed is the safe choice when accuracy matters")
    if not gpu.supports_bf16:
        notes.append(f"{gpu.label} has no bf16 tensor cores: 16-bit plans are fp16-mixed (autocast with fp32 "
                     "masters and a loss scaler)")
    if num_devices > 1:
        notes.append(SHARDING_NOTE)
    time_key = "time per sequence" if by_sequence else "step time"
    return FitResult(tuple(options), combinations, rooms[own_strategy], gpu, num_devices, target, utilisation,
                     f"fewest and safest changes to your plan, then {time_key}", tuple(notes), allow_risky,
                     risky_left_out, nearest, tuple(left_out), tuple(rooms.items()))


class _Combo(NamedTuple):
    """A combination's technique fields, cheap to make: the Scenario is built only when searched."""

    finetune: FineTune
    optimizer: Optimizer
    precision: Precision
    checkpointing: Checkpointing
    batch_size: int
    grad_accum_steps: int

    def scenario(self, base: Scenario, **overrides) -> Scenario:
        fields = {**self._asdict(), **overrides}
        return dataclasses.replace(base, **fields)


def _nearest(shape: ModelShape, base: Scenario, misses: dict, rooms: dict[Strategy, int],
             num_devices: int) -> tuple[NearMiss, ...]:
    """Per combination, the split of the target with the lowest per-GPU peak; the
    NEAREST_SHOWN nearest to the capacity, safest first among equal misses."""
    found = []
    for (plan_strategy, *_), tries in misses.items():
        parallel = ParallelPlan(num_devices, plan_strategy)
        # The peak grows with the micro-batch among splits that accumulate (K >= 2): only the
        # one without accumulation and the finest split can be lowest.
        accumulating = [t for t in tries if t[0].grad_accum_steps > 1]
        lowest_candidates = [t for t in tries if t[0].grad_accum_steps == 1] + (
            [max(accumulating, key=lambda t: t[0].grad_accum_steps)] if accumulating else [])
        best = None
        for probe, changes in lowest_candidates:
            try:
                plan = probe.scenario(base)
            except PlannerInputError:  # a micro-batch beyond any real step: no estimate to show
                continue
            peak = _peak_or_none(shape, plan, parallel)
            if peak is not None and peak <= rooms[plan_strategy]:
                continue  # its live tensors fit: it missed on the allocator's replay, not by a peak to show
            if peak is not None and (best is None or peak < best.peak_bytes):
                best = NearMiss(plan, plan_strategy, num_devices, peak, rooms[plan_strategy], changes)
        if best is not None:
            found.append(best)
    found.sort(key=lambda m: (m.peak_bytes, change_rank(m.changes)))
    return tuple(found[:NEAREST_SHOWN])


def best_options_with_max_seq_len(shape: ModelShape, result: FitResult, count: int,
                                  check: FitsCheck | None = None) -> FitResult:
    """`result` cut to its `count` best options, each with its largest sequence searched:
    what a report lists, without searching sequences for the options it leaves out (on CPU
    kernels each search probes new sequence lengths, seconds per option)."""
    best = tuple(dataclasses.replace(option, max_seq_len=max_seq_len(
        shape, option.scenario, result.room_bytes(option.strategy), known_fit=option.scenario.seq_len,
        plan=ParallelPlan(option.num_devices, option.strategy), check=check)) for option in result.options[:count])
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
