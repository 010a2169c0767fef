"""The prepared GPU check: on a machine with a CUDA GPU, one command measures everything
the project needs from a GPU, under 8 minutes on one H100/H200, and writes committed
results (issue 16, item 5).

    bash benchmarks/gpu_check.sh              # the GPU run: about 4-5 minutes on an H100
    bash benchmarks/gpu_check.sh --dry-run    # the same code path on CPU, 2 tiny scenarios, temp dir
    bash benchmarks/gpu_check.sh --export "$OUT"  # on a lent machine: results + run history into $OUT

On a lent machine (its image has python3 with torch but no bitsandbytes: the three 8-bit
scenarios are then "skipped" at once, saying so, unless a bitsandbytes wheel is carried),
copy the exported runs.sqlite3 into ./data (or point $PLANNER_DATA_DIR at it) here for
the Verify page to show the runs, and commit benchmarks/results/.

What it runs, in order (the GPU run):
1. The environment probe, in its own process (so this one never holds a CUDA context
   while a run measures its own): GPU name, compute capability, driver, torch, CUDA and
   cuDNN versions, the bare CUDA context (`mem_get_info` total - free - reserved before
   any tensor), and the cuBLAS/cuBLASLt workspaces: `memory_allocated()` after the
   first matmul on the main thread, after a bf16 linear with a bias (cuBLASLt's path),
   and after the first backward (autograd's device thread), less the tensors those
   calls made (512-byte rounded).
2. SCENARIOS, each in a child process (runners.verify, mode cuda, 3 steps, the last one
   measured) and recorded in the dashboard's run history (runners.history.RunHistory:
   $PLANNER_DATA_DIR or ./data, so the Verify page shows them). Each scenario also gets
   the planner's estimate for the detected GPU (`planner.cli.result_json` with `gpu`),
   computed beside the runs in one process of its own with the GPU hidden from it
   (ParallelPlanner).
   No scenario starts once START_LIMIT_S have passed; the ones left are recorded as
   "skipped" with that reason.
3. benchmarks/allocator_gpu_check.py and scripts/check_fake_cuda_on_gpu.py --steps, each
   in a subprocess with a time limit (SUBCHECK_TIMEOUT_S), their outputs kept.
The JSON and the table are rewritten after every scenario, so a run stopped midway still
leaves what it measured.

Time per scenario on an H100 (from benchmarks/results/runner_speed.md: a child's imports
and model build are most of a run; 9.7 s in the child for distilbert 8 x 128 with 3
steps on 2 CPU cores, the steps themselves under a second on a GPU): about 10 s for
the ~100M models (distilbert, gpt2, pythia-160m, opt-125m), 15 s for smollm2-360m and
qwen2.5-0.5b, 25-30 s for llama-3.2-1b (its random initialisation on the CPU), a few
seconds more for the Trainer; the planner's estimates beside them (71 s for all of
SCENARIOS on 2 cores with no shipped table, as on a machine whose torch is not the pinned
one). The first 16 scenarios: about 3-4 minutes, the four added last (2-4B models) about 3 more
(measured: 259 s in their child processes on an H200), so a full run may leave some not started; the probe 10 s; the two
sub-checks about 20-40 s each. The guards keep the total under 8 minutes whatever
happens: no scenario starts after 5 min 30 s, none runs past 7 min, each sub-check gets
at most 60 s and none starts after 7 min 40 s.

Records (benchmarks/results/gpu_check.json, `scenarios`): per scenario, its inputs
(model, family, technique, engine, expandable segments, scenario values), the run's
status and history id, the measured allocated peak (`max_memory_allocated` over the
steady-state step), reserved peak (`max_memory_reserved` over the same step), reserved
after the run, CUDA context before and after the run, weights and optimizer state
bytes, the cuBLAS workspace bytes (from the probe, per GPU), the planner's estimate and
verdict keys, and the errors: planner allocated peak (live tensors + torch's own
allocator blocks) against measured, and measured reserved over allocated. Also
`environment`, `probe`, `subchecks`, `overheads` (documented figures next to measured
ones) and `elapsed_s`. benchmarks/results/gpu_check.md tables the same.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from planner.cuda_overheads import (  # noqa: E402
    CONTEXT_BYTES,
    CONTEXT_LOW_BYTES,
    CUBLAS_WORKSPACES_PER_STEP,
    cublas_workspace_bytes,
)
from planner.units import GIB, MIB  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"
EXPANDABLE_ON = "expandable_segments:True"
EXPANDABLE_OFF = "expandable_segments:False"
# Step 1 creates the optimizer state; the last step is measured (DESIGN, "What measured means").
# Six, not three: with expandable segments a run's reserved memory can still grow after step 3
# (SmolLM2-360M's did, in the allocator's replay of its own record), and the planner reports the
# level a long run stays at (planner.reserved SETTLING_REPEATS). The runs of 2026-12-04 measured
# step 3 (their records' "steps").
STEPS = 6
START_LIMIT_S = 330.0  # no scenario starts after 5 min 30 s
SCENARIO_END_S = 420.0  # no scenario runs past 7 min
SCENARIO_TIMEOUT_S = 150.0
MIN_SCENARIO_S = 30.0
SUBCHECK_TIMEOUT_S = 60.0
SUBCHECK_END_S = 460.0  # no sub-check runs past 7 min 40 s
MIN_SUBCHECK_S = 10.0
PROBE_TIMEOUT_S = 60.0
RESERVED_REPORTED = (0.02, 0.15)  # users report reserved 2-15% above allocated (DESIGN, Known facts)

LESSON = dict(task="sequence-classification", num_labels=2, batch_size=8, seq_len=128)
CAUSAL = dict(task="causal-lm", batch_size=4, seq_len=512)


def scenario(sid: str, model: str, technique: str, values: dict, engine: str = "accelerate",
             expandable: bool = False) -> dict:
    return {"id": sid, "model": model, "technique": technique, "engine": engine,
            "expandable_segments": expandable, "values": values}


# Attention dropout: on in distilbert (attention_dropout 0.1) and gpt2 (attn_pdrop 0.1) as
# their configs ship; off (0.0) in SmolLM2, Qwen2.5, Pythia, OPT and Llama-3.2.
SCENARIOS = [
    scenario("distilbert-adamw", "distilbert-base-cased", "AdamW, fp32, SDPA, dropout on",
             dict(LESSON, optimizer="adamw")),
    scenario("distilbert-adamw-exp", "distilbert-base-cased", "AdamW, fp32, SDPA, dropout on, expandable",
             dict(LESSON, optimizer="adamw"), expandable=True),
    scenario("distilbert-hf-adafactor-trainer", "distilbert-base-cased", "Adafactor (TrainingArguments), Trainer",
             dict(LESSON, optimizer="hf-adafactor"), engine="trainer"),
    scenario("distilbert-adam8bit-exp", "distilbert-base-cased", "8-bit Adam, expandable",
             dict(LESSON, optimizer="adam8bit"), expandable=True),
    scenario("distilbert-fused-bf16-ckpt-accum", "distilbert-base-cased",
             "fused AdamW, bf16 autocast, checkpointing, accumulation 4 x 2, Trainer",
             dict(LESSON, optimizer="adamw-fused", precision="bf16-mixed", gradient_checkpointing=True,
                  batch_size=2, grad_accum=4), engine="trainer"),
    scenario("gpt2-fused-bf16", "gpt2", "fused AdamW, bf16 autocast, SDPA, dropout on",
             dict(CAUSAL, optimizer="adamw-fused", precision="bf16-mixed")),
    scenario("gpt2-sgd-eager-exp", "gpt2", "SGD momentum, fp32, eager, dropout on, expandable",
             dict(CAUSAL, optimizer="sgd", attn="eager"), expandable=True),
    scenario("gpt2-adafactor-bf16", "gpt2", "Adafactor (torch), pure bf16",
             dict(CAUSAL, optimizer="adafactor", precision="bf16")),
    # fp16 autocast with accelerate's GradScaler, what a T4 or V100 trains in: planned under
    # autocast on CUDA's kernels since 2026-12-05 (an fp32 step before), the scaler's 0-dim
    # tensors left out (planner.probe.build.autocast_as_on_cuda).
    scenario("gpt2-adamw-fp16", "gpt2", "AdamW, fp16 autocast with GradScaler, SDPA, dropout on",
             dict(CAUSAL, optimizer="adamw", precision="fp16-mixed")),
    scenario("smollm2-adamw-bf16", "smollm2-360m", "AdamW, bf16 autocast, SDPA, dropout off",
             dict(CAUSAL, optimizer="adamw", precision="bf16-mixed")),
    scenario("smollm2-adamw-bf16-exp", "smollm2-360m", "AdamW, bf16 autocast, SDPA, dropout off, expandable",
             dict(CAUSAL, optimizer="adamw", precision="bf16-mixed"), expandable=True),
    scenario("pythia-adamw8bit-eager-accum", "pythia-160m", "8-bit AdamW, fp32, eager, accumulation 2 x 4",
             dict(CAUSAL, optimizer="adamw8bit", attn="eager", seq_len=256, grad_accum=2)),
    scenario("opt-adamw-trainer", "opt-125m", "AdamW, fp32, SDPA, Trainer",
             dict(CAUSAL, optimizer="adamw"), engine="trainer"),
    scenario("qwen2.5-paged8bit-bf16-ckpt-trainer-exp", "qwen2.5-0.5b",
             "paged 8-bit AdamW, bf16 autocast, checkpointing, Trainer, expandable",
             dict(CAUSAL, optimizer="paged-adamw8bit", precision="bf16-mixed", gradient_checkpointing=True),
             engine="trainer", expandable=True),
    scenario("llama-3.2-1b-adamw8bit-bf16-ckpt-exp", "llama-3.2-1b",
             "8-bit AdamW, bf16 autocast, checkpointing, expandable",
             dict(CAUSAL, optimizer="adamw8bit", precision="bf16-mixed", gradient_checkpointing=True),
             expandable=True),
    # LoRA and QLoRA at PEFT's defaults (r 16, all-linear): the replay's wrapped model.
    scenario("gpt2-lora-bf16", "gpt2", "LoRA r16 all-linear, AdamW, bf16 autocast",
             dict(CAUSAL, optimizer="adamw", precision="bf16-mixed", finetune="lora")),
    scenario("qwen2.5-qlora-paged8bit-ckpt-exp", "qwen2.5-0.5b",
             "QLoRA nf4 (double quantisation), r16 all-linear, paged 8-bit AdamW, bf16, checkpointing, expandable",
             dict(CAUSAL, optimizer="paged-adamw8bit", precision="bf16-mixed", gradient_checkpointing=True,
                  finetune="qlora"), expandable=True),
    # Four models measured for the first time in the second session, none of them tuned on:
    # BERT's biases at 4,096 tokens, Qwen3's q/k norms, Gemma-2's soft-capping and eager
    # attention, Phi-3's fused qkv and gate-up projections.
    scenario("bert-base-adamw", "bert-base-uncased", "AdamW, fp32, SDPA, dropout on",
             dict(LESSON, optimizer="adamw", batch_size=16, seq_len=256)),
    scenario("qwen3-0.6b-adamw-bf16-ckpt-exp", "qwen3-0.6b", "AdamW, bf16 autocast, checkpointing, expandable",
             dict(CAUSAL, optimizer="adamw", precision="bf16-mixed", gradient_checkpointing=True, batch_size=8,
                  seq_len=1024), expandable=True),
    scenario("gemma-2-2b-adamw8bit-bf16-ckpt", "gemma-2-2b", "8-bit AdamW, bf16 autocast, eager, checkpointing",
             dict(CAUSAL, optimizer="adamw8bit", precision="bf16-mixed", gradient_checkpointing=True, attn="eager",
                  batch_size=2, seq_len=1024)),
    scenario("phi-3-mini-adamw-bf16-ckpt", "phi-3-mini-4k-instruct", "AdamW, bf16 autocast, checkpointing",
             dict(CAUSAL, optimizer="adamw", precision="bf16-mixed", gradient_checkpointing=True, seq_len=1024)),
]

# The dry run: the same code path on CPU, tiny configs (tests/configs), both engines, both settings.
DRY_SCENARIOS = [
    scenario("tiny-gpt2-adamw-exp", "tests/configs/tiny-gpt2.json", "AdamW, fp32, expandable (CPU: no effect)",
             dict(task="causal-lm", batch_size=2, seq_len=32, optimizer="adamw"), expandable=True),
    scenario("tiny-llama-sgd-trainer", "tests/configs/tiny-llama.json", "SGD, fp32, Trainer",
             dict(task="causal-lm", batch_size=2, seq_len=32, optimizer="sgd"), engine="trainer"),
]

# --- the environment probe (its own process) -------------------------------------------
PROBE_CODE = r'''
import json, platform, sys
import torch
out = {"torch": torch.__version__, "python": platform.python_version(), "platform": platform.platform(),
       "cuda_available": torch.cuda.is_available(), "cuda_version": torch.version.cuda}
from importlib import metadata
for package in ("transformers", "accelerate", "bitsandbytes", "peft"):  # installed versions, without importing them
    try:
        out[package] = metadata.version(package)
    except metadata.PackageNotFoundError:
        out[package] = None
def r512(n):
    return max(512, -(-n // 512) * 512)
def storage(t):
    return r512(t.untyped_storage().nbytes())
if out["cuda_available"]:
    torch.cuda.init()
    free, total = torch.cuda.mem_get_info()
    out.update(gpu_name=torch.cuda.get_device_name(), compute_capability=list(torch.cuda.get_device_capability()),
               total_bytes=total, cudnn_version=torch.backends.cudnn.version(),
               multiprocessors=torch.cuda.get_device_properties(0).multi_processor_count,
               context_bytes=total - free - torch.cuda.memory_reserved())
    a = torch.randn(512, 512, device="cuda")
    b = torch.randn(512, 512, device="cuda")
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    c = a @ b
    torch.cuda.synchronize()
    out["workspace_main_thread_bytes"] = torch.cuda.memory_allocated() - before - storage(c)
    # A bf16 linear with a bias takes cuBLASLt's path (the bias epilogue): its workspace, if separate.
    a16, b16, bias = a.bfloat16(), b.bfloat16(), torch.zeros(512, device="cuda", dtype=torch.bfloat16)
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    d = torch.nn.functional.linear(a16, b16, bias)
    torch.cuda.synchronize()
    out["workspace_lt_main_thread_bytes"] = torch.cuda.memory_allocated() - before - storage(d)
    x = torch.randn(64, 512, device="cuda", requires_grad=True)
    w = torch.randn(512, 512, device="cuda", requires_grad=True)
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    y = (x @ w).sum()
    y.backward()
    torch.cuda.synchronize()
    out["workspace_autograd_thread_bytes"] = (torch.cuda.memory_allocated() - before
                                              - storage(y) - storage(x.grad) - storage(w.grad))
    free, total = torch.cuda.mem_get_info()
    out["context_after_matmuls_bytes"] = total - free - torch.cuda.memory_reserved()
else:
    out["gpu_name"] = None
print(json.dumps(out))
'''


def run_probe(timeout_s: float = PROBE_TIMEOUT_S) -> dict:
    """The environment probe's JSON, or {"error": ...}; never raises."""
    probe = _run_subprocess([sys.executable, "-c", PROBE_CODE], timeout_s)
    if probe["returncode"] != 0:
        return {"error": f"the environment probe failed ({probe['reason']}): {probe['output_tail'][-300:]}"}
    try:
        data = json.loads(probe["stdout"].strip().splitlines()[-1])
    except (ValueError, IndexError):
        return {"error": f"the environment probe printed no JSON: {probe['output_tail'][-300:]}"}
    data["driver_version"] = _nvidia_smi_driver()
    data["wall_s"] = probe["wall_s"]
    return data


def _nvidia_smi_driver() -> str | None:
    try:
        done = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                              capture_output=True, text=True, timeout=15)
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout.strip().splitlines()[0] if done.returncode == 0 and done.stdout.strip() else None


def _run_subprocess(command: list[str], timeout_s: float, env: dict | None = None) -> dict:
    """Run `command` in its own session; past `timeout_s` its whole process group is killed
    (allocator_gpu_check.py starts workers that would otherwise keep GPU memory)."""
    started = time.monotonic()
    try:
        proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
                                env=env, start_new_session=True)
    except OSError as error:
        proc, code, stdout, stderr, reason = None, None, "", "", f"could not start: {error}"
    if proc is not None:
        try:
            stdout, stderr = proc.communicate(timeout=timeout_s)
            code, reason = proc.returncode, None
        except subprocess.TimeoutExpired:
            code, reason = None, f"no result within {timeout_s:g} s: stopped"
        finally:
            try:
                os.killpg(proc.pid, signal.SIGKILL)  # whatever it started, whatever the outcome
            except (ProcessLookupError, PermissionError):
                pass
        if code is None:
            stdout, stderr = proc.communicate()
    if reason is None and code != 0:
        reason = f"exit status {code}"
    tail = (stdout + ("\n" if stdout and stderr else "") + stderr)[-4000:]
    return {"command": " ".join(command[1:2] if command[1:2] != ["-c"] else ["<probe>"]), "returncode": code,
            "reason": reason, "wall_s": round(time.monotonic() - started, 1), "stdout": stdout,
            "output_tail": tail}


# --- the planner's GPU ------------------------------------------------------------------
_GPU_NAMES = (("H200", ("h200",)), ("H100", ("h100",)), ("A100", ("a100-40gb", "a100-80gb")),
              ("4090", ("rtx4090",)), ("L4", ("l4",)), ("A10", ("a10",)), ("T4", ("t4",)))
GPU_MATCH_TOLERANCE = 0.03  # the driver keeps back up to ~0.5% of nvidia-smi's total (planner.cuda_overheads)


def planner_gpu(name: str | None, total_bytes: int | None) -> str | None:
    """The planner.gpus key of the GPU torch names (its capacity within 3%), else its size in
    GiB as text (what `--gpu` accepts); None without a GPU."""
    from planner.gpus import GPUS

    if not total_bytes:
        return None
    for token, keys in _GPU_NAMES:
        if name and re.search(rf"(?<![A-Z0-9]){token}(?![0-9])", name.upper()):
            key = min(keys, key=lambda k: abs(GPUS[k].capacity_bytes - total_bytes))
            if abs(GPUS[key].capacity_bytes - total_bytes) <= GPU_MATCH_TOLERANCE * total_bytes:
                return key
    return f"{total_bytes / GIB:.2f}"


# --- one scenario -------------------------------------------------------------------------
def _ratio(numerator: int | None, denominator: int | None) -> float | None:
    if numerator is None or not denominator:
        return None
    return round(numerator / denominator, 5)


def _error_pct(estimated: int | None, measured: int | None) -> float | None:
    if estimated is None or not measured:
        return None
    return round((estimated - measured) / measured * 100.0, 3)


VERDICT_KEYS = ("capacity_bytes", "usable_capacity_bytes", "allocated_peak_bytes", "reserved_peak_bytes",
                "required_bytes", "margin_bytes", "fits", "cuda_overhead_bytes", "allocator_overhead_bytes")


def planner_record(spec: dict, device: str, gpu: str | None, cudnn_version: int | None = None) -> dict:
    """The planner's estimate and verdict for the scenario (planner.cli.result_json), the
    attention kernels chosen for `cudnn_version` (None: this process's torch's cuDNN, the
    runs' on a GPU machine; on a CPU build the planner's default)."""
    from planner.cli import result_json

    values = {**spec["values"], "config": spec["model"], "device": device, "engine": spec["engine"]}
    if device == "cuda" and spec["expandable_segments"]:  # the replay takes the run's PYTORCH_CUDA_ALLOC_CONF
        values["cuda_alloc_conf"] = EXPANDABLE_ON
    if gpu is not None:
        values["gpu"] = gpu
    if device == "cuda":
        import torch

        values["cudnn_version"] = cudnn_version if cudnn_version is not None else torch.backends.cudnn.version()
    started = time.monotonic()
    try:
        data = result_json(values, base_dir=ROOT)
    except Exception as error:  # one planner failure must not stop the check
        return {"error": f"{type(error).__name__}: {' '.join(str(error).split())}"[:500]}
    record = {"peak_bytes": data.get("peak_bytes"), "peak_phase": data.get("peak_phase"),
              "weights_bytes": data.get("weights_bytes"), "optimizer_state_bytes": data.get("optimizer_state_bytes"),
              "confidence": data.get("confidence"), "gpu": gpu, "wall_s": round(time.monotonic() - started, 2)}
    record.update({key: data.get(key) for key in VERDICT_KEYS})
    if record["allocated_peak_bytes"] is None:  # no verdict (CPU): the live-tensor peak is the allocated one
        record["allocated_peak_bytes"] = record["peak_bytes"]
    record["cuda_overhead_items"] = [{k: item[k] for k in ("name", "bytes", "kind")}
                                     for item in data.get("cuda_overhead_items") or []]
    record["allocator_overhead_items"] = [{k: item[k] for k in ("name", "bytes", "kind")}
                                          for item in data.get("allocator_overhead_items") or []]
    record["caveat"] = data.get("caveat")
    return record


def scenario_record(spec: dict, result: dict, planned: dict, probe: dict, family: str | None) -> dict:
    """What the check keeps of one scenario: inputs, measurement, estimate, errors."""
    measured = result.get("measured") or {}
    environment = result.get("environment") or {}
    allocated = measured.get("peak_bytes")
    reserved = measured.get("reserved_peak_bytes")
    workspace = _workspace_bytes(probe)
    return {
        "id": spec["id"], "model": spec["model"], "family": family, "technique": spec["technique"],
        "engine": spec["engine"], "expandable_segments": spec["expandable_segments"],
        "cuda_alloc_conf": EXPANDABLE_ON if spec["expandable_segments"] else EXPANDABLE_OFF,
        "scenario": spec["values"], "steps": STEPS,
        "status": result.get("status"), "reason": result.get("reason"), "run_id": result.get("run_id"),
        "mode": result.get("mode"), "wall_s": (result.get("child") or {}).get("wall_s"),
        "child_alloc_conf": environment.get("cuda_alloc_conf"),
        "measured": {
            "allocated_peak_bytes": allocated,
            "reserved_peak_bytes": reserved,
            "reserved_after_run_bytes": measured.get("reserved_bytes"),
            "cuda_context_bytes": measured.get("cuda_context_bytes"),
            "cuda_context_after_run_bytes": measured.get("cuda_context_after_run_bytes"),
            "cublas_workspace_bytes": workspace,
            "weights_bytes": measured.get("weights_bytes"),
            "optimizer_state_bytes": measured.get("optimizer_state_bytes"),
            "peak_phase": measured.get("peak_phase"),
            "phase_peak_bytes": measured.get("phase_peak_bytes"),
            "after_load_bytes": measured.get("after_load_bytes"),
            "step_wall_s": measured.get("step_wall_s"),
        },
        "planner": planned,
        "errors": scenario_errors(planned, allocated, reserved, measured.get("optimizer_state_bytes")),
        "environment": environment,
    }


def scenario_errors(planned: dict, allocated: int | None, reserved: int | None, state: int | None) -> dict:
    """The estimate's errors against one measurement (percent of the measured figure)."""
    return {
        "allocated_peak_pct": _error_pct(planned.get("allocated_peak_bytes"), allocated),
        "live_tensor_peak_pct": _error_pct(planned.get("peak_bytes"), allocated),
        "reserved_peak_pct": _error_pct(planned.get("reserved_peak_bytes"), reserved),
        "optimizer_state_pct": _error_pct(planned.get("optimizer_state_bytes"), state),
        "reserved_over_allocated": _ratio(reserved, allocated),
    }


def _workspace_bytes(probe: dict) -> int | None:
    """The cuBLAS and cuBLASLt workspaces the probe saw allocated (main thread, cuBLASLt's
    if separate, autograd's device thread); None where not measured."""
    parts = [probe.get("workspace_main_thread_bytes"), probe.get("workspace_autograd_thread_bytes")]
    if any(p is None for p in parts):
        return None
    return sum(parts) + (probe.get("workspace_lt_main_thread_bytes") or 0)


# --- the planner's estimates, beside the runs -----------------------------------------------
# The estimates are computed in one process of their own, started before the first run:
# on a machine whose torch is not the pinned one (a lent GPU's image) every technique class
# is probed afresh (about 70 s for SCENARIOS on 2 cores), and beside the runs that costs no
# device time. The GPU is hidden from it, so it never holds a CUDA context on the GPU whose
# context and memory the runs measure; the planner needs none (fake tensors, CUDA kernels
# chosen by planner.probe.fake_cuda).
PLANNER_ENV = {"CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "4"}
PLAN_POLL_S = 0.5


def plan_into(specs: list[dict], device: str, gpu: str | None, path: Path) -> None:
    """Each scenario's planner record, in order, into `path` ({id: record}), rewritten after
    each one (what the parallel planner process does)."""
    from planner.probe.cache import write_tables  # a JSON file written whole, then renamed

    plans: dict = {}
    for spec in specs:
        plans[spec["id"]] = planner_record(spec, device, gpu)
        write_tables(plans, path)
        print(f"[planned] {spec['id']} ({plans[spec['id']].get('wall_s', 'n/a')} s)", flush=True)


class ParallelPlanner:
    """The planner process (`gpu_check.py --plans-into`), and each record as it arrives."""

    def __init__(self, specs: list[dict], device: str, gpu: str | None, folder: Path):
        self.path, self.log_path = folder / "plans.json", folder / "planner.log"
        command = [sys.executable, str(Path(__file__).resolve()), "--plans-into", str(self.path),
                   "--plan-device", device, "--only", ",".join(s["id"] for s in specs)]
        if gpu is not None:
            command += ["--plan-gpu", gpu]
        self.log = self.log_path.open("w")
        self.proc = subprocess.Popen(command, stdout=self.log, stderr=subprocess.STDOUT, cwd=ROOT,
                                     env={**os.environ, **PLANNER_ENV}, start_new_session=True)

    def _plans(self) -> dict:
        try:
            return json.loads(self.path.read_text())
        except (OSError, ValueError):
            return {}

    def record(self, spec_id: str, deadline_s: float, clock: Callable[[], float] = time.monotonic) -> dict:
        """`spec_id`'s record once written; an error record if the process ends without it or
        `deadline_s` (on `clock`) passes first."""
        while True:
            ended = self.proc.poll() is not None
            plans = self._plans()
            if spec_id in plans:
                return plans[spec_id]
            if ended:
                tail = " ".join(self.log_path.read_text()[-400:].split())
                return {"error": f"the planner's process ended (exit status {self.proc.returncode}) without this "
                                 f"scenario's estimate: {tail}"}
            if clock() > deadline_s:
                return {"error": "no estimate: the planner's process had not reached this scenario within the "
                                 "time budget"}
            time.sleep(PLAN_POLL_S)

    def stop(self) -> None:
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        self.proc.wait()
        self.log.close()


def measure_scenario(spec: dict, *, mode: str, gpu: str | None, probe: dict, history, timeout_s: float,
                     plan: Callable[[dict], dict] | None = None) -> dict:
    """Run one scenario in a child (runners.verify, recorded in `history`) and build its record;
    its estimate from `plan(spec)` (default: planner_record in this process)."""
    from planner.config_source import resolve_config
    from runners.request import Engine, Mode, VerifyRequest
    from runners.verify import verify

    config, name = resolve_config(spec["model"], base_dir=ROOT)
    device = "cuda" if mode == "cuda" else "cpu"
    request = VerifyRequest(config=config, model_name=name, scenario={**spec["values"], "device": device},
                            mode=Mode(mode), engine=Engine(spec["engine"]), steps=STEPS,
                            cuda_alloc_conf=EXPANDABLE_ON if spec["expandable_segments"] else EXPANDABLE_OFF)
    try:
        result = verify(request, timeout_s=timeout_s, history=history)
    except Exception as error:  # bad input or a history fault: this scenario fails, the check goes on
        result = {"status": "failed", "reason": f"{type(error).__name__}: {' '.join(str(error).split())}"[:500]}
    planned = plan(spec) if plan is not None else planner_record(spec, device, gpu)
    return scenario_record(spec, result, planned, probe, config.get("model_type"))


BITSANDBYTES_OPTIMIZERS = ("adam8bit", "adamw8bit", "paged-adamw8bit")


def missing_package(spec: dict, probe: dict) -> str | None:
    """Why the scenario cannot run in this environment (a package it needs is absent), or None:
    said at once, rather than after a child has started and failed."""
    method = spec["values"].get("finetune", "full")
    needs = [("bitsandbytes", "the 8-bit optimizers need it")] if spec["values"].get("optimizer") in \
        BITSANDBYTES_OPTIMIZERS else []
    needs += [("peft", "LoRA needs it")] if method in ("lora", "qlora") else []
    needs += [("bitsandbytes", "QLoRA's 4-bit layers need it")] if method == "qlora" else []
    for package, why in needs:
        if package in probe and probe.get(package) is None:
            return (f"not run: {package} is not installed here ({why}): install {package} (requirements.txt), "
                    "or carry its wheel, and run this scenario again with --only")
    return None


def skipped_record(spec: dict, reason: str) -> dict:
    return {"id": spec["id"], "model": spec["model"], "family": None, "technique": spec["technique"],
            "engine": spec["engine"], "expandable_segments": spec["expandable_segments"],
            "cuda_alloc_conf": EXPANDABLE_ON if spec["expandable_segments"] else EXPANDABLE_OFF,
            "scenario": spec["values"], "steps": STEPS, "status": "skipped", "reason": reason, "run_id": None,
            "mode": None, "wall_s": None, "child_alloc_conf": None, "measured": None, "planner": None,
            "errors": None, "environment": None}


def run_scenarios(specs: list[dict], measure: Callable[[dict, float], dict], *, started: float,
                  clock: Callable[[], float] = time.monotonic, start_limit_s: float = START_LIMIT_S,
                  end_s: float = SCENARIO_END_S, on_record: Callable[[list[dict]], None] | None = None,
                  log: Callable[[str], None] = print) -> list[dict]:
    """Each scenario through `measure(spec, timeout_s)`, in order, until the time guard: none
    starts once `start_limit_s` have passed since `started`, and each one's time limit
    ends by `end_s` (at most SCENARIO_TIMEOUT_S, at least MIN_SCENARIO_S). The ones not
    started are "skipped" records. `on_record(records)` after each (the results are
    rewritten then)."""
    records: list[dict] = []
    for index, spec in enumerate(specs, 1):
        elapsed = clock() - started
        if elapsed > start_limit_s:
            records.append(skipped_record(spec, f"not started: {elapsed:.0f} s had passed, over the "
                                                f"{start_limit_s:.0f} s time budget for starting scenarios"))
        else:
            timeout_s = max(MIN_SCENARIO_S, min(SCENARIO_TIMEOUT_S, end_s - elapsed))
            log(f"[{index}/{len(specs)}] {spec['id']} ({elapsed:.0f} s elapsed, limit {timeout_s:.0f} s)")
            records.append(measure(spec, timeout_s))
            last = records[-1]
            log(f"    {last['status']}" + (f": {last['reason']}" if last.get("reason") else ""))
        if on_record is not None:
            on_record(records)
    return records


# --- the sub-checks -------------------------------------------------------------------------
def run_subchecks(out_dir: Path, *, dry_run: bool, started: float, clock: Callable[[], float] = time.monotonic,
                  end_s: float = SUBCHECK_END_S) -> dict:
    """benchmarks/allocator_gpu_check.py and scripts/check_fake_cuda_on_gpu.py, each bounded."""
    allocator = [sys.executable, str(ROOT / "benchmarks" / "allocator_gpu_check.py"), "--out", str(out_dir)]
    fake_cuda = [sys.executable, str(ROOT / "scripts" / "check_fake_cuda_on_gpu.py")]
    commands = {"allocator_gpu_check": allocator + (["--dry-run"] if dry_run else []),
                "check_fake_cuda_on_gpu": fake_cuda + ([] if dry_run else ["--steps"])}
    results = {}
    for name, command in commands.items():
        left = end_s - (clock() - started)
        if left < MIN_SUBCHECK_S:
            results[name] = {"command": " ".join(command[1:]), "returncode": None, "wall_s": 0.0,
                             "reason": f"not started: {left:.0f} s left of the time budget", "output_tail": ""}
            continue
        print(f"[sub-check] {name} (limit {min(SUBCHECK_TIMEOUT_S, left):.0f} s)", flush=True)
        done = _run_subprocess(command, min(SUBCHECK_TIMEOUT_S, left))
        done.pop("stdout")
        done["command"] = " ".join(str(Path(c).relative_to(ROOT)) if c.startswith(str(ROOT)) else c
                                   for c in command[1:])
        results[name] = done
    allocator_json = out_dir / "allocator_gpu_check.json"
    if not dry_run and allocator_json.exists():
        try:
            rows = json.loads(allocator_json.read_text()).get("rows", [])
            results["allocator_gpu_check"]["summary"] = {
                "traces": len(rows), "exact_every_event": sum(bool(r.get("exact")) for r in rows),
                "peak_reserved_equal": sum(r.get("peak_reserved_model") == r.get("peak_reserved_measured")
                                           for r in rows)}
        except (ValueError, AttributeError) as error:
            results["allocator_gpu_check"]["summary"] = {"error": f"unreadable: {error}"}
    lines = results["check_fake_cuda_on_gpu"].get("output_tail", "").splitlines()
    results["check_fake_cuda_on_gpu"]["mismatches"] = sum("MISMATCH" in line for line in lines)
    return results


# --- overheads: documented next to measured ---------------------------------------------------
def overheads_summary(records: list[dict], probe: dict) -> dict:
    measured = [r["measured"] for r in records if r.get("measured")]
    contexts = [m["cuda_context_bytes"] for m in measured if m.get("cuda_context_bytes") is not None]
    after = [m["cuda_context_after_run_bytes"] for m in measured if m.get("cuda_context_after_run_bytes") is not None]
    ratios = [r["errors"]["reserved_over_allocated"] for r in records
              if r.get("errors") and r["errors"].get("reserved_over_allocated") is not None]
    capability = probe.get("compute_capability")
    documented_workspace = (cublas_workspace_bytes(tuple(capability) if capability else None)
                            * CUBLAS_WORKSPACES_PER_STEP)
    return {
        "cuda_context": {"documented_bytes": CONTEXT_BYTES, "documented_low_bytes": CONTEXT_LOW_BYTES,
                         "source": "planner/cuda_overheads.py (CONTEXT_SOURCE)", "bare_measured_bytes":
                         probe.get("context_bytes"), "after_matmuls_measured_bytes": probe.get("context_after_matmuls_bytes"),
                         "at_run_start_measured_max_bytes": max(contexts, default=None),
                         "after_run_measured_max_bytes": max(after, default=None)},
        "cublas_workspace": {"documented_bytes": documented_workspace,
                             "source": "planner/cuda_overheads.py (TORCH_CUBLAS_SOURCE)",
                             "measured_bytes": _workspace_bytes(probe),
                             "main_thread_measured_bytes": probe.get("workspace_main_thread_bytes"),
                             "lt_main_thread_measured_bytes": probe.get("workspace_lt_main_thread_bytes"),
                             "autograd_thread_measured_bytes": probe.get("workspace_autograd_thread_bytes")},
        "reserved_over_allocated": {"reported_range": list(RESERVED_REPORTED),
                                    "source": "DESIGN.md, Known facts (users' reports)",
                                    "measured_min": min(ratios, default=None),
                                    "measured_max": max(ratios, default=None)},
    }


# --- output -------------------------------------------------------------------------------------
def _b(value) -> str:
    return "n/a" if value is None else f"{value:,}"


def _pct(value) -> str:
    return "n/a" if value is None else f"{value:+.2f}%"


def _mib(value) -> str:
    return "n/a" if value is None else f"{value / MIB:,.1f} MiB"


def _sm_counts(env: dict, gpu_key: str | None) -> str:
    """The SMs torch read (multi_processor_count) beside the planner's preset figure, which the
    replay's kernel scratch is sized by (planner.gpus, planner.embedding_scratch)."""
    from planner.gpus import GPUS

    preset = GPUS[gpu_key].multiprocessors if gpu_key in GPUS else None
    return f"SMs {env.get('multiprocessors') or 'n/a'} (the planner's preset: {preset or 'n/a'})"


def render_markdown(report: dict) -> str:
    env, probe = report["environment"], report["probe"]
    lines = ["# GPU check (benchmarks/gpu_check.sh)", "",
             (f"Mode: {report['mode']}; device: {env.get('gpu_name') or env.get('device')}; driver "
              f"{env.get('driver_version') or 'n/a'}; torch {env.get('torch')}; CUDA {env.get('cuda_version') or 'n/a'}; "
              f"cuDNN {env.get('cudnn_version') or 'n/a'}; {_sm_counts(env, report['gpu'])}; planner GPU `{report['gpu']}`; "
              f"{report['elapsed_s']:.0f} s in all; command: `{report['command']}`."), "",
             ("Allocated: `max_memory_allocated` over the steady-state step (the last of each run's "
              f"{', '.join(sorted({str(r.get('steps')) for r in report['scenarios']}))} steps); reserved: "
              "`max_memory_reserved` over the same step; estimate: the planner's allocated peak (live "
              "tensors + torch's own allocator blocks, the cuBLAS workspaces; where the allocator is replayed, "
              "the replay's) and reserved peak (the replay's). Error: (estimate - measured) / "
              "measured. Context: the CUDA context at the run's start / after it; workspace: the probe's "
              "cuBLAS workspaces (per GPU)."), ""]
    if report.get("replanned"):
        again = report["replanned"]
        lines += [f"Estimates recomputed after the runs: {again['note']}", ""]
    lines += [("| scenario | family | engine | expandable | status | estimate (B) | measured allocated (B) | error "
               "| reserved estimate (B) | reserved (B) | error | reserved / allocated | context start / after "
               "| workspace | fits (planner) |"),
              "|---|---|---|---|---|---:|---:|---:|---:|---:|---:|---:|---|---:|---|"]
    for r in report["scenarios"]:
        m, p, e = r.get("measured") or {}, r.get("planner") or {}, r.get("errors") or {}
        ratio = e.get("reserved_over_allocated")
        lines.append(
            f"| {r['id']} ({r['technique']}) | {r.get('family') or 'n/a'} | {r['engine']} | "
            f"{'on' if r['expandable_segments'] else 'off'} | {r['status']} | {_b(p.get('allocated_peak_bytes'))} | "
            f"{_b(m.get('allocated_peak_bytes'))} | {_pct(e.get('allocated_peak_pct'))} | "
            f"{_b(p.get('reserved_peak_bytes'))} | {_b(m.get('reserved_peak_bytes'))} | "
            f"{_pct(e.get('reserved_peak_pct'))} | {'n/a' if ratio is None else f'{ratio:.4f}'} | "
            f"{_mib(m.get('cuda_context_bytes'))} / {_mib(m.get('cuda_context_after_run_bytes'))} | "
            f"{_mib(m.get('cublas_workspace_bytes'))} | {'n/a' if p.get('fits') is None else p['fits']} |")
    failed = [r for r in report["scenarios"] if r["status"] != "ok"]
    if failed:
        lines += ["", "Not measured:", ""] + [f"- {r['id']}: {r['status']}: {r.get('reason')}" for r in failed]
    planner_errors = [r for r in report["scenarios"] if (r.get("planner") or {}).get("error")]
    if planner_errors:
        lines += ["", "No estimate:", ""] + [f"- {r['id']}: {r['planner']['error']}" for r in planner_errors]
    o = report["overheads"]
    ctx, ws, ra = o["cuda_context"], o["cublas_workspace"], o["reserved_over_allocated"]
    fmt_range = (lambda lo, hi: "n/a" if lo is None else f"{lo:.4f}-{hi:.4f}")
    lines += ["", "## Overheads: documented figures next to measured ones", "",
              "| overhead | documented (planner) | measured |", "|---|---|---|",
              (f"| CUDA context | {_mib(ctx['documented_bytes'])} (range from {_mib(ctx['documented_low_bytes'])}) "
               f"| bare {_mib(ctx['bare_measured_bytes'])}; after matmuls {_mib(ctx['after_matmuls_measured_bytes'])}; "
               f"runs: start max {_mib(ctx['at_run_start_measured_max_bytes'])}, after max "
               f"{_mib(ctx['after_run_measured_max_bytes'])} |"),
              (f"| cuBLAS/cuBLASLt workspaces (main + autograd thread) | {_mib(ws['documented_bytes'])} "
               f"| {_mib(ws['measured_bytes'])} (main {_mib(ws['main_thread_measured_bytes'])}, cuBLASLt "
               f"{_mib(ws['lt_main_thread_measured_bytes'])}, autograd {_mib(ws['autograd_thread_measured_bytes'])}) |"),
              (f"| reserved / allocated | users report {1 + ra['reported_range'][0]:.2f}-{1 + ra['reported_range'][1]:.2f} "
               f"| {fmt_range(ra['measured_min'], ra['measured_max'])} |")]
    if probe.get("error"):
        lines += ["", f"Environment probe: {probe['error']}"]
    lines += ["", "## Sub-checks", ""]
    for name, sub in report["subchecks"].items():
        status = "ok" if sub.get("returncode") == 0 else (sub.get("reason") or f"exit {sub.get('returncode')}")
        extra = f"; {sub['summary']}" if sub.get("summary") else ""
        lines.append(f"- `{sub['command']}`: {status}, {sub.get('wall_s', 0):.1f} s{extra}")
        tail = [line for line in sub.get("output_tail", "").splitlines() if line.strip()][-12:]
        if tail:
            lines += ["", "  ```"] + [f"  {line}" for line in tail] + ["  ```", ""]
    return "\n".join(lines).rstrip() + "\n"


def write_results(report: dict, out_dir: Path) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "gpu_check.json").write_text(json.dumps(report, indent=1, allow_nan=False) + "\n")
    (out_dir / "gpu_check.md").write_text(render_markdown(report))


EXPORTED = ("gpu_check.json", "gpu_check.md", "allocator_gpu_check.json", "allocator_gpu_check.md")


def export(out_dir: Path, history_path: Path, dest: Path) -> list[str]:
    """Copy the results and a consistent copy of the run history (sqlite3's backup: the
    WAL's commits included) into `dest`: what a lent machine hands back before it goes.
    Returns the names written."""
    import shutil
    import sqlite3

    dest.mkdir(parents=True, exist_ok=True)
    written = []
    for name in EXPORTED:
        if (out_dir / name).exists() and (out_dir / name).resolve() != (dest / name).resolve():
            shutil.copyfile(out_dir / name, dest / name)
            written.append(name)
    source, target = sqlite3.connect(history_path), sqlite3.connect(dest / "runs.sqlite3")
    try:
        source.backup(target)
    finally:
        source.close()
        target.close()
    return written + ["runs.sqlite3"]


def environment_record(probe: dict) -> dict:
    keys = ("gpu_name", "compute_capability", "multiprocessors", "total_bytes", "driver_version", "torch",
            "cuda_version", "cudnn_version", "transformers", "accelerate", "bitsandbytes", "python", "platform")
    env = {key: probe.get(key) for key in keys}
    env["device"] = probe.get("gpu_name") or platform.processor() or platform.machine()
    return env


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dry-run", action="store_true",
                        help="the same code path on CPU: 2 tiny scenarios, results and history in a temp dir")
    parser.add_argument("--out", type=Path, help="folder for the results (default benchmarks/results; "
                                                 "with --dry-run a new temp dir)")
    parser.add_argument("--data-dir", type=Path, help="the run history's folder (default $PLANNER_DATA_DIR or "
                                                      "./data; with --dry-run <out>/data)")
    parser.add_argument("--only", help="comma-separated scenario ids to run (default all)")
    parser.add_argument("--export", type=Path, help="also copy the results and the run history (runs.sqlite3) "
                                                    "here at the end, e.g. a lent machine's $OUT")
    parser.add_argument("--plans-into", type=Path, help=argparse.SUPPRESS)  # the parallel planner process
    parser.add_argument("--plan-device", choices=("cpu", "cuda"), help=argparse.SUPPRESS)
    parser.add_argument("--plan-gpu", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    started = time.monotonic()
    mode = "cpu" if args.dry_run else "cuda"
    specs = DRY_SCENARIOS if args.dry_run else SCENARIOS
    if args.plans_into is not None:
        specs = DRY_SCENARIOS + SCENARIOS
    if args.only:
        wanted = set(args.only.split(","))
        unknown = wanted - {s["id"] for s in specs}
        if unknown:
            print(f"gpu_check: unknown scenario id(s) {', '.join(sorted(unknown))}: see SCENARIOS", file=sys.stderr)
            return 2
        specs = [s for s in specs if s["id"] in wanted]
    if args.plans_into is not None:
        plan_into(specs, args.plan_device or mode, args.plan_gpu, args.plans_into)
        return 0
    out_dir = args.out or (Path(tempfile.mkdtemp(prefix="gpu_check_")) if args.dry_run else RESULTS)

    print("[probe] the environment", flush=True)
    probe = run_probe()
    if mode == "cuda" and not probe.get("cuda_available"):
        print(f"gpu_check: no CUDA device visible to torch ({probe.get('error', 'torch.cuda.is_available() is false')}): "
              "run this on a machine with a GPU, or use --dry-run", file=sys.stderr)
        return 2
    gpu = planner_gpu(probe.get("gpu_name"), probe.get("total_bytes")) if mode == "cuda" else "24"

    from runners.history import RunHistory

    data_dir = args.data_dir or (out_dir / "data" if args.dry_run else None)
    history = RunHistory(data_dir / "runs.sqlite3") if data_dir is not None else RunHistory()
    report = {"mode": mode, "gpu": gpu, "command": "bash benchmarks/gpu_check.sh" + (" --dry-run" if args.dry_run else ""),
              "history_path": str(history.path),
              "environment": environment_record(probe), "probe": probe, "scenarios": [], "subchecks": {},
              "overheads": overheads_summary([], probe), "elapsed_s": 0.0,
              "time_budget_s": {"start_limit": START_LIMIT_S, "scenario_end": SCENARIO_END_S,
                                "subcheck_end": SUBCHECK_END_S}}

    def save(records: list[dict]) -> None:
        report.update(scenarios=records, overheads=overheads_summary(records, probe),
                      elapsed_s=round(time.monotonic() - started, 1))
        write_results(report, out_dir)

    device = "cuda" if mode == "cuda" else "cpu"
    planner = ParallelPlanner(specs, device, gpu, Path(tempfile.mkdtemp(prefix="gpu_check_plans_")))

    def measure(spec: dict, timeout_s: float) -> dict:
        missing = missing_package(spec, probe)
        if missing is not None:
            return skipped_record(spec, missing)
        return measure_scenario(spec, mode=mode, gpu=gpu, probe=probe, history=history, timeout_s=timeout_s,
                                plan=lambda s: planner.record(s["id"], started + SCENARIO_END_S))

    try:
        records = run_scenarios(specs, measure, started=started, on_record=save)
    finally:
        planner.stop()
    report["subchecks"] = run_subchecks(out_dir, dry_run=args.dry_run, started=started)
    save(records)
    print((out_dir / "gpu_check.md").read_text())
    print(f"gpu_check: wrote {out_dir / 'gpu_check.json'} and gpu_check.md; runs in {report['history_path']}")
    if args.export is not None:
        print(f"gpu_check: exported {', '.join(export(out_dir, history.path, args.export))} to {args.export}")
    return 0 if all(r["status"] == "ok" for r in records) else 1  # "skipped" too: not all measured


if __name__ == "__main__":
    sys.exit(main())
