"""store/malloc_trim.py: the periodic trimmer, and that glibc's malloc_trim(0) really hands back
freed memory held inside a thread's arena (the mechanism the store's RSS bound relies on)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time

from hybridkv.store import malloc_trim


def test_off_when_interval_is_zero() -> None:
    assert malloc_trim.start(0, trim=lambda _pad: 1) is None


def test_calls_trim_periodically_and_stops() -> None:
    pads: list[int] = []
    t = malloc_trim.start(0.02, trim=lambda pad: pads.append(pad) or 1)
    assert t is not None
    time.sleep(0.3)
    t.stop()
    n = t.calls
    assert n >= 3 and set(pads) == {0} and t.released == n and t.max_s >= 0
    time.sleep(0.1)
    assert t.calls == n  # stopped


def test_a_failing_trim_ends_the_thread_quietly() -> None:
    def boom(_pad: int) -> int:
        raise OSError("no")

    t = malloc_trim.start(0.01, trim=boom)
    time.sleep(0.1)
    assert t is not None and t.calls == 0 and not t._thread.is_alive()


# Freed chunks in a thread's arena, pinned by a live chunk above them, stay resident until
# malloc_trim(0): the worker's pattern (allocations freed on store/engine threads).
_CHILD = textwrap.dedent("""
    import ctypes, threading
    libc = ctypes.CDLL(None)
    libc.malloc.restype = ctypes.c_void_p
    libc.malloc.argtypes = [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]
    def rss():
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * 4096 / 2**20
    def churn():
        ptrs = [libc.malloc(4000) for _ in range(40000)]  # ~160 MiB, below the mmap threshold
        for i, p in enumerate(ptrs):
            if i % 1000:
                libc.free(p)  # keep every 1000th: the heap cannot shrink from the top
    t = threading.Thread(target=churn); t.start(); t.join()
    before = rss()
    from hybridkv.store import malloc_trim
    malloc_trim.libc_malloc_trim()(0)
    print(before, rss())
""")


def test_malloc_trim_returns_freed_arena_memory() -> None:
    """Linux/glibc (what hybridkv supports): a missing malloc_trim fails here, not skips."""
    assert malloc_trim.libc_malloc_trim() is not None, "this C library has no malloc_trim"
    out = subprocess.run(
        [sys.executable, "-c", _CHILD], capture_output=True, text=True, timeout=60, check=True
    )
    before, after = map(float, out.stdout.split())
    assert before - after > 100, (before, after)  # ~150 MiB freed but resident before the trim
