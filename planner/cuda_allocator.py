"""A model of PyTorch's CUDA caching allocator that replays an allocation trace and
reports what `torch.cuda.max_memory_allocated` / `max_memory_reserved` would read.

Written from c10/cuda/CUDACachingAllocator.cpp (DeviceCachingAllocator, a current copy of
pytorch main that reads AcceleratorAllocatorConfig::large_segment_size() and
max_non_split_rounding_size(), the API the torch 2.13 headers installed here declare) and
c10/core/AllocatorConfig.h as installed with torch 2.13 (the constants and option
defaults). Pure Python, no torch import. One device, one stream. Every rule below names
the source function it follows.

Interface
---------
Events are `(key, nbytes)` pairs: `nbytes >= 0` allocates `nbytes` under `key` (any
hashable; a key must be freed before it is allocated again), `nbytes == FREE` (-1)
frees `key`. `Alloc(key, nbytes)` and `Free(key)` build the same tuples.

    replay(events, *, prefix=(), repeats=1, expandable_segments=False,
           capacity_bytes=None, allowed_memory_bytes=None, max_split_size_bytes=None,
           roundup_power2_divisions=None) -> ReplayResult

replays `prefix` once (model load: weights, optimizer state), then `events` `repeats`
times, and reads the peaks over the last repetition only (the stats are reset before
it, as `torch.cuda.reset_peak_memory_stats()` would be): `repeats=2` gives the steady
state of a training step. `capacity_bytes` is what cudaMalloc can still get on the card
(None: unlimited); a request that cannot be met after the allocator has released its
cache ends the replay with `out_of_memory=True` and the index of that event.
With `capacity_bytes` and `headroom=True` the result also says by how much the capacity
could shrink or must grow (`headroom_bytes`, below); the other figures are unchanged.
`allowed_memory_bytes` is the limit `torch.cuda.set_per_process_memory_fraction` sets
(allowed_memory_maximum), which torch checks differently: against the segment size a
request would cudaMalloc, even with expandable segments, whose page mapping can then
pass the limit by up to a page.

For finer control, `CachingAllocator(settings, capacity_bytes=None,
allowed_memory_bytes=None)` is the stateful model: `malloc(key, nbytes)`, `free(key)`,
`reset_peak_stats()`, `empty_cache()`, `replay(events)`; properties `allocated_bytes`,
`reserved_bytes`, `peak_allocated_bytes`, `peak_reserved_bytes`,
`reserved_at_peak_allocated_bytes`, `reserved_bytes_small_pool` /
`reserved_bytes_large_pool`, `segments` (cudaMalloc'd), `expandable_segments`;
`live_keys()`, `releasable_bytes()`, `least_room_bytes` and `check_invariants()` (an
O(blocks) consistency check for tests).
`malloc` raises `CudaOutOfMemoryError` where torch would raise torch.OutOfMemoryError.
`replay(events)` is `malloc` and `free` per event; with the default settings (no expandable
segments, max_split_size or power-of-two rounding) it runs them written out in one loop, a
quarter faster (`benchmarks/allocator_speed.py`), leaving the same blocks.

Rules modelled (source function in CUDACachingAllocator.cpp unless said otherwise)
------------------------------------------------------------------------------
- Sizes round up to kMinBlockSize = 512 B (`round_size`); with
  `roundup_power2_divisions:N` sizes above 512*N round to the next of N divisions
  between powers of two (`roundup_power2_next_division`). One N for every size
  interval (the option's plain-integer form).
- Requests <= kSmallSize (1 MiB) use the small pool, larger ones the large pool
  (`get_pool`). A new segment (`get_allocation_size`) is kSmallBuffer (2 MiB) for a small
  request, large_segment_size (20 MiB) for one below kMinLargeAlloc (10 MiB), else the
  request rounded up to kRoundLarge (2 MiB).
- Best fit (`get_free_block`): the free block with the smallest size >= the request,
  ties to the lowest address (the pool's std::set orders by (stream, size, address),
  `BlockComparatorSize`). With max_split_size set, a request below it never takes a
  block at or above it, and a request at or above it takes a block only if the block is
  less than the request + max_non_split_rounding (20 MiB default).
- Splitting (`should_split`): small pool (or expandable segments) when the remainder is
  >= 512 B; large pool when the request is below max_split_size and the remainder is
  > 1 MiB. An unsplit block counts its whole size as allocated (`alloc_found_block`).
- Freeing merges the block with free neighbours of its own segment
  (`free_block` / `try_merge_blocks`); blocks of different segments never merge.
- When no cached block fits (`malloc`): cudaMalloc a new segment (`alloc_block`, which
  first refuses when reserved + the segment size would pass allowed_memory_maximum, the
  per-process memory fraction); if that fails, release oversize cached blocks when
  max_split_size is set (`release_available_cached_blocks`), retry; then release every
  unsplit cached segment (`release_cached_blocks` / `release_blocks` /
  `release_block`), retry; then OOM.
  `empty_cache()` is `release_cached_blocks` (`emptyCache`).
- Expandable segments (`expandable_segments:True`): one segment per pool grows by
  mapping pages, kSmallBuffer (2 MiB) pages for the small pool and large_segment_size
  (20 MiB) pages for the large pool (`find_expandable_block`; the Note [Expandable
  Segments] says "2MiB pages for our small pool and 20MiB pages for our large pool").
  A request no free block fits maps pages at the lowest address with enough free or
  unmapped room behind it (`find_expandable_block`, `try_allocate_expandable_block`,
  `map_block`); reserved = mapped pages. Best fit counts a free block followed by
  unmapped space at its expandable size (`get_free_block`). A free never unmaps: pages
  are unmapped only by `release_cached_blocks` (empty_cache, or the OOM retry), which
  unmaps every whole page of every free block (`unmap_block`) and drops a segment left
  with nothing mapped (`release_expandable_segment`). A mapping is all-or-nothing per
  call (`ExpandableSegment::map` releases the pages it made when cuMemCreate fails).

Headroom
--------
Whether a replay within a capacity runs out of memory is all a fit search needs, but a
yes or no per replay makes it bisect a sequence length token by token (a 7B step's
replay takes about 0.15 s on two cores). A replay with `headroom=True` also measures how
close it came: a cudaMalloc (or a page mapping) can fail only where the allocator needs
new memory, and then it first releases its cache, so at each such moment the memory it
needs at least is what it keeps after that release (`reserved_bytes -
releasable_bytes()`) plus the new segment. `headroom_bytes` is the capacity less the
largest such need: >= 0 exactly when the replay never runs out of memory (the sign is
the replay's answer). Where it runs out, `headroom_bytes` is minus what the request that
ran out lacked after the release: how far over it was at that moment; the step may lack
more later (going on to measure that would cost a whole replay, where an out-of-memory
replay stops at its first shortfall, often early in the step). Either way it is a measure along this replay's own order of releases, not
the capacity another replay would need: a guide for where to test next, never the test
(planner.fit). For expandable segments the new segment is the request rounded up to
whole pages (the mapping may need fewer).

Known limitations
-----------------
One device, one stream: no record_stream / cross-stream events, no CUDA graph or
`torch.cuda.MemPool` private pools, no garbage_collection_threshold (torch runs that
collector only with a memory fraction set; its default is off), no free-memory
callbacks. The address cudaMalloc returns is modelled as a bump pointer
(new segments sit above all earlier ones; freed address ranges are not reused), which
only decides ties between equal-size free blocks. The driver's addresses do not follow it:
on the H200's records it put some new segments below earlier ones, and those ties moved
two runs' reserved peaks (BERT-base 6 MiB, SmolLM2-360M 30 MiB below the run's). Given the
records' own addresses (`CachingAllocator(segment_address=...)`) the model opens every
segment of every record without expandable segments as the run did and reserves what it
reserved (tests/test_gpu_traces.py). An expandable segment's address space
is unbounded here (torch reserves 1 1/8 of the device's memory and opens a second
segment when it runs out). cudaMalloc is assumed to succeed exactly when the reserved
total plus the request fits `capacity_bytes`; the driver's own granularity, the CUDA
context and other processes are outside this model (the caller subtracts them from the
capacity). Per-interval roundup_power2_divisions lists are not modelled. Nothing here
has been checked against a GPU yet: benchmarks/allocator_gpu_check.py is the prepared
check (every event's memory_allocated / memory_reserved against real torch).
"""

from __future__ import annotations

from bisect import bisect_left, insort
from collections.abc import Callable, Hashable, Iterable, Sequence
from dataclasses import dataclass
from typing import NamedTuple

from planner.units import MIB

# c10/core/AllocatorConfig.h (torch 2.13): the allocator's constants.
K_MIN_BLOCK_SIZE = 512  # kMinBlockSize: all sizes are rounded to at least 512 bytes
K_SMALL_SIZE = 1 * MIB  # kSmallSize: largest "small" allocation is 1 MiB
K_SMALL_BUFFER = 2 * MIB  # kSmallBuffer: "small" allocations are packed in 2 MiB blocks
K_MIN_LARGE_ALLOC = 10 * MIB  # kMinLargeAlloc: 1-10 MiB requests may use kLargeBuffer
K_ROUND_LARGE = 2 * MIB  # kRoundLarge: round up large allocations to 2 MiB
# AcceleratorAllocatorConfig::large_segment_size_ default 20971520 (kLargeBuffer), also
# the default max_non_split_rounding_size and the smallest max_split_size the parser
# accepts (parseMaxSplitSize: min_allowed_split_size_mb = kLargeBuffer / kMB).
K_LARGE_BUFFER = 20 * MIB

FREE = -1  # the nbytes of a free event
Event = tuple[Hashable, int]  # (key, nbytes) allocates; (key, FREE) frees

# Address space given to one expandable segment (see Known limitations).
_EXPANDABLE_ADDRESS_SPACE = 1 << 48
_ADDR_BITS = 72  # free-list key = size << 72 | address (addresses stay below 2**72)


class Alloc(NamedTuple):
    key: Hashable
    nbytes: int


class Free(NamedTuple):
    key: Hashable
    nbytes: int = FREE


class CudaOutOfMemoryError(Exception):
    """The allocator could not get memory even after releasing its cache (torch raises
    torch.OutOfMemoryError from `malloc` here)."""

    def __init__(self, request_bytes: int, allocation_bytes: int, allocated_bytes: int,
                 reserved_bytes: int):
        # Message as torch words it: "Tried to allocate <alloc_size>".
        super().__init__(
            f"CUDA out of memory. Tried to allocate {allocation_bytes} B for a request of "
            f"{request_bytes} B; {allocated_bytes} B allocated, {reserved_bytes} B reserved"
        )
        self.request_bytes = request_bytes
        self.event_index: int | None = None  # set by CachingAllocator.replay
        self.shortfall_bytes: int | None = None  # what cudaMalloc (or the mapping) lacked, after the release
        self.allocation_bytes = allocation_bytes
        self.allocated_bytes = allocated_bytes
        self.reserved_bytes = reserved_bytes


@dataclass(frozen=True)
class AllocatorSettings:
    """The PYTORCH_CUDA_ALLOC_CONF options the model honours, in bytes."""

    expandable_segments: bool = False
    max_split_size_bytes: int | None = None  # None: unlimited (torch's default)
    max_non_split_rounding_bytes: int = K_LARGE_BUFFER
    roundup_power2_divisions: int | None = None  # None or 0/1: off (torch's default)
    large_segment_bytes: int = K_LARGE_BUFFER

    def __post_init__(self):
        # AcceleratorAllocatorConfig::parseMaxSplitSize refuses values below kLargeBuffer.
        if self.max_split_size_bytes is not None and self.max_split_size_bytes < K_LARGE_BUFFER:
            raise ValueError("max_split_size_bytes must be at least 20 MiB (torch's minimum)")
        if self.max_non_split_rounding_bytes < 0:
            raise ValueError("max_non_split_rounding_bytes must be >= 0")
        divisions = self.roundup_power2_divisions
        # parseRoundUpPower2Divisions: the value must be a power of two.
        if divisions is not None and divisions > 1 and divisions & (divisions - 1):
            raise ValueError("roundup_power2_divisions must be a power of two")
        if self.large_segment_bytes <= 0 or self.large_segment_bytes % K_ROUND_LARGE:
            raise ValueError("large_segment_bytes must be a positive multiple of 2 MiB")


@dataclass(frozen=True)
class ReplayResult:
    """What a replay read, as torch.cuda.memory_stats would report it."""

    peak_allocated_bytes: int  # max_memory_allocated over the measured repetition
    peak_reserved_bytes: int  # max_memory_reserved over the measured repetition
    reserved_at_peak_allocated_bytes: int  # reserved when allocated first hit its peak
    allocated_bytes: int  # memory_allocated at the end (or at the OOM)
    reserved_bytes: int  # memory_reserved at the end (or at the OOM)
    segments: int  # live cudaMalloc segments (memory_stats "segment.all.current")
    expandable_segments: int  # live expandable segments (0 without the option)
    events_replayed: int  # events completed before the end or the OOM
    out_of_memory: bool
    oom_event_index: int | None = None  # index into prefix + events * repeats
    oom_request_bytes: int | None = None
    # With a capacity and headroom=True (see Headroom): >= 0, the least room left at a moment
    # needing new memory; < 0, minus what the request that ran out lacked. Else None.
    headroom_bytes: int | None = None

    def __post_init__(self):
        if self.peak_reserved_bytes < self.peak_allocated_bytes:
            raise ValueError("peak reserved below peak allocated")
        if self.out_of_memory != (self.oom_event_index is not None):
            raise ValueError("oom_event_index is set exactly when out_of_memory")
        if self.headroom_bytes is not None and (self.headroom_bytes < 0) != self.out_of_memory:
            raise ValueError("headroom is negative exactly when the replay ran out of memory")


class _Segment:
    __slots__ = ("base", "expandable", "page_bytes")

    def __init__(self, base: int, expandable: bool, page_bytes: int):
        self.base = base
        self.expandable = expandable
        self.page_bytes = page_bytes


class _Block:
    # Block in CUDACachingAllocator.cpp: a range of one segment, free or allocated,
    # linked to its neighbours in the same segment.
    __slots__ = ("addr", "allocated", "mapped", "next", "pool", "prev", "seg", "size")

    def __init__(self, size: int, addr: int, seg: _Segment, pool: _Pool, mapped: bool = True):
        self.size = size
        self.addr = addr
        self.prev: _Block | None = None
        self.next: _Block | None = None
        self.allocated = False
        self.mapped = mapped
        self.seg = seg
        self.pool = pool


class _Pool:
    # BlockPool: `blocks` (free mapped blocks, ordered by size then address) as a sorted
    # list of int keys, and `unmapped` (ordered by address) for expandable segments.
    __slots__ = ("by_key", "keys", "reserved", "small", "unmapped", "unmapped_addrs")

    def __init__(self, small: bool):
        self.small = small
        self.keys: list[int] = []
        self.by_key: dict[int, _Block] = {}
        self.unmapped_addrs: list[int] = []
        self.unmapped: dict[int, _Block] = {}
        self.reserved = 0

    def insert(self, block: _Block) -> None:
        k = (block.size << _ADDR_BITS) | block.addr
        insort(self.keys, k)
        self.by_key[k] = block

    def remove(self, block: _Block) -> None:
        k = (block.size << _ADDR_BITS) | block.addr
        keys = self.keys
        del keys[bisect_left(keys, k)]
        del self.by_key[k]

    def insert_unmapped(self, block: _Block) -> None:
        insort(self.unmapped_addrs, block.addr)
        self.unmapped[block.addr] = block

    def remove_unmapped(self, block: _Block) -> None:
        addrs = self.unmapped_addrs
        del addrs[bisect_left(addrs, block.addr)]
        del self.unmapped[block.addr]


def _roundup_power2_next_division(size: int, divisions: int) -> int:
    # roundup_power2_next_division: round up to the next of `divisions` equal steps
    # between the powers of two around `size`.
    if size & (size - 1) == 0:
        return size
    power2_floor = 1 << (size.bit_length() - 1)
    division = power2_floor >> (divisions.bit_length() - 1)
    if division == 0:
        return power2_floor << 1
    floor = size & ~(division - 1)
    return size if floor == size else floor + division


def _split_front(block: _Block, size: int, pool: _Pool) -> _Block:
    # alloc_found_block: the front `size` bytes of a free block become a new block; the rest
    # stays free in the pool.
    front = _Block(size, block.addr, block.seg, pool)
    prev = front.prev = block.prev
    if prev is not None:
        prev.next = front
    front.next = block
    block.prev = front
    block.addr += size
    block.size -= size
    pool.insert(block)
    return front


class CachingAllocator:
    """The stateful model of one device's DeviceCachingAllocator on one stream."""

    def __init__(self, settings: AllocatorSettings | None = None, *,
                 capacity_bytes: int | None = None, allowed_memory_bytes: int | None = None,
                 headroom: bool = False, segment_address: Callable[[int], int] | None = None):
        if capacity_bytes is not None and capacity_bytes < 0:
            raise ValueError("capacity_bytes must be >= 0")
        if headroom and capacity_bytes is None:
            raise ValueError("headroom is measured against a capacity: give capacity_bytes")
        # See Headroom in the module docstring.
        self._headroom = headroom
        self._least_room: int | None = None
        self._map_shortfall = 0
        if allowed_memory_bytes is not None and allowed_memory_bytes < 0:
            raise ValueError("allowed_memory_bytes must be >= 0")
        self.allowed_memory_bytes = allowed_memory_bytes
        self.settings = settings if settings is not None else AllocatorSettings()
        self.capacity_bytes = capacity_bytes
        self._expandable = self.settings.expandable_segments
        self._max_split = self.settings.max_split_size_bytes
        divisions = self.settings.roundup_power2_divisions
        self._divisions = divisions if divisions is not None and divisions > 1 else 0
        self._small = _Pool(small=True)
        self._large = _Pool(small=False)
        self._live: dict[Hashable, _Block] = {}
        self._empty: set[Hashable] = set()  # keys allocated with 0 bytes: no block
        self.retry_releases = 0  # times malloc released the whole cache to retry (near the capacity)
        self._next_addr = 1 << 40  # bump pointer standing in for cudaMalloc's addresses
        # Where cudaMalloc puts a new segment of n bytes, when the caller knows (a record's own
        # addresses: tests/test_gpu_traces.py); None: the bump pointer (Known limitations).
        self._segment_address = segment_address
        self._allocated = 0
        self._reserved = 0
        self._peak_allocated = 0
        self._peak_reserved = 0
        self._reserved_at_peak = 0
        self._cuda_segments = 0
        self._expandable_segments = 0

    # --- stats -------------------------------------------------------------------
    @property
    def allocated_bytes(self) -> int:
        return self._allocated

    @property
    def reserved_bytes(self) -> int:
        return self._reserved

    @property
    def peak_allocated_bytes(self) -> int:
        return self._peak_allocated

    @property
    def peak_reserved_bytes(self) -> int:
        return self._peak_reserved

    @property
    def reserved_at_peak_allocated_bytes(self) -> int:
        return self._reserved_at_peak

    @property
    def reserved_bytes_small_pool(self) -> int:
        return self._small.reserved

    @property
    def reserved_bytes_large_pool(self) -> int:
        return self._large.reserved

    @property
    def segments(self) -> int:
        """Live cudaMalloc segments, as memory_stats()["segment.all.current"] counts them
        (alloc_block / release_block; mapping pages of an expandable segment is not a
        segment there)."""
        return self._cuda_segments

    @property
    def expandable_segments(self) -> int:
        """Live expandable segments (find_expandable_block / release_expandable_segment).
        One whose first mapping failed stays, with nothing mapped: release_blocks only
        visits segments with a free mapped block."""
        return self._expandable_segments

    def live_keys(self) -> list[Hashable]:
        return list(self._live) + list(self._empty)

    def reset_peak_stats(self) -> None:
        # resetPeakStats / reset_peak_stat: peak = current.
        self._peak_allocated = self._allocated
        self._peak_reserved = self._reserved
        self._reserved_at_peak = self._reserved

    # --- public operations ----------------------------------------------------------
    def round_size(self, nbytes: int) -> int:
        # round_size
        if nbytes < K_MIN_BLOCK_SIZE:
            return K_MIN_BLOCK_SIZE
        divisions = self._divisions
        if divisions and nbytes > K_MIN_BLOCK_SIZE * divisions:
            return _roundup_power2_next_division(nbytes, divisions)
        return -(-nbytes // K_MIN_BLOCK_SIZE) * K_MIN_BLOCK_SIZE

    def allocation_size(self, size: int) -> int:
        # get_allocation_size
        if size <= K_SMALL_SIZE:
            return K_SMALL_BUFFER
        if size < K_MIN_LARGE_ALLOC:
            return self.settings.large_segment_bytes
        return -(-size // K_ROUND_LARGE) * K_ROUND_LARGE

    def malloc(self, key: Hashable, nbytes: int) -> int:
        """Allocate `nbytes` under `key`; returns the block's size (rounded bytes)."""
        if key in self._live or key in self._empty:
            raise ValueError(f"key {key!r} is already allocated")
        if nbytes < 0:
            raise ValueError("nbytes must be >= 0")
        if nbytes == 0:
            # NativeCachingAllocator::allocate skips malloc for size 0 (null data pointer).
            self._empty.add(key)
            return 0
        size = self.round_size(nbytes)
        pool = self._small if size <= K_SMALL_SIZE else self._large  # get_pool
        block = self._get_free_block(pool, size)
        if block is None:
            block = self._new_memory(pool, size, nbytes)
        # should_split
        remaining = block.size - size
        if pool.small or self._expandable:
            split = remaining >= K_MIN_BLOCK_SIZE
        else:
            split = remaining > K_SMALL_SIZE and (self._max_split is None or size < self._max_split)
        if split:
            block = _split_front(block, size, pool)
        block.allocated = True
        self._live[key] = block
        allocated = self._allocated + block.size  # alloc_found_block: the block's size
        self._allocated = allocated
        if allocated > self._peak_allocated:
            self._peak_allocated = allocated
            self._reserved_at_peak = self._reserved
        return block.size

    def free(self, key: Hashable) -> None:
        """Free the allocation made under `key` (free / free_block)."""
        block = self._live.pop(key, None)
        if block is None:
            if key in self._empty:
                self._empty.discard(key)
                return
            raise KeyError(f"key {key!r} is not allocated")
        block.allocated = False
        self._allocated -= block.size
        # free_block: merge with the free neighbours of the same segment.
        self._try_merge(block, block.prev)
        self._try_merge(block, block.next)
        block.pool.insert(block)

    def _new_memory(self, pool: _Pool, size: int, nbytes: int) -> _Block:
        # malloc, where no cached block fits: alloc_block, then release_available_cached_blocks
        # and retry, then release_cached_blocks and retry; then out of memory.
        alloc_size = self.allocation_size(size)
        if self._headroom:
            self._note_room(pool, size, alloc_size)
        block = self._alloc_block(pool, size, alloc_size)
        if block is None and self._release_available_cached_blocks(pool, size):
            block = self._alloc_block(pool, size, alloc_size)
        if block is None:
            self.retry_releases += 1
            self._release_cached_blocks()
            block = self._alloc_block(pool, size, alloc_size)
        if block is None:
            error = CudaOutOfMemoryError(nbytes, alloc_size, self._allocated, self._reserved)
            if self.capacity_bytes is not None:
                error.shortfall_bytes = max(K_MIN_BLOCK_SIZE, self._map_shortfall if self._expandable
                                            else self._reserved + alloc_size - self.capacity_bytes)
            raise error
        return block

    def empty_cache(self) -> None:
        """torch.cuda.empty_cache(): emptyCache -> release_cached_blocks."""
        self._release_cached_blocks()

    def releasable_bytes(self) -> int:
        """What `empty_cache()` would give back now (release_cached_blocks): every free
        segment of its own, and the whole pages inside free blocks of expandable segments."""
        total = 0
        for pool in (self._large, self._small):
            for block in pool.by_key.values():
                seg = block.seg
                if seg.expandable:
                    page = seg.page_bytes
                    offset = block.addr - seg.base
                    pages = (offset + block.size) // page - -(-offset // page)
                    if pages > 0:
                        total += pages * page
                elif block.prev is None and block.next is None:
                    total += block.size
        return total

    @property
    def least_room_bytes(self) -> int | None:
        """With headroom=True, the least room left so far at a moment needing new memory (see
        Headroom in the module docstring); None without it or before any such moment."""
        return self._least_room

    def replay(self, events: Iterable[tuple[Hashable, int]], start_index: int = 0) -> int:
        """Replay events; returns how many ran. Raises CudaOutOfMemoryError with
        `event_index` (counted from `start_index`) set on an OOM."""
        if not (self._expandable or self._max_split is not None or self._divisions):
            return self._replay_plain(events, start_index)
        malloc = self.malloc
        free = self.free
        i = start_index
        try:
            for key, nbytes in events:
                if nbytes == FREE:
                    free(key)
                else:
                    malloc(key, nbytes)
                i += 1
        except CudaOutOfMemoryError as error:
            error.event_index = i
            raise
        return i - start_index

    def _replay_plain(self, events: Iterable[tuple[Hashable, int]], start_index: int) -> int:
        # `malloc` and `free` written out in one loop, for the settings a training step's
        # replay has by default (no expandable segments, max_split_size or power-of-two
        # rounding): every block is mapped, a large block splits when more than 1 MiB is
        # left, and blocks merge with any free neighbour. The same rules as the two methods,
        # without a call per event (a 7B step is tens of thousands of events):
        # tests/test_cuda_allocator.py replays random traces both ways and compares every
        # block. New memory, and keys freed or allocated wrongly, go through the methods;
        # the allocated total and its peak are kept in locals and written back around them.
        live, empty = self._live, self._empty
        small = self._small
        large = self._large
        allocated, peak = self._allocated, self._peak_allocated
        i = start_index
        try:
            for key, nbytes in events:
                if nbytes == FREE:
                    block = live.pop(key, None)
                    if block is None:
                        self._allocated = allocated
                        self.free(key)  # a zero-byte key, or the KeyError
                        i += 1
                        continue
                    block.allocated = False
                    allocated -= block.size
                    pool = block.pool
                    keys = pool.keys
                    by_key = pool.by_key
                    prev = block.prev
                    if prev is not None and not prev.allocated:  # [prev block]: absorb prev
                        k = (prev.size << _ADDR_BITS) | prev.addr
                        del keys[bisect_left(keys, k)]
                        del by_key[k]
                        block.addr = prev.addr
                        block.size += prev.size
                        prev = block.prev = prev.prev
                        if prev is not None:
                            prev.next = block
                    nxt = block.next
                    if nxt is not None and not nxt.allocated:  # [block next]: absorb next
                        k = (nxt.size << _ADDR_BITS) | nxt.addr
                        del keys[bisect_left(keys, k)]
                        del by_key[k]
                        block.size += nxt.size
                        nxt = block.next = nxt.next
                        if nxt is not None:
                            nxt.prev = block
                    k = (block.size << _ADDR_BITS) | block.addr
                    insort(keys, k)
                    by_key[k] = block
                else:
                    if nbytes <= 0 or key in live or key in empty:
                        self._allocated = allocated
                        self.malloc(key, nbytes)  # zero bytes, or the ValueError
                        i += 1
                        continue
                    size = K_MIN_BLOCK_SIZE if nbytes < K_MIN_BLOCK_SIZE else \
                        -(-nbytes // K_MIN_BLOCK_SIZE) * K_MIN_BLOCK_SIZE
                    pool = small if size <= K_SMALL_SIZE else large
                    keys = pool.keys
                    j = bisect_left(keys, size << _ADDR_BITS)
                    if j < len(keys):
                        k = keys[j]
                        del keys[j]
                        block = pool.by_key.pop(k)
                    else:
                        self._allocated = allocated
                        block = self._new_memory(pool, size, nbytes)
                    remaining = block.size - size
                    if (remaining >= K_MIN_BLOCK_SIZE) if pool is small else (remaining > K_SMALL_SIZE):
                        block = _split_front(block, size, pool)
                    block.allocated = True
                    live[key] = block
                    allocated += block.size
                    if allocated > peak:
                        peak = allocated
                        self._reserved_at_peak = self._reserved
                i += 1
        except CudaOutOfMemoryError as error:
            error.event_index = i
            raise
        finally:
            self._allocated = allocated
            if peak > self._peak_allocated:
                self._peak_allocated = peak
        return i - start_index

    # --- headroom (not the allocator's: see Headroom) ---------------------------------
    def _note_room(self, pool: _Pool, size: int, alloc_size: int) -> None:
        if self._expandable:
            page = K_SMALL_BUFFER if pool.small else self.settings.large_segment_bytes
            alloc_size = -(-size // page) * page
        room = self.capacity_bytes - (self._reserved - self.releasable_bytes() + alloc_size)
        if self._least_room is None or room < self._least_room:
            self._least_room = room

    # --- the allocator's private functions ---------------------------------------
    def _get_free_block(self, pool: _Pool, size: int) -> _Block | None:
        # get_free_block: lower_bound on (size, address).
        keys = pool.keys
        i = bisect_left(keys, size << _ADDR_BITS)
        n = len(keys)
        if i == n:
            return None
        by_key = pool.by_key
        block = by_key[keys[i]]
        if block.seg.expandable:
            # A free block followed by unmapped space counts at the size it can grow to;
            # step on while the next block is smaller by that measure.
            grow = block.size + (block.next.size if block.next is not None and not block.next.mapped else 0)
            while block.seg.expandable and i + 1 < n:
                nxt = by_key[keys[i + 1]]
                nxt_grow = nxt.size + (nxt.next.size if nxt.next is not None and not nxt.next.mapped else 0)
                if nxt_grow >= grow:
                    break
                i += 1
                block = nxt
                grow = nxt_grow
        max_split = self._max_split
        if max_split is not None:
            # Do not return an oversized block for a large request.
            if size < max_split and block.size >= max_split:
                return None
            # Allow oversized block size to be rounded up but within a limit.
            if size >= max_split and block.size >= size + self.settings.max_non_split_rounding_bytes:
                return None
        del keys[i]
        del by_key[(block.size << _ADDR_BITS) | block.addr]
        return block

    def _alloc_block(self, pool: _Pool, size: int, alloc_size: int) -> _Block | None:
        # alloc_block: a new cudaMalloc segment of alloc_size, or with expandable segments
        # a mapping of `size` bytes (try_allocate_expandable_block). The per-process limit
        # (set_fraction: total_allocated_memory + alloc_size > allowed_memory_maximum) is
        # checked first, with alloc_size in both cases.
        allowed = self.allowed_memory_bytes
        if allowed is not None and self._reserved + alloc_size > allowed:
            return None
        if self._expandable:
            return self._try_allocate_expandable_block(pool, size)
        capacity = self.capacity_bytes
        if capacity is not None and self._reserved + alloc_size > capacity:
            return None  # cudaMalloc: cudaErrorMemoryAllocation
        if self._segment_address is None:
            seg = _Segment(self._next_addr, False, alloc_size)
            self._next_addr += alloc_size
        else:
            seg = _Segment(self._segment_address(alloc_size), False, alloc_size)
        self._cuda_segments += 1
        self._add_reserved(pool, alloc_size)
        return _Block(alloc_size, seg.base, seg, pool)

    def _add_reserved(self, pool: _Pool, nbytes: int) -> None:
        pool.reserved += nbytes
        self._reserved += nbytes
        self._peak_reserved = max(self._peak_reserved, self._reserved)

    def _try_merge(self, dst: _Block, src: _Block | None) -> int:
        # try_merge_blocks: absorb a free neighbour in the same mapping state.
        if src is None or src.allocated or src.mapped != dst.mapped:
            return 0
        if src.mapped:
            src.pool.remove(src)
        else:
            src.pool.remove_unmapped(src)
        if dst.prev is src:  # [src dst]
            dst.addr = src.addr
            dst.prev = src.prev
            if dst.prev is not None:
                dst.prev.next = dst
        else:  # [dst src]
            dst.next = src.next
            if dst.next is not None:
                dst.next.prev = dst
        dst.size += src.size
        return src.size

    def _release_block(self, block: _Block) -> None:
        # release_block: cudaFree a whole, free, non-expandable segment.
        assert not block.seg.expandable and block.prev is None and block.next is None
        pool = block.pool
        pool.remove(block)
        pool.reserved -= block.size
        self._reserved -= block.size
        self._cuda_segments -= 1

    def _release_available_cached_blocks(self, pool: _Pool, size: int) -> bool:
        # release_available_cached_blocks: only with max_split_size set; free one oversize
        # block large enough, else oversize blocks from the largest down until enough.
        max_split = self._max_split
        if max_split is None:
            return False
        key_size = max(size, max_split)
        keys = pool.keys
        by_key = pool.by_key
        i = bisect_left(keys, key_size << _ADDR_BITS)
        if i == len(keys) or by_key[keys[i]].seg.expandable:
            if i == 0:
                return False
            released = 0
            i -= 1
            while released < key_size:
                block = by_key[keys[i]]
                if block.size < max_split:
                    break
                is_first = i == 0
                i -= 1
                if not block.seg.expandable:
                    released += block.size
                    self._release_block(block)
                if is_first:
                    break
            return released >= key_size
        self._release_block(by_key[keys[i]])
        return True

    def _release_cached_blocks(self) -> None:
        # release_cached_blocks -> release_blocks(large_blocks), release_blocks(small_blocks)
        for pool in (self._large, self._small):
            to_unmap = []
            for k in list(pool.keys):
                block = pool.by_key[k]
                if block.seg.expandable:
                    to_unmap.append(block)
                elif block.prev is None and block.next is None:
                    self._release_block(block)
            for block in to_unmap:
                self._unmap_block(block)
                if block.prev is None and block.next is None:
                    # release_expandable_segment: nothing of the segment is mapped.
                    assert not block.mapped
                    pool.remove_unmapped(block)
                    self._expandable_segments -= 1

    # --- expandable segments ---------------------------------------------------------
    def _find_expandable_block(self, pool: _Pool, size: int) -> _Block:
        # find_expandable_block: the lowest-address unmapped range (with the free block
        # just before it) that has `size` bytes of free or unmapped room; else a new
        # segment with kSmallBuffer pages (small pool) or large_segment_size pages.
        for addr in pool.unmapped_addrs:
            c = pool.unmapped[addr]
            if c.prev is not None and not c.prev.allocated:
                c = c.prev
            room = 0
            b = c
            while room < size and b is not None and not b.allocated:
                room += b.size
                b = b.next
            if room >= size:
                return c
        page = K_SMALL_BUFFER if pool.small else self.settings.large_segment_bytes
        seg = _Segment(self._next_addr, True, page)
        self._next_addr += _EXPANDABLE_ADDRESS_SPACE
        self._expandable_segments += 1
        # ExpandableSegment::size(): max_handles pages.
        candidate = _Block(_EXPANDABLE_ADDRESS_SPACE // page * page, seg.base, seg, pool,
                           mapped=False)
        pool.insert_unmapped(candidate)
        return candidate

    def _map_block(self, to_map: _Block, size: int) -> bool:
        # map_block / ExpandableSegment::map: map whole pages covering `size` bytes from
        # the block's (page-aligned) start; all or nothing.
        seg = to_map.seg
        page = seg.page_bytes
        offset = to_map.addr - seg.base
        begin = offset // page
        end = -(-(offset + size) // page)
        mapped = (end - begin) * page
        if mapped == 0:
            return False
        capacity = self.capacity_bytes
        if capacity is not None and self._reserved + mapped > capacity:
            self._map_shortfall = self._reserved + mapped - capacity
            return False  # cuMemCreate: CUDA_ERROR_OUT_OF_MEMORY, pages released
        pool = to_map.pool
        pool.remove_unmapped(to_map)
        to_map.mapped = True
        if mapped < to_map.size:
            rest = _Block(to_map.size - mapped, to_map.addr + mapped, seg, pool, mapped=False)
            rest.prev = to_map
            rest.next = to_map.next
            if to_map.next is not None:
                to_map.next.prev = rest
            to_map.next = rest
            pool.insert_unmapped(rest)
            to_map.size = mapped
        self._try_merge(to_map, to_map.prev)
        self._try_merge(to_map, to_map.next)
        pool.insert(to_map)
        self._add_reserved(pool, mapped)
        return True

    def _try_allocate_expandable_block(self, pool: _Pool, size: int) -> _Block | None:
        # try_allocate_expandable_block
        candidate = self._find_expandable_block(pool, size)
        if not candidate.mapped and not self._map_block(candidate, min(candidate.size, size)):
            return None
        while candidate.size < size:
            # free -> unmapped -> ...: map part of the unmapped block, which merges the
            # free block into it.
            nxt = candidate.next
            if not self._map_block(nxt, min(size - candidate.size, nxt.size)):
                return None
            candidate = nxt
        pool.remove(candidate)
        return candidate

    def _unmap_block(self, block: _Block) -> None:
        # unmap_block / ExpandableSegment::unmap: unmap the whole pages inside a free
        # block; the partial pages at either end stay mapped as free blocks.
        seg = block.seg
        page = seg.page_bytes
        offset = block.addr - seg.base
        begin = -(-offset // page)
        end = (offset + block.size) // page
        if begin >= end:
            return
        pool = block.pool
        pool.remove(block)
        start = seg.base + begin * page
        unmapped = (end - begin) * page
        before = start - block.addr
        if before > 0:
            head = _Block(before, block.addr, seg, pool)
            head.prev = block.prev
            if block.prev is not None:
                block.prev.next = head
            head.next = block
            block.prev = head
            pool.insert(head)
        after = block.size - before - unmapped
        if after > 0:
            tail = _Block(after, start + unmapped, seg, pool)
            tail.next = block.next
            if block.next is not None:
                block.next.prev = tail
            tail.prev = block
            block.next = tail
            pool.insert(tail)
        block.addr = start
        block.size = unmapped
        block.mapped = False
        self._try_merge(block, block.prev)
        self._try_merge(block, block.next)
        pool.insert_unmapped(block)
        pool.reserved -= unmapped
        self._reserved -= unmapped

    # --- consistency check (O(blocks); for tests) -------------------------------------
    def check_invariants(self) -> None:
        """Assert the block structure is consistent: every segment is covered by a chain
        of contiguous blocks, no two neighbours could have merged, the pools hold exactly
        the free mapped blocks, and the byte counters match the blocks."""
        blocks: list[_Block] = list(self._live.values())
        for pool in (self._small, self._large):
            for k, b in pool.by_key.items():
                assert k == (b.size << _ADDR_BITS) | b.addr and b.mapped and not b.allocated
                assert b.pool is pool
                blocks.append(b)
            assert pool.keys == sorted(pool.by_key)
            assert pool.unmapped_addrs == sorted(pool.unmapped)
            for a, b in pool.unmapped.items():
                assert a == b.addr and not b.mapped and not b.allocated
                blocks.append(b)
        assert all(b.allocated and b.mapped for b in self._live.values())
        assert self._allocated == sum(b.size for b in self._live.values())
        assert len({id(b) for b in blocks}) == len(blocks)
        seen = {id(b) for b in blocks}
        heads = [b for b in blocks if b.prev is None]
        reserved = {True: 0, False: 0}
        segments = {True: 0, False: 0}
        covered = 0
        for head in heads:
            seg = head.seg
            assert head.addr == seg.base
            b = head
            while b is not None:
                assert id(b) in seen and b.seg is seg
                covered += 1
                if b.next is not None:
                    nxt = b.next
                    assert nxt.prev is b and nxt.addr == b.addr + b.size
                    if not b.allocated and not nxt.allocated:
                        assert b.mapped != nxt.mapped, "free neighbours left unmerged"
                if b.mapped:
                    reserved[head.pool.small] += b.size
                elif seg.expandable:
                    # mapped and unmapped ranges meet at page boundaries
                    assert (b.addr - seg.base) % seg.page_bytes == 0
                    assert b.size % seg.page_bytes == 0
                b = b.next
            segments[seg.expandable] += 1
        assert covered == len(blocks)
        assert reserved[True] == self._small.reserved and reserved[False] == self._large.reserved
        assert self._reserved == self._small.reserved + self._large.reserved
        assert segments[False] == self._cuda_segments
        assert segments[True] == self._expandable_segments
        assert self._reserved >= self._allocated
        assert self._peak_reserved >= self._reserved and self._peak_allocated >= self._allocated


def replay(events: Sequence[tuple[Hashable, int]], *, prefix: Sequence[tuple[Hashable, int]] = (),
           repeats: int = 1, expandable_segments: bool = False,
           capacity_bytes: int | None = None, allowed_memory_bytes: int | None = None,
           max_split_size_bytes: int | None = None,
           roundup_power2_divisions: int | None = None, headroom: bool = False,
           settle: int = 0) -> ReplayResult:
    """Replay `prefix` once, then `events` `repeats` times through a fresh allocator;
    peaks are read over the last repetition (reset_peak_stats before it). `settle`: while
    the last repetition reserved memory it did not hold at its start (a run's reserved memory
    can still grow steps after the first, when freed blocks sit where the next step's requests
    do not fit), up to `settle` more repetitions, each read the same way: the peaks are then
    those of the first repetition that reserves nothing new, the level a long run stays at.
    `headroom` (with `capacity_bytes`): also measure `headroom_bytes` (see Headroom); the
    other figures are those of a replay without it."""
    if repeats < 1:
        raise ValueError("repeats must be >= 1")
    settings = AllocatorSettings(
        expandable_segments=expandable_segments,
        max_split_size_bytes=max_split_size_bytes,
        roundup_power2_divisions=roundup_power2_divisions,
    )
    allocator = CachingAllocator(settings, capacity_bytes=capacity_bytes,
                                 allowed_memory_bytes=allowed_memory_bytes, headroom=headroom)
    done = 0
    oom: CudaOutOfMemoryError | None = None
    try:
        done += allocator.replay(prefix, done)
        for repetition in range(repeats):
            if repetition == repeats - 1 and done:
                allocator.reset_peak_stats()
            start, releases = allocator.reserved_bytes, allocator.retry_releases
            done += allocator.replay(events, done)
        for _ in range(settle):
            # Settled: nothing new reserved; or held at the capacity (the cache released to retry),
            # where each step maps again what it freed.
            if allocator.peak_reserved_bytes <= start or allocator.retry_releases > releases:
                break
            allocator.reset_peak_stats()
            start, releases = allocator.reserved_bytes, allocator.retry_releases
            done += allocator.replay(events, done)
    except CudaOutOfMemoryError as error:
        oom = error
        done = error.event_index
    headroom_bytes = None
    if headroom:
        least = allocator.least_room_bytes
        headroom_bytes = -oom.shortfall_bytes if oom is not None else None if least is None else max(0, least)
    return ReplayResult(
        peak_allocated_bytes=allocator.peak_allocated_bytes,
        peak_reserved_bytes=allocator.peak_reserved_bytes,
        reserved_at_peak_allocated_bytes=allocator.reserved_at_peak_allocated_bytes,
        allocated_bytes=allocator.allocated_bytes,
        reserved_bytes=allocator.reserved_bytes,
        segments=allocator.segments,
        expandable_segments=allocator.expandable_segments,
        events_replayed=done,
        out_of_memory=oom is not None,
        oom_event_index=None if oom is None else oom.event_index,
        oom_request_bytes=None if oom is None else oom.request_bytes,
        headroom_bytes=headroom_bytes,
    )
