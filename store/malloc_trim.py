"""Hand the engine worker's freed heap memory back to the kernel, periodically.

Why: glibc keeps memory that was malloc'd and freed in its arenas (the main brk heap and one
heap per arena of other threads) and returns it only when the free space sits at the top
of a heap, so a store connector's worker RSS grows with freed-but-kept pages.
``malloc_trim(0)`` also releases free pages in the middle of every arena (``MADV_DONTNEED``),
which no other glibc setting does (MALLOC_ARENA_MAX does not release them);
bench/rss_growth.py compares the two.

Linux/glibc only; where the C library has no ``malloc_trim`` (musl, macOS) ``start``
returns None and nothing runs.
"""

from __future__ import annotations

import ctypes
import threading
import time
from collections.abc import Callable

from hybridkv.store.logs import get_logger

logger = get_logger(__name__)


def libc_malloc_trim() -> Callable[[int], int] | None:
    """glibc's ``malloc_trim``, or None where the C library has none."""
    try:
        fn = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):
        return None
    fn.argtypes, fn.restype = [ctypes.c_size_t], ctypes.c_int
    return fn


class MallocTrimmer:
    """One daemon thread calling ``trim(0)`` every ``interval_s``; ``stop()`` ends it.

    ``calls`` / ``total_s`` / ``max_s``: how often it ran and what it cost (the call holds
    each arena's lock while it walks that arena, so allocating threads may wait that long)."""

    def __init__(
        self, interval_s: float, trim: Callable[[int], int], name: str = "hybridkv-malloc-trim"
    ) -> None:
        self.interval_s = float(interval_s)
        self._trim = trim
        self._stop = threading.Event()
        self.calls = 0
        self.released = 0  # calls that returned 1 (some memory was given back)
        self.total_s = 0.0
        self.max_s = 0.0
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            t0 = time.perf_counter()
            try:
                r = self._trim(0)
            except Exception as e:  # noqa: BLE001 - never take the worker down for this
                logger.warning("malloc_trim failed, not calling it again: %s", e)
                return
            dt = time.perf_counter() - t0
            self.calls += 1
            self.released += bool(r)
            self.total_s += dt
            self.max_s = max(self.max_s, dt)

    def stop(self, wait_s: float = 1.0) -> None:
        self._stop.set()
        if threading.current_thread() is not self._thread:
            self._thread.join(wait_s)


def start(interval_s: float, trim: Callable[[int], int] | None = None) -> MallocTrimmer | None:
    """A running trimmer, or None when ``interval_s`` <= 0 or there is no ``malloc_trim``."""
    if interval_s <= 0:
        return None
    fn = trim or libc_malloc_trim()
    if fn is None:
        logger.info("no malloc_trim in this C library; malloc_trim_interval_s has no effect")
        return None
    return MallocTrimmer(interval_s, fn)
