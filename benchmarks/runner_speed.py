"""How long verification runs take on this machine, end to end through the CLI
(`python -m runners verify ... --json`: child process start, model build, steps, measure).

- distilbert-base-cased (2 labels), batch 8 x 128, AdamW, 3 steps, real CPU run (`cpu`);
- Llama-2-7B shape, batch 1 x 2048, bf16 autocast, gradient checkpointing, one
  steady-state step simulated on fake tensors (`simulate`, steps=2: step 1 builds the
  optimizer state, step 2 is measured).

Writes benchmarks/results/runner_speed.md. Run: python benchmarks/runner_speed.py
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results" / "runner_speed.md"

RUNS = [
    ("distilbert-base-cased, 8 x 128, AdamW fp32, 3 steps", "cpu",
     ["--config", "distilbert-base-cased", "--task", "sequence-classification", "--num-labels", "2",
      "--batch-size", "8", "--seq-len", "128", "--optimizer", "adamw", "--steps", "3", "--mode", "cpu"]),
    ("Llama-2-7B, 1 x 2048, AdamW bf16-mixed, checkpointing, 1 steady-state step", "simulate",
     ["--config", "llama-2-7b", "--task", "causal-lm", "--batch-size", "1", "--seq-len", "2048",
      "--optimizer", "adamw", "--precision", "bf16-mixed", "--gradient-checkpointing", "--steps", "2",
      "--mode", "simulate"]),
]


def main() -> None:
    rows = []
    with tempfile.TemporaryDirectory() as data_dir:
        env = {**os.environ, "PLANNER_DATA_DIR": data_dir}
        for label, mode, flags in RUNS:
            print(f"running: {label} ({mode})", flush=True)
            started = time.perf_counter()
            completed = subprocess.run([sys.executable, "-m", "runners", "verify", *flags, "--json", "--timeout", "900"],
                                       cwd=ROOT, env=env, capture_output=True, text=True)
            wall = time.perf_counter() - started
            result = json.loads(completed.stdout.strip().splitlines()[-1])
            measured = result.get("measured") or {}
            rows.append((label, result["mode"], result["status"], wall, measured.get("run_wall_s"),
                         measured.get("peak_bytes"), result["estimated"]["peak_bytes"]))
    lines = ["# Verification run speed", "",
             f"Machine: {os.cpu_count()} cores, {platform.machine()}, Python {platform.python_version()}; "
             "command: `python benchmarks/runner_speed.py`.", "",
             "| run | mode | status | wall, end to end (s) | build + steps + measure in the child (s) | measured peak (B) | estimated peak (B) |",
             "|---|---|---|---:|---:|---:|---:|"]
    for label, mode, status, wall, child, measured, estimated in rows:
        child_text = f"{child:.1f}" if child is not None else "n/a"
        measured_text = f"{measured:,}" if measured is not None else "n/a"
        lines.append(f"| {label} | {mode} | {status} | {wall:.1f} | {child_text} | {measured_text} | {estimated:,} |")
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
