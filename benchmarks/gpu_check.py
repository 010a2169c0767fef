"""The CUDA verification matrix: on a machine with a GPU, every scenario runs in a child
process (runners.verify, mode cuda) and is compared with the planner's CUDA estimate.

Scenarios: the lessons' distilbert-base-cased (2 labels) with AdamW, transformers'
Adafactor, 8-bit Adam, bf16 mixed precision, gradient checkpointing and accumulation;
and a 1B-class LLaMA-style model (Llama-3.2-1B shape). Writes
benchmarks/results/gpu_check.json and gpu_check.md. Run: bash benchmarks/gpu_check.sh
"""

from __future__ import annotations

import json
import platform
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from planner.config_source import resolve_config  # noqa: E402
from runners.request import Mode, VerifyRequest  # noqa: E402
from runners.verify import verify  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"
LESSON = dict(task="sequence-classification", num_labels=2, batch_size=8, seq_len=128)
LLAMA_1B = dict(task="causal-lm", batch_size=4, seq_len=512)
MATRIX = [
    ("distilbert-base-cased", "AdamW", dict(LESSON, optimizer="adamw")),
    ("distilbert-base-cased", "Adafactor (TrainingArguments)", dict(LESSON, optimizer="hf-adafactor")),
    ("distilbert-base-cased", "8-bit Adam", dict(LESSON, optimizer="adam8bit")),
    ("distilbert-base-cased", "bf16 mixed precision", dict(LESSON, optimizer="adamw", precision="bf16-mixed")),
    ("distilbert-base-cased", "gradient checkpointing", dict(LESSON, optimizer="adamw", gradient_checkpointing=True)),
    ("distilbert-base-cased", "accumulation 4 x 2", dict(LESSON, optimizer="adamw", batch_size=2, grad_accum=4)),
    ("llama-3.2-1b", "AdamW bf16-mixed", dict(LLAMA_1B, optimizer="adamw", precision="bf16-mixed")),
    ("llama-3.2-1b", "8-bit AdamW, bf16-mixed, checkpointing",
     dict(LLAMA_1B, optimizer="adamw8bit", precision="bf16-mixed", gradient_checkpointing=True)),
]


def main() -> int:
    import torch

    if not torch.cuda.is_available():
        print("gpu_check: no CUDA device visible to torch: run this on a machine with a GPU", file=sys.stderr)
        return 2
    rows = []
    with tempfile.TemporaryDirectory() as data_dir:
        from runners.history import RunHistory

        history = RunHistory(Path(data_dir) / "runs.sqlite3")
        for index, (model, technique, values) in enumerate(MATRIX, 1):
            print(f"[{index}/{len(MATRIX)}] {model}: {technique}", flush=True)
            config, name = resolve_config(model)
            request = VerifyRequest(config=config, model_name=name, scenario=dict(values, device="cuda"),
                                    mode=Mode.CUDA, steps=3)
            result = verify(request, timeout_s=900, history=history)
            rows.append({"model": name, "technique": technique, "status": result["status"],
                         "reason": result.get("reason"), "measured": result.get("measured"),
                         "estimated": result.get("estimated"), "errors_pct": result.get("errors_pct"),
                         "environment": result.get("environment")})
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "gpu_check.json").write_text(json.dumps(rows, indent=2) + "\n")
    lines = ["# CUDA verification (benchmarks/gpu_check.sh)", "",
             f"Device: {torch.cuda.get_device_name()}; torch {torch.__version__}; {platform.platform()}.", "",
             "| model | technique | status | estimated peak (B) | measured peak (B) | error | reserved (B) | optimizer state: est / measured (B) |",
             "|---|---|---|---:|---:|---:|---:|---|"]
    for row in rows:
        measured, estimated = row["measured"] or {}, row["estimated"] or {}
        peak = measured.get("peak_bytes")
        error = (estimated["peak_bytes"] - peak) / peak * 100 if peak else None
        lines.append(
            f"| {row['model']} | {row['technique']} | {row['status']} | {estimated.get('peak_bytes', 0):,} | "
            f"{peak if peak is None else format(peak, ',')} | {'n/a' if error is None else f'{error:+.2f}%'} | "
            f"{measured.get('reserved_bytes', 'n/a')} | {estimated.get('optimizer_state_bytes')} / "
            f"{measured.get('optimizer_state_bytes')} |")
    (RESULTS / "gpu_check.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
