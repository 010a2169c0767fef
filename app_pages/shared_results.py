"""Results every session of the server shares, by key: computed once, the least recently
used dropped first.

A dictionary and locks, not st.cache_resource: Streamlit's cache hashes its arguments and
sets up the replay of the elements a cached function draws on every call, and the Plan page
asks it half a dozen times a render, for every session; nothing computed here draws an
element, so there is nothing to replay. What a render costs the server is measured by
`benchmarks/load_test.py` (server CPU per render).
"""

from __future__ import annotations

import collections
import contextlib
import threading
from collections.abc import Callable, Hashable
from contextlib import AbstractContextManager
from typing import TypeVar

T = TypeVar("T")


class SharedResults:
    """`get(key, compute)`: the result kept for `key`, or `compute()`'s, then kept (at most
    `kept` results). Two sessions asking for the same missing key at once compute it once:
    the second waits for the first. A computation that raises keeps nothing. `computing`
    (e.g. a spinner) is entered only while a result is missing."""

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

    def get(self, key: Hashable, compute: Callable[[], T],
            computing: Callable[[], AbstractContextManager] = contextlib.nullcontext) -> T:
        hit, result = self.found(key)
        if hit:
            return result  # type: ignore[return-value]
        with self._lock:
            lock = self._computing.setdefault(key, threading.Lock())
        with computing(), lock:
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

    def __len__(self) -> int:
        return len(self._results)
