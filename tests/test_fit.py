"""The fit finder (planner.fit) and the step-time model (planner.step_time): ranking and
fields, agreement with planner.estimate, the CLI, and the finder checked against
simulated (fake-tensor) runs: for three models and two capacities the measured peak at
the reported largest batch fits, and the next batch up does not fit with room to spare
beyond the planner's stated error margin (neither unsafe nor wasteful)."""

import dataclasses
import json

import pytest
from conftest import tiny_config

from planner.cli import main
from planner.cuda_overheads import cuda_overheads
from planner.errors import PlannerInputError
from planner.estimate import estimate
from planner.finetune import FineTune, Method
from planner.fit import (
    FIT_ERROR_MARGIN,
    NEAREST_SHOWN,
    SEARCH_OPTIMIZERS,
    SEARCH_STRATEGIES,
    SHARDING_NOTE,
    ChangeKind,
    Cost,
    FitTarget,
    Risk,
    change_rank,
    find_fits,
    smallest_plan,
)
from planner.gpus import GPUS, nearest_gpu
from planner.loading import load_model_shape, model_shape_for_config
from planner.parallel import parallel_estimate
from planner.scenario import (
    Checkpointing,
    Device,
    Optimizer,
    Precision,
    Task,
    scenario_from_values,
)
from planner.step_time import step_time
from planner.strategy import ParallelPlan, Strategy
from planner.units import GIB, MIB
from runners.measure import measure_in_process
from runners.request import Mode

A10 = GPUS["a10"]


@pytest.fixture(scope="module")
def gpt2():
    return load_model_shape("gpt2", Task.CAUSAL_LM)


def base(task="causal-lm", seq_len=256, **overrides):
    return scenario_from_values(**({"task": task, "batch_size": 1, "seq_len": seq_len} | overrides))


def test_options_are_ranked_and_carry_the_fields(gpt2):
    # Full fine-tuning's grid (LoRA plans are searched beside it: tests below).
    result = find_fits(gpt2, base(), 8 * GIB, FitTarget(256, effective_batch=32), A10, lora=False)
    assert result.ranked_by == "fewest and safest changes to your plan, then step time" and result.options
    keys = [(change_rank(o.changes), o.step_time_s) for o in result.options]
    assert keys == sorted(keys)
    for option in result.options:
        j = option.to_json()
        for key in ("optimizer", "precision", "gradient_checkpointing", "grad_accum", "strategy",
                    "max_batch_size", "peak_bytes", "step_time_s", "changes", "risks", "finetune"):
            assert key in j
        assert j["strategy"] == "single"
        assert j["batch_size"] * j["grad_accum"] == 32  # the target effective batch, exactly
        assert j["grad_accum"] & (j["grad_accum"] - 1) == 0  # a power of two
    assert result.combinations == 4 * 3 * 2 * 6  # optimizers x precisions x checkpointing x {1..32}


def test_a_gpu_without_bf16_is_offered_fp16_mixed_and_never_bf16(gpt2):
    target = FitTarget(256, effective_batch=32)
    t4 = find_fits(gpt2, base(), 8 * GIB, target, GPUS["t4"], lora=False)
    assert not GPUS["t4"].supports_bf16 and t4.options
    assert {o.scenario.precision for o in t4.options} == {Precision.FP32, Precision.FP16_MIXED}
    assert t4.combinations == 4 * 2 * 2 * 6  # fp32 and fp16-mixed only
    assert any("no bf16 tensor cores" in note for note in t4.notes)
    a10 = find_fits(gpt2, base(), 8 * GIB, target, A10, allow_risky=True)  # pure bf16 is a risky change
    assert Precision.FP16_MIXED not in {o.scenario.precision for o in a10.options}
    assert {Precision.BF16_MIXED, Precision.BF16} <= {o.scenario.precision for o in a10.options}
    _, smallest, _ = smallest_plan(gpt2, base(), 256, gpu=GPUS["t4"])
    assert smallest.precision in (Precision.FP32, Precision.FP16_MIXED)


def test_search_agrees_with_estimate(gpt2):
    capacity = 6 * GIB
    # Risky changes allowed: every combination searched, SGD and pure bf16 included.
    result = find_fits(gpt2, base(), capacity, FitTarget(256, effective_batch=16), A10, allow_risky=True)
    assert result.options
    for option in result.options:
        plan = option.scenario
        assert estimate(gpt2, plan).peak_bytes == option.peak_bytes <= capacity
        at_max = dataclasses.replace(plan, batch_size=option.max_batch_size)
        assert estimate(gpt2, at_max).peak_bytes <= capacity
        assert estimate(gpt2, dataclasses.replace(at_max, batch_size=option.max_batch_size + 1)).peak_bytes > capacity
        if option.max_seq_len is not None and option.max_seq_len < gpt2.max_positions:
            longer = dataclasses.replace(plan, seq_len=option.max_seq_len + 1)
            assert estimate(gpt2, longer).peak_bytes > capacity
    # Every combination left out is one whose micro-batch does not fit.
    kept = {(o.scenario.optimizer, o.scenario.precision, o.scenario.checkpointing, o.scenario.grad_accum_steps)
            for o in result.options}
    for o in Optimizer.ADAMW, Optimizer.SGD:
        for p in Precision.FP32, Precision.BF16:
            for k in (1, 2, 4, 8, 16):
                plan = dataclasses.replace(base(), optimizer=o, precision=p, batch_size=16 // k, grad_accum_steps=k)
                fits = estimate(gpt2, plan).peak_bytes <= capacity
                assert fits == ((o, p, Checkpointing.NONE, k) in kept)


def test_batch_target_and_largest_batch_modes(gpt2):
    fixed = find_fits(gpt2, base(), 8 * GIB, FitTarget(256, batch_size=4), A10)
    assert all(o.scenario.batch_size == 4 and o.scenario.grad_accum_steps == 1 for o in fixed.options)
    largest = find_fits(gpt2, base(), 8 * GIB, FitTarget(256), A10)
    assert largest.ranked_by.endswith("then time per sequence")
    assert all(o.scenario.batch_size == o.max_batch_size for o in largest.options)
    per_sequence = [(change_rank(o.changes), o.seconds_per_sequence) for o in largest.options]
    assert per_sequence == sorted(per_sequence)
    assert find_fits(gpt2, base(), 100 * 2**20, FitTarget(256), A10).options == ()  # nothing fits 100 MiB


def test_several_gpus_and_bad_targets(gpt2):
    result = find_fits(gpt2, base(), 8 * GIB, FitTarget(256, effective_batch=32), A10, num_devices=4)
    assert all(o.strategy in SEARCH_STRATEGIES and o.effective_batch == 32 and o.step.communication_s > 0
               for o in result.options)
    assert {o.strategy for o in result.options} == set(SEARCH_STRATEGIES)  # gpt2 fits 8 GiB every way
    for option in result.options:  # every per-GPU peak is the multi-device planner's
        assert option.peak_bytes == parallel_estimate(gpt2, option.scenario,
                                                      ParallelPlan(4, option.strategy)).per_device_peak_bytes
    assert SHARDING_NOTE in result.notes
    with pytest.raises(PlannerInputError, match="divisible"):
        find_fits(gpt2, base(), 8 * GIB, FitTarget(256, effective_batch=30), A10, num_devices=4)
    with pytest.raises(PlannerInputError):
        FitTarget(256, batch_size=4, effective_batch=8)


def test_step_time_model(gpt2):
    plan = dataclasses.replace(base(), batch_size=8, precision=Precision.BF16_MIXED)
    plain = step_time(gpt2, plan, A10)
    recomputed = step_time(gpt2, dataclasses.replace(plan, checkpointing=Checkpointing.EVERY_LAYER), A10)
    assert recomputed.compute_s == pytest.approx(plain.compute_s * 4 / 3)  # one more forward of three passes
    # The same tokens in more, smaller micro-batches take longer.
    split = step_time(gpt2, dataclasses.replace(plan, batch_size=2, grad_accum_steps=4), A10)
    assert split.flops == pytest.approx(plain.flops) and split.compute_s > plain.compute_s
    assert step_time(gpt2, dataclasses.replace(plan, precision=Precision.FP32), A10).compute_s > 3 * plain.compute_s
    eight_bit = step_time(gpt2, dataclasses.replace(plan, optimizer=Optimizer.ADAMW8BIT), A10)
    assert eight_bit.optimizer_s < plain.optimizer_s
    assert step_time(gpt2, plan, A10, utilisation=0.2).compute_s == pytest.approx(2 * plain.compute_s)
    # 24 GiB is the RTX 3090's reported total exactly; 24,564 MiB the RTX 4090's.
    assert nearest_gpu(24 * GIB).key == "rtx3090" and nearest_gpu(24564 * MIB).key == "rtx4090"
    assert nearest_gpu(80 * GIB).key in ("a100-80gb", "h100")


def test_cli_fit_json_and_errors(capsys):
    assert main(["fit", "--config", "gpt2", "--gpu-memory-gib", "8", "--seq-len", "256",
                 "--effective-batch", "4", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    # The CLI's default plan (AdamW, fp32, the whole batch in one micro-batch) fits 8 GiB: it is first.
    assert estimate(load_model_shape("gpt2", Task.CAUSAL_LM), base(batch_size=4)).peak_bytes <= 8 * GIB
    assert rows and rows[0]["fits"] and rows[0]["changes"] == [] and rows[0]["optimizer"] == "adamw"
    assert {"optimizer", "precision", "gradient_checkpointing", "grad_accum", "strategy", "max_batch_size",
            "peak_bytes", "step_time_s"} <= set(rows[0])
    assert main(["fit", "--config", "gpt2", "--gpu", "a10", "--num-devices", "2", "--seq-len", "128"]) == 0
    out = capsys.readouterr().out
    assert "ddp" in out and "fsdp-full-shard" in out  # the strategy column: every searched strategy fits
    assert SHARDING_NOTE in " ".join(out.split())
    assert main(["fit", "--config", "gpt2", "--seq-len", "128"]) == 2
    assert main(["fit", "--config", "gpt2", "--gpu", "a10", "--utilisation", "1.5"]) == 2
    assert main(["fit", "--config", "gpt2", "--gpu", "nope"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 3 and all(line.startswith("planner: error:") for line in err)


# --- Against simulated runs ---------------------------------------------------------

SEQ = 64
MODELS = [("tiny-llama", "causal-lm"), ("tiny-gpt2", "causal-lm"), ("tiny-distilbert", "sequence-classification")]
REFERENCE_BATCHES = (2, 6)  # capacities: the AdamW fp32 peak at these batches, so largest batches stay small


def _simulated_peak(name: str, plan) -> int:
    values = {"task": plan.task.value, "num_labels": plan.num_labels, "batch_size": plan.batch_size,
              "seq_len": plan.seq_len, "optimizer": plan.optimizer.value, "precision": plan.precision.value,
              "gradient_checkpointing": plan.checkpointing is Checkpointing.EVERY_LAYER,
              "grad_accum": plan.grad_accum_steps, "attn": plan.attention.value, "device": plan.device.value}
    return measure_in_process(tiny_config(name), name, values, Mode.SIMULATE)["measured"]["peak_bytes"]


@pytest.mark.parametrize("reference_batch", REFERENCE_BATCHES)
@pytest.mark.parametrize("name,task", MODELS)
def test_largest_batch_against_simulated_runs(name, task, reference_batch):
    # device cpu: simulated runs use CPU kernels (fp32 dropout masks), so the plan must too.
    plan_base = base(task=task, seq_len=SEQ, device="cpu")
    shape = model_shape_for_config(tiny_config(name), plan_base.task, plan_base.num_labels, name)
    capacity = estimate(shape, dataclasses.replace(plan_base, batch_size=reference_batch)).peak_bytes
    best = find_fits(shape, plan_base, capacity, FitTarget(SEQ), A10, with_max_seq_len=False, lora=False).options[0]
    at_max = best.scenario
    assert at_max.batch_size == best.max_batch_size <= 64
    fitted = _simulated_peak(name, at_max)
    over = _simulated_peak(name, dataclasses.replace(at_max, batch_size=at_max.batch_size + 1))
    assert fitted <= capacity, f"unsafe: {at_max} simulates to {fitted:,} B > capacity {capacity:,} B"
    assert over > capacity * (1 - FIT_ERROR_MARGIN), (
        f"wasteful: {at_max} at batch {at_max.batch_size + 1} simulates to {over:,} B, within {capacity:,} B "
        "less the margin")


def test_eight_bit_mixed_checkpointed_distilbert_is_safe():
    # Found by checking non-top options against simulation: the finder's largest batch for
    # this combination did not fit when simulated (the planner missed the moment a
    # recomputed encoder block is entered under autocast); kept as a regression test.
    name, task = "tiny-distilbert", "sequence-classification"
    plan_base = base(task=task, seq_len=SEQ, device="cpu")
    shape = model_shape_for_config(tiny_config(name), plan_base.task, plan_base.num_labels, name)
    capacity = estimate(shape, dataclasses.replace(plan_base, batch_size=2)).peak_bytes
    option = next(o for o in find_fits(shape, plan_base, capacity, FitTarget(SEQ), A10, with_max_seq_len=False,
                                       lora=False).options
                  if o.scenario.optimizer is Optimizer.ADAMW8BIT and o.scenario.precision is Precision.BF16_MIXED
                  and o.scenario.checkpointing is Checkpointing.EVERY_LAYER)
    assert _simulated_peak(name, option.scenario) <= capacity


def test_pure_bf16_adafactor_step_is_counted():
    # transformers' Adafactor under pure bf16 works on fp32 copies of the gradient and the
    # parameter: without them the planner was 27% under this simulated peak (unsafe plans).
    name = "tiny-distilbert"
    plan = base(task="sequence-classification", seq_len=SEQ, device="cpu", optimizer="hf-adafactor",
                precision="bf16", batch_size=5)
    shape = model_shape_for_config(tiny_config(name), plan.task, plan.num_labels, name)
    estimated = estimate(shape, plan).peak_bytes
    assert abs(_simulated_peak(name, plan) / estimated - 1) < FIT_ERROR_MARGIN


def test_report_carries_the_fit_finders_best_options(tmp_path):
    """The exported report lists the same options, best first, that the finder returns."""
    import json as json_module

    from planner.fit import FitTarget, find_fits
    from planner.gpus import nearest_gpu
    from planner.loading import load_model_shape
    from reporting import write_report

    values = {"config": "gpt2", "task": "causal-lm", "batch_size": 4, "seq_len": 512, "gpu": "24"}
    out = write_report(values, tmp_path / "plan.json")
    report = json_module.loads(out.read_text())
    scenario = scenario_from_values(task="causal-lm", batch_size=4, seq_len=512)
    shape = load_model_shape("gpt2", scenario.task)
    capacity = 24 * 2**30
    expected = find_fits(shape, scenario, capacity, FitTarget(512, effective_batch=4), nearest_gpu(capacity),
                         with_max_seq_len=False).options
    assert report["what_fits"], "a 124M model fits 24 GiB"
    assert [row["peak (bytes)"] for row in report["what_fits"]] == [o.peak_bytes for o in expected[:10]]
    assert report["what_fits"][0]["changes"] == "none (your plan)"  # the plan itself fits 24 GiB
    assert [row["changes"] for row in report["what_fits"][1:]] == [
        "; ".join(c.text for c in o.changes) for o in expected[1:10]]
    assert report["what_fits_nearest"] == []
    markdown = write_report(values, tmp_path / "plan.md").read_text()
    assert "## What fits" in markdown and "| changes | risks |" in markdown


def test_report_lists_the_nearest_plans_when_nothing_fits(tmp_path):
    from reporting import write_report

    # 1.25 GiB: 600 MiB of room, under LoRA's least with a bf16 base (631 MiB: its bf16 weights, 238 MiB).
    values = {"config": "gpt2", "task": "causal-lm", "batch_size": 4, "seq_len": 512, "gpu": "1.25"}
    report = json.loads(write_report(values, tmp_path / "plan.json").read_text())
    shape = load_model_shape("gpt2", Task.CAUSAL_LM)
    assert report["what_fits"] == [] and report["what_fits_nearest"]
    # On CUDA a plan gets the capacity less the overheads (planner.cuda_overheads; a size names
    # no GPU, so their larger figures).
    overheads = cuda_overheads(None)
    room = 5 * GIB // 4 - overheads.total_bytes - overheads.allocator_bytes
    for row in report["what_fits_nearest"]:
        plan = scenario_from_values(task="causal-lm", batch_size=row["micro-batch"], seq_len=512,
                                    optimizer=row["optimizer"], precision=row["precision"],
                                    gradient_checkpointing=row["checkpointing"], grad_accum=row["accumulation"],
                                    finetune=row["method"].split()[0])  # "lora r16"
        assert row["over by (bytes)"] == estimate(shape, plan).peak_bytes - room > 0
    filled = json.loads(write_report({**values, "gpu": "0.5"}, tmp_path / "small.json").read_text())
    assert filled["what_fits"] == [] and filled["what_fits_nearest"] == []
    assert filled["what_fits_left_out"][0].startswith("the CUDA overheads alone")
    # LoRA and QLoRA are planned on CUDA (probed with CUDA's kernels).
    assert not any("LoRA plans left out" in line for line in report["what_fits_left_out"])
    markdown = write_report(values, tmp_path / "plan.md").read_text()
    assert "The nearest plans" in markdown and "| over by (%) |" in markdown


def test_sharding_makes_a_7b_model_fit_where_ddp_cannot():
    """Llama-2-7B with AdamW on 8 x 24 GiB: a replica's model state alone (fp32 weights and
    gradients, two fp32 moments: 16 bytes per parameter, 100 GiB) cannot fit one GPU, so no
    DDP plan with AdamW exists; sharded over 8 GPUs (2 bytes per parameter each) it does."""
    shape = load_model_shape("llama-2-7b", Task.CAUSAL_LM, 2)
    scenario = scenario_from_values(task="causal-lm", batch_size=1, seq_len=2048)
    result = find_fits(shape, scenario, 24 * GIB, FitTarget(2048, batch_size=1), A10, num_devices=8)
    adamw_mixed = [o for o in result.options if o.scenario.optimizer is Optimizer.ADAMW
                   and o.scenario.precision is not Precision.BF16]
    assert 16 * shape.num_parameters > 24 * GIB > 16 * shape.num_parameters / 8
    assert adamw_mixed and not [o for o in adamw_mixed if o.strategy in (Strategy.DDP, Strategy.ZERO1)]
    assert {o.strategy for o in adamw_mixed} >= {Strategy.FSDP_FULL_SHARD}
    assert all(o.peak_bytes <= 24 * GIB for o in result.options)


# --- Ranking by the fewest and safest changes to the user's plan ----------------------

A100 = GPUS["a100-80gb"]


@pytest.fixture(scope="module")
def mistral():
    return load_model_shape("mistral-7b-v0.1", Task.CAUSAL_LM)


def _risky(scenario) -> set:
    """The risks a plan takes against an AdamW, bf16-mixed plan, read from its fields alone
    (a bf16 base under LoRA is no risk: the adapters PEFT trains stay fp32)."""
    pure_bf16 = scenario.precision is Precision.BF16 and not scenario.finetune.uses_adapters
    return ({Risk.SGD} if scenario.optimizer is Optimizer.SGD else set()) | ({Risk.PURE_BF16} if pure_bf16 else set())


def test_mistral_on_8_a100_keeps_adamw_unless_risky_changes_are_allowed(mistral, capsys):
    """Full fine-tuning of Mistral-7B on 8 x A100 80 GB, effective batch 64: ranked by step
    time alone, the fastest plan that fits is SGD or pure bf16 (what the finder used to put
    first); ranked by changes to an AdamW bf16-mixed plan, the first plan keeps AdamW and
    bf16-mixed, and no SGD or pure bf16 plan is proposed unless risky changes are allowed,
    each then labelled with exactly its risks."""
    own = base(seq_len=2048, precision="bf16-mixed")
    target = FitTarget(2048, effective_batch=64)
    allowed = find_fits(mistral, own, A100.capacity_bytes, target, A100, 8, with_max_seq_len=False,
                        allow_risky=True)
    fastest = min(allowed.options, key=lambda o: o.step_time_s)
    assert _risky(fastest.scenario), "step time alone proposes SGD or pure bf16"
    safe = find_fits(mistral, own, A100.capacity_bytes, target, A100, 8, with_max_seq_len=False)
    first = safe.options[0].scenario
    assert (first.optimizer, first.precision) == (Optimizer.ADAMW, Precision.BF16_MIXED)
    assert not [o for o in safe.options if _risky(o.scenario)] and safe.risky_left_out > 0
    assert any("risk model quality" in note for note in safe.notes)
    risky = [o for o in allowed.options if _risky(o.scenario)]
    assert {Risk.SGD, Risk.PURE_BF16} <= {r for o in risky for r in o.risks}
    for option in allowed.options:
        assert set(option.risks) == _risky(option.scenario)
        assert option.to_json()["risks"] == [r.value for r in option.risks]
    # Allowed, risky plans still rank after every plan that risks nothing.
    assert allowed.options[:len(safe.options)] == safe.options


# Extended (conftest.py): the CLI searches every option's largest sequence too, each answer
# replayed through the caching allocator (tens of seconds on two cores); test_cli_fit_json_and_errors
# below and tests/test_cli_hostile_input.py take the CLI's fit path in the suite.
@pytest.mark.extended
def test_mistral_on_8_a100_from_the_cli_keeps_adamw_unless_risky_changes_are_allowed(mistral, capsys):
    own = base(seq_len=2048, precision="bf16-mixed")
    target = FitTarget(2048, effective_batch=64)

    # The CLI, from the same plan: AdamW first, SGD and pure bf16 only with --allow-risky. It
    # searches the room the CUDA overheads leave on each GPU under each strategy (the context;
    # NCCL communicators: one under DDP and FSDP, two under ZeRO; planner.cuda_overheads).
    def room(plan):
        overheads = cuda_overheads(A100, plan)
        return A100.capacity_bytes - overheads.total_bytes - overheads.allocator_bytes

    on_the_driver = find_fits(mistral, own, A100.capacity_bytes, target, A100, 8, with_max_seq_len=False,
                              room_for=room)
    argv = ["fit", "--config", "mistral-7b-v0.1", "--gpu", "a100-80gb", "--num-devices", "8", "--seq-len", "2048",
            "--effective-batch", "64", "--precision", "bf16-mixed", "--json"]
    assert main(argv) == 0
    first = json.loads(capsys.readouterr().out)[0]
    assert (first["optimizer"], first["precision"], first["strategy"]) == ("adamw", "bf16-mixed",
                                                                         on_the_driver.options[0].strategy.value)
    assert main([*argv, "--allow-risky"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert {(r["optimizer"], r["precision"], tuple(r["risks"])) for r in rows if r["risks"]} >= {
        ("sgd", "bf16-mixed", (Risk.SGD.value,)), ("adamw", "bf16", (Risk.PURE_BF16.value,))}


def test_the_users_own_plan_ranks_first_when_it_fits(gpt2):
    # torch's Adafactor is not among the searched optimizers: the user's own is searched too.
    own = base(batch_size=4, grad_accum=2, optimizer="adafactor", precision="bf16-mixed")
    assert Optimizer.ADAFACTOR not in SEARCH_OPTIMIZERS
    capacity = 8 * GIB
    assert estimate(gpt2, own).peak_bytes <= capacity
    # Full fine-tuning's grid: LoRA plans rank after every full one (test below), and would
    # probe this precision's adapter classes first.
    result = find_fits(gpt2, own, capacity, FitTarget(256, effective_batch=8), A10, lora=False)
    first = result.options[0]
    assert first.changes == () and first.scenario == own
    assert all(o.changes for o in result.options[1:])
    faster = [o for o in result.options if o.step_time_s < first.step_time_s]
    assert faster, "a plan with changes is faster: the user's plan is first because it changes nothing"


def test_checkpointing_alone_ranks_above_an_optimizer_change(gpt2):
    """On a GPU where the plan fits only with checkpointing or with 8-bit AdamW, the plan
    that adds checkpointing (a memory technique, the same updates) ranks above the one that
    swaps the optimizer, though the swap is faster (no recomputation)."""
    own = base(batch_size=8, seq_len=512)
    checkpointed = dataclasses.replace(own, checkpointing=Checkpointing.EVERY_LAYER)
    eight_bit = dataclasses.replace(own, optimizer=Optimizer.ADAMW8BIT)
    capacity = max(estimate(gpt2, checkpointed).peak_bytes, estimate(gpt2, eight_bit).peak_bytes)
    assert estimate(gpt2, own).peak_bytes > capacity  # the plan itself does not fit
    result = find_fits(gpt2, own, capacity, FitTarget(512, batch_size=8), A10, with_max_seq_len=False)
    plans = [o.scenario for o in result.options]
    ckpt, swap = plans.index(checkpointed), plans.index(eight_bit)
    assert ckpt < swap and ckpt == 0
    assert [c.kind for c in result.options[ckpt].changes] == [ChangeKind.CHECKPOINTING]
    assert [(c.kind, c.cost) for c in result.options[swap].changes] == [(ChangeKind.OPTIMIZER, Cost.SWAP)]
    assert result.options[swap].step_time_s < result.options[ckpt].step_time_s


def test_nothing_fits_lists_the_nearest_plans_and_their_misses(gpt2, capsys):
    capacity = 300 * 2**20  # gpt2's fp32 weights alone are 475 MiB, its bf16 base under LoRA 238 MiB
    own = base(seq_len=256)
    result = find_fits(gpt2, own, capacity, FitTarget(256, effective_batch=4), A10)
    assert result.options == () and 0 < len(result.nearest) <= NEAREST_SHOWN
    for miss in result.nearest:
        peak = estimate(gpt2, miss.scenario).peak_bytes
        assert miss.peak_bytes == peak and miss.over_bytes == peak - capacity > 0
        assert miss.over_pct == pytest.approx(100 * (peak - capacity) / capacity)
        assert not _risky(miss.scenario) and miss.to_json()["over_bytes"] == peak - capacity
    misses = [m.over_bytes for m in result.nearest]
    assert misses == sorted(misses)
    # The nearest is the lowest peak of every non-risky combination, recomputed here.
    # Full plans in fp32 or bf16 autocast; LoRA and QLoRA (planned on CUDA too) in fp32 or over a bf16 base.
    searched = [(FineTune(), p) for p in (Precision.FP32, Precision.BF16_MIXED)] + [
        (FineTune(m), p) for m in (Method.LORA, Method.QLORA) for p in (Precision.FP32, Precision.BF16)]
    lowest = min(estimate(gpt2, dataclasses.replace(own, optimizer=o, precision=p, checkpointing=c,
                                                    batch_size=4 // k, grad_accum_steps=k, finetune=f)).peak_bytes
                 for o in (Optimizer.ADAMW, Optimizer.ADAMW8BIT, Optimizer.HF_ADAFACTOR)
                 for f, p in searched for c in Checkpointing for k in (1, 2, 4))
    assert result.nearest[0].peak_bytes == lowest
    # The CLI prints them (and, as JSON, marks them as not fitting), on a GPU whose CUDA
    # overheads (planner.cuda_overheads, an A10's) leave the same 300 MiB.
    overheads = cuda_overheads(A10)
    driver_total = capacity + overheads.total_bytes + overheads.allocator_bytes
    argv = ["fit", "--config", "gpt2", "--gpu-memory-gib", str(driver_total / GIB), "--gpu", "a10", "--seq-len", "256",
            "--effective-batch", "4"]
    assert main(argv) == 0
    text = capsys.readouterr().out
    assert "Nearest plans" in text and f"{result.nearest[0].over_pct:.1f}%" in text
    assert main([*argv, "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [r["over_bytes"] for r in rows] == misses and not any(r["fits"] for r in rows)


def _lora_ranks_beside_full(shape, result) -> None:
    """LoRA and QLoRA plans (PEFT's default r 16, all-linear; nf4 with double quantisation)
    rank after every full plan (they train other parameters), each peak the estimate's."""
    lora = [o for o in result.options if o.scenario.finetune.uses_adapters]
    full = [o for o in result.options if not o.scenario.finetune.uses_adapters]
    assert lora and full and result.options == (*full, *lora)
    assert {o.scenario.finetune.method for o in lora} == {Method.LORA, Method.QLORA}
    for option in lora:
        method = option.scenario.finetune.method.value
        assert option.changes[0].text == f"fine-tuning full -> {method} r16" and option.changes[0].cost is Cost.METHOD
        assert option.peak_bytes == estimate(shape, option.scenario).peak_bytes
    assert result.left_out == ()


def test_lora_plans_beside_full_ones_where_the_estimate_plans_them():
    """On CUDA, probed with CUDA's kernels (tests/test_lora.py, tests/test_qlora.py), planned on
    GPT-2, whose CUDA tables ship (a tiny config's CUDA classes took 100 s to probe)."""
    own = base(seq_len=SEQ, device="cuda", batch_size=2)
    gpt2 = load_model_shape("gpt2", Task.CAUSAL_LM)
    _lora_ranks_beside_full(gpt2, find_fits(gpt2, own, A10.capacity_bytes, FitTarget(SEQ, batch_size=2), A10))


@pytest.mark.extended
def test_lora_plans_beside_full_ones_on_the_cpu():
    """The same ranking with CPU kernels (the search does not depend on the device): a tiny
    config's 16 CPU LoRA and QLoRA classes, about 45 s to probe on a fresh machine."""
    name = "tiny-gpt2"
    own = base(seq_len=SEQ, device="cpu", batch_size=2)
    shape = model_shape_for_config(tiny_config(name), own.task, own.num_labels, name)
    _lora_ranks_beside_full(shape, find_fits(shape, own, GIB, FitTarget(SEQ, batch_size=2), A10,
                                             with_max_seq_len=False))


def test_lora_over_a_bf16_base_is_a_swap_because_peft_keeps_the_adapters_fp32():
    """LoRA plans are also searched with the frozen base in bf16. PEFT casts bf16 adapters to
    fp32 (`autocast_adapter_dtype`), so every weight the optimizer updates is fp32: the plan is
    a precision swap, not the pure-bf16 risk, and it is proposed without --allow-risky."""
    import torch
    from peft import get_peft_model
    from transformers import AutoModelForCausalLM

    from planner.adapters import lora_config
    from planner.shapes_from_config import load_transformers_config

    name = "tiny-gpt2"
    own = base(seq_len=SEQ, device="cuda", batch_size=2)
    config_dict = tiny_config(name)
    model = AutoModelForCausalLM.from_config(load_transformers_config(config_dict, own.task, 0), dtype=torch.bfloat16)
    peft_model = get_peft_model(model, lora_config(FineTune(Method.LORA), own.task))
    trained = {p.dtype for p in peft_model.parameters() if p.requires_grad}
    frozen = {p.dtype for p in peft_model.parameters() if not p.requires_grad}
    assert trained == {torch.float32} and frozen == {torch.bfloat16}

    # Planned on GPT-2, whose CUDA tables ship (the tiny config's CUDA classes probe for minutes).
    shape = load_model_shape("gpt2", own.task)
    result = find_fits(shape, own, A10.capacity_bytes, FitTarget(SEQ, batch_size=2), A10, with_max_seq_len=False)
    over_bf16 = [o for o in result.options
                 if o.scenario.finetune.method is Method.LORA and o.scenario.precision is Precision.BF16]
    assert over_bf16 and not result.allow_risky
    for option in over_bf16:
        precision = next(c for c in option.changes if c.kind is ChangeKind.PRECISION)
        assert (precision.cost, precision.risk) == (Cost.SWAP, None)
        assert precision.text == "precision fp32 -> bf16 frozen base (adapters fp32)"
        assert option.peak_bytes == estimate(shape, option.scenario).peak_bytes
    # Full fine-tuning in pure bf16 stays a risk, left out unless allowed.
    assert not any(o.scenario.precision is Precision.BF16 for o in result.options
                   if not o.scenario.finetune.uses_adapters)
    # On a GPU without bf16 (a T4) LoRA stays in the user's precision.
    t4 = find_fits(shape, own, GPUS["t4"].capacity_bytes, FitTarget(SEQ, batch_size=2), GPUS["t4"],
                   with_max_seq_len=False)
    assert {o.scenario.precision for o in t4.options if o.scenario.finetune.uses_adapters} == {Precision.FP32}
