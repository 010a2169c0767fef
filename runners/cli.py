"""Command line: `python -m runners verify|history`.

`verify` takes the planner's scenario flags (`python -m planner estimate`), runs the
scenario in a child process (runners.verify) and prints estimated vs measured memory.
With `--num-processes N` (N > 1) it runs N ranks under torchrun with `--strategy`
(runners.launch) and prints each rank's measured peak and the collectives per step.
Progress goes to stderr as a one-line bar (redrawn in place on a terminal, one line per
stage otherwise); with `--json` the last stdout line is the result object.

Exit status (EXIT_CODES):
  0  ok: measured
  1  the run did not answer: failed, timeout or killed (the reason says why)
  2  bad input, or a run history that cannot be used (a damaged, read-only or newer
     database...): one line on stderr saying how to recover, nothing run
  3  a valid "no": oom (the scenario does not fit) or refused (not started, e.g. a CPU
     run too big for free RAM; the reason suggests what to do)
  130 interrupted with Ctrl-C (the child is killed and the run recorded as killed)
  143 stopped by SIGTERM or SIGHUP (likewise)

A run whose outcome the history could not store (its database deleted or damaged during
the run) still prints its result, plus one line on stderr naming the file beside the
database that keeps it (runners.unrecorded); `history` lists how many such files wait.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import threading
from pathlib import Path

from planner.cli import (
    EXIT_BAD_INPUT,
    EXIT_BROKEN_PIPE,
    OneLineParser,
    add_scenario_flags,
    finetune_values,
    help_hint,
    quiet_stdout,
)
from planner.config_source import resolve_config
from planner.errors import PlannerInputError
from planner.scenario import as_int
from planner.strategy import MULTI_DEVICE_STRATEGIES, Strategy, parse_strategy
from planner.units import format_bytes
from runners.request import INJECTABLE_FAULTS, Engine, Mode, VerifyRequest

EXIT_OK = 0
EXIT_RUN_FAILED = 1
EXIT_DOES_NOT_FIT = 3
EXIT_INTERRUPTED = 130
EXIT_TERMINATED = 128 + signal.SIGTERM
EXIT_CODES = {"ok": EXIT_OK, "failed": EXIT_RUN_FAILED, "timeout": EXIT_RUN_FAILED, "killed": EXIT_RUN_FAILED,
              "oom": EXIT_DOES_NOT_FIT, "refused": EXIT_DOES_NOT_FIT}
BAR_WIDTH = 24


class Terminated(BaseException):
    """SIGTERM or SIGHUP arrived: unwinds like Ctrl-C, so the run in progress is stopped
    (its child killed) and recorded as killed before the process exits."""


def _raise_terminated(number, frame) -> None:
    raise Terminated(f"stopped by {signal.Signals(number).name}")


class _Parser(OneLineParser):
    def error(self, message: str) -> None:  # the planner's parser names `python -m planner` in its hint
        raise PlannerInputError(f"{message} ({help_hint(self.prog, 'runners')})")


def _positive_number(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number of seconds, got {text!r}") from None
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a positive number of seconds, got {text!r}")
    return value


MAX_HISTORY_LIMIT = 1_000_000  # runs listed; SQLite's LIMIT takes a 64-bit integer


def _bounded_int(what: str, low: int, high: int):
    """An argparse type: an integer from low to high, or a one-line error naming the range."""
    def parse(text: str) -> int:
        try:
            value = as_int(text, what)
        except PlannerInputError:
            value = None
        if value is None or not low <= value <= high:
            raise argparse.ArgumentTypeError(f"{what} must be an integer from {low:,} to {high:,}, got {text[:40]!r}")
        return value
    return parse


def _build_parser() -> argparse.ArgumentParser:
    from runners.verify import DEFAULT_TIMEOUT_S

    parser = _Parser(prog="runners", description="Verification runs: measure what the planner estimates.")
    commands = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    verify = commands.add_parser("verify", help="run a scenario for a few steps and measure its memory")
    add_scenario_flags(verify)  # includes --engine (accelerate|trainer)
    # The measured device is decided by --mode; None tells an explicit --device apart.
    verify.set_defaults(device=None)
    verify.add_argument("--steps", type=int, default=3, help="optimizer steps, 2 or more; the last one is measured")
    verify.add_argument("--mode", default=Mode.AUTO.value, choices=[m.value for m in Mode],
                        help="auto: cuda if available, else cpu if it fits in free RAM, else simulate")
    verify.add_argument("--local-sgd-steps", type=int, default=None, help="accelerate LocalSGD every K steps")
    verify.add_argument("--seed", type=int, default=0, help="weights' and batches' seed (runners.request.MAX_SEED)")
    verify.add_argument("--timeout", type=_positive_number, default=DEFAULT_TIMEOUT_S,
                        help=f"wall-clock limit in seconds (default {DEFAULT_TIMEOUT_S:g})")
    verify.add_argument("--json", action="store_true", help="last stdout line: the result as one JSON object")
    verify.add_argument("--num-processes", type=int, default=1,
                        help="ranks under torchrun (default 1: one process, estimated vs measured)")
    verify.add_argument("--strategy", default=None, choices=[s.value for s in MULTI_DEVICE_STRATEGIES],
                        help="with --num-processes 2 or more (default ddp)")
    verify.add_argument("--write-job", default=None, metavar="JOB.json",
                        help="with --num-processes: write the rank worker's job file and stop (to launch it yourself, "
                             "e.g. across machines with accelerate launch)")
    verify.add_argument("--inject-fault", choices=INJECTABLE_FAULTS, default=None, help=argparse.SUPPRESS)
    history = commands.add_parser("history", help="list recent runs")
    history.add_argument("--limit", type=_bounded_int("--limit", 1, MAX_HISTORY_LIMIT), default=20)
    history.add_argument("--json", action="store_true", help="one JSON array of runs")
    return parser


def _request_from_args(args: argparse.Namespace) -> VerifyRequest:
    if args.device is not None:
        raise PlannerInputError("verify measures on the device --mode picks: drop --device and use "
                                "--mode cuda, cpu or simulate")
    config, name = resolve_config(args.config, base_dir=Path.cwd(), allow_hub=args.hub)
    scenario = {"task": args.task, "num_labels": args.num_labels, "batch_size": args.batch_size,
                "seq_len": args.seq_len, "optimizer": args.optimizer, "precision": args.precision,
                "gradient_checkpointing": args.gradient_checkpointing, "grad_accum": args.grad_accum,
                "attn": args.attn}
    if args.target_len is not None:  # seq2seq-lm's target; other scenarios stay as the history holds them
        scenario["target_len"] = args.target_len
    if args.finetune != "full":  # full fine-tuning's scenarios stay as the history holds them
        scenario.update(finetune_values(args))
    return VerifyRequest(config=config, model_name=name, scenario=scenario, mode=Mode(args.mode),
                         engine=Engine(args.engine), steps=args.steps, local_sgd_steps=args.local_sgd_steps,
                         seed=args.seed, inject_fault=args.inject_fault, cuda_alloc_conf=args.cuda_alloc_conf)


class ProgressBar:
    """One line on stderr: redrawn in place on a terminal, one line per stage otherwise."""

    def __init__(self, stream=None):
        self.stream = stream if stream is not None else sys.stderr
        self.live = bool(getattr(self.stream, "isatty", lambda: False)())
        self.last_text = None
        self.drawn = False

    def __call__(self, event: dict) -> None:
        stage = event.get("stage", "")
        step, steps = event.get("step"), event.get("steps")
        if stage == "step" and isinstance(step, int) and isinstance(steps, int) and steps > 0:
            fraction, text = min(step / steps, 1.0), f"step {step} of {steps}"
        elif stage == "step" and isinstance(step, int):
            fraction, text = 0.0, f"step {step}"
        elif stage == "measuring":
            fraction, text = 1.0, "measuring"
        else:
            fraction, text = 0.0, stage or "working"
        filled = round(fraction * BAR_WIDTH)
        line = f"[{'#' * filled}{'.' * (BAR_WIDTH - filled)}] {text}"
        if self.live:
            self.stream.write(f"\r{line:<60}")
            self.drawn = True
        elif text != self.last_text:
            self.stream.write(line + "\n")
        self.last_text = text
        self.stream.flush()

    def close(self) -> None:
        if self.live and self.drawn:
            self.stream.write("\n")
            self.stream.flush()


def _pct(value: float | None) -> str:
    if value is None:
        return "n/a"
    return "0.00%" if round(value, 2) == 0 else f"{value:+.2f}%"  # no "-0.00%"


def format_result(result: dict) -> str:
    """Estimated vs measured per category, binary units labelled."""
    estimated, measured = result["estimated"], result.get("measured")
    s = estimated["scenario"]
    lines = [
        f"{estimated['model']}: {result['status']}, mode {result['mode']}, engine {result['engine']} "
        f"(run {result['run_id']})",
        f"{s['task']}, batch {s['batch_size']} x {s['seq_len']} tokens, {s['optimizer']}, {s['precision']}, "
        f"checkpointing {'on' if s['gradient_checkpointing'] else 'off'}, accumulation {s['grad_accum']}, "
        f"attention {s['attn']}, device {s['device']}",
    ]
    if result.get("reason"):
        lines.append(f"Reason: {result['reason']}")
    if result.get("oom_requested_bytes") is not None:
        lines.append(f"Requested when out of memory: {format_bytes(result['oom_requested_bytes'])}")
    lines += ["", f"{'category (at the peak)':<26}{'estimated':>16}{'measured':>16}{'error':>11}"]
    breakdown = estimated["peak_breakdown_bytes"]
    errors = result.get("errors_pct") or {}
    rows = [(c.replace("_", " "), breakdown[c], f"{c}_bytes", c) for c in
            ("weights", "gradients", "optimizer_state", "activations", "temporaries")]
    rows.append(("PEAK", estimated["peak_bytes"], "peak_bytes", "peak"))
    for label, est, key, error_key in rows:
        got = measured.get(key) if measured else None
        lines.append(f"{label:<26}{format_bytes(est):>16}{format_bytes(got):>16}{_pct(errors.get(error_key)):>11}")
    phase = measured.get("peak_phase") if measured else None
    lines.append(f"{'peak phase':<26}{estimated['peak_phase']:>16}{phase or 'n/a':>16}")
    if measured and measured.get("step_wall_s") is not None:
        lines.append(f"Measured step: {measured['step_wall_s']:.2f} s wall time.")
    lines.append("Error: (estimated - measured) / measured. Sizes in binary units (GiB = 2**30 bytes).")
    return "\n".join(lines)


def _check_job_path(args: argparse.Namespace) -> None:
    """--write-job's file can be written, before anything is planned or run."""
    if args.num_processes < 2:
        raise PlannerInputError("--write-job writes a distributed job: give --num-processes 2 or more")
    path = Path(args.write_job)
    if path.is_dir():
        raise PlannerInputError(f"--write-job {args.write_job[:200]!r} is a folder: give a file name, e.g. "
                                f"{str(path / 'job.json')[:200]!r}")
    if not path.parent.is_dir():
        raise PlannerInputError(f"--write-job: folder {str(path.parent)[:200]!r} does not exist: create it first")


def _run_verify(args: argparse.Namespace) -> int:
    from runners.verify import verify

    if args.num_processes < 1:
        raise PlannerInputError(f"--num-processes must be a positive integer, got {args.num_processes}")
    if args.num_processes == 1 and args.strategy is not None:
        raise PlannerInputError("--strategy needs --num-processes 2 or more")
    if args.num_processes > 1 and args.finetune != "full":
        raise PlannerInputError(f"{args.finetune} runs are measured in one process so far: drop --num-processes")
    if args.write_job is not None:
        _check_job_path(args)
    request = _request_from_args(args)
    if args.num_processes > 1:
        return _run_distributed_verify(args, request)
    bar = ProgressBar()
    try:
        result = verify(request, timeout_s=args.timeout, on_progress=bar)
    finally:
        bar.close()
    if args.json:
        print(json.dumps(result))
    else:
        print(format_result(result))
    _report_unrecorded(result)
    return EXIT_CODES.get(result["status"], EXIT_RUN_FAILED)


def _report_unrecorded(result: dict) -> None:
    from runners.unrecorded import unrecorded_note

    note = unrecorded_note(result)
    if note is not None:
        print(f"runners: warning: {note}", file=sys.stderr)


# --- distributed runs (runners.launch) ----------------------------------------------------

def _display_bytes(value: float | int | None) -> str:
    if value is None:
        return "n/a"
    whole = int(value) if float(value).is_integer() else value
    return f"{format_bytes(whole)} ({value:,.0f} bytes)"


def format_distributed_result(result: dict, model_name: str, steps: int) -> str:
    """Each rank's measured peak, and the collectives of one steady-state step."""
    lines = [f"{model_name}: {result['status']}, {result['num_processes']} processes, strategy {result['strategy']}, "
             f"mode {result['mode']} (run {result.get('run_id')})"]
    if result.get("reason"):
        lines.append(f"Reason: {result['reason']}")
    if result["status"] != "ok":
        tail = result.get("stderr_tail") or []
        if tail:
            lines += ["", "Last output:", *(f"  {line}" for line in tail[-8:])]
        return "\n".join(lines)
    lines += ["", f"{'rank':<6}{'measured peak':<40}{'peak phase':<16}{'replicas':<10}"]
    for rank in result["ranks"]:
        measured = rank["measured"]
        equal = {True: "equal", False: "DIFFER", None: "sharded"}[rank.get("replicas_equal")]
        lines.append(f"{rank['rank']:<6}{_display_bytes(measured.get('peak_bytes')):<40}"
                     f"{measured.get('peak_phase') or 'n/a':<16}{equal:<10}")
    lines.append(f"Largest rank peak: {_display_bytes(result['max_rank_peak_bytes'])}.")
    estimated = result.get("estimated") or {}
    if estimated.get("per_device_peak_bytes"):
        error = 100 * (estimated["per_device_peak_bytes"] - result["max_rank_peak_bytes"]) / result["max_rank_peak_bytes"]
        lines.append(f"Planner's per-device peak: {_display_bytes(estimated['per_device_peak_bytes'])} ({error:+.2f}%); "
                     f"traffic {estimated['comm_bytes_per_step']:,.0f} bytes per optimizer step.")
    lines += ["", f"Collectives per step (rank 0, mean of steps 2 to {steps}; step 1 includes set-up):"]
    for kind, tally in (result.get("comm_per_step") or {}).items():
        lines.append(f"  {kind:<24}{tally['calls']:>8.2f} calls  {_display_bytes(tally['bytes'])}")
    if not result.get("comm_per_step"):
        lines.append("  none")
    if result.get("wall_s") is not None:
        lines.append(f"Wall time: {result['wall_s']:.1f} s, torchrun start to finish.")
    lines.append("Sizes in binary units (MiB = 2**20 bytes); collective bytes are the payload each rank hands over.")
    return "\n".join(lines)


def _run_distributed_verify(args: argparse.Namespace, request: VerifyRequest) -> int:
    from runners.distributed_record import verify_distributed
    from runners.launch import write_job

    strategy = parse_strategy(args.strategy or Strategy.DDP.value)
    if args.write_job:
        path = write_job(request, strategy, Path(args.write_job))
        print(f"wrote {path}: start it on every machine with `accelerate launch -m runners.rank_worker {path} OUT_DIR` "
              f"or `torchrun --nproc_per_node {args.num_processes} -m runners.rank_worker {path} OUT_DIR`")
        return 0
    bar = ProgressBar()
    try:  # PlannerInputError from planning: bad input, exit 2
        result = verify_distributed(request, strategy, args.num_processes, args.timeout, on_progress=bar)
    finally:
        bar.close()
    if args.json:
        print(json.dumps(result))
    else:
        print(format_distributed_result(result, request.model_name, request.steps))
    _report_unrecorded(result)
    return EXIT_CODES.get(result["status"], EXIT_RUN_FAILED)


def _record_json(record) -> dict:
    return {"id": record.id, "model": record.model_name, "mode": record.mode.value, "status": record.status.value,
            "created_at": record.created_at.isoformat(),
            "finished_at": None if record.finished_at is None else record.finished_at.isoformat(),
            "scenario": record.scenario, "estimate": record.estimate, "measurement": record.measurement,
            "environment": record.environment, "reason": record.reason}


def _run_history(args: argparse.Namespace) -> int:
    from runners.history import RunHistory
    from runners.unrecorded import unrecorded_path

    store = RunHistory()  # opening it marks the runs whose process died as killed
    records = store.list_runs(limit=args.limit)
    waiting = sorted(unrecorded_path(store.path, "x").parent.glob("*.json"))
    if waiting:
        print(f"runners: warning: {len(waiting)} run(s) could not be recorded and wait in {waiting[0].parent}",
              file=sys.stderr)
    if args.json:
        print(json.dumps([_record_json(r) for r in records]))
        return EXIT_OK
    if not records:
        print("no runs recorded yet: run `python -m runners verify ...`")
        return EXIT_OK
    print(f"{'created (UTC)':<21}{'run':<10}{'status':<9}{'mode':<10}{'model':<24}{'estimated':>13}{'measured':>13}")
    for r in records:
        measured = (r.measurement or {}).get("peak_bytes")
        print(f"{r.created_at.strftime('%Y-%m-%d %H:%M:%S'):<21}{r.id[:8]:<10}{r.status.value:<9}{r.mode.value:<10}"
              f"{r.model_name[:23]:<24}{format_bytes(r.estimate.get('peak_bytes')):>13}{format_bytes(measured):>13}")
    return EXIT_OK


def main(argv: list[str] | None = None) -> int:
    from runners.history_errors import HistoryError

    # Handlers can be set only in the main thread (a test may call main from another).
    in_main = threading.current_thread() is threading.main_thread()
    previous = {number: signal.signal(number, _raise_terminated) for number in (signal.SIGTERM, signal.SIGHUP)
                if in_main}
    try:
        args = _build_parser().parse_args(argv)
        return {"verify": _run_verify, "history": _run_history}[args.command](args)
    except (PlannerInputError, HistoryError) as error:
        print(f"runners: error: {error}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except KeyboardInterrupt:
        print("runners: interrupted: a run in progress was stopped and recorded as killed", file=sys.stderr)
        return EXIT_INTERRUPTED
    except Terminated as stop:
        print(f"runners: {stop}: a run in progress was stopped and recorded as killed", file=sys.stderr)
        return EXIT_TERMINATED
    except BrokenPipeError:  # the reader went away (`history | head`): stop quietly
        quiet_stdout()
        return EXIT_BROKEN_PIPE
    finally:
        for number, handler in previous.items():
            signal.signal(number, handler)
