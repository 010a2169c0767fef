"""On a machine with a CUDA GPU: do planner.probe.fake_cuda's choices match torch's own?

Three checks, each printing one line per case and exiting 1 on any mismatch
(docs/cuda_kernels.md, section 5):
  1. backend: torch._fused_sdp_choice on real CUDA tensors against select_sdp_backend;
  2. saved tensors of one SDPA call and one dropout, real CUDA against fake + cuda_kernels;
  3. (with --steps) tiny Llama / GPT-2 training steps: torch.cuda.max_memory_allocated
     against the simulated step on this GPU's kernels, both printed with their difference.

    python scripts/check_fake_cuda_on_gpu.py [--steps]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from planner.probe.fake_cuda import (
    Backend,
    CudaGpu,
    SdpParams,
    cuda_kernels,
    saved_during,
    select_sdp_backend,
)

B, H, S = 2, 8, 256
# (label, dtype, head_dim, kv_heads, s_k, mask, dropout, enable_gqa)
CASES = [
    ("bf16 causal", torch.bfloat16, 64, H, S, False, 0.0, False),
    ("bf16 causal dropout", torch.bfloat16, 64, H, S, False, 0.1, False),
    ("bf16 masked", torch.bfloat16, 64, H, S, True, 0.0, False),
    ("fp32 causal", torch.float32, 64, H, S, False, 0.0, False),
    ("fp32 GQA enable_gqa", torch.float32, 64, 2, S, False, 0.0, True),
    ("bf16 GQA enable_gqa", torch.bfloat16, 128, 2, S, False, 0.0, True),
    ("bf16 head dim 288", torch.bfloat16, 288, H, S, False, 0.0, False),
    ("bf16 head dim 36 masked", torch.bfloat16, 36, H, S, True, 0.0, False),
    ("fp32 head dim 30", torch.float32, 30, H, S, False, 0.0, False),
    ("bf16 causal s_k != s_q", torch.bfloat16, 64, H, S + 64, False, 0.0, False),
]


def _tensors(device, dtype, head_dim, kv_heads, s_k, mask):
    q = torch.randn(B, H, S, head_dim, device=device, dtype=dtype, requires_grad=True)
    k = torch.randn(B, kv_heads, s_k, head_dim, device=device, dtype=dtype, requires_grad=True)
    v = torch.randn(B, kv_heads, s_k, head_dim, device=device, dtype=dtype, requires_grad=True)
    attn_mask = torch.ones(B, 1, S, s_k, device=device, dtype=torch.bool) if mask else None
    return q, k, v, attn_mask


def this_gpu() -> CudaGpu:
    major, minor = torch.cuda.get_device_capability()
    version = torch.version.cuda.split(".")
    return CudaGpu(torch.cuda.get_device_name(), major, minor, cudnn_version=torch.backends.cudnn.version(),
                   cuda_version=int(version[0]) * 1000 + int(version[1]) * 10)


def check_backends(gpu: CudaGpu) -> int:
    failures = 0
    for label, dtype, head_dim, kv_heads, s_k, mask, dropout, gqa in CASES:
        q, k, v, attn_mask = _tensors("cuda", dtype, head_dim, kv_heads, s_k, mask)
        causal = not mask
        real = Backend(torch._fused_sdp_choice(q, k, v, attn_mask, dropout, causal, enable_gqa=gqa))
        ours = select_sdp_backend(SdpParams(q, k, v, attn_mask, dropout, causal, gqa), gpu)
        failures += real is not ours
        verdict = "ok" if real is ours else "MISMATCH"
        print(f"backend  {label:28s} torch {real.name:9s} fake_cuda {ours.name:9s} {verdict}")
    return failures


def _saved(fn):
    return sorted(saved_during(fn), key=str)


def _sdpa_saved(device, case):
    _, dtype, head_dim, kv_heads, s_k, mask, dropout, gqa = case
    q, k, v, attn_mask = _tensors(device, dtype, head_dim, kv_heads, s_k, mask)
    return _saved(lambda: torch.nn.functional.scaled_dot_product_attention(
        q, k, v, attn_mask=attn_mask, dropout_p=dropout, is_causal=not mask, enable_gqa=gqa))


def check_saved(gpu: CudaGpu) -> int:
    from torch._subclasses.fake_tensor import FakeTensorMode

    failures = 0
    for case in CASES:
        label = case[0]
        real = _sdpa_saved("cuda", case)
        with FakeTensorMode(), cuda_kernels(gpu):
            fake = _sdpa_saved("cpu", case)
        failures += real != fake
        print(f"saved    {label:28s} {'ok' if real == fake else f'MISMATCH torch {real} fake_cuda {fake}'}")
    x = torch.randn(B, S, 64, device="cuda", requires_grad=True)
    real = _saved(lambda: torch.nn.functional.dropout(x, 0.1))
    with FakeTensorMode(), cuda_kernels(gpu):
        fake_x = torch.empty(B, S, 64, requires_grad=True)
        fake = _saved(lambda: torch.nn.functional.dropout(fake_x, 0.1))
    failures += real != fake
    print(f"saved    {'dropout':28s} {'ok' if real == fake else f'MISMATCH torch {real} fake_cuda {fake}'}")
    return failures


def check_steps(gpu: CudaGpu) -> None:
    from runners.measure import measure_in_process
    from runners.request import Mode
    from runners.simulate_measure import simulate_step
    from tests.conftest import tiny_config

    for name in ("tiny-llama", "tiny-gpt2"):
        for precision in ("fp32", "bf16-mixed"):
            scenario = {"task": "causal-lm", "batch_size": 4, "seq_len": 256, "device": "cuda", "precision": precision}
            real = measure_in_process(tiny_config(name), name, scenario, Mode.CUDA)["measured"]["peak_bytes"]
            simulated = simulate_step(tiny_config(name), {**scenario, "device": "cpu"}, gpu)["peak_bytes"]
            print(f"step     {name} {precision:10s} cuda {real:>12,} simulated {simulated:>12,} "
                  f"difference {real - simulated:>+10,} (512 B rounding and host-side tensors not applied)")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", action="store_true", help="also compare whole training steps")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("no CUDA device: nothing to check", file=sys.stderr)
        return 2
    gpu = this_gpu()
    print(f"{gpu.name} {gpu.arch} cuDNN {gpu.cudnn_version} CUDA {gpu.cuda_version} torch {torch.__version__}")
    failures = check_backends(gpu) + check_saved(gpu)
    if args.steps:
        check_steps(gpu)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
