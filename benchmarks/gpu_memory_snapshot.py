"""On a CUDA GPU: which allocations make a scenario's allocated peak, one by one.

For each scenario of benchmarks/gpu_check.py named with --only, a fresh child process
(PYTORCH_CUDA_ALLOC_CONF as the scenario sets it) records torch's allocator history
(`torch.cuda.memory._record_memory_history`, Python stacks) over a verification run of the
scenario (runners.measure, in-process, 3 steps), replays the recorded trace
(alloc +size, free_completed -size: torch's memory_allocated) to the moment of its maximum,
and lists what is live then, largest first, with the Python frames that allocated it
(none for the autograd engine's thread: backward runs in C++). Written to
<out>/gpu_memory_snapshot.json and .md. It finds the tensor behind an estimate that is off
(benchmarks/results/gpu_check.md). The whole recorded trace goes to
<out>/traces/<id>.json.gz too, one [action, address, bytes, innermost frame] per event
(alloc, free_requested, free_completed, segment_alloc/free, segment_map/unmap), to be
compared offline, event by event, with the planner's expansion of the probe's trace
(an order that differs shows as a reserved peak the replay does not reach).

    bash benchmarks/gpu_check.sh --script benchmarks/gpu_memory_snapshot.py --only ID[,ID...] [--out DIR]
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

LIVE_LISTED = 40  # allocations listed at the peak, largest first
FRAMES_KEPT = 4  # innermost Python frames kept per allocation, torch's own dispatch frames skipped
SKIPPED_FRAME_PARTS = ("torch/utils/_device.py", "torch/_tensor.py", "torch/cuda/memory.py", "torch/_ops.py")
HISTORY_ENTRIES = 2_000_000
STEPS = 3
CHILD_TIMEOUT_S = 240


def _frames(entry: dict) -> list[str]:
    kept = []
    for frame in entry.get("frames") or []:
        name = frame.get("filename", "")
        if any(part in name for part in SKIPPED_FRAME_PARTS) or name.startswith("<"):
            continue
        short = name.split("site-packages/")[-1].replace(str(ROOT) + "/", "")
        kept.append(f"{short}:{frame.get('line')} {frame.get('name')}")
        if len(kept) == FRAMES_KEPT:
            break
    return kept


def live_at_peak(trace: list[dict]) -> tuple[int, int, list[dict]]:
    """(peak allocated bytes, its event index, the allocations live then) of a device trace."""
    live: dict[int, dict] = {}
    allocated = peak = 0
    peak_index = -1
    peak_live: list[dict] = []
    for index, entry in enumerate(trace):
        action = entry.get("action")
        if action == "alloc":
            live[entry["addr"]] = entry
            allocated += entry["size"]
            if allocated > peak:
                peak, peak_index = allocated, index
                peak_live = list(live.values())
        elif action == "free_completed" and entry["addr"] in live:
            allocated -= live.pop(entry["addr"])["size"]
    return peak, peak_index, peak_live


def compact_trace(trace: list[dict]) -> list[list]:
    """[action, address, bytes, innermost kept frame or ""] per event of a device trace."""
    return [[entry.get("action"), entry.get("addr"), entry.get("size"), (_frames(entry) or [""])[0]]
            for entry in trace]


def child(spec_id: str, trace_dir: Path | None = None) -> dict:
    """One scenario with the history recorded (runs in a fresh process)."""
    import torch

    import gpu_check
    from planner.config_source import resolve_config
    from runners.measure import measure_in_process
    from runners.request import Engine, Mode

    spec = next(s for s in gpu_check.SCENARIOS if s["id"] == spec_id)
    config, name = resolve_config(spec["model"], base_dir=ROOT)
    torch.cuda.memory._record_memory_history(max_entries=HISTORY_ENTRIES, stacks="python")
    started = time.monotonic()
    result = measure_in_process(config, name, {**spec["values"], "device": "cuda"}, Mode.CUDA,
                                Engine(spec["engine"]), steps=STEPS)
    snapshot = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(enabled=None)
    trace = snapshot["device_traces"][torch.cuda.current_device()]
    if trace_dir is not None:
        trace_dir.mkdir(parents=True, exist_ok=True)
        with gzip.open(trace_dir / f"{spec_id}.json.gz", "wt") as handle:
            json.dump({"id": spec_id, "alloc_conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF"), "steps": STEPS,
                       "max_memory_reserved_bytes": torch.cuda.max_memory_reserved(),
                       "events": compact_trace(trace)}, handle)
    peak, index, live = live_at_peak(trace)
    live.sort(key=lambda entry: -entry["size"])
    by_size = Counter(entry["size"] for entry in live)
    return {
        "id": spec_id, "alloc_conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF"),
        "measured_peak_bytes": (result.get("measured") or {}).get("peak_bytes"),
        "max_memory_allocated_bytes": torch.cuda.max_memory_allocated(),
        "trace_events": len(trace), "trace_peak_bytes": peak, "trace_peak_index": index,
        "live_at_peak": len(live), "wall_s": round(time.monotonic() - started, 1),
        "largest": [{"bytes": entry["size"], "frames": _frames(entry)} for entry in live[:LIVE_LISTED]],
        "sizes_repeated": [[size, count] for size, count in by_size.most_common(12) if count > 1],
    }


def markdown(records: list[dict]) -> str:
    lines = ["# Allocations at the allocated peak, on a GPU (benchmarks/gpu_memory_snapshot.py)", ""]
    for record in records:
        lines.append(f"## {record['id']}")
        if "error" in record:
            lines += ["", f"not measured: {record['error']}", ""]
            continue
        lines += ["", f"PYTORCH_CUDA_ALLOC_CONF {record['alloc_conf']}; trace peak {record['trace_peak_bytes']:,} B "
                      f"(max_memory_allocated {record['max_memory_allocated_bytes']:,} B), {record['live_at_peak']} "
                      f"allocations live at event {record['trace_peak_index']:,} of {record['trace_events']:,}.",
                  "", "| bytes | allocated by (innermost Python frames) |", "|---:|---|"]
        lines += [f"| {item['bytes']:,} | {'<br>'.join(item['frames']) or 'no Python frame (autograd engine)'} |"
                  for item in record["largest"]]
        lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", required=True, help="comma-separated benchmarks/gpu_check.py scenario ids")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(child(args.child, args.out / "traces")))
        return 0
    import torch

    import gpu_check

    if not torch.cuda.is_available():
        print("gpu_memory_snapshot: no CUDA device: nothing to record", file=sys.stderr)
        return 2
    ids = [part for part in args.only.split(",") if part]
    known = {spec["id"]: spec for spec in gpu_check.SCENARIOS}
    unknown = [i for i in ids if i not in known]
    if unknown:
        print(f"gpu_memory_snapshot: unknown scenario id(s) {', '.join(unknown)}: see benchmarks/gpu_check.py",
              file=sys.stderr)
        return 2
    records = []
    for number, spec_id in enumerate(ids, 1):
        print(f"[{number}/{len(ids)}] {spec_id}", flush=True)
        env = {**os.environ, "PYTORCH_CUDA_ALLOC_CONF": gpu_check.EXPANDABLE_ON
               if known[spec_id]["expandable_segments"] else gpu_check.EXPANDABLE_OFF}
        try:
            done = subprocess.run([sys.executable, __file__, "--only", spec_id, "--child", spec_id,
                                   "--out", str(args.out)], env=env,
                                  capture_output=True, text=True, timeout=CHILD_TIMEOUT_S, check=False)
            if done.returncode != 0:
                raise RuntimeError(done.stderr.strip().splitlines()[-1] if done.stderr.strip() else
                                   f"exit status {done.returncode}")
            records.append(json.loads(done.stdout.strip().splitlines()[-1]))
        except (RuntimeError, subprocess.TimeoutExpired, json.JSONDecodeError, IndexError) as error:
            records.append({"id": spec_id, "error": f"{type(error).__name__}: {error}"[:500]})
        print("    " + (records[-1].get("error") or f"peak {records[-1]['trace_peak_bytes']:,} B"), flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "gpu_memory_snapshot.json").write_text(json.dumps(records, indent=1) + "\n")
    (args.out / "gpu_memory_snapshot.md").write_text(markdown(records))
    print(f"gpu_memory_snapshot: wrote {args.out}/gpu_memory_snapshot.json and .md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
