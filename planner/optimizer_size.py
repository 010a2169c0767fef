"""The lessons' `compute_optimizer_size(state_values) -> (megabytes, elements)`, for real
optimizers: pass `optimizer.state.values()` (or `trainer.optimizer.state.values()`).

Megabytes are MiB (2**20 bytes), as the lessons print them ("AdamW size: 502 MB" for
526,264,752 bytes). Bytes count each storage once: bitsandbytes shares its two
quantile maps between all tensors. Elements follow the lessons: every tensor element,
and one per Python number (the lesson's Adafactor count of 178,712 includes one per
integer `step`).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from planner.units import MIB


def optimizer_state_storage(state_values: Iterable[Mapping]) -> tuple[int, int]:
    """(bytes of distinct storage, elements) over the tensors in optimizer state dicts."""
    import torch

    seen_storages: set[tuple[str, int]] = set()
    total_bytes = 0
    total_elements = 0
    for state in state_values:
        for value in state.values():
            if isinstance(value, torch.Tensor):
                total_elements += value.numel()
                storage = value.untyped_storage()
                key = (str(value.device), storage.data_ptr())
                if key not in seen_storages:
                    seen_storages.add(key)
                    total_bytes += storage.nbytes()
            elif isinstance(value, (int, float)) and not isinstance(value, bool):
                total_elements += 1
    return total_bytes, total_elements


def compute_optimizer_size(state_values: Iterable[Mapping]) -> tuple[float, int]:
    """(megabytes as MiB, number of elements) held by an optimizer's state."""
    total_bytes, total_elements = optimizer_state_storage(state_values)
    return total_bytes / MIB, total_elements
