"""The CUDA caching allocator model (planner.cuda_allocator) on hand-built traces whose
outcomes follow from the allocator's rules (c10/cuda/CUDACachingAllocator.cpp), plus
properties over random traces. Each test's docstring names the rule and its source
function; expected byte counts are derived by hand and written as arithmetic."""

import dataclasses

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from planner.cuda_allocator import (
    FREE,
    K_SMALL_BUFFER,
    AllocatorSettings,
    CachingAllocator,
    CudaOutOfMemoryError,
    Free,
    replay,
)

KiB = 2**10
MiB = 2**20


def run(events, **kwargs) -> CachingAllocator:
    """A fresh allocator after `events`, its block structure checked."""
    capacity = kwargs.pop("capacity_bytes", None)
    allocator = CachingAllocator(AllocatorSettings(**kwargs), capacity_bytes=capacity)
    allocator.replay(events)
    allocator.check_invariants()
    return allocator


# --- rounding, pools and segment sizes ---------------------------------------------
def test_sizes_round_up_to_512_bytes():
    """round_size: every request rounds up to a multiple of kMinBlockSize (512 B),
    at least 512 B; the rounded size is what memory_allocated counts."""
    a = run([("one", 1)])
    assert a.allocated_bytes == 512
    a = run([("k", 513)])
    assert a.allocated_bytes == 2 * 512
    a = run([("m", 1_000_000)])
    assert a.allocated_bytes == 1954 * 512  # ceil(1e6 / 512) = 1954
    assert a.reserved_bytes == 2 * MiB


def test_zero_byte_allocation_takes_no_block():
    """NativeCachingAllocator::allocate skips malloc for 0 bytes: nothing is allocated
    or reserved, and the key can still be freed."""
    a = run([("empty", 0), ("x", 512), ("empty", FREE)])
    assert a.allocated_bytes == 512 and a.reserved_bytes == 2 * MiB


def test_small_requests_share_a_2mib_segment():
    """get_pool / get_allocation_size: requests <= kSmallSize (1 MiB) come from the
    small pool, whose segments are kSmallBuffer (2 MiB); four 512 KiB tensors fill one,
    the fifth opens a second."""
    four = [(i, 512 * KiB) for i in range(4)]
    a = run(four)
    assert a.reserved_bytes == 2 * MiB and a.segments == 1
    a = run([*four, (4, 512 * KiB)])
    assert a.reserved_bytes == 2 * 2 * MiB and a.segments == 2
    # exactly 1 MiB is still "small": two of them share one 2 MiB segment
    a = run([("a", 1 * MiB), ("b", 1 * MiB)])
    assert a.reserved_bytes == 2 * MiB and a.reserved_bytes_large_pool == 0


def test_mid_request_gets_a_20mib_segment_later_mid_requests_carved_from_it():
    """get_allocation_size: a large request below kMinLargeAlloc (10 MiB) opens a
    kLargeBuffer (20 MiB) segment; best fit (get_free_block) then carves later 1-10 MiB
    requests from its free remainder until one no longer fits."""
    a = run([("a", 1 * MiB + 512), ("b", 3 * MiB), ("c", 9 * MiB)])
    assert a.reserved_bytes == 20 * MiB and a.segments == 1
    assert a.allocated_bytes == (1 * MiB + 512) + 3 * MiB + 9 * MiB
    # 20 - 13 MiB - 512 B is left: a 7 MiB request needs a second 20 MiB segment
    a.malloc("d", 7 * MiB)
    assert a.reserved_bytes == 20 * MiB + 20 * MiB and a.segments == 2


def test_request_of_10mib_or_more_rounds_to_2mib():
    """get_allocation_size: from kMinLargeAlloc (10 MiB) up a segment is the request
    rounded up to kRoundLarge (2 MiB); a 1 MiB remainder is not split off (should_split
    wants > kSmallSize), so the whole segment counts as allocated."""
    a = run([("x", 10 * MiB)])
    assert a.reserved_bytes == 10 * MiB and a.allocated_bytes == 10 * MiB
    a = run([("y", 11 * MiB)])
    assert a.reserved_bytes == 12 * MiB and a.allocated_bytes == 12 * MiB
    a = run([("z", 13 * MiB + 1)])
    assert a.reserved_bytes == 14 * MiB and a.allocated_bytes == 14 * MiB


# --- splitting ---------------------------------------------------------------------
def test_small_pool_splits_off_a_512_byte_remainder():
    """should_split: in the small pool a remainder of kMinBlockSize (512 B) is split
    off, so a later 512 B request fits it exactly and no new segment is needed."""
    a = run([("a", 1 * MiB), ("b", 1 * MiB - 512)])
    assert a.allocated_bytes == 2 * MiB - 512
    a.malloc("c", 512)
    assert a.allocated_bytes == 2 * MiB and a.reserved_bytes == 2 * MiB and a.segments == 1


def test_large_pool_splits_only_remainders_above_1mib():
    """should_split: in the large pool a block is split only when the remainder is
    > kSmallSize (1 MiB). 18.5 MiB in a 20 MiB segment leaves 1.5 MiB, split off and
    reused; 19 MiB leaves exactly 1 MiB, kept inside the allocated block."""
    a = run([("a", 18 * MiB + 512 * KiB)])
    assert a.allocated_bytes == 18 * MiB + 512 * KiB
    a.malloc("b", 1 * MiB + 512 * KiB)
    assert a.reserved_bytes == 20 * MiB and a.segments == 1
    a = run([("c", 19 * MiB)])
    assert a.allocated_bytes == 20 * MiB and a.reserved_bytes == 20 * MiB


# --- merging -----------------------------------------------------------------------
def test_free_merges_with_free_neighbours_in_the_segment():
    """free_block / try_merge_blocks: a freed block absorbs free neighbours, so two
    adjacent freed 6 MiB blocks serve a 12 MiB request from the same segment; two that
    are not adjacent (a live block between) do not, and a new segment is opened."""
    three = [("a", 6 * MiB), ("b", 6 * MiB), ("c", 6 * MiB)]  # one 20 MiB segment
    a = run([*three, ("a", FREE), ("b", FREE), ("d", 12 * MiB)])
    assert a.reserved_bytes == 20 * MiB
    a = run([*three, ("a", FREE), ("c", FREE), ("d", 12 * MiB)])
    # free: a (6 MiB) and c plus the 2 MiB tail (8 MiB), split by b
    assert a.reserved_bytes == 20 * MiB + 12 * MiB and a.segments == 2


def test_blocks_of_different_segments_never_merge():
    """try_merge_blocks only follows a block's prev/next within its segment: two freed
    10 MiB segments (adjacent in the model's address space) stay two 10 MiB blocks, and
    a 20 MiB request opens a third segment."""
    trace = [("x", 10 * MiB), ("y", 10 * MiB), ("x", FREE), ("y", FREE), ("z", 20 * MiB)]
    a = run(trace)
    assert a.reserved_bytes == 10 * MiB + 10 * MiB + 20 * MiB and a.segments == 3
    # allocated first peaks (20 MiB) before z's segment is reserved
    result = replay(trace)
    assert result.peak_allocated_bytes == 10 * MiB + 10 * MiB
    assert result.reserved_at_peak_allocated_bytes == 10 * MiB + 10 * MiB
    assert result.peak_reserved_bytes == 10 * MiB + 10 * MiB + 20 * MiB


def test_allocation_order_changes_reserved_memory():
    """The fragmentation case: interleaved 4 MiB tensors in a 20 MiB segment (get_free_block
    carves them in order), freed every other one, leave three 4 MiB holes that no 8 MiB
    request fits, so a second 20 MiB segment is opened; allocated in the other order the
    freed tensors are adjacent, merge (try_merge_blocks) and serve the 8 MiB request."""
    interleaved = [("a1", 4 * MiB), ("b1", 4 * MiB), ("a2", 4 * MiB), ("b2", 4 * MiB), ("a3", 4 * MiB)]
    grouped = [("a1", 4 * MiB), ("a2", 4 * MiB), ("a3", 4 * MiB), ("b1", 4 * MiB), ("b2", 4 * MiB)]
    tail = [("a1", FREE), ("a2", FREE), ("a3", FREE), ("big", 8 * MiB)]
    fragmented = replay(interleaved + tail)
    reused = replay(grouped + tail)
    assert fragmented.peak_allocated_bytes == reused.peak_allocated_bytes == 5 * 4 * MiB
    assert fragmented.peak_reserved_bytes == 20 * MiB + 20 * MiB
    assert reused.peak_reserved_bytes == 20 * MiB


def test_segment_addresses_decide_ties_between_equal_blocks_and_so_reserved_memory():
    """get_free_block's lower_bound on (size, address): of two free 12 MiB blocks in two 20 MiB
    segments, a 12 MiB request takes the one at the lower address. Where the segments rise in
    address (the model's own bump pointer) it is the first segment's, whose 8 MiB tensor, once
    freed, leaves an 8 MiB hole that a 16 MiB request does not fit: a third segment. Where the
    driver put the second segment below the first (as the H200's records show it does), the
    request takes the second's, the first segment empties and merges (try_merge_blocks) into a
    20 MiB block that serves the 16 MiB request."""
    trace = [("a", 8 * MiB), ("b", 12 * MiB), ("c", 8 * MiB), ("b", FREE), ("d", 12 * MiB), ("a", FREE),
             ("e", 16 * MiB)]
    rising = CachingAllocator(AllocatorSettings())
    rising.replay(trace)
    falling_addresses = iter([1 << 44, 1 << 40])
    falling = CachingAllocator(AllocatorSettings(), segment_address=lambda nbytes: next(falling_addresses))
    falling.replay(trace)
    for allocator in (rising, falling):
        allocator.check_invariants()
    assert rising.peak_reserved_bytes == 20 * MiB + 20 * MiB + 16 * MiB and rising.segments == 3
    assert falling.peak_reserved_bytes == 20 * MiB + 20 * MiB and falling.segments == 2
    assert rising.peak_allocated_bytes == falling.peak_allocated_bytes == 8 * MiB + 12 * MiB + 16 * MiB  # c, d, e


def test_best_fit_takes_the_smallest_sufficient_block():
    """get_free_block: lower_bound on (size, address) picks the smallest free block at
    least as large as the request: an 11 MiB request takes the cached 12 MiB block (not
    the 14 MiB one), keeps its 1 MiB remainder (should_split), and 13 MiB then takes the
    14 MiB block, with no new segment."""
    a = run([("p", 14 * MiB), ("q", 12 * MiB), ("p", FREE), ("q", FREE), ("r", 11 * MiB)])
    assert a.allocated_bytes == 12 * MiB
    a.malloc("s", 13 * MiB)
    assert a.allocated_bytes == 12 * MiB + 14 * MiB
    assert a.reserved_bytes == 14 * MiB + 12 * MiB and a.segments == 2


# --- capacity, release and OOM -----------------------------------------------------
def test_capacity_met_after_releasing_cached_segments():
    """malloc: when cudaMalloc fails, release_cached_blocks frees every unsplit cached
    segment and alloc_block retries: a 14 MiB request on a 20 MiB card with a cached
    12 MiB segment succeeds, and reserved never exceeds the card."""
    trace = [("x", 12 * MiB), ("x", FREE), ("y", 14 * MiB)]
    unlimited = replay(trace)
    assert unlimited.reserved_bytes == 12 * MiB + 14 * MiB
    fitted = replay(trace, capacity_bytes=20 * MiB)
    assert not fitted.out_of_memory
    assert fitted.reserved_bytes == 14 * MiB and fitted.peak_reserved_bytes == 14 * MiB
    assert fitted.segments == 1


def test_capacity_exceeded_when_live_blocks_split_segments():
    """malloc -> OOM: release_blocks frees only unsplit segments. A live 4 MiB block
    pins its 20 MiB segment (a free 4 MiB hole and 12 MiB tail beside it), so a 24 MiB
    request on a 40 MiB card fails though only 4 + 24 MiB would be live."""
    trace = [("x", 4 * MiB), ("y", 4 * MiB), ("x", FREE), ("z", 24 * MiB), ("z", FREE)]
    result = replay(trace, capacity_bytes=40 * MiB)
    assert result.out_of_memory and result.oom_event_index == 3
    assert result.oom_request_bytes == 24 * MiB
    assert result.allocated_bytes == 4 * MiB and result.reserved_bytes == 20 * MiB
    assert result.events_replayed == 3
    allocator = CachingAllocator(capacity_bytes=40 * MiB)
    with pytest.raises(CudaOutOfMemoryError) as raised:
        allocator.replay(trace)
    assert raised.value.allocation_bytes == 24 * MiB and raised.value.event_index == 3


def test_max_split_size_releases_only_oversize_blocks_first():
    """With max_split_size set: get_free_block refuses a block >= max_split_size for a
    smaller request, and on a full card release_available_cached_blocks frees just the
    oversize cached block before release_cached_blocks would free everything: the cached
    12 MiB segment survives."""
    setup = [("big", 60 * MiB), ("mid", 12 * MiB), ("big", FREE), ("mid", FREE)]
    plain = run([*setup, ("x", 30 * MiB)])
    assert plain.reserved_bytes == 60 * MiB + 12 * MiB  # 30 MiB carved from the 60
    capped = run([*setup, ("x", 30 * MiB)], max_split_size_bytes=40 * MiB, capacity_bytes=90 * MiB)
    assert capped.reserved_bytes == 12 * MiB + 30 * MiB and capped.segments == 2
    # a request >= max_split_size takes an oversize block within max_non_split_rounding
    # (20 MiB) of its size, unsplit
    near = run([("big", 60 * MiB), ("big", FREE), ("y", 50 * MiB)], max_split_size_bytes=40 * MiB)
    assert near.allocated_bytes == 60 * MiB and near.reserved_bytes == 60 * MiB


def test_empty_cache_frees_unsplit_segments_only():
    """release_cached_blocks / release_blocks: empty_cache returns cached segments that
    are wholly free; a segment with a live block stays. (14 MiB does not fit the 12 MiB
    left beside a and b, so it gets its own segment.)"""
    a = run([("a", 4 * MiB), ("b", 4 * MiB), ("c", 14 * MiB), ("a", FREE), ("c", FREE)])
    assert a.reserved_bytes == 20 * MiB + 14 * MiB
    a.empty_cache()
    a.check_invariants()
    assert a.reserved_bytes == 20 * MiB and a.segments == 1


def test_roundup_power2_divisions():
    """round_size / roundup_power2_next_division: with roundup_power2_divisions:4 a size
    above 4 * 512 B rounds up to the next quarter between its powers of two (3 MiB + 1 B
    -> 3.5 MiB); at or below that threshold the plain 512 B rounding applies."""
    a = CachingAllocator(AllocatorSettings(roundup_power2_divisions=4))
    assert a.round_size(3 * MiB + 1) == 2 * MiB + 3 * 512 * KiB
    assert a.round_size(1200) == 3 * 512
    assert a.round_size(4 * MiB) == 4 * MiB
    assert CachingAllocator().round_size(3 * MiB + 1) == 3 * MiB + 512


# --- expandable segments -----------------------------------------------------------
def test_expandable_segments_reserve_whole_pages():
    """find_expandable_block / map_block: with expandable_segments:True the small pool
    maps kSmallBuffer (2 MiB) pages and the large pool large_segment_size (20 MiB)
    pages; reserved is the mapped pages, and the rest of a page serves later requests
    (should_split splits any remainder >= 512 B)."""
    a = run([("s", 512)], expandable_segments=True)
    assert a.reserved_bytes == 2 * MiB
    a = run([("x", 21 * MiB)], expandable_segments=True)
    assert a.reserved_bytes == 2 * 20 * MiB and a.allocated_bytes == 21 * MiB
    a.malloc("y", 5 * MiB)
    assert a.reserved_bytes == 2 * 20 * MiB and a.allocated_bytes == 21 * MiB + 5 * MiB
    assert a.expandable_segments == 1 and a.segments == 0


def test_expandable_segments_avoid_the_new_segment_for_a_slightly_larger_request():
    """Note [Expandable Segments]: freed blocks of one growing segment merge
    (try_merge_blocks), so a 120 MiB request after two freed 100 MiB tensors reuses them;
    without it the two 100 MiB cudaMalloc segments cannot merge and a third is opened."""
    trace = [("p", 100 * MiB), ("q", 100 * MiB), ("p", FREE), ("q", FREE), ("r", 120 * MiB)]
    assert replay(trace).peak_reserved_bytes == 100 * MiB + 100 * MiB + 120 * MiB
    assert replay(trace, expandable_segments=True).peak_reserved_bytes == 100 * MiB + 100 * MiB


def test_expandable_segments_fit_where_split_segments_run_out():
    """try_allocate_expandable_block: the OOM case above fits with expandable segments:
    the free 12 MiB tail is grown by one more 20 MiB page (map_block merges it in), and
    the 24 MiB request is carved from the 32 MiB block."""
    trace = [("x", 4 * MiB), ("y", 4 * MiB), ("x", FREE), ("z", 24 * MiB)]
    result = replay(trace, expandable_segments=True, capacity_bytes=40 * MiB)
    assert not result.out_of_memory
    assert result.reserved_bytes == 20 * MiB + 20 * MiB
    assert result.allocated_bytes == 4 * MiB + 4 * MiB + 24 * MiB - 4 * MiB


def test_expandable_best_fit_passes_over_the_growable_tail():
    """get_free_block with expandable segments: a free block followed by unmapped space
    ranks at the size it could grow to, so a 3 MiB request skips the 4 MiB tail and is
    carved from the 12 MiB hole; a later 10 MiB request then fits neither the 9 MiB
    left nor the tail, and one more 20 MiB page is mapped behind the tail."""
    a = run([("a", 12 * MiB), ("b", 4 * MiB), ("a", FREE), ("c", 3 * MiB)],
            expandable_segments=True)
    assert a.reserved_bytes == 20 * MiB
    a.malloc("d", 10 * MiB)
    a.check_invariants()
    assert a.reserved_bytes == 20 * MiB + 20 * MiB
    assert a.allocated_bytes == 4 * MiB + 3 * MiB + 10 * MiB


def test_expandable_free_keeps_pages_until_empty_cache():
    """free_block never unmaps; release_cached_blocks -> unmap_block unmaps the whole
    pages inside free blocks (a partial page next to a live block stays mapped)."""
    a = run([("p", 100 * MiB), ("q", 4 * MiB), ("p", FREE)], expandable_segments=True)
    assert a.reserved_bytes == 100 * MiB + 20 * MiB
    a.empty_cache()
    a.check_invariants()
    assert a.reserved_bytes == 20 * MiB  # q's page; [104, 120) MiB is not a whole page
    a.free("q")
    a.empty_cache()
    a.check_invariants()
    assert a.reserved_bytes == 0 and a.expandable_segments == 0


# --- steady state ------------------------------------------------------------------
def test_peaks_over_the_last_repetition_after_a_prefix():
    """resetPeakStats sets each peak to the current value: after a prefix (weights kept,
    a 500 MiB staging tensor freed and cached) the step's peaks are read over its second
    run; the step's activation is carved from the cached 500 MiB segment."""
    prefix = [("w", 100 * MiB), ("staging", 500 * MiB), Free("staging")]
    step = [("act", 200 * MiB), Free("act")]
    result = replay(step, prefix=prefix, repeats=2)
    assert result.peak_allocated_bytes == 100 * MiB + 200 * MiB
    assert result.peak_reserved_bytes == 100 * MiB + 500 * MiB
    assert result.reserved_at_peak_allocated_bytes == 100 * MiB + 500 * MiB
    whole = replay(prefix + step)
    assert whole.peak_allocated_bytes == 100 * MiB + 500 * MiB


def test_event_index_counts_prefix_and_repetitions():
    """The OOM position and the event count run over prefix + events * repeats: after
    a 30 MiB prefix tensor on a 40 MiB card, the step's first 4 MiB request needs a
    20 MiB segment (get_allocation_size) and cannot get it."""
    step = [("act", 4 * MiB), Free("act")]
    fits = replay(step, prefix=[("w", 10 * MiB), ("v", 6 * MiB)], repeats=3)
    assert fits.events_replayed == 2 + 3 * 2 and not fits.out_of_memory
    result = replay(step, prefix=[("w", 30 * MiB), ("v", 512)], repeats=3,
                    capacity_bytes=40 * MiB)
    assert result.out_of_memory and result.oom_event_index == 2
    assert result.reserved_bytes == 30 * MiB + 2 * MiB


# --- properties over random traces -------------------------------------------------
SIZES = st.one_of(
    st.integers(1, 2 * MiB),
    st.integers(1 * MiB, 30 * MiB),
    st.sampled_from([512, 1 * MiB, 1 * MiB + 1, 10 * MiB, 19 * MiB, 20 * MiB, 21 * MiB, 60 * MiB]),
)
OPS = st.lists(st.tuples(st.booleans(), SIZES, st.integers(0, 10**6)), max_size=60)
CONFIGS = st.fixed_dictionaries({
    "expandable_segments": st.booleans(),
    "max_split_size_bytes": st.sampled_from([None, 20 * MiB, 40 * MiB]),
})


def make_trace(ops) -> list:
    """Allocate on True (or when nothing is live), else free a live key; free all at the end."""
    events, live = [], []
    for key, (alloc, size, pick) in enumerate(ops):
        if alloc or not live:
            events.append((key, size))
            live.append(key)
        else:
            events.append((live.pop(pick % len(live)), FREE))
    return events + [(k, FREE) for k in live]


@settings(max_examples=150, deadline=None, print_blob=True,
          suppress_health_check=[HealthCheck.too_slow])
@given(ops=OPS, config=CONFIGS, capacity=st.one_of(st.none(), st.integers(0, 120 * MiB)))
def test_invariants_on_random_traces(ops, config, capacity):
    """At every event: the block structure is consistent (check_invariants), reserved >=
    allocated, allocated = the sum of the live blocks, each block is the rounded request
    or (large pool, unsplit: should_split) at most 1 MiB more, or less than
    max_non_split_rounding more for an oversize request (get_free_block); with
    expandable segments reserved is whole pages per pool."""
    allocator = CachingAllocator(AllocatorSettings(**config), capacity_bytes=capacity)
    blocks = {}
    max_split = config["max_split_size_bytes"]
    for key, nbytes in make_trace(ops):
        if nbytes == FREE:
            allocator.free(key)
            del blocks[key]
        else:
            try:
                block = allocator.malloc(key, nbytes)
            except CudaOutOfMemoryError:
                allocator.check_invariants()
                assert capacity is not None
                break
            size = allocator.round_size(nbytes)
            blocks[key] = block
            if size <= 1 * MiB or config["expandable_segments"]:
                assert block == size
            elif max_split is None or size < max_split:
                assert size <= block <= size + 1 * MiB
            else:
                assert size <= block < size + max(20 * MiB, 2 * MiB)
        allocator.check_invariants()
        assert allocator.reserved_bytes >= allocator.allocated_bytes == sum(blocks.values())
        assert allocator.peak_reserved_bytes >= allocator.peak_allocated_bytes
        if capacity is not None:
            assert allocator.peak_reserved_bytes <= capacity
        if config["expandable_segments"]:
            assert allocator.reserved_bytes_small_pool % K_SMALL_BUFFER == 0
            assert allocator.reserved_bytes_large_pool % (20 * MiB) == 0


def _layout(allocator: CachingAllocator) -> tuple:
    """Everything a later event's outcome depends on: each live key's block, each pool's
    free blocks in order, the counters and the peaks."""
    live = {key: (block.addr, block.size, block.seg.base) for key, block in allocator._live.items()}
    pools = tuple(tuple((b.addr, b.size, b.seg.base, b.prev is None, b.next is None) for b in
                        (pool.by_key[k] for k in pool.keys)) for pool in (allocator._small, allocator._large))
    return (live, sorted(allocator._empty, key=repr), pools, allocator.allocated_bytes, allocator.reserved_bytes,
            allocator.peak_allocated_bytes, allocator.peak_reserved_bytes, allocator.reserved_at_peak_allocated_bytes,
            allocator.segments, allocator.retry_releases, allocator.least_room_bytes)


@settings(max_examples=200, deadline=None, print_blob=True)
@given(ops=OPS, capacity=st.one_of(st.none(), st.integers(0, 120 * MiB)), cut=st.integers(0, 60),
       zeros=st.lists(st.integers(0, 60), max_size=3))
def test_replay_loop_is_malloc_and_free_event_by_event(ops, capacity, cut, zeros):
    """`replay` runs the default settings' events in one loop of its own (`_replay_plain`):
    it leaves every block, pool, counter, peak and headroom where `malloc` and `free` called
    per event leave them, runs out of memory at the same event, and goes on from where an
    earlier replay (or a peak reset) left the allocator. Zero-byte requests included."""
    trace = make_trace(ops)
    for at in zeros:  # a zero-byte key allocated and freed somewhere in the trace
        at = min(at, len(trace))
        trace[at:at] = [(("empty", at), 0), (("empty", at), FREE)]
    cut = min(cut, len(trace))
    looped = CachingAllocator(capacity_bytes=capacity, headroom=capacity is not None)
    stepped = CachingAllocator(capacity_bytes=capacity, headroom=capacity is not None)
    looped_oom = stepped_oom = None
    try:
        done = looped.replay(trace[:cut])
        looped.reset_peak_stats()
        looped.replay(trace[cut:], done)
    except CudaOutOfMemoryError as error:
        looped_oom = (error.event_index, error.request_bytes, error.shortfall_bytes)
    try:
        for index, (key, nbytes) in enumerate(trace):
            if index == cut:
                stepped.reset_peak_stats()
            stepped.free(key) if nbytes == FREE else stepped.malloc(key, nbytes)
        if cut == len(trace):
            stepped.reset_peak_stats()
    except CudaOutOfMemoryError as error:
        stepped_oom = (index, error.request_bytes, error.shortfall_bytes)
    assert looped_oom == stepped_oom
    assert _layout(looped) == _layout(stepped)
    looped.check_invariants()


@settings(max_examples=100, deadline=None, print_blob=True)
@given(ops=OPS, config=CONFIGS)
def test_released_cache_replays_like_a_fresh_allocator(ops, config):
    """release_cached_blocks after everything is freed returns every segment (release_block,
    release_expandable_segment), so the allocator is as new: replaying the trace again
    gives the same allocated and reserved bytes at every event."""
    allocator = CachingAllocator(AllocatorSettings(**config))
    trace = make_trace(ops)

    def counters():
        seen = []
        for key, nbytes in trace:
            if nbytes == FREE:
                allocator.free(key)
            else:
                allocator.malloc(key, nbytes)
            seen.append((allocator.allocated_bytes, allocator.reserved_bytes))
        return seen

    first = counters()
    allocator.empty_cache()
    assert allocator.reserved_bytes == 0
    assert allocator.segments == 0 and allocator.expandable_segments == 0
    assert counters() == first
    allocator.check_invariants()


def test_expandable_oom_on_the_first_mapping_leaves_an_empty_segment():
    """find_expandable_block opens the segment before map_block tries cuMemCreate; when
    that fails the segment stays with nothing mapped (release_blocks only visits free
    mapped blocks), and is reused by the next request."""
    a = CachingAllocator(AllocatorSettings(expandable_segments=True), capacity_bytes=30 * MiB)
    with pytest.raises(CudaOutOfMemoryError):
        a.malloc("x", 30 * MiB)  # two 20 MiB pages > 30 MiB
    a.check_invariants()
    assert a.reserved_bytes == 0 and a.expandable_segments == 1
    a.malloc("y", 12 * MiB)
    a.check_invariants()
    assert a.reserved_bytes == 20 * MiB and a.expandable_segments == 1


def test_memory_fraction_checks_the_segment_size_even_when_expandable():
    """alloc_block with set_per_process_memory_fraction: the limit is checked against
    reserved + alloc_size (get_allocation_size) before any mapping, so with expandable
    segments a 21 MiB request (alloc_size 22 MiB) passes a 30 MiB limit and then maps two
    20 MiB pages, 40 MiB; a 4 MiB request under a 19 MiB limit fails (alloc_size 20 MiB)
    though its page would be 20 MiB either way, and so does it without the option."""
    over = replay([("x", 21 * MiB)], expandable_segments=True, allowed_memory_bytes=30 * MiB)
    assert not over.out_of_memory and over.reserved_bytes == 2 * 20 * MiB
    capped = replay([("x", 21 * MiB)], expandable_segments=True, capacity_bytes=30 * MiB)
    assert capped.out_of_memory and capped.reserved_bytes == 0
    for expandable in (False, True):
        small = replay([("y", 4 * MiB)], expandable_segments=expandable,
                       allowed_memory_bytes=19 * MiB)
        assert small.out_of_memory and small.oom_event_index == 0


# --- headroom (planner.cuda_allocator, "Headroom"): a guide for the fit searches -------------

@settings(max_examples=150, deadline=None, print_blob=True)
@given(ops=OPS, config=CONFIGS, cut=st.integers(0, 10**6))
def test_releasable_bytes_is_what_empty_cache_gives_back(ops, config, cut):
    """release_cached_blocks (empty_cache) frees every unsplit free segment and unmaps the
    whole pages inside free blocks of expandable segments: releasable_bytes(), computed
    without releasing, equals the drop in reserved memory empty_cache() then makes, at any
    point of a trace."""
    allocator = CachingAllocator(AllocatorSettings(**config))
    trace = make_trace(ops)
    for key, nbytes in trace[:cut % (len(trace) + 1)]:
        if nbytes == FREE:
            allocator.free(key)
        else:
            allocator.malloc(key, nbytes)
    releasable, before = allocator.releasable_bytes(), allocator.reserved_bytes
    allocator.empty_cache()
    assert before - allocator.reserved_bytes == releasable


@settings(max_examples=150, deadline=None, print_blob=True)
@given(ops=OPS, config=CONFIGS, capacity=st.integers(0, 120 * MiB))
def test_headroom_leaves_the_replay_as_it_was_and_its_sign_is_the_answer(ops, config, capacity):
    """A replay measuring its headroom reads exactly what one without it reads (the same
    peaks, the same out-of-memory event and request, the figures of that moment), and its
    headroom is negative exactly when it ran out of memory."""
    trace, prefix = make_trace(ops), [("weights", 3 * MiB)]
    plain = replay(trace, prefix=prefix, repeats=2, capacity_bytes=capacity, **config)
    measured = replay(trace, prefix=prefix, repeats=2, capacity_bytes=capacity, headroom=True, **config)
    assert dataclasses.replace(measured, headroom_bytes=None) == plain
    assert measured.headroom_bytes is not None  # the prefix's request needs new memory
    assert (measured.headroom_bytes < 0) == plain.out_of_memory


def test_headroom_is_the_room_left_at_the_tightest_new_segment():
    """Hand-built: a 30 MiB block (its own 30 MiB segment, get_allocation_size) is freed
    and a 40 MiB request follows; best fit finds nothing, so a new segment is needed, and
    releasing the cache would first give back the free 30 MiB one (release_cached_blocks).
    Within 100 MiB the 40 MiB request needs 10 (live) + 40 MiB after that release: 50 MiB
    of room is left there, less than at any earlier segment. Within 45 MiB the same request
    runs out by 5 MiB: the replay reports that shortfall, and the figures of a replay that
    stops there."""
    trace = [("a", 10 * MiB), ("b", 30 * MiB), ("b", FREE), ("c", 40 * MiB)]
    roomy = replay(trace, capacity_bytes=100 * MiB, headroom=True)
    assert not roomy.out_of_memory and roomy.headroom_bytes == 100 * MiB - (10 + 40) * MiB
    tight = replay(trace, capacity_bytes=45 * MiB, headroom=True)
    assert tight.out_of_memory and tight.oom_event_index == 3
    assert tight.headroom_bytes == -(10 * MiB + 40 * MiB - 45 * MiB)
    assert tight == dataclasses.replace(replay(trace, capacity_bytes=45 * MiB), headroom_bytes=tight.headroom_bytes)


def test_settling_replays_until_a_repetition_reserves_nothing_new():
    """A 1.5 MiB tensor handed from step to step (two keys taking turns, as planner.reserved
    replays outputs carried between steps) beside 14 and 9 MiB temporaries. Step 1 carves the
    new 1.5 MiB tensor from the 20 MiB segment the old one is in, and the temporaries fit there
    and in one new 14 MiB segment (46 MiB with the 12 MiB weight). Step 2's 1.5 MiB request
    takes the best fit, the now free 14 MiB segment (get_free_block: smallest sufficient
    block), splitting it, so its second 14 MiB temporary finds no block and a third segment is
    opened: 60 MiB, where it stays. Peaks read after one repetition say 46; settled, 60."""
    step = [("c1", 3 * MiB // 2), Free("c0"), ("t1", 14 * MiB), ("t2", 14 * MiB), Free("t1"),
            ("c0", 3 * MiB // 2), Free("c1"), ("t3", 9 * MiB), Free("t2"), Free("t3")]
    prefix = [("w", 12 * MiB), ("c0", 3 * MiB // 2)]
    assert replay(step, prefix=prefix, repeats=1).peak_reserved_bytes == 46 * MiB
    settled = replay(step, prefix=prefix, repeats=1, settle=4)
    assert settled.peak_reserved_bytes == replay(step, prefix=prefix, repeats=8).peak_reserved_bytes == 60 * MiB
    assert settled.events_replayed == len(prefix) + 3 * len(step)  # grew in the second, not the third
    assert replay(step, prefix=prefix, repeats=3, settle=4).events_replayed == len(prefix) + 3 * len(step)
    # On a 50 MiB card the first step fits and the second runs out (its split segments cannot be
    # released): a verdict read after one step would say it fits.
    assert not replay(step, prefix=prefix, repeats=1, capacity_bytes=50 * MiB).out_of_memory
    short = replay(step, prefix=prefix, repeats=1, settle=4, capacity_bytes=50 * MiB)
    assert short.out_of_memory and short.oom_event_index == len(prefix) + len(step) + 3
