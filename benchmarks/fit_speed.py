"""How fast the fit finder answers (planner.fit.find_fits), and how its answer compares
with a simulated (fake-tensor) run of the same scenario, measured in the same run.

- Llama-2-7B shape, causal LM, 2048 tokens, on one 24 GB GPU (the A10 row: 23,028 MiB),
  for three targets: the largest batch, batch 1, effective batch 64 (accumulation 1..64):
  every technique combination (full fine-tuning, LoRA and QLoRA x 4 optimizers x precisions x
  checkpointing x accumulation),
  the risky ones (SGD, pure bf16) allowed so that every one is searched; "best plan" is
  the first by the finder's ranking (fewest and safest changes to AdamW fp32, then step time).
  Timed after the shape is loaded: the first search (it replays the caching allocator for
  each combination's answer), then the median and the slowest of REPEATS more.
- Full fine-tuning of a 7B model fits no 24 GB GPU (bf16 weights and gradients alone are
  25 GiB), so the finder answers "nothing fits"; the simulated run checks the finder's
  smallest plan (batch 1) really is over 24 GB. The same search on an A100 40 GB finds
  plans; the best one is simulated too, at the finder's largest batch.
- The search below a failing answer (planner.fit `_largest_passing`): for each plan the
  A10 "largest batch" search proposes, its largest sequence searched again with the
  replay's verdict alone (stepping down from the live-tensor answer, then bisecting: the
  search before the replay reported its headroom) and with its headroom (regula falsi),
  counting the replays each makes; and the best plan's verdict replayed token by token
  around its answer, where it need not be monotone.

Writes benchmarks/results/fit_speed.md. Run: python benchmarks/fit_speed.py
"""

from __future__ import annotations

import dataclasses
import os
import platform
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from planner.catalog import catalog_config
from planner.device_fit import reserved_check
from planner.finetune import Method
from planner.fit import FitTarget, find_fits, max_seq_len, smallest_plan
from planner.gpus import GPUS, scenario_on
from planner.loading import load_model_shape
from planner.scenario import Checkpointing, Task, scenario_from_values
from planner.units import format_bytes
from planner.verdict import room_for_plans

RESULTS = ROOT / "benchmarks" / "results" / "fit_speed.md"
MODEL = "llama-2-7b"
SEQ = 2048
REPEATS = 20
TARGETS = [("largest batch", FitTarget(SEQ)), ("batch 1", FitTarget(SEQ, batch_size=1)),
           ("effective batch 64", FitTarget(SEQ, effective_batch=64))]


def simulate(scenario) -> tuple[int, float]:
    """The scenario's step simulated at full depth with the kernels its estimate takes: CUDA's
    (planner.probe.fake_cuda, the probe's architecture) for a CUDA plan."""
    from planner.probe.cache import probe_gpu
    from runners.simulate_measure import simulate_step

    values = {"task": scenario.task.value, "batch_size": scenario.batch_size, "seq_len": scenario.seq_len,
              "optimizer": scenario.optimizer.value, "precision": scenario.precision.value,
              "gradient_checkpointing": scenario.checkpointing is Checkpointing.EVERY_LAYER,
              "grad_accum": scenario.grad_accum_steps, "attn": scenario.attention.value,
              "device": scenario.device.value}
    method = scenario.finetune
    if method.uses_adapters:  # the plan's LoRA / QLoRA, as the scenario keys write it
        values |= {"finetune": method.method.value, "lora_r": method.lora_r, "lora_alpha": method.lora_alpha,
                   "lora_dropout": method.lora_dropout, "lora_targets": method.targets_text,
                   "quant_type": method.quant_type, "double_quant": method.double_quant}
    started = time.perf_counter()
    measured = simulate_step(catalog_config(MODEL), values, gpu=probe_gpu(scenario))
    return measured["peak_bytes"], time.perf_counter() - started


def describe(s) -> str:
    ckpt = ", checkpointing" if s.checkpointing is Checkpointing.EVERY_LAYER else ""
    method = "" if s.finetune.method is Method.FULL else f"{s.finetune.method.value} r{s.finetune.lora_r}, "
    return (f"{method}{s.optimizer.value}, {s.precision.value}{ckpt}, batch {s.batch_size} x accumulation "
            f"{s.grad_accum_steps}")


def timed_searches(shape, base, gpu, num_devices: int = 1) -> list[tuple[str, int, int, float, float, float, object]]:
    """Per target: the first search (the caching allocator replayed for each combination's
    answer, planner.device_fit), then the median and slowest of REPEATS more (replays cached)."""
    rows = []
    base = scenario_on(base, gpu)  # its kernels (planner.gpus.scenario_on)
    room_for = room_for_plans(gpu.capacity_bytes, base.device, gpu)
    check = reserved_check(gpu.capacity_bytes, base.device, gpu)
    for label, target in TARGETS:
        times = []
        for _ in range(REPEATS + 1):
            started = time.perf_counter()
            # Risky changes allowed: every combination is searched, as the rows' counts say.
            result = find_fits(shape, base, gpu.capacity_bytes, target, gpu, num_devices, allow_risky=True,
                               room_for=room_for, check=check)
            times.append(time.perf_counter() - started)
        rows.append((label, result.combinations, len(result.options), times[0], statistics.median(times[1:]),
                     max(times[1:]), result))
    return rows


def search_below_answer(shape, result) -> list[str]:
    """Replays per largest-sequence search, verdict alone against headroom, for the A10 plans;
    and the best plan's verdict token by token around its answer."""
    gpu = GPUS["a10"]
    check = reserved_check(gpu.capacity_bytes, result.options[0].scenario.device, gpu)
    room = result.room_bytes(result.options[0].strategy)
    lines = ["", "## The search below a failing answer", "",
             ("Largest sequence of each plan above (A10 24 GB, largest batch), searched with the replay's verdict "
              "alone (stepping down from the live-tensor answer, doubling the step, then bisecting) and with its "
              "headroom (regula falsi); both answers pass and one token more fails."), "",
             "| plan | verdict alone: replays | answer (tokens) | with headroom: replays | answer (tokens) |",
             "|---|---:|---:|---:|---:|"]
    totals = [0, 0]
    for option in result.options:
        counts, answers = [], []
        for guided in (False, True):
            calls = []

            def passes(s, scenario, plan, guided=guided, calls=calls):
                calls.append(scenario.seq_len)
                verdict = check(s, scenario, plan)
                return verdict if guided else bool(verdict)

            answers.append(max_seq_len(shape, option.scenario, room, known_fit=option.scenario.seq_len,
                                       check=passes))
            counts.append(len(calls))
        totals = [totals[0] + counts[0], totals[1] + counts[1]]
        lines.append(f"| {describe(option.scenario)} | {counts[0]} | {answers[0]:,} | {counts[1]} | {answers[1]:,} |")
        print(lines[-1], flush=True)
    count = len(result.options)
    lines.append(f"| **all {count}** | **{totals[0]}** ({totals[0] / count:.1f} each) | | **{totals[1]}** "
                 f"({totals[1] / count:.1f} each) | |")
    best = result.options[0]
    answer = max_seq_len(shape, best.scenario, room, known_fit=best.scenario.seq_len, check=check)
    lengths = range(answer - 70, answer + 31)
    verdicts = [bool(check(shape, dataclasses.replace(best.scenario, seq_len=n), None)) for n in lengths]
    turns = sum(a != b for a, b in zip(verdicts, verdicts[1:]))
    passing = [n for n, ok in zip(lengths, verdicts) if ok]
    failing = [n for n, ok in zip(lengths, verdicts) if not ok]
    lines += ["", (f"The best plan ({describe(best.scenario)}), its verdict replayed at every length from "
                   f"{lengths[0]:,} to {lengths[-1]:,} tokens: {len(passing)} pass, {len(failing)} fail, the verdict "
                   f"changes {turns} times; the shortest failing length is {min(failing, default=0):,}, the longest "
                   f"passing {max(passing, default=0):,} (the search answered {answer:,}). Where the allocator "
                   "starts releasing its cache the verdict need not be monotone: any length that passes with one "
                   "more failing is an answer, as it is bisection's.")]
    print(lines[-1], flush=True)
    return lines


def main() -> None:
    started = time.perf_counter()
    base = scenario_from_values(task="causal-lm", batch_size=1, seq_len=SEQ)
    shape = load_model_shape(MODEL, Task.CAUSAL_LM)
    load_s = time.perf_counter() - started
    lines = ["# Fit finder speed", "",
             (f"Machine: {os.cpu_count()} cores, {platform.machine()}, Python {platform.python_version()}; "
             "command: `python benchmarks/fit_speed.py`."), "",
             (f"Model: {MODEL} ({shape.num_parameters:,} parameters), causal LM, {SEQ} tokens, device kind cuda "
             f"(estimates probed on CUDA's kernels; probe tables already cached). Loading the shape: {load_s:.2f} s. "
             "Each search below: every combination, in the room the CUDA overheads leave, each answer tested "
             "by the caching allocator's replay where the verdict replays it (single-GPU plans). The first "
             f"search replays; then the median and slowest of {REPEATS} more, replays cached."), "",
             "| GPU | target | combinations | fit | first (ms) | median (ms) | slowest (ms) | best plan (estimated peak) |",
             "|---|---|---:|---:|---:|---:|---:|---|"]
    summaries = {}
    # Several GPUs: every combination is also tried under DDP, ZeRO-1/2 and both FSDP modes.
    for key, devices in (("a10", 1), ("a100-40gb", 1), ("a10", 8)):
        gpu = GPUS[key]
        for label, combos, fit, first, median, slowest, result in timed_searches(shape, base, gpu, devices):
            best = (f"{describe(result.options[0].scenario)} ({format_bytes(result.options[0].peak_bytes)})"
                    if result.options else "nothing fits")
            if devices > 1 and result.options:
                best = f"{result.options[0].strategy.value}, {best}"
            gpus = gpu.label if devices == 1 else f"{devices} x {gpu.label}"
            lines.append(f"| {gpus} | {label} | {combos} | {fit} | {first * 1e3:.0f} | {median * 1e3:.1f} "
                         f"| {slowest * 1e3:.1f} | {best} |")
            print(lines[-1], flush=True)
            if devices == 1:
                summaries[(key, label)] = result

    lines += ["", "## Against a simulated run of the same scenario", "",
              ("| GPU | scenario | estimated peak (B) | simulated peak (B) | difference | capacity (B) | verdict | "
              "simulation (s) |"), "|---|---|---:|---:|---:|---:|---|---:|"]
    a10 = GPUS["a10"]
    peak, plan, _ = smallest_plan(shape, scenario_on(base, a10), SEQ)
    simulated, sim_s = simulate(plan)
    lines.append(f"| {a10.label} | smallest plan: {describe(plan)} | {peak:,} | {simulated:,} | "
                 f"{simulated / peak - 1:+.3%} | {a10.capacity_bytes:,} | "
                 f"{'over capacity, as the finder says' if simulated > a10.capacity_bytes else 'FITS: finder wrong'} "
                 f"| {sim_s:.1f} |")
    print(lines[-1], flush=True)
    a100 = GPUS["a100-40gb"]
    best = summaries[("a100-40gb", "largest batch")].options[0]
    simulated, sim_s = simulate(best.scenario)
    lines.append(f"| {a100.label} | best, at its largest batch: {describe(best.scenario)} | {best.peak_bytes:,} | "
                 f"{simulated:,} | {simulated / best.peak_bytes - 1:+.3%} | {a100.capacity_bytes:,} | "
                 f"{'fits' if simulated <= a100.capacity_bytes else 'OVER capacity'} | {sim_s:.1f} |")
    print(lines[-1], flush=True)
    lines += ["", ("Once its replays are cached a search answers in the median time above; a simulated run of one "
              "scenario (fake tensors, one steady-state step) takes the time in the last column.")]
    lines += search_below_answer(shape, summaries[("a10", "largest batch")])
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text("\n".join(lines) + "\n")
    print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()
