"""Per-rank memory and per-step traffic on two CPU processes (gloo, torchrun, the lessons'
Accelerate loop), against the planner: DDP, DDP with local SGD, and Accelerate's FSDP2
with FULL_SHARD and SHARD_GRAD_OP.

    python benchmarks/distributed_memory.py          # about 6 minutes on 2 cores

The FSDP terms of planner.parallel were derived from FSDP2's and Accelerate's code and
checked against these runs while they were written: none of them is held out.

Writes benchmarks/results/distributed_memory.{md,csv}. Measured peaks are MemTracker's
over the last optimizer step of each rank (runners.rank_worker); traffic is counted by
DDP's communication hook and at torch.distributed (runners.collectives), averaged over
the steady-state steps.
"""

from __future__ import annotations

import csv
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from planner.loading import load_model_shape  # noqa: E402
from planner.parallel import parallel_estimate  # noqa: E402
from planner.scenario import scenario_from_values  # noqa: E402
from planner.strategy import ParallelPlan, Strategy  # noqa: E402
from planner.units import format_bytes  # noqa: E402
from runners.launch import run_distributed  # noqa: E402
from runners.request import Mode, VerifyRequest  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"
NUM_PROCESSES = 2
FULL, GRAD_OP, DDP = Strategy.FSDP_FULL_SHARD, Strategy.FSDP_SHARD_GRAD_OP, Strategy.DDP
# (model, task, batch, sequence, strategy, local SGD K, precision, technique)
CASES = [
    *[(m, "causal-lm", b, s, strategy, k, precision, None)
      for m, b, s in (("tiny-llama", 4, 64), ("tiny-gpt2", 4, 64), ("tiny-neox", 2, 32))
      for strategy, k, precision in ((DDP, None, "fp32"), (DDP, 2, "fp32"), (FULL, None, "fp32"),
                                     (GRAD_OP, None, "fp32"), (DDP, None, "bf16-mixed"),
                                     (FULL, None, "bf16-mixed"))],  # bf16: Accelerate's 16-bit MixedPrecisionPolicy
    # Other families (OPT: tied embeddings; Phi: an LM head with a bias; DistilBERT: no
    # _no_split_modules, so the root holds every block) and the lessons' techniques.
    *[(m, task, b, 64, strategy, None, "fp32", None)
      for m, task, b in (("tiny-opt", "causal-lm", 4), ("tiny-phi", "causal-lm", 4),
                         ("tiny-distilbert", "sequence-classification", 8))
      for strategy in (FULL, GRAD_OP)],
    *[("tiny-llama", "causal-lm", 4, 64, strategy, None, "fp32", "checkpointing") for strategy in (FULL, GRAD_OP)],
    *[("tiny-llama", "causal-lm", 2, 64, strategy, None, "fp32", "accumulation 2") for strategy in (FULL, GRAD_OP)],
]
STEPS = 4


def _measure(name: str, task: str, batch: int, seq: int, strategy: Strategy, k: int | None, precision: str,
             technique: str | None) -> dict:
    config = f"tests/configs/{name}.json"
    values = {"task": task, "batch_size": batch, "seq_len": seq, "optimizer": "adamw", "precision": precision,
              "gradient_checkpointing": technique == "checkpointing",
              "grad_accum": 2 if technique == "accumulation 2" else 1}
    request = VerifyRequest(config=json.loads((ROOT / config).read_text()), model_name=name, scenario=values,
                            mode=Mode.CPU, steps=STEPS, local_sgd_steps=k)
    result = run_distributed(request, strategy, NUM_PROCESSES, timeout_s=600)
    if result["status"] != "ok":
        raise SystemExit(f"{name} {strategy.value}: {result['status']}: {result['reason']}")
    scenario = scenario_from_values(**values, device="cpu")
    shape = load_model_shape(str(ROOT / config), scenario.task, scenario.num_labels)
    planned = parallel_estimate(shape, scenario, ParallelPlan(NUM_PROCESSES, strategy, k))
    peaks = [rank["measured"]["peak_bytes"] for rank in result["ranks"]]
    if k:
        # Local SGD traffic comes in bursts (and once more on leaving the context): the
        # whole run is compared; step 1 also holds DDP's start-up broadcast, left out.
        basis = f"over {STEPS} steps"
        estimated_bytes = planned.comm_bytes_over_run(STEPS)
        measured_bytes = sum(step.get("all_reduce", {}).get("bytes", 0)
                             for step in result["ranks"][0]["collectives_per_step"])
    else:
        basis = "per step"
        estimated_bytes = planned.comm_bytes_per_step
        measured_bytes = sum(kind["bytes"] for kind in result["comm_per_step"].values())
    return {
        "model": name, "strategy": strategy.value, "local_sgd_steps": k or "", "precision": precision,
        "technique": technique or "",
        "batch": f"{batch}x{seq}",
        "estimated_peak_bytes": planned.per_device_peak_bytes,
        "measured_rank0_peak_bytes": peaks[0], "measured_rank1_peak_bytes": peaks[1],
        "peak_error_pct": round(100 * (planned.per_device_peak_bytes - max(peaks)) / max(peaks), 2),
        "estimated_phase": planned.peak.phase.value,
        "measured_phase": result["ranks"][0]["measured"]["peak_phase"],
        "comm_basis": basis,
        "estimated_comm_bytes": estimated_bytes,
        "measured_comm_bytes": measured_bytes,
        "replicas_equal": result["replicas_equal"],
        "wall_s": round(result.get("wall_s") or 0, 1),
    }


def main() -> None:
    rows = []
    for case in CASES:
        started = time.perf_counter()
        rows.append(_measure(*case))
        row = rows[-1]
        label = row["strategy"] + (f" K={row['local_sgd_steps']}" if row["local_sgd_steps"] else "")
        print(f"{row['model']:<16}{label:<22}{row['precision']:<11}{row['technique']:<15}"
              f"est {row['estimated_peak_bytes']:>12,} "
              f"meas {max(row['measured_rank0_peak_bytes'], row['measured_rank1_peak_bytes']):>12,} "
              f"({row['peak_error_pct']:+.2f}%)  comm {row['comm_basis']} est {row['estimated_comm_bytes']:>12,.0f} "
              f"meas {row['measured_comm_bytes']:>12,.0f}  {time.perf_counter() - started:.0f} s", flush=True)
    RESULTS.mkdir(parents=True, exist_ok=True)
    with (RESULTS / "distributed_memory.csv").open("w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    errors = sorted(abs(r["peak_error_pct"]) for r in rows)
    lines = [
        "# Per-rank memory and traffic on two CPU processes (gloo), estimated against measured",
        "",
        f"`python benchmarks/distributed_memory.py`; torchrun --nproc_per_node {NUM_PROCESSES}, the lessons' "
        f"Accelerate loop, AdamW, {STEPS} optimizer steps, the last one measured on every rank "
        "(MemTracker). Local SGD: K=2 (averaging every 2 micro-batches, and once more on leaving its context). "
        "Traffic = payload bytes per rank: per optimizer step in steady state, or over the whole run for local SGD.",
        "",
        "| model | strategy | precision | technique | batch | estimated per rank | measured rank 0 | measured rank 1 | error | "
        "phase est / meas | traffic | estimated | measured | replicas equal |",
        "|---|---|---|---|---|---:|---:|---:|---:|---|---|---:|---:|---|",
    ]
    for r in rows:
        strategy = r["strategy"] + (f" + local SGD K={r['local_sgd_steps']}" if r["local_sgd_steps"] else "")
        lines.append(
            f"| {r['model']} | {strategy} | {r['precision']} | {r['technique'] or '-'} | {r['batch']} | {format_bytes(r['estimated_peak_bytes'])} | "
            f"{format_bytes(r['measured_rank0_peak_bytes'])} | {format_bytes(r['measured_rank1_peak_bytes'])} | "
            f"{r['peak_error_pct']:+.2f}% | {r['estimated_phase']} / {r['measured_phase']} | "
            f"{r['comm_basis']} | {r['estimated_comm_bytes']:,.0f} B | {r['measured_comm_bytes']:,.0f} B | "
            f"{'n/a (sharded)' if r['replicas_equal'] is None else r['replicas_equal']} |")
    lines += ["", f"Peak error: median {errors[len(errors) // 2]:.2f}%, maximum {errors[-1]:.2f}% over {len(rows)} "
              "runs (binary units: MiB = 2^20 bytes)."]
    (RESULTS / "distributed_memory.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
