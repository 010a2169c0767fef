"""QLoRA planned against QLoRA measured: the model as a user builds it (`from_pretrained` with
`BitsAndBytesConfig`, `prepare_model_for_kbit_training`, `get_peft_model`), a full-depth step
on real CPU tensors (bitsandbytes 0.50 runs 4-bit layers forward and backward on CPU) against
the estimate: weights (4-bit storage and its quantisation state, fp32 rest, adapters) and
optimizer state exact, the peak and every phase from the probe, which runs QLoRA on small
real tensors (a fake tensor cannot become a Params4bit). The bar is the probe's, 0.1% of the
peak (tests/probe_comparison.py); GPT-2's batches are +16 B a token high there as in full
fine-tuning (README, "Batch 1 is a technique class of its own")."""

import dataclasses
import types

import pytest
from probe_comparison import TOLERANCE, deep, own_probe_cache  # noqa: F401 (the fixture)

from planner.adapters import quantized_base
from planner.errors import PlannerInputError
from planner.estimate import Confidence, Phase, estimate
from planner.loading import model_shape_for_config
from planner.probe.memtracker import quantization_state_tensors
from planner.scenario import scenario_from_values
from runners.measure import measure_in_process
from runners.request import Mode

CASES = [
    ("tiny-llama", {"quant_type": "nf4", "double_quant": True}),
    ("tiny-llama", {"quant_type": "fp4", "double_quant": False, "gradient_checkpointing": True}),
    # GPT-2's Conv1D layers: transformers' bnb integration quantises them too.
    ("tiny-gpt2", {"quant_type": "nf4", "double_quant": True, "precision": "bf16-mixed"}),
    ("tiny-gpt2", {"quant_type": "fp4", "double_quant": False}),
]


@pytest.mark.parametrize("name,overrides", CASES,
                         ids=[f"{n}-{'-'.join(f'{k}={v}' for k, v in o.items())}" for n, o in CASES])
def test_qlora_estimate_matches_a_real_cpu_step(name, overrides):
    values = {"task": "causal-lm", "batch_size": 3, "seq_len": 40, "finetune": "qlora", "lora_r": 8, **overrides}
    config = deep(name, 5)
    scenario = scenario_from_values(device="cpu", **values)
    shape = model_shape_for_config(config, scenario.task, scenario.num_labels, "tiny")
    estimated = estimate(shape, scenario)
    assert estimated.confidence is Confidence.PROBED_REAL
    measured = measure_in_process(config, "tiny", dict(device="cpu", **values), Mode.CPU)["measured"]
    # States: exact (the 4-bit base as bitsandbytes stores it, tests/test_adapters.py).
    assert estimated.weights_bytes == measured["weights_bytes"]
    assert estimated.optimizer_state_bytes == measured["optimizer_state_bytes"]
    peak = measured["peak_bytes"]
    error = (estimated.peak_bytes - peak) / peak
    assert abs(error) <= TOLERANCE, f"{name}: estimated {estimated.peak_bytes:,} B, measured {peak:,} B ({error:+.4%})"
    phases = {p.phase.value: p.total for p in estimated.phases}
    for phase in (Phase.FORWARD.value, Phase.BACKWARD.value, Phase.OPTIMIZER_STEP.value):
        got, want = phases[phase], measured["phase_peak_bytes"][phase]
        assert abs(got - want) <= TOLERANCE * want, f"{name} {phase}: {got:,} B against {want:,} B"


def test_the_quantisation_state_is_measured_as_weights():
    """MemTracker sees parameters and buffers only; absmax, codes and the nested state of each
    4-bit weight are live too, and the runs count them (planner.probe.memtracker)."""
    from conftest import tiny_config

    from planner.probe.build import build_model

    config = tiny_config("tiny-llama")
    scenario = scenario_from_values(device="cpu", task="causal-lm", batch_size=2, seq_len=8, finetune="qlora")
    model = build_model(config, scenario)
    stored = {}
    for tensor in quantization_state_tensors(model):
        stored[tensor.untyped_storage().data_ptr()] = tensor.untyped_storage().nbytes()
    packed = sum(p.untyped_storage().nbytes() for p in model.parameters() if hasattr(p, "quant_state"))
    shape = model_shape_for_config(config, scenario.task, scenario.num_labels, "tiny")
    planned = quantized_base(shape.source_config, scenario.task, scenario.num_labels, True, "nf4")
    assert packed + sum(stored.values()) == planned.quantized_bytes
    assert sum(stored.values()) > 0


def test_qlora_on_cuda_is_refused_in_one_line():
    from conftest import tiny_config

    config = tiny_config("tiny-llama")
    scenario = scenario_from_values(device="cuda", task="causal-lm", batch_size=2, seq_len=8, finetune="qlora")
    shape = model_shape_for_config(config, scenario.task, scenario.num_labels, "tiny")
    with pytest.raises(PlannerInputError, match="--device cpu") as refused:
        estimate(shape, scenario)
    assert "\n" not in str(refused.value)


def test_a_simulated_qlora_run_is_refused_in_one_line(monkeypatch):
    """A 4-bit base is quantised from real weights: `--mode simulate` (and `auto` when a real
    run would not fit) says so instead of failing in the child."""
    from conftest import tiny_config

    from runners import verify
    from runners.request import VerifyRequest

    planned = types.SimpleNamespace(peak_bytes=1)  # the estimate itself is tested above
    monkeypatch.setattr(verify, "estimate", lambda shape, scenario: planned)
    request = VerifyRequest(config=tiny_config("tiny-llama"), model_name="tiny", mode=Mode.SIMULATE,
                            scenario={"task": "causal-lm", "batch_size": 2, "seq_len": 8, "finetune": "qlora"})
    refusal = verify.plan_run(request).refusal
    assert refusal == verify.QLORA_NEEDS_REAL_TENSORS and "--mode cpu" in refusal
    too_small = verify.plan_run(dataclasses.replace(request, mode=Mode.AUTO), cuda_available=False,
                                available_bytes=0)
    assert too_small.refusal.endswith(verify.QLORA_NEEDS_REAL_TENSORS)
