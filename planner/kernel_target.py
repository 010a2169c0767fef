"""The GPU and torch build a replay's kernel scratch is for: what the allocator's replay
(planner.reserved) makes beside the probe's outputs where a kernel's own requests depend on
them (planner.attention_scratch, planner.embedding_scratch)."""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass

from planner import attention_scratch, embedding_scratch
from planner.attention_scratch import DEFAULT_BUILD, AttentionBackward, CudaBuild
from planner.cuda_allocator import Event
from planner.embedding_scratch import EmbeddingBackward


@dataclass(frozen=True)
class KernelTarget:
    """The GPU (compute capability and SM count; None: not known) and torch build."""

    compute_capability: tuple[int, int] | None = None
    build: CudaBuild = DEFAULT_BUILD
    multiprocessors: int | None = None

    def attention_events(self, owner: Hashable, call: AttentionBackward) -> list[Event]:
        """A fused attention backward's scratch, made after its last output (`owner`)."""
        backend = attention_scratch.replay_backend(call, self.compute_capability, self.build)
        return attention_scratch.scratch_events(owner, call, backend, self.build)

    def embedding_events(self, owner: Hashable, call: EmbeddingBackward) -> tuple[list[Event], list[Event]]:
        """An embedding backward's requests before and after its output (`owner`)."""
        return embedding_scratch.scratch_events(owner, call, self.compute_capability, self.multiprocessors,
                                                self.build.cuda_version)


UNKNOWN_GPU = KernelTarget()
