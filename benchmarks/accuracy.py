"""Planner against runner: peak memory estimated vs measured over many scenarios.

Scenarios span 7 architecture families (BERT-style encoders, GPT-2, OPT, GPT-NeoX,
LLaMA, Qwen2, Phi), real catalog shapes from 66M to 7B parameters, and every
technique (AdamW, SGD, both Adafactors, 8-bit Adam, fp32, bf16 autocast, pure bf16,
gradient checkpointing, accumulation, eager and SDPA attention, both engines).
Small models are measured on real CPU tensors (`cpu`), the rest on fake tensors
(`simulate`, byte-identical to `cpu`: tests/test_simulate.py). Measurement is MemTracker's
steady-state step (../shared/DESIGN.md). Writes benchmarks/results/accuracy.md,
accuracy.csv and accuracy.png.

Run: python benchmarks/accuracy.py [--only SUBSTRING]
"""

from __future__ import annotations

import argparse
import csv
import gc
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from planner.config_source import resolve_config  # noqa: E402
from planner.estimate import Estimate, estimate  # noqa: E402
from planner.loading import model_shape_for_config  # noqa: E402
from planner.model_shape import ModelShape  # noqa: E402
from planner.optimizer_state import FP32_BYTES, STEP_TENSOR_OPTIMIZERS  # noqa: E402
from planner.scenario import Device, scenario_from_values  # noqa: E402
from runners.measure import measure_in_process  # noqa: E402
from runners.request import Engine, Mode  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"
CLS, LM, MLM = "sequence-classification", "causal-lm", "masked-lm"
REAL, FAKE = Mode.CPU, Mode.SIMULATE

# (model, mode, scenario values). Sequence lengths and batches vary on purpose.
SCENARIOS = [
    ("distilbert-base-cased", REAL, dict(task=CLS, batch_size=8, seq_len=128)),
    ("distilbert-base-cased", REAL, dict(task=CLS, batch_size=8, seq_len=128, optimizer="hf-adafactor")),
    ("distilbert-base-cased", REAL, dict(task=CLS, batch_size=8, seq_len=128, optimizer="adam8bit")),
    ("distilbert-base-cased", REAL, dict(task=CLS, batch_size=8, seq_len=128, precision="bf16-mixed")),
    ("distilbert-base-cased", REAL, dict(task=CLS, batch_size=8, seq_len=128, gradient_checkpointing=True)),
    ("distilbert-base-cased", REAL, dict(task=CLS, batch_size=4, seq_len=128, grad_accum=2)),
    ("distilbert-base-cased", FAKE, dict(task=CLS, batch_size=32, seq_len=512, precision="bf16-mixed",
                                         gradient_checkpointing=True, optimizer="adamw8bit")),
    ("bert-base-uncased", FAKE, dict(task=CLS, batch_size=16, seq_len=256)),
    ("bert-base-uncased", FAKE, dict(task=MLM, batch_size=8, seq_len=512, precision="bf16-mixed")),
    ("bert-large-uncased", FAKE, dict(task=CLS, batch_size=8, seq_len=384, optimizer="sgd", attn="eager")),
    ("roberta-base", FAKE, dict(task=CLS, batch_size=16, seq_len=256, optimizer="adafactor")),
    ("roberta-large", FAKE, dict(task=MLM, batch_size=4, seq_len=512, gradient_checkpointing=True)),
    ("electra-base-discriminator", FAKE, dict(task=CLS, batch_size=16, seq_len=128, precision="bf16")),
    ("gpt2", REAL, dict(task=LM, batch_size=2, seq_len=256)),
    ("gpt2", FAKE, dict(task=LM, batch_size=8, seq_len=1024, precision="bf16-mixed")),
    ("gpt2", FAKE, dict(task=LM, batch_size=8, seq_len=1024, gradient_checkpointing=True)),
    ("gpt2", FAKE, dict(task=LM, batch_size=4, seq_len=512, attn="eager", optimizer="sgd")),
    ("gpt2", FAKE, dict(task=LM, batch_size=4, seq_len=512, grad_accum=4, optimizer="adamw8bit")),
    ("gpt2", REAL, dict(task=LM, batch_size=2, seq_len=256, engine="trainer")),  # Trainer: real tensors only
    ("gpt2-medium", FAKE, dict(task=LM, batch_size=4, seq_len=1024, precision="bf16-mixed", gradient_checkpointing=True)),
    ("gpt2-xl", FAKE, dict(task=LM, batch_size=1, seq_len=1024, optimizer="adafactor", precision="bf16")),
    ("opt-125m", FAKE, dict(task=LM, batch_size=8, seq_len=512)),
    ("opt-125m", FAKE, dict(task=LM, batch_size=8, seq_len=512, precision="bf16-mixed", optimizer="hf-adafactor")),
    ("opt-1.3b", FAKE, dict(task=LM, batch_size=2, seq_len=1024, gradient_checkpointing=True, optimizer="adamw8bit")),
    ("opt-6.7b", FAKE, dict(task=LM, batch_size=1, seq_len=2048, precision="bf16", gradient_checkpointing=True)),
    ("pythia-160m", FAKE, dict(task=LM, batch_size=8, seq_len=512)),
    ("pythia-160m", FAKE, dict(task=LM, batch_size=8, seq_len=1024, precision="bf16-mixed", grad_accum=2)),
    ("pythia-1.4b", FAKE, dict(task=LM, batch_size=2, seq_len=2048, gradient_checkpointing=True, precision="bf16-mixed")),
    ("pythia-6.9b", FAKE, dict(task=LM, batch_size=1, seq_len=1024, optimizer="adamw8bit", precision="bf16-mixed",
                               gradient_checkpointing=True)),
    ("tinyllama-1.1b", FAKE, dict(task=LM, batch_size=4, seq_len=1024)),
    ("tinyllama-1.1b", FAKE, dict(task=LM, batch_size=4, seq_len=1024, precision="bf16-mixed", optimizer="adamw8bit")),
    ("tinyllama-1.1b", FAKE, dict(task=LM, batch_size=4, seq_len=2048, gradient_checkpointing=True, attn="eager")),
    ("llama-3.2-1b", FAKE, dict(task=LM, batch_size=2, seq_len=2048, precision="bf16-mixed", gradient_checkpointing=True)),
    ("pythia-160m", REAL, dict(task=LM, batch_size=2, seq_len=256, engine="trainer", optimizer="adamw8bit")),
    ("llama-3.2-1b", FAKE, dict(task=LM, batch_size=4, seq_len=512, optimizer="adamw-fused")),
    ("llama-2-7b", FAKE, dict(task=LM, batch_size=1, seq_len=4096, precision="bf16-mixed", gradient_checkpointing=True)),
    ("llama-2-7b", FAKE, dict(task=LM, batch_size=2, seq_len=1024, precision="bf16", optimizer="adamw8bit",
                              gradient_checkpointing=True)),
    ("mistral-7b-v0.1", FAKE, dict(task=LM, batch_size=1, seq_len=2048, precision="bf16-mixed", optimizer="adamw8bit",
                                   gradient_checkpointing=True, grad_accum=4)),
    ("qwen2.5-0.5b", FAKE, dict(task=LM, batch_size=4, seq_len=1024)),
    ("qwen2.5-0.5b", FAKE, dict(task=LM, batch_size=4, seq_len=1024, precision="bf16-mixed", gradient_checkpointing=True)),
    ("qwen2.5-1.5b", FAKE, dict(task=LM, batch_size=2, seq_len=2048, precision="bf16", optimizer="adafactor")),
    ("qwen2.5-7b", FAKE, dict(task=LM, batch_size=1, seq_len=2048, precision="bf16-mixed", optimizer="adamw8bit",
                              gradient_checkpointing=True)),
    ("phi-2", FAKE, dict(task=LM, batch_size=2, seq_len=1024, precision="bf16-mixed", gradient_checkpointing=True)),
    ("phi-2", FAKE, dict(task=LM, batch_size=2, seq_len=512, optimizer="sgd")),
    ("gemma-2b", FAKE, dict(task=LM, batch_size=1, seq_len=2048, precision="bf16-mixed", gradient_checkpointing=True)),
]


def _technique(values: dict, skip: tuple[str, ...] = ("task", "batch_size", "seq_len")) -> str:
    parts = [f"{key}={value}" for key, value in values.items() if key not in skip]
    return ", ".join(parts) or "adamw, fp32"


@dataclass(frozen=True)
class Comparison:
    """One scenario planned and measured: what both benchmark tables are built from."""

    name: str
    values: dict  # the scenario values the run was given (device added, engine taken out)
    engine: Engine
    shape: ModelShape
    planned: Estimate
    measured: dict  # runners.measure's "measured" object
    seconds: float

    @property
    def error_pct(self) -> float:
        peak = self.measured["peak_bytes"]
        return 100 * (self.planned.peak_bytes - peak) / peak


def compare(model: str, mode: Mode, values: dict) -> Comparison:
    """`values` may ask for device "cuda": the lessons' loop simulated on CUDA's kernels
    (runners.simulate_measure.simulate_step); otherwise the CPU's."""
    config, name = resolve_config(model)
    values = dict(values, device=values.get("device", "cpu"))
    engine = Engine(values.pop("engine", "accelerate"))
    scenario = scenario_from_values(**values, engine=engine.value)
    shape = model_shape_for_config(config, scenario.task, scenario.num_labels, name)
    planned = estimate(shape, scenario)
    started = time.perf_counter()
    if values["device"] == "cuda":
        if mode is not Mode.SIMULATE or engine is not Engine.ACCELERATE:
            raise ValueError("CUDA's kernels are simulated in the lessons' loop only")
        from planner.probe.cache import probe_gpu
        from runners.simulate_measure import simulate_step

        measured = simulate_step(config, dict(values), gpu=probe_gpu(scenario))
    else:
        measured = measure_in_process(config, name, values, mode, engine=engine)["measured"]
    seconds = time.perf_counter() - started
    gc.collect()
    return Comparison(name, values, engine, shape, planned, measured, seconds)


def run_one(model: str, mode: Mode, values: dict) -> dict:
    c = compare(model, mode, values)
    planned, measured, scenario = c.planned, c.measured, c.planned.scenario
    return {
        "model": c.name, "parameters": c.shape.num_parameters, "family": c.shape.family.value, "mode": mode.value,
        "task": scenario.task.value, "batch": scenario.batch_size, "seq": scenario.seq_len,
        "technique": _technique(dict(c.values, engine=c.engine.value) if c.engine is Engine.TRAINER else c.values),
        "estimated_peak_bytes": planned.peak_bytes, "measured_peak_bytes": measured["peak_bytes"],
        "error_pct": c.error_pct,
        "estimated_phase": planned.peak_phase.value, "measured_phase": measured["peak_phase"],
        "estimated_state_bytes": planned.optimizer_state_bytes,
        "measured_state_bytes": measured["optimizer_state_bytes"],
        # A CUDA plan rounds each state tensor (at most three per parameter, and bitsandbytes' two
        # quantile maps) up to the caching allocator's 512 B; a simulated step counts exact sizes.
        "state_rounding_bytes": 511 * (3 * len(c.shape.params) + 2) if scenario.device is Device.CUDA else 0,
        # ... and the simulated step counts the `step` scalars torch's Adam, AdamW and Adafactor keep
        # on the CPU beside CUDA parameters (4 B a tensor), which a CUDA plan leaves out.
        "state_cpu_hosted_bytes": (FP32_BYTES * len(c.shape.params) if scenario.device is Device.CUDA
                                   and scenario.optimizer in STEP_TENSOR_OPTIMIZERS else 0),
        "seconds": round(c.seconds, 1),
        "method": planned.confidence.value,
    }


def write_csv(rows: list[dict], path: Path) -> None:
    with path.open("w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)


def plot(rows: list[dict], path: Path, title: str = "Planner vs measured peak") -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    gib = 2**30
    measured = [r["measured_peak_bytes"] / gib for r in rows]
    estimated = [r["estimated_peak_bytes"] / gib for r in rows]
    figure, axis = plt.subplots(figsize=(6.5, 6.5))
    low, high = min(measured + estimated) * 0.8, max(measured + estimated) * 1.25
    axis.plot([low, high], [low, high], color="#6b7280", linewidth=1, label="y = x")
    axis.fill_between([low, high], [low * 0.97, high * 0.97], [low * 1.03, high * 1.03], color="#93c5fd",
                      alpha=0.35, label="±3%")
    for family in sorted({r["family"] for r in rows}):
        chosen = [r for r in rows if r["family"] == family]
        axis.scatter([r["measured_peak_bytes"] / gib for r in chosen], [r["estimated_peak_bytes"] / gib for r in chosen],
                     s=22, label=family)
    axis.set_xscale("log")
    axis.set_yscale("log")
    axis.set_xlim(low, high)
    axis.set_ylim(low, high)
    axis.set_xlabel("measured peak (GiB, MemTracker on CPU / fake tensors)")
    axis.set_ylabel("estimated peak (GiB, planner)")
    axis.set_title(f"{title}, {len(rows)} scenarios")
    axis.legend(loc="upper left", fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", help="run the scenarios whose model name contains this text")
    args = parser.parse_args()
    chosen = [s for s in SCENARIOS if not args.only or args.only in s[0]]
    rows = []
    for index, (model, mode, values) in enumerate(chosen, 1):
        print(f"[{index}/{len(chosen)}] {model} ({mode.value}) {values}", flush=True)
        rows.append(run_one(model, mode, values))
        print(f"    error {rows[-1]['error_pct']:+.2f}% in {rows[-1]['seconds']} s", flush=True)
    if args.only:
        return
    RESULTS.mkdir(parents=True, exist_ok=True)
    write_csv(rows, RESULTS / "accuracy.csv")
    plot(rows, RESULTS / "accuracy.png")
    errors = [abs(r["error_pct"]) for r in rows]
    lines = ["# Planner accuracy: estimated vs measured peak", "",
             "Command: `python benchmarks/accuracy.py`. Measured: MemTracker over one steady-state step "
             "(`cpu`: real tensors; `simulate`: fake tensors, byte-identical). Error = (estimated - measured) / measured.",
             "", f"**{len(rows)} scenarios, {len({r['family'] for r in rows})} families, "
             f"{min(r['parameters'] for r in rows) / 1e6:,.0f}M to {max(r['parameters'] for r in rows) / 1e9:,.1f}B parameters: "
             f"median absolute error {statistics.median(errors):.2f}%, maximum {max(errors):.2f}%; "
             f"optimizer state equal to the byte in {sum(r['estimated_state_bytes'] == r['measured_state_bytes'] for r in rows)}"
             f" of {len(rows)}; peak phase right in {sum(r['estimated_phase'] == r['measured_phase'] for r in rows)} of {len(rows)}.**",
             "", "![estimated vs measured](accuracy.png)", "",
             "| model | mode | task | batch x seq | technique | estimated (B) | measured (B) | error | phase (est / measured) |",
             "|---|---|---|---|---|---:|---:|---:|---|"]
    for r in rows:
        lines.append(f"| {r['model']} | {r['mode']} | {r['task']} | {r['batch']} x {r['seq']} | {r['technique']} | "
                     f"{r['estimated_peak_bytes']:,} | {r['measured_peak_bytes']:,} | {r['error_pct']:+.2f}% | "
                     f"{r['estimated_phase']} / {r['measured_phase']} |")
    (RESULTS / "accuracy.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines[:6]))


if __name__ == "__main__":
    main()
