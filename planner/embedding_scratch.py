"""What CUDA's embedding backward takes from the caching allocator beside its output.

A fake kernel makes only `embedding_dense_backward`'s output, the weight's gradient (its
`at::zeros({num_weights, dim})`). The real one (torch's aten/src/ATen/native/cuda/Embedding.cu
`embedding_dense_backward_cuda` and EmbeddingBackwardKernel.cu `embedding_backward_cuda_kernel`)
makes more for as long as it runs. The probe marks each call with its sizes
(planner.probe.recorder); the allocator's replay (planner.reserved) makes these requests around
the output, for the plan's GPU (planner.kernel_target `KernelTarget`).

Every path first makes contiguous copies of the indices and of the incoming gradient where
they are not contiguous (`indices_.contiguous()`, `grad_.contiguous()`), alive until it returns.

- **Up to 3,072 indices** (and no `scale_grad_by_freq`): one kernel over the features,
  nothing else.
- **More** (torch's sort-and-segment path), in order, n indices of `index_bytes` each, m =
  min(n, num_weights) segments at most, p = n // 10 + m partial segments at most
  (NROWS_PER_THREAD = 10):
  `sorted_indices`, `orig_indices` and `range` (n each), CUB's radix sort's temporary storage
  (planner.cub_temporaries), freed, then `range` freed; with `scale_grad_by_freq` a `count` (n)
  and two CUB scans (their temporaries not modelled). Then the output. Then
  `segment_offsets` (n), the segment count (8 B), CUB's unique-by-key with its own keys
  output (n) and temporary storage, both freed; `partials_per_segment` and its offsets (m
  each), CUB's exclusive sum's temporary storage, freed; the partial-segment count (8 B);
  `partial_segment_offset` (p). Then one of two kernels:
  - two passes (compute_grad_weight, sum_and_scatter): `grad_weight_per_segment`, p rows of the
    gradient's width in the accumulation type (fp32 for 16-bit gradients);
  - one fused pass with atomic adds, where the scatter would have few blocks
    (`use_fused_kernel`: ceil(m * width32 / block) below 4 blocks per SM and p more than four
    times that, not in deterministic mode): `partial_to_segment_idx` (p), and for 16-bit
    gradients an fp32 accumulator of the whole weight (`grad_weight_acc`), freed after it is
    copied into the output.
  Locals die in reverse order of their making as each C++ scope closes.

Recorded on an H200 (torch 2.11; benchmarks/results/gpu_runs/2026-12-04-e/traces): BERT-base at
16 x 256 tokens (word embeddings, 4,096 indices, two passes: `grad_weight_per_segment`
(409 + 4,096) x 768 x 4 = 13,839,360 B; token types, 2 rows, fused, after a contiguous copy of
the expanded token-type ids) and Qwen3-0.6B at 8 x 1,024 ((819 + 8,192) x 1,024 x 4 =
36,909,056 B), every request equal to this sequence (tests/test_embedding_scratch.py).

Not modelled: deterministic mode (no fused pass; the runners do not ask for it), the scans'
temporaries under `scale_grad_by_freq` (no transformers model sets it), `embedding_bag`. A
GPU whose SM count is not known takes the two passes; a ROCm GPU gets this CUDA sequence as a
stand-in (as planner.cuda_overheads does for its figures).
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass

from planner import cub_temporaries as cub
from planner.cuda_allocator import FREE, Event


@dataclass(frozen=True)
class EmbeddingBackward:
    """One `embedding_dense_backward` as the probe marked it, its sizes at one (b, s)."""

    num_indices: int
    num_weights: int
    dim: int  # the gradient's last dimension: the weight's width
    grad_bytes: int  # the incoming gradient's element bytes (the output's)
    index_bytes: int  # 8 for int64 indices, 4 for int32
    indices_contiguous: bool
    grad_contiguous: bool
    scale_grad_by_freq: bool

    @property
    def segments(self) -> int:
        """`max_segments`: distinct indices there can be, min(n, rows)."""
        return min(self.num_indices, self.num_weights)

    @property
    def partials(self) -> int:
        """`max_partial_segment`: partial segments of NROWS_PER_THREAD there can be."""
        return self.num_indices // NROWS_PER_THREAD + self.segments


FEATURE_PATH_MAX_INDICES = 3072  # embedding_dense_backward_cuda: at most this many, one kernel over features
NROWS_PER_THREAD = 10  # EmbeddingBackwardKernel.cu: rows a partial segment sums
MAX_ATOMIC_ACCUM_BLOCKS_PER_SM = 4  # EmbeddingBackwardKernel.cu: the fused pass below this many per SM
MAX_BLOCK_SIZE = 1024  # SortingCommon.cuh (CUDA)
WARP_SIZE = 32
COUNT_BYTES = 8  # the segment counts' 0-d int64 tensors


def uses_fused_pass(call: EmbeddingBackward, multiprocessors: int | None) -> bool:
    """`use_fused_kernel` (module doc); a GPU whose SM count is not known takes the two-pass
    path, whose scratch is the larger where the fused one could run (p > 4 m)."""
    if multiprocessors is None:
        return False
    width = -(-call.dim // WARP_SIZE) * WARP_SIZE
    scatter_blocks = -(-call.segments * width // min(width, MAX_BLOCK_SIZE))
    return scatter_blocks < multiprocessors * MAX_ATOMIC_ACCUM_BLOCKS_PER_SM and call.partials > scatter_blocks * 4


def scratch_events(owner: Hashable, call: EmbeddingBackward, compute_capability: tuple[int, int] | None,
                   multiprocessors: int | None, cuda_version: int) -> tuple[list[Event], list[Event]]:
    """(before, after): the requests the backward makes before its output (`owner`, the output's
    key) and after it, each freed by the end of `after` (module doc for the order)."""
    n, ib = call.num_indices, call.index_bytes
    key = lambda name: ("embedding-scratch", owner, name)  # noqa: E731
    before, held = [], []  # held: alive until the function returns, freed in reverse
    if not call.indices_contiguous:
        before.append((key("indices"), n * ib))
        held.append(key("indices"))
    if not call.grad_contiguous:
        before.append((key("grad"), n * call.dim * call.grad_bytes))
        held.append(key("grad"))
    if n <= FEATURE_PATH_MAX_INDICES and not call.scale_grad_by_freq:
        return before, [(k, FREE) for k in reversed(held)]
    before += [(key("sorted"), n * ib), (key("orig"), n * ib), (key("range"), n * ib),
               (key("sort-temp"), cub.radix_sort_pairs_bytes(n, ib, compute_capability)),
               (key("sort-temp"), FREE), (key("range"), FREE)]
    held += [key("sorted"), key("orig")]
    if call.scale_grad_by_freq:
        before.append((key("count"), n * ib))
        held.append(key("count"))
    segments, partials = call.segments, call.partials
    after = [(key("segment_offsets"), n * ib), (key("segments"), COUNT_BYTES),
             (key("unique-keys"), n * ib),
             (key("unique-temp"), cub.unique_by_key_bytes(n, compute_capability, cuda_version)),
             (key("unique-temp"), FREE), (key("unique-keys"), FREE),
             (key("partials_per_segment"), segments * ib), (key("partials_per_segment_offset"), segments * ib),
             (key("scan-temp"), cub.exclusive_sum_bytes(segments, cuda_version)), (key("scan-temp"), FREE),
             (key("partials"), COUNT_BYTES), (key("partial_segment_offset"), partials * ib)]
    if uses_fused_pass(call, multiprocessors):
        after.append((key("partial_to_segment_idx"), partials * ib))
        if call.grad_bytes < 4:  # 16-bit: atomics into an fp32 copy of the weight's gradient
            after += [(key("grad_weight_acc"), call.num_weights * call.dim * 4), (key("grad_weight_acc"), FREE)]
        after.append((key("partial_to_segment_idx"), FREE))
    else:
        accumulator = max(call.grad_bytes, 4)  # acc_type: fp32 for 16-bit and fp32 gradients, fp64 for fp64
        after += [(key("grad_weight_per_segment"), partials * call.dim * accumulator),
                  (key("grad_weight_per_segment"), FREE)]
    after += [(key(name), FREE) for name in ("partial_segment_offset", "partials", "partials_per_segment_offset",
                                             "partials_per_segment", "segments", "segment_offsets")]
    return before, after + [(k, FREE) for k in reversed(held)]
