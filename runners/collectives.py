"""Counting what crosses the network in one rank: collective calls and payload bytes.

Two sources, so that every collective a training step issues is seen once:
- DDP's gradient buckets through DDP's own communication hook
  (`DistributedDataParallel.register_comm_hook`, wrapping torch's default all-reduce
  hook): one call per bucket, the bucket's flat buffer as the payload.
- Everything issued from Python through `torch.distributed` (LocalSGD's parameter
  averaging via `accelerator.reduce`, FSDP2's `all_gather_single` / `reduce_scatter_single`,
  DDP's per-forward buffer broadcast `_broadcast_coalesced`): the module functions are
  wrapped while counting. Calls made from inside the DDP hook are not counted twice.

Payload bytes are what the rank hands to the collective (the reduced tensor for an
all-reduce, the gathered output for an all-gather, the full input for a reduce-scatter,
the broadcast tensors), not the bytes a ring algorithm puts on the wire.

Counting starts before `accelerator.prepare`, so the first step's tally also holds the
set-up traffic (DDP's start-up broadcast of parameters and buffers); steady-state figures
use the later steps.

Known limitation: a collective issued from C++ without a Python call or a DDP hook (NCCL
calls inside a fused kernel, DeepSpeed's own process groups) is not seen.
"""

from __future__ import annotations

import contextlib
import threading
from collections import defaultdict
from dataclasses import dataclass, field

import torch

# torch.distributed function -> (kind, which argument is the payload)
_WRAPPED = {
    "all_reduce": ("all_reduce", "tensor"),
    "broadcast": ("broadcast", "tensor"),
    "_broadcast_coalesced": ("broadcast", "tensors"),
    "all_gather_single": ("all_gather", "output"),
    "all_gather_into_tensor": ("all_gather", "output"),
    "all_gather": ("all_gather", "output_list"),
    "reduce_scatter_single": ("reduce_scatter", "input"),
    "reduce_scatter_tensor": ("reduce_scatter", "input"),
}
DDP_BUCKETS = "ddp_gradient_buckets"


def _nbytes(value) -> int:
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, (list, tuple)):
        return sum(_nbytes(v) for v in value)
    return 0


def _payload(name: str, args: tuple, kwargs: dict) -> int:
    if name == "_broadcast_coalesced":  # (process_group, tensors, buffer_size, src)
        return _nbytes(args[1] if len(args) > 1 else kwargs.get("tensors"))
    if name in ("reduce_scatter_single", "reduce_scatter_tensor"):  # (output, input, ...)
        return _nbytes(kwargs["input"] if "input" in kwargs else args[1])
    first = args[0] if args else next(iter(kwargs.values()), None)
    return _nbytes(first)


@dataclass
class CollectiveTally:
    """Calls and payload bytes by collective kind (plus DDP's buckets under their own name)."""

    calls: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    bytes: dict[str, int] = field(default_factory=lambda: defaultdict(int))

    def add(self, kind: str, nbytes: int) -> None:
        self.calls[kind] += 1
        self.bytes[kind] += nbytes

    def copy(self) -> "CollectiveTally":
        return CollectiveTally(defaultdict(int, self.calls), defaultdict(int, self.bytes))

    def minus(self, earlier: "CollectiveTally") -> dict:
        kinds = sorted(set(self.calls) | set(earlier.calls))
        return {kind: {"calls": self.calls[kind] - earlier.calls.get(kind, 0),
                       "bytes": self.bytes[kind] - earlier.bytes.get(kind, 0)}
                for kind in kinds if self.calls[kind] - earlier.calls.get(kind, 0)}

    def to_json(self) -> dict:
        return {kind: {"calls": self.calls[kind], "bytes": self.bytes[kind]} for kind in sorted(self.calls)}


class CollectiveCounter:
    """Counts collectives while `counting()` is active; `tally` holds the running totals."""

    def __init__(self) -> None:
        self.tally = CollectiveTally()
        self._inside_hook = threading.local()

    def ddp_hook(self):
        """A DDP communication hook: torch's default all-reduce, counted per bucket."""
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

        def counted_allreduce(state, bucket):
            self.tally.add(DDP_BUCKETS, _nbytes(bucket.buffer()))
            self._inside_hook.active = True
            try:
                return default_hooks.allreduce_hook(state, bucket)
            finally:
                self._inside_hook.active = False

        return counted_allreduce

    @contextlib.contextmanager
    def counting(self):
        import torch.distributed as dist

        originals = {name: getattr(dist, name) for name in _WRAPPED if hasattr(dist, name)}

        def wrap(name, original):
            kind, _ = _WRAPPED[name]

            def counted(*args, **kwargs):
                if not getattr(self._inside_hook, "active", False):
                    self.tally.add(kind, _payload(name, args, kwargs))
                return original(*args, **kwargs)

            return counted

        for name, original in originals.items():
            setattr(dist, name, wrap(name, original))
        try:
            yield self
        finally:
            for name, original in originals.items():
                setattr(dist, name, original)
