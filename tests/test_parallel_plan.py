"""The multi-device planner without processes: sharded state against real optimizers on
real shards, DDP's bucket assignment against torch's own, CLI flags and JSON keys."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from planner.errors import PlannerInputError
from planner.loading import load_model_shape
from planner.optimizer_state import optimizer_state_bytes
from planner.parallel import ddp_buckets, parallel_estimate, sharded_shape
from planner.scenario import Device, Optimizer, Precision, Task, scenario_from_values
from planner.strategy import ParallelPlan, Strategy, parse_strategy
from runners.model_factory import build_model
from runners.optimizers import build_optimizer
from runners.probes import _tensor_bytes, optimizer_state_tensors

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = ROOT / "tests" / "configs"


@pytest.mark.parametrize("config", ["tiny-llama", "tiny-gpt2"])
@pytest.mark.parametrize("optimizer", [Optimizer.ADAMW, Optimizer.SGD, Optimizer.ADAFACTOR])
@pytest.mark.parametrize("n", [2, 3])
def test_sharded_state_equals_a_real_optimizer_on_rank_zero_shards(config, optimizer, n):
    scenario = scenario_from_values(task="causal-lm", batch_size=1, seq_len=8, optimizer=optimizer.value, device="cpu")
    model = build_model(json.loads((CONFIGS / f"{config}.json").read_text()), scenario)
    with torch.no_grad():  # rank 0's piece of every parameter: torch.chunk along dim 0, as FSDP2 shards
        for parameter in model.parameters():
            parameter.data = parameter.data.chunk(n, dim=0)[0].clone()
    optimizer_object = build_optimizer(model, optimizer)
    for parameter in model.parameters():
        parameter.grad = torch.ones_like(parameter)
    optimizer_object.step()
    shape = load_model_shape(str(CONFIGS / f"{config}.json"), Task.CAUSAL_LM, 2)
    planned = optimizer_state_bytes(sharded_shape(shape, n), optimizer, Precision.FP32, Device.CPU)
    assert planned == _tensor_bytes(optimizer_state_tensors(optimizer_object))


def test_ddp_buckets_match_torchs_assignment():
    from torch.distributed import _DEFAULT_FIRST_BUCKET_BYTES, _compute_bucket_assignment_by_size

    shape = load_model_shape(str(CONFIGS / "tiny-gpt2.json"), Task.CAUSAL_LM, 2)
    model = build_model(json.loads((CONFIGS / "tiny-gpt2.json").read_text()),
                        scenario_from_values(task="causal-lm", batch_size=1, seq_len=8, device="cpu"))
    params = list(reversed(list(model.parameters())))
    # torch's own assignment (what DDP's reducer calls when it rebuilds its buckets).
    indices, _ = _compute_bucket_assignment_by_size(
        params, [_DEFAULT_FIRST_BUCKET_BYTES, 25 * 1024 * 1024], [False] * len(params))
    torch_buckets = tuple(sum(params[i].numel() * 4 for i in bucket) for bucket in indices)
    assert ddp_buckets(shape, 4) == torch_buckets


def test_one_device_is_the_single_device_estimate():
    shape = load_model_shape(str(CONFIGS / "tiny-llama.json"), Task.CAUSAL_LM, 2)
    scenario = scenario_from_values(task="causal-lm", batch_size=2, seq_len=16, device="cpu")
    result = parallel_estimate(shape, scenario, ParallelPlan(1, Strategy.DDP))
    assert result.plan.strategy is Strategy.SINGLE
    assert result.per_device_peak_bytes == result.base.peak_bytes and result.comm_bytes_per_step == 0


def test_more_sharding_never_needs_more_memory_per_device():
    shape = load_model_shape("llama-2-7b", Task.CAUSAL_LM, 2)
    scenario = scenario_from_values(task="causal-lm", batch_size=1, seq_len=2048, precision="bf16-mixed",
                                    gradient_checkpointing=True)
    peaks = [parallel_estimate(shape, scenario, ParallelPlan(8, s)).per_device_peak_bytes
             for s in (Strategy.DDP, Strategy.ZERO1, Strategy.ZERO2, Strategy.ZERO3)]
    assert peaks == sorted(peaks, reverse=True) and peaks[-1] < peaks[0] / 2


def test_plan_validation_is_one_line():
    with pytest.raises(PlannerInputError, match="local SGD runs on DDP only"):
        ParallelPlan(2, Strategy.FSDP_FULL_SHARD, local_sgd_steps=8)
    with pytest.raises(PlannerInputError, match="unknown strategy"):
        parse_strategy("zero4")
    with pytest.raises(PlannerInputError, match="need a strategy"):
        ParallelPlan(2, Strategy.SINGLE)
    with pytest.raises(PlannerInputError, match="number of devices"):
        ParallelPlan(0, Strategy.DDP)


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "planner", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)


def test_cli_json_adds_per_device_and_communication_keys():
    done = _cli("estimate", "--config", "tests/configs/tiny-llama.json", "--task", "causal-lm", "--batch-size", "2",
                "--seq-len", "16", "--device", "cpu", "--num-devices", "2", "--strategy", "ddp",
                "--local-sgd-steps", "8", "--json")
    assert done.returncode == 0, done.stderr
    data = json.loads(done.stdout)
    assert {"peak_bytes", "weights_bytes", "per_device_peak_bytes", "comm_bytes_per_step"} <= set(data)
    shape = load_model_shape(str(CONFIGS / "tiny-llama.json"), Task.CAUSAL_LM, 2)
    assert data["comm_bytes_per_step"] == shape.num_parameters * 4 / 8  # fp32 parameters, averaged every 8
    bad = _cli("estimate", "--config", "tests/configs/tiny-llama.json", "--task", "causal-lm", "--batch-size", "2",
               "--seq-len", "16", "--num-devices", "2", "--strategy", "fsdp-full-shard", "--local-sgd-steps", "8")
    assert bad.returncode == 2 and len(bad.stderr.strip().splitlines()) == 1 and "DDP only" in bad.stderr


def test_batch_lines_take_the_multi_device_keys(tmp_path):
    lines = tmp_path / "plans.jsonl"
    config = str(CONFIGS / "tiny-llama.json")
    base = {"config": config, "task": "causal-lm", "batch_size": 2, "seq_len": 16, "device": "cpu"}
    lines.write_text("\n".join(json.dumps(line) for line in (
        {**base, "id": "fsdp", "num_devices": 4, "strategy": "fsdp-full-shard"},
        {**base, "id": "bad", "num_devices": 4, "strategy": "zero9"},
        {**base, "id": "one"},
    )) + "\n")
    done = _cli("batch", str(lines))
    assert done.returncode == 0, done.stderr
    fsdp, bad, one = (json.loads(line) for line in done.stdout.splitlines())
    shape = load_model_shape(config, Task.CAUSAL_LM, 2)
    scenario = scenario_from_values(task="causal-lm", batch_size=2, seq_len=16, device="cpu")
    assert fsdp["per_device_peak_bytes"] == parallel_estimate(
        shape, scenario, ParallelPlan(4, Strategy.FSDP_FULL_SHARD)).per_device_peak_bytes
    assert fsdp["placement"]["weights"] == "sharded 4 ways"
    assert bad["id"] == "bad" and "unknown strategy" in bad["error"]
    assert one["per_device_peak_bytes"] == one["peak_bytes"] and one["comm_bytes_per_step"] == 0
