"""The temporary storage CUB's device algorithms take from the caching allocator, as torch's
CUDA embedding backward calls them (planner.embedding_scratch).

torch's wrappers (aten/src/ATen/cuda/cub.cuh, cub.cu, cub-RadixSortPairs.cuh, `CUB_WRAPPER`) ask
CUB for its temporary storage size and make one allocator request of exactly that. CUB lays
its temporaries out with `AliasTemporaries` (cub/util_temporary_storage.cuh): each part
rounded up to 256 B, plus 255 B once for aligning the whole. Sizes read from CCCL 3.0.x (the
CUB of CUDA 13.0 builds), for the calls torch makes:

- **Radix sort of pairs**, int64 keys (all 64 bits) and 8-byte values, n items as int64
  (`DeviceRadixSort::SortPairs`, dispatch_radix_sort.cuh `InvokeOnesweep`; n above the single
  tile, 2,304 items, which the embedding backward's 3,072 always is): per portion of up to
  PORTION items, 8 passes of 8-bit digits; bins of 8 passes x 256 digits x 8 B per portion, a
  lookback of 256 x 4 B per tile of the first portion, alternate key and value buffers of
  n x 8 B each (the outputs may not be overwritten), and 8 x 4 B of counters per portion. The
  tile is the onesweep policy's threads x items: 384 x 12 on sm90 and sm100 (`OnesweepPolicyKey64`,
  24 items scaled by `RegBoundScaling` for 8-byte values), 384 x 10 on sm80-sm89 (Policy800).
- **Unique by key**, int64 keys, int values (`DeviceSelect::UniqueByKey`): one tile-state
  allocation of (32 + tiles) descriptors of 16 B, itself aligned by a nested
  `AliasTemporaries` from CCCL 3.0 on, and an empty virtual shared memory part. Tiles of
  640 x 7 items on sm90, 384 x 10 on sm100, 256 x 7 on sm80-sm89.
- **Exclusive sum** of int64 with torch's own sum functor (`DeviceScan`, not a primitive
  operator, so CUB's default policy: 128 x 7 items per tile on every architecture): the same
  tile state.

Measured on the H200 (torch 2.11.0+cu130: benchmarks/results/gpu_runs/2026-12-04-e/traces): the
radix sort took 83,455 B for 4,096 items and 150,015 B for 8,192, the unique and the scan
1,279 B each, as these give. Before CCCL 3.0 (CUDA 12 builds, CUB 2.x) the tile state has no
nested alignment (1,023 B where 3.0 takes 1,279 B); the radix sort's layout is the same from
CUB 2.5 on.

Not derived: architectures before sm80 (their policies are not read: sm80's are used) and
int32 indices (other key policies: the int64 layout is used with the indices' size). A GPU
not known takes sm80's tiles, the smaller, so the larger temporaries.
"""

from __future__ import annotations

ALIGN = 256  # AliasTemporaries' ALIGN_BYTES
RADIX_BITS = 8  # ONESWEEP_RADIX_BITS
KEY_BITS = 64
RADIX_DIGITS = 1 << RADIX_BITS
RADIX_PASSES = -(-KEY_BITS // RADIX_BITS)
TILE_STATUS_PADDING = 32  # ScanTileState's descriptors beyond one per tile
TILE_DESCRIPTOR_BYTES = 16  # a 64-bit offset's status and value (ulonglong2)
SCAN_TILE = 128 * 7  # DeviceScan's default policy: 128 threads x 15 items, MemBoundScaling for 8 B
CCCL3_FROM_CUDA = 13000  # CUDA 13.0 ships CCCL 3.0: the tile state's nested alignment


def _aligned(nbytes: int) -> int:
    return -(-nbytes // ALIGN) * ALIGN


def _onesweep_tile(compute_capability: tuple[int, int] | None) -> int:
    return 384 * 12 if compute_capability is not None and compute_capability[0] >= 9 else 384 * 10


def _unique_tile(compute_capability: tuple[int, int] | None) -> int:
    major = compute_capability[0] if compute_capability is not None else 8
    return 640 * 7 if major == 9 else 384 * 10 if major >= 10 else 256 * 7


def radix_sort_pairs_bytes(items: int, item_bytes: int, compute_capability: tuple[int, int] | None) -> int:
    """Temporary storage of a onesweep radix sort of `items` 64-bit keys with values of
    `item_bytes` (module doc)."""
    tile = _onesweep_tile(compute_capability)
    portion_items = ((1 << 28) - 1) // tile * tile  # PORTION_SIZE: whole tiles below 2^28
    portions = -(-items // portion_items)
    tiles = -(-min(items, portion_items) // tile)
    bins = portions * RADIX_PASSES * RADIX_DIGITS * 8
    lookback = tiles * RADIX_DIGITS * 4
    counters = portions * RADIX_PASSES * 4
    return (_aligned(bins) + _aligned(lookback) + 2 * _aligned(items * item_bytes) + _aligned(counters)
            + ALIGN - 1)


def _tile_state_bytes(tiles: int, cuda_version: int) -> int:
    state = _aligned(TILE_DESCRIPTOR_BYTES * (TILE_STATUS_PADDING + tiles))
    if cuda_version >= CCCL3_FROM_CUDA:  # the tile state's own AliasTemporaries, then an empty part
        return _aligned(state + ALIGN - 1) + ALIGN - 1
    return state + ALIGN - 1


def unique_by_key_bytes(items: int, compute_capability: tuple[int, int] | None, cuda_version: int) -> int:
    """Temporary storage of a unique-by-key over `items` keys, in a build for `cuda_version`
    (13000 for 13.0; module doc)."""
    return _tile_state_bytes(-(-items // _unique_tile(compute_capability)), cuda_version)


def exclusive_sum_bytes(items: int, cuda_version: int) -> int:
    """Temporary storage of torch's int64 exclusive sum over `items` (module doc)."""
    return _tile_state_bytes(-(-items // SCAN_TILE), cuda_version)
