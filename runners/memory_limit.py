"""The memory limit a run's child process runs under, so that a run the planner misjudged
stops with a clear outcome instead of swapping the machine or waking the OOM killer.

The limit (`memory_limit_for`), from the planner's estimate and the machine's free RAM:
- cpu: LIMIT_FACTOR x the RAM the planner says the run needs (runners.verify.ram_needed_for_peak:
  peak x 1.25 + 1 GiB), and never more than the RAM available when the run starts;
- simulate: the RAM available (fake tensors allocate no tensor memory; the limit only
  keeps a runaway bookkeeping from taking the machine);
- cuda: none. CUDA reserves virtual address space the size of the GPU's memory and more,
  so an address-space limit would break it (Known limitations).

The child applies it to itself (`apply_from_env`, first thing, before torch is imported)
as RLIMIT_AS: limit + ADDRESS_SPACE_SLACK_BYTES, the slack covering address space that
is not RAM (shared libraries mapped but not resident, thread stacks, malloc arenas). An
allocation beyond it fails in the run (torch: "DefaultCPUAllocator: can't allocate
memory", Python: MemoryError); the child reports that as status "oom" with the reason
"over the run's memory limit of ..." (`is_allocation_failure`, `over_limit_reason`).

Known limitations: RLIMIT_AS counts address space, not resident memory, so the run may
stop a little below the limit in RAM (never above it plus the slack); a CUDA run's host
memory is not limited; Linux and macOS only (the resource module).
"""

from __future__ import annotations

import os

GIB = 2**30
LIMIT_FACTOR = 1.5  # the estimate's safety margin is already in "needed"; this is the tolerance beyond it
ADDRESS_SPACE_SLACK_BYTES = 1 * GIB
MEMORY_LIMIT_ENV = "PLANNER_MEMORY_LIMIT_BYTES"
MALLOC_ARENAS = 2  # unless the caller's environment sets MALLOC_ARENA_MAX itself
ALLOCATION_FAILURES = ("can't allocate memory", "not enough memory", "std::bad_alloc", "Cannot allocate memory")


def memory_limit_for(mode: str, needed_bytes: int | None, available_bytes: int | None) -> int | None:
    """Bytes the child may use (module docstring); None: no limit."""
    if mode == "cuda":
        return None
    if mode == "simulate":
        return available_bytes
    if mode != "cpu":
        raise ValueError(f"mode must be cpu, cuda or simulate, got {mode!r}")
    from_estimate = None if needed_bytes is None else int(needed_bytes * LIMIT_FACTOR)
    if from_estimate is None or available_bytes is None:
        return from_estimate if from_estimate is not None else available_bytes
    return min(from_estimate, available_bytes)


def env_with_limit(env: dict, limit_bytes: int | None) -> dict:
    """`env` for a child under `limit_bytes`. glibc reserves 64 MiB of address space per
    malloc arena, up to 8 per core, and torch's threads each take one: on a many-core
    machine that alone would exhaust the slack, so arenas are capped (MALLOC_ARENA_MAX)."""
    env = {k: v for k, v in env.items() if k != MEMORY_LIMIT_ENV}
    if limit_bytes is None:
        return env
    return {"MALLOC_ARENA_MAX": str(MALLOC_ARENAS), **env, MEMORY_LIMIT_ENV: str(int(limit_bytes))}


def apply_from_env() -> int | None:
    """Set this process's address-space limit from $PLANNER_MEMORY_LIMIT_BYTES; returns the
    limit in bytes (None when there is none, or the platform cannot set one)."""
    text = os.environ.get(MEMORY_LIMIT_ENV, "")
    if not text.isdigit():
        return None
    limit = int(text)
    try:
        import resource
    except ImportError:  # not a Unix
        return None
    _, hard = resource.getrlimit(resource.RLIMIT_AS)
    soft = limit + ADDRESS_SPACE_SLACK_BYTES
    if hard != resource.RLIM_INFINITY:
        soft = min(soft, hard)
    resource.setrlimit(resource.RLIMIT_AS, (soft, hard))
    return limit


def is_allocation_failure(error: BaseException) -> bool:
    """An allocation refused under the limit: MemoryError, or torch's CPU allocator failing."""
    return isinstance(error, MemoryError) or (isinstance(error, RuntimeError)
                                              and any(text in str(error) for text in ALLOCATION_FAILURES))


def over_limit_reason(limit_bytes: int, detail: str) -> str:
    gib = limit_bytes / GIB
    return (f"over the run's memory limit of {gib:.2f} GiB ({limit_bytes:,} bytes: {LIMIT_FACTOR:g} x the RAM the "
            f"planner's estimate needs, or the free RAM if less); the planner under-estimates this run or the "
            f"machine is short of RAM: {detail}")
