"""A probe's result as exact functions of batch, sequence and depth, and its evaluation.

No torch here: a table is plain data (shipped as JSON for the catalog) and one scenario
costs a walk over the real model's blocks, microseconds.

A polynomial is a tuple of (i, j, c) terms: c · b^i · s^j bytes, where j's higher base-100
digits count powers of sizes CUDA's kernels round s up to (ROUNDINGS): j = m + 100 · k1 +
10000 · k2 + 1000000 · k3 is s^m · ceil8(s)^k1 · ceil32(s)^k2 · ceil16(s)^k3. CUDA's
memory-efficient attention sizes by them: its log-sum-exp is (b, h, ceil32(s)), the mask it
keeps for backward has ceil8(s) columns, and the gradient of a bias that trains (T5's
position bias) ceil16(s) (planner.probe.fake_cuda). A table holds, for each
segment of the recorded step (micro-batch, forward or backward, and which block or the
part before the blocks), its net change of live bytes by category and the candidates for
its high point (live bytes by category at the moments no other moment dominates for every
b, s >= 1). The real step is the probed one with each middle block repeated as often as
the real model has layers of its type (`stands_for`); planner.probe.solve explains why
that is exact.

A table probed since the trace was added also keeps the step's allocations and frees in
order (`ProbeTrace`, optional: older tables load with `trace=None`), which
planner.probe.trace expands into the real step's allocation sequence for the caching
allocator's replay (planner.cuda_allocator).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from typing import TypeVar

CATEGORIES = ("gradients", "activations", "temporaries")
Poly = tuple[tuple[int, int, int], ...]
Bytes = tuple[int, int, int]  # by CATEGORIES
T = TypeVar("T")


# Sizes s is rounded up to (kind: multiple), in the order of j's digits after s's own (see the
# module docstring).
ROUNDINGS = {"ceil8": 8, "ceil32": 32, "ceil16": 16}
_DIGIT = 100


def rounded_sequence(kind: str, s: int) -> int:
    multiple = ROUNDINGS[kind]
    return -(-s // multiple) * multiple


def rounded_exponent(kind: str) -> int:
    """j of the rounding `kind` of s to the first power."""
    return _DIGIT ** (1 + list(ROUNDINGS).index(kind))


def monomial_value(i: int, j: int, b: int, s: int) -> int:
    if j < _DIGIT:  # no rounded factor: most terms, on every walk
        return b**i * s**j
    value = b**i * s**(j % _DIGIT)
    j //= _DIGIT
    for multiple in ROUNDINGS.values():
        if j % _DIGIT:
            value *= (-(-s // multiple) * multiple) ** (j % _DIGIT)
        j //= _DIGIT
    return value


def poly_value(poly: Poly, b: int, s: int) -> int:
    return sum(c * monomial_value(i, j, b, s) for i, j, c in poly)


PolyValues = Callable[[int, int], tuple[int, ...]]


def compile_polys(polys: Sequence[Poly]) -> PolyValues:
    """A function of (b, s) returning every one of `polys`' values in order, poly_value's
    integers, from one generated function that computes each distinct monomial once.

    Why: a scenario's estimate walks a few hundred polynomials of its table and a replay of the
    caching allocator sizes hundreds to thousands of allocations of its trace
    (planner.probe.trace); a sidebar change on the Plan page makes a few hundred of each. Term
    by term (poly_value), DistilBERT's CUDA table took 118 us for its walk's 222 polynomials
    and 332 us for its trace's 790 (2 cores); generated, 8 us and 15 us
    (benchmarks/estimate_speed.py).
    The source is written from the polynomials' integers alone (exponents, coefficients and
    ROUNDINGS' multiples), so a table read from a file cannot put anything else into it."""
    monomials: dict[tuple[int, int], int] = {}
    for poly in polys:
        for i, j, _ in poly:
            monomials.setdefault((int(i), int(j)), len(monomials))
    rounded = {digit for _, j in monomials for digit, power in enumerate(_rounded_powers(j)) if power}
    lines = ["def poly_values(b, s):"]
    for digit, multiple in enumerate(ROUNDINGS.values()):
        if digit in rounded:
            lines.append(f"    r{digit} = -(-s // {int(multiple)}) * {int(multiple)}")
    for (i, j), number in monomials.items():
        factors = [_power("b", i), _power("s", j % _DIGIT)]
        factors += [_power(f"r{digit}", power) for digit, power in enumerate(_rounded_powers(j))]
        lines.append(f"    m{number} = {'*'.join(f for f in factors if f) or '1'}")
    values = [" + ".join(f"{int(c)}*m{monomials[(int(i), int(j))]}" for i, j, c in poly) or "0" for poly in polys]
    lines.append(f"    return ({', '.join(values)},)" if values else "    return ()")
    namespace: dict = {}
    exec(compile("\n".join(lines), "<planner.probe.table.compile_polys>", "exec"), namespace)  # integers only
    return namespace["poly_values"]


def _rounded_powers(j: int) -> list[int]:
    """The power of each rounded s (ROUNDINGS' order) in exponent j: its base-100 digits after s's own."""
    powers, j = [], j // _DIGIT
    while j:
        powers.append(j % _DIGIT)
        j //= _DIGIT
    return powers


def _power(name: str, exponent: int) -> str:
    return "" if exponent == 0 else name if exponent == 1 else f"{name}**{exponent}"


@dataclass(frozen=True)
class Segment:
    delta: tuple[Poly, Poly, Poly]  # by CATEGORIES
    candidates: tuple[tuple[Poly, Poly, Poly], ...]  # relative to the segment's start


@dataclass(frozen=True)
class ProbeTrace:
    """The recorded step's allocations and frees in order, per segment (the same names and
    `:first` variants as ProbeTable.segments). An event is (storage, sign, weight): +1 the
    storage's allocation (its first appearance), -1 its free (its last removal), `weight`
    how many real instances it stands for (planner.probe.solve._segment_events); category
    changes in between are left out, they move no byte."""

    polys: tuple[Poly, ...]  # per storage (creation index): its bytes
    initial: tuple[int, ...]  # storages alive at the start of the step, in index order
    gradients: tuple[int, ...]  # storages that are gradients when the step ends (zero_grad frees them)
    makers: tuple[int, ...]  # per storage: the probed block that made it in the step, -1 if none
    ordinals: tuple[int, ...]  # per storage: its rank among what its maker made in its micro:direction
    events: dict[str, tuple[tuple[int, int, int], ...]]  # segment name -> (storage, sign, weight)
    # On CUDA's kernels (planner.probe.recorder): the storages a cuBLAS routine made, and per
    # column reduction's output storage its rows and columns (polynomials in b and s, in
    # elements) and its accumulator's bytes. Empty for a CPU table.
    cublas: tuple[int, ...] = ()
    column_reductions: tuple[tuple[int, Poly, Poly, int], ...] = ()
    # Per fused attention backward, on its last output's storage: backend, whether cuDNN would
    # take it, its dimensions (planner.probe.solve.ATTENTION_DIMS, each a polynomial in b and s)
    # and Q's element bytes (planner.attention_scratch).
    attention_backwards: tuple[tuple[int, str, bool, tuple[Poly, ...], int], ...] = ()
    # Per embedding backward, on its output's storage: its indices, rows and width (polynomials
    # in b and s), the gradient's and the indices' element bytes, whether the indices and the
    # gradient are contiguous, scale_grad_by_freq (planner.embedding_scratch).
    embedding_backwards: tuple[tuple[int, tuple[Poly, Poly, Poly], int, int, bool, bool, bool], ...] = ()

    def to_json(self) -> dict:
        # Compact: distinct polynomials once; an event is one int (i: allocate, ~i: free),
        # weights other than 1 listed apart as (position, weight); makers and ordinals follow
        # from where each allocation is (_makers), given the allocations a block's segment
        # holds that its block did not make ("unmade": between blocks, after the last).
        distinct: dict[Poly, int] = {}
        which = [distinct.setdefault(p, len(distinct)) for p in self.polys]
        unmade = {}
        for name, events in self.events.items():
            part = name.split(":")[2]
            if name.endswith(":first") or part == "outside":
                continue
            positions = [k for k, (i, sign, _) in enumerate(events) if sign > 0 and self.makers[i] != int(part)]
            if positions:
                unmade[name] = positions
        data = {"polys": [[list(t) for t in p] for p in distinct], "storage_polys": which,
                "initial": list(self.initial), "gradients": list(self.gradients),
                "events": {name: [i if sign > 0 else ~i for i, sign, _ in events]
                           for name, events in self.events.items()},
                "weights": {name: [[k, w] for k, (_, _, w) in enumerate(events) if w != 1]
                            for name, events in self.events.items() if any(w != 1 for _, _, w in events)},
                "unmade": unmade}
        if _makers(self.events, len(self.polys), unmade) != (self.makers, self.ordinals):
            data["makers"], data["ordinals"] = list(self.makers), list(self.ordinals)  # kept as they are
        if self.cublas:
            data["cublas"] = list(self.cublas)
        if self.column_reductions:
            data["column_reductions"] = [[index, [list(t) for t in rows], [list(t) for t in cols], accumulator]
                                         for index, rows, cols, accumulator in self.column_reductions]
        if self.attention_backwards:
            data["attention_backwards"] = [[index, backend, eligible, [[list(t) for t in d] for d in dims], element]
                                           for index, backend, eligible, dims, element in self.attention_backwards]
        if self.embedding_backwards:
            data["embedding_backwards"] = [[index, [[list(t) for t in d] for d in dims], *kinds]
                                           for index, dims, *kinds in self.embedding_backwards]
        return data

    @classmethod
    def from_json(cls, data: dict) -> ProbeTrace:
        distinct = [tuple((int(i), int(j), int(c)) for i, j, c in p) for p in data["polys"]]
        events = {}
        for name, flat in data["events"].items():
            weights = {int(k): int(w) for k, w in data.get("weights", {}).get(name, ())}
            events[name] = tuple((int(e), 1, weights.get(k, 1)) if e >= 0 else (~int(e), -1, weights.get(k, 1))
                                 for k, e in enumerate(flat))
        polys = tuple(distinct[int(k)] for k in data["storage_polys"])
        if "makers" in data:
            makers, ordinals = tuple(int(i) for i in data["makers"]), tuple(int(i) for i in data["ordinals"])
        else:
            makers, ordinals = _makers(events, len(polys), data.get("unmade", {}))
        reductions = tuple((int(index), tuple(tuple(int(v) for v in t) for t in rows),
                            tuple(tuple(int(v) for v in t) for t in cols), int(accumulator))
                           for index, rows, cols, accumulator in data.get("column_reductions", ()))
        attention = tuple((int(index), str(backend), bool(eligible),
                           tuple(tuple(tuple(int(v) for v in t) for t in d) for d in dims), int(element))
                          for index, backend, eligible, dims, element in data.get("attention_backwards", ()))
        embedding = tuple((int(index), tuple(tuple(tuple(int(v) for v in t) for t in d) for d in dims),
                           int(grad_bytes), int(index_bytes), bool(indices_contiguous), bool(grad_contiguous),
                           bool(scale))
                          for index, dims, grad_bytes, index_bytes, indices_contiguous, grad_contiguous, scale
                          in data.get("embedding_backwards", ()))
        return cls(polys=polys, initial=tuple(int(i) for i in data["initial"]),
                   gradients=tuple(int(i) for i in data["gradients"]), makers=makers, ordinals=ordinals,
                   events=events, cublas=tuple(int(i) for i in data.get("cublas", ())), column_reductions=reductions,
                   attention_backwards=attention, embedding_backwards=embedding)


def _makers(events: dict, count: int, unmade: dict) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Makers and ordinals from the allocations' places: what block k made is allocated in
    segment "m:d:k" (its every-instance variant holds all of it, in recorded order), and an
    ordinal is the rank there (planner.probe.solve._made)."""
    makers, ordinals = [-1] * count, [-1] * count
    for name, entries in events.items():
        micro, direction, part, *first = name.split(":")
        if first or part == "outside":
            continue
        skip = set(unmade.get(name, ()))
        rank = 0
        for k, (index, sign, _) in enumerate(entries):
            if sign > 0 and k not in skip:
                makers[index], ordinals[index] = int(part), rank
                rank += 1
    return tuple(makers), tuple(ordinals)


@dataclass(frozen=True)
class Moment:
    """Live bytes of the recorded step at one instant, by category (weights and optimizer
    state are not in the trace: the planner adds them exactly)."""

    gradients: int
    activations: int
    temporaries: int

    @property
    def total(self) -> int:
        return self.gradients + self.activations + self.temporaries


@dataclass(frozen=True)
class Walk:
    forward: Moment  # the high point of every forward of the step
    backward: Moment
    end: Moment  # after the last backward: what the optimizer step sees
    forward_end_activations: int  # activations alive when the first micro-batch's forward returns


@dataclass(frozen=True)
class ProbeTable:
    key: str  # technique class and library versions (planner.probe.cache)
    num_layers: int
    stands_for: tuple[int, ...]  # per real layer, the probed block it repeats
    initial: tuple[Poly, Poly, Poly]  # alive at the start of the step (outputs carried over)
    segments: dict[str, Segment]  # "micro:direction:part" -> Segment
    order: dict[str, tuple[str, ...]]  # "micro:direction" -> parts in the probed order
    on_real_tensors: bool = False  # probed on small real tensors: the model's code reads tensor values
    trace: ProbeTrace | None = None  # the allocation order (None: a table probed before traces were kept)
    # Parameters the step leaves without a gradient (the cross-attention of an encoder-decoder's
    # decoder run as a causal LM): they hold no optimizer state. Real names.
    no_gradient: tuple[str, ...] = ()

    def _sequence(self, micro: int, backward: bool) -> list[str]:
        direction = "bw" if backward else "fw"
        parts = self.order.get(f"{micro}:{direction}", ())
        head = [p for p in parts if p == "outside"]
        blocks = [str(i) for i in self.stands_for]
        return head + (blocks[::-1] if backward else blocks)

    def walk(self, batch: int, seq: int, accumulation_steps: int) -> Walk:
        """The step's high points at (batch, seq): each pass (micro-batch, direction) goes over
        its parts in order (the blocks reversed in backward, a repeated block's first real
        instance by its `:first` variant), each part's candidates over the live bytes at its
        start, then its net change. With accumulation, the second micro-batch stands for every
        later one (planner.probe.solve)."""
        values, passes = _walk_plan(self, accumulation_steps)
        v = values(batch, seq)
        live0, live1, live2 = v[0], v[1], v[2]
        highs: dict[bool, tuple[int, Bytes]] = {}
        forward_end = None
        for backward, parts, is_first_forward in passes:
            best = highs.get(backward, (-1, (0, 0, 0)))
            for delta, candidates in parts:
                base = live0 + live1 + live2
                for c in candidates:
                    total = base + v[c] + v[c + 1] + v[c + 2]
                    if total > best[0]:
                        best = (total, (live0 + v[c], live1 + v[c + 1], live2 + v[c + 2]))
                live0, live1, live2 = live0 + v[delta], live1 + v[delta + 1], live2 + v[delta + 2]
            highs[backward] = best
            if is_first_forward:
                forward_end = live1 + live2
        return Walk(Moment(*highs[False][1]), Moment(*highs[True][1]), Moment(live0, live1, live2), forward_end)

    # JSON: shipped for the catalog, cached for the rest.
    def to_json(self) -> dict:
        data = {"key": self.key, "num_layers": self.num_layers, "stands_for": list(self.stands_for),
                "initial": [list(map(list, p)) for p in self.initial],
                "segments": {name: {"delta": [list(map(list, p)) for p in seg.delta],
                                    "candidates": [[list(map(list, p)) for p in c] for c in seg.candidates]}
                             for name, seg in self.segments.items()},
                "order": {name: list(parts) for name, parts in self.order.items()},
                "on_real_tensors": self.on_real_tensors}
        if self.trace is not None:  # a table without one writes exactly what it always wrote
            data["trace"] = self.trace.to_json()
        if self.no_gradient:  # likewise
            data["no_gradient"] = list(self.no_gradient)
        return data

    @classmethod
    def from_json(cls, data: dict) -> ProbeTable:
        def poly(terms) -> Poly:
            return tuple((int(i), int(j), int(c)) for i, j, c in terms)

        def triple(polys) -> tuple[Poly, Poly, Poly]:
            return tuple(poly(p) for p in polys)

        return cls(key=data["key"], num_layers=int(data["num_layers"]),
                   stands_for=tuple(int(i) for i in data["stands_for"]), initial=triple(data["initial"]),
                   segments={name: Segment(triple(seg["delta"]), tuple(triple(c) for c in seg["candidates"]))
                             for name, seg in data["segments"].items()},
                   order={name: tuple(parts) for name, parts in data["order"].items()},
                   on_real_tensors=bool(data.get("on_real_tensors", False)),
                   trace=ProbeTrace.from_json(data["trace"]) if "trace" in data else None,
                   no_gradient=tuple(data.get("no_gradient", ())))


class PerTable:
    """Values kept per probe table object, for work that follows from a table alone (its walk's
    compiled polynomials, its trace's expansion, its step's form), each under a further key.
    Kept by the object's id, which its entry holds so that the id is not reused while kept;
    not by the table's `key`, which two models' tables of one technique class share (keyed so,
    alternating models recomputed). Emptied when `kept` entries are held."""

    def __init__(self, kept: int):
        self._kept = kept
        self._entries: dict[tuple[int, Hashable], tuple[ProbeTable, object]] = {}

    def get(self, table: ProbeTable, key: Hashable):
        entry = self._entries.get((id(table), key))
        return entry[1] if entry is not None and entry[0] is table else None

    def put(self, table: ProbeTable, key: Hashable, value) -> None:
        if len(self._entries) >= self._kept:
            self._entries.clear()
        self._entries[(id(table), key)] = (table, value)

    def made(self, table: ProbeTable, key: Hashable, make: Callable[[], T]) -> T:
        """The value kept for (table, key), made by `make()` and kept the first time."""
        value = self.get(table, key)
        if value is None:
            value = make()
            self.put(table, key, value)
        return value

    def values(self) -> list[tuple[ProbeTable, object]]:
        return list(self._entries.values())

    def clear(self) -> None:
        self._entries.clear()


@dataclass(frozen=True)
class _WalkValues:
    """Every polynomial a table's walk reads, as one compiled function (initial bytes first, then
    each segment's delta and candidates, three by CATEGORIES each), and per segment name the
    offsets of its delta and candidates in those values."""

    values: PolyValues
    offsets: dict[str, tuple[int, tuple[int, ...]]]


Passes = tuple[tuple[bool, tuple[tuple[int, tuple[int, ...]], ...], bool], ...]  # (backward, parts, first forward)
_WALKS = PerTable(kept=512)


def _walk_values(table: ProbeTable) -> _WalkValues:
    polys: list[Poly] = list(table.initial)
    offsets: dict[str, tuple[int, tuple[int, ...]]] = {}
    for name, segment in table.segments.items():
        delta = len(polys)
        polys += segment.delta
        candidates = []
        for candidate in segment.candidates:
            candidates.append(len(polys))
            polys += candidate
        offsets[name] = (delta, tuple(candidates))
    return _WalkValues(compile_polys(polys), offsets)


def _walk_passes(table: ProbeTable, offsets: dict[str, tuple[int, tuple[int, ...]]], micro_batches: int) -> Passes:
    """Each pass (micro-batch, direction) of the walk as (backward, its parts' offsets, whether it
    is the first forward)."""
    passes = []
    for micro in range(micro_batches):
        for backward in (False, True):
            direction = "bw" if backward else "fw"
            parts, seen = [], set()
            for part in table._sequence(micro, backward):
                name = f"{micro}:{direction}:{part}"
                entry = offsets.get(name + ":first") if part not in seen else None
                seen.add(part)
                entry = entry or offsets.get(name)
                if entry is not None:
                    parts.append(entry)
            passes.append((backward, tuple(parts), micro == 0 and not backward))
    return tuple(passes)


def _walk_plan(table: ProbeTable, accumulation_steps: int) -> tuple[PolyValues, Passes]:
    """The walk's compiled values (one per table) and its passes (one or two micro-batches)."""
    layout = _WALKS.made(table, "values", lambda: _walk_values(table))
    micro_batches = 1 if accumulation_steps == 1 else 2
    return layout.values, _WALKS.made(table, micro_batches, lambda: _walk_passes(table, layout.offsets, micro_batches))
