"""The real step's allocations and frees, in order, from a probe table's trace: one optimizer
step's micro-batches (forward and backward) at any batch, sequence and accumulation, every
real tensor under its own key, for the caching allocator's replay (planner.cuda_allocator).

No torch here. The expansion walks the real step exactly as ProbeTable.walk does (the head,
then each real layer's probed block, reversed in backward; a repeated block's first real
instance takes its `:first` variant; micro-batch 0, then micro-batch 1's segments for every
later micro-batch) and plays each segment's events (planner.probe.table.ProbeTrace):

- An allocation makes a fresh instance of its storage, keyed `(storage, serial)`, the serial
  counting every instance of the expansion (the storages alive at the start come first, in
  index order, and are the first events).
- A free of weight w frees w live instances of its storage, the last made first (a stack per
  storage; for a block's own tensors, the one its real layer made). That is the real order
  for what a block saves in its forward and frees in its backward (backward meets the
  layers in the reverse order), for autocast's weight copies
  freed for every layer at once when the forward returns (w = the layers a block stands for:
  all of them), and for what was alive at the start (one instance). Where the free's maker
  and freer are neighbouring blocks (a block's output freed by the next block, an input
  gradient freed by the block below) the real instance is the neighbouring real layer's:
  when that layer is probed as another block (the first instance of a repeated block frees
  the first period's output, the later ones the repeated block's own), it is that block's
  storage of the same role (made in the same micro-batch and direction, at the same rank),
  of the same size; the instance freed is the one that real layer made.
- Micro-batch 1 frees what micro-batch 0 left (the lessons' loop's outputs); a later
  micro-batch frees what its predecessor left: micro-batch 1's own storages alive at its end,
  matched with the earlier ones it frees by size, the latest with the latest (checked).
  What the recorded loop keeps alive with each batch until the recording ends (a tensor
  derived from the inputs, never freed in the step; OPT, GPT-2 and DistilBERT keep one) makes
  micro-batch 1 end with more than it started with; a later micro-batch first lets go of the
  one kept with the batch before last, so that it starts as micro-batch 1 did (the walk
  repeats micro-batch 1 from the same level).

`check_against_walk` accounts the expansion exactly (allocated = sum of live bytes, no
rounding, no cache) and requires its high points to be the walk's, to the byte.

Known limitations: the order within a run of frees that happen together is the probe's
canonical one (by storage: planner.probe.solve._canonical), not the real one (autocast's
cache is a hash map), and the instances freed at once go newest first; neither changes
live bytes, but may change which free blocks the allocator merges first. A free by a
block that is not its maker's neighbour frees the newest instance. Where the real layer
before the last block is of another type than the probe's (an alternating pattern at a
depth the pattern does not divide), the walk itself is approximate and the expansion
raises TraceError if the neighbour's counterpart differs in size.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Hashable
from dataclasses import dataclass

from planner.probe.table import PerTable, ProbeTable, compile_polys

FREE = -1  # planner.cuda_allocator.FREE: the nbytes of a free event


class TraceError(ValueError):
    """The trace cannot be expanded into a real step, or disagrees with the walk."""


@dataclass(frozen=True)
class Span:
    """Events [start, stop) of one micro-batch's forward or backward."""

    micro_batch: int
    backward: bool
    start: int
    stop: int


@dataclass(frozen=True)
class Expansion:
    events: list[tuple[Hashable, int]]  # (key, nbytes) allocates, (key, FREE) frees
    initial_count: int  # the first events allocate what is alive at the start of the step
    spans: tuple[Span, ...]
    live_at_end: tuple[tuple[Hashable, int], ...]  # (key, storage) alive after the last backward, in allocation order
    layers: list[int | None]  # per event: the real layer whose segment it is in (None: outside the blocks)


def _parts(table: ProbeTable, micro: int, backward: bool) -> list[tuple[int | None, str]]:
    """(real layer, part) in the walk's order (ProbeTable._sequence)."""
    parts = table.order.get(f"{micro}:{'bw' if backward else 'fw'}", ())
    head = [(None, "outside")] if "outside" in parts else []
    blocks = [(layer, str(block)) for layer, block in enumerate(table.stands_for)]
    return head + (blocks[::-1] if backward else blocks)


# The expansion's order and keys do not depend on batch or sequence, only its sizes do, so
# one structure per (table, micro-batches) serves every size, and one compiled function of
# (b, s) per table gives its storages' sizes.
_EXPANSIONS = PerTable(kept=128)


def expand(table: ProbeTable, batch: int, seq: int, accumulation_steps: int) -> Expansion:
    """The micro-batches of one optimizer step of `accumulation_steps` micro-batches at (batch, seq)."""
    if accumulation_steps < 1:
        raise ValueError("accumulation_steps must be at least 1")
    # The structure first: it raises TraceError for a table without a trace.
    structure = _EXPANSIONS.made(table, accumulation_steps, lambda: _structure(table, accumulation_steps))
    sizes = _EXPANSIONS.made(table, "sizes", lambda: compile_polys(table.trace.polys))(batch, seq)
    # An allocation's key is (storage, serial): its size is its storage's.
    events = [(key, FREE if nbytes == FREE else sizes[key[0]]) for key, nbytes in structure.events]
    return dataclasses.replace(structure, events=events)


def _structure(table: ProbeTable, accumulation_steps: int) -> Expansion:
    """The expansion with every allocation's size left as 0 (expand fills them in)."""
    trace = table.trace
    if trace is None:
        raise TraceError("this probe table has no allocation trace (probed before traces were kept): probe it again")
    polys, makers, ordinals = trace.polys, trace.makers, trace.ordinals
    sizes = [0] * len(polys)
    group_of: dict[int, str] = {}  # storage -> "micro:direction" it is made in
    made_in_one, freed = set(), set()
    for name, events in trace.events.items():
        group = name[:name.index(":", name.index(":") + 1)]
        for index, sign, _ in events:
            if sign > 0:
                group_of[index] = group
                if group.startswith("1:"):
                    made_in_one.add(index)
            else:
                freed.add(index)
    by_role = {(group, makers[i], ordinals[i]): i for i, group in group_of.items() if makers[i] >= 0}
    later: dict[int, int] = {}  # for micro-batches >= 2: what micro-batch 1 freed of earlier ones -> its own
    kept: list[tuple[int, int]] = []  # (micro-batch 0's, micro-batch 1's) kept with their batch
    if accumulation_steps > 2:
        consumed = sorted({i for name, events in trace.events.items() if name.startswith("1:")
                           for i, sign, _ in events if sign < 0 and i not in made_in_one})
        left = sorted(i for i in made_in_one if i not in freed)
        later, extra = match_by_size(consumed, left, polys, "micro-batch 1 frees", "of its own")
        gradients = set(trace.gradients)
        kept_zero = sorted(i for i, group in group_of.items()
                           if group.startswith("0:") and i not in freed and i not in gradients)
        paired, _ = match_by_size(extra, kept_zero, polys, "micro-batch 1 keeps", "of micro-batch 0's")
        kept = [(old, new) for new, old in paired.items()]

    num_layers, stands_for = table.num_layers, table.stands_for
    stacks: dict[int, list[tuple[Hashable, int | None]]] = {}  # storage -> live (key, real layer), oldest first
    events: list[tuple[Hashable, int]] = []
    layers: list[int | None] = []
    serial = 0
    for index in trace.initial:
        key = (index, serial)
        serial += 1
        stacks.setdefault(index, []).append((key, None))
        events.append((key, sizes[index]))
    initial_count = len(events)
    layers += [None] * initial_count

    def pop(index: int, layer: int | None, wanted: int | None, name: str) -> Hashable:
        stack = stacks.get(index)
        if not stack:
            raise TraceError(f"segment {name} (real layer {layer}) frees storage {index}, which has no live instance")
        if wanted is not None:
            for position in range(len(stack) - 1, -1, -1):
                if stack[position][1] == wanted:
                    return stack.pop(position)[0]
        return stack.pop()[0]

    spans = []
    for micro_batch in range(accumulation_steps):
        micro = min(micro_batch, 1)
        if micro_batch >= 2:
            # What the recorded loop keeps with each batch: the batch before last is let go, so
            # that every later micro-batch starts as micro-batch 1 did (the walk's repeat).
            for old, new in kept:
                stack = stacks[old] if micro_batch == 2 else stacks[new]
                events.append((stack.pop(0)[0], FREE))
                layers.append(None)
        for backward in (False, True):
            start = len(events)
            direction = "bw" if backward else "fw"
            seen: set[str] = set()
            for layer, part in _parts(table, micro, backward):
                name = f"{micro}:{direction}:{part}"
                if part not in seen and name + ":first" in trace.events:
                    name += ":first"  # a repeated block's first real instance (planner.probe.solve)
                seen.add(part)
                entries = trace.events.get(name)
                if entries is None:
                    continue
                runner = None if part == "outside" else int(part)
                for index, sign, weight in entries:
                    if sign > 0:
                        stack = stacks.setdefault(index, [])
                        for _ in range(weight):
                            key = (index, serial)
                            serial += 1
                            stack.append((key, layer))
                            events.append((key, sizes[index]))
                        continue
                    target, wanted = index, None
                    if micro_batch >= 2 and index in later:
                        target = later[index]
                    elif runner is not None and makers[index] >= 0 and weight == 1 \
                            and group_of.get(index, "")[:1] == str(micro):
                        maker = makers[index]
                        if maker == runner:
                            wanted = layer
                        elif abs(maker - runner) == 1 and 0 <= layer + maker - runner < num_layers:
                            wanted = layer + maker - runner  # the neighbouring real layer
                            probed = stands_for[wanted]
                            if probed != maker:
                                counterpart = by_role.get((group_of[index], probed, ordinals[index]))
                                if counterpart is None or polys[counterpart] != polys[index]:
                                    raise TraceError(f"segment {name}: storage {index} from block {maker} has no "
                                                     f"counterpart of its size in block {probed}")
                                target = counterpart
                    if len(stacks.get(target, ())) < weight:
                        raise TraceError(f"segment {name} (real layer {layer}) frees storage {target} {weight} "
                                         f"times, {len(stacks.get(target, ()))} instances alive")
                    for _ in range(weight):
                        events.append((pop(target, layer, wanted, name), FREE))
                layers += [layer] * (len(events) - len(layers))
            spans.append(Span(micro_batch, backward, start, len(events)))
    alive = sorted(((key, index) for index, stack in stacks.items() for key, _ in stack), key=lambda kv: kv[0][1])
    return Expansion(events, initial_count, tuple(spans), tuple(alive), layers)


def match_by_size(olds: list[int], news: list[int], polys, what: str, whose: str) -> tuple[dict[int, int], list[int]]:
    """Pair each of `olds` with one of `news` of the same size polynomial, the latest with the
    latest (creation order); returns the pairs and the `news` left over."""
    rest = list(news)
    pairs = {}
    for old in reversed(olds):
        for k in range(len(rest) - 1, -1, -1):
            if polys[rest[k]] == polys[old]:
                pairs[old] = rest.pop(k)
                break
        else:
            raise TraceError(f"{what} {len(olds)} earlier storages but leaves {len(news)} {whose}, "
                             f"none the size of storage {old}: a later micro-batch would not repeat it")
    return pairs, rest


def step_events(table: ProbeTable, batch: int, seq: int, accumulation_steps: int) -> list[tuple[Hashable, int]]:
    """(key, nbytes) / (key, FREE): the storages alive at the start (allocated first, in
    index order), then the step's micro-batches."""
    return expand(table, batch, seq, accumulation_steps).events


@dataclass(frozen=True)
class ExactLevels:
    """Exact accounting of an expansion (live bytes, no rounding, no cache)."""

    forward: int  # the highest total during any forward
    backward: int
    end: int  # after the last backward


def exact_levels(expansion: Expansion) -> ExactLevels:
    sizes: dict[Hashable, int] = {}
    total = 0
    highs = {False: None, True: None}
    levels = []
    for key, nbytes in expansion.events:
        if nbytes == FREE:
            total -= sizes.pop(key)
        else:
            sizes[key] = nbytes
            total += nbytes
        levels.append(total)
    for span in expansion.spans:
        if span.stop > span.start:
            high = max(levels[span.start:span.stop])
            highs[span.backward] = high if highs[span.backward] is None else max(high, highs[span.backward])
    end = levels[-1] if levels else 0
    return ExactLevels(highs[False] or 0, highs[True] or 0, end)


def check_against_walk(table: ProbeTable, batch: int, seq: int, accumulation_steps: int) -> ExactLevels:
    """The expansion's exact high points must be the walk's (forward, backward, end), or TraceError."""
    levels = exact_levels(expand(table, batch, seq, accumulation_steps))
    walk = table.walk(batch, seq, accumulation_steps)
    want = ExactLevels(walk.forward.total, walk.backward.total, walk.end.total)
    if levels != want:
        raise TraceError(f"the expanded trace at {batch} x {seq}, {accumulation_steps} micro-batches reaches "
                         f"{levels}, the walk {want}")
    return levels
