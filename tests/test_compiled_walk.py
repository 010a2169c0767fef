"""planner.probe.table's compiled evaluation (compile_polys, the walk's precomputed plan) against
the term-by-term definition: poly_value for every polynomial, and a walk written here straight
from the module's definition of a table, on the shipped catalog tables at random sizes."""

import json
import os
import random
import time
from pathlib import Path

import pytest

from planner.probe.table import ProbeTable, compile_polys, poly_value

ROOT = Path(__file__).resolve().parents[1]
SHIPPED = sorted((ROOT / "planner" / "catalog" / "probes").glob("*.json"))
TABLES_CHECKED = 40


def shipped_tables(rng: random.Random, count: int) -> list[ProbeTable]:
    """`count` step tables drawn from every shipped file (optimizer-step tables are another kind)."""
    entries = [(path, key) for path in SHIPPED for key, data in json.loads(path.read_text()).items()
               if "segments" in data]
    chosen = rng.sample(entries, min(count, len(entries)))
    return [ProbeTable.from_json(json.loads(path.read_text())[key]) for path, key in chosen]


def sizes(rng: random.Random) -> list[tuple[int, int]]:
    # Ones, sizes that are and are not multiples of the roundings (8, 16, 32), and large ones.
    return [(1, 1), (1, 7), (3, 33), (8, 512), (2, 4095)] + [(rng.randint(1, 4096), rng.randint(1, 131_072))
                                                          for _ in range(5)]


def reference_walk(table: ProbeTable, b: int, s: int, accumulation_steps: int):
    """The walk as planner.probe.table's docstring defines it, every polynomial by poly_value."""
    def bytes_of(polys):
        return tuple(poly_value(p, b, s) for p in polys)

    live = bytes_of(table.initial)
    highs, forward_end = {}, None
    for micro in ((0,) if accumulation_steps == 1 else (0, 1)):
        for backward in (False, True):
            direction = "bw" if backward else "fw"
            best, seen = highs.get(backward, (-1, (0, 0, 0))), set()
            for part in table._sequence(micro, backward):
                name = f"{micro}:{direction}:{part}"
                segment = table.segments.get(name + ":first") if part not in seen else None
                seen.add(part)
                segment = segment or table.segments.get(name)
                if segment is None:
                    continue
                for candidate in map(bytes_of, segment.candidates):
                    at = tuple(x + y for x, y in zip(live, candidate))
                    if sum(at) > best[0]:
                        best = (sum(at), at)
                live = tuple(x + y for x, y in zip(live, bytes_of(segment.delta)))
            highs[backward] = best
            if micro == 0 and not backward:
                forward_end = live[1] + live[2]
    return highs[False][1], highs[True][1], live, forward_end


# A new draw each run; COMPILED_WALK_SEED=N reruns one (the seed is printed and in every failure).
SEED = int(os.environ.get("COMPILED_WALK_SEED", time.time_ns() % 2**32))


@pytest.fixture
def rng():  # each test draws from the seed afresh, so one test reruns alone with the same draw
    print(f"compiled walk seed {SEED} (rerun with COMPILED_WALK_SEED={SEED})")
    return random.Random(SEED)


def test_compiled_polynomials_equal_poly_value_on_shipped_tables_and_traces(rng):
    for table in shipped_tables(rng, TABLES_CHECKED):
        polys = list(table.initial) + [p for segment in table.segments.values()
                                       for p in segment.delta + tuple(q for c in segment.candidates for q in c)]
        if table.trace is not None:
            polys += table.trace.polys
        values = compile_polys(polys)
        for b, s in sizes(rng):
            assert list(values(b, s)) == [poly_value(p, b, s) for p in polys], (SEED, table.key, b, s)


def test_walk_equals_the_term_by_term_walk_on_shipped_tables(rng):
    for table in shipped_tables(rng, TABLES_CHECKED):
        for b, s in sizes(rng):
            for accumulation_steps in (1, 2, 3):
                walk = table.walk(b, s, accumulation_steps)
                forward, backward, end, forward_end = reference_walk(table, b, s, accumulation_steps)
                case = (SEED, table.key, b, s, accumulation_steps)
                assert (walk.forward.gradients, walk.forward.activations, walk.forward.temporaries) == forward, case
                assert (walk.backward.gradients, walk.backward.activations, walk.backward.temporaries) == backward, case
                assert (walk.end.gradients, walk.end.activations, walk.end.temporaries) == end, case
                assert walk.forward_end_activations == forward_end, case


def test_rounded_monomials_and_empty_polynomials():
    # j = 1 + 100·1 + 10000·2: s · ceil8(s) · ceil32(s)²; an empty polynomial is 0; none at all, ().
    polys = [((1, 1 + 100 + 20000, 3),), (), ((0, 0, -5), (2, 0, 1))]
    assert compile_polys(polys)(3, 33) == (3 * 3 * 33 * 40 * 64**2, 0, -5 + 9)
    assert compile_polys([])(4, 4) == ()


def test_only_integers_reach_the_generated_code():
    with pytest.raises(ValueError):
        compile_polys([((0, 0, "__import__('os').system('true')"),)])
