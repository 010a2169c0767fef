"""CUDA's kernel choices on fake CPU tensors (planner.probe.fake_cuda), checked against facts
that do not come from the code under test: the shapes the CUDA attention kernels' meta
functions give, the sizes of dropout masks, the rules of sdp_utils.cpp as stated there, and
whole training steps whose CPU and CUDA peaks must differ by exactly those terms.
docs/cuda_kernels.md says what was read from source and what is still to be measured."""

import math
import subprocess
import sys

import pytest
import torch
from conftest import tiny_config
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.nn.attention import SDPBackend, sdpa_kernel

from planner.probe.fake_cuda import (
    Backend,
    CudaGpu,
    SdpParams,
    cuda_kernels,
    refusal,
    resolve_gpu,
    saved_during,
    select_sdp_backend,
)
from planner.probe.fake_mode import simulation
from planner.probe.memtracker import TrainableMemTracker
from runners.simulate_measure import simulate_step

B, H, S, D = 2, 4, 24, 32




def _attention(dtype, dropout_p, gpu=None, s=S, kv_heads=H, enable_gqa=False):
    """Saved tensors of one causal SDPA call on fake tensors, and the backends chosen."""
    with FakeTensorMode(), cuda_kernels(gpu) if gpu else _no_choices() as choices:
        q = torch.empty(B, H, s, D, dtype=dtype, requires_grad=True)
        kv = torch.empty(B, kv_heads, s, D, dtype=dtype, requires_grad=True)
        saved = saved_during(lambda: torch.nn.functional.scaled_dot_product_attention(
            q, kv, kv, dropout_p=dropout_p, is_causal=True, enable_gqa=enable_gqa))
    return saved, getattr(choices, "attention", None)


class _no_choices:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


def test_fake_cuda_tensors_cannot_run_autograd_on_a_cpu_only_build():
    """The first thing tried: fake tensors on device "cuda". On a CPU-only build the first
    op that records a gradient edge aborts the process (no CUDA device guard is registered:
    c10::impl::getDeviceGuardImpl, called from autograd's InputMetadata), so fake CUDA
    tensors cannot carry a training step here (docs/cuda_kernels.md)."""
    if torch.cuda._is_compiled():
        pytest.skip("a CUDA build registers a CUDA device guard")
    code = ("import torch\nfrom torch._subclasses.fake_tensor import FakeTensorMode\n"
            "with FakeTensorMode():\n"
            "    x = torch.empty(2, 3, device='cuda', requires_grad=True)\n"
            "    torch.nn.functional.linear(x, torch.empty(4, 3, device='cuda'))\n")
    done = subprocess.run([sys.executable, "-c", code], check=False, capture_output=True, text=True, timeout=120)
    assert done.returncode != 0
    assert "PyTorch is not linked with support for cuda devices" in done.stderr
    assert "getDeviceGuardImpl" in done.stderr


def test_flash_saves_a_logsumexp_where_the_cpu_math_path_saves_scores():
    cpu_saved, _ = _attention(torch.bfloat16, 0.1)
    # CPU SDPA with dropout is the math kernel: softmax output, dropout noise, dropped weights.
    assert sum(1 for shape, _ in cpu_saved if shape[-2:] == (S, S) and math.prod(shape) == B * H * S * S) == 3
    cuda_saved, backends = _attention(torch.bfloat16, 0.1, gpu="sm90")
    assert backends == [Backend.FLASH]
    # _scaled_dot_product_flash_attention's meta: a (b, h, s) fp32 log-sum-exp, philox
    # seed (2 x uint64) and offset (uint64); no score matrix of any shape.
    assert ((B, H, S), torch.float32) in cuda_saved
    assert ((2,), torch.uint64) in cuda_saved and ((), torch.uint64) in cuda_saved
    assert not any(shape[-2:] == (S, S) for shape, _ in cuda_saved)


def test_memory_efficient_attention_pads_its_logsumexp_to_32_rows():
    saved, backends = _attention(torch.float32, 0.0, gpu="sm90", s=40)
    assert backends == [Backend.EFFICIENT]  # flash takes fp16/bf16 only
    assert ((B, H, math.ceil(40 / 32) * 32), torch.float32) in saved  # meta__scaled_dot_product_efficient_attention


def test_cudnn_attention_saves_a_four_dimensional_logsumexp_when_preferred():
    gpu = CudaGpu("H100 with cuDNN 9.16", 9, 0, cudnn_version=91600)  # check_prefer_cudnn_attention: > 9.15.0
    with FakeTensorMode(), cuda_kernels(gpu) as choices:
        q = torch.empty(B, H, S, 64, dtype=torch.bfloat16, requires_grad=True)
        saved = saved_during(lambda: torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True))
    assert choices.attention == [Backend.CUDNN]
    assert ((B, H, S, 1), torch.float32) in saved


def test_dropout_mask_is_one_byte_per_element_on_cuda():
    def dropout_masks(gpu):
        with FakeTensorMode(), cuda_kernels(gpu) if gpu else _no_choices():
            x = torch.empty(B, S, D, requires_grad=True)
            return saved_during(lambda: torch.nn.Dropout(0.1)(x))

    assert dropout_masks(None) == [((B, S, D), torch.float32)]  # _dropout_impl's noise, the input's dtype
    assert dropout_masks("sm90") == [((B, S, D), torch.bool)]  # native_dropout's mask


def test_bytes_counted_equal_the_attention_kernels_outputs():
    """MemTracker's count for one flash call is the meta kernel's outputs, byte for byte:
    output (b, h, s, d) bf16, log-sum-exp (b, h, s) fp32, philox seed 16 B and offset 8 B."""
    with FakeTensorMode(), cuda_kernels("sm90"):
        q = torch.empty(B, H, S, D, dtype=torch.bfloat16, requires_grad=True)
        tracker = TrainableMemTracker()
        with tracker:
            before = sum(snap["Total"] for snap in tracker.get_tracker_snapshot("current").values())
            out = torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True)
            after = sum(snap["Total"] for snap in tracker.get_tracker_snapshot("current").values())
        assert out.grad_fn is not None
    assert after - before == B * H * S * D * 2 + B * H * S * 4 + 16 + 8


def _params(dtype=torch.bfloat16, head_dim=64, kv_heads=H, s_k=S, mask=False, dropout=0.0, is_causal=True,
            enable_gqa=False, requires_grad=True):
    q = torch.empty(B, H, S, head_dim, dtype=dtype, device="meta", requires_grad=requires_grad)
    kv = torch.empty(B, kv_heads, s_k, head_dim, dtype=dtype, device="meta", requires_grad=requires_grad)
    attn_mask = torch.ones(B, 1, S, s_k, dtype=torch.bool, device="meta") if mask else None
    return SdpParams(q, kv, kv, attn_mask, dropout, is_causal and not mask, enable_gqa)


T4 = CudaGpu("T4", 7, 5)
CUDNN_H100 = CudaGpu("H100, cuDNN 9.16", 9, 0, cudnn_version=91600)

# (id, gpu, params, expected backend, {backend tried before it: the filter that refuses}).
# Each row restates one rule of sdp_utils.cpp (filter names are its function names).
SELECTION = [
    ("bf16 unmasked causal: flash first", "sm90", _params(), Backend.FLASH, {}),
    ("a mask rules out flash", "sm90", _params(mask=True), Backend.EFFICIENT,
     {Backend.FLASH: "check_for_attn_mask"}),
    ("fp32 rules out flash", "sm90", _params(dtype=torch.float32), Backend.EFFICIENT,
     {Backend.FLASH: "check_dtypes_flash_attention"}),
    ("flash takes GQA with enable_gqa", "sm90", _params(kv_heads=2, enable_gqa=True), Backend.FLASH, {}),
    ("torch 2.13's memory-efficient kernel refuses GQA", "sm90",
     _params(dtype=torch.float32, kv_heads=2, enable_gqa=True), Backend.MATH,
     {Backend.FLASH: "check_dtypes_flash_attention",
      Backend.EFFICIENT: "mem_efficient_batch_size_and_num_heads_dense"}),
    ("head dim above 256 rules out flash", "sm90", _params(head_dim=288), Backend.EFFICIENT,
     {Backend.FLASH: "check_head_dim_size_flash"}),
    ("sm86 cannot train flash at head dim 200", "sm86", _params(head_dim=200), Backend.EFFICIENT,
     {Backend.FLASH: "check_requires_grad_and_head_dim_gt192_constraints_on_sm86_89_or_120"}),
    ("sm86 runs head dim 200 flash without gradients", "sm86", _params(head_dim=200, requires_grad=False),
     Backend.FLASH, {}),
    ("causal with s_q != s_k rules out flash", "sm90", _params(s_k=S + 8), Backend.EFFICIENT,
     {Backend.FLASH: "check_flash_causal_non_square_seqlens"}),
    ("fp32 head dim not a multiple of 4 rules out memory-efficient", "sm90", _params(dtype=torch.float32, head_dim=30),
     Backend.MATH, {Backend.EFFICIENT: "check_head_dim_size_mem_efficient"}),
    ("bf16 head dim not a multiple of 8 rules out memory-efficient", "sm90", _params(head_dim=36, mask=True),
     Backend.MATH, {Backend.FLASH: "check_for_attn_mask", Backend.EFFICIENT: "check_head_dim_size_mem_efficient"}),
    ("sm75 has no flash and no bf16 memory-efficient", T4, _params(), Backend.MATH,
     {Backend.FLASH: "check_flash_attention_hardware_support", Backend.EFFICIENT: "check_dtypes_mem_efficient"}),
    ("sm75 runs fp16 memory-efficient", T4, _params(dtype=torch.float16), Backend.EFFICIENT,
     {Backend.FLASH: "check_flash_attention_hardware_support"}),
    ("cuDNN first when preferred", CUDNN_H100, _params(), Backend.CUDNN, {}),
    ("cuDNN dropout needs a multiple of 1/16", CUDNN_H100, _params(dropout=0.1), Backend.FLASH,
     {Backend.CUDNN: "check_cudnn_dropout"}),
    ("cuDNN takes dropout 1/8", CUDNN_H100, _params(dropout=0.125), Backend.CUDNN, {}),
    ("cuDNN head dim must be a multiple of 8", CUDNN_H100, _params(head_dim=60), Backend.FLASH,
     {Backend.CUDNN: "check_cudnn_tensor_shapes"}),
    ("cuDNN 9.10 is not preferred: flash first", "sm90", _params(head_dim=64), Backend.FLASH, {}),
]


@pytest.mark.parametrize("gpu,params,expected,refused", [row[1:] for row in SELECTION],
                         ids=[row[0] for row in SELECTION])
def test_backend_choice_follows_the_rules_of_sdp_utils(gpu, params, expected, refused):
    gpu = resolve_gpu(gpu)
    assert select_sdp_backend(params, gpu) is expected
    assert refusal(expected, params, gpu) is None
    for backend, filter_name in refused.items():
        assert refusal(backend, params, gpu) == filter_name


def test_a_user_backend_choice_is_honoured():
    params = _params()
    with sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION]):  # check_runtime_disabled_flash
        assert select_sdp_backend(params, "sm90") is Backend.EFFICIENT
    assert select_sdp_backend(params, "sm90") is Backend.FLASH


def test_autocast_takes_the_cuda_op_lists():
    def dtypes(gpu):
        with FakeTensorMode(), cuda_kernels(gpu) if gpu else _no_choices():
            x = torch.empty(3, 8, dtype=torch.bfloat16, requires_grad=True)
            w = torch.empty(8, 8, requires_grad=True)
            with torch.autocast("cpu", dtype=torch.bfloat16):
                return [t.dtype for t in (torch.pow(x, 3.0), x.exp(), torch.softmax(x, -1), x.sum(),
                                          torch.nn.functional.layer_norm(x, (8,)),
                                          torch.nn.functional.linear(x.float(), w))]

    bf16, fp32 = torch.bfloat16, torch.float32
    assert dtypes(None) == [bf16, bf16, bf16, bf16, bf16, bf16]  # AutocastCPU: only linear is listed here
    assert dtypes("sm90") == [fp32, fp32, fp32, fp32, fp32, bf16]  # AT_FORALL_FP32 / _SET_OPT_DTYPE


def test_everything_is_restored_on_exit():
    from torch.optim.optimizer import _default_to_fused_or_foreach

    fake = FakeTensorMode()
    with fake:
        params = [torch.nn.Parameter(torch.empty(4, 4))]
    with simulation(fake, "sm90") as choices:
        assert _default_to_fused_or_foreach(params, False) == (False, True)  # CUDA's default: foreach
        torch.nn.functional.scaled_dot_product_attention(*[torch.empty(B, H, S, D, dtype=torch.bfloat16)] * 3)
    assert choices.attention == [Backend.FLASH]
    with simulation(fake) as nothing:
        assert nothing is None
        assert _default_to_fused_or_foreach(params, False) == (False, False)
        x = torch.empty(B, S, D, requires_grad=True)
        assert saved_during(lambda: torch.nn.functional.dropout(x, 0.1)) == [((B, S, D), torch.float32)]


# Whole training steps (the simulate runner's accelerate loop, MemTracker over fake tensors),
# CPU kernels against sm90 kernels. The backward phase peaks at its start, where every saved
# tensor is alive, so the two differ by exactly the saved tensors the kernels differ in. (The
# optimizer step differs too: CUDA's foreach AdamW holds temporaries for all tensors at once.)
STEP_BATCH, STEP_SEQ = 2, 64
NO_DROPOUT_GPT2 = {"attn_pdrop": 0.0, "resid_pdrop": 0.0, "embd_pdrop": 0.0}


def _peaks(name, extra, precision, gpu):
    config = {**tiny_config(name), **extra}
    scenario = {"task": "causal-lm", "batch_size": STEP_BATCH, "seq_len": STEP_SEQ, "device": "cpu",
                "precision": precision}
    measured = simulate_step(config, scenario, gpu)
    return measured["phase_peak_bytes"]["backward"], measured["peak_phase"], measured["attention_backends"]


def _heads_and_layers(name):
    config = tiny_config(name)
    return config.get("num_attention_heads", config.get("n_head")), config.get("num_hidden_layers",
                                                                                  config.get("n_layer"))


def test_llama_bf16_step_takes_flash_with_or_without_attention_dropout():
    _, layers = _heads_and_layers("tiny-llama")
    cpu, _, _ = _peaks("tiny-llama", {}, "bf16-mixed", None)
    cuda, _, backends = _peaks("tiny-llama", {}, "bf16-mixed", "sm90")
    assert set(backends) == {"flash"}
    # CPU's unmasked SDPA is flash too (same log-sum-exp); CUDA's flash adds philox seed and offset.
    assert cuda == cpu + layers * 24
    # Flash's dropout keeps only that philox state: no mask, no scores.
    cuda_dropout, _, _ = _peaks("tiny-llama", {"attention_dropout": 0.1}, "bf16-mixed", "sm90")
    assert cuda_dropout == cuda


def test_llama_fp32_step_with_attention_dropout_keeps_one_byte_masks():
    """fp32 grouped-query attention is the math kernel on both (torch 2.13's memory-efficient
    kernel refuses GQA); the only difference is the dropout mask: bool, not fp32."""
    heads, layers = _heads_and_layers("tiny-llama")
    extra = {"attention_dropout": 0.1}
    cpu, _, _ = _peaks("tiny-llama", extra, "fp32", None)
    cuda, _, backends = _peaks("tiny-llama", extra, "fp32", "sm90")
    assert set(backends) == {"math"}
    assert cpu - cuda == layers * STEP_BATCH * heads * STEP_SEQ**2 * (4 - 1)


def test_gpt2_fp32_step_takes_memory_efficient_attention():
    _, layers = _heads_and_layers("tiny-gpt2")
    cpu, _, _ = _peaks("tiny-gpt2", NO_DROPOUT_GPT2, "fp32", None)
    cuda, _, backends = _peaks("tiny-gpt2", NO_DROPOUT_GPT2, "fp32", "sm90")
    assert set(backends) == {"efficient"}
    # s is a multiple of 32: the padded log-sum-exp equals the CPU flash one; + seed and offset (int64).
    assert cuda == cpu + layers * 16


def test_gpt2_fp32_step_with_dropout_drops_the_score_matrices_and_shrinks_the_masks():
    heads, layers = _heads_and_layers("tiny-gpt2")
    width = tiny_config("tiny-gpt2")["n_embd"]
    cpu, _, _ = _peaks("tiny-gpt2", {}, "fp32", None)
    cuda, _, backends = _peaks("tiny-gpt2", {}, "fp32", "sm90")
    assert set(backends) == {"efficient"}
    scores = STEP_BATCH * heads * STEP_SEQ**2 * 4
    # Per layer the CPU math kernel saves softmax output, dropout noise and dropped weights
    # (three fp32 score matrices) where memory-efficient attention saves its log-sum-exp
    # and 16 B of philox state; GPT-2's other five dropouts (embeddings, and per layer after
    # attention and after the MLP) keep bool masks instead of fp32 noise.
    attention = layers * (3 * scores - STEP_BATCH * heads * STEP_SEQ * 4 - 16)
    other_dropouts = (1 + 2 * layers) * STEP_BATCH * STEP_SEQ * width * (4 - 1)
    assert cpu - cuda == attention + other_dropouts


def test_the_probe_records_cuda_kernels_when_asked():
    """planner.probe.run.record_probes(..., gpu=...): the probe's recordings hold the CUDA
    kernels' storages (memory-efficient log-sum-exp, no score matrices) instead of the CPU's.
    fp32 GPT-2 with attention dropout: memory-efficient attention on sm90."""
    import json

    from planner.loading import model_shape_for_config
    from planner.probe import cache
    from planner.probe.run import PROBE_SIZES, layout_for, record_probes
    from planner.scenario import Task, scenario_from_values
    from planner.shapes_from_config import load_transformers_config

    config_dict = tiny_config("tiny-gpt2")  # attention dropout 0.1: CPU SDPA is the math kernel
    shape = model_shape_for_config(config_dict, Task.CAUSAL_LM)
    scenario = scenario_from_values(task="causal-lm", batch_size=2, seq_len=16, device="cpu")
    config = load_transformers_config(json.loads(shape.source_config), scenario.task, scenario.num_labels)
    layout = layout_for(config)
    heads = config_dict["n_head"]

    recordings = record_probes(config_dict, config, scenario, layout, cache.window_exceeded(shape, scenario),
                               gpu="sm90")
    for (b, s), recording in zip(PROBE_SIZES, recordings, strict=True):
        shapes = {size[0] for size in recording.sizes}
        # The CPU probe records (b, h, s, s) scores, noise and dropped weights here (the
        # math kernel, as test_flash_saves_a_logsumexp_where_the_cpu_math_path_saves_scores shows).
        assert not any(t is not None and t[-2:] == (s, s) for t in shapes)
        assert (b, heads, math.ceil(s / 32) * 32) in shapes


# fp16-mixed: accelerate autocasts it on a GPU, with a GradScaler, but runs it as fp32 on a CPU
# (Accelerator.__init__ turns native AMP on for fp16 only off the CPU). A step on CUDA's kernels
# takes the GPU's autocast (planner.probe.build.autocast_as_on_cuda); fp16 and bf16 are both
# 2-byte autocast dtypes under the same CUDA op lists (ATen/autocast_mode.h lists ops, not
# dtypes), so on a model whose code treats them alike the two steps hold the same bytes, and
# bf16-mixed steps were measured on an H200 (README "Measured on a GPU"). Before the fix a CUDA
# fp16-mixed plan held fp32's activations, in the probe and in the simulated step alike.


def test_a_simulated_cuda_fp16_mixed_step_autocasts_as_on_a_gpu():
    fp32, _, fp32_backends = _peaks("tiny-llama", {}, "fp32", "sm90")
    bf16, _, _ = _peaks("tiny-llama", {}, "bf16-mixed", "sm90")
    fp16, _, backends = _peaks("tiny-llama", {}, "fp16-mixed", "sm90")
    # Flash attention takes 16-bit inputs only: the fp32 step's grouped-query attention is the math kernel.
    assert set(backends) == {"flash"} and set(fp32_backends) == {"math"}
    assert fp16 == bf16 != fp32  # at this size autocast's weight copies outweigh the halved activations
    # On CPU kernels the step is a CPU run's, and accelerate runs fp16-mixed there as fp32.
    assert _peaks("tiny-llama", {}, "fp16-mixed", None)[0] == _peaks("tiny-llama", {}, "fp32", None)[0]


def test_a_cuda_fp16_mixed_plan_is_probed_under_autocast():
    from planner.estimate import estimate
    from planner.loading import model_shape_for_config
    from planner.probe import cache
    from planner.scenario import Task, scenario_from_values

    config = tiny_config("tiny-llama")
    shape = model_shape_for_config(config, Task.CAUSAL_LM, 2, "tiny-llama")

    def plan(precision):
        scenario = scenario_from_values(task="causal-lm", batch_size=2, seq_len=24, precision=precision,
                                        device="cuda")
        return scenario, estimate(shape, scenario)

    _, fp32 = plan("fp32")
    _, bf16 = plan("bf16-mixed")
    scenario, fp16 = plan("fp16-mixed")
    assert fp16.activations_bytes == bf16.activations_bytes != fp32.activations_bytes
    # Tables probed before the fix are not read: the class's key says it was autocast.
    assert cache.FP16_AUTOCAST in cache.technique_key(shape, scenario).split("|")

