"""Who had the CPU while a soak's turns stalled.

The soak's turns stall together for 15-50 s on the shared 2-core machine. Whether that is
the host taking the CPU away (steal), the machine idling while something waits, or one
process eating both cores decides what could fix it, so the soak records, once a second and
from /proc only (no HTTP call that a starved server could hold up):

* the machine's cumulative busy / idle / iowait / steal seconds (/proc/stat);
* each server process's cumulative CPU seconds (user + system), keyed ``server/name[pid]``;
* the sampler's own lateness (a sample due every second that comes 25 s late says the
  sampler itself got no CPU).

:func:`stalls` then finds every window of at least ``min_gap_s`` in which no turn was
answered and reports, over that window, the CPU each process used and the machine's steal
and idle time.
"""

from __future__ import annotations

import os
import threading
import time
from typing import Callable, Iterable

CPU_SAMPLE_S = 1.0
_TICK = os.sysconf("SC_CLK_TCK")


def machine_times() -> dict[str, float]:
    """Seconds since boot, summed over CPUs: busy (user+nice+system+irq+softirq), idle,
    iowait, steal."""
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:]]
    user, nice, system, idle, iowait, irq, softirq, steal = (v + [0] * 8)[:8]
    return {
        "busy": (user + nice + system + irq + softirq) / _TICK,
        "idle": idle / _TICK,
        "iowait": iowait / _TICK,
        "steal": steal / _TICK,
    }


def process_cpu_s(pid: int) -> float | None:
    """user + system CPU seconds of ``pid`` (all its threads), None if it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / _TICK
    except (OSError, IndexError, ValueError):
        return None


def process_name(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/comm") as f:
            return f.read().strip()
    except OSError:
        return "?"


class CpuSampler:
    """A daemon thread appending one row per second to ``rows`` until ``stop`` is set.

    ``pids()`` returns ``{server name: [pid, ...]}`` (read each time: a restarted server's
    new processes appear); this process is recorded as ``harness``."""

    def __init__(
        self, t0: float, pids: Callable[[], dict[str, Iterable[int]]], stop: threading.Event
    ) -> None:
        self.rows: list[dict] = []
        self._t0, self._pids, self._stop = t0, pids, stop
        self._names: dict[int, str] = {}
        self.thread = threading.Thread(target=self._run, daemon=True, name="soak-cpu-sampler")

    def start(self) -> None:
        self.thread.start()

    def _run(self) -> None:
        me = os.getpid()
        while not self._stop.wait(CPU_SAMPLE_S):
            row: dict = {"t": round(time.monotonic() - self._t0, 2), **machine_times(), "procs": {}}
            try:
                groups = {"harness": [me], **{k: list(v) for k, v in self._pids().items()}}
            except Exception:  # noqa: BLE001 - a server between restarts: sample what is known
                groups = {"harness": [me]}
            for server, pids in groups.items():
                for pid in pids:
                    cpu = process_cpu_s(pid)
                    if cpu is None:
                        continue
                    name = self._names.get(pid)
                    if name is None:  # read once: the key must stay the same for the pid's deltas
                        name = self._names[pid] = process_name(pid)
                    row["procs"][f"{server}/{name}[{pid}]"] = cpu
            self.rows.append(row)


def stalls(
    records: list[dict], cpu_rows: list[dict], min_gap_s: float = 10.0, top: int = 4
) -> list[dict]:
    """Windows of at least ``min_gap_s`` with no answered turn, each with the CPU seconds
    the busiest processes used in it, the machine's busy / idle / steal seconds there, and
    the longest interval between two CPU samples inside it (the sampler's own starvation).

    The run's start (t = 0) and its last CPU sample bound the first and last window. A
    process that started inside a window is charged all its CPU (from 0); one that ended
    inside it, up to its last sample."""
    ends = sorted(r["t"] + r["latency_s"] for r in records if r.get("ok") and "latency_s" in r)
    if cpu_rows:
        ends = [0.0, *ends, max(cpu_rows[-1]["t"], ends[-1] if ends else 0.0)]
    out = []
    for a, b in zip(ends, ends[1:]):
        if b - a < min_gap_s:
            continue
        inside = [r for r in cpu_rows if a <= r["t"] <= b]
        before = [r for r in cpu_rows if r["t"] < a]
        after = [r for r in cpu_rows if r["t"] > b]
        first = before[-1] if before else (inside[0] if inside else None)
        last = after[0] if after else (inside[-1] if inside else None)
        if first is None or last is None or first is last:
            continue
        seen = [first, *inside, last]
        used = {}
        for k in {k for r in seen for k in r["procs"]}:
            had = [r["procs"][k] for r in seen if k in r["procs"]]
            used[k] = had[-1] - first["procs"].get(k, 0.0)
        times = [first["t"], *[r["t"] for r in inside], last["t"]]
        out.append(
            {
                "from_s": round(a, 1),
                "to_s": round(b, 1),
                "window_s": round(last["t"] - first["t"], 1),
                **{k: round(last[k] - first[k], 1) for k in ("busy", "idle", "iowait", "steal")},
                "top": sorted(((k, round(v, 1)) for k, v in used.items()), key=lambda kv: -kv[1])[
                    :top
                ],
                "longest_sample_gap_s": round(max(y - x for x, y in zip(times, times[1:])), 1),
            }
        )
    return out


def describe(rows: list[dict]) -> list[str]:
    """One markdown line per stall."""
    return [
        f"- {s['from_s']:g}-{s['to_s']:g} s without an answered turn: over {s['window_s']:g} s the machine "
        f"was busy {s['busy']:g} CPU-s, idle {s['idle']:g}, iowait {s['iowait']:g}, steal {s['steal']:g}; "
        f"most CPU: {', '.join(f'{k} {v:g} s' for k, v in s['top'])}; the /proc sampler's longest "
        f"wait {s['longest_sample_gap_s']:g} s (due every {CPU_SAMPLE_S:g} s)"
        for s in rows
    ]
