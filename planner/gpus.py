"""The GPUs the planner knows: memory capacity, peak dense throughput and bandwidths,
as the step-time model (planner.step_time) and the fit finder (planner.fit) read them.

Capacities are what `nvidia-smi` reports (memory.total, MiB), not the marketing "GB", so a
plan that fits here fits the driver's total. Throughputs are the vendors' published dense
(no 2:4 sparsity) peaks, in FLOP/s:
- `bf16_flops`: 16-bit tensor-core peak with fp32 accumulation (what autocast and pure
  bf16 training run their matmuls at).
- `supports_bf16`: whether the tensor cores take bf16 (Ampere and later). Turing (T4) has
  fp16 tensor cores only: bf16 there falls back to slow paths, so plans on it use fp16.
- `fp32_flops`: plain FP32 (CUDA cores). PyTorch leaves TF32 off for matmuls by default
  (torch.backends.cuda.matmul.allow_tf32 = False since 1.12), so fp32 training runs at this.
Sources (datasheets / whitepapers):
  T4:       NVIDIA T4 datasheet: 8.1 TFLOPS FP32, 65 TFLOPS FP16 tensor (Turing has no
            bf16 tensor cores: the 16-bit figure is fp16's; bf16 falls back to slower paths),
            320 GB/s GDDR6, PCIe Gen3 x16.
  L4:       NVIDIA L4 datasheet: 30.3 TFLOPS FP32, 242 TFLOPS BF16 with sparsity -> 121 dense,
            300 GB/s, PCIe Gen4 x16.
  A10:      NVIDIA A10 datasheet: 31.2 TFLOPS FP32, 125 TFLOPS BF16 dense, 600 GB/s, PCIe Gen4.
  RTX 4090: NVIDIA Ada Lovelace architecture whitepaper (appendix A): 82.6 TFLOPS FP32,
            165.2 TFLOPS FP16/BF16 tensor with FP32 accumulate (dense), 1008 GB/s, PCIe Gen4.
  A100:     NVIDIA A100 datasheet: 19.5 TFLOPS FP32, 312 TFLOPS BF16 dense, 1,555 GB/s
            (40 GB) / 2,039 GB/s (80 GB SXM), NVLink 600 GB/s (both directions).
  H100 SXM: NVIDIA H100 datasheet: 67 TFLOPS FP32, 989 TFLOPS BF16 dense (1,979 sparse),
            3.35 TB/s HBM3, NVLink 900 GB/s (both directions).
  H200 SXM: NVIDIA H200 datasheet: 67 TFLOPS FP32, 989 TFLOPS BF16 dense, 4.8 TB/s HBM3e,
            NVLink 900 GB/s.
`link_bytes_per_s` is the per-direction bandwidth one GPU has to its peers for a ring
all-reduce: half the bidirectional NVLink figure, or PCIe's per-direction rate
(Gen3 x16 ~16 GB/s, Gen4 x16 ~32 GB/s) for cards without NVLink.
`compute_capability` (major, minor) is what `cudaDeviceProp.major/.minor` report, the
key torch's CUDA code branches on (planner.cuda_overheads reads it for the cuBLAS
workspace size). Source: NVIDIA's compute capability table,
https://developer.nvidia.com/cuda-gpus (T4 7.5 Turing; A100 8.0 and A10 8.6 Ampere;
L4 and RTX 4090 8.9 Ada Lovelace; H100 and H200 9.0 Hopper). None: not known.
"""

from __future__ import annotations

from dataclasses import dataclass

from planner.errors import PlannerInputError
from planner.units import MIB

TERA = 10**12
GIGA = 10**9
MAX_GPU_GIB = float(1 << 20)  # 1 PiB per GPU: thousands of times any GPU, and bytes stay finite


def capacity_bytes_from_gib(value: object, what: str = "GPU memory") -> int:
    """Bytes of a user-given GPU size in GiB (a number or its text); one-line error otherwise."""
    try:
        gib = float(value) if not isinstance(value, bool) else float("nan")
    except (TypeError, ValueError, OverflowError):
        gib = float("nan")
    if not 0 < gib <= MAX_GPU_GIB:  # also false for NaN
        raise PlannerInputError(f"{what} must be a positive number of GiB, at most {MAX_GPU_GIB:,.0f}, "
                                f"got {str(value)[:40]!r}")
    return round(gib * 2**30)


@dataclass(frozen=True)
class GpuSpec:
    key: str  # CLI name, e.g. "a100-80gb"
    label: str  # display name
    capacity_bytes: int
    bf16_flops: float  # FLOP/s, dense 16-bit tensor-core peak
    fp32_flops: float  # FLOP/s, dense FP32 (non-tensor-core) peak
    hbm_bytes_per_s: float
    link_bytes_per_s: float  # per direction, to peers (NVLink or PCIe)
    supports_bf16: bool = True  # bf16 tensor cores; False: 16-bit means fp16 (bf16_flops is fp16's peak)
    compute_capability: tuple[int, int] | None = None  # (major, minor), as cudaDeviceProp reports it

    def __post_init__(self) -> None:
        for name in ("capacity_bytes", "bf16_flops", "fp32_flops", "hbm_bytes_per_s", "link_bytes_per_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"GpuSpec.{name} must be positive, got {getattr(self, name)!r}")
        cc = self.compute_capability
        if cc is not None and not (isinstance(cc, tuple) and len(cc) == 2
                                   and all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in cc)
                                   and cc[0] >= 1):
            raise ValueError(f"GpuSpec.compute_capability must be (major, minor) integers, got {cc!r}")


GPUS: dict[str, GpuSpec] = {g.key: g for g in (
    GpuSpec("t4", "T4 16 GB", 15360 * MIB, 65 * TERA, 8.1 * TERA, 320 * GIGA, 16 * GIGA, supports_bf16=False,
            compute_capability=(7, 5)),
    GpuSpec("l4", "L4 24 GB", 23034 * MIB, 121 * TERA, 30.3 * TERA, 300 * GIGA, 32 * GIGA,
            compute_capability=(8, 9)),
    GpuSpec("a10", "A10 24 GB", 23028 * MIB, 125 * TERA, 31.2 * TERA, 600 * GIGA, 32 * GIGA,
            compute_capability=(8, 6)),
    GpuSpec("rtx4090", "RTX 4090 24 GB", 24564 * MIB, 165.2 * TERA, 82.6 * TERA, 1008 * GIGA, 32 * GIGA,
            compute_capability=(8, 9)),
    GpuSpec("a100-40gb", "A100 40 GB", 40960 * MIB, 312 * TERA, 19.5 * TERA, 1555 * GIGA, 300 * GIGA,
            compute_capability=(8, 0)),
    GpuSpec("a100-80gb", "A100 80 GB", 81920 * MIB, 312 * TERA, 19.5 * TERA, 2039 * GIGA, 300 * GIGA,
            compute_capability=(8, 0)),
    GpuSpec("h100", "H100 SXM 80 GB", 81559 * MIB, 989 * TERA, 67 * TERA, 3350 * GIGA, 450 * GIGA,
            compute_capability=(9, 0)),
    GpuSpec("h200", "H200 SXM 141 GB", 143771 * MIB, 989 * TERA, 67 * TERA, 4800 * GIGA, 450 * GIGA,
            compute_capability=(9, 0)),
)}


def gpu_spec(key: str) -> GpuSpec:
    text = str(key).strip().lower()
    if text not in GPUS:
        raise PlannerInputError(f"unknown GPU {key!r}: choose one of {', '.join(GPUS)}")
    return GPUS[text]


def nearest_gpu(capacity_bytes: int) -> GpuSpec:
    """The known GPU whose capacity is closest to `capacity_bytes`: the throughput to
    assume when only a memory size is given (ties go to the slower, earlier row)."""
    return min(GPUS.values(), key=lambda g: abs(g.capacity_bytes - capacity_bytes))


def gpu_from_text(value: object) -> tuple[GpuSpec | None, int]:
    """(the known GPU, its capacity in bytes) for a planner.gpus key, or (None, bytes) for a
    size in GiB; one-line error otherwise."""
    text = str(value).strip().lower()
    if text in GPUS:
        return GPUS[text], GPUS[text].capacity_bytes
    try:
        float(text)
    except ValueError:
        raise PlannerInputError(f"unknown GPU {str(value)[:40]!r}: give a size in GiB or one of "
                                f"{', '.join(GPUS)}") from None
    return None, capacity_bytes_from_gib(text, "GPU memory")
