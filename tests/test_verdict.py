"""The verdict on what the driver sees (planner.verdict): CUDA overheads outside the caching
allocator come off the capacity, torch's own allocator blocks join the peak, a replayed
reserved peak replaces the allocated one; the fit searches stop where the verdict does."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from planner.cuda_allocator import Alloc, Free, replay
from planner.cuda_overheads import cuda_overheads
from planner.estimate import estimate
from planner.fit import max_batch_size, max_seq_len
from planner.gpus import GPUS
from planner.loading import load_model_shape
from planner.scenario import Device, Task, scenario_from_values
from planner.units import MIB
from planner.verdict import DeviceVerdict, device_verdict, tensor_budget_bytes

ROOT = Path(__file__).resolve().parents[1]
A10 = GPUS["a10"]  # 23,028 MiB as nvidia-smi reports it; compute capability 8.6
# planner.cuda_overheads' sources: a 616 MiB context (the upper published reading) and, below
# Hopper, torch 2.13's cuBLAS workspace 4096 * 1024 * 2 + 16 * 1024 * 8 bytes per thread (two).
CONTEXT = 616 * MIB
WORKSPACES = 2 * (4096 * 1024 * 2 + 16 * 1024 * 8)


def test_a_plan_whose_live_tensors_fit_a_24_gb_card_but_not_with_the_cuda_overheads():
    shape = load_model_shape("llama-3.2-1b", Task.CAUSAL_LM)
    scenario = scenario_from_values(task="causal-lm", batch_size=4, seq_len=512, optimizer="adamw8bit",
                                    precision="bf16-mixed", gradient_checkpointing=True, device="cuda")
    raw = max_seq_len(shape, scenario, A10.capacity_bytes)
    budget = tensor_budget_bytes(A10.capacity_bytes, Device.CUDA, A10)
    assert budget == A10.capacity_bytes - CONTEXT - WORKSPACES
    longest = max_seq_len(shape, scenario, budget)
    assert raw is not None and longest is not None and longest < raw
    plan = scenario_from_values(task="causal-lm", batch_size=4, seq_len=raw, optimizer="adamw8bit",
                                precision="bf16-mixed", gradient_checkpointing=True, device="cuda")
    peak = estimate(shape, plan).peak_bytes
    assert peak <= A10.capacity_bytes  # the live tensors alone fit the driver's total
    verdict = device_verdict(peak, A10.capacity_bytes, Device.CUDA, A10)
    assert not verdict.fits
    assert verdict.usable_capacity_bytes == A10.capacity_bytes - CONTEXT
    assert verdict.allocated_peak_bytes == peak + WORKSPACES
    assert verdict.margin_bytes == A10.capacity_bytes - CONTEXT - peak - WORKSPACES < 0
    assert verdict.headline.startswith("Does not fit: the allocated peak")
    at_limit = scenario_from_values(task="causal-lm", batch_size=4, seq_len=longest, optimizer="adamw8bit",
                                    precision="bf16-mixed", gradient_checkpointing=True, device="cuda")
    assert device_verdict(estimate(shape, at_limit).peak_bytes, A10.capacity_bytes, Device.CUDA, A10).fits


def test_the_largest_batch_is_the_last_the_verdict_passes():
    shape = load_model_shape("gpt2", Task.CAUSAL_LM)
    scenario = scenario_from_values(task="causal-lm", batch_size=1, seq_len=1024, device="cuda")
    budget = tensor_budget_bytes(GPUS["t4"].capacity_bytes, Device.CUDA, GPUS["t4"])
    largest = max_batch_size(shape, scenario, budget)
    assert largest is not None

    def verdict_at(batch):
        plan = scenario_from_values(task="causal-lm", batch_size=batch, seq_len=1024, device="cuda")
        return device_verdict(estimate(shape, plan).peak_bytes, GPUS["t4"].capacity_bytes, Device.CUDA, GPUS["t4"])

    assert verdict_at(largest).fits and not verdict_at(largest + 1).fits


def test_a_reserved_peak_above_the_usable_capacity_fails_a_plan_whose_allocated_peak_fits():
    """Rules (CUDACachingAllocator.cpp): get_allocation_size gives a 1-10 MiB request a 20 MiB
    segment and one above 10 MiB its size rounded up to 2 MiB; should_split splits a large-pool
    block only when more than 1 MiB remains, and an unsplit block counts whole as allocated."""
    overheads = cuda_overheads(A10)
    workspace = overheads.allocator_items[0].bytes  # 8 MiB + 128 KiB
    prefix = [Alloc(("workspace", i), item.bytes) for i, item in enumerate(overheads.allocator_items)]
    step = [Alloc("x", 11 * MIB), Free("x")]
    replayed = replay(step, prefix=prefix, repeats=2)
    # Both workspaces share one 20 MiB segment (3.75 MiB left over: too small for 11 MiB), the
    # tensor gets a 12 MiB segment and, 1 MiB remaining, takes all of it.
    assert replayed.peak_reserved_bytes == 20 * MIB + 12 * MIB
    assert replayed.peak_allocated_bytes == 2 * workspace + 12 * MIB
    capacity = CONTEXT + 2 * workspace + 11 * MIB + MIB  # 1 MiB to spare on allocated memory
    allocated_only = DeviceVerdict(11 * MIB, capacity, overheads)
    assert allocated_only.fits and allocated_only.caveat is not None
    with_reserved = DeviceVerdict(11 * MIB, capacity, overheads, reserved_peak_bytes=replayed.peak_reserved_bytes)
    assert not with_reserved.fits and with_reserved.caveat is None
    assert with_reserved.margin_bytes == capacity - CONTEXT - (20 * MIB + 12 * MIB)
    with pytest.raises(ValueError):
        DeviceVerdict(11 * MIB, capacity, overheads, reserved_peak_bytes=MIB)  # below allocated: not an allocator's


def test_on_cpu_the_capacity_is_the_budget_and_nothing_is_added():
    assert tensor_budget_bytes(16 * MIB, Device.CPU, A10) == 16 * MIB
    verdict = device_verdict(10 * MIB, 16 * MIB, Device.CPU, A10)
    assert verdict.overheads is None and verdict.allocated_peak_bytes == 10 * MIB and verdict.margin_bytes == 6 * MIB
    assert "cuda_overhead_items" not in verdict.to_json()


def test_cli_json_carries_the_verdict_keys():
    def run(*extra):
        done = subprocess.run([sys.executable, "-m", "planner", "estimate", "--config", "gpt2", "--task", "causal-lm",
                               "--batch-size", "2", "--seq-len", "128", "--json", *extra],
                              cwd=ROOT, capture_output=True, text=True, timeout=120, check=False)
        assert done.returncode == 0, done.stderr
        return json.loads(done.stdout)

    with_gpu = run("--gpu", "h100")
    overheads = cuda_overheads(GPUS["h100"])
    assert with_gpu["cuda_overhead_bytes"] == overheads.total_bytes  # the context and the H100's driver reservation
    assert {item["name"] for item in with_gpu["cuda_overhead_items"]} == {item.name for item in overheads.items}
    assert with_gpu["usable_capacity_bytes"] == GPUS["h100"].capacity_bytes - overheads.total_bytes
    # A single-GPU plan probed on CUDA's kernels: the caching allocator is replayed (planner.device_fit).
    assert with_gpu["reserved_peak_bytes"] >= with_gpu["allocated_peak_bytes"] and "caveat" not in with_gpu
    assert with_gpu["required_bytes"] == with_gpu["reserved_peak_bytes"]
    lora = run("--gpu", "h100", "--finetune", "lora")  # replayed on the wrapped model's tensors
    assert lora["reserved_peak_bytes"] >= lora["allocated_peak_bytes"] and "caveat" not in lora
    # Replayed: the live tensors and the workspaces (Hopper: 32 MiB each) in the allocator's blocks.
    assert with_gpu["allocated_peak_bytes"] >= with_gpu["peak_bytes"] + 2 * 32 * MIB
    without = run()
    assert without["usable_capacity_bytes"] is None and without["cuda_overhead_bytes"] == CONTEXT
    on_cpu = run("--device", "cpu", "--gpu", "24")
    assert on_cpu["cuda_overhead_bytes"] == 0 and on_cpu["usable_capacity_bytes"] == 24 * 1024 * MIB
