"""How long one estimate takes on a catalog model's shipped probe table, and, where this
version has it (planner.probe.table.compile_polys), the table's polynomials evaluated term by
term (poly_value) against the generated function: DistilBERT's default CUDA scenario (the
dashboard's first plan). The estimate part runs on any version of the planner, so it times
an older commit too (check it out in a worktree and run this file from there).

Run: python benchmarks/estimate_speed.py [--out FILE]   (default benchmarks/results/estimate_speed.md)
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

MODEL, TASK = "distilbert-base-cased", "sequence-classification"
REPEATS = 300


def median_us(run, repeats: int = REPEATS) -> float:
    times = []
    for i in range(repeats):
        t0 = time.perf_counter()
        run(i)
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "estimate_speed.md"))
    args = parser.parse_args()
    from planner.estimate import estimate
    from planner.loading import load_model_shape
    from planner.probe import table as tables
    from planner.probe.cache import config_digest, technique_key
    from planner.scenario import Task, scenario_from_values

    shape = load_model_shape(MODEL, Task(TASK))
    scenario = scenario_from_values(task=TASK, batch_size=8, seq_len=512, device="cuda")
    estimate(shape, scenario)  # loads the shipped table
    estimate_us = median_us(lambda i: estimate(shape, dataclasses.replace(scenario, batch_size=1 + i % 200)))
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    lines = ["# Estimate speed", "",
             f"Command: `python benchmarks/estimate_speed.py`; commit {commit}; "
             f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; Python {sys.version.split()[0]}.", "",
             f"{MODEL}, {TASK}, CUDA, 512 tokens, batch 1-200, its shipped table: one estimate, median of "
             f"{REPEATS}: **{estimate_us:.0f} us**.", ""]
    if hasattr(tables, "compile_polys"):
        data = json.loads((ROOT / "planner" / "catalog" / "probes" / f"{config_digest(shape)}.json").read_text())
        table = tables.ProbeTable.from_json(data[technique_key(shape, scenario)])
        walk = list(table.initial) + [p for segment in table.segments.values()
                                      for p in segment.delta + tuple(q for c in segment.candidates for q in c)]
        lines += ["| polynomials | count | term by term (poly_value), median (us) | generated (compile_polys), median (us) |",
                  "|---|---:|---:|---:|"]
        for name, polys in (("the walk's", walk), ("the trace's allocation sizes", list(table.trace.polys))):
            generated = tables.compile_polys(polys)
            assert list(generated(8, 512)) == [tables.poly_value(p, 8, 512) for p in polys]
            by_term = median_us(lambda i: [tables.poly_value(p, 8, 512) for p in polys])
            compiled = median_us(lambda i: generated(8, 512))
            lines.append(f"| {name} | {len(polys):,} | {by_term:.0f} | {compiled:.0f} |")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
