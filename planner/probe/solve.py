"""From three recorded probes to a ProbeTable: every allocation as an exact function of
batch b and sequence s, every moment's live bytes as a sum of them, cut into segments.

Why this is exact:
- Fake-tensor runs of one model at different (b, s) execute the same ops in the same order
  (checked: the three event lists must agree in everything but sizes), so the i-th storage
  created is the same tensor in every probe.
- A tensor's bytes are its element size times the product of its dimensions, and each
  dimension is a constant or a · X + c for one X of b, s, b·s, s², b·s² (heads x sequence,
  a shifted label length s + 1, a flattened b·s). Three probes determine a and c and check
  them (two would fit any affine formula); PROBE_SIZES admit no two formulas at once.
  A dimension the kernel rounds s up for (planner.probe.table.ROUNDINGS: the memory-efficient
  kernel's ceil32(s) log-sum-exp, 32 at every probe size, and its mask padded to ceil8(s)
  columns) is announced by the kernel that makes it (Recording.rounded) and taken as
  announced, checked at every probe.
  Batch 1 is probed on its own (run.BATCH_ONE_PROBE_SIZES), its table a function of s.
  The product, expanded, is the storage's size as a polynomial in b and s.
- Depth: the blocks are run one after the other, each creating and freeing the same
  tensors as any other block of its layer type, so the step of an L-layer model is the
  probed step with the second period's block segments (forward and backward) repeated
  for every later middle layer (`_segment_events` names the two patterns where a plain
  repeat would be wrong, and how the first period detects them). Live bytes within a
  segment are its starting level plus its own prefix sums; the walk (planner.probe.table)
  adds them up for the real depth. The first and the last block are probed as themselves
  (the first's backward also produces the embedding's input gradient; the last's forward
  is followed by the head).
"""

from __future__ import annotations

import dataclasses
from fractions import Fraction

from planner.probe.recorder import Recording
from planner.probe.run import Layout, ProbeUnsupported
from planner.probe.table import (
    CATEGORIES,
    Poly,
    ProbeTable,
    ProbeTrace,
    Segment,
    monomial_value,
    rounded_exponent,
    rounded_sequence,
)

_MONOMIALS = ((1, 0), (0, 1), (1, 1), (0, 2), (1, 2))  # b, s, b*s, s^2, b*s^2


def _dimension_formula(values: tuple[int, ...], sizes: tuple[tuple[int, int], ...]) -> dict[tuple[int, int], int]:
    """One dimension across the probes as {monomial: coefficient}: constant, or a · X + c.
    Probes of one batch size (batch 1's class) tell no power of b apart: X is a power of s."""
    if len(set(values)) == 1:
        return {(0, 0): values[0]}
    one_batch = len({b for b, _ in sizes}) == 1
    found = []
    for i, j in _MONOMIALS:
        if one_batch and i:
            continue
        xs = [monomial_value(i, j, b, s) for b, s in sizes]
        a = Fraction(values[1] - values[0], xs[1] - xs[0])
        c = values[0] - a * xs[0]
        if a.denominator == 1 and c.denominator == 1 and all(a * x + c == v for x, v in zip(xs, values)):
            found.append({(i, j): int(a), (0, 0): int(c)})
    if len(found) != 1:
        raise ProbeUnsupported(f"a tensor dimension {values} at probe sizes {sizes} "
                               f"{'fits no' if not found else 'fits more than one'} size formula")
    return {k: v for k, v in found[0].items() if v}


def _multiply(p: dict, q: dict) -> dict:
    out: dict[tuple[int, int], int] = {}
    for (i1, j1), c1 in p.items():
        for (i2, j2), c2 in q.items():
            key = (i1 + i2, j1 + j2)
            out[key] = out.get(key, 0) + c1 * c2
    return {k: v for k, v in out.items() if v}


def _rounded_formula(values: tuple[int, ...], sizes: tuple[tuple[int, int], ...], kind: str) -> dict:
    """An announced dimension: `kind` of s at every probe, or the probe is refused."""
    if any(value != rounded_sequence(kind, s) for value, (_, s) in zip(values, sizes)):
        raise ProbeUnsupported(f"a tensor dimension {values} announced as {kind} of the sequence is not, "
                               f"at probe sizes {sizes}")
    return {(0, rounded_exponent(kind)): 1}


def _storage_polys(recordings: list[Recording]) -> list[dict]:
    sizes = tuple((r.batch_size, r.seq_len) for r in recordings)
    if any(r.rounded != recordings[0].rounded for r in recordings[1:]):
        raise ProbeUnsupported("the kernels announced rounded sizes for different storages at different sizes")
    polys = []
    for index, entries in enumerate(zip(*(r.sizes for r in recordings))):
        shapes = [entry[0] for entry in entries]
        if any(shape is None for shape in shapes) or len({len(shape) for shape in shapes}) != 1:
            raise ProbeUnsupported("a storage's creating tensor differs between probes")
        poly = {(0, 0): entries[0][1]}  # element size
        rounded = recordings[0].rounded.get(index)
        for dim, dim_values in enumerate(zip(*shapes)):
            formula = (_rounded_formula(tuple(dim_values), sizes, rounded[1]) if rounded and rounded[0] == dim
                       else _dimension_formula(tuple(dim_values), sizes))
            poly = _multiply(poly, formula)
        for entry, (b, s) in zip(entries, sizes):
            if sum(c * monomial_value(i, j, b, s) for (i, j), c in poly.items()) != entry[2]:
                raise ProbeUnsupported("a storage's bytes are not its tensor's size")
        polys.append(poly)
    return polys


def _add(into: dict, poly: dict, sign: int) -> None:
    for key, value in poly.items():
        into[key] = into.get(key, 0) + sign * value
        if not into[key]:
            del into[key]


def _frozen(poly: dict) -> Poly:
    return tuple(sorted((i, j, c) for (i, j), c in poly.items()))


def _dominates(upper: list[dict], lower: list[dict]) -> bool:
    """upper >= lower in total for every b, s >= 1: every coefficient of the difference >= 0
    (every monomial, rounded ones included, is positive there)."""
    difference: dict = {}
    for poly in upper:
        _add(difference, poly, +1)
    for poly in lower:
        _add(difference, poly, -1)
    return all(value >= 0 for value in difference.values())


def _sample_total(moment: list[dict]) -> int:
    # Ordering only (which candidates to compare first): a large scenario.
    return sum(c * monomial_value(i, j, 8, 4096) for poly in moment for (i, j), c in poly.items())


def _segment(entries: list, polys) -> Segment:
    """entries: (event, how many real events it stands for)."""
    level = [dict() for _ in CATEGORIES]
    candidates = []
    for position, (event, weight) in enumerate(entries):
        _add(level[CATEGORIES.index(event.category)], polys[event.index], event.sign * weight)
        following = entries[position + 1][0] if position + 1 < len(entries) else None
        # A high point can only be where live bytes stop growing: before a free or at the end.
        if event.sign > 0 and (following is None or following.sign < 0):
            candidates.append([dict(p) for p in level])
    candidates.sort(key=_sample_total, reverse=True)
    kept: list[list[dict]] = []
    for candidate in candidates:
        if not any(_dominates(other, candidate) for other in kept):
            kept.append(candidate)
    return Segment(tuple(_frozen(p) for p in level), tuple(tuple(_frozen(p) for p in c) for c in kept))


def _canonical(events: list) -> list:
    """Frees that happen together come in no fixed order (autocast clears its weight cache,
    a hash map keyed by address, when the forward returns): sort each run of consecutive
    frees by storage. Within such a run live bytes only fall, so no high point moves."""
    out, run = [], []
    for event in events + [None]:
        if event is not None and event.sign < 0 and (not run or run[-1][:3] == (event.micro_batch, event.backward,
                                                                              event.block)):
            run.append((event.micro_batch, event.backward, event.block, event.index, event))
            continue
        out += [entry[-1] for entry in sorted(run, key=lambda entry: entry[3])]
        run = []
        if event is not None:
            if event.sign < 0:
                run.append((event.micro_batch, event.backward, event.block, event.index, event))
            else:
                out.append(event)
    return out


def _check_aligned(recordings: list[Recording]) -> None:
    for recording in recordings:
        recording.events = _canonical(recording.events)
    first = recordings[0]
    for other in recordings[1:]:
        if (len(other.sizes) != len(first.sizes) or other.events != first.events
                or other.live_at_start != first.live_at_start):
            raise ProbeUnsupported("the model runs different operations at different batch or sequence sizes")
    for recording in recordings:
        if recording.unsized:
            raise ProbeUnsupported(recording.unsized[0])
    if any(r.cublas != first.cublas or r.column_reductions.keys() != first.column_reductions.keys()
           or r.attention_backwards.keys() != first.attention_backwards.keys()
           or r.embedding_backwards.keys() != first.embedding_backwards.keys() for r in recordings[1:]):
        raise ProbeUnsupported("the model runs different CUDA kernels at different batch or sequence sizes")


def _column_reductions(recordings: list[Recording]) -> tuple[tuple[int, Poly, Poly, int], ...]:
    """Each column reduction's rows and columns as polynomials in b and s (one dimension
    formula each, as a tensor dimension's), and its accumulator bytes."""
    sizes = tuple((r.batch_size, r.seq_len) for r in recordings)
    out = []
    for index in sorted(recordings[0].column_reductions):
        shapes = [r.column_reductions[index] for r in recordings]
        if len({accumulator for _, _, accumulator in shapes}) != 1:
            raise ProbeUnsupported("a reduction's accumulator differs between probes")
        rows = _dimension_formula(tuple(rows for rows, _, _ in shapes), sizes)
        cols = _dimension_formula(tuple(cols for _, cols, _ in shapes), sizes)
        out.append((index, _frozen(rows), _frozen(cols), shapes[0][2]))
    return tuple(out)


def _marked_calls(recordings: list[Recording], marks: str, sizes: tuple[str, ...], kinds: tuple[str, ...],
                  what: str) -> list[tuple[int, tuple[Poly, ...], tuple]]:
    """Each kernel call a probe marked on a storage (`marks`, a Recording field: storage -> call),
    as (storage, its fields `sizes` as dimension formulas in b and s, its fields `kinds`, which
    must be the same at every probed size)."""
    probed = tuple((r.batch_size, r.seq_len) for r in recordings)
    out = []
    for index in sorted(getattr(recordings[0], marks)):
        calls = [getattr(r, marks)[index] for r in recordings]
        if len({tuple(getattr(c, name) for name in kinds) for c in calls}) != 1:
            raise ProbeUnsupported(f"{what} runs differently at different batch or sequence sizes")
        dims = tuple(_frozen(_dimension_formula(tuple(getattr(c, name) for c in calls), probed)) for name in sizes)
        out.append((index, dims, tuple(getattr(calls[0], name) for name in kinds)))
    return out


ATTENTION_DIMS = ("batch", "heads_q", "heads_kv", "seq_q", "seq_kv", "head_dim_qk", "head_dim_v")


def _attention_backwards(recordings: list[Recording]) -> tuple[tuple[int, str, bool, tuple[Poly, ...], int], ...]:
    """Each fused attention backward (planner.attention_scratch) on its last output's storage:
    backend, whether cuDNN would take it, its dimensions (ATTENTION_DIMS) as dimension formulas
    in b and s, and Q's element bytes."""
    return tuple((index, backend, eligible, dims, element) for index, dims, (backend, eligible, element) in
                 _marked_calls(recordings, "attention_backwards", ATTENTION_DIMS,
                               ("backend", "cudnn_eligible", "element_bytes"), "an attention backward"))


EMBEDDING_SIZES = ("num_indices", "num_weights", "dim")
EMBEDDING_KINDS = ("grad_bytes", "index_bytes", "indices_contiguous", "grad_contiguous", "scale_grad_by_freq")


def _embedding_backwards(recordings: list[Recording]) -> tuple[tuple, ...]:
    """Each embedding backward (planner.embedding_scratch) on its output's storage: its sizes
    (EMBEDDING_SIZES) as dimension formulas in b and s, then EMBEDDING_KINDS."""
    return tuple((index, dims, *kinds) for index, dims, kinds in
                 _marked_calls(recordings, "embedding_backwards", EMBEDDING_SIZES, EMBEDDING_KINDS,
                               "an embedding backward"))


def _made(groups: dict, live_at_start) -> tuple[dict, dict]:
    """storage -> (group, maker block, ordinal) for what the step makes, and storage ->
    (group, part) of its last removal."""
    before = {index for index, _ in live_at_start}
    made: dict[int, tuple[str, int | None, int]] = {}  # storage -> (group, maker block, ordinal)
    ordinals: dict[tuple[str, int | None], int] = {}
    freed_in: dict[int, tuple[str, str]] = {}  # storage -> (group, part) of its last removal
    for group, runs in groups.items():
        for part, events in runs:
            for event in events:
                if event.sign > 0 and event.index not in before and event.index not in made:
                    ordinal = ordinals.get((group, event.block), 0)
                    ordinals[(group, event.block)] = ordinal + 1
                    made[event.index] = (group, event.block, ordinal)
                elif event.sign < 0:  # the last removal is the free (earlier ones change category)
                    freed_in[event.index] = (group, part)
    return made, freed_in


def _trace(recording: Recording, polys: list[dict], variants: dict[str, list], made: dict,
           reductions: tuple = (), attention: tuple = (), embedding: tuple = ()) -> ProbeTrace:
    """The allocation order for the allocator's replay (planner.probe.table.ProbeTrace): of
    each storage only its allocation (first +1, unless alive at the start) and its free (last
    -1, when it does not outlive the recording); a category change (-1 then +1) moves no byte."""
    before = {index for index, category in recording.live_at_start if category in CATEGORIES}  # as the walk's
    net = {index: 1 for index in before}
    category = dict(recording.live_at_start)
    allocation, free = {}, {}
    for event in recording.events:
        net[event.index] = net.get(event.index, 0) + event.sign
        if event.sign > 0:
            category[event.index] = event.category
            if event.index not in before and event.index not in allocation:
                allocation[event.index] = id(event)
        else:
            free[event.index] = id(event)
    real = set(allocation.values()) | {key for index, key in free.items() if not net[index]}
    count = len(polys)
    makers, ordinals = [-1] * count, [-1] * count
    for index, (_, block, ordinal) in made.items():
        if block is not None:
            makers[index], ordinals[index] = block, ordinal
    return ProbeTrace(
        polys=tuple(_frozen(p) for p in polys), initial=tuple(sorted(before)),
        gradients=tuple(sorted(i for i, n in net.items() if n > 0 and category.get(i) == "gradients")),
        makers=tuple(makers), ordinals=tuple(ordinals),
        events={name: tuple((event.index, event.sign, weight) for event, weight in entries if id(event) in real)
                for name, entries in variants.items()},
        cublas=tuple(sorted(set(recording.cublas))), column_reductions=reductions, attention_backwards=attention,
        embedding_backwards=embedding)


def _segment_events(groups: dict, layout: Layout, live_at_start) -> dict[str, list]:
    """Each segment's events with how often each counts in the real step, keyed by segment
    name ("micro:direction:part"; where a second-period block's first real instance differs,
    that instance's events under "...:first").

    A second-period block stands for n real layers, so its segments repeat n times. That is
    exact for what a block makes and frees itself (in any of its segments: saved in forward,
    freed in backward) and for what one block hands to the next, which frees it. Two
    patterns need more, and the first period tells them apart (its blocks stand for one
    layer each, and run the same code):
    - a storage a block makes and a later part of the step frees for every layer at once
      (autocast's weight copies, freed when the forward returns): its first-period
      counterpart is freed in the same place. That place frees n of them.
    - a storage made once (outside the blocks, or by a block not in the second period) that
      a second-period block frees, not handed over from its neighbour: only the first real
      instance frees it.
    """
    second = layout.second_period()
    period = layout.period
    repeats = {block: layout.stands_for.count(block) for block in second}
    made, freed_in = _made(groups, live_at_start)
    by_role = {role: index for index, role in made.items()}

    def block_of(part: str) -> int | None:
        return None if part == "outside" else int(part)

    out: dict[str, list] = {}
    for group, runs in groups.items():
        for part, events in runs:
            runner = block_of(part)
            every, first_only = [], []
            for event in events:
                origin = made.get(event.index)
                maker = origin[1] if origin is not None else None
                weight, once = 1, False
                if origin is None or maker is None:  # alive before the step, or made outside the blocks
                    once = runner in second
                elif maker == runner:
                    pass
                elif maker in second:
                    counterpart = by_role.get((origin[0], maker - period, origin[2]))
                    if counterpart is None:
                        raise ProbeUnsupported(f"blocks {maker - period} and {maker} make different tensors")
                    if freed_in.get(counterpart) == (group, part):
                        weight = repeats[maker]  # freed here for every real layer at once
                elif runner in second and abs(runner - maker) != 1:
                    once = True
                entry = (event, weight)
                first_only.append(entry)
                if not once:
                    every.append(entry)
            out[f"{group}:{part}"] = every
            if len(every) != len(first_only):
                out[f"{group}:{part}:first"] = first_only
    return out


def _grouped(events: list, count: int) -> tuple[dict, dict | None]:
    """Events by "micro:direction", in runs by part (a block, or "outside"), and each group's
    parts in order; the order is None (and `groups` the first bad group's parts) when the
    blocks did not run one after the other."""
    groups: dict[str, list[tuple[str, list]]] = {}
    for event in events:
        group = f"{event.micro_batch}:{'bw' if event.backward else 'fw'}"
        runs = groups.setdefault(group, [])
        # Events between blocks belong to the block before them (sticky); those before the
        # first block of a direction to "outside" (embeddings in forward, loss and head in backward).
        part = str(event.block) if event.block is not None else (runs[-1][0] if runs else "outside")
        if not runs or runs[-1][0] != part:
            runs.append((part, []))
        runs[-1][1].append(event)
    order = {}
    for group, runs in groups.items():
        parts = [part for part, _ in runs]
        blocks = [p for p in parts if p != "outside"]
        expected = [str(i) for i in (range(count - 1, -1, -1) if group.endswith("bw") else range(count))]
        if blocks != expected or parts.count("outside") > 1 or ("outside" in parts and parts[0] != "outside"):
            return f"{group}: {parts}", None
        order[group] = tuple(parts)
    return groups, order


def solve(recordings: list[Recording], layout: Layout, key: str, on_real_tensors: bool = False) -> ProbeTable:
    _check_aligned(recordings)
    polys = _storage_polys(recordings)
    weights = [e for e in recordings[0].events if e.category in ("weights", "optimizer_state")]
    if weights:
        raise ProbeUnsupported(f"the step created {weights[0].category} (storage {weights[0].index})")
    initial = [dict() for _ in CATEGORIES]
    for index, category in recordings[0].live_at_start:
        if category in CATEGORIES:
            _add(initial[CATEGORIES.index(category)], polys[index], +1)
    groups, order = _grouped(recordings[0].events, len(layout.probed))
    if order is None and not layout.reduced:
        # Every block probed as itself repeats nothing, so the blocks need not run one after
        # the other: an encoder-decoder's backward takes each decoder block's cross-attention
        # to the encoder's output after the decoder's first block. The step is one segment.
        recordings[0].events = [dataclasses.replace(event, block=None) for event in recordings[0].events]
        groups, order = _grouped(recordings[0].events, 0)
    if order is None:
        raise ProbeUnsupported(f"blocks ran out of order in {groups}")
    segments = {}
    variants = _segment_events(groups, layout, recordings[0].live_at_start)
    for name, variant in variants.items():
        segments[name] = _segment(variant, polys)
    trace = _trace(recordings[0], polys, variants, _made(groups, recordings[0].live_at_start)[0],
                   _column_reductions(recordings), _attention_backwards(recordings), _embedding_backwards(recordings))
    return ProbeTable(key=key, num_layers=layout.num_layers, stands_for=layout.stands_for,
                      initial=tuple(_frozen(p) for p in initial), segments=segments, order=order,
                      on_real_tensors=on_real_tensors, trace=trace,
                      no_gradient=tuple(recordings[0].no_gradient))
