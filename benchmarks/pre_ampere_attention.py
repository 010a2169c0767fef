"""Before Ampere: a T4 (sm75) and a V100 (sm70) against an A100 (sm80), each simulated on its
own kernels, against the planner's plan for that GPU.

torch has no flash attention before sm80 (sdp_utils.cpp `check_flash_attention_hardware_support`),
so on a T4 or a V100 SDPA takes the memory-efficient kernel, or the math path where that kernel
refuses the call: in torch 2.13 it refuses grouped-query attention (`enable_gqa`), and the math
path keeps the attention matrix for the backward. CUDA plans are probed on the kernels of their
GPU's class (planner.probe.cache.kernel_class: sm75 for both). For each model: the lessons'
loop simulated at full depth on fake tensors (runners.simulate_measure.simulate_step, each run
in its own process) with the kernels of sm80, sm75 and sm70 (planner.probe.fake_cuda, which
follows sdp_utils.cpp's dispatch), the planner's plan on an A100, a T4 and a V100
(planner.gpus.scenario_on), and the attention backends each run took.

Run: python benchmarks/pre_ampere_attention.py   (writes benchmarks/results/pre_ampere_attention.md)
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
sys.path.insert(0, str(ROOT))

# (catalog model, task, precision): multi-head and grouped-query attention, in the 16-bit
# autocast a T4 or V100 trains with (neither has bf16), and one fp32 row.
CASES = [
    ("distilbert-base-cased", "sequence-classification", "fp16-mixed"),
    ("gpt2", "causal-lm", "fp16-mixed"),
    ("smollm2-135m", "causal-lm", "fp16-mixed"),
    ("smollm2-135m", "causal-lm", "fp32"),
    ("qwen2.5-0.5b", "causal-lm", "fp16-mixed"),
    ("llama-3.2-1b", "causal-lm", "fp16-mixed"),
]
BATCH, SEQ = 4, 512
# (architecture, GPU, compute capability, the planner.gpus key whose plan it is compared with)
ARCHES = [("sm80", "A100", 8, 0, "a100-40gb"), ("sm75", "T4", 7, 5, "t4"), ("sm70", "V100", 7, 0, "v100-16gb")]

_ONE = r"""
import json, sys, warnings
warnings.filterwarnings("ignore")
sys.path.insert(0, {root!r})
from planner.catalog import catalog_config
from planner.probe.fake_cuda import CudaGpu
from runners.simulate_measure import simulate_step
name, values, label, major, minor = json.loads(sys.argv[1])
measured = simulate_step(dict(catalog_config(name)), values, gpu=CudaGpu(label, major, minor))
print(json.dumps(dict(peak=measured["peak_bytes"], backends=measured["attention_backends"])))
"""


def simulated(name: str, values: dict, arch: tuple) -> dict:
    _, label, major, minor, _ = arch
    done = subprocess.run([sys.executable, "-c", _ONE.format(root=str(ROOT)),
                           json.dumps([name, values, label, major, minor])],
                          capture_output=True, text=True, timeout=1800, check=False)
    if done.returncode != 0:
        raise RuntimeError((done.stderr.strip().splitlines() or ["no output"])[-1][:200])
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    from planner.catalog import catalog_config
    from planner.estimate import estimate
    from planner.gpus import GPUS, scenario_on
    from planner.loading import load_model_shape
    from planner.scenario import Task, scenario_from_values

    started = time.perf_counter()
    rows = []
    for name, task, precision in CASES:
        values = dict(task=task, batch_size=BATCH, seq_len=SEQ, precision=precision, device="cuda")
        shape = load_model_shape(name, Task(task))
        config = catalog_config(name)
        q = config.get("num_attention_heads") or config.get("n_head") or config.get("n_heads")
        kv = config.get("num_key_value_heads") or q
        row = dict(model=name, precision=precision, heads=f"{q} / {kv}")
        for arch in ARCHES:
            found = simulated(name, values, arch)
            row[arch[0]] = found["peak"]
            row[arch[0] + "_plan"] = estimate(shape, scenario_on(scenario_from_values(**values),
                                                                 GPUS[arch[4]])).peak_bytes
            row[arch[0] + "_backends"] = ", ".join(f"{k} x{v}" for k, v in Counter(found["backends"]).items())
        rows.append(row)
        print(json.dumps(row), flush=True)
    write(rows, time.perf_counter() - started)


def _pct(value: int, base: int) -> str:
    return f"{100 * (value - base) / base:+.4f}%"


def write(rows: list[dict], seconds: float) -> None:
    machine = f"{platform.machine()}, {os.cpu_count()} CPUs, Python {platform.python_version()}"
    lines = ["# Before Ampere: SDPA on a T4 (sm75) and a V100 (sm70) against an A100 (sm80), and each GPU's plan", "",
             f"Command: `python benchmarks/pre_ampere_attention.py` ({seconds / 60:.0f} min; {machine}; "
             f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}). Each model at {BATCH} x {SEQ} tokens, AdamW, "
             "full fine-tuning, the lessons' loop simulated at full depth on fake tensors with each architecture's "
             "kernels (planner.probe.fake_cuda); \"plan\" is the planner's CUDA plan for that GPU, probed on its "
             "kernel class's kernels (planner.probe.cache.kernel_class: sm75 for the T4 and the V100). Heads: "
             "query / key-value.", "",
             "| model | precision | heads | A100 (sm80) simulated (B) | A100 plan against it | T4 (sm75) simulated (B) "
             "| T4 plan against it | T4 against the A100 | V100 (sm70) simulated (B) | V100 plan against it "
             "| backends sm80 / sm75 / sm70 |",
             "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---|"]
    for r in rows:
        lines.append(f"| {r['model']} | {r['precision']} | {r['heads']} | {r['sm80']:,} | "
                     f"{_pct(r['sm80_plan'], r['sm80'])} | {r['sm75']:,} | {_pct(r['sm75_plan'], r['sm75'])} | "
                     f"{_pct(r['sm75'], r['sm80'])} | {r['sm70']:,} | {_pct(r['sm70_plan'], r['sm70'])} | "
                     f"{r['sm80_backends']} / {r['sm75_backends']} / {r['sm70_backends']} |")
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "pre_ampere_attention.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
