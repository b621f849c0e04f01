"""A pool for buffers a store call may still touch after the caller gave up on it.

A Mooncake call that timed out cannot be cancelled: it may go on reading or
writing its buffers (a trailer arena, a staging slot set) for a while. The
next batch must therefore never share them; a buffer returns to the pool only
once its call has really ended, and meanwhile ``acquire`` builds a fresh one.
One implementation for every such buffer, so the rule lives in one place.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Generic, TypeVar

T = TypeVar("T")


class CallPool(Generic[T]):
    """Free buffers of one kind; ``make`` builds (and registers) a new one on demand."""

    def __init__(self, make: Callable[[], T], prebuild: bool = False) -> None:
        self._make = make
        self._free: list[T] = []
        self._lock = threading.Lock()
        if prebuild:  # build (and register) the first one now, at startup, not on the hot path
            self.release(self.acquire())

    def acquire(self) -> T:
        with self._lock:
            if self._free:
                return self._free.pop()
        return self._make()

    def release(self, item: T) -> None:
        """Only once no store call can still touch ``item``."""
        with self._lock:
            self._free.append(item)
