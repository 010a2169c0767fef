"""CUDA plans take the kernels of their GPU's class (planner.probe.cache.kernel_class): a T4 or
V100 has no flash attention, and in torch 2.13 SDPA runs grouped-query attention there on the
math path, which keeps every layer's attention matrix. Checked against what fake_cuda's
transcription of sdp_utils.cpp selects per architecture, and against a whole step simulated on
each architecture's kernels (runners.simulate_measure.simulate_step)."""

import dataclasses
import itertools
from pathlib import Path

import pytest
import torch

from conftest import tiny_config
from planner.device_fit import plan_verdict
from planner.estimate import estimate
from planner.gpus import GPUS, scenario_on
from planner.loading import model_shape_for_config
from planner.probe import cache
from planner.probe.fake_cuda import Backend, CudaGpu, SdpParams, refusal
from planner.scenario import scenario_from_values
from runners.simulate_measure import simulate_step

APP = Path(__file__).resolve().parents[1] / "app.py"


def _params(dtype, heads_q, heads_kv, head_dim, mask, dropout, causal, grad) -> SdpParams:
    shape_q, shape_kv = (2, heads_q, 64, head_dim), (2, heads_kv, 64, head_dim)
    query = torch.empty(shape_q, dtype=dtype, requires_grad=grad)
    key, value = (torch.empty(shape_kv, dtype=dtype, requires_grad=grad) for _ in range(2))
    attn_mask = torch.zeros(2, 1, 64, 64, dtype=dtype) if mask else None
    return SdpParams(query, key, value, attn_mask, dropout, causal, heads_q != heads_kv)


GRID = [_params(dtype, heads_q, heads_kv, head_dim, mask, dropout, causal, grad)
        for dtype, (heads_q, heads_kv), head_dim, mask, dropout, causal, grad in itertools.product(
            (torch.float32, torch.float16, torch.bfloat16), ((8, 8), (8, 2)), (20, 64, 128, 200, 256),
            (False, True), (0.0, 0.1), (False, True), (False, True))]


def _choices(gpu: CudaGpu) -> list[tuple]:
    return [tuple(refusal(backend, p, gpu) is None for backend in (Backend.FLASH, Backend.EFFICIENT))
            for p in GRID]


@pytest.mark.parametrize("capabilities", [((7, 0), (7, 5)), ((8, 0), (9, 0), (10, 0), (11, 0)),
                                          ((8, 6), (8, 7), (8, 9), (12, 0), (12, 1))])
def test_one_class_selects_alike_on_every_call(capabilities):
    """Every architecture of a class lets the same fused kernels take every call of a grid of
    dtypes, grouped heads, head dimensions, masks, dropout, causality and gradients, by
    fake_cuda's filters (its transcription of sdp_utils.cpp): so one probe stands for all."""
    classes = {cache.kernel_class(c) for c in capabilities}
    assert len(classes) == 1
    first, *others = (CudaGpu(f"sm{a}{b}", a, b) for a, b in capabilities)
    for other in others:
        assert _choices(other) == _choices(first), other.arch


def test_the_classes_differ_where_the_filters_do():
    """sm75 against sm80: no flash at all; sm86 against sm80: flash refuses a backward with a
    head dimension over 192 only (the one call sm80's table must not have for sm86 to share it)."""
    sm75, sm80, sm86 = (CudaGpu(a, int(a[2]), int(a[3])) for a in ("sm75", "sm80", "sm86"))
    assert not any(flash for flash, _ in _choices(sm75)) and any(flash for flash, _ in _choices(sm80))
    differ = [p for p, a, b in zip(GRID, _choices(sm80), _choices(sm86)) if a != b]
    assert differ and all(p.query.size(-1) > cache.FLASH_HEAD_DIM_SM86 and p.requires_grad() for p in differ)
    assert [cache.kernel_class(GPUS[k].compute_capability) for k in ("t4", "v100-16gb", "a10", "l4", "a100-40gb",
                                                                     "h100", "h200")] == \
        ["sm75", "sm75", "sm86", "sm86", "sm80", "sm80", "sm80"]
    assert cache.kernel_class(None) == "sm80" and cache.kernel_class((6, 1)) == "sm61"


def _plan(name: str, precision: str, gpu_key: str | None, **more):
    values = dict(task="causal-lm", batch_size=2, seq_len=64, precision=precision, device="cuda", **more)
    scenario = scenario_from_values(**values)
    if gpu_key is not None:
        scenario = scenario_on(scenario, GPUS[gpu_key])
    shape = model_shape_for_config(tiny_config(name), scenario.task, 2, name)
    return shape, estimate(shape, scenario), values


@pytest.mark.parametrize("name, precision, math_on_t4", [
    ("tiny-llama", "fp16-mixed", True),  # 4 query heads, 2 key/value heads: flash on sm80, math before it
    ("tiny-gpt2", "fp16-mixed", False),  # multi-head: the memory-efficient kernel on a T4
    ("tiny-llama", "fp32", False),  # no flash in fp32: the math path on sm80 too
])
def test_a_t4_plan_is_the_step_simulated_on_a_t4(name, precision, math_on_t4):
    """The plan on a T4 against the whole step simulated with sm75's kernels (full depth, the
    lessons' loop); the A100's plan against sm80's. Where a T4 takes the math path the two
    plans differ by the attention matrices the T4 keeps."""
    _, on_t4, values = _plan(name, precision, "t4")
    _, on_a100, _ = _plan(name, precision, "a100-40gb")
    t4 = simulate_step(tiny_config(name), dict(values), gpu=CudaGpu("T4", 7, 5))
    a100 = simulate_step(tiny_config(name), dict(values), gpu="sm80")
    assert ("math" in t4["attention_backends"] and "math" not in a100["attention_backends"]) == math_on_t4
    for plan, simulated in ((on_t4, t4), (on_a100, a100)):
        assert abs(plan.peak_bytes - simulated["peak_bytes"]) <= 0.001 * simulated["peak_bytes"]
    if math_on_t4:  # at the end of the forward, at least one layer's 2 x 4 x 64 x 64 fp16 matrix more
        assert on_t4.activations_bytes - on_a100.activations_bytes >= 2 * 4 * 64 * 64 * 2
    else:
        assert on_t4.activations_bytes - on_a100.activations_bytes < 2 * 4 * 64 * 64 * 2
    assert "sm75's CUDA kernels (T4 and V100" in " ".join(on_t4.notes)


def test_a_v100_is_planned_as_a_t4():
    _, on_t4, _ = _plan("tiny-llama", "fp16-mixed", "t4")
    _, on_v100, _ = _plan("tiny-llama", "fp16-mixed", "v100-16gb")
    assert on_v100.peak_bytes == on_t4.peak_bytes


def test_an_sm86_plan_reads_sm80s_table_unless_a_head_is_over_192():
    """A tiny GPT-2 (head dimension 8) on an L4 reads the A100's table itself, no probe of its
    own; with head dimension 200 (flash on sm80, refused on sm86 for the backward) the L4 is
    probed on sm86's kernels, and its plan is the step simulated there."""
    shape, on_l4, _ = _plan("tiny-gpt2", "fp16-mixed", "l4")
    _, on_a100, _ = _plan("tiny-gpt2", "fp16-mixed", "a100-40gb")
    assert cache.probe_table(shape, on_l4.scenario) is cache.probe_table(shape, on_a100.scenario)
    assert on_l4.peak_bytes == on_a100.peak_bytes

    wide = dict(tiny_config("tiny-gpt2"), n_embd=400, n_head=2)  # head dimension 200
    scenario = scenario_on(scenario_from_values(task="causal-lm", batch_size=2, seq_len=64, precision="fp16-mixed",
                                                device="cuda"), GPUS["l4"])
    shape = model_shape_for_config(wide, scenario.task, 2, "wide-gpt2")
    ampere = cache.probe_table(shape, dataclasses.replace(scenario, compute_capability=(8, 0)))
    assert cache.flash_head_over_sm86_limit(ampere)
    own = cache.probe_table(shape, scenario)
    assert "cuda-kernels=sm86" in own.key
    values = dict(task="causal-lm", batch_size=2, seq_len=64, precision="fp16-mixed", device="cuda")
    simulated = simulate_step(wide, values, gpu="sm86")
    assert "efficient" in simulated["attention_backends"] and "flash" not in simulated["attention_backends"]
    assert abs(estimate(shape, scenario).peak_bytes - simulated["peak_bytes"]) <= 0.001 * simulated["peak_bytes"]


def test_a_verdict_on_another_gpus_kernels_is_refused():
    shape, on_a100, _ = _plan("tiny-llama", "fp16-mixed", None)
    with pytest.raises(ValueError, match="sm80's kernels and is judged on a T4"):
        plan_verdict(shape, on_a100, GPUS["t4"].capacity_bytes, GPUS["t4"])
    plan_verdict(shape, on_a100, GPUS["a100-40gb"].capacity_bytes, GPUS["a100-40gb"])  # its own: judged


def test_the_compute_capability_value():
    scenario = scenario_from_values(task="causal-lm", batch_size=1, seq_len=8, compute_capability="7.5")
    assert scenario.compute_capability == (7, 5)
    assert scenario_from_values(task="causal-lm", batch_size=1, seq_len=8, device="cpu",
                                compute_capability="7.5").compute_capability is None  # the CPU's kernels
    for bad in ("7", "seven", "7.5.1", True):
        with pytest.raises(Exception, match="compute capability must be"):
            scenario_from_values(task="causal-lm", batch_size=1, seq_len=8, compute_capability=bad)


def test_the_plan_page_on_a_t4_plans_the_t4s_step():
    """SmolLM2-135M (9 query heads, 3 key/value heads) in fp16 autocast on the default T4: the
    page's peak is the plan on sm75's kernels, larger than the A100's by the attention matrices."""
    from streamlit.testing.v1 import AppTest

    from planner.loading import load_model_shape
    from planner.units import format_bytes
    from views.inputs import DEFAULTS

    at = AppTest.from_file(str(APP), default_timeout=300).run()
    at.selectbox(key="catalog_model").set_value("smollm2-135m").run()
    at.selectbox(key="precision").set_value("fp16-mixed").run()
    assert not at.exception
    assert DEFAULTS["gpu_preset"].startswith("T4")
    values = dict(task="causal-lm", batch_size=DEFAULTS["batch_size"], seq_len=DEFAULTS["seq_len"],
                  precision="fp16-mixed", device="cuda")
    scenario = scenario_from_values(**values)
    shape = load_model_shape("smollm2-135m", scenario.task)
    on_t4 = estimate(shape, scenario_on(scenario, GPUS["t4"])).peak_bytes
    on_a100 = estimate(shape, scenario_on(scenario, GPUS["a100-40gb"])).peak_bytes
    assert on_t4 > on_a100
    peak = next(m.value for m in at.metric if m.label == "Peak")
    assert peak == format_bytes(on_t4)


def test_the_cli_plans_on_the_named_gpus_kernels(tmp_path, capsys):
    """`planner estimate --gpu t4` plans on sm75's kernels; a `planner batch` line may name a
    compute capability for a size in GiB, and one that contradicts its named GPU is refused."""
    import json

    from conftest import CONFIGS
    from planner.cli import main as planner_main

    config = str(CONFIGS / "tiny-llama.json")
    arguments = ["estimate", "--config", config, "--task", "causal-lm", "--batch-size", "2", "--seq-len", "64",
                 "--precision", "fp16-mixed", "--json"]
    assert planner_main([*arguments, "--gpu", "t4"]) == 0
    on_t4 = json.loads(capsys.readouterr().out)
    assert on_t4["scenario"]["compute_capability"] == "7.5"
    _, expected, _ = _plan("tiny-llama", "fp16-mixed", "t4")
    assert on_t4["peak_bytes"] == expected.peak_bytes
    assert planner_main([*arguments, "--gpu", "a100-40gb"]) == 0
    assert json.loads(capsys.readouterr().out)["activations_bytes"] < on_t4["activations_bytes"]

    line = dict(config=config, task="causal-lm", batch_size=2, seq_len=64, precision="fp16-mixed")
    batch = tmp_path / "plans.jsonl"
    batch.write_text("\n".join(json.dumps(line | extra) for extra in (
        {"gpu": "16", "compute_capability": "7.5"}, {"gpu": "t4", "compute_capability": "8.0"})) + "\n")
    assert planner_main(["batch", str(batch)]) == 0
    sized, contradicting = (json.loads(out) for out in capsys.readouterr().out.splitlines())
    assert sized["peak_bytes"] == on_t4["peak_bytes"]
    assert "is not the T4 16 GB's" in contradicting["error"]
