"""CUDA's kernel choices for a simulated step on a machine without a GPU.

A simulated step runs on fake CPU tensors, so every op takes the CPU kernel's path and
saves what the CPU kernel saves. `cuda_kernels(gpu)` makes four choices as torch 2.13
makes them for CUDA tensors on `gpu`, while the tensors stay fake CPU tensors (they cannot
be fake CUDA tensors on a CPU-only build: docs/cuda_kernels.md says why, with the torch
functions that refuse):

- Attention. `aten::scaled_dot_product_attention` (CompositeImplicitAutograd, so every
  caller reaches it, transformers' `sdpa_attention_forward` included) is replaced for the
  duration of the context by the CUDA branch of attention.cpp's `scaled_dot_product_attention`:
  the backend `select_sdp_backend` (aten/src/ATen/native/transformers/cuda/sdp_utils.cpp)
  would pick on `gpu`, transcribed below filter by filter, then that backend's own op
  (`_scaled_dot_product_flash_attention`, `_efficient_attention`, `_cudnn_attention` or
  `_scaled_dot_product_attention_math`) with attention.cpp's preprocessing (boolean masks
  made additive, the memory-efficient kernel's mask padding, flash's head-dim padding).
  Those ops' meta kernels (torch/_meta_registrations.py) give the outputs' exact shapes
  (flash: a (b, h, s) fp32 log-sum-exp; memory-efficient: (b, h, ceil(s/32)*32); cuDNN:
  (b, h, s, 1)), and autograd saves for backward what their derivative formulas
  (tools/autograd/derivatives.yaml) name: inputs, output, log-sum-exp, philox seed and
  offset, never the (b, h, s, s) scores the CPU math path keeps.
- Dropout. `aten::dropout` is replaced by `at::native::dropout`'s CUDA branch
  (aten/src/ATen/native/Dropout.cpp): when `is_fused_kernel_acceptable` (a CUDA input,
  0 < p < 1, numel > 0) it calls `native_dropout`, whose mask is bool (one byte per
  element); the CPU branch `_dropout_impl` multiplies by a noise tensor of the input's
  dtype. The math attention backend's own dropout goes through the same op.
- Autocast. A simulation runs accelerate's `autocast("cpu")`; for every op whose CUDA
  policy (torch 2.13.0's ATen/autocast_mode.h, AT_FORALL_*) differs from the CPU's
  (autocast_mode.cpp, AutocastCPU), the AutocastCPU kernel is replaced by the CUDA policy:
  exp, log, pow, rsqrt, layer_norm, rms_norm and the other fp32 ops cast to fp32;
  softmax, log_softmax, sum, cumsum and the norms get dtype=fp32 when none is given;
  einsum, mv, addmv and the RNN cells cast to the low-precision dtype; cross_entropy_loss,
  which the CPU casts whole, runs as it decomposes (log_softmax, nll_loss). Seen on a tiny
  GPT-2 in bf16-mixed: gelu_new's `torch.pow` makes its intermediates fp32 on CUDA.
- Optimizer defaults. `torch.optim`'s `_default_to_fused_or_foreach` picks foreach for
  CUDA parameters and the single-tensor loop for CPU ones; inside the context CPU counts
  as a foreach device, so AdamW, Adam and SGD built with the defaults take the foreach
  path (all tensors' temporaries at once) as they do on CUDA.

What this does not change (docs/cuda_kernels.md, "Remaining code-read assumptions"):
the CUDA-only low-precision casts (einsum and the rest) do not share autocast's cache of
weight casts (the ops both devices cast, linear and matmul among them, keep torch's
kernel and its cache); the CPU-only fp32 casts other than cross_entropy_loss (linalg, fft,
pooling, padding, prod; the promotion of cat and stack) are kept; storage sizes stay
exact element counts (MemTracker rounds CUDA storages to 512 B, the caching allocator's
block size; the allocator model is another module's); the philox seed and offset (24 B
per flash call, 16 B otherwise) are counted, where on a GPU they live in host memory; the
attention kernels' internal scratch (flash backward's fp32 dq accumulator, the
memory-efficient and cuDNN workspaces) is not made here: only what the ops return and
autograd saves is; the probe marks each fused backward (`attention_backward_call`: its
dimensions, and whether cuDNN's filters pass it on the reference build) and the allocator's
replay makes the scratch (planner.attention_scratch).

Known limitations: the selection reads torch 2.13's rules from source; the source read is
pytorch main at 001f694 (sdp_utils.cpp) with torch 2.13.0's installed sdp_utils_cpp.h,
and where main has moved past 2.13 (memory-efficient GQA) the 2.13 rule is kept.
FlashAttention-3 (opt-in, `userEnabledFA3SDP`), nested tensors and ROCm are not modelled.
Whole steps were recorded on an H200 under torch 2.11 (docs/cuda_kernels.md, sections 4 and
4b): what else CUDA's path does is taken by planner.probe.memtracker and planner.probe.recorder.
"""

from __future__ import annotations

import contextlib
import enum
import math
import re
import warnings
from dataclasses import dataclass

import torch
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils._python_dispatch import TorchDispatchMode

from planner import attention_scratch as scratch


class Backend(enum.Enum):
    """torch.nn.attention.SDPBackend's members, by the value `_fused_sdp_choice` returns."""

    MATH = 0
    FLASH = 1
    EFFICIENT = 2
    CUDNN = 3


@dataclass(frozen=True)
class CudaGpu:
    """What sdp_utils.cpp reads about the device and the build (cudaDeviceProp major/minor,
    the runtime cuDNN version, the CUDA version torch was built with)."""

    name: str
    major: int
    minor: int
    # at::detail::getCUDAHooks().versionRuntimeCuDNN(): 9.10.2 reads 91002; None: no cuDNN SDPA.
    cudnn_version: int | None = 91002
    cuda_version: int = 12080  # CUDA_VERSION torch was built with: 12.8 reads 12080
    cudnn_frontend_d256: bool = True  # CUDNN_FRONTEND_VERSION >= 12400 (kCuDNNFrontendSupportsD256)

    def __post_init__(self) -> None:
        if self.major < 5:
            raise ValueError(f"{self.name}: sm{self.major}{self.minor} is below every SDPA kernel's range")

    @property
    def arch(self) -> str:
        return f"sm{self.major}{self.minor}"


# The cuDNN of torch's CUDA 12.8 wheels (nvidia-cudnn-cu12 9.10.2.21), an assumption until a
# GPU run reads torch.backends.cudnn.version(): with it cuDNN attention is not preferred
# (check_prefer_cudnn_attention wants > 9.15.0), so a choice is flash, efficient or math.
GPUS = {
    "sm75": CudaGpu("T4", 7, 5),
    "sm80": CudaGpu("A100", 8, 0),
    "sm86": CudaGpu("A10 / RTX 3090", 8, 6),
    "sm89": CudaGpu("L4 / RTX 4090", 8, 9),
    "sm90": CudaGpu("H100 / H200", 9, 0),
}


def resolve_gpu(gpu: CudaGpu | str) -> CudaGpu:
    if isinstance(gpu, CudaGpu):
        return gpu
    if gpu in GPUS:
        return GPUS[gpu]
    match = re.fullmatch(r"sm([0-9]{1,2})([0-9])", gpu)  # planner.probe.cache.kernel_class's own classes
    if match is None:
        raise ValueError(f"unknown GPU architecture {gpu!r}: use one of {', '.join(GPUS)}, smXY or a CudaGpu")
    return CudaGpu(gpu, int(match.group(1)), int(match.group(2)))


@dataclass(frozen=True)
class SdpParams:
    """sdp_utils_cpp.h's `sdp_params`, plus what the filters read of grad mode."""

    query: torch.Tensor
    key: torch.Tensor
    value: torch.Tensor
    attn_mask: torch.Tensor | None
    dropout: float
    is_causal: bool
    enable_gqa: bool

    def requires_grad(self) -> bool:  # input_requires_grad
        return (any(t.requires_grad for t in (self.query, self.key, self.value))
                and torch.is_grad_enabled())


def _between(gpu: CudaGpu, low: tuple[int, int], high: tuple[int, int]) -> bool:  # check_sm_version
    return low <= (gpu.major, gpu.minor) <= high


# --- filters shared by the fused backends (sdp_utils_cpp.h, torch 2.13.0 as installed) ---

def check_tensor_shapes(p: SdpParams, gpu: CudaGpu) -> bool:
    return p.query.dim() == p.key.dim() == p.value.dim() == 4


def check_for_attn_mask(p: SdpParams, gpu: CudaGpu) -> bool:
    return p.attn_mask is None


def _batch_size_and_num_heads_dense(p: SdpParams, supports_gqa: bool, requires_same_num_heads: bool) -> bool:
    # check_batch_size_and_num_heads_dense<supports_gqa, requires_same_num_heads>
    q, k, v = p.query, p.key, p.value
    if not q.size(0) == k.size(0) == v.size(0):
        return False
    if p.enable_gqa and supports_gqa:  # check_grouped_query_attention<requires_same_num_heads>
        qh, kh, vh = q.size(-3), k.size(-3), v.size(-3)
        if requires_same_num_heads and kh != vh:
            return False
        return qh % kh == 0 and (requires_same_num_heads or qh % vh == 0)
    return q.size(-3) == k.size(-3) == v.size(-3)


def check_nonzero_sequence_lengths_dense(p: SdpParams, gpu: CudaGpu) -> bool:
    return p.query.size(-2) != 0 and p.key.size(-2) != 0


def _last_dim_stride_equals_1_dense(p: SdpParams, ignore_singleton_dim: bool) -> bool:
    ok = all(t.stride(-1) == 1 for t in (p.query, p.key, p.value))
    if ignore_singleton_dim:
        ok = ok or p.query.size(-1) == 1
    mask_ok = p.attn_mask is None or p.attn_mask.stride(-1) == 1  # not CPU: the mask must be dense too
    return ok and mask_ok


def _dtype_in(p: SdpParams, allowed: tuple[torch.dtype, ...]) -> bool:  # check_tensor_dtype
    return p.query.dtype == p.key.dtype == p.value.dtype and p.query.dtype in allowed


def check_dtypes_low_precision(p: SdpParams, gpu: CudaGpu) -> bool:
    return _dtype_in(p, (torch.float16, torch.bfloat16) if gpu.major >= 8 else (torch.float16,))


# --- flash (can_use_flash_attention, sdp_utils.cpp) ---

def check_runtime_disabled_flash(p: SdpParams, gpu: CudaGpu) -> bool:
    return torch.backends.cuda.flash_sdp_enabled()


def check_head_dim_size_flash(p: SdpParams, gpu: CudaGpu) -> bool:
    d = p.query.size(-1)
    return d == p.key.size(-1) == p.value.size(-1) and d <= 256


def check_flash_attention_hardware_support(p: SdpParams, gpu: CudaGpu) -> bool:
    return _between(gpu, (8, 0), (12, 1))


def check_requires_grad_and_head_dim_gt192_constraints_on_sm86_89_or_120(p: SdpParams, gpu: CudaGpu) -> bool:
    if p.requires_grad() and (_between(gpu, (8, 6), (8, 9)) or _between(gpu, (12, 0), (12, 1))):
        d = p.query.size(-1)
        return d <= 192 or (p.dropout == 0.0 and d > 224)
    return True


def check_flash_causal_non_square_seqlens(p: SdpParams, gpu: CudaGpu) -> bool:
    return not p.is_causal or p.query.size(-2) == p.key.size(-2)


def check_dtypes_flash_attention(p: SdpParams, gpu: CudaGpu) -> bool:
    return check_dtypes_low_precision(p, gpu)  # the FA3 branch needs torch.backends.cuda's opt-in


def flash_batch_size_and_num_heads_dense(p: SdpParams, gpu: CudaGpu) -> bool:
    return _batch_size_and_num_heads_dense(p, supports_gqa=True, requires_same_num_heads=True)


def flash_last_dim_stride_equals_1_dense(p: SdpParams, gpu: CudaGpu) -> bool:
    return _last_dim_stride_equals_1_dense(p, ignore_singleton_dim=True)


FLASH_FILTERS = (
    check_runtime_disabled_flash, check_tensor_shapes, check_for_attn_mask, check_head_dim_size_flash,
    check_flash_attention_hardware_support, check_requires_grad_and_head_dim_gt192_constraints_on_sm86_89_or_120,
    check_flash_causal_non_square_seqlens, check_dtypes_flash_attention,
    # dense inputs
    flash_batch_size_and_num_heads_dense, check_nonzero_sequence_lengths_dense,
    flash_last_dim_stride_equals_1_dense,
)


# --- memory-efficient (can_use_mem_efficient_attention, sdp_utils.cpp) ---

def check_runtime_disabled_mem_efficient(p: SdpParams, gpu: CudaGpu) -> bool:
    return torch.backends.cuda.mem_efficient_sdp_enabled()


def check_mem_efficient_hardware_support(p: SdpParams, gpu: CudaGpu) -> bool:
    return _between(gpu, (5, 0), (12, 1))


def minimum_gemm_alignment(p: SdpParams, gpu: CudaGpu) -> int:
    is_half = p.query.dtype in (torch.float16, torch.bfloat16)
    use_tensor_cores = gpu.major >= 8 or (gpu.major >= 7 and is_half)  # use_tensor_cores
    alignment = 4 if gpu.major >= 8 else 1
    if use_tensor_cores:
        alignment = max(alignment, 128 // (16 if is_half else 32))
    return alignment


def check_head_dim_size_mem_efficient(p: SdpParams, gpu: CudaGpu) -> bool:
    a = minimum_gemm_alignment(p, gpu)
    dq, dk, dv = p.query.size(-1), p.key.size(-1), p.value.size(-1)
    return dq == dk and dq % a == 0 and dq > 0 and dv % a == 0 and dv > 0


def check_data_ptr_alignment_mem_efficient(p: SdpParams, gpu: CudaGpu) -> bool:
    if gpu.major < 8:
        return True
    # The caching allocator's base pointers are >= 256-byte aligned, so only the storage
    # offset can misalign a tensor.
    alignment_bytes = minimum_gemm_alignment(p, gpu) * p.query.element_size()
    return all(t.numel() == 0 or (t.storage_offset() * t.element_size()) % alignment_bytes == 0
               for t in (p.query, p.key, p.value))


def mem_efficient_batch_size_and_num_heads_dense(p: SdpParams, gpu: CudaGpu) -> bool:
    # torch 2.13 passes supports_gqa=false here (its sdp_utils_cpp.h predates main's MQA/GQA
    # rework, pytorch PR 191085); main passes true. docs/cuda_kernels.md, section 4.
    return _batch_size_and_num_heads_dense(p, supports_gqa=False, requires_same_num_heads=True)


def mem_efficient_last_dim_stride_equals_1_dense(p: SdpParams, gpu: CudaGpu) -> bool:
    return _last_dim_stride_equals_1_dense(p, ignore_singleton_dim=False)


def check_dtypes_mem_efficient(p: SdpParams, gpu: CudaGpu) -> bool:
    if gpu.major >= 8:
        return _dtype_in(p, (torch.float16, torch.float32, torch.bfloat16))
    return _dtype_in(p, (torch.float16, torch.float32))


EFFICIENT_FILTERS = (
    check_runtime_disabled_mem_efficient, check_mem_efficient_hardware_support, check_tensor_shapes,
    check_head_dim_size_mem_efficient, check_data_ptr_alignment_mem_efficient,
    # dense inputs
    check_nonzero_sequence_lengths_dense, mem_efficient_last_dim_stride_equals_1_dense,
    mem_efficient_batch_size_and_num_heads_dense,
    check_dtypes_mem_efficient,
)


# --- cuDNN (can_use_cudnn_attention, sdp_utils.cpp) ---

def check_cudnn_build(p: SdpParams, gpu: CudaGpu) -> bool:
    # AT_CUDNN_ENABLED and CUDNN_VERSION >= 9.0.0; dropout is refused on cuDNN 9.11-9.13.
    v = gpu.cudnn_version
    return v is not None and v >= 90000 and not (p.dropout > 0.0 and 91100 < v < 91400)


def check_runtime_disabled_cudnn(p: SdpParams, gpu: CudaGpu) -> bool:
    return torch.backends.cuda.cudnn_sdp_enabled()


def check_cudnn_deterministic(p: SdpParams, gpu: CudaGpu) -> bool:
    return not torch.are_deterministic_algorithms_enabled() or torch.is_deterministic_algorithms_warn_only_enabled()


def check_attn_mask_shape(p: SdpParams, gpu: CudaGpu) -> bool:
    m = p.attn_mask
    if m is None:
        return True
    if m.requires_grad:
        return False
    q = p.query

    def compatible(mask_dim: int, target: int) -> bool:
        return mask_dim == target or mask_dim == 1

    if not (compatible(m.size(-2), q.size(2)) and compatible(m.size(-1), p.key.size(2))):
        return False
    if m.dim() == 2:
        return True
    return m.dim() == 4 and compatible(m.size(0), q.size(0)) and compatible(m.size(1), q.size(1))


def check_cudnn_hardware_support(p: SdpParams, gpu: CudaGpu) -> bool:
    return _between(gpu, (8, 0), (12, 1))


def check_cudnn_dropout(p: SdpParams, gpu: CudaGpu) -> bool:
    return p.dropout * 16.0 == math.floor(p.dropout * 16.0)


def _is_sm90_or_sm10x(gpu: CudaGpu) -> bool:
    return (gpu.major == 9 and gpu.minor == 0) or gpu.major == 10


def _cudnn_supports_d256(gpu: CudaGpu) -> bool:
    v = gpu.cudnn_version or 0
    unsupported_sm107 = gpu.major == 10 and gpu.minor == 7 and v <= 92500
    return _is_sm90_or_sm10x(gpu) and not unsupported_sm107 and v > 92200 and gpu.cudnn_frontend_d256


def check_cudnn_tensor_shapes(p: SdpParams, gpu: CudaGpu) -> bool:
    b, h = p.query.size(0), p.query.size(1)
    if b > 65535 or h > 65535:
        return False
    s_q, s_k = p.query.size(2), p.key.size(2)
    d_qk, d_v = p.query.size(3), p.value.size(3)
    v = gpu.cudnn_version or 0
    if v < 8903 or (v < 8906 and p.dropout != 0.0):
        return False
    limit = 128
    if _cudnn_supports_d256(gpu):
        limit = 256
    elif _is_sm90_or_sm10x(gpu) and v >= 91100 and d_qk == 192 and d_v == 128:
        limit = 192
    if not (d_qk <= limit and d_v <= limit) or d_qk % 8 or d_v % 8:
        return False
    if v < 8906 and s_k % 64:
        return False
    if v < 90000 and (s_q < 64 or (p.dropout != 0.0 and (s_q % 64 or s_k % 64))):
        return False
    return s_k != 1 and not (p.dropout != 0.0 and s_q == 1)


def check_cudnn_d256_bprop_head_dim(p: SdpParams, gpu: CudaGpu) -> bool:
    if not p.requires_grad() or not _cudnn_supports_d256(gpu):
        return True
    d_qk, d_v = p.query.size(3), p.value.size(3)
    return (d_qk <= 128 and d_v <= 128) or (d_qk, d_v) in ((192, 128), (256, 256))


def cudnn_batch_size_and_num_heads_dense(p: SdpParams, gpu: CudaGpu) -> bool:
    return _batch_size_and_num_heads_dense(p, supports_gqa=True, requires_same_num_heads=False)


CUDNN_FILTERS = (
    check_cudnn_build, check_runtime_disabled_cudnn, check_tensor_shapes, check_cudnn_deterministic,
    check_dtypes_low_precision, check_attn_mask_shape, check_cudnn_hardware_support, check_cudnn_dropout,
    # dense inputs
    check_nonzero_sequence_lengths_dense, flash_last_dim_stride_equals_1_dense,
    cudnn_batch_size_and_num_heads_dense, check_cudnn_tensor_shapes, check_cudnn_d256_bprop_head_dim,
)

FILTERS = {Backend.FLASH: FLASH_FILTERS, Backend.EFFICIENT: EFFICIENT_FILTERS, Backend.CUDNN: CUDNN_FILTERS}


def refusal(backend: Backend, params: SdpParams, gpu: CudaGpu) -> str | None:
    """The name of the first filter of `backend` that refuses `params` on `gpu`, or None."""
    if backend is Backend.MATH:
        return None if torch.backends.cuda.math_sdp_enabled() else "math disabled"
    for check in FILTERS[backend]:
        if not check(params, gpu):
            return check.__name__
    return None


def prefers_cudnn(gpu: CudaGpu) -> bool:
    """check_prefer_cudnn_attention (unless TORCH_CUDNN_SDPA_DEPRIORITIZED is set)."""
    return scratch.prefers_cudnn(gpu.major, gpu.minor, scratch.CudaBuild(gpu.cudnn_version, gpu.cuda_version))


_DEFAULT_ORDER = [Backend.FLASH.value, Backend.EFFICIENT.value, Backend.MATH.value, Backend.CUDNN.value, 4]


def priority_order(gpu: CudaGpu) -> list[Backend]:
    """priority_order: at::globalContext().sDPPriorityOrder() (torch.nn.attention's
    `sdpa_kernel(..., set_priority=True)` sets it), with cuDNN moved first once on GPUs that
    prefer it when the order is still the default."""
    order = list(torch._C._get_sdp_priority_order())
    if order == _DEFAULT_ORDER and prefers_cudnn(gpu):
        order = [Backend.CUDNN.value, Backend.FLASH.value, Backend.EFFICIENT.value, Backend.MATH.value]
    return [Backend(value) for value in order if value in Backend._value2member_map_]


def select_sdp_backend(params: SdpParams, gpu: CudaGpu | str) -> Backend:
    """select_sdp_backend: the first backend in priority order whose filters all pass."""
    gpu = resolve_gpu(gpu)
    for backend in priority_order(gpu):
        if refusal(backend, params, gpu) is None:
            return backend
    raise RuntimeError("No available kernel. Aborting execution.")  # select_sdp_backend's own words


# --- what an attention backward takes beside its outputs (planner.attention_scratch) ---

class _BackwardParams(SdpParams):
    def requires_grad(self) -> bool:  # a backward runs: its forward's inputs required a gradient
        return True


# The GPU whose cuDNN filters a backward is tested on: sm90 with the reference build.
_CUDNN_REFERENCE_GPU = CudaGpu("H100 / H200", 9, 0, cudnn_version=scratch.CUDNN_REFERENCE.cudnn_version,
                               cuda_version=scratch.CUDNN_REFERENCE.cuda_version)
_BACKWARDS = {torch.ops.aten._scaled_dot_product_flash_attention_backward.default: scratch.FLASH,
              torch.ops.aten._scaled_dot_product_efficient_attention_backward.default: scratch.EFFICIENT,
              torch.ops.aten._scaled_dot_product_cudnn_attention_backward.default: scratch.CUDNN}


def attention_backward_call(func, args, kwargs) -> scratch.AttentionBackward | None:
    """The fused attention backward `func` is, with its dimensions and whether cuDNN's filters
    pass its inputs on the reference build (as the forward's would: the same query, key,
    value, mask, dropout and causality); None for any other op."""
    backend = _BACKWARDS.get(func)
    if backend is None:
        return None
    named = dict(zip((a.name for a in func._schema.arguments), args)) | dict(kwargs or {})
    query, key, value = named["query"], named["key"], named["value"]
    params = _BackwardParams(query, key, value, named.get("attn_bias"), float(named.get("dropout_p") or 0.0),
                             bool(named.get("is_causal")), key.size(1) != query.size(1))
    eligible = refusal(Backend.CUDNN, params, _CUDNN_REFERENCE_GPU) is None
    (b, h_q, s_q, d_qk), (h_kv, s_kv), d_v = query.shape, key.shape[1:3], value.size(3)
    return scratch.AttentionBackward(backend, eligible, b, h_q, h_kv, s_q, s_kv, d_qk, d_v, query.element_size())


# --- the attention op, as attention.cpp's scaled_dot_product_attention runs it on CUDA ---

def _convert_boolean_attn_mask(mask: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    # convert_boolean_attn_mask_: an additive mask in the query's dtype, of the mask's shape.
    if mask is None or mask.dtype != torch.bool:
        return mask
    return torch.where(mask, 0.0, torch.scalar_tensor(-math.inf, dtype=dtype, device=mask.device))


def _preprocess_mask(mask: torch.Tensor, query: torch.Tensor, key: torch.Tensor) -> torch.Tensor:
    # preprocess_mask with aligned_tensor<8> and pad_bias<8>: a mask whose strides are not
    # multiples of 8 is copied into one padded to a multiple of 8 columns, then sliced back.
    aligned = all(stride % 8 == 0 for stride in mask.stride()[:-1]) and mask.stride(-1) == 1
    if not aligned:
        last = mask.size(-1)
        padded = torch.nn.functional.pad(mask, (0, 8 - last % 8))
        if last == query.size(-2):
            # The mask kept for backward has ceil8(s) columns: this copy when s is not a multiple
            # of 8, the mask itself when it is (no copy then: see planner.probe.table).
            _announce_rounded(padded, padded.dim() - 1, "ceil8")
            if padded.requires_grad:  # a bias that trains: the slice's backward makes a padded gradient
                _PADDED_MASK_SIZES.add(tuple(padded.shape))
        mask = padded[..., :last]
    return mask.expand(query.size(0), query.size(1), query.size(2), key.size(2))


def _pad_last_dim_8(tensor: torch.Tensor) -> torch.Tensor:  # pad_last_dim<8, false>
    d = tensor.size(-1)
    return tensor if d % 8 == 0 else torch.nn.functional.pad(tensor, (0, 8 - d % 8))


# Who is told which outputs have a dimension that is the sequence length rounded up (the
# probe's recorder: three small probes show 32 for ceil32(s) at every size).
_rounded_size_listeners: list = []


@contextlib.contextmanager
def rounded_sizes_to(listener):
    """Inside, `listener(tensor, dim, kind)` hears of every output whose dimension `dim` is
    `kind` of the sequence length (planner.probe.table.ROUNDINGS)."""
    _rounded_size_listeners.append(listener)
    try:
        yield
    finally:
        _rounded_size_listeners.remove(listener)


def _announce_rounded(tensor: torch.Tensor, dim: int, kind: str) -> None:
    for listener in list(_rounded_size_listeners):
        listener(tensor, dim, kind)


# Shapes of the padded masks _preprocess_mask made of a bias that trains, in this context.
_PADDED_MASK_SIZES: set[tuple[int, ...]] = set()


class _PaddedBiasGradients(TorchDispatchMode):
    """Gradients of a bias that trains (T5's position bias), sized as the CUDA kernels size them:
    - the memory-efficient backward (attention_backward.cu, `_efficient_attention_backward`)
      allocates the bias gradient with its last dimension aligned to 16 and returns the slice,
      as the meta kernel does, but a fake tensor's storage would hold only the slice's
      elements: here the slice keeps the whole (..., ceil16(s)) storage, announced;
    - the backward of pad_bias<8>'s slice (`slice_backward`) makes a gradient of the padded
      mask's (..., ceil8(s)) shape: announced."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func is torch.ops.aten.slice_backward.default and tuple(args[1]) in _PADDED_MASK_SIZES:
            if args[2] in (-1, len(args[1]) - 1):
                _announce_rounded(out, out.dim() - 1, "ceil8")
            return out
        if func is not torch.ops.aten._scaled_dot_product_efficient_attention_backward.default or out[3] is None:
            return out
        grad_bias, query = out[3], args[1]
        last = grad_bias.size(-1)
        padded = torch.empty((*grad_bias.shape[:-1], -(-last // 16) * 16), dtype=grad_bias.dtype,
                             device=grad_bias.device)
        if last == query.size(-2):
            _announce_rounded(padded, padded.dim() - 1, "ceil16")
        return (*out[:3], padded[..., :last])


class _Choices:
    """What one cuda_kernels context chose, call by call (for tests and reports)."""

    def __init__(self) -> None:
        self.attention: list[Backend] = []


def _attention_kernel(gpu: CudaGpu, choices: _Choices):
    def scaled_dot_product_attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, *,
                                     scale=None, enable_gqa=False):
        if not all(isinstance(t, FakeTensor) for t in (query, key, value)):
            raise RuntimeError("cuda_kernels() routes the attention of fake tensors only")
        params = SdpParams(query, key, value, attn_mask, dropout_p, is_causal, enable_gqa)
        backend = select_sdp_backend(params, gpu)
        choices.attention.append(backend)
        mask = _convert_boolean_attn_mask(attn_mask, query.dtype)
        compute_logsumexp = params.requires_grad()  # should_compute_logsumexp
        ops = torch.ops.aten
        if backend is Backend.CUDNN:
            return ops._scaled_dot_product_cudnn_attention(query, key, value, mask, compute_logsumexp, dropout_p,
                                                           is_causal, False, scale=scale)[0]
        if backend is Backend.FLASH:
            head_dim = query.size(-1)
            og_scale = scale if scale is not None else 1.0 / math.sqrt(head_dim)  # sdp::calculate_scale
            out = ops._scaled_dot_product_flash_attention(_pad_last_dim_8(query), _pad_last_dim_8(key),
                                                          _pad_last_dim_8(value), dropout_p, is_causal, False,
                                                          scale=og_scale)[0]
            return out if out.size(-1) == head_dim else out[..., :head_dim]  # post_process_flash_output
        if backend is Backend.EFFICIENT:
            if mask is not None:
                mask = _preprocess_mask(mask, query, key)
            outputs = ops._scaled_dot_product_efficient_attention(query, key, value, mask, compute_logsumexp,
                                                                  dropout_p, is_causal, scale=scale)
            if compute_logsumexp:  # meta__efficient_attention_forward: (b, h, ceil(s_q / 32) * 32), fp32
                _announce_rounded(outputs[1], 2, "ceil32")
            return outputs[0]
        return ops._scaled_dot_product_attention_math(query, key, value, mask, dropout_p, is_causal, None,
                                                      scale=scale, enable_gqa=enable_gqa)[0]

    return scaled_dot_product_attention


def _dropout_kernel(input, p, train):
    # at::native::dropout: the fused kernel (native_dropout, a bool mask) whenever
    # is_fused_kernel_acceptable holds for a CUDA input; otherwise _dropout<false>.
    if train and 0 < p < 1 and input.numel() > 0:
        return torch.ops.aten.native_dropout.default(input, p, train)[0]
    if p == 0 or not train or input.numel() == 0:
        return input
    return input.mul(torch.zeros((), dtype=input.dtype, device=input.device))  # p == 1


# --- autocast: CUDA's op lists where they differ from the CPU's ---
# torch 2.13.0's installed ATen/autocast_mode.h lists the CUDA policies (AT_FORALL_*); the
# CPU's are registered in aten/src/ATen/autocast_mode.cpp (TORCH_LIBRARY_IMPL(aten,
# AutocastCPU, m)). A simulation runs autocast("cpu"), so each op whose policy differs gets
# an AutocastCPU kernel with the CUDA policy; ops both lists treat alike keep torch's own
# kernel (and its cache of weight casts).

# AT_FORALL_LOWER_PRECISION_FP entries the CPU list lacks.
CUDA_ONLY_LOWER_PRECISION = (
    "_convolution", "convolution", "addmv", "addr", "einsum", "mv", "chain_matmul", "linalg_multi_dot",
    "_thnn_fused_lstm_cell", "_thnn_fused_gru_cell", "lstm_cell", "gru_cell", "rnn_tanh_cell", "rnn_relu_cell",
)
# AT_FORALL_FP32 entries the CPU list lacks (the CPU casts the losses, kl_div and cdist alike).
CUDA_ONLY_FP32 = (
    "acos", "asin", "cosh", "erfinv", "exp", "expm1", "log", "log10", "log2", "log1p", "reciprocal", "rsqrt",
    "sinh", "tan", "pow.Tensor_Scalar", "pow.Tensor_Tensor", "pow.Scalar", "softplus", "layer_norm",
    "native_layer_norm", "rms_norm", "group_norm", "frobenius_norm.dim", "nuclear_norm", "nuclear_norm.dim",
    "cosine_similarity", "dist", "pdist", "renorm", "logsumexp",
    "upsample_nearest1d", "_upsample_nearest_exact1d", "upsample_nearest2d", "_upsample_nearest_exact2d",
    "upsample_nearest3d", "_upsample_nearest_exact3d", "upsample_linear1d", "upsample_bilinear2d",
    "_upsample_bilinear2d_aa", "upsample_trilinear3d", "upsample_bicubic2d", "_upsample_bicubic2d_aa",
)
# AT_FORALL_FP32_SET_OPT_DTYPE (the CPU casts prod to fp32 instead: kept as the CPU's).
CUDA_FP32_SET_OPT_DTYPE = (
    "softmax.int", "log_softmax.int", "cumprod", "cumsum", "linalg_vector_norm", "linalg_matrix_norm",
    "linalg_matrix_norm.str_ord", "sum", "sum.dim_IntList",
)
# In the CPU's fp32 list, in no CUDA list: on CUDA the op runs as it decomposes
# (cross_entropy_loss: log_softmax, fp32_set_opt_dtype, and nll_loss, fp32).
CPU_ONLY_CASTS = ("cross_entropy_loss",)


def _eligible(value) -> bool:  # is_eligible for the CPU autocast key
    return isinstance(value, torch.Tensor) and value.is_floating_point() and value.device.type == "cpu" \
        and value.dtype != torch.float64


def _without_autocast():
    return torch._C._ExcludeDispatchKeyGuard(torch._C.DispatchKeySet(torch._C.DispatchKey.AutocastCPU))


def _overload(name: str):
    op_name, _, overload = name.partition(".")
    return getattr(getattr(torch.ops.aten, op_name), overload or "default")


def _cast_kernel(op, lower_precision: bool):
    # WrapFunction_ for lower_precision_fp / fp32: cast every eligible tensor argument, then
    # run the op with autocast excluded (its decomposition included), as cached_cast does
    # minus the weight cache.
    from torch.utils._pytree import tree_map

    def kernel(*args, **kwargs):
        dtype = torch.get_autocast_dtype("cpu") if lower_precision else torch.float32
        args, kwargs = tree_map(lambda v: v.to(dtype) if _eligible(v) and v.dtype != dtype else v, (args, kwargs))
        with _without_autocast():
            return op(*args, **kwargs)

    return kernel


def _set_opt_dtype_kernel(op):
    # fp32_set_opt_dtype: when the first argument is eligible, an unset dtype becomes fp32.
    arguments = op._schema.arguments
    position = next(i for i, a in enumerate(arguments) if a.name == "dtype")
    kwarg_only = arguments[position].kwarg_only

    def kernel(*args, **kwargs):
        if args and _eligible(args[0]):
            if kwarg_only or len(args) <= position:
                if kwargs.get("dtype") is None:
                    kwargs = {**kwargs, "dtype": torch.float32}
            elif args[position] is None:
                args = (*args[:position], torch.float32, *args[position + 1:])
        with _without_autocast():
            return op(*args, **kwargs)

    return kernel


def _register_cuda_autocast(library) -> None:
    for name in CUDA_ONLY_LOWER_PRECISION:
        library.impl(name, _cast_kernel(_overload(name), lower_precision=True), "AutocastCPU")
    for name in CUDA_ONLY_FP32:
        library.impl(name, _cast_kernel(_overload(name), lower_precision=False), "AutocastCPU")
    for name in CUDA_FP32_SET_OPT_DTYPE:
        library.impl(name, _set_opt_dtype_kernel(_overload(name)), "AutocastCPU")
    for name in CPU_ONLY_CASTS:
        library.impl(name, torch.library.fallthrough_kernel, "AutocastCPU")


@contextlib.contextmanager
def cuda_kernels(gpu: CudaGpu | str = "sm90"):
    """Inside, fake CPU tensors take CUDA's attention backend, dropout kernel and optimizer
    default on `gpu` (see the module doc). Yields the record of attention choices."""
    import torch.optim.optimizer as optimizer_module

    gpu = resolve_gpu(gpu)
    choices = _Choices()
    library = torch.library.Library("aten", "IMPL")
    foreach_devices = optimizer_module._get_foreach_kernels_supported_devices
    # A fake parameter's type is FakeTensor (nn.Parameter keeps a subclass's own type), which
    # _default_to_fused_or_foreach would refuse whatever the device.
    foreach_types = optimizer_module._foreach_supported_types
    added_type = FakeTensor not in foreach_types
    try:
        with warnings.catch_warnings():
            # "Overriding a previously registered kernel": the override is the point, and
            # destroying the library restores torch's own kernels.
            warnings.simplefilter("ignore")
            library.impl("scaled_dot_product_attention", _attention_kernel(gpu, choices), "CompositeImplicitAutograd")
            library.impl("dropout", _dropout_kernel, "CompositeImplicitAutograd")
            _register_cuda_autocast(library)
        optimizer_module._get_foreach_kernels_supported_devices = lambda: [*foreach_devices(), "cpu"]
        if added_type:
            foreach_types.append(FakeTensor)
        with _PaddedBiasGradients():
            yield choices
    finally:
        if added_type and FakeTensor in foreach_types:
            foreach_types.remove(FakeTensor)
        optimizer_module._get_foreach_kernels_supported_devices = foreach_devices
        library._destroy()
        _PADDED_MASK_SIZES.clear()


def saved_during(fn) -> list[tuple[tuple[int, ...], torch.dtype]]:
    """(shape, dtype) of every tensor autograd saves while `fn` runs, in order: what a kernel
    path keeps for backward (tests/test_fake_cuda.py, scripts/check_fake_cuda_on_gpu.py)."""
    saved = []

    def pack(tensor):
        saved.append((tuple(tensor.shape), tensor.dtype))
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        fn()
    return saved
