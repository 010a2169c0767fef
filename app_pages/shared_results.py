"""Results every session of the server shares, by key: computed once, the least recently
used dropped first.

A dictionary and locks, not st.cache_resource: Streamlit's cache hashes its arguments and
records the elements a cached function draws on every call, hit or miss, and the Plan page
asks it six times a render; under 20 concurrent sessions that bookkeeping was 8% of the
server's time (`benchmarks/load_test.py`, profiled with py-spy). Nothing computed here draws
an element, so there is nothing to record.
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Callable, Hashable
from typing import TypeVar

T = TypeVar("T")


class SharedResults:
    """`get(key, compute)`: the result kept for `key`, or `compute()`'s, then kept (at most
    `kept` results). Two sessions asking for the same missing key at once compute it once:
    the second waits for the first. A computation that raises keeps nothing."""

    def __init__(self, kept: int):
        self._kept = kept
        self._results: collections.OrderedDict[Hashable, object] = collections.OrderedDict()
        self._lock = threading.Lock()
        self._computing: dict[Hashable, threading.Lock] = {}

    def found(self, key: Hashable) -> tuple[bool, object]:
        """(True, the result) when `key` is kept, else (False, None)."""
        with self._lock:
            if key in self._results:
                self._results.move_to_end(key)
                return True, self._results[key]
        return False, None

    def get(self, key: Hashable, compute: Callable[[], T]) -> T:
        hit, result = self.found(key)
        if hit:
            return result  # type: ignore[return-value]
        with self._lock:
            computing = self._computing.setdefault(key, threading.Lock())
        with computing:
            hit, result = self.found(key)  # computed by a session this one waited for
            if hit:
                return result  # type: ignore[return-value]
            try:
                result = self.keep(key, compute())
            finally:
                with self._lock:
                    self._computing.pop(key, None)
        return result  # type: ignore[return-value]

    def keep(self, key: Hashable, result: T) -> T:
        """Keep `result` for `key` unless one is kept already; returns the one kept (the first)."""
        with self._lock:
            if key in self._results:
                self._results.move_to_end(key)
                return self._results[key]  # type: ignore[return-value]
            self._results[key] = result
            if len(self._results) > self._kept:
                self._results.popitem(last=False)
        return result

    def clear(self) -> None:
        with self._lock:
            self._results.clear()

    def __len__(self) -> int:
        return len(self._results)
