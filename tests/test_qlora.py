"""QLoRA planned against QLoRA measured: the model as a user builds it (`from_pretrained` with
`BitsAndBytesConfig`, `prepare_model_for_kbit_training`, `get_peft_model`), a full-depth step
on real CPU tensors (bitsandbytes 0.50 runs 4-bit layers forward and backward on CPU) against
the estimate: weights (4-bit storage and its quantisation state, fp32 rest, adapters) and
optimizer state exact, the peak and every phase from the probe, which runs QLoRA on small
real tensors on the CPU. CUDA plans build the same model on fake tensors
(planner.probe.fake_quantized), checked here against the real load and its probe. The bar is the probe's, 0.1% of the
peak (tests/probe_comparison.py); GPT-2's batches are +16 B a token high there as in full
fine-tuning (README, "Batch 1 is a technique class of its own")."""

import dataclasses

import pytest
from probe_comparison import TOLERANCE, deep, own_probe_cache  # noqa: F401 (the fixture)

from planner.adapters import quantized_base
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


FAKE_CASES = [
    ("tiny-llama", {"quant_type": "nf4", "double_quant": True}),
    ("tiny-gpt2", {"quant_type": "fp4", "double_quant": False, "precision": "bf16-mixed",
                   "gradient_checkpointing": True}),
]
FAKE_IDS = [f"{n}-{o['quant_type']}" for n, o in FAKE_CASES]


def _qlora_scenario(overrides, **more):
    return scenario_from_values(task="causal-lm", batch_size=2, seq_len=16, finetune="qlora", lora_r=8,
                                **{"device": "cpu", **overrides, **more})


def _state_summary(state) -> tuple:
    def tensor(t):
        return None if t is None else (tuple(t.shape), t.dtype)

    nested = _state_summary(state.state2) if state.nested else None
    shape = None if state.shape is None else tuple(state.shape)
    return (tensor(state.absmax), tensor(state.code), tensor(state.offset), shape, state.dtype,
            state.blocksize, state.quant_type, nested)


@pytest.mark.parametrize("name,overrides", FAKE_CASES, ids=FAKE_IDS)
def test_qlora_built_on_fake_tensors_is_the_real_load(name, overrides):
    """CUDA plans build QLoRA on fake tensors (planner.probe.fake_quantized): every parameter
    (name, shape, dtype, trainable), every 4-bit weight's quantisation state and every
    module's class as the real `from_pretrained` load, `prepare_model_for_kbit_training` and
    `get_peft_model` leave them; and the model's flags PEFT reads."""
    from conftest import tiny_config
    from torch._subclasses.fake_tensor import FakeTensorMode

    from planner.probe.build import build_model

    config, scenario = tiny_config(name), _qlora_scenario(overrides)
    real = build_model(config, scenario)
    with FakeTensorMode():
        fake = build_model(config, scenario)

    def parameters(model):
        return [(n, tuple(p.shape), p.dtype, p.requires_grad) for n, p in model.named_parameters()]

    def states(model):
        return [(n, _state_summary(p.quant_state)) for n, p in model.named_parameters() if hasattr(p, "quant_state")]

    assert parameters(fake) == parameters(real)
    assert states(fake) == states(real) and len(states(real)) > 0
    assert [type(m).__name__ for m in fake.modules()] == [type(m).__name__ for m in real.modules()]
    for flag in ("is_loaded_in_4bit", "quantization_method", "is_quantized"):
        assert getattr(fake.base_model.model, flag) == getattr(real.base_model.model, flag)


@pytest.mark.parametrize("name,overrides", FAKE_CASES, ids=FAKE_IDS)
def test_qlora_probed_on_fake_tensors_walks_as_the_real_probe(name, overrides):
    """The probe of the fake-tensor QLoRA model (CPU kernels) against the probe of the real
    load on real tensors: the same high points in forward, backward and at the step, for
    several batch, sequence and accumulation sizes. (The real run's padding-mask check adds a
    bool (b, s) and 9 B of scalars at one moment in the first forward; fake tensors skip it,
    planner.probe.fake_mode, and it never is the high point.)"""
    from conftest import tiny_config

    from planner.probe.run import layout_for, record_probes
    from planner.probe.solve import solve
    from planner.shapes_from_config import load_transformers_config

    config_dict, scenario = tiny_config(name), _qlora_scenario(overrides)
    config = load_transformers_config(config_dict, scenario.task, 0)
    layout = layout_for(config)
    real = solve(record_probes(config_dict, config, scenario, layout, False, real=True), layout, "real",
                 on_real_tensors=True)
    fake = solve(record_probes(config_dict, config, scenario, layout, False), layout, "fake")
    for batch, seq, accumulation in ((1, 64, 1), (3, 100, 2), (8, 512, 1)):
        assert fake.walk(batch, seq, accumulation) == real.walk(batch, seq, accumulation)


def test_a_4bit_matmul_on_fake_tensors_dequantises_as_cuda_does():
    """Inside gemm_4bit_as_on_cuda, a fake 4-bit matmul of more than 1536 tokens allocates what
    bitsandbytes' CUDA path does (`_gemm_4bit_default_impl`): the dequantised absmax (one fp32
    per 64 weights) plus the offset, then the dequantised weight in the input's dtype, then
    the output. Without it, the op's fake kernel allocates the output only."""
    import contextlib

    import bitsandbytes as bnb
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode

    from planner.probe.fake_quantized import gemm_4bit_as_on_cuda
    from planner.probe.memtracker import TrainableMemTracker

    rows, cols, tokens = 256, 128, 2048
    dynamic_map = bnb.functional.create_dynamic_map()  # real: it reads values (planner.probe.fake_quantized)
    with FakeTensorMode() as mode:
        linear = torch.nn.Linear(cols, rows, bias=False, dtype=torch.bfloat16)
        bnb.functional.name2qmap["dynamic"] = mode.from_tensor(dynamic_map)
        packed, state = bnb.functional.quantize_4bit(linear.weight, compress_statistics=True, quant_type="nf4")
        del bnb.functional.name2qmap["dynamic"]
        x = torch.empty(tokens, cols, dtype=torch.bfloat16)

    def peak(context) -> int:
        with mode, context:
            tracker = TrainableMemTracker()
            with tracker:
                bnb.matmul_4bit(x, packed.t(), quant_state=state)
            return tracker.get_tracker_snapshot("peak")[x.device]["Total"]

    output = tokens * rows * 2
    blocks = rows * cols // 64
    fused = peak(contextlib.nullcontext())
    assert fused == output + packed.numel()  # MemTracker sees the packed weight through matmul_4bit's view of it
    # The dequantised weight in bf16, and the summed absmax (the sum's first operand is freed before it).
    assert peak(gemm_4bit_as_on_cuda()) == fused + rows * cols * 2 + blocks * 4


def test_qlora_on_cuda_counts_every_stored_tensor_in_the_allocators_blocks():
    """On CUDA each tensor takes whole 512-byte blocks: the estimate's weights are the real
    load's every parameter, adapter and quantisation-state tensor (packed weight, absmax,
    nested absmax and code, offset, 4-bit code), each rounded up, plus its buffers. The
    probe is the fake-tensor build's with CUDA's kernels (tested above)."""
    from conftest import tiny_config

    from planner.optimizer_state import allocation
    from planner.probe.build import build_model
    from planner.scenario import Device

    config = tiny_config("tiny-llama")
    scenario = _qlora_scenario({"device": "cuda"}, precision="bf16-mixed")
    model = build_model(config, dataclasses.replace(scenario, device=Device.CPU))
    blocks = allocation(Device.CUDA)
    stored = [p.untyped_storage().nbytes() for p in model.parameters()]
    stored += [t.untyped_storage().nbytes() for t in quantization_state_tensors(model)]
    buffers = blocks(sum(b.untyped_storage().nbytes() for b in model.buffers()))  # one rotary buffer
    shape = model_shape_for_config(config, scenario.task, scenario.num_labels, "tiny")
    estimated = estimate(shape, scenario)
    assert estimated.weights_bytes == sum(blocks(n) for n in stored) + buffers
    assert estimated.weights_bytes > sum(stored)  # the rounding is there
    assert estimated.confidence is Confidence.PROBED and any("QLoRA on CUDA" in n for n in estimated.notes)


@pytest.mark.parametrize("name,overrides", FAKE_CASES, ids=FAKE_IDS)
def test_a_simulated_qlora_run_measures_what_the_real_cpu_run_measures(name, overrides):
    """`--mode simulate` builds QLoRA on fake tensors (planner.probe.fake_quantized): every
    measured byte (weights with the quantisation state, gradients, state, activations, each
    phase's peak) equals the real CPU run's; `verify.plan_run` no longer refuses it."""
    from conftest import tiny_config

    from runners import verify
    from runners.request import VerifyRequest

    config = tiny_config(name)
    values = {"task": "causal-lm", "batch_size": 3, "seq_len": 40, "finetune": "qlora", "lora_r": 8,
              "device": "cpu", **overrides}
    real = measure_in_process(config, "tiny", dict(values), Mode.CPU)["measured"]
    simulated = measure_in_process(config, "tiny", dict(values), Mode.SIMULATE)["measured"]
    timings = {k for k in real if k.endswith("_s")}
    assert {k: v for k, v in simulated.items() if k not in timings} == {
        k: v for k, v in real.items() if k not in timings}
    assert real["peak_bytes"] > 0 and real["weights_bytes"] > 0
    request = VerifyRequest(config=config, model_name="tiny", mode=Mode.SIMULATE, scenario=values)
    assert verify.plan_run(request).refusal is None
