"""Command line: `python -m planner estimate|batch|fit|catalog` (interfaces in ../shared/DESIGN.md).

Errors are one line on stderr saying what is wrong and what to do, with exit status 2.
Tools above the planner reuse its scenario flags (add_scenario_flags), its one-line parser
and its way of ending a command (run_guarded), so they read and fail alike.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable
from pathlib import Path

from planner.batch import (
    MAX_BATCH_LINE_CHARS,
    batch_file,
    batch_lines,
    clipped,
    line_answer,
)
from planner.attention_scratch import CudaBuild, cuda_build_from
from planner.catalog import catalog_entries
from planner.device_fit import plan_verdict, reserved_check
from planner.errors import PlannerInputError
from planner.estimate import Estimate, estimate
from planner.finetune import ALL_LINEAR, FINETUNE_KEYS, QUANT_TYPES, Method
from planner.fit import (
    SHARDING_NOTE,
    FitResult,
    FitTarget,
    max_batch_size,
    micro_batch_bound,
    smallest_plan,
)
from planner.gpus import (
    GPUS,
    capacity_bytes_from_gib,
    gpu_from_text,
    gpu_spec,
    nearest_gpu,
    scenario_on,
)
from planner.loading import load_model_shape
from planner.model_shape import ModelShape
from planner.parallel import ParallelEstimate, parallel_estimate
from planner.probe.cache import probe_progress
from planner.scenario import (
    Attention,
    Checkpointing,
    Device,
    Engine,
    Precision,
    Scenario,
    Task,
    as_int,
    capability_text,
    scenario_from_values,
)
from planner.step_time import DEFAULT_UTILISATION
from planner.strategy import (
    MULTI_DEVICE_STRATEGIES,
    ParallelPlan,
    Strategy,
    parse_strategy,
)
from planner.units import format_bytes
from planner.verdict import (
    RESERVED_NOT_IN_FIGURE,
    DeviceVerdict,
    device_overheads,
    room_for_plans,
    searchable_budget_bytes,
)

EXIT_BAD_INPUT = 2
EXIT_INTERRUPTED = 130  # 128 + SIGINT, as a shell reports Ctrl-C
EXIT_BROKEN_PIPE = 141  # 128 + SIGPIPE


def help_hint(prog: str, tool: str) -> str:
    """`python -m planner fit --help` for a subcommand's parser, `python -m planner --help` for the tool's."""
    words = prog.split()
    command = f" {words[-1]}" if len(words) > 1 else ""
    return f"see `python -m {tool}{command} --help`"


class OneLineParser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # argparse's default prints the whole usage
        raise PlannerInputError(f"{message} ({help_hint(self.prog, 'planner')})")


def add_scenario_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", required=True, help="catalog name (see `catalog`) or path to a config.json")
    parser.add_argument("--task", required=True, choices=[t.value for t in Task])
    parser.add_argument("--num-labels", default="2", help="classes for sequence classification (default 2)")
    parser.add_argument("--batch-size", required=True, help="sequences per micro-batch")
    parser.add_argument("--seq-len", required=True, help="tokens per sequence")
    parser.add_argument("--target-len", default=None,
                        help="seq2seq-lm: tokens per target sequence (the labels; default: --seq-len)")
    parser.add_argument("--optimizer", default="adamw",
                        help="adamw, adam, sgd, adafactor, hf-adafactor, adam8bit, adamw8bit, paged-adamw8bit "
                             "or a TrainingArguments optim string")
    parser.add_argument("--precision", default="fp32", choices=[p.value for p in Precision])
    parser.add_argument("--gradient-checkpointing", action="store_true")
    parser.add_argument("--grad-accum", default="1", help="micro-batches per optimizer step")
    parser.add_argument("--attn", default="sdpa", choices=[a.value for a in Attention])
    parser.add_argument("--device", default="cuda", choices=[d.value for d in Device])
    parser.add_argument("--engine", default="accelerate", choices=[e.value for e in Engine],
                        help="training loop: the lessons' Accelerate loop (default) or transformers' Trainer")
    parser.add_argument("--hub", action="store_true", help="allow fetching --config from the Hugging Face hub")
    add_alloc_conf_flag(parser)
    add_finetune_flags(parser)


def add_alloc_conf_flag(parser: argparse.ArgumentParser) -> None:
    """The run's PYTORCH_CUDA_ALLOC_CONF (planner.scenario.parse_cuda_alloc_conf)."""
    parser.add_argument("--cuda-alloc-conf", default=None,
                        help="PYTORCH_CUDA_ALLOC_CONF the run will have, for the reserved memory the verdict "
                             "replays: expandable_segments:True or expandable_segments:False (the default)")


def add_finetune_flags(parser: argparse.ArgumentParser) -> None:
    """PEFT's LoraConfig and transformers' BitsAndBytesConfig, as a user writes them."""
    parser.add_argument("--finetune", default="full", choices=[m.value for m in Method],
                        help="full fine-tuning (default), or LoRA adapters on a frozen base")
    parser.add_argument("--lora-r", default="16", help="LoRA rank r (default 16)")
    parser.add_argument("--lora-alpha", default=None, help="LoRA alpha (default 2 x r)")
    parser.add_argument("--lora-dropout", default="0.05", help="LoRA dropout probability (default 0.05)")
    parser.add_argument("--lora-targets", default=ALL_LINEAR,
                        help="all-linear (default) or module names, comma-separated (q_proj,v_proj)")
    parser.add_argument("--quant-type", default="nf4", choices=list(QUANT_TYPES), help="QLoRA's 4-bit type")
    parser.add_argument("--double-quant", default=True, action=argparse.BooleanOptionalAction,
                        help="QLoRA: quantise the quantisation constants too (default on)")


def finetune_values(args: argparse.Namespace) -> dict:
    return {"finetune": args.finetune, "lora_r": args.lora_r, "lora_alpha": args.lora_alpha,
            "lora_dropout": args.lora_dropout, "lora_targets": args.lora_targets, "quant_type": args.quant_type,
            "double_quant": args.double_quant}


def add_parallel_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--num-devices", default="1", help="data-parallel devices (GPUs), each with --batch-size")
    parser.add_argument("--strategy", default=Strategy.DDP.value, choices=[s.value for s in MULTI_DEVICE_STRATEGIES],
                        help="how the devices share the model when --num-devices > 1 (default ddp)")
    parser.add_argument("--local-sgd-steps", default=None,
                        help="accelerate LocalSGD: average parameters every K micro-batches instead of "
                             "all-reducing gradients (ddp only)")


def add_fit_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", required=True, help="catalog name (see `catalog`) or path to a config.json")
    parser.add_argument("--task", default="causal-lm", choices=[t.value for t in Task])
    parser.add_argument("--num-labels", default="2", help="classes for sequence classification (default 2)")
    parser.add_argument("--gpu-memory-gib", help="memory per GPU in GiB (default: the --gpu's)")
    parser.add_argument("--gpu", help=f"GPU whose kernels plan the step and whose throughput step times assume: "
                                      f"{', '.join(GPUS)} (default: the one nearest in memory to --gpu-memory-gib, "
                                      "planned on Ampere's kernels)")
    parser.add_argument("--num-devices", default="1", help="GPUs, data parallel (DDP) when more than one")
    parser.add_argument("--seq-len", default="512", help="tokens per sequence (default 512)")
    parser.add_argument("--target-len", default=None,
                        help="seq2seq-lm: tokens per target sequence (the labels; default: --seq-len)")
    target = parser.add_mutually_exclusive_group()
    target.add_argument("--batch-size", help="sequences per micro-batch per GPU, no accumulation")
    target.add_argument("--effective-batch", help="sequences per optimizer step, all GPUs together "
                                                  "(accumulation splits it into micro-batches)")
    parser.add_argument("--utilisation", default=str(DEFAULT_UTILISATION),
                        help=f"model FLOPs utilisation in (0, 1] (default {DEFAULT_UTILISATION})")
    parser.add_argument("--attn", default="sdpa", choices=[a.value for a in Attention])
    parser.add_argument("--device", default="cuda", choices=[d.value for d in Device])
    parser.add_argument("--engine", default="accelerate", choices=[e.value for e in Engine])
    parser.add_argument("--hub", action="store_true", help="allow fetching --config from the Hugging Face hub")
    # Your own plan: plans are ranked by the fewest and safest changes to it (planner.fit).
    parser.add_argument("--optimizer", default="adamw", help="your plan's optimizer (default adamw)")
    parser.add_argument("--precision", default="fp32", choices=[p.value for p in Precision],
                        help="your plan's precision (default fp32)")
    parser.add_argument("--gradient-checkpointing", action="store_true", help="your plan checkpoints")
    add_alloc_conf_flag(parser)
    parser.add_argument("--strategy", default=Strategy.DDP.value, choices=[s.value for s in MULTI_DEVICE_STRATEGIES],
                        help="your plan's strategy with --num-devices > 1 (default ddp)")
    add_finetune_flags(parser)
    parser.add_argument("--allow-risky", action="store_true",
                        help="also propose changes that risk model quality (pure bf16, SGD for a language model)")
    parser.add_argument("--json", action="store_true",
                        help="print a JSON list, best first (when nothing fits: the nearest plans, with fits false)")


def add_cudnn_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--cudnn-version", type=int, default=None,
                        help="your torch's cuDNN (python -c 'import torch; print(torch.backends.cudnn.version())'), "
                             "which decides the attention kernel the allocator's replay takes; default 91002 "
                             "(torch's CUDA 12.8 wheels)")


def _build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(prog="planner", description="Training memory estimates from a model config.")
    commands = parser.add_subparsers(dest="command", required=True, parser_class=OneLineParser)
    one = commands.add_parser("estimate", help="estimate one scenario")
    add_scenario_flags(one)
    add_parallel_flags(one)
    one.add_argument("--gpu", help=f"GPU for the fits / does not fit verdict, whose kernels plan the step: "
                                   f"{', '.join(GPUS)} or a size in GiB")
    add_cudnn_flag(one)
    one.add_argument("--json", action="store_true", help="print one JSON object (integer bytes)")
    many = commands.add_parser("batch", help="estimate one scenario per line of a JSONL file")
    many.add_argument("file", help="JSONL file, one scenario object per line")
    fits = commands.add_parser("fit", help="rank the technique combinations that fit a GPU (planner.fit)")
    add_fit_flags(fits)
    add_cudnn_flag(fits)
    listing = commands.add_parser("catalog", help="list the bundled models")
    listing.add_argument("--json", action="store_true")
    return parser


PARALLEL_KEYS = ("num_devices", "strategy", "local_sgd_steps")


def plan_from_values(values: dict) -> ParallelPlan:
    """The multi-device plan from user-facing values (CLI flags, JSONL keys); one device by default."""
    devices = as_int(values.get("num_devices", 1), "number of devices")
    local_sgd = values.get("local_sgd_steps")
    strategy = parse_strategy(values.get("strategy") or Strategy.DDP.value) if devices > 1 else Strategy.SINGLE
    return ParallelPlan(devices, strategy, None if local_sgd is None else as_int(local_sgd, "local SGD steps"))


def parallel_from_values(values: dict, base_dir: Path | None = None, allow_hub: bool = False) -> ParallelEstimate:
    """The single-device estimate (`.base`) and its multi-device plan from user-facing values."""
    return _shape_and_parallel(values, base_dir, allow_hub)[1]


def _shape_and_parallel(values: dict, base_dir: Path | None, allow_hub: bool) -> tuple[ModelShape, ParallelEstimate]:
    plan = plan_from_values(values)
    shape, base = _shape_and_estimate(values, base_dir, allow_hub)
    if base.scenario.finetune.uses_adapters and (plan.distributed or plan.local_sgd_steps is not None):
        raise PlannerInputError("LoRA across several devices is not planned yet: use one device "
                                "(--num-devices 1, no local SGD)")
    return shape, parallel_estimate(shape, base.scenario, plan, base=base)


def result_json(values: dict, base_dir: Path | None = None, allow_hub: bool = False) -> dict:
    """The estimate's JSON with the per-device and communication keys of its plan, and on
    CUDA the verdict's (planner.verdict: overheads itemised; capacity keys with a `gpu`;
    the caching allocator replayed where planner.device_fit can)."""
    shape, result = _shape_and_parallel(values, base_dir, allow_hub)
    data = {**result.base.to_json(), **result.to_json()}
    build = cuda_build_from(values.get("cudnn_version"))
    verdict = verdict_from_values(values, result, shape, build)
    if verdict is not None:
        data.update(verdict.to_json())
        if result.base.scenario.device is Device.CUDA:
            # The cuDNN the replay's attention kernels were chosen for (planner.attention_scratch).
            data["cudnn_version"] = build.cudnn_version
    elif result.base.scenario.device is Device.CUDA:
        # The allocator is replayed for a verdict on a GPU only: a 7B step's replay is tens of
        # milliseconds, and a `planner batch` file without GPUs should stay at estimate speed.
        overheads = device_overheads(Device.CUDA, None, result.plan)
        data.update({"allocated_peak_bytes": result.per_device_peak_bytes + overheads.allocator_bytes,
                     "reserved_peak_bytes": None, "usable_capacity_bytes": None, **overheads.to_json(),
                     "caveat": f"{RESERVED_NOT_IN_FIGURE}: give a GPU (--gpu, or the batch key gpu) to replay "
                               "the caching allocator within its capacity"})
    return data


def verdict_from_values(values: dict, result: ParallelEstimate, shape: ModelShape,
                        build: CudaBuild) -> DeviceVerdict | None:
    """The verdict on the `gpu` of `values` (a planner.gpus key or GiB), its attention kernels
    those of torch's CUDA `build`; None without one."""
    if values.get("gpu") is None:
        return None
    gpu, capacity = gpu_from_text(values["gpu"])
    return plan_verdict(shape, result, capacity, gpu, result.plan, build=build)


def estimate_from_values(values: dict, base_dir: Path | None = None, allow_hub: bool = False) -> Estimate:
    """One estimate from user-facing scenario values (the JSONL keys)."""
    return _shape_and_estimate(values, base_dir, allow_hub)[1]


def _shape_and_estimate(values: dict, base_dir: Path | None, allow_hub: bool) -> tuple[ModelShape, Estimate]:
    """The model shape and its one-device estimate from user-facing scenario values (the JSONL keys)."""
    if "config" not in values:
        raise PlannerInputError("scenario has no 'config': give a catalog name or a config.json path")
    if "task" not in values:
        raise PlannerInputError("scenario has no 'task': use one of " + ", ".join(t.value for t in Task))
    known = {"id", "config", "task", "num_labels", "batch_size", "seq_len", "target_len", "optimizer", "precision",
             "gradient_checkpointing", "grad_accum", "attn", "device", "engine", "gpu", "cudnn_version",
             "cuda_alloc_conf", "compute_capability",
             *FINETUNE_KEYS, *PARALLEL_KEYS}
    unknown = sorted(set(values) - known)
    if unknown:
        raise PlannerInputError(f"unknown scenario key(s) {', '.join(map(repr, unknown))}: allowed are {', '.join(sorted(known))}")
    for key in ("batch_size", "seq_len"):
        if key not in values:
            raise PlannerInputError(f"scenario has no {key!r}: give a positive integer")
    scenario_values = {k: v for k, v in values.items() if k not in ("id", "config", "gpu", "cudnn_version",
                                                                      *PARALLEL_KEYS)}
    scenario = _on_named_gpu(scenario_from_values(**scenario_values), values.get("gpu"))
    if not isinstance(values["config"], str):
        raise PlannerInputError("'config' must be a string: a catalog name or a config.json path")
    shape = load_model_shape(values["config"], scenario.task, scenario.num_labels, base_dir=base_dir,
                             allow_hub=allow_hub)
    return shape, estimate(shape, scenario)


def _on_named_gpu(scenario: Scenario, gpu_text: object) -> Scenario:
    """The scenario on the GPU `gpu_text` names (its kernels run the step: planner.gpus.scenario_on);
    as it is for a size in GiB, which names none."""
    if gpu_text is None:
        return scenario
    gpu = gpu_from_text(gpu_text)[0]
    if gpu is None:
        return scenario
    named = scenario_on(scenario, gpu)
    if scenario.compute_capability is not None and named.compute_capability != scenario.compute_capability:
        raise PlannerInputError(f"compute capability {capability_text(scenario.compute_capability)} is not the "
                                f"{gpu.label}'s: leave compute_capability out, or give a size in GiB as the gpu")
    return named


def format_table(result: Estimate) -> str:
    """The estimate as a readable table, binary units labelled."""
    s = result.scenario
    peak = result.peak
    lines = [
        f"{result.model_name} ({result.architecture}, {result.num_parameters:,} parameters)",
        (f"{s.task.value}, batch {s.batch_size} x {s.seq_len} tokens, {s.optimizer.value}, {s.precision.value}, "
         f"checkpointing {'on' if s.checkpointing is Checkpointing.EVERY_LAYER else 'off'}, "
         f"accumulation {s.grad_accum_steps}, attention {s.attention.value}, device {s.device.value}, "
         f"engine {s.engine.value}"
         + (f", PYTORCH_CUDA_ALLOC_CONF={s.cuda_alloc_conf}" if s.cuda_alloc_conf else "")
         + (f", compute capability {capability_text(s.compute_capability)}" if s.compute_capability else "")),
        "",
        f"{'category':<34}{'bytes':>18}  {'size (binary units)':>20}",
    ]
    rows = [
        ("weights", result.weights_bytes),
        ("gradients", result.gradients_bytes),
        ("optimizer state", result.optimizer_state_bytes),
        ("activations (end of forward)", result.activations_bytes),
        ("temporaries at the peak", peak.temporaries),
        (f"PEAK ({peak.phase.value})", peak.total),
    ]
    lines += [f"{name:<34}{value:>18,}  {format_bytes(value):>20}" for name, value in rows]
    lines += ["", f"Peak phase: {peak.phase.value}: {result.peak_reason}."]
    lines += [f"Note: {note}" for note in result.notes]
    return "\n".join(lines)


def _run_estimate(args: argparse.Namespace) -> int:
    values = {"config": args.config, "task": args.task, "num_labels": args.num_labels, "batch_size": args.batch_size,
              "seq_len": args.seq_len, "optimizer": args.optimizer, "precision": args.precision,
              "gradient_checkpointing": args.gradient_checkpointing, "grad_accum": args.grad_accum,
              "attn": args.attn, "device": args.device, "engine": args.engine, "num_devices": args.num_devices,
              "strategy": args.strategy, "local_sgd_steps": args.local_sgd_steps, "gpu": args.gpu,
              "cudnn_version": args.cudnn_version,
              "cuda_alloc_conf": args.cuda_alloc_conf, **finetune_values(args),
              **({"target_len": args.target_len} if args.target_len is not None else {})}
    if args.gpu is not None:
        gpu_from_text(args.gpu)  # a bad --gpu is refused before anything is estimated
    build = cuda_build_from(args.cudnn_version)  # a bad --cudnn-version too
    if args.json:
        print(json.dumps(result_json(values, base_dir=Path.cwd(), allow_hub=args.hub)))
        return 0
    shape, result = _shape_and_parallel(values, base_dir=Path.cwd(), allow_hub=args.hub)
    print(format_table(result.base))
    if result.plan.distributed or result.plan.local_sgd_steps is not None:
        print("\n" + format_parallel_table(result))
    verdict = verdict_from_values(values, result, shape, build)
    if verdict is not None:
        print("\n" + format_verdict(verdict))
    return 0


def format_verdict(verdict: DeviceVerdict) -> str:
    """The verdict with what it adds on CUDA (allocator blocks, overheads), binary units labelled."""
    rows = [(name, value) for name, value, _ in verdict.rows() if value is not None]
    width = max(len(name) for name, _ in rows) + 2
    lines = [f"{name:<{width}}{value:>18,}  {format_bytes(value):>14}" for name, value in rows]
    lines += ["", verdict.headline]
    if verdict.caveat:
        lines.append(f"Note: {verdict.caveat}.")
    return "\n".join(lines)


def format_parallel_table(result: ParallelEstimate) -> str:
    """Per-device memory and per-step traffic of a multi-device plan, binary units labelled."""
    plan, peak = result.plan, result.peak
    sgd = f", local SGD every {plan.local_sgd_steps} micro-batches" if plan.local_sgd_steps else ""
    lines = [f"{plan.num_devices} devices, {plan.strategy.value}{sgd}: per device", ""]
    rows = [("weights", peak.weights), ("gradients", peak.gradients), ("optimizer state", peak.optimizer_state),
            ("activations", peak.activations), ("temporaries", peak.temporaries),
            ("communication buffers", peak.communication_buffers), (f"PEAK PER DEVICE ({peak.phase.value})", peak.total)]
    lines += [f"{name:<34}{value:>18,}  {format_bytes(value):>20}" for name, value in rows]
    lines += ["", "placement: " + ", ".join(f"{k} {v}" for k, v in result.placement.items())]
    if result.ddp_bucket_bytes:
        lines.append(f"DDP gradient buckets: {len(result.ddp_bucket_bytes)} "
                     f"({', '.join(format_bytes(b) for b in result.ddp_bucket_bytes)})")
    if result.largest_gathered_unit_bytes:
        lines.append(f"largest gathered unit: {format_bytes(result.largest_gathered_unit_bytes)}")
    lines += ["", "per optimizer step (payload per device; wire = ring algorithm):"]
    for c in result.collectives:
        lines.append(f"  {c.kind:<15}{c.what:<11}{c.calls_per_step:>9.4g} calls {c.bytes_per_step:>18,.0f} B  "
                     f"{format_bytes(round(c.bytes_per_step)):>12}  wire {format_bytes(round(c.wire_bytes_per_step))}")
    lines.append(f"  total {result.comm_bytes_per_step:,.0f} B ({format_bytes(round(result.comm_bytes_per_step))}) "
                 "per optimizer step")
    return "\n".join(lines)


def _run_batch(args: argparse.Namespace) -> int:
    path = batch_file(args.file)
    base_dir = path.resolve().parent
    with path.open(encoding="utf-8", errors="replace") as stream:
        for line in batch_lines(stream):
            if line is None:
                answer = {"error": f"line is longer than {MAX_BATCH_LINE_CHARS:,} characters: not a scenario"}
            elif line.strip():
                answer = line_answer(line, lambda values: result_json(values, base_dir=base_dir))
            else:
                continue
            print(json.dumps(answer), flush=False)
    sys.stdout.flush()
    return 0


def _changes_cell(changes) -> str:
    return "; ".join(c.text for c in changes) if changes else "none (your plan)"


def _ckpt(scenario) -> str:
    return "on" if scenario.checkpointing is Checkpointing.EVERY_LAYER else "off"


def _columns_row(columns):
    def row(cells) -> str:  # a space between every two columns, so wide numbers never run together
        return " ".join(f"{cell:{align}{width}}" for cell, (_, width, align) in zip(cells, columns))
    return row


def fit_table(shape, base, result: FitResult) -> str:
    """The fit finder's answer as a readable table, best first, binary units labelled; when
    nothing fits, why, and the nearest plans with how far over the capacity each is."""
    t = result.target
    wanted = (f"effective batch {t.effective_batch:,}" if t.effective_batch is not None
              else f"batch {t.batch_size:,}" if t.batch_size is not None else "the largest batch")
    strategy = "single GPU" if result.num_devices == 1 else "DDP, ZeRO-1/2 and FSDP searched"
    lines = [f"{shape.name} ({shape.num_parameters:,} parameters), {base.task.value}, {t.seq_len} tokens, {wanted}",
             (f"{result.num_devices} x {format_bytes(result.capacity_bytes)} ({strategy}); "
              f"{result.combinations} combinations tried, "
              f"{len(result.options)} fit; ranked by {result.ranked_by}"), ""]
    risks = set()
    if not result.options:
        lines.append(_why_nothing_fits(shape, base, result))
        if result.nearest:
            columns = (("#", 3, ">"), ("strategy", 20, "<"), ("method", 9, "<"), ("optimizer", 12, "<"),
                       ("precision", 11, "<"), ("ckpt", 4, "<"), ("accum", 6, ">"), ("micro", 9, ">"),
                       ("peak", 12, ">"), ("over by", 12, ">"), ("over %", 8, ">"), ("risk", 4, "<"),
                       ("changes", 0, "<"))
            row = _columns_row(columns)
            lines += ["", "Nearest plans, and how far over the capacity each is:", row(n for n, _, _ in columns)]
            for rank, miss in enumerate(result.nearest, 1):
                s = miss.scenario
                risks.update(miss.risks)
                lines.append(row((rank, miss.strategy.value, miss.to_json()["finetune"], s.optimizer.value,
                                  s.precision.value, _ckpt(s), f"{s.grad_accum_steps:,}", f"{s.batch_size:,}",
                                  format_bytes(miss.peak_bytes), format_bytes(miss.over_bytes),
                                  f"{miss.over_pct:.1f}%", "yes" if miss.risks else "-",
                                  _changes_cell(miss.changes))).rstrip())
    else:
        columns = (("#", 3, ">"), ("strategy", 20, "<"), ("method", 9, "<"), ("optimizer", 12, "<"),
                   ("precision", 11, "<"), ("ckpt", 4, "<"), ("accum", 6, ">"), ("micro", 9, ">"),
                   ("max micro", 9, ">"), ("max seq", 9, ">"), ("peak", 12, ">"), ("step (s)", 9, ">"),
                   ("tokens/s", 11, ">"), ("risk", 4, "<"), ("changes", 0, "<"))
        row = _columns_row(columns)
        lines.append(row(name for name, _, _ in columns).rstrip())
        for rank, option in enumerate(result.options, 1):
            j = option.to_json()
            risks.update(option.risks)
            max_seq = "n/a" if j["max_seq_len"] is None else f"{j['max_seq_len']:,}"
            lines.append(row((rank, j["strategy"], j["finetune"], j["optimizer"], j["precision"],
                              "on" if j["gradient_checkpointing"] else "off", f"{j['grad_accum']:,}",
                              f"{j['batch_size']:,}", f"{j['max_batch_size']:,}", max_seq,
                              format_bytes(j["peak_bytes"]), f"{j['step_time_s']:.3f}", f"{j['tokens_per_s']:,.0f}",
                              "yes" if option.risks else "-", _changes_cell(option.changes))).rstrip())
    lines += [""] + [f"Risk: {risk.value}" for risk in sorted(risks, key=lambda r: r.value)]
    lines += list(result.left_out)
    lines += [f"Note: {note}" for note in result.notes]
    if result.risky_left_out:
        lines.append("Note: --allow-risky proposes them too, labelled")
    return "\n".join(lines)


def _why_nothing_fits(shape, base, result: FitResult) -> str:
    """The real reason: the smallest plan's memory, or, when one sequence fits, the target's
    micro-batches, which no plan can hold."""
    t = result.target
    peak, plan, smallest_strategy = smallest_plan(shape, base, t.seq_len, result.num_devices, result.gpu)
    sharded = "" if result.num_devices == 1 else f"{smallest_strategy.value}, "
    described = (f"{sharded}{plan.optimizer.value}, {plan.precision.value}, "
                 f"checkpointing {'on' if plan.checkpointing is Checkpointing.EVERY_LAYER else 'off'}")
    bound = micro_batch_bound(result)
    if peak > result.capacity_bytes or bound is None:
        more = "more GPUs with sharding" if result.num_devices == 1 else "more GPUs"
        return (f"Nothing fits. The smallest plan ({described}, batch 1) needs {format_bytes(peak)} per GPU: "
                f"a larger GPU, {more}, or LoRA / quantised weights.")
    splits, micro = bound
    most = max_batch_size(shape, plan, result.capacity_bytes, plan=ParallelPlan(
        result.num_devices, smallest_strategy)) or 1
    if t.effective_batch is not None:
        split = (f"an effective batch of {t.effective_batch:,} splits into at most {splits:,} micro-batches per GPU "
                 f"(accumulation steps are powers of two dividing it), of {micro:,} sequences each")
        fix = "an effective batch with more factors of two (a power of two), or more GPUs"
    else:
        split = f"a batch of {micro:,} sequences per GPU"
        fix = f"--batch-size {most:,} or less, --effective-batch to accumulate, or more GPUs"
    return (f"Nothing fits: {split}, and at most {most:,} fit in {format_bytes(result.capacity_bytes)} "
            f"(the smallest plan, {described}); give {fix}.")


def _positive_float(text: str | None, what: str) -> float | None:
    if text is None:
        return None
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not value > 0 or value == float("inf"):
        raise PlannerInputError(f"{what} must be a positive number, got {text!r}")
    return value


def _run_fit(args: argparse.Namespace) -> int:
    from planner.fit import find_fits

    if args.gpu_memory_gib is None and args.gpu is None:
        raise PlannerInputError("give --gpu-memory-gib G or --gpu NAME: the memory of one GPU")
    build = cuda_build_from(args.cudnn_version)
    capacity = (capacity_bytes_from_gib(args.gpu_memory_gib, "--gpu-memory-gib") if args.gpu_memory_gib is not None
                else gpu_spec(args.gpu).capacity_bytes)
    gpu = gpu_spec(args.gpu) if args.gpu is not None else nearest_gpu(capacity)
    utilisation = _positive_float(args.utilisation, "--utilisation")
    batch = None if args.batch_size is None else as_int(args.batch_size, "batch size")
    base = scenario_from_values(task=args.task, batch_size=batch or 1, seq_len=args.seq_len, attn=args.attn,
                                device=args.device, num_labels=args.num_labels, engine=args.engine,
                                optimizer=args.optimizer, precision=args.precision,
                                gradient_checkpointing=args.gradient_checkpointing,
                                cuda_alloc_conf=args.cuda_alloc_conf, target_len=args.target_len,
                                **finetune_values(args))
    base = _on_named_gpu(base, args.gpu)  # a size alone names no GPU: Ampere's kernels
    target = FitTarget(seq_len=base.seq_len, batch_size=batch,
                       effective_batch=None if args.effective_batch is None
                       else as_int(args.effective_batch, "effective batch"))
    num_devices = as_int(args.num_devices, "number of GPUs")
    shape = load_model_shape(args.config, base.task, base.num_labels, base_dir=Path.cwd(), allow_hub=args.hub)
    # Plans must pass the verdict: on CUDA, the room the overheads leave (planner.verdict).
    strategy = parse_strategy(args.strategy)
    known = gpu_spec(args.gpu) if args.gpu is not None else None  # a size alone: the overheads' larger figures
    searchable_budget_bytes(capacity, base.device, known,
                            ParallelPlan(num_devices, strategy if num_devices > 1 else Strategy.SINGLE))
    result = find_fits(shape, base, capacity, target, gpu, num_devices, utilisation,
                       allow_risky=args.allow_risky, strategy=strategy,
                       room_for=room_for_plans(capacity, base.device, known),
                       check=reserved_check(capacity, base.device, known, build))
    if args.json:
        notes = {"strategy_note": SHARDING_NOTE} if num_devices > 1 else {}
        rows = ([{"fits": True, **option.to_json(), **notes} for option in result.options]
                or [{"fits": False, **miss.to_json(), **notes} for miss in result.nearest])
        print(json.dumps(rows))
    else:
        print(fit_table(shape, base, result))
    return 0


def _run_catalog(args: argparse.Namespace) -> int:
    entries = catalog_entries()
    if args.json:
        print(json.dumps([{"name": e.name, "hub_id": e.hub_id, "family": e.family, "description": e.description,
                           "published_params": e.published_params} for e in entries.values()]))
        return 0
    for entry in entries.values():
        params = f"{entry.published_params:,}" if entry.published_params else "n/a"
        print(f"{entry.name:<28}{params:>18} params  {entry.description}")
    return 0


def main(argv: list[str] | None = None) -> int:
    def command() -> int:
        args = _build_parser().parse_args(argv)
        handler = {"estimate": _run_estimate, "batch": _run_batch, "fit": _run_fit,
                   "catalog": _run_catalog}[args.command]
        return handler(args)

    return run_guarded("planner", command)


def run_guarded(tool: str, command: Callable[[], int]) -> int:
    """Run one command line's work (parsing included) and answer its exit status: bad input
    is one line on stderr, `tool: error: ...`, and status 2; a closed pipe ends quietly
    (141), Ctrl-C with 130."""
    try:
        # A config never probed before is probed once (seconds): say what is happening.
        with probe_progress(lambda message: print(f"{tool}: {message}", file=sys.stderr, flush=True)):
            return command()
    except PlannerInputError as error:
        print(f"{tool}: error: {clipped(str(error))}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except BrokenPipeError:  # the reader went away (`| head`): stop quietly, as `cat` does
        quiet_stdout()
        return EXIT_BROKEN_PIPE
    except KeyboardInterrupt:
        print(f"{tool}: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED


def quiet_stdout() -> None:
    """Point stdout at /dev/null so the interpreter's last flush cannot fail once more."""
    try:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    except (OSError, ValueError):  # stdout already closed or not a file
        pass
