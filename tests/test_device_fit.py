"""The verdict with the caching allocator replayed on the plan's own step (planner.device_fit),
and the fit searches that must agree with it: a plan they propose is one the verdict passes.

Cases use GPT-2, whose CUDA probe tables (with their allocation traces) ship with the catalog,
so no probe runs here. The figures are the replay's (planner.cuda_allocator, written from
CUDACachingAllocator.cpp), not yet compared with a GPU.
"""

import dataclasses
import json

import pytest

from planner.cli import main as planner_main
from planner.device_fit import MULTI_GPU_NOT_REPLAYED, plan_verdict, reserved_check
from planner.estimate import estimate
from planner.fit import fit_limits, max_batch_size
from planner.gpus import gpu_spec, scenario_on
from planner.loading import load_model_shape
from planner.parallel import parallel_estimate
from planner.probe.cache import probe_table
from planner.reserved import model_prefix, state_events, training_events
from planner.scenario import Device, Task, scenario_from_values
from planner.strategy import ParallelPlan, Strategy
from planner.verdict import device_verdict, tensor_budget_bytes

RTX_4090 = gpu_spec("rtx4090")


@pytest.fixture(scope="module")
def gpt2():
    return load_model_shape("gpt2", Task.CAUSAL_LM)


def _plan(**overrides):
    """A plan on the RTX 4090 (its kernels: planner.gpus.scenario_on)."""
    values = {"task": "causal-lm", "batch_size": 1, "seq_len": 1024, "device": "cuda", "precision": "bf16-mixed"}
    return scenario_on(scenario_from_values(**(values | overrides)), RTX_4090)


def test_a_plan_whose_live_tensors_fit_a_24_gb_card_but_whose_reserved_memory_does_not(gpt2):
    """The largest batch whose live tensors (and torch's cuBLAS blocks) fit the RTX 4090's usable
    capacity: the allocator, replayed within that capacity, runs out of memory even after
    releasing its cache (fragmentation among the fp32 logits-sized blocks), so the verdict
    says no, and the search stops lower, at a batch the verdict passes."""
    capacity = RTX_4090.capacity_bytes
    budget = tensor_budget_bytes(capacity, Device.CUDA, RTX_4090)
    by_live_tensors = max_batch_size(gpt2, _plan(), budget)
    result = estimate(gpt2, _plan(batch_size=by_live_tensors))
    without_replay = device_verdict(result.peak_bytes, capacity, Device.CUDA, RTX_4090)
    assert without_replay.fits  # what the verdict said before the replay

    verdict = plan_verdict(gpt2, result, capacity, RTX_4090)
    assert verdict.allocated_peak_bytes <= verdict.usable_capacity_bytes
    assert verdict.replay_out_of_memory and not verdict.fits
    assert verdict.reserved_peak_bytes > verdict.usable_capacity_bytes
    assert verdict.headline.startswith("Does not fit: the reserved peak")
    assert "runs out of memory even after releasing its cache" in verdict.caveat

    check = reserved_check(capacity, Device.CUDA, RTX_4090)
    searched = max_batch_size(gpt2, _plan(), budget, check=check)
    assert searched is not None and searched < by_live_tensors
    passed = plan_verdict(gpt2, estimate(gpt2, _plan(batch_size=searched)), capacity, RTX_4090)
    assert passed.fits and not passed.replay_out_of_memory
    assert passed.allocated_peak_bytes <= passed.reserved_peak_bytes <= passed.usable_capacity_bytes
    assert not plan_verdict(gpt2, estimate(gpt2, _plan(batch_size=searched + 1)), capacity, RTX_4090).fits
    assert fit_limits(gpt2, _plan(), budget, check=check).batch_size == searched


def test_limits_searched_from_a_plan_that_fits_are_those_searched_from_one(gpt2):
    """The Plan page starts both searches at the sidebar's plan when its verdict passes (a new
    model then never plans batch 1, a probe class of its own): the answers are the searches
    from batch 1 and one token, on CUDA with the replayed verdict and on the CPU."""
    capacity = RTX_4090.capacity_bytes
    budget = tensor_budget_bytes(capacity, Device.CUDA, RTX_4090)
    check = reserved_check(capacity, Device.CUDA, RTX_4090)
    for plan in (_plan(batch_size=3, seq_len=512), _plan(batch_size=2, seq_len=256, precision="fp32", grad_accum=2),
                 _plan(batch_size=5, seq_len=200, device="cpu")):
        plan_check = check if plan.device is Device.CUDA else None
        assert plan_check is None or plan_check(gpt2, plan)
        assert estimate(gpt2, plan).peak_bytes <= budget
        from_one = fit_limits(gpt2, plan, budget, check=plan_check)
        assert fit_limits(gpt2, plan, budget, check=plan_check, scenario_fits=True) == from_one
        assert from_one.batch_size > plan.batch_size and from_one.seq_len > plan.seq_len


def test_every_batch_the_search_passes_fits_and_the_next_does_not(gpt2):
    """Across precisions and an accumulating plan, the searched largest batch is exactly where
    the replayed verdict turns (the bisection assumes it turns once)."""
    capacity = RTX_4090.capacity_bytes
    budget = tensor_budget_bytes(capacity, Device.CUDA, RTX_4090)
    check = reserved_check(capacity, Device.CUDA, RTX_4090)
    for plan in (_plan(precision="fp32"), _plan(seq_len=512), _plan(grad_accum=2)):
        found = max_batch_size(gpt2, plan, budget, check=check)
        assert found is not None
        assert plan_verdict(gpt2, estimate(gpt2, dataclasses.replace(plan, batch_size=found)), capacity,
                            RTX_4090).fits
        assert not plan_verdict(gpt2, estimate(gpt2, dataclasses.replace(plan, batch_size=found + 1)), capacity,
                                RTX_4090).fits
        for batch in (found - 1, found, found + 1, found + 2):  # the searches' bounded replay only: same answer
            result = estimate(gpt2, dataclasses.replace(plan, batch_size=batch))
            assert (plan_verdict(gpt2, result, capacity, RTX_4090, figures=False).fits
                    == plan_verdict(gpt2, result, capacity, RTX_4090).fits)


@pytest.mark.parametrize("method", ["lora", "qlora"])
def test_lora_and_qlora_are_replayed_on_what_peft_and_bitsandbytes_store(gpt2, method):
    """The replay's model is the wrapped model's stored tensors (PEFT's parameters; under
    QLoRA bitsandbytes' packed weights and quantisation state) and its state is the
    trainable tensors' only: in 512-byte blocks they add up to the estimate's weights and
    state, and the replayed step's live bytes reach the estimate's peak (saved tensors are
    counted exactly there, in blocks here)."""
    scenario = _plan(finetune=method, batch_size=4, seq_len=512, optimizer="adamw8bit", precision="bf16")
    result = estimate(gpt2, scenario)
    blocks = lambda n: -(-n // 512) * 512
    prefix, step = training_events(gpt2, scenario, probe_table(gpt2, scenario),
                                   step_temporaries_bytes=result.phases[-1].temporaries)
    model = [n for key, n in model_prefix(gpt2, scenario)]
    assert sum(blocks(n) for n in model) == result.weights_bytes
    assert sum(blocks(n) for _, n in state_events(gpt2, scenario)) == result.optimizer_state_bytes
    live, peak, sizes = 0, 0, {}
    for index, (key, nbytes) in enumerate(prefix + step + step):
        if nbytes == -1:
            live -= sizes.pop(key)
        else:
            sizes[key] = blocks(nbytes)
            live += sizes[key]
        if index >= len(prefix) + len(step):  # the measured (third) step
            peak = max(peak, live)
    assert 0 <= peak - result.peak_bytes < 512 * len(step)

    verdict = plan_verdict(gpt2, result, RTX_4090.capacity_bytes, RTX_4090)
    assert verdict.caveat is None and verdict.fits
    assert verdict.allocated_peak_bytes <= verdict.reserved_peak_bytes <= verdict.usable_capacity_bytes


@pytest.mark.parametrize("local_sgd", [None, 4])
def test_a_ddp_rank_is_replayed_with_its_gradient_buckets(gpt2, local_sgd):
    """A DDP rank runs the single-GPU step and holds DDP's buckets from the wrap on: its replay
    is the single GPU's with the buckets allocated after the weights (local SGD keeps DDP's
    buckets too), so it reserves at least what the single GPU does plus the buckets, and its
    allocated peak is the rank's estimate plus torch's own blocks, as the allocator rounds them."""
    capacity = RTX_4090.capacity_bytes
    scenario = _plan(batch_size=4)
    single = plan_verdict(gpt2, estimate(gpt2, scenario), capacity, RTX_4090)
    plan = ParallelPlan(2, Strategy.DDP, local_sgd)
    shared = parallel_estimate(gpt2, scenario, plan)
    verdict = plan_verdict(gpt2, shared, capacity, RTX_4090, plan)
    assert shared.ddp_bucket_bytes and verdict.caveat is None
    # The replay's allocated peak: the rank's tensors and torch's blocks, in the allocator's blocks.
    assert verdict.replayed_allocated_peak_bytes == verdict.allocated_peak_bytes
    assert verdict.allocated_peak_bytes >= shared.per_device_peak_bytes + verdict.allocator_blocks_bytes
    assert verdict.reserved_peak_bytes >= single.reserved_peak_bytes + sum(shared.ddp_bucket_bytes)
    assert verdict.reserved_peak_bytes >= verdict.allocated_peak_bytes

    # The fit searches test a DDP plan with the same replay.
    budget = tensor_budget_bytes(capacity, Device.CUDA, RTX_4090, plan)
    check = reserved_check(capacity, Device.CUDA, RTX_4090)
    found = max_batch_size(gpt2, _plan(), budget, plan=plan, check=check)
    assert plan_verdict(gpt2, parallel_estimate(gpt2, _plan(batch_size=found), plan), capacity, RTX_4090, plan).fits
    assert not plan_verdict(gpt2, parallel_estimate(gpt2, _plan(batch_size=found + 1), plan), capacity, RTX_4090,
                            plan).fits


def test_what_is_not_replayed_says_why_and_keeps_the_allocated_test(gpt2):
    capacity = RTX_4090.capacity_bytes
    plan = ParallelPlan(2, Strategy.FSDP_FULL_SHARD)
    shared = parallel_estimate(gpt2, _plan(batch_size=4), plan)
    verdict = plan_verdict(gpt2, shared, capacity, RTX_4090, plan)
    assert verdict.reserved_peak_bytes is None and MULTI_GPU_NOT_REPLAYED in verdict.caveat
    assert reserved_check(capacity, Device.CUDA, RTX_4090)(gpt2, _plan(batch_size=4), plan)

    on_cpu = plan_verdict(gpt2, estimate(gpt2, _plan(device="cpu")), capacity, None)
    assert on_cpu.overheads is None and on_cpu.caveat is None
    assert reserved_check(capacity, Device.CPU, None) is None


def test_the_json_reports_the_replayed_reserved_peak_on_a_gpu(gpt2, capsys):
    arguments = ["estimate", "--config", "gpt2", "--task", "causal-lm", "--batch-size", "4", "--seq-len", "1024",
                 "--precision", "bf16-mixed", "--json"]
    assert planner_main([*arguments, "--gpu", "rtx4090"]) == 0
    on_gpu = json.loads(capsys.readouterr().out)
    assert "caveat" not in on_gpu
    assert on_gpu["fits"] and on_gpu["required_bytes"] == on_gpu["reserved_peak_bytes"]
    assert on_gpu["reserved_peak_bytes"] >= on_gpu["allocated_peak_bytes"]
    assert on_gpu["margin_bytes"] == on_gpu["usable_capacity_bytes"] - on_gpu["reserved_peak_bytes"]
    # Without a GPU there is no capacity to replay within: null, and the caveat says what to give.
    assert planner_main(arguments) == 0
    plain = json.loads(capsys.readouterr().out)
    assert plain["reserved_peak_bytes"] is None and "--gpu" in plain["caveat"]


@pytest.mark.parametrize("name,overrides", [
    ("gpt2", {"precision": "bf16-mixed", "batch_size": 2}),
    ("gpt2", {"precision": "fp32", "gradient_checkpointing": True, "batch_size": 4, "seq_len": 512}),
    ("qwen2.5-0.5b", {"precision": "fp32", "batch_size": 3, "seq_len": 700}),
    ("qwen2.5-0.5b", {"precision": "bf16-mixed", "batch_size": 1, "seq_len": 2048, "optimizer": "adamw8bit"}),
])
def test_micro_batches_after_the_third_add_no_reserved_memory(name, overrides):
    """Why the replay stops at MICRO_BATCHES_REPLAYED micro-batches: replaying every one of 4, 8
    and 16 gives the same allocated and reserved peaks as 3."""
    from planner.probe.cache import probe_table
    from planner.reserved import MICRO_BATCHES_REPLAYED, reserved_peak

    shape = load_model_shape(name, Task.CAUSAL_LM)
    peaks = set()
    for steps in (MICRO_BATCHES_REPLAYED, 4, 8, 16):
        scenario = _plan(**(overrides | {"grad_accum": steps}))
        result = estimate(shape, scenario)
        replayed = reserved_peak(shape, scenario, probe_table(shape, scenario),
                                 step_temporaries_bytes=result.phases[-1].temporaries)
        peaks.add((replayed.peak_allocated_bytes, replayed.peak_reserved_bytes))
    assert len(peaks) == 1, peaks


def test_foreach_adamws_temporaries_are_replayed_as_torch_allocates_them():
    """torch's foreach AdamW (CUDA's default) allocates one square root per parameter tensor,
    in order, alive together (`_multi_tensor_adam`: torch._foreach_sqrt). A real foreach step
    (forced on CPU tensors of the model's own parameter shapes, torch's same Python path)
    makes exactly the requests the replay makes, which the allocator can then serve from
    cached activation blocks, where one step-sized request could not be."""
    import math

    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    from conftest import tiny_config
    from planner.loading import model_shape_for_config
    from planner.reserved import optimizer_step_events

    shape = model_shape_for_config(tiny_config("tiny-gpt2"), Task.CAUSAL_LM, 2, "tiny")
    scenario = _plan(batch_size=2, seq_len=16, precision="fp32")
    params = [torch.zeros(p.shape, requires_grad=True) for p in shape.params]
    for param in params:
        param.grad = torch.ones_like(param)
    optimizer = torch.optim.AdamW(params, foreach=True)
    optimizer.step()  # the first step makes the state

    class Requests(TorchDispatchMode):
        sizes: list = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if func is torch.ops.aten._foreach_sqrt.default:
                self.sizes += [t.numel() * t.element_size() for t in out]
            return out

    with Requests() as requests:
        optimizer.step()
    result = estimate(shape, scenario)
    events = optimizer_step_events(shape, scenario, result.phases[-1].temporaries)
    allocated = [n for _, n in events if n >= 0]
    assert allocated == requests.sizes == [math.prod(p.shape) * 4 for p in shape.params]
    assert sum(allocated) == result.phases[-1].temporaries
    assert [key for key, n in events if n < 0] == [key for key, n in reversed(events) if n >= 0]


def test_the_replay_memo_keeps_the_plans_used_last_and_answers_as_a_fresh_replay(gpt2, monkeypatch):
    """A search and the report's second search ask for the same plans again: the memo drops the
    least recently used plan first (it was cleared whole when full, so a search of more plans
    than it kept replayed everything again), and a remembered answer is a fresh replay's."""
    from planner import reserved

    monkeypatch.setattr(reserved, "_REPLAYS", type(reserved._REPLAYS)())
    monkeypatch.setattr(reserved, "_REPLAYS_KEPT", 2)
    plans = {batch: estimate(gpt2, _plan(batch_size=batch, seq_len=256)) for batch in (1, 2, 3)}
    first = reserved.replayed_step(gpt2, plans[1], ())
    reserved.replayed_step(gpt2, plans[2], ())
    assert reserved.replayed_step(gpt2, plans[1], ()) is first  # remembered, and now the most recent
    reserved.replayed_step(gpt2, plans[3], ())  # over the bound: batch 2, used least recently, goes
    kept = {key[2].batch_size for key in reserved._REPLAYS}
    assert kept == {1, 3}
    reserved._REPLAYS.clear()
    assert reserved.replayed_step(gpt2, plans[1], ()) == first
