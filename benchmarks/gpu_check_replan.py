"""The planner's side of measured GPU check results, recomputed with the planner as it is now.

    .venv/bin/python benchmarks/gpu_check_replan.py RUN.json [RUN.json ...] [--out DIR]

A GPU check (benchmarks/gpu_check.sh) measures on a lent machine and computes the estimates
there, with the planner of that moment. After a fix found by those measurements, this takes
the scenario records of the runs given (a later run's record of a scenario replaces an
earlier one's), keeps every measurement, recomputes each estimate and its errors
(gpu_check.planner_record on the GPU the run detected, gpu_check.scenario_errors) on this
machine, and writes <out>/gpu_check.{json,md} (default benchmarks/results), saying so at the
top of the table: which runs, which commit, which torch computed the estimates (the lent
machine's torch may not be the pinned one). Sub-checks and the environment are the last
run's.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import gpu_check  # noqa: E402


def _commit() -> str:
    done = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                          check=False)
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT, capture_output=True,
                           text=True, check=False).stdout.strip()
    return (done.stdout.strip() or "unknown") + (" with uncommitted changes" if dirty else "")


def merged_records(runs: list[dict]) -> list[dict]:
    """Every scenario's latest record, in gpu_check.SCENARIOS order (then any other id)."""
    latest: dict[str, dict] = {}
    for run in runs:
        for record in run["scenarios"]:
            if record["id"] not in latest or record["status"] == "ok":
                latest[record["id"]] = record
    order = {spec["id"]: i for i, spec in enumerate(gpu_check.SCENARIOS)}
    return sorted(latest.values(), key=lambda r: (order.get(r["id"], len(order)), r["id"]))


def replanned(record: dict, gpu: str, cudnn_version: int | None) -> dict:
    """`record` with its estimate and errors recomputed for the run's GPU and cuDNN (unchanged
    when it holds no measurement)."""
    spec = next((s for s in gpu_check.SCENARIOS if s["id"] == record["id"]), None)
    if spec is None or record["status"] != "ok":
        return record
    planned = gpu_check.planner_record(spec, "cuda", gpu, cudnn_version)
    measured = record["measured"]
    errors = gpu_check.scenario_errors(planned, measured["allocated_peak_bytes"], measured["reserved_peak_bytes"],
                                       measured["optimizer_state_bytes"])
    return {**record, "planner": planned, "errors": errors}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", nargs="+", type=Path, help="gpu_check.json files, oldest first")
    parser.add_argument("--out", type=Path, default=gpu_check.RESULTS)
    args = parser.parse_args(argv)
    try:
        runs = [json.loads(path.read_text()) for path in args.runs]
    except (OSError, json.JSONDecodeError) as error:
        print(f"gpu_check_replan: cannot read a run: {error}", file=sys.stderr)
        return 2
    if any(run.get("mode") != "cuda" for run in runs):
        print("gpu_check_replan: only runs measured on a GPU (mode cuda) are replanned", file=sys.stderr)
        return 2
    started = time.monotonic()
    last = runs[-1]
    records = []
    for number, record in enumerate(merged_records(runs), 1):
        print(f"[{number}] {record['id']}", flush=True)
        records.append(replanned(record, last["gpu"], last["environment"].get("cudnn_version")))
    import torch

    commit = _commit()
    report = {**last, "scenarios": records, "overheads": gpu_check.overheads_summary(records, last["probe"]),
              "replanned": {
                  "runs": [str(path) for path in args.runs], "commit": commit, "torch_here": torch.__version__,
                  "wall_s": round(time.monotonic() - started, 1),
                  "note": (f"measurements from {', '.join(f'`{path}`' for path in args.runs)}; estimates by the "
                           f"planner at commit {commit}, on a machine without a GPU with torch {torch.__version__} "
                           f"(fake CUDA tensors, the run's GPU `{last['gpu']}` and cuDNN "
                           f"{last['environment'].get('cudnn_version')}), by "
                           f"`python benchmarks/gpu_check_replan.py`.")}}
    gpu_check.write_results(report, args.out)
    print(f"gpu_check_replan: wrote {args.out / 'gpu_check.json'} and gpu_check.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
