"""What a fused attention backward takes from the caching allocator beside its outputs.

A fake kernel makes only an op's outputs (dQ, dK, dV); the real backward kernels also
allocate scratch for as long as they run. The probe marks each attention backward with its
dimensions and the backend it ran (planner.probe.recorder); the allocator's replay
(planner.reserved) makes the scratch after the op's last output, for the backend the plan's
GPU and torch build choose (`replay_backend`), and frees it before the next event.

- **cuDNN** (measured): one workspace request per call, made right after dQ, dK and dV and
  freed at once. Its size is the plan's `graph.get_workspace_size()` in cudnn-frontend's
  SDPA backward graph (`CompositeSDPABackwardNode`, include/cudnn_frontend/node/
  scaled_dot_product_flash_attention.h, `get_fe_workspace_size_node`): the fp32 dQ
  accumulator, b·h_q·s_q·d_qk·4 B, the fp32 softmax sum, b·h_q·s_q·4 B, and with grouped-query
  attention the full-head dK and dV the graph makes before reducing them to the key/value
  heads, b·h_q·s_kv·(d_qk + d_v) elements in Q's dtype, plus 256 B of the engine's own; up to
  cuDNN 9.15 the frontend adds b·8 B for its padding-mask workaround when s_kv is not a
  multiple of 128. Recorded on an H200 (torch 2.11, cuDNN 9.19;
  benchmarks/results/gpu_runs/2026-12-04-{c,d}/traces): 6,390,016 B on GPT-2, 15,851,776 B on
  SmolLM2-360M and 33,816,832 B on Llama-3.2-1B at 4 x 512 tokens, each equal to the formula.
- **Flash attention 2** (read from torch's flash_attn/flash_api.cpp `mha_bwd`, not yet measured):
  after dQ, dK and dV, `softmax_d` (b, h_q, ceil128(s_q)) fp32 and `dq_accum`
  (b, ceil128(s_q), h_q, d_r) fp32, where d is the head size padded to 8 and d_r it rounded to
  32 (64 above 128); with grouped-query attention `dk_expanded` and `dv_expanded`
  (b, s_kv, h_q, d) in Q's dtype. At return the locals go in reverse order (dv_expanded,
  dk_expanded, dq_accum), and `softmax_d`, returned to `_flash_attention_backward`, when that
  drops it. Deterministic mode (an nsplits dimension) is not modelled; nor is the
  `sum_out` reducing the expanded dK and dV to the key/value heads (a reduction over a middle
  dimension, whose kernel may take a global workspace).
- **Memory-efficient**, fp32 with 64-wide heads (measured; read from torch's
  transformers/cuda/attention_backward.cu `_efficient_attention_backward` and
  mem_eff_attention/kernel_backward.h): after dQ, dK and dV, the fp32 kernels do not compute
  `delta` themselves (`kKernelComputesDelta` is for 16-bit types), so torch does,
  `(grad_out.float() * out.float()).sum(-1).transpose(-2, -1).contiguous()`: the product
  (b, s_q, h_q, d_v) fp32, its sum (b, s_q, h_q) and the contiguous delta (b, h_q, s_q), the
  two temporaries freed at the end of that expression (the sum, then the product). Then the
  kernel's workspace, dQ's accumulator tiles (`workspace_elements_gq`: per batch and head,
  ceil(s_q / 64) x ceil(d_qk / 64) tiles of 64 x 64 floats and a 16 B lock, rounded to 4
  floats; dK and dV need none when the output type is the accumulator's); both freed when the
  function returns. Recorded on the H200 (torch 2.11): 3,145,728 B and 3,148,800 B per layer
  for DistilBERT at 8 x 128, 12,582,912 B and 12,595,200 B for BERT-base at 16 x 256 (with
  attention dropout), equal to these. Not modelled: 16-bit types (the kernel computes delta,
  and dK/dV accumulators and key splits depend on the CUTLASS kernel chosen and the GPU's SM
  count) and other head sizes (another kernel's tiles).

The backend: torch prefers cuDNN on sm90 and sm10x from cuDNN 9.15.1 on
(sdp_utils.cpp `check_prefer_cudnn_attention`), where cuDNN's filters pass; the probe records
whether they do (on the reference build `CUDNN_REFERENCE`) beside the backend its own
kernel class took (planner.probe.cache.kernel_class). The cuDNN of a user's torch is not
known to the planner: `CudaBuild` holds it, by default torch's CUDA 12.8 wheels' (9.10.2,
under which flash runs on every GPU the presets hold); the GPU check passes the version its
run read (`torch.backends.cudnn.version()`).
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass

from planner.cuda_allocator import FREE
from planner.errors import PlannerInputError

FLASH, EFFICIENT, CUDNN = "flash", "efficient", "cudnn"


@dataclass(frozen=True)
class CudaBuild:
    """What of torch's CUDA build decides the attention backend: the runtime cuDNN version
    (`torch.backends.cudnn.version()`: 9.10.2 reads 91002) and the CUDA version it was built
    with (12.8 reads 12080)."""

    cudnn_version: int | None = 91002  # nvidia-cudnn-cu12 9.10.2.21, pinned by torch's CUDA 12.8 wheels
    cuda_version: int = 12080


DEFAULT_BUILD = CudaBuild()


def cuda_build_from(cudnn_version: object) -> CudaBuild:
    """The build of a user-given cuDNN version (an integer as `torch.backends.cudnn.version()`
    reads it, 91900 for 9.19.0; None: the default build's); one-line error otherwise."""
    if cudnn_version is None:
        return DEFAULT_BUILD
    if isinstance(cudnn_version, bool) or not isinstance(cudnn_version, int) or not 8000 <= cudnn_version < 1000000:
        raise PlannerInputError(f"cudnn_version must be an integer as torch.backends.cudnn.version() gives it "
                                f"(91900 for cuDNN 9.19.0), got {str(cudnn_version)[:40]!r}")
    return CudaBuild(cudnn_version=cudnn_version, cuda_version=DEFAULT_BUILD.cuda_version)
# The build the probe tests cuDNN's filters on: the one measured on the H200 (torch 2.11.0+cu130).
CUDNN_REFERENCE = CudaBuild(cudnn_version=91900, cuda_version=13000)


def prefers_cudnn(major: int, minor: int, build: CudaBuild) -> bool:
    """check_prefer_cudnn_attention (sdp_utils.cpp): cuDNN after 9.15.0 on sm90 and sm10x, on
    CUDA 12 builds only for minor 0 and 3."""
    v = build.cudnn_version
    if v is None or v <= 91500 or major not in (9, 10):
        return False
    return build.cuda_version >= 13000 or minor in (0, 3)


@dataclass(frozen=True)
class AttentionBackward:
    """One attention backward as the probe marked it, its dimensions at one (b, s)."""

    backend: str  # what the probe's architecture ran: FLASH, EFFICIENT or CUDNN
    cudnn_eligible: bool  # cuDNN's filters pass on CUDNN_REFERENCE
    batch: int
    heads_q: int
    heads_kv: int
    seq_q: int
    seq_kv: int
    head_dim_qk: int
    head_dim_v: int
    element_bytes: int  # Q's dtype


def _round_up(x: int, multiple: int) -> int:
    return -(-x // multiple) * multiple


def cudnn_workspace_bytes(call: AttentionBackward, build: CudaBuild) -> int:
    """cudnn-frontend's SDPA backward workspace (module doc)."""
    b, h, s_q = call.batch, call.heads_q, call.seq_q
    size = b * h * s_q * (call.head_dim_qk + 1) * 4 + 256
    if call.heads_kv != call.heads_q:
        size += b * h * call.seq_kv * (call.head_dim_qk + call.head_dim_v) * call.element_bytes
    if call.seq_kv % 128 and (build.cudnn_version or 0) <= 91500:
        size += b * 8
    return size


def flash_scratch_bytes(call: AttentionBackward) -> list[int]:
    """Flash attention 2's backward scratch in allocation order: softmax_d, dq_accum, then with
    grouped-query attention dk_expanded and dv_expanded (module doc)."""
    b, h = call.batch, call.heads_q
    d = _round_up(call.head_dim_qk, 8)
    d_rounded = _round_up(d, 32 if d <= 128 else 64)
    s_q = _round_up(call.seq_q, 128)
    sizes = [b * h * s_q * 4, b * s_q * h * d_rounded * 4]
    if call.heads_kv != call.heads_q:
        sizes += [b * call.seq_kv * h * d * call.element_bytes] * 2
    return sizes


# The tile of the fp32 kernel measured with 64-wide heads (kBlockSizeI x MatmulGradQ's kN), and
# the 16 B of GradQTempStorage beside each tile's floats (its lock and counter).
EFFICIENT_TILE = 64
EFFICIENT_TILE_EXTRA_FLOATS = 4


def efficient_scratch_bytes(call: AttentionBackward) -> list[int]:
    """The memory-efficient backward's requests in order, fp32 with 64-wide heads: delta's
    product, sum and delta, then the workspace (module doc); [] where not modelled."""
    if call.element_bytes != 4 or call.head_dim_qk != EFFICIENT_TILE or call.head_dim_v != EFFICIENT_TILE:
        return []
    b, h, s_q = call.batch, call.heads_q, call.seq_q
    tiles = -(-s_q // EFFICIENT_TILE) * -(-call.head_dim_qk // EFFICIENT_TILE)
    per_head = _round_up(tiles * (EFFICIENT_TILE * EFFICIENT_TILE + EFFICIENT_TILE_EXTRA_FLOATS), 4)
    return [b * s_q * h * call.head_dim_v * 4, b * s_q * h * 4, b * h * s_q * 4, b * h * per_head * 4]


def replay_backend(call: AttentionBackward, compute_capability: tuple[int, int] | None,
                   build: CudaBuild = DEFAULT_BUILD) -> str:
    """The backend a GPU of `compute_capability` runs the call on with `build` (None: a GPU not
    known, whichever of the probe's and cuDNN's scratch is larger)."""
    if not call.cudnn_eligible:
        return call.backend
    if compute_capability is None:
        own = sum(scratch_sizes(call, call.backend, build))
        return CUDNN if cudnn_workspace_bytes(call, build) > own else call.backend
    return CUDNN if prefers_cudnn(*compute_capability, build) else call.backend


def scratch_sizes(call: AttentionBackward, backend: str, build: CudaBuild) -> list[int]:
    if backend == CUDNN:
        return [cudnn_workspace_bytes(call, build)]
    if backend == FLASH:
        return flash_scratch_bytes(call)
    return efficient_scratch_bytes(call)


def scratch_events(owner: Hashable, call: AttentionBackward, backend: str,
                   build: CudaBuild) -> list[tuple[Hashable, int]]:
    """The backward's scratch as caching-allocator events, made after its last output (`owner`,
    that output's key) and freed before anything else happens (module doc for the order)."""
    sizes = scratch_sizes(call, backend, build)
    keys = [("attention-scratch", owner, k) for k in range(len(sizes))]
    events = list(zip(keys, sizes))
    if backend == FLASH:  # locals in reverse order, then softmax_d (returned, then dropped)
        return events + [(key, FREE) for key in reversed(keys[1:])] + [(keys[0], FREE)]
    if backend == EFFICIENT and keys:  # product, sum, delta; the sum and product go; workspace; all go
        product, total, delta, workspace = events
        return [product, total, delta, (total[0], FREE), (product[0], FREE), workspace,
                (workspace[0], FREE), (delta[0], FREE)]
    return events + [(key, FREE) for key in reversed(keys)]
