"""Randomized differential benchmark: the planner against simulated steps on scenarios
drawn at random over the whole input space.

Every catalog model up to --max-params (default 8e9), its tasks, every optimizer,
precision, checkpointing, accumulation, attention implementation (SDPA only where the
model has it) and training loop, batch and sequence at random. The lessons' loop is
measured on fake tensors (`simulate`, byte-identical to real CPU tensors,
tests/test_simulate.py); the Trainer reads loss values with `.item()`, so its scenarios
run on real CPU tensors, on models small enough for this machine. Each row says how the
estimate was obtained (`probed`, `modelled`, `generic`). Mixture-of-experts models are
drawn like the others: transformers' grouped expert matmul allocates the same whatever the
routing, so fake tensors measure them exactly (planner/probe/fake_mode.py).
Writes benchmarks/results/random_differential.{md,csv,png} and the run's state
(random_differential.json) after every scenario; `--resume` replays the same draws and
goes on after the last one measured, so a long run can span several sittings.

`--devices cpu,cuda` (or `cuda`) also draws the device: a CUDA scenario is estimated as a
CUDA plan and measured as a simulated step on CUDA's kernels (planner.probe.fake_cuda, the
lessons' loop), and the run writes random_differential_<devices>.* beside the CPU run's.
A CUDA estimate rounds each weight, gradient and optimizer state tensor up to the caching
allocator's 512-byte blocks, which the simulated step does not: it reads up to 2 KiB per
parameter tensor high (0.0001% on a 7B model).

`--redo NAME[,NAME...]` replays the draws of the stored run of these --devices and measures again
only the scenarios already drawn for these catalog models, in place (after a change that moves
those models' measurements as well as their estimates: the table stays one run, with the models
re-run and when named under it). `--redo-optimizers NAME[,NAME...]` does the same for the
scenarios drawn with these optimizers (after a change to one optimizer's estimate).

`--precisions` chooses the precisions drawn (default fp32, bf16-mixed and bf16; fp16-mixed may
be named too); a run of another set writes files of its own (random_differential_cuda_fp16-mixed.*
for `--devices cuda --precisions fp16-mixed`), so the default runs stay as drawn.

Run: python benchmarks/random_differential.py [--count 300] [--seed S] [--max-params 8e9]
[--devices cpu|cuda|cpu,cuda] [--precisions P,...] [--resume | --redo NAMES | --redo-optimizers NAMES]
"""

from __future__ import annotations

import argparse
import csv
import json
import random
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from accuracy import plot, run_one  # noqa: E402
from planner.catalog import catalog_entries  # noqa: E402
from planner.loading import load_model_shape  # noqa: E402
from planner.scenario import Task  # noqa: E402
from runners.request import Mode  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"
OPTIMIZERS = ("adamw", "adamw-fused", "adam", "sgd", "adafactor", "hf-adafactor", "adam8bit", "adamw8bit")
PRECISIONS = ("fp32", "bf16-mixed", "bf16")  # drawn by default; --precisions may name fp16-mixed too
ALL_PRECISIONS = (*PRECISIONS, "fp16-mixed")
REAL_CPU_LIMIT = 200_000_000  # parameters: Trainer scenarios run on real tensors
DEVICES = ("cpu", "cuda")


def _stem(devices: list[str], precisions: list[str] = PRECISIONS) -> str:
    """Result files' name: the CPU run keeps its own, another device set or precision set gets
    its own files."""
    stem = "random_differential" if list(devices) == ["cpu"] else "random_differential_" + "_".join(devices)
    return stem if tuple(precisions) == PRECISIONS else stem + "_" + "_".join(precisions)


def _models(max_params: float) -> list[tuple[str, Task, object]]:
    models = []
    for name, entry in catalog_entries().items():
        shape = load_model_shape(name, entry.default_task)
        if shape.num_parameters <= max_params:
            tasks = ([Task.SEQUENCE_CLASSIFICATION, Task.MASKED_LM] if entry.family == "encoder"
                     else [Task.CAUSAL_LM])
            models.append((name, tasks, shape))
    return models


def draw(rng: random.Random, models: list, devices: list[str],
         precisions: list[str] = PRECISIONS) -> tuple[str, Mode, dict]:
    name, tasks, shape = rng.choice(models)
    small = shape.num_parameters <= REAL_CPU_LIMIT
    engine = "trainer" if small and rng.random() < 0.3 else "accelerate"
    limit = min(shape.max_positions or 4096, 4096)
    values = dict(task=rng.choice(tasks).value, batch_size=rng.choice([1, 1, 2, 3, 4, 8]),
                  seq_len=rng.randint(8, limit if engine == "accelerate" else min(limit, 256)),
                  optimizer=rng.choice(OPTIMIZERS), precision=rng.choice(precisions),
                  gradient_checkpointing=rng.random() < 0.4, grad_accum=rng.choice([1, 1, 2, 4]),
                  attn="eager" if not shape.supports_sdpa or rng.random() < 0.3 else "sdpa")
    if engine == "trainer":
        values["engine"] = "trainer"
        values["batch_size"] = min(values["batch_size"], 2)
    if devices != ["cpu"]:  # drawn last and only then: a CPU run's draws stay what they were
        values["device"] = rng.choice(devices) if engine == "accelerate" else "cpu"
    return name, Mode.CPU if engine == "trainer" else Mode.SIMULATE, values


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--count", type=int, default=300)
    parser.add_argument("--seed", type=int, default=random.SystemRandom().randrange(2**32))
    parser.add_argument("--max-params", type=float, default=8e9)
    parser.add_argument("--devices", default="cpu",
                        help="comma-separated devices to draw from: cpu (default), cuda, or cpu,cuda")
    parser.add_argument("--precisions", default=",".join(PRECISIONS),
                        help=f"comma-separated precisions to draw from, of {', '.join(ALL_PRECISIONS)} "
                             f"(default {','.join(PRECISIONS)}); another set writes files of its own")
    parser.add_argument("--resume", action="store_true",
                        help="go on with the run of these --devices and --precisions (its count, seed and size limit)")
    parser.add_argument("--redo", default="",
                        help="comma-separated catalog names: measure their drawn scenarios again, in place")
    parser.add_argument("--redo-optimizers", default="",
                        help="comma-separated optimizers: measure the drawn scenarios with them again, in place")
    args = parser.parse_args()
    devices = [d for d in DEVICES if d in args.devices.split(",")]
    if not devices or set(args.devices.split(",")) - set(DEVICES):
        parser.error(f"--devices takes {', '.join(DEVICES)} or both, comma-separated: not {args.devices!r}")
    precisions = [p for p in ALL_PRECISIONS if p in args.precisions.split(",")]
    if not precisions or set(args.precisions.split(",")) - set(ALL_PRECISIONS):
        parser.error(f"--precisions takes some of {', '.join(ALL_PRECISIONS)}, comma-separated: "
                     f"not {args.precisions!r}")
    if args.redo or args.redo_optimizers:
        names = [name for name in args.redo.split(",") if name]
        optimizers = [name for name in args.redo_optimizers.split(",") if name]
        unknown = set(names) - set(catalog_entries())
        if unknown:
            parser.error(f"--redo takes catalog names: not {', '.join(sorted(unknown))}")
        if set(optimizers) - set(OPTIMIZERS):
            parser.error(f"--redo-optimizers takes {', '.join(OPTIMIZERS)}: not "
                         f"{', '.join(sorted(set(optimizers) - set(OPTIMIZERS)))}")
        redo(json.loads((RESULTS / f"{_stem(devices, precisions)}.json").read_text()), names, optimizers)
        return
    state = {"count": args.count, "seed": args.seed, "max_params": args.max_params, "drawn": 0, "minutes": 0.0,
             "rows": [], "failures": [], "devices": devices, "precisions": precisions}
    if args.resume:
        state = json.loads((RESULTS / f"{_stem(devices, precisions)}.json").read_text())
        state.setdefault("devices", ["cpu"])  # runs begun before devices were drawn
    rng = random.Random(state["seed"])
    models = _models(state["max_params"])
    resumed = f", going on after scenario {state['drawn']}" if args.resume else ""
    print(f"seed {state['seed']}: {state['count']} scenarios over {len(models)} models{resumed}", flush=True)
    started = time.perf_counter()
    for index in range(1, state["count"] + 1):
        model, mode, values = draw(rng, models, state["devices"], _precisions(state))
        if index <= state["drawn"]:
            continue  # measured in an earlier sitting: the draw is replayed so the sequence stays the same
        print(f"[{index}/{state['count']}] {model} ({mode.value}) {values}", flush=True)
        try:
            state["rows"].append(run_one(model, mode, dict(values)))
            print(f"    error {state['rows'][-1]['error_pct']:+.4f}% ({state['rows'][-1]['method']}) "
                  f"in {state['rows'][-1]['seconds']} s", flush=True)
        except Exception as error:  # a scenario the planner or the runner refuses: listed, not hidden
            state["failures"].append([model, values, f"{type(error).__name__}: {str(error).splitlines()[0][:160]}"])
            print(f"    refused: {state['failures'][-1][2]}", flush=True)
        state["drawn"] = index
        state["minutes"] += (time.perf_counter() - started) / 60
        started = time.perf_counter()
        _write(state)  # after every scenario: a stopped run keeps its rows and can --resume


def redo(state: dict, names: list[str], optimizers: list[str] = ()) -> None:
    """Measure again, in place, the drawn scenarios of the models `names` and those with the
    `optimizers` (module doc). The draws are replayed from the run's seed; a draw is matched to
    its row, or to its failure, in order."""
    state.setdefault("devices", ["cpu"])
    rng = random.Random(state["seed"])
    models = _models(state["max_params"])
    failed = [[model, values] for model, values, _ in state["failures"]]
    row = 0
    redone = 0
    print(f"seed {state['seed']}: measuring again the drawn scenarios of {_redone_label(names, optimizers)}",
          flush=True)
    for index in range(1, state["drawn"] + 1):
        model, mode, values = draw(rng, models, state["devices"], _precisions(state))
        if [model, values] in failed:
            continue  # refused when drawn: stays listed as it was
        if state["rows"][row]["model"] != model:
            raise SystemExit(f"scenario {index} draws {model} where the stored run has "
                             f"{state['rows'][row]['model']}: not the same run")
        if model in names or values.get("optimizer") in optimizers:
            print(f"[{index}/{state['drawn']}] {model} ({mode.value}) {values}", flush=True)
            before = state["rows"][row]["error_pct"]
            state["rows"][row] = run_one(model, mode, dict(values))
            redone += 1
            print(f"    error {before:+.4f}% -> {state['rows'][row]['error_pct']:+.4f}% "
                  f"in {state['rows'][row]['seconds']} s", flush=True)
            _write(state)
        row += 1
    state.setdefault("redone", []).append({"models": names, "optimizers": list(optimizers), "scenarios": redone,
                                           "date": time.strftime("%Y-%m-%d")})
    _write(state)


def _precisions(state: dict) -> list[str]:
    return state.get("precisions", list(PRECISIONS))  # runs begun before precisions were chosen drew these


def _redone_label(names: list[str], optimizers: list[str]) -> str:
    return "; ".join(part for part in (", ".join(names),
                                       optimizers and "optimizer " + " or ".join(optimizers)) if part)


def _state_exact(row: dict) -> bool:
    # Rows written before state_rounding_bytes was recorded are CPU rows (no rounding).
    difference = row["estimated_state_bytes"] - row["measured_state_bytes"]
    return -row.get("state_cpu_hosted_bytes", 0) <= difference <= row.get("state_rounding_bytes", 0)


def _write(state: dict) -> None:
    RESULTS.mkdir(parents=True, exist_ok=True)
    stem = _stem(state.get("devices", ["cpu"]), _precisions(state))
    (RESULTS / f"{stem}.json").write_text(json.dumps(state, indent=1) + "\n")
    rows, failures = state["rows"], state["failures"]
    if not rows:
        return
    with (RESULTS / f"{stem}.csv").open("w", newline="") as handle:
        # Every row's fields, in first-seen order: rows measured before a field was recorded lack it.
        writer = csv.DictWriter(handle, fieldnames=list(dict.fromkeys(key for row in rows for key in row)))
        writer.writeheader()
        writer.writerows(rows)
    plot(rows, RESULTS / f"{stem}.png")
    errors = [abs(r["error_pct"]) for r in rows]
    devices = state.get("devices", ["cpu"])
    devices_flag = "" if devices == ["cpu"] else f" --devices {','.join(devices)}"
    if tuple(_precisions(state)) != PRECISIONS:
        devices_flag += f" --precisions {','.join(_precisions(state))}"
    cuda_note = ("; `device=cuda` rows: the lessons' loop simulated on CUDA's kernels (sm80), against a CUDA "
                 "plan, which rounds each weight, gradient and state tensor to 512 B (the simulated step does "
                 "not)") if "cuda" in devices else ""
    families = sorted({load_model_shape(r["model"], Task(r["task"])).model_type for r in rows})
    lines = ["# Randomized differential benchmark: planner against simulated steps", "",
             f"Command: `python benchmarks/random_differential.py --count {state['count']} --seed {state['seed']} "
             f"--max-params {state['max_params']:g}{devices_flag}` (then `--resume` until done): the first "
             f"{state['drawn']} of {state['count']} drawn scenarios, {state['minutes']:.0f} min on 2 CPU cores. "
             "Measured: MemTracker over one steady-state step (`simulate`: fake tensors; `cpu`: real tensors, "
             "the Trainer's scenarios)" + cuda_note + ". Error = (estimated - measured) / measured."
             + "".join(f" Measured again on {r['date']} (`--redo`, {r['scenarios']} scenarios): "
                       f"{_redone_label(r['models'], r.get('optimizers', []))}." for r in state.get("redone", [])), "",
             f"**{len(rows)} scenarios, {len(families)} model types ({', '.join(families)}), "
             f"{min(r['parameters'] for r in rows) / 1e6:,.0f}M to {max(r['parameters'] for r in rows) / 1e9:,.1f}B "
             f"parameters: median absolute peak error {statistics.median(errors):.4f}%, maximum {max(errors):.4f}%; "
             f"optimizer state equal to the byte in {sum(_state_exact(r) for r in rows)} of {len(rows)}"
             f"{' (CUDA rows: up to the plan' + chr(39) + 's 512-byte rounding per state tensor, and the CPU-hosted step scalars the simulated step counts)' if cuda_note else ''}.**",
             ""]
    for method in sorted({r["method"] for r in rows}):
        chosen = [abs(r["error_pct"]) for r in rows if r["method"] == method]
        lines.append(f"- `{method}`: {len(chosen)} scenarios, median {statistics.median(chosen):.4f}%, "
                     f"maximum {max(chosen):.4f}%")
    if failures:
        lines += ["", f"Refused or failed ({len(failures)}):", ""]
        lines += [f"- {model} {values}: {reason}" for model, values, reason in failures]
    lines += ["", f"![estimated vs measured]({stem}.png)", "",
              "| model | mode | task | batch x seq | technique | method | estimated (B) | measured (B) | error |",
              "|---|---|---|---|---|---|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['model']} | {r['mode']} | {r['task']} | {r['batch']} x {r['seq']} | {r['technique']} | "
                     f"{r['method']} | {r['estimated_peak_bytes']:,} | {r['measured_peak_bytes']:,} | "
                     f"{r['error_pct']:+.4f}% |")
    (RESULTS / f"{stem}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines[:12]))


if __name__ == "__main__":
    main()
