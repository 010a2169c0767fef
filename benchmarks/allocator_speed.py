"""How fast the CUDA caching allocator model (planner.cuda_allocator) replays a trace.

A random trace of EVENTS events (seeded): each step allocates (sizes log-uniform from
1 B to 64 MiB, so both pools and every segment kind are hit) or frees a random live
tensor, holding about LIVE tensors alive; everything left is freed at the end. The trace
is replayed through `replay()` with expandable segments off and on, and once with a
capacity of 90% of the unlimited reserved peak, which forces the release-and-retry path;
and, for reference, with `CachingAllocator.malloc` and `free` called per event (the same
rules: `replay` runs the default settings' events in one loop of its own). Median and
slowest of REPEATS runs.

Writes benchmarks/results/allocator_speed.md. Run: python benchmarks/allocator_speed.py
"""

from __future__ import annotations

import math
import platform
import random
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from planner.cuda_allocator import FREE, CachingAllocator, replay
from planner.units import GIB, MIB, format_bytes

EVENTS = 100_000
LIVE = 400
REPEATS = 5
SEED = 20261201
OUT = ROOT / "benchmarks" / "results" / "allocator_speed.md"


def random_trace(n_events: int, live_target: int, seed: int) -> list[tuple[int, int]]:
    rng = random.Random(seed)
    events: list[tuple[int, int]] = []
    live: list[int] = []
    next_key = 0
    max_log = math.log(64 * MIB)
    while len(events) < n_events - len(live):
        if live and (len(live) >= 2 * live_target or rng.random() < len(live) / (2 * live_target)):
            i = rng.randrange(len(live))
            live[i], live[-1] = live[-1], live[i]
            events.append((live.pop(), FREE))
        else:
            events.append((next_key, max(1, int(math.exp(rng.uniform(0, max_log))))))
            live.append(next_key)
            next_key += 1
    events.extend((key, FREE) for key in live)
    return events


def time_replay(events, **kwargs) -> tuple[list[float], object]:
    times = []
    result = None
    for _ in range(REPEATS):
        start = time.perf_counter()
        result = replay(events, **kwargs)
        times.append(time.perf_counter() - start)
    return times, result


class _EventByEvent:
    """What `time_replay` reads from a replay, for an allocator driven one call per event."""

    def __init__(self, allocator: CachingAllocator, events: int):
        self.events_replayed = events
        self.peak_allocated_bytes = allocator.peak_allocated_bytes
        self.peak_reserved_bytes = allocator.peak_reserved_bytes
        self.out_of_memory = False


def time_event_by_event(events) -> tuple[list[float], _EventByEvent]:
    times = []
    allocator = None
    for _ in range(REPEATS):
        start = time.perf_counter()
        allocator = CachingAllocator()
        malloc, free = allocator.malloc, allocator.free
        for key, nbytes in events:
            if nbytes == FREE:
                free(key)
            else:
                malloc(key, nbytes)
        times.append(time.perf_counter() - start)
    return times, _EventByEvent(allocator, len(events))


def main() -> None:
    events = random_trace(EVENTS, LIVE, SEED)
    free_run = replay(events)
    # 90% of the unlimited reserved peak: the trace fits only by releasing cached segments.
    capacity = free_run.peak_reserved_bytes * 9 // 10
    cases = [
        ("expandable_segments:False, unlimited", {}),
        ("expandable_segments:True, unlimited", {"expandable_segments": True}),
        (f"expandable_segments:False, capacity {format_bytes(capacity)}", {"capacity_bytes": capacity}),
    ]
    cases.append(("expandable_segments:False, unlimited, `malloc` and `free` called per event (reference)", None))
    rows = []
    for label, kwargs in cases:
        times, result = time_replay(events, **kwargs) if kwargs is not None else time_event_by_event(events)
        median = statistics.median(times)
        rows.append(
            f"| {label} | {result.events_replayed:,} | {median * 1e3:.0f} | {max(times) * 1e3:.0f} "
            f"| {result.events_replayed / median:,.0f} | {format_bytes(result.peak_allocated_bytes)} "
            f"| {format_bytes(result.peak_reserved_bytes)} | {'OOM' if result.out_of_memory else 'fits'} |"
        )
        print(rows[-1])
    text = "\n".join([
        "# CUDA caching allocator model: replay speed",
        "",
        (f"Machine: {platform.machine()}, Python {platform.python_version()}; "
        "command: `python benchmarks/allocator_speed.py`."),
        "",
        (f"Trace: {len(events):,} random events (seed {SEED}), sizes log-uniform 1 B - 64 MiB, "
        f"about {LIVE} tensors live; median and slowest of {REPEATS} replays "
        "(pure Python, shared 2-core machine)."),
        "",
        ("| settings | events replayed | median (ms) | slowest (ms) | events/s (median) "
        "| peak allocated | peak reserved | outcome |"),
        "|---|---:|---:|---:|---:|---:|---:|---|",
        *rows,
        "",
        f"Unlimited capacity as a reference: peak reserved {free_run.peak_reserved_bytes / GIB:.2f} GiB.",
        "",
    ])
    OUT.write_text(text)
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
