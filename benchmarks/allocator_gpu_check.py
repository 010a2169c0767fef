"""Checks the CUDA caching allocator model (planner.cuda_allocator) against the real
allocator on a GPU: the same traces replayed as `torch.empty(n, dtype=torch.uint8,
device="cuda")` allocations and `del`s, with `torch.cuda.memory_allocated()` and
`memory_reserved()` compared after every event, and the OOM position compared where a
per-process memory fraction limits the trace.

Traces: a few hand-built ones (the fragmentation and split cases of
tests/test_cuda_allocator.py) and RANDOM seeded random ones (sizes log-uniform 1 B -
64 MiB, about 100 tensors live), each replayed with expandable segments off and on (one
worker process per setting, as PYTORCH_CUDA_ALLOC_CONF is read once), and LIMITED of the
random ones again under `torch.cuda.set_per_process_memory_fraction`.

Needs a CUDA GPU; without one it says so and writes nothing. `--dry-run` replays the
model side only (a smoke test of the script on a machine without a GPU).
Writes benchmarks/results/allocator_gpu_check.md and .json.
Run: python benchmarks/allocator_gpu_check.py [--dry-run]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import random
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from planner.cuda_allocator import (
    FREE,
    AllocatorSettings,
    CachingAllocator,
    CudaOutOfMemoryError,
)
from planner.units import MIB

RANDOM = 40
LIMITED = 10
EVENTS = 300
OUT_MD = ROOT / "benchmarks" / "results" / "allocator_gpu_check.md"
OUT_JSON = ROOT / "benchmarks" / "results" / "allocator_gpu_check.json"


def hand_built() -> dict[str, list]:
    four = 4 * MIB
    return {
        "interleaved 4 MiB, holes": [("a1", four), ("b1", four), ("a2", four), ("b2", four),
                                     ("a3", four), ("a1", FREE), ("a2", FREE), ("a3", FREE),
                                     ("big", 8 * MIB)],
        "grouped 4 MiB, merged": [("a1", four), ("a2", four), ("a3", four), ("b1", four),
                                  ("b2", four), ("a1", FREE), ("a2", FREE), ("a3", FREE),
                                  ("big", 8 * MIB)],
        "split thresholds": [("s1", MIB), ("s2", MIB - 512), ("s3", 512), ("l1", 18 * MIB + MIB // 2),
                             ("l2", MIB + MIB // 2), ("l3", 19 * MIB), ("l4", 11 * MIB)],
        "two 100 MiB then 120 MiB": [("p", 100 * MIB), ("q", 100 * MIB), ("p", FREE), ("q", FREE),
                                     ("r", 120 * MIB)],
        "best fit 12 of 12/14": [("p", 14 * MIB), ("q", 12 * MIB), ("p", FREE), ("q", FREE),
                                 ("r", 11 * MIB), ("s", 13 * MIB)],
    }


def random_trace(seed: int, n_events: int = EVENTS, live_target: int = 100) -> list:
    rng = random.Random(seed)
    events, live, key = [], [], 0
    max_log = math.log(64 * MIB)
    while len(events) < n_events - len(live):
        if live and rng.random() < len(live) / (2 * live_target):
            i = rng.randrange(len(live))
            live[i], live[-1] = live[-1], live[i]
            events.append((live.pop(), FREE))
        else:
            events.append((key, max(1, int(math.exp(rng.uniform(0, max_log))))))
            live.append(key)
            key += 1
    return events + [(k, FREE) for k in live]


def cases() -> list[dict]:
    out = [{"name": name, "events": ev, "allowed": None} for name, ev in hand_built().items()]
    out += [{"name": f"random seed {s}", "events": random_trace(s), "allowed": None}
            for s in range(RANDOM)]
    for s in range(LIMITED):
        events = random_trace(1000 + s)
        peak = replay_model(events, False, None)["peak_reserved"]
        # about 70% of the unlimited reserved peak, at a half MiB so no boundary is exact
        out.append({"name": f"limited seed {1000 + s}", "events": events,
                    "allowed": (peak * 7 // 10) // MIB * MIB + MIB // 2})
    return out


def replay_model(events, expandable: bool, allowed: int | None) -> dict:
    allocator = CachingAllocator(AllocatorSettings(expandable_segments=expandable),
                                 allowed_memory_bytes=allowed)
    seq, oom = [], None
    for i, (key, n) in enumerate(events):
        try:
            if n == FREE:
                allocator.free(key)
            else:
                allocator.malloc(key, n)
        except CudaOutOfMemoryError:
            oom = i
            break
        seq.append((allocator.allocated_bytes, allocator.reserved_bytes))
    return {"seq": seq, "oom": oom, "peak_allocated": allocator.peak_allocated_bytes,
            "peak_reserved": allocator.peak_reserved_bytes}


def worker(expandable: bool, cases_path: Path) -> None:
    import torch

    total = torch.cuda.get_device_properties(0).total_memory
    results = []
    for case in json.loads(cases_path.read_text()):
        torch.cuda.empty_cache()
        start_reserved = torch.cuda.memory_reserved()
        allowed = None
        if case["allowed"] is not None:
            fraction = case["allowed"] / total
            torch.cuda.set_per_process_memory_fraction(fraction)
            allowed = int(fraction * total)  # setMemoryFraction: static_cast<size_t>
        torch.cuda.reset_peak_memory_stats()
        live, seq, oom = {}, [], None
        started = time.perf_counter()
        for i, (key, n) in enumerate(case["events"]):
            key = str(key)
            try:
                if n == FREE:
                    live.pop(key, None)
                else:
                    live[key] = torch.empty(n, dtype=torch.uint8, device="cuda")
            except torch.OutOfMemoryError:
                oom = i
                break
            seq.append((torch.cuda.memory_allocated(), torch.cuda.memory_reserved()))
        results.append({
            "name": case["name"], "seq": seq, "oom": oom, "allowed": allowed,
            "start_reserved": start_reserved,
            "peak_allocated": torch.cuda.max_memory_allocated(),
            "peak_reserved": torch.cuda.max_memory_reserved(),
            "seconds": time.perf_counter() - started,
        })
        live.clear()
        if case["allowed"] is not None:
            torch.cuda.set_per_process_memory_fraction(1.0)
    print(json.dumps({"device": torch.cuda.get_device_name(0), "total": total,
                      "torch": torch.__version__, "results": results}))


def compare(case: dict, measured: dict, expandable: bool) -> dict:
    model = replay_model(case["events"], expandable, measured["allowed"])
    first_diff = next((i for i, (m, r) in enumerate(zip(model["seq"], measured["seq"])) if m != tuple(r)),
                      None)
    if first_diff is None and len(model["seq"]) != len(measured["seq"]):
        first_diff = min(len(model["seq"]), len(measured["seq"]))
    return {
        "name": case["name"], "expandable": expandable, "events": len(case["events"]),
        "exact": first_diff is None, "first_difference": first_diff,
        "oom_model": model["oom"], "oom_measured": measured["oom"],
        "peak_allocated_model": model["peak_allocated"], "peak_allocated_measured": measured["peak_allocated"],
        "peak_reserved_model": model["peak_reserved"], "peak_reserved_measured": measured["peak_reserved"],
        "start_reserved": measured["start_reserved"],
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dry-run", action="store_true")
    parser.add_argument("--worker", choices=["0", "1"])
    parser.add_argument("--cases")
    parser.add_argument("--out", type=Path, default=OUT_MD.parent, help="folder for the results")
    args = parser.parse_args()
    out_md, out_json = args.out / OUT_MD.name, args.out / OUT_JSON.name
    if args.worker is not None:
        worker(args.worker == "1", Path(args.cases))
        return
    all_cases = cases()
    if args.dry_run:
        for expandable in (False, True):
            ooms = sum(replay_model(c["events"], expandable, c["allowed"])["oom"] is not None
                       for c in all_cases)
            print(f"model only, expandable_segments:{expandable}: {len(all_cases)} traces, {ooms} OOM")
        return
    try:
        import torch
    except ImportError:
        print("no torch: nothing measured")
        sys.exit(2)
    if not torch.cuda.is_available():
        print("no CUDA device: nothing measured")
        sys.exit(2)
    cases_path = out_json.with_suffix(".cases.tmp.json")
    cases_path.write_text(json.dumps(all_cases))
    rows, device = [], {}
    try:
        for expandable in (False, True):
            env = dict(os.environ, PYTORCH_CUDA_ALLOC_CONF=f"expandable_segments:{expandable}")
            done = subprocess.run([sys.executable, __file__, "--worker", str(int(expandable)),
                                   "--cases", str(cases_path)], env=env, capture_output=True,
                                  text=True, check=True)
            measured = json.loads(done.stdout.strip().splitlines()[-1])
            device = {k: measured[k] for k in ("device", "total", "torch")}
            rows += [compare(c, m, expandable) for c, m in zip(all_cases, measured["results"])]
    finally:
        cases_path.unlink(missing_ok=True)
    out_json.write_text(json.dumps({"device": device, "rows": rows}, indent=1))
    lines = [
        "# CUDA caching allocator model against the real allocator",
        "",
        (f"Device: {device['device']} ({device['total']:,} B), torch {device['torch']}, "
         f"{platform.python_version()}; command: `python benchmarks/allocator_gpu_check.py`."),
        "",
        "Exact: memory_allocated and memory_reserved equal after every event.",
        "",
        ("| expandable | traces | exact every event | peak allocated equal | peak reserved equal "
         "| OOM index equal | largest peak reserved error |"),
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for expandable in (False, True):
        sel = [r for r in rows if r["expandable"] == expandable]
        worst = max(abs(r["peak_reserved_model"] - r["peak_reserved_measured"]) / max(1, r["peak_reserved_measured"])
                    for r in sel)
        lines.append(
            f"| {expandable} | {len(sel)} | {sum(r['exact'] for r in sel)} "
            f"| {sum(r['peak_allocated_model'] == r['peak_allocated_measured'] for r in sel)} "
            f"| {sum(r['peak_reserved_model'] == r['peak_reserved_measured'] for r in sel)} "
            f"| {sum(r['oom_model'] == r['oom_measured'] for r in sel)} | {worst:.2%} |")
    lines += ["", "Traces that differ (first differing event):", ""]
    lines += [f"- {r['name']}, expandable {r['expandable']}: event {r['first_difference']}, peak reserved "
              f"model {r['peak_reserved_model']:,} vs {r['peak_reserved_measured']:,}"
              for r in rows if not r["exact"]] or ["- none"]
    out_md.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
