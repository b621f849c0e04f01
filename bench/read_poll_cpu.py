"""CPU a store read burns while it waits for a slow segment owner, per ``read_wait_nice``.

    python bench/read_poll_cpu.py [--stall-s 3] [--repeats 3] [--out bench/results]

Mooncake 0.3.13's pip build waits for a read's transfer by polling on the calling thread
(``TransferEngineOperationState::wait_for_completion`` without ``USE_EVENT_DRIVEN_COMPLETION``);
writes do not. This measures it with real processes: a ``mooncake_master``, a store node
holding the objects (a second process with a segment), and this process's MooncakeBackend
with no segment of its own. The node is SIGSTOPped for ``--stall-s`` (a peer whose CPU is
taken, or hung) while this process reads 8 objects of 16 KiB (``get_into_parts``) or writes
8 more (``put_from_parts``), with one busy competitor process per usable CPU at normal
priority (the engine's forward pass, the peer that must serve the read). Reported: the
call's wall time and this process's CPU time meanwhile (user + system), per
``read_wait_nice`` (0: the read waits at normal priority; 10; 19: hybridkv's default).
Writes to md / json under ``--out`` (read_poll_cpu.*). Mooncake's TCP session sometimes
drops a read across the stall (TRANSFER_FAIL / LEASE_EXPIRED): counted, not hidden.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import signal
import statistics
import subprocess
import sys
import threading
import time

import numpy as np

ROOT = pathlib.Path(__file__).resolve().parents[1]
_NODE = """
import os, sys, time
from hybridkv.store.mooncake_backend import MooncakeBackend
parent = os.getppid()
b = MooncakeBackend(sys.argv[1], global_segment_size=int(sys.argv[2]))
print("ready", flush=True)
while os.getppid() == parent:
    time.sleep(0.5)
"""
_BUSY = "import time\nt = time.time() + {s}\nwhile time.time() < t: pass"


def measure(nice: int, op: str, stall_s: float, tag: str) -> dict:
    """One call against a node stalled ``stall_s``; fresh master, node and client."""
    from hybridkv.store.embedded_master import EmbeddedMaster
    from hybridkv.store.mooncake_backend import MooncakeBackend, StoreError

    size, n = 16 << 10, 8
    src = np.random.default_rng(0).integers(0, 256, size * n, dtype=np.uint8)
    dst = np.zeros_like(src)
    busy: list[subprocess.Popen] = []
    with EmbeddedMaster(default_kv_lease_ttl_ms=int(stall_s * 1000 + 10_000)) as m:
        node = subprocess.Popen(
            [sys.executable, "-c", _NODE, m.address, str(64 << 20)],
            stdout=subprocess.PIPE,
            text=True,
        )
        b = None
        try:
            assert node.stdout is not None and node.stdout.readline().strip() == "ready"
            b = MooncakeBackend(
                m.address,
                global_segment_size=0,
                local_buffer_size=16 << 20,
                timeout_s=stall_s + 10,
                read_wait_nice=nice,
            )
            b.register(src.ctypes.data, src.nbytes)
            b.register(dst.ctypes.data, dst.nbytes)
            keys = [f"bench/{tag}/{i}" for i in range(n)]
            if op == "read":
                assert (
                    b.put_from_parts(
                        keys, [[src.ctypes.data + i * size] for i in range(n)], [[size]] * n
                    )
                    == [0] * n
                )
                keys_w = keys
            else:
                keys_w = [k + "/w" for k in keys]
            busy = [
                subprocess.Popen([sys.executable, "-c", _BUSY.format(s=stall_s + 30)])
                for _ in os.sched_getaffinity(0)
            ]
            time.sleep(0.3)
            os.kill(node.pid, signal.SIGSTOP)
            threading.Timer(stall_s, os.kill, (node.pid, signal.SIGCONT)).start()
            cpu0, t0 = sum(os.times()[:2]), time.monotonic()
            try:
                if op == "read":
                    codes = b.get_into_parts(
                        keys_w, [[dst.ctypes.data + i * size] for i in range(n)], [[size]] * n
                    )
                else:
                    codes = b.put_from_parts(
                        keys_w, [[src.ctypes.data + i * size] for i in range(n)], [[size]] * n
                    )
            except StoreError as e:
                codes = [e.code]
            wall, cpu = time.monotonic() - t0, sum(os.times()[:2]) - cpu0
            ok = all(c == (size if op == "read" else 0) for c in codes)
        finally:
            for c in busy:
                c.kill()
            node.kill()
            node.wait()
            if b is not None:
                b.close()
    return {
        "nice": nice,
        "op": op,
        "wall_s": wall,
        "cpu_s": cpu,
        "ok": ok,
        "codes": sorted(set(codes)),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--stall-s", type=float, default=3.0)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", default=str(ROOT / "bench" / "results"))
    args = p.parse_args(argv)
    rows = []
    for rep in range(args.repeats):
        for nice in (0, 10, 19):
            for op in ("read", "write"):
                if op == "write" and nice:
                    continue  # writes do not run on the read threads
                r = measure(nice, op, args.stall_s, f"{rep}-{nice}-{op}-{time.time_ns()}")
                print(json.dumps(r), flush=True)
                rows.append(r)
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    doc = {
        "command": "python bench/read_poll_cpu.py " + " ".join(argv or sys.argv[1:]),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "cpus": len(os.sched_getaffinity(0)),
        "stall_s": args.stall_s,
        "rows": rows,
    }
    (out / "read_poll_cpu.json").write_text(json.dumps(doc, indent=1))
    lines = [
        "# CPU a store read burns while its segment owner is stalled",
        "",
        f"- command: `{doc['command']}`; date: {doc['date']}; {doc['cpus']} CPUs, each kept busy by a "
        f"competitor process at normal priority; the node holding the objects SIGSTOPped {args.stall_s:g} s "
        "during the call; 8 objects of 16 KiB; this process's CPU (user + system) during the call",
        "",
        "| call | read_wait_nice | calls | ok | wall s (median) | CPU s (median) | CPU / wall (median [min-max]) |",
        "|---|---|---|---|---|---|---|",
    ]
    for op, nice in (("read", 0), ("read", 10), ("read", 19), ("write", 0)):
        rs = [r for r in rows if r["op"] == op and r["nice"] == nice]
        if not rs:
            continue
        share = [r["cpu_s"] / r["wall_s"] for r in rs]
        lines.append(
            f"| {'get_into_parts' if op == 'read' else 'put_from_parts'} | {nice} | {len(rs)} | "
            f"{sum(r['ok'] for r in rs)} | {statistics.median(r['wall_s'] for r in rs):.2f} | "
            f"{statistics.median(r['cpu_s'] for r in rs):.2f} | {statistics.median(share):.3f} "
            f"[{min(share):.3f}-{max(share):.3f}] |"
        )
    lines += [
        "",
        "Calls not ok: Mooncake's TCP session dropped the transfer across the stall (codes in the json).",
    ]
    (out / "read_poll_cpu.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
