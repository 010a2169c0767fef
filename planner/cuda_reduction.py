"""The global-memory workspace CUDA's reduction kernel takes from the caching allocator.

torch's reductions on CUDA (sum, mean, norm, ...: aten/src/ATen/native/cuda/Reduce.cuh,
`gpu_reduce_kernel`) split a long reduction across thread blocks when each output has
many inputs and there are few outputs; the blocks then meet in a buffer of
`global_memory_size()` bytes plus `semaphore_size()` bytes of semaphores, both allocated
through the caching allocator for the kernel's launch and freed after it. A fake kernel
allocates only the output, so a probe never sees them.

Measured on an H200 (benchmarks/results/gpu_memory_snapshot.md): transformers' Adafactor's
`update.mean(dim=-2)` over DistilBERT's 28,996 x 768 fp32 word embeddings took
138,412,032 B at transformers/optimization.py:1267, which `column_reduction_workspace_bytes`
gives to the byte.

This module covers the reduction over dim -2 of a contiguous tensor (the column reductions
Adafactor's factored second moments make), following `setReduceConfig` and
`ReduceConfig` of torch 2.x's Reduce.cuh:
- TensorIterator puts the reduced dimension first; it is not the fastest-moving one, so
  threads run along the outputs (`dim0 = num_outputs`, `dim1 = inputs_per_output`), and
  outputs are vectorised by `get_output_vec_size`: 4, halved until it divides the output
  width and the other strides (in elements);
- `set_block_dimension`: at most 512 / output_vec_size threads (512: `max_reduce_threads`
  for any dtype but complex double); block width min(pow2(dim0), 32), height
  min(pow2(dim1), threads / width), width min(pow2(dim0), threads / height), where pow2(n)
  is n's largest power of two below the limit, else the limit;
- the width splits the outputs; the height splits the inputs when each thread still has
  min(16 x height, 256) values or more;
- with the inputs split and at least 256 values per thread and `grid.x` = ceil(outputs /
  vec / width) at most the GPU's target grid (SMs x (max resident threads per SM /
  threads per block)), `ctas_per_output` = max(min(ceil(target / grid.x), ceil(values per
  thread / 16)), ceil(values per thread / 256)), and above 1 the reduction goes global;
- `global_memory_size` = accumulator bytes x outputs x ctas_per_output x block width x
  vec (the block does not reduce along x here); `semaphore_size` = 4 x grid.x.
The workspace depends on the GPU's SM count and resident threads per SM (`sm_grids`).

It also covers the reduction of a whole contiguous tensor to one value (`tensor.norm()`, which
both Adafactors take per tensor: `full_reduction_requests`), where the reduced dimension is the
fastest-moving one: the input is vectorised by 4 when it has more than 128 elements, the block
is one row of min(pow2(elements / 4), 512) threads along the input, each output's inputs split
across `ctas_per_output` blocks by the same rule, and `global_memory_size` = accumulator bytes x
ctas_per_output (the block reduces along x); semaphores 4 B. Measured on the H200 (DistilBERT's
Trainer run, `_rms`): 2,112 B for the 28,996 x 768 word embeddings, 192 B for a 393,216-element
tensor, none for a 768-element one.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Hashable
from dataclasses import dataclass

from planner.cuda_allocator import FREE
from planner.optimizer_state import allocation
from planner.scenario import Device

MAX_REDUCE_THREADS = 512  # Reduce.cuh max_reduce_threads: 512 but for complex double (256)
WARP_SIZE = 32
MIN_VALUES_PER_THREAD = 16
MAX_VALUES_PER_THREAD = 256
OUTPUT_VEC_SIZE = 4  # get_output_vec_size's start
INPUT_VEC_SIZE = 4  # gpu_reduce_kernel's input_vec_size (vt0): inputs per load when vectorised


@dataclass(frozen=True)
class SmGrid:
    """What a reduction's grid is sized by: cudaDeviceProp multiProcessorCount and
    maxThreadsPerMultiProcessor."""

    sm_count: int
    max_threads_per_sm: int


# Resident threads per SM by compute capability (CUDA C++ Programming Guide, "Technical
# Specifications per Compute Capability": maximum number of resident threads per SM).
_THREADS_PER_SM = {(7, 0): 2048, (7, 5): 1024, (8, 0): 2048, (8, 6): 1536, (8, 9): 1536, (9, 0): 2048}


@functools.lru_cache(maxsize=1)
def sm_grids() -> dict[str, SmGrid]:
    """The grid of every CUDA GPU planner.gpus holds, by key."""
    from planner.gpus import GPUS

    return {key: SmGrid(gpu.multiprocessors, _THREADS_PER_SM[gpu.compute_capability])
            for key, gpu in GPUS.items() if gpu.multiprocessors is not None}


def _pow2_below(n: int, limit: int) -> int:
    return limit if n >= limit else 1 << (max(n, 1).bit_length() - 1)


def _output_vec_size(rows: int, cols: int) -> int:
    vec = OUTPUT_VEC_SIZE
    for n in (cols, cols * rows):  # the output width, then the other dims' strides in elements
        while n % vec:
            vec //= 2
    return vec


def column_reduction_requests(shape: tuple[int, ...], grid: SmGrid, accumulator_bytes: int = 4) -> tuple[int, int]:
    """(workspace, semaphores): the two buffers, in bytes as requested, that the reduction of a
    contiguous tensor of `shape` over dim -2 allocates beside its output on a GPU of `grid`,
    one after the other, and frees after its launch (semaphores first); (0, 0) when it does
    not go global (module doc)."""
    if len(shape) < 2:
        return 0, 0
    rows, cols = shape[-2], shape[-1]
    batch = math.prod(shape[:-2])
    outputs, inputs = batch * cols, rows
    if outputs == 0 or inputs == 0:
        return 0, 0
    vec = _output_vec_size(rows, cols)
    dim0, dim1 = outputs // vec, inputs
    max_threads = MAX_REDUCE_THREADS // vec
    width = min(_pow2_below(dim0, max_threads), WARP_SIZE)
    height = min(_pow2_below(dim1, max_threads), max_threads // width)
    width = min(_pow2_below(dim0, max_threads), max_threads // height)
    step_output, step_input = width, 1  # the width splits the outputs
    if -(-inputs // step_input) < min(height * MIN_VALUES_PER_THREAD, MAX_VALUES_PER_THREAD):
        return 0, 0  # each warp takes its own outputs: no split of the inputs, no global reduction
    step_input = height
    values_per_thread = -(-inputs // step_input)
    grid_x = -(-(outputs // vec) // step_output)
    target = grid.sm_count * (grid.max_threads_per_sm // (width * height))
    if values_per_thread < MAX_VALUES_PER_THREAD or grid_x > target:
        return 0, 0
    ctas = max(min(-(-target // grid_x), -(-values_per_thread // MIN_VALUES_PER_THREAD)),
               -(-values_per_thread // MAX_VALUES_PER_THREAD))
    if ctas <= 1:
        return 0, 0
    return accumulator_bytes * outputs * ctas * width * vec, 4 * grid_x


def column_reduction_workspace_bytes(shape: tuple[int, ...], grid: SmGrid, accumulator_bytes: int = 4) -> int:
    """Bytes the reduction of a contiguous tensor of `shape` over dim -2 allocates beside its
    output on a GPU of `grid` (workspace and semaphores, each in 512-byte blocks), 0 when it
    does not go global (module doc)."""
    on_cuda = allocation(Device.CUDA)
    return sum(on_cuda(n) for n in column_reduction_requests(shape, grid, accumulator_bytes) if n)


@functools.lru_cache(maxsize=4096)
def largest_column_reduction_workspace_bytes(shape: tuple[int, ...], accumulator_bytes: int = 4) -> int:
    """The workspace on the GPU of planner.gpus that makes the largest: a plan's estimate
    takes no GPU, and a smaller grid never needs more (`ctas_per_output` grows with it)."""
    return max(column_reduction_workspace_bytes(shape, grid, accumulator_bytes) for grid in sm_grids().values())


@functools.lru_cache(maxsize=4096)
def largest_column_reduction_requests(shape: tuple[int, ...], accumulator_bytes: int = 4) -> tuple[int, int]:
    """`column_reduction_requests` on the GPU of planner.gpus whose workspace is the largest."""
    return max((column_reduction_requests(shape, grid, accumulator_bytes) for grid in sm_grids().values()),
               key=lambda requests: (sum(requests), requests))


def full_reduction_requests(numel: int, grid: SmGrid, accumulator_bytes: int = 4) -> tuple[int, int]:
    """(workspace, semaphores): what reducing a contiguous tensor of `numel` elements to one
    value allocates beside its output on a GPU of `grid` (module doc); (0, 0) when it does not
    go global."""
    dim0 = numel // INPUT_VEC_SIZE if numel > 128 else numel  # vectorize_input
    width = _pow2_below(dim0, MAX_REDUCE_THREADS)  # one row of threads along the input
    values_per_thread = -(-numel // width)
    target = grid.sm_count * (grid.max_threads_per_sm // width)
    if values_per_thread < MAX_VALUES_PER_THREAD:
        return 0, 0
    ctas = max(min(target, -(-values_per_thread // MIN_VALUES_PER_THREAD)),
               -(-values_per_thread // MAX_VALUES_PER_THREAD))
    if ctas <= 1:
        return 0, 0
    return accumulator_bytes * ctas, 4


@functools.lru_cache(maxsize=4096)
def largest_full_reduction_requests(numel: int, accumulator_bytes: int = 4) -> tuple[int, int]:
    """`full_reduction_requests` on the GPU of planner.gpus whose workspace is the largest."""
    return max((full_reduction_requests(numel, grid, accumulator_bytes) for grid in sm_grids().values()),
               key=lambda requests: (sum(requests), requests))


def launch_events(owner: Hashable, workspace: int, semaphores: int) -> list[tuple[Hashable, int]]:
    """A global reduction's launch as caching-allocator events: its workspace, then its
    semaphores, made after its output (`owner`, the output's key) and freed on return,
    semaphores first; [] when it does not go global (no workspace)."""
    if not workspace:
        return []
    return [(("reduction-workspace", owner), workspace), (("reduction-semaphores", owner), semaphores),
            (("reduction-semaphores", owner), FREE), (("reduction-workspace", owner), FREE)]
