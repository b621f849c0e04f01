"""Start the store's own threads and processes outside the engine's CPU pinning.

Why: vLLM's CPU worker pins its process to the cores its OpenMP threads spin on (on a
2-core machine: one core). Threads and child processes inherit the affinity of the
thread that creates them, so an embedded ``mooncake_master`` started from the worker,
and the Mooncake client's transfer threads, landed on the very core the forward pass
keeps busy. The master then stops answering for up to a minute: every lookup times out
and saves fail. Linux applies ``sched_setaffinity(0, ...)`` to the
calling thread only, so widening it for the moment of creation frees exactly what is
created then and leaves the engine's own pinning alone.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Sequence
from pathlib import Path

from hybridkv.store.logs import get_logger

logger = get_logger(__name__)

_CPU_LIST_SOURCES = (
    "/sys/fs/cgroup/cpuset.cpus.effective",  # cgroup v2: what this container may use
    "/sys/devices/system/cpu/online",
)


def parse_cpu_list(text: str) -> set[int]:
    """``"0-3,8,10-11"`` -> ``{0, 1, 2, 3, 8, 10, 11}`` (the kernel's cpulist format)."""
    cpus: set[int] = set()
    for part in text.strip().split(","):
        part = part.strip()
        if not part:
            continue
        lo, _, hi = part.partition("-")
        cpus.update(range(int(lo), int(hi or lo) + 1))
    return cpus


def format_cpu_list(cpus: Sequence[int]) -> str:
    """``[0, 1, 2, 5]`` -> ``"0-2,5"``: the inverse of :func:`parse_cpu_list` (sorted input)."""
    parts: list[str] = []
    start = prev = cpus[0]
    for c in list(cpus[1:]) + [None]:
        if c is not None and c == prev + 1:
            prev = c
            continue
        parts.append(f"{start}-{prev}" if prev != start else str(start))
        if c is not None:
            start = prev = c
    return ",".join(parts)


def usable_cpus() -> set[int]:
    """Every CPU this process could be scheduled on if nobody had pinned it."""
    for source in _CPU_LIST_SOURCES:
        try:
            cpus = parse_cpu_list(Path(source).read_text())
        except (OSError, ValueError):
            continue
        if cpus:
            return cpus
    return set(range(os.cpu_count() or 1))


@contextlib.contextmanager
def unpinned() -> Iterator[None]:
    """Run the body with the calling thread allowed on every usable CPU, then restore."""
    if not hasattr(os, "sched_setaffinity"):
        yield
        return
    before = os.sched_getaffinity(0)
    wanted = usable_cpus()
    changed = False
    if wanted != before:
        try:
            os.sched_setaffinity(0, wanted)
            changed = True
        except OSError as e:  # e.g. a cpuset narrower than what sysfs reports
            logger.debug("could not widen CPU affinity to %s: %s", sorted(wanted), e)
    try:
        yield
    finally:
        if changed:
            os.sched_setaffinity(0, before)
