"""Planner speed: start-up (reading a catalog model's shipped shapes),
the first probe of each technique class (CPU and CUDA kernels; shipped tables and caches bypassed,
so this is what an uploaded config costs), apart from the cost of one estimate once
loaded, plus a 1,000-line `planner batch` run end to end. Writes benchmarks/results/speed.md.

With --shipped the catalog's shipped probe tables are used, as for a catalog model in the
dashboard: the first use of a class is reading its table, and the per-scenario column is
what every later estimate costs. Writes benchmarks/results/speed_shipped.md.

Run: python benchmarks/speed.py [--shipped]
"""

from __future__ import annotations

import itertools
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
RESULTS = ROOT / "benchmarks" / "results" / "speed.md"
MODELS = ["distilbert-base-cased", "gpt2", "llama-2-7b", "llama-2-70b"]


def _scenarios(task: str) -> list[dict]:
    grid = itertools.product([1, 2, 4, 8, 16], [128, 256, 512], ["adamw", "adafactor", "adamw8bit", "sgd"],
                             ["fp32", "bf16-mixed", "bf16"], [False, True], [1, 4], ["sdpa", "eager"], ["cpu", "cuda"])
    out = [dict(task=task, batch_size=b, seq_len=s, optimizer=o, precision=p, gradient_checkpointing=c,
                grad_accum=k, attn=a, device=d) for b, s, o, p, c, k, a, d in grid
           # SDPA only, and on CPU two optimizers: twelve probed technique classes per device keep
           # the first-load part to minutes (CUDA plans take every optimizer: their step is mostly
           # read from torch's code).
           if a == "sdpa" and (d == "cuda" or o in ("adamw", "adamw8bit"))]
    return out[:1000]


def layout_blocks(shape) -> tuple[int, ...]:
    from planner.probe.run import layout_for
    from planner.shapes_from_config import load_transformers_config

    config = load_transformers_config(json.loads(shape.source_config), shape.task, shape.num_labels)
    return layout_for(config).probed


def _best_of_three(path: Path) -> float:
    """Wall time of a `planner batch` run, best of three (process start-up is noisy)."""
    times = []
    for _ in range(3):
        t0 = time.perf_counter()
        subprocess.run([sys.executable, "-m", "planner", "batch", str(path)], cwd=ROOT, check=True, capture_output=True)
        times.append(time.perf_counter() - t0)
    return min(times)


def main() -> None:
    shipped = "--shipped" in sys.argv[1:]
    started = time.perf_counter()
    from planner import Task, estimate, load_model_shape, scenario_from_values

    import_s = time.perf_counter() - started
    from planner.probe import cache

    if not shipped:
        cache.SHIPPED_DIR = Path(tempfile.mkdtemp(prefix="no-shipped-"))
    os.environ["PLANNER_DATA_DIR"] = tempfile.mkdtemp(prefix="planner-speed-")
    rows, probes = [], []
    for name in MODELS:
        task = Task.SEQUENCE_CLASSIFICATION if name.startswith("distilbert") else Task.CAUSAL_LM
        t0 = time.perf_counter()
        shape = load_model_shape(name, task, 2)
        load_s = time.perf_counter() - t0
        scenarios = [scenario_from_values(**values) for values in _scenarios(task.value)]
        # First use of each technique class probes it once, and of each optimizer and precision its
        # step's temporaries where they are probed (every CPU loop; Adafactor's on CUDA too).
        class_s, step_s, seen, unshipped = [], [], set(), 0
        for scenario in scenarios:
            technique = cache.technique_key(shape, scenario)
            wanted = {technique, cache.step_key(shape, scenario)}
            if not wanted <= seen:
                unshipped += shipped and not cache.is_ready(shape, scenario)  # probed after all
                t1 = time.perf_counter()
                estimate(shape, scenario)
                (step_s if technique in seen else class_s).append(time.perf_counter() - t1)
                seen |= wanted
        probes.append((name, len(layout_blocks(shape)), class_s, step_s, unshipped))
        timings = []
        for scenario in scenarios:
            t1 = time.perf_counter()
            estimate(shape, scenario).to_json()
            timings.append(time.perf_counter() - t1)
        rows.append((name, shape.num_parameters, load_s, statistics.median(timings), max(timings), sum(timings)))

    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "scenarios.jsonl"
        path.write_text("\n".join(json.dumps({"config": "llama-2-7b", **values}) for values in _scenarios("causal-lm")))
        one = Path(folder) / "one.jsonl"
        one.write_text(json.dumps({"config": "llama-2-7b", **_scenarios("causal-lm")[0]}))
        batch_one_s = _best_of_three(one)
        batch_thousand_s = _best_of_three(path)

    lines = [
        "# Planner speed" + (" with the catalog's shipped probe tables" if shipped else ""), "",
        f"Machine: {platform.machine()}, {platform.python_implementation()} {platform.python_version()}; "
        f"command: `python benchmarks/speed.py{' --shipped' if shipped else ''}`; "
        f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}.", "",
        f"Import of `planner` (lazy: torch/transformers load with the first shape): {import_s * 1000:.0f} ms.", "",
        "| model | parameters | start-up: build shapes (s) | per scenario, median (µs) | per scenario, max (µs) | 1,000 scenarios (ms) |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for name, params, load_s, median_s, max_s, total_s in rows:
        lines.append(f"| {name} | {params:,} | {load_s:.2f} | {median_s * 1e6:.0f} | {max_s * 1e6:.0f} | {total_s * 1000:.0f} |")
    lines += [
        "",
        ("Start-up reads each catalog model's shipped shape (`planner/catalog/shapes/`): nothing imports torch or "
         "transformers for it (a config outside the catalog imports both, then builds its shape on the meta device)."),
        "",
        ("First use of each technique class of a catalog model, CPU and CUDA kernels: reading its shipped table "
         "(and its optimizer step's where that is probed); another optimizer of a class only its step's:" if shipped else
         "First load of an uncached config (shipped tables bypassed), CPU and CUDA kernels: a new technique class "
         "costs the probe (three fake-tensor steps of the reduced model) and its optimizer's step where that is probed "
         "(every CPU loop; Adafactor's on CUDA); another optimizer of a class already probed only its step, if any:"), "",
        "| model | probed blocks | new class: median (s) | new class: max (s) | classes | another optimizer: median (s) |"
        + (" of them probed (not shipped) |" if shipped else ""),
        "|---|---:|---:|---:|---:|---:|" + ("---:|" if shipped else ""),
    ]
    digits = 3 if shipped else 1  # reading a table takes milliseconds, a probe seconds

    def seconds(values: list[float], pick) -> str:
        return f"{pick(values):.{digits}f}" if values else "-"

    for name, blocks, class_s, step_s, unshipped in probes:
        lines.append(f"| {name} | {blocks} | {seconds(class_s, statistics.median)} | {seconds(class_s, max)} | "
                     f"{len(class_s)} | {seconds(step_s, statistics.median)} |" + (f" {unshipped} |" if shipped else ""))
    lines += [
        "",
        f"`python -m planner batch` end to end (llama-2-7b): 1 line {batch_one_s:.2f} s, 1,000 lines {batch_thousand_s:.2f} s: "
        f"the 999 extra scenarios add {max(batch_thousand_s - batch_one_s, 0):.2f} s (best of three runs each).",
    ]
    out = RESULTS.with_name("speed_shipped.md") if shipped else RESULTS
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
