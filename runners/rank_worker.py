"""One rank of a distributed verification run, started by a launcher, one process per rank:

    torchrun --nproc_per_node 2 -m runners.rank_worker JOB.json OUT_DIR
    accelerate launch --multi_gpu --num_processes 2 -m runners.rank_worker JOB.json OUT_DIR

(`python -m runners verify --num-processes N` writes JOB.json and starts torchrun for you.)
JOB.json holds {"request": VerifyRequest JSON, "strategy": "ddp" | "fsdp-full-shard" |
"fsdp-shard-grad-op"}. Each rank trains the lessons' Accelerate loop on its own micro-
batches (seeded by rank), measures its memory over the last optimizer step (MemTracker
on CPU, the CUDA allocator on GPUs), counts the collectives of every step
(runners.collectives), checks at the end that the replicas are equal (DDP, LocalSGD),
and writes OUT_DIR/rank<R>.json. Rank 0 prints progress as JSON lines on stdout.

On CPU the ranks talk over gloo. Accelerate only enables FSDP for GPU types
(accelerate/state.py), so on CPU the FSDP plugin is installed on the state after the
Accelerator is built; `accelerator.prepare` then runs Accelerate's own FSDP2 path
(`fsdp2_prepare_model`: one unit per block, the input embedding, the final norm with the
LM head) over gloo, as it would over NCCL.
"""

from __future__ import annotations

import datetime
import hashlib
import json
import os
import signal
import sys
import time
from pathlib import Path

import torch

from planner.strategy import Strategy, parse_strategy
from runners.collectives import CollectiveCounter
from runners.request import Mode, VerifyRequest

SINGLE_PROCESS_ERROR = ("runners.rank_worker: RANK and WORLD_SIZE are not set, so this is a single process: "
                        "`accelerate launch --cpu --num_processes N` starts only one; use "
                        "`accelerate launch --multi_gpu --num_processes N` (on CPU too, over gloo) or "
                        "`torchrun --nproc_per_node N`")
PROCESS_GROUP_TIMEOUT_S = 120  # a rank that never joins fails the others' init instead of hanging them


def _rank_env() -> tuple[int, int, int]:
    try:
        return int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), int(os.environ.get("LOCAL_RANK", "0"))
    except KeyError:
        raise SystemExit(SINGLE_PROCESS_ERROR) from None


def build_accelerator(scenario, strategy: Strategy, cpu: bool):
    from accelerate import FullyShardedDataParallelPlugin
    from accelerate.utils import DistributedType, InitProcessGroupKwargs

    from runners.engines import fresh_accelerator

    timeout = InitProcessGroupKwargs(timeout=datetime.timedelta(seconds=PROCESS_GROUP_TIMEOUT_S))
    if strategy is Strategy.DDP:
        return fresh_accelerator(scenario, cpu, kwargs_handlers=[timeout])
    plugin = FullyShardedDataParallelPlugin(
        fsdp_version=2, reshard_after_forward=strategy is Strategy.FSDP_FULL_SHARD,
        auto_wrap_policy="transformer_based_wrap", cpu_ram_efficient_loading=False)
    if not cpu:
        return fresh_accelerator(scenario, cpu, kwargs_handlers=[timeout], fsdp_plugin=plugin)
    accelerator = fresh_accelerator(scenario, cpu, kwargs_handlers=[timeout])
    accelerator.state.distributed_type = DistributedType.FSDP
    accelerator.state.fsdp_plugin = plugin
    if accelerator.state.mixed_precision != "no":
        plugin.set_mixed_precision(accelerator.state.mixed_precision)
    return accelerator


def parameter_digest(model: torch.nn.Module) -> str:
    """SHA-256 of every parameter's bytes, in order: equal digests mean equal replicas."""
    digest = hashlib.sha256()
    for parameter in model.parameters():
        data = parameter.detach()
        if hasattr(data, "to_local"):  # FSDP2 DTensor: this rank's shard
            data = data.to_local()
        digest.update(data.float().contiguous().cpu().numpy().tobytes())
    return digest.hexdigest()


def _ddp_bucket_bytes(wrapped) -> list[int] | None:
    """DDP's gradient buckets as its reducer logged them when it wrapped the model (bytes):
    the same total as the buckets it rebuilds after the first step, not their number."""
    if not isinstance(wrapped, torch.nn.parallel.DistributedDataParallel):
        return None
    sizes = wrapped._get_ddp_logging_data().get("bucket_sizes", "")
    return [int(size) for size in str(sizes).split(",") if size.strip()]


def _stage_fault(fault: str | None, rank: int, stage: str) -> None:
    """Tests only: rank 1 fails the way a real rank can, so the launcher's handling is real."""
    if fault is None:
        return
    if stage == "step 2" and fault in ("sigkill-self", "hang", "raise"):
        # Every rank meets here after rank 0 has reported step 2, so the launcher's last progress
        # is the step the fault fires in: otherwise rank 1 could die before rank 0's line was
        # written (seen under load: "at step 1 of 4" for a rank killed in step 2).
        torch.distributed.barrier()
    if rank != 1:
        return
    if fault == "import-error" and stage == "start":
        raise SystemExit(3)  # dies before joining: the others cannot form the group
    if fault == "sigkill-self" and stage == "step 2":
        os.kill(os.getpid(), signal.SIGKILL)
    if fault == "hang" and stage == "step 2":
        time.sleep(3600)
    if fault == "raise" and stage == "step 2":
        raise RuntimeError("injected failure in rank 1")


def _emit(rank: int, event: dict) -> None:
    if rank == 0:
        print(json.dumps({**event, "event": "progress"}), flush=True)


def run_rank(job: dict) -> dict:
    from runners.engines import run_accelerate_loop
    from runners.measure import environment
    from runners.model_factory import build_model, synthetic_batch
    from runners.optimizers import build_optimizer
    from runners.probes import CudaProbe, MemTrackerProbe

    rank, world, local_rank = _rank_env()
    request = VerifyRequest.from_json(job["request"])
    strategy = parse_strategy(job["strategy"])
    _stage_fault(request.inject_fault, rank, "start")
    scenario = request.parsed_scenario()
    cuda = request.mode is Mode.CUDA
    if cuda:
        torch.cuda.set_device(local_rank)
    accelerator = build_accelerator(scenario, strategy, cpu=not cuda)
    device = torch.device("cuda", local_rank) if cuda else torch.device("cpu")
    _emit(rank, {"stage": "building model", "message": f"{world} ranks over {accelerator.state.backend}: "
                 f"building {request.model_name} ({strategy.value})"})
    model = build_model(request.config, scenario, seed=request.seed).to(device)
    # Each rank sees its own data, as a distributed sampler gives it.
    batches = [synthetic_batch(request.config, scenario, seed=1000 * rank + i, device=str(device))
               for i in range(scenario.grad_accum_steps)]
    optimizer = build_optimizer(model, scenario.optimizer)
    counter = CollectiveCounter()
    prepared: dict = {}
    per_step: list[dict] = []
    step_start = counter.tally.copy()

    def on_prepared(wrapped, _optimizer) -> None:
        prepared["model"] = wrapped
        if isinstance(wrapped, torch.nn.parallel.DistributedDataParallel):
            wrapped.register_comm_hook(None, counter.ddp_hook())

    def on_step(step: int, steps: int) -> None:
        nonlocal step_start
        if step > 1:
            per_step.append(counter.tally.minus(step_start))
            step_start = counter.tally.copy()
        _emit(rank, {"stage": "step", "step": step, "steps": steps,
                     "message": f"step {step} of {steps}" + (" (measured)" if step == steps else "")})
        _stage_fault(request.inject_fault, rank, f"step {step}")

    probe = CudaProbe() if cuda else MemTrackerProbe()
    started = time.perf_counter()
    with counter.counting():
        run_accelerate_loop(model, optimizer, batches, scenario, request.steps, probe, cpu=not cuda,
                            local_sgd_steps=request.local_sgd_steps, progress=on_step,
                            accelerator=accelerator, on_prepared=on_prepared)
    # The last step, and LocalSGD's averaging on leaving its context, come after the loop.
    per_step.append(counter.tally.minus(step_start))
    wrapped = prepared["model"]
    digests = [None] * world
    torch.distributed.all_gather_object(digests, parameter_digest(wrapped))
    if probe.result is None:
        raise RuntimeError("the measured step never ran: the engine stopped before the last step")
    measured = probe.result.to_json()
    buckets = _ddp_bucket_bytes(wrapped)
    measured["ddp_bucket_bytes"] = buckets
    measured["comm_buffers_bytes"] = sum(buckets) if buckets else 0
    measured["tracked_peak_bytes"] = measured["peak_bytes"]
    if not cuda and buckets and request.local_sgd_steps is not None:
        # DDP allocates its flat bucket buffers when it wraps the model, before MemTracker
        # starts. A synchronising step replaces them with the all-reduce's results (seen
        # by MemTracker as temporaries, so already in the peak); under LocalSGD the model
        # stays in no_sync and the original, untracked buckets live on: add them.
        measured["peak_bytes"] = measured["tracked_peak_bytes"] + measured["comm_buffers_bytes"]
    sharded = strategy is not Strategy.DDP
    return {
        "rank": rank, "world_size": world, "strategy": strategy.value, "backend": accelerator.state.backend,
        "distributed_type": str(accelerator.distributed_type.value), "measured": measured,
        "collectives_per_step": per_step, "collectives_total": counter.tally.to_json(),
        "parameter_digest": digests[rank],
        # Sharded strategies hold different shards by design; replicas must be equal otherwise.
        "replicas_equal": None if sharded else len(set(digests)) == 1,
        "run_wall_s": time.perf_counter() - started,
        "environment": environment(request.mode),
    }


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 2:
        print("usage: torchrun --nproc_per_node N -m runners.rank_worker JOB.json OUT_DIR", file=sys.stderr)
        return 2
    _rank_env()  # a lone process stops here, before it writes anything
    job = json.loads(Path(argv[0]).read_text())
    out_dir = Path(argv[1])
    out_dir.mkdir(parents=True, exist_ok=True)
    result = run_rank(job)
    path = out_dir / f"rank{result['rank']}.json"
    path.with_suffix(".tmp").write_text(json.dumps(result))
    path.with_suffix(".tmp").replace(path)  # whole or absent: the launcher never reads half a file
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()
    return 0


if __name__ == "__main__":
    from runners.memory_limit import apply_from_env
    from runners.parent_death import die_with_parent

    die_with_parent()  # its launcher (torchrun) dead, SIGKILLed: this rank goes too
    apply_from_env()  # the run's per-rank memory limit (runners.launch), if it has one
    raise SystemExit(main())
