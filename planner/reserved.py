"""The steady-state training run as the caching allocator sees it, and its replay: what
`torch.cuda.max_memory_reserved` would read (planner.cuda_allocator).

`training_events(shape, scenario, table)` gives `(prefix, step)`, so that
`replay(step, prefix=prefix, repeats=2)` is a run's first three steps, the third measured
(runners' default: step 1 builds the optimizer state, the last step is measured), or five
where a step is replayed as two (below); `reserved_peak` replays more while the measured
step still maps new memory (SETTLING_REPEATS):
- prefix: the model, then the first step. The model: one allocation per real parameter
  tensor (`shape.params`, tied weights once, in order; bytes per element for the
  precision, planner.optimizer_state), the registered buffers (one allocation for the
  floating ones, one for the rest: ModelShape keeps only their totals), torch's own blocks
  (DDP's buckets). The first step is a step (below) that starts without the previous
  step's outputs and makes the optimizer's state tensors (as planner.optimizer_state counts
  them: their sum is `optimizer_state_bytes`, less a paged optimizer's buffers in unified
  memory) in its `optimizer.step()`, before the update:
  optimizers create state lazily (torch's `_init_group`, bitsandbytes' `init_state`), when
  backward has freed the activations, so state can take blocks the activations left cached.
- step: the K micro-batches (planner.probe.trace), the optimizer step's temporaries, then
  zero_grad(set_to_none=True) freeing every gradient, and what the recorded loop kept alive
  with its batches (planner.probe.trace), let go as a real loop drops its batch.
- what CUDA's kernels allocate beside their outputs, where the probe marked it
  (planner.probe.recorder; tables of CUDA probe format 5 on): each thread's cuBLAS workspace
  (planner.cuda_overheads: the main thread's and the autograd thread's) right after the
  output of its first cuBLAS call, in the first step's first forward and first backward
  (torch makes it lazily, per handle and stream, and keeps it); and every column
  reduction's workspace and semaphores (planner.cuda_reduction, on the planner's GPU that
  makes the largest), allocated after its output and freed before the next event; and from
  CUDA probe format 7 each fused attention backward's scratch (planner.attention_scratch, for
  the backend the plan's GPU and torch build take: `kernels`), after its last output and
  freed before the next event; and from CUDA probe format 8 each embedding backward's own
  requests (planner.embedding_scratch: the sort before its output, the segments and partial
  sums after it, all freed before the next event). On an
  H200 (benchmarks/results/gpu_runs/2026-12-04-c/traces): GPT-2 with LoRA's autograd
  workspace took 32 MiB of a cached 413 MB block freed by the loss, so that block could no
  longer hold the next step's 411.7 MB logits gradient (a new segment: +380 MB reserved),
  and DistilBERT's bias gradients took 6,291,456 B + 24 B and 25,165,824 B + 96 B for their
  launches. A table without the marks puts the workspaces in the prefix, after the model.

Keys: parameters ("param", i), buffers ("buffers", kind), torch's blocks ("allocator-block", i),
cuBLAS workspaces ("cublas-workspace", i), a reduction's ("reduction-workspace", key) and
("reduction-semaphores", key) for its output's key, a kernel's scratch ("attention-scratch",
key, k) and ("embedding-scratch", key, name), state ("state", i, n) and
("state", "qmap1"/"qmap2"), the step's tensors planner.probe.trace's (storage, serial), the
optimizer step's ("optimizer-step",) or ("optimizer-step", i). The outputs the lessons' loop carries from one step
to the next are keyed ("carry", parity, j): the step's last outputs (of its live
non-gradient tensors at the end, in allocation order, those matching the carried ones'
sizes, the latest with the latest; a TraceError where one has no match) are the next
step's starting ones (the trace's initial storages the step frees, in index order), so
`replay(step, prefix=prefix, repeats=2)` is a steady state. Where the new outputs are made
before the old ones die (one micro-batch: the new forward returns before `outputs` is
rebound) one step cannot hand its keys to itself: `step` is then two steps, the second
with the carried keys' parities swapped (the same events, so the same peaks).

Known limitations: the optimizer step is one allocation of its temporaries' size
(planner.probe.cache.probed_step_temporaries holds a byte count, not its allocations),
freed at the end of the step, but for foreach Adam/AdamW on CUDA, whose one temporary per
parameter tensor is replayed as such (`optimizer_step_events`; the Trainer's two parameter
groups are replayed as one), and both Adafactors on CUDA, whose loops are replayed request by
request (planner.adafactor_cuda; LoRA's adapters excepted); the first step makes every state tensor before the update, where bitsandbytes and transformers' Adafactor make each tensor's state just
before its own update (interleaved with the update's temporaries); buffers are two
allocations; with LoRA and QLoRA the stored tensors are allocated in PEFT's parameter order
(QLoRA: the 4-bit weights' tensors, then the others, then the adapters), and loading's own
transient copies are not replayed (a QLoRA load quantises each weight on the GPU from a
16-bit copy, and prepare_model_for_kbit_training re-casts the norms and embeddings to fp32,
both of which can leave cached blocks behind); the trace is the probe's (CUDA's
kernels on fake tensors for a CUDA plan, planner.probe.fake_cuda), for one device and one
stream.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections import OrderedDict
from collections.abc import Hashable

from planner import optimizer_state as counts
from planner.adafactor_cuda import optimizer_order, step_events, step_peak_bytes
from planner.attention_scratch import AttentionBackward
from planner.cuda_allocator import FREE, K_SMALL_SIZE, Event, ReplayResult, replay
from planner.cuda_reduction import largest_column_reduction_requests, launch_events
from planner.embedding_scratch import EmbeddingBackward
from planner.kernel_target import UNKNOWN_GPU, KernelTarget
from planner.model_shape import ModelShape
from planner.probe.table import PerTable, ProbeTable, poly_value
from planner.probe.trace import Expansion, TraceError, expand
from planner.scenario import CudaSegments, Device, Optimizer, Scenario


def state_tensor_bytes(shape: tuple[int, ...], optimizer: Optimizer, param_bytes: int, device: Device,
                       fp32_embedding: bool = False) -> list[int]:
    """Bytes of each state tensor the optimizer keeps on `device` for one parameter tensor,
    in the order it creates them (planner.optimizer_state says where each comes from)."""
    numel = math.prod(shape)
    on_device_step = [counts.FP32_BYTES] if device is Device.CPU else []  # CPU-hosted `step`: where the params live
    paged = counts.is_paged_buffer(optimizer, device, numel)  # state1, state2 in unified memory: not the allocator's
    if fp32_embedding:
        return [] if paged else [numel * counts.FP32_BYTES] * 2
    if optimizer in (Optimizer.ADAMW, Optimizer.ADAM):
        return on_device_step + [numel * param_bytes] * 2
    if optimizer is Optimizer.ADAMW_FUSED:
        return [counts.FP32_BYTES] + [numel * param_bytes] * 2
    if optimizer is Optimizer.SGD:
        return [numel * param_bytes]
    if optimizer in (Optimizer.ADAFACTOR, Optimizer.HF_ADAFACTOR):
        element = param_bytes if optimizer is Optimizer.ADAFACTOR else counts.FP32_BYTES
        if len(shape) >= 2:
            factored = [math.prod(shape[:-1]) * element, math.prod(shape[:-2]) * shape[-1] * element]
        else:
            factored = [numel * element]
        if optimizer is Optimizer.ADAFACTOR:
            return on_device_step + factored
        return factored + [counts.FP32_BYTES]  # the device-side RMS
    if optimizer in (Optimizer.ADAM8BIT, Optimizer.ADAMW8BIT, Optimizer.PAGED_ADAMW8BIT):
        if numel < counts.BNB_MIN_8BIT_SIZE:
            return [numel * counts.FP32_BYTES] * 2
        absmax = -(-numel // counts.BNB_BLOCK_SIZE) * counts.FP32_BYTES
        return ([] if paged else [numel, numel]) + [absmax, absmax]
    raise ValueError(f"no state model for optimizer {optimizer}")


def model_prefix(shape: ModelShape, scenario: Scenario, allocator_blocks: tuple[int, ...] = ()) -> list[Event]:
    """Parameters and buffers, allocated once before the first step, then
    `allocator_blocks`: torch's own persistent blocks made before the first step (DDP's
    buckets; cuBLAS workspaces where the trace does not say where their first use is).
    With LoRA or QLoRA, every tensor the wrapped model stores
    (planner.estimate.adapter_tensors)."""
    if scenario.finetune.uses_adapters:
        from planner.estimate import adapter_tensors

        stored = adapter_tensors(shape, scenario).stored_bytes
        events: list[Event] = [(("param", i), n) for i, n in enumerate(stored) if n]
    else:
        element = counts.parameter_bytes_per_element(scenario.precision)
        events = [(("param", i), p.numel * element) for i, p in enumerate(shape.params)]
        if shape.float_buffer_elements:
            events.append((("buffers", "float"), shape.float_buffer_elements * 4))
        if shape.other_buffer_bytes:
            events.append((("buffers", "other"), shape.other_buffer_bytes))
    events += [(("allocator-block", i), nbytes) for i, nbytes in enumerate(allocator_blocks)]
    return events


def _trained_tensors(shape: ModelShape, scenario: Scenario) -> list[tuple[tuple[int, ...], int, bool]]:
    """(shape, bytes per element, state kept in 32 bits) of every tensor the optimizer
    updates, in order: the model's parameters, or with LoRA or QLoRA the adapters' (and
    trained heads'), as planner.estimate counts their state."""
    if scenario.finetune.uses_adapters:
        from planner.estimate import adapter_tensors

        return [(dims, size, False) for _, dims, size in adapter_tensors(shape, scenario).trainable]
    fp32_embeddings = counts.trainer_keeps_embeddings_in_32_bit(scenario.optimizer, scenario.engine)
    element = counts.parameter_bytes_per_element(scenario.precision)
    return [(p.shape, element, fp32_embeddings and p.name in shape.embedding_param_names) for p in shape.params]


def state_events(shape: ModelShape, scenario: Scenario) -> list[Event]:
    """The optimizer's state tensors in torch's caching allocator, per trained parameter
    tensor in order (as planner.optimizer_state counts them: their sum is
    `optimizer_state_bytes` less a paged optimizer's unified-memory buffers), then
    bitsandbytes' quantile maps. A real run makes them in its first `optimizer.step()`
    (torch's `_init_group`, bitsandbytes' `init_state`), after that step's backward has freed
    the activations. With LoRA or QLoRA, the adapters' (and trained heads') only."""
    events: list[Event] = []
    quantised = False
    for i, (dims, element, in_32_bit) in enumerate(_trained_tensors(shape, scenario)):
        sizes = state_tensor_bytes(dims, scenario.optimizer, element, scenario.device, in_32_bit)
        quantised |= (scenario.optimizer in counts.BNB_8BIT_OPTIMIZERS and not in_32_bit
                      and math.prod(dims) >= counts.BNB_MIN_8BIT_SIZE)
        events += [(("state", i, n), nbytes) for n, nbytes in enumerate(sizes)]
    if quantised:  # bitsandbytes' two quantile maps, shared by every 8-bit tensor
        events += [(("state", "qmap1"), counts.BNB_QMAP_BYTES), (("state", "qmap2"), counts.BNB_QMAP_BYTES)]
    return events


def optimizer_step_events(shape: ModelShape, scenario: Scenario, temporaries_bytes: int) -> list[Event]:
    """The optimizer step's temporaries (`temporaries_bytes` in all), allocated and freed.

    torch's foreach Adam/AdamW (CUDA's default, `_multi_tensor_adam`) makes
    `exp_avg_sq_sqrt = torch._foreach_sqrt(exp_avg_sqs)`: one tensor per parameter tensor,
    allocated in order and alive together until the step returns, when the list is let go
    (CPython frees a list's items last first). Those are replayed as such, each its own
    request, so the allocator can serve them from blocks the activations left cached; what
    the estimate counts beyond them (nothing, for the code-read rule) is one more request.
    An Adafactor step on CUDA replays its loop's requests (planner.adafactor_cuda.step_events,
    the tensors in the order the step visits them), each its own request, with the reductions'
    workspaces and semaphores that no tensor count holds.
    Every other step (fused kernels, bitsandbytes, LoRA's adapters) is one allocation of its
    temporaries."""
    if (scenario.device is Device.CUDA and scenario.optimizer in (Optimizer.ADAFACTOR, Optimizer.HF_ADAFACTOR)
            and not scenario.finetune.uses_adapters):
        shapes = optimizer_order(shape.params, scenario.optimizer, scenario.engine)
        element = counts.parameter_bytes_per_element(scenario.precision)
        replayed = _adafactor_step_events(shapes, element, scenario.optimizer)
        if replayed:
            if temporaries_bytes > step_peak_bytes(shapes, element, scenario.optimizer, workspaces=False):
                # the probe saw a higher moment than these requests hold: one request before them
                return [(("optimizer-step",), temporaries_bytes), (("optimizer-step",), FREE)] + list(replayed)
            return list(replayed)
    if scenario.device is Device.CUDA and scenario.optimizer in (Optimizer.ADAMW, Optimizer.ADAM):
        sizes = [math.prod(dims) * element for dims, element, _ in _trained_tensors(shape, scenario)]
        rest = temporaries_bytes - sum(sizes)
        if rest >= 0:
            keys = [("optimizer-step", i) for i in range(len(sizes))]
            if rest:
                keys.append(("optimizer-step", "rest"))
                sizes.append(rest)
            return list(zip(keys, sizes)) + [(key, FREE) for key in reversed(keys)]
    return [(("optimizer-step",), temporaries_bytes), (("optimizer-step",), FREE)]


@functools.lru_cache(maxsize=32)  # each replay of a plan, and every plan of a search, asks again
def _adafactor_step_events(shapes: tuple[tuple[int, ...], ...], element: int,
                           optimizer: Optimizer) -> tuple[Event, ...]:
    """An Adafactor loop's requests as the replay makes them: keyed under the step, without the
    small transients."""
    return tuple((("optimizer-step", key), nbytes)
                 for key, nbytes in _without_small_transients(step_events(shapes, element, optimizer)))


def _without_small_transients(events: tuple[Event, ...]) -> list[Event]:
    """`events` less each small request (K_SMALL_SIZE or less) made and freed while no large one
    is made: the norms' scalars and their launches' workspaces, a few of them per tensor, most
    of an Adafactor loop's requests. They touch only the small pool, whose cached room serves
    them in a steady state, so the large pool sees the same sequence; they lift the allocated
    peak by at most their few kilobytes (Llama-2-7B in pure bf16: 4,008 of torch's loop's 5,944
    requests, 6,726 of transformers' 11,374)."""
    opened: dict[Hashable, int] = {}  # small key -> its position, while no large request came after it
    dropped: set[int] = set()
    for position, (key, nbytes) in enumerate(events):
        if nbytes == FREE:
            start = opened.pop(key, None)
            if start is not None:
                dropped.update((start, position))
        elif nbytes <= K_SMALL_SIZE:
            opened[key] = position
        else:
            opened.clear()  # a large request inside their lifetime: kept
    return [event for position, event in enumerate(events) if position not in dropped]


def _check_keys(prefix: list[Event], step: list[Event], repeats: int = 2) -> None:
    live: set[Hashable] = set()
    for events in [prefix] + [step] * repeats:
        for key, nbytes in events:
            if nbytes == FREE:
                if key not in live:
                    raise TraceError(f"{key!r} is freed while not allocated")
                live.remove(key)
            else:
                if key in live:
                    raise TraceError(f"{key!r} is allocated while alive")
                live.add(key)


def _first_cublas_outputs(expansion: Expansion, cublas: frozenset[int]) -> dict[int, int]:
    """Position in `expansion.events` of the first allocation a cuBLAS routine made in micro-batch
    0's forward (thread 0: the main thread) and backward (thread 1: the autograd engine's)."""
    found = {}
    for span in expansion.spans:
        if span.micro_batch != 0:
            continue
        for position in range(span.start, span.stop):
            key, nbytes = expansion.events[position]
            if nbytes != FREE and key[0] in cublas:
                found[int(span.backward)] = position
                break
    return found


def _reduction_requests(table: ProbeTable, batch: int, seq: int) -> dict[int, tuple[int, int]]:
    """storage -> (workspace, semaphores) its column reduction allocates at (batch, seq), where nonzero."""
    out = {}
    for index, rows, cols, accumulator in table.trace.column_reductions:
        requests = largest_column_reduction_requests((poly_value(rows, batch, seq), poly_value(cols, batch, seq)),
                                                     accumulator)
        if requests[0]:
            out[index] = requests
    return out


def attention_calls(table: ProbeTable, batch: int, seq: int) -> dict[int, AttentionBackward]:
    """storage -> the fused attention backward whose last output it is, at (batch, seq)."""
    return {index: AttentionBackward(backend, eligible, *(poly_value(d, batch, seq) for d in dims), element)
            for index, backend, eligible, dims, element in table.trace.attention_backwards}


def _embedding_calls(table: ProbeTable, batch: int, seq: int) -> dict[int, EmbeddingBackward]:
    """storage -> the embedding backward whose output it is, at (batch, seq)."""
    return {index: EmbeddingBackward(*(poly_value(d, batch, seq) for d in dims), *kinds)
            for index, dims, *kinds in table.trace.embedding_backwards}


def _marked_positions(table: ProbeTable, expansion: Expansion, accumulation_steps: int,
                      carried: frozenset) -> list[int]:
    """Positions in a step's part of `expansion.events` that are not copied as they are: every
    event of a carried output (renamed per step), and each allocation made by a column
    reduction, a fused attention backward or an embedding backward (their scratch follows).
    Which they are follows from the table's structure, not from the sizes (planner.probe.trace
    `expand`): kept per table and micro-batch count."""
    def find() -> list[int]:
        trace = table.trace
        kernels = ({index for index, *_ in trace.column_reductions} | {index for index, *_ in trace.attention_backwards}
                   | {index for index, *_ in trace.embedding_backwards})
        start = expansion.initial_count
        return [position for position, (key, nbytes) in enumerate(expansion.events[start:], start)
                if key in carried or (nbytes != FREE and key[0] in kernels)]

    return _MARKED.made(table, (accumulation_steps, carried), find)


_MARKED = PerTable(kept=64)


def training_events(shape: ModelShape, scenario: Scenario, table: ProbeTable,
                    step_temporaries_bytes: int | None = None,
                    allocator_blocks: tuple[int, ...] = (),
                    cublas_workspaces: tuple[int, ...] = (),
                    kernels: KernelTarget = UNKNOWN_GPU) -> tuple[list[Event], list[Event]]:
    """(prefix, step) for `replay(step, prefix=prefix, repeats=2)` (see the module docstring).
    `step_temporaries_bytes`: the optimizer step's temporaries; None probes them
    (planner.probe.cache.probed_step_temporaries). `allocator_blocks`: made before the first
    step; `cublas_workspaces`: per thread (main, autograd), made at its first cuBLAS call;
    `kernels`: the GPU and build whose attention backends' scratch is made."""
    if step_temporaries_bytes is None:
        from planner.probe.cache import probed_step_temporaries

        found = probed_step_temporaries(shape, scenario)
        if isinstance(found, str):
            raise TraceError(f"the optimizer step could not be probed: {found}")
        step_temporaries_bytes = found
    expansion = expand(table, scenario.batch_size, scenario.seq_len, scenario.grad_accum_steps)
    trace = table.trace
    sizes = dict(e for e in expansion.events[:expansion.initial_count])
    initial_keys = [key for key, _ in expansion.events[:expansion.initial_count]]
    alive = {key for key, _ in expansion.live_at_end}
    gradients = set(trace.gradients)
    carried_in = [key for key in initial_keys if key not in alive]  # freed during the step, index order
    candidates = [key for key, index in expansion.live_at_end if index not in gradients and key not in initial_keys]
    # The step's last outputs are the candidates of the carried ones' sizes, the latest first;
    # the rest are kept with their batch by the recorded loop (planner.probe.trace), which a
    # real loop lets go with the batch: freed at the end of the step.
    carried_out = []
    for old in reversed(carried_in):
        match = next((k for k in range(len(candidates) - 1, -1, -1)
                      if trace.polys[candidates[k][0]] == trace.polys[old[0]]), None)
        if match is None:
            raise TraceError(f"the step starts with {len(carried_in)} tensors carried over but leaves no "
                             f"non-gradient tensor the size of storage {old[0]}: it is not a steady state")
        carried_out.insert(0, candidates.pop(match))
    dropped = candidates

    step_events = optimizer_step_events(shape, scenario, step_temporaries_bytes)
    # cuBLAS workspaces at their first use when the trace marks it, else before the first step.
    first_use = _first_cublas_outputs(expansion, frozenset(trace.cublas)) if cublas_workspaces else {}
    workspace_after = {position: (("cublas-workspace", thread), cublas_workspaces[thread])
                       for thread, position in first_use.items() if thread < len(cublas_workspaces)}
    in_prefix = tuple(nbytes for thread, nbytes in enumerate(cublas_workspaces)
                      if thread not in first_use)
    reductions = _reduction_requests(table, scenario.batch_size, scenario.seq_len)
    attention = attention_calls(table, scenario.batch_size, scenario.seq_len)
    embedding = _embedding_calls(table, scenario.batch_size, scenario.seq_len)

    # Most of a step's events are the expansion's as they are: copied in runs between the
    # positions that need more (a carried output's name, a kernel's scratch, a cuBLAS workspace).
    marked = _marked_positions(table, expansion, scenario.grad_accum_steps,
                               frozenset(carried_in) | frozenset(carried_out))
    first_marked = sorted(set(marked) | set(workspace_after))
    carried_in_set = set(carried_in)

    def one_step(parity_in: int | None, parity_out: int) -> list[Event]:
        """A step whose carried-in outputs are keyed by `parity_in` (None: the first step, which
        starts with none, makes the cuBLAS workspaces and makes the optimizer state before its update)."""
        names = {} if parity_in is None else {old: ("carry", parity_in, j) for j, old in enumerate(carried_in)}
        names.update({new: ("carry", parity_out, j) for j, new in enumerate(carried_out)})
        all_events = expansion.events
        events = []
        copied = expansion.initial_count  # all_events[copied:] are not in `events` yet
        for position in (marked if parity_in is not None else first_marked):
            events += all_events[copied:position]
            copied = position + 1
            key, nbytes = all_events[position]
            if parity_in is None and key in carried_in_set:
                continue
            named = names.get(key, key)
            embedding_call = embedding.get(key[0]) if nbytes != FREE else None
            if embedding_call is not None:  # its sort before its output, its segments after
                before, after = kernels.embedding_events(named, embedding_call)
                events += before
            events.append((named, nbytes))
            if embedding_call is not None:
                events += after
            if nbytes == FREE:
                continue
            requests = reductions.get(key[0])
            if requests is not None:
                events += launch_events(named, *requests)
            call = attention.get(key[0])
            if call is not None:
                events += kernels.attention_events(named, call)
            if parity_in is None and position in workspace_after:
                events.append(workspace_after[position])
        events += all_events[copied:]
        if parity_in is None:
            events += state_events(shape, scenario)
        events += step_events
        # zero_grad(set_to_none=True)
        events += [(key, FREE) for key, index in expansion.live_at_end if index in gradients]
        events += [(key, FREE) for key in dropped]
        return events

    # What is alive at the start of every step but the carried-in outputs (the recorded loop's
    # batch-kept tensors, which a step's frees match), then the first step.
    warm_up = [(key, sizes[key]) for key in initial_keys if key not in carried_in_set]
    prefix = model_prefix(shape, scenario, allocator_blocks + in_prefix) + warm_up + one_step(None, 0)
    # Which form a step takes, and that its keys are sound, follows from the table and the
    # micro-batches alone (the prefix's own keys are distinct by construction): checked once.
    form_key = (scenario.grad_accum_steps, kernels)
    known = _STEP_FORMS.get(table, form_key)
    if known is not None:
        return prefix, one_step(0, 0) if known == 1 else one_step(0, 1) + one_step(1, 0)
    step = one_step(0, 0)
    steps = 1
    try:
        _check_keys(prefix, step)
    except TraceError:
        step = one_step(0, 1) + one_step(1, 0)  # the new outputs are made before the old ones die
        steps = 2
        _check_keys(prefix, step)
    _STEP_FORMS.put(table, form_key, steps)
    return prefix, step


_STEP_FORMS = PerTable(kept=64)  # (table, (K, kernels)) -> steps per step


def reserved_peak(shape: ModelShape, scenario: Scenario, table: ProbeTable, *, expandable_segments: bool = False,
                  capacity_bytes: int | None = None, step_temporaries_bytes: int | None = None,
                  allocator_blocks: tuple[int, ...] = (), cublas_workspaces: tuple[int, ...] = (),
                  kernels: KernelTarget = UNKNOWN_GPU) -> ReplayResult:
    """The steady-state step replayed through the caching allocator model (its peaks are
    the second step's, after the first has warmed the cache); within `capacity_bytes`,
    with its headroom (planner.cuda_allocator, Headroom), which guides the fit searches."""
    prefix, step = training_events(shape, scenario, table, step_temporaries_bytes, allocator_blocks,
                                   cublas_workspaces, kernels)
    return replay(step, prefix=prefix, repeats=2, expandable_segments=expandable_segments,
                  capacity_bytes=capacity_bytes, headroom=capacity_bytes is not None, settle=SETTLING_REPEATS)


# Steps replayed after the measured one while it still maps new memory (planner.cuda_allocator
# `replay(settle=)`): the reserved peak is the level a long run stays at. On the H200's records
# SmolLM2-360M with expandable segments reserved 10,322,182,144 B at step 3, the run's own
# measured step, and the replay grows to 10,720,641,024 B at steps 4-5 and stays; the other 19
# scenarios of the GPU check reserve nothing after step 3 (benchmarks/results/gpu_check.md).
SETTLING_REPEATS = 4


# Replays by (config, scenario, blocks, capacity), the least recently used dropped first: a
# page or a search asks for the same plan more than once, and a 7B step is tens of thousands
# of events (planner.cuda_allocator). One fit search replays up to about a thousand plans
# (`planner fit --config gpt2 --gpu-memory-gib 8 --seq-len 256 --effective-batch 4`: 634), and
# the report runs the What fits search once per format it writes: with 512 kept and the whole
# memo cleared when full, the second search replayed everything again. An entry is a dozen
# integers and its key; 8,192 of them are a few MiB.
_REPLAYS: OrderedDict[tuple, ReplayResult | str] = OrderedDict()
_REPLAYS_KEPT = 8192

# Micro-batches replayed per step. Every micro-batch after the first runs the same events
# with gradients alive (planner.probe.trace), and the third is the first to follow one that
# followed another, so from the third on the allocator sees the same requests from the same
# live set; a step of 64 micro-batches of a 7B model would otherwise be 780,000 events (1.5 s).
# That later micro-batches add no reserved memory is checked, not assumed silently:
# tests/test_device_fit.py replays 3, 4, 8 and 16 micro-batches of several models and
# techniques and compares the peaks.
MICRO_BATCHES_REPLAYED = 3


def replayed_step(shape: ModelShape, result, allocator_blocks: tuple[int, ...],
                  capacity_bytes: int | None = None, cublas_workspaces: tuple[int, ...] = (),
                  kernels: KernelTarget = UNKNOWN_GPU) -> ReplayResult | str:
    """The steady-state step of the estimate `result` (planner.estimate.Estimate, on CUDA)
    replayed through the caching allocator (with expandable segments when the scenario's
    PYTORCH_CUDA_ALLOC_CONF asks for them), with torch's own `allocator_blocks` (made before
    the first step), `cublas_workspaces` (per thread, at its first cuBLAS call), the attention
    backwards' scratch for `kernels` (planner.attention_scratch) and, when given, the memory the allocator may take (`capacity_bytes`: it then releases its cache
    and retries before an out-of-memory error, as a real one does), with at most
    MICRO_BATCHES_REPLAYED micro-batches; or why it cannot be:
    the replay needs the step's allocation trace, which only a probe on CUDA's kernels
    keeps."""
    from planner.estimate import Confidence
    from planner.probe.cache import config_digest, probe_table

    scenario = result.scenario
    if scenario.grad_accum_steps > MICRO_BATCHES_REPLAYED:
        scenario = dataclasses.replace(scenario, grad_accum_steps=MICRO_BATCHES_REPLAYED)
    if scenario.device is not Device.CUDA:
        return "only CUDA has a caching allocator"
    if result.confidence is not Confidence.PROBED:
        return "the step was not probed on CUDA's kernels (the family recipe stands in), so there is no " \
               "allocation trace to replay"
    key = (config_digest(shape), shape.name, scenario, allocator_blocks, cublas_workspaces, capacity_bytes, kernels)
    found = _REPLAYS.get(key)
    if found is not None:
        _REPLAYS.move_to_end(key)
        return found
    table = probe_table(shape, scenario)
    if isinstance(table, str) or table.trace is None:
        found = "this probe table was made before allocation traces were kept: probe it again"
    else:
        step = result.phases[-1].temporaries  # the optimizer step's, as the estimate counts them
        try:
            found = reserved_peak(shape, scenario, table, step_temporaries_bytes=step,
                                  allocator_blocks=allocator_blocks, cublas_workspaces=cublas_workspaces,
                                  capacity_bytes=capacity_bytes, kernels=kernels,
                                  expandable_segments=scenario.cuda_segments is CudaSegments.EXPANDABLE)
        except TraceError as error:
            found = f"the step's trace cannot be replayed ({error})"
    _REPLAYS[key] = found
    if len(_REPLAYS) > _REPLAYS_KEPT:
        _REPLAYS.popitem(last=False)
    return found
