"""Does splitting one big ``batch_is_exist`` into K concurrent calls pay, on this machine?

``python bench/exists_split.py [--keys N] [--repeats R] [--ks 1,2,3,4]``

Stores N 64-byte objects under hybridkv-style names (118 characters) on a fresh
``mooncake_master``, then times ``batch_is_exist`` of all N keys split into K
contiguous shards, each shard on its own thread (the binding releases the GIL), all
in flight at once; the K variants are interleaved (rotated every repeat). Also
records the CPU seconds each call costs this process and the master (so the
question "who is busy" has an answer), and the time of the same K calls issued one
after another (what concurrency adds over plain splitting).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("VLLM_HOST_IP", "127.0.0.1")
os.environ.setdefault("GLOG_minloglevel", "2")


def _proc_cpu(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--keys", type=int, default=12314)
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--ks", default="1,2,3,4,6")
    ap.add_argument(
        "--fill",
        type=int,
        default=0,
        help="other objects stored beside the keys (the lookup bench's master holds ~126k)",
    )
    ap.add_argument(
        "--rpc-threads", type=int, default=0, help="master --rpc_thread_num (0: its default)"
    )
    args = ap.parse_args()
    ks = [int(k) for k in args.ks.split(",")]

    import numpy as np

    from hybridkv.store.embedded_master import EmbeddedMaster
    from hybridkv.store.keys import KeySchema
    from hybridkv.store.mooncake_backend import MooncakeBackend

    extra = [f"--rpc_thread_num={args.rpc_threads}"] if args.rpc_threads else []
    with EmbeddedMaster(extra_args=extra) as master:
        client = MooncakeBackend(master.address, global_segment_size=512 << 20, workers=max(ks) + 2)
        schema = KeySchema.create("bench", "bf16", [{"g": 4}])
        rng = np.random.default_rng(0)
        keys = [schema.key(int(g), rng.bytes(32)) for g in rng.integers(0, 2, args.keys)]
        buf = np.zeros(64, dtype=np.uint8)
        client.register(buf.ctypes.data, buf.nbytes)
        other = [schema.key(2, rng.bytes(32)) for _ in range(args.fill)]
        for lo in range(0, len(other), 4096):
            part = other[lo : lo + 4096]
            assert client.put_from(
                part, [buf.ctypes.data] * len(part), [64] * len(part), timeout_s=60
            ) == [0] * len(part)
        for lo in range(0, len(keys), 4096):
            part = keys[lo : lo + 4096]
            assert client.put_from(
                part, [buf.ctypes.data] * len(part), [64] * len(part), timeout_s=60
            ) == [0] * len(part)
        store = client._store
        mpid = master._proc.pid
        expect = [1] * len(keys)

        def shards(k: int) -> list[list[str]]:
            n = len(keys)
            return [keys[i * n // k : (i + 1) * n // k] for i in range(k)]

        split = {k: shards(k) for k in ks}

        def concurrent(k: int) -> list[int]:
            parts = split[k]
            if k == 1:
                return list(store.batch_is_exist(parts[0]))
            out: list = [None] * k

            def run(i: int) -> None:
                out[i] = store.batch_is_exist(parts[i])

            ts = [threading.Thread(target=run, args=(i,)) for i in range(1, k)]
            for t in ts:
                t.start()
            run(0)
            for t in ts:
                t.join()
            return [c for o in out for c in o]

        def pooled(k: int) -> list[bool]:
            """Through the backend's bounded call path: K calls on its daemon pool."""
            futs = [client._pool.submit(store.batch_is_exist, p) for p in split[k]]
            return [c for f in futs for c in f.result(timeout=10)]

        def sequential(k: int) -> list[int]:
            return [c for p in split[k] for c in store.batch_is_exist(p)]

        units = [
            (name, k, fn)
            for k in ks
            for name, fn in (("threads", concurrent), ("pool", pooled), ("sequential", sequential))
            if not (k == 1 and name != "threads")
        ]
        res: dict = {(n, k): {"wall": [], "cpu": [], "mcpu": []} for n, k, _ in units}
        for n, k, fn in units:  # warm-up
            assert list(fn(k)) == expect
        for r in range(args.repeats):
            for n, k, fn in units[r % len(units) :] + units[: r % len(units)]:
                c0, m0 = time.process_time(), _proc_cpu(mpid)
                t0 = time.perf_counter()
                out = fn(k)
                t1 = time.perf_counter()
                c1, m1 = time.process_time(), _proc_cpu(mpid)
                assert list(out) == expect
                d = res[(n, k)]
                d["wall"].append(t1 - t0)
                d["cpu"].append(c1 - c0)
                d["mcpu"].append(m1 - m0)
        base = res[("threads", 1)]["wall"]
        print(
            f"{args.keys} keys (+{args.fill} other objects stored), {args.repeats} repeats, master rpc threads {args.rpc_threads or 'default'}; "
            f"ms median [min-max]; ratio to K=1 per repeat; cpu = process CPU s of this process / master (10 ms ticks)"
        )
        for (n, k), d in res.items():
            w = d["wall"]
            rat = [a / b for a, b in zip(w, base)]
            print(
                f"  {n:10s} K={k}: {statistics.median(w) * 1e3:6.1f} [{min(w) * 1e3:.1f}-{max(w) * 1e3:.1f}] ms"
                f"  ratio {statistics.median(rat):.2f} [{min(rat):.2f}-{max(rat):.2f}]"
                f"  cpu client {statistics.mean(d['cpu']) * 1e3:.1f} ms master {statistics.mean(d['mcpu']) * 1e3:.1f} ms"
            )
        client.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
