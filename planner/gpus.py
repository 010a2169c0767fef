"""The GPUs the planner knows: memory capacity, peak dense throughput and bandwidths,
as the step-time model (planner.step_time) and the fit finder (planner.fit) read them.

Capacities are what `nvidia-smi` reports (memory.total, MiB; `rocm-smi` for the MI300X),
not the marketing "GB", so a plan that fits here fits the driver's total; the one exception,
the RTX 4060 Ti 16 GB, carries its datasheet figure and says so (`capacity_from_datasheet`). Throughputs are the vendors' published dense
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

Rows added for the cards people have (throughputs from the vendors' datasheets or
architecture whitepapers; where a datasheet gives only a sparse or no tensor figure, the
dense one is derived from the whitepaper's per-SM rate, and the row says so):
  RTX 4060:    NVIDIA RTX 4060 spec page: 15.11 TFLOPS FP32, 272 GB/s, PCIe Gen4 x8 (16 GB/s);
               16-bit tensor with FP32 accumulate, dense: the Ada whitepaper's GeForce rate,
               512 FLOP/clock/SM x 24 SMs x 2.46 GHz = 30.2 TFLOPS (derived).
  RTX 3060:    NVIDIA Ampere GA102 whitepaper rates for GA106: 12.74 TFLOPS FP32, 16-bit tensor
               FP32 accumulate dense 512 FLOP/clock/SM x 28 SMs x 1.777 GHz = 25.5 TFLOPS
               (derived), 360 GB/s, PCIe Gen4 x16.
  RTX 4060 Ti 16 GB: NVIDIA spec page: 22.06 TFLOPS FP32, 288 GB/s, PCIe Gen4 x8; tensor
               512 x 34 SMs x 2.535 GHz = 44.1 TFLOPS (derived).
  RTX 4080:    Ada Lovelace architecture whitepaper (appendix A): 48.7 TFLOPS FP32, 97.5
               TFLOPS FP16/BF16 tensor with FP32 accumulate (dense), 716.8 GB/s, PCIe Gen4.
  RTX 3090:    NVIDIA Ampere GA102 whitepaper (appendix A): 35.6 TFLOPS FP32, 71 TFLOPS
               FP16/BF16 tensor with FP32 accumulate (dense), 936 GB/s, PCIe Gen4 (NVLink
               bridges are rare: PCIe's rate is taken).
  V100 SXM2 16 GB: NVIDIA V100 datasheet: 15.7 TFLOPS FP32, 125 TFLOPS tensor (FP16 only:
               Volta has no bf16), 900 GB/s, NVLink 300 GB/s.
  V100 PCIe 32 GB: NVIDIA V100 datasheet: 14 TFLOPS FP32, 112 TFLOPS tensor (FP16), 900 GB/s,
               PCIe Gen3 x16.
  RTX A6000:   NVIDIA RTX A6000 datasheet: 38.7 TFLOPS FP32, 309.7 TFLOPS tensor with sparsity
               -> 154.8 dense, 768 GB/s, PCIe Gen4 x16.
  L40S:        NVIDIA L40S datasheet: 91.6 TFLOPS FP32, 733 TFLOPS BF16 with sparsity -> 362
               dense, 864 GB/s, PCIe Gen4 x16.
  MI300X:      AMD Instinct MI300X datasheet: 163.4 TFLOPS FP32 matrix / 81.7 vector (the
               vector figure is taken, as for the CUDA cores), 1,307.4 TFLOPS BF16 dense,
               5.3 TB/s HBM3, Infinity Fabric 128 GB/s per link (64 GB/s each way) x 7 peers.
               ROCm, not CUDA: `runtime` says so, and planner.cuda_overheads labels its
               CUDA figures as stand-ins for it. Its compute capability is None (a gfx942,
               not an sm_ number).

Capacity sources (`capacity_source`; `capacity_from_datasheet` is True where only the
datasheet's GB is known, taken as GiB: the driver's total is a little less, not sourced):
see each row. The T4, L4, A10, A100 and H100 totals came with the first rows and their
readings are not recorded here (the H100's is in planner.cuda_overheads).
"""

from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass

from planner.errors import PlannerInputError
from planner.scenario import Device, Scenario, capability_text
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


class Runtime(enum.Enum):
    CUDA = "cuda"  # NVIDIA: the CUDA runtime and driver
    ROCM = "rocm"  # AMD: HIP on ROCm (torch's "cuda" device, but none of CUDA's figures)


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
    capacity_source: str | None = None  # where capacity_bytes comes from (URL or document); None: not recorded
    capacity_from_datasheet: bool = False  # True: the datasheet's GB, not a driver's reported total
    runtime: Runtime = Runtime.CUDA
    # Streaming multiprocessors, as cudaDeviceProp.multiProcessorCount reports them: the
    # datasheets' CUDA cores divided by the FP32 lanes per SM the CUDA C++ Programming Guide gives
    # for the compute capability (64 on 7.x and 8.0, 128 on 8.6, 8.9 and 9.0); the H200 read 132
    # through torch on a lent machine. Kernels size their grids, and so some of their scratch, by
    # it (planner.cuda_reduction, planner.embedding_scratch). None: not known.
    multiprocessors: int | None = None

    def __post_init__(self) -> None:
        for name in ("capacity_bytes", "bf16_flops", "fp32_flops", "hbm_bytes_per_s", "link_bytes_per_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"GpuSpec.{name} must be positive, got {getattr(self, name)!r}")
        cc = self.compute_capability
        if cc is not None and not (isinstance(cc, tuple) and len(cc) == 2
                                   and all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in cc)
                                   and cc[0] >= 1):
            raise ValueError(f"GpuSpec.compute_capability must be (major, minor) integers, got {cc!r}")
        if self.capacity_from_datasheet and not self.capacity_source:
            raise ValueError("GpuSpec.capacity_from_datasheet needs capacity_source naming the datasheet")
        if self.runtime is not Runtime.CUDA and cc is not None:
            raise ValueError("GpuSpec.compute_capability is CUDA's: a non-CUDA GPU has None")
        sms = self.multiprocessors
        if sms is not None and (isinstance(sms, bool) or not isinstance(sms, int) or sms < 1):
            raise ValueError(f"GpuSpec.multiprocessors must be a positive integer, got {sms!r}")

    @property
    def capacity_basis(self) -> str:
        """How capacity_bytes was obtained, in words (for tables and captions)."""
        if self.capacity_from_datasheet:
            return "datasheet figure (not a driver's reported total)"
        if self.runtime is Runtime.ROCM:
            return "as rocm-smi reports it (VRAM Total Memory)"
        return "as nvidia-smi reports it (memory.total)"


_PUBLIC_SMI = "public nvidia-smi output on GitHub"
GPUS: dict[str, GpuSpec] = {g.key: g for g in (
    GpuSpec("rtx4060", "RTX 4060 8 GB", 8188 * MIB, 30.2 * TERA, 15.11 * TERA, 272 * GIGA, 16 * GIGA,
            compute_capability=(8, 9), multiprocessors=3072 // 128,
            capacity_source=f"{_PUBLIC_SMI}: NVIDIA GeForce RTX 4060, 115 W, driver 560.94, 8188MiB "
                            "(also seen on RTX 4060 Laptop GPUs)"),
    GpuSpec("rtx3060", "RTX 3060 12 GB", 12288 * MIB, 25.5 * TERA, 12.74 * TERA, 360 * GIGA, 32 * GIGA,
            compute_capability=(8, 6), multiprocessors=3584 // 128,
            capacity_source="https://github.com/geerlingguy/raspberry-pi-pcie-devices/issues/790 "
                            "(nvidia-smi, driver 580.95.05: 12288MiB)"),
    GpuSpec("t4", "T4 16 GB", 15360 * MIB, 65 * TERA, 8.1 * TERA, 320 * GIGA, 16 * GIGA, supports_bf16=False,
            compute_capability=(7, 5), multiprocessors=2560 // 64),
    GpuSpec("v100-16gb", "V100 SXM2 16 GB", 16160 * MIB, 125 * TERA, 15.7 * TERA, 900 * GIGA, 150 * GIGA,
            supports_bf16=False, compute_capability=(7, 0), multiprocessors=5120 // 64,
            capacity_source="https://github.com/4paradigm/k8s-vgpu-scheduler/issues/7 "
                            "(nvidia-smi, Tesla V100-SXM2, driver 440.64.00: 16160MiB)"),
    GpuSpec("rtx4060ti-16gb", "RTX 4060 Ti 16 GB", 16384 * MIB, 44.1 * TERA, 22.06 * TERA, 288 * GIGA, 16 * GIGA,
            compute_capability=(8, 9), multiprocessors=4352 // 128, capacity_from_datasheet=True,
            capacity_source="NVIDIA GeForce RTX 4060 Ti spec page: 16 GB GDDR6 (datasheet figure; no driver "
                            "reading sourced)"),
    GpuSpec("rtx4080", "RTX 4080 16 GB", 16376 * MIB, 97.5 * TERA, 48.7 * TERA, 716.8 * GIGA, 32 * GIGA,
            compute_capability=(8, 9), multiprocessors=9728 // 128,  # the 4080's (the SUPER's 10,240 cores: 80)
            capacity_source=f"{_PUBLIC_SMI}: 'NVIDIA GeForce RTX 4080 ...' (name cut off: a 4080 or 4080 SUPER, "
                            "both 16 GB), 320 W, driver 571.96, 16376MiB; RTX A4000 16 GB cards read the same"),
    GpuSpec("l4", "L4 24 GB", 23034 * MIB, 121 * TERA, 30.3 * TERA, 300 * GIGA, 32 * GIGA,
            compute_capability=(8, 9), multiprocessors=7424 // 128),
    GpuSpec("a10", "A10 24 GB", 23028 * MIB, 125 * TERA, 31.2 * TERA, 600 * GIGA, 32 * GIGA,
            compute_capability=(8, 6), multiprocessors=9216 // 128),
    GpuSpec("rtx4090", "RTX 4090 24 GB", 24564 * MIB, 165.2 * TERA, 82.6 * TERA, 1008 * GIGA, 32 * GIGA,
            compute_capability=(8, 9), multiprocessors=16384 // 128,
            capacity_source="https://github.com/RLinf/RLinf/issues/255 (nvidia-smi, driver 550.163.01: 24564MiB)"),
    GpuSpec("rtx3090", "RTX 3090 24 GB", 24576 * MIB, 71 * TERA, 35.6 * TERA, 936 * GIGA, 32 * GIGA,
            compute_capability=(8, 6), multiprocessors=10496 // 128,
            capacity_source="https://github.com/noonghunna/club-3090/issues/390 (nvidia-smi, driver 580.142: "
                            "24576MiB)"),
    GpuSpec("v100-32gb", "V100 PCIe 32 GB", 32480 * MIB, 112 * TERA, 14 * TERA, 900 * GIGA, 16 * GIGA,
            supports_bf16=False, compute_capability=(7, 0), multiprocessors=5120 // 64,
            capacity_source="NVIDIA's nvidia-smi walkthrough as reprinted at "
                            "https://blog.cachecha.com/csdn/kunhe0512/126265050.html (four Tesla V100-PCIE, "
                            "driver 410.48: 32480MiB)"),
    GpuSpec("a100-40gb", "A100 40 GB", 40960 * MIB, 312 * TERA, 19.5 * TERA, 1555 * GIGA, 300 * GIGA,
            compute_capability=(8, 0), multiprocessors=6912 // 64),
    GpuSpec("l40s", "L40S 48 GB", 46068 * MIB, 362 * TERA, 91.6 * TERA, 864 * GIGA, 32 * GIGA,
            compute_capability=(8, 9), multiprocessors=18176 // 128,
            capacity_source="https://github.com/akash-network/provider-configs/pull/99 (nvidia-smi "
                            "--query-gpu=memory.total, driver 595.71.05: 46068 MiB)"),
    GpuSpec("a6000", "RTX A6000 48 GB", 49140 * MIB, 154.8 * TERA, 38.7 * TERA, 768 * GIGA, 32 * GIGA,
            compute_capability=(8, 6), multiprocessors=10752 // 128,
            capacity_source=f"{_PUBLIC_SMI}: NVIDIA RTX A6000, 300 W, driver 590.48.01, 49140MiB"),
    GpuSpec("a100-80gb", "A100 80 GB", 81920 * MIB, 312 * TERA, 19.5 * TERA, 2039 * GIGA, 300 * GIGA,
            compute_capability=(8, 0), multiprocessors=6912 // 64),
    GpuSpec("h100", "H100 SXM 80 GB", 81559 * MIB, 989 * TERA, 67 * TERA, 3350 * GIGA, 450 * GIGA,
            compute_capability=(9, 0), multiprocessors=16896 // 128,
            capacity_source="https://github.com/vllm-project/vllm/issues/55169 (nvidia-smi memory.total 81559 MiB)"),
    GpuSpec("h200", "H200 SXM 141 GB", 143771 * MIB, 989 * TERA, 67 * TERA, 4800 * GIGA, 450 * GIGA,
            compute_capability=(9, 0), multiprocessors=132),
    GpuSpec("mi300x", "MI300X 192 GB", 196592 * MIB, 1307.4 * TERA, 81.7 * TERA, 5300 * GIGA, 448 * GIGA,
            runtime=Runtime.ROCM,
            capacity_source="https://github.com/ROCm/ROCm/issues/4750 (rocm-smi, MI300X: VRAM Total Memory "
                            "206141652992 B = 196592 MiB; the datasheet says 192 GB HBM3)"),
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


def capability_values(device: str, gpu: GpuSpec | None) -> dict:
    """The compute capability of `gpu` as planner.scenario.scenario_from_values takes it, for a
    plan on CUDA: the step takes that GPU's kernels (a T4 has no flash attention;
    planner.probe.cache.kernel_class). Empty on the CPU, for a size that names no GPU, and for
    a GPU without one (ROCm): those are planned on Ampere's kernels."""
    if device != "cuda" or gpu is None or gpu.compute_capability is None:
        return {}
    return {"compute_capability": capability_text(gpu.compute_capability)}


def scenario_on(scenario: Scenario, gpu: GpuSpec | None) -> Scenario:
    """`scenario` as it runs on `gpu`: with its compute capability (capability_values)."""
    capability = gpu.compute_capability if gpu is not None and scenario.device is Device.CUDA else None
    if scenario.compute_capability == capability:
        return scenario
    return dataclasses.replace(scenario, compute_capability=capability)
