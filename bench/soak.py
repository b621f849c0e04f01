"""Soak with chaos: the agentic demo workload against a store server while the master fails.

    flock /tmp/hybridkv-engine.lock .venv/bin/python bench/soak.py [--sessions 16] [--phase-s 60]
        [--out bench/results/soak]

Not in CI (one engine, minutes). One real vLLM OpenAI server on the CPU engine with
HybridStoreConnector on an external ``mooncake_master`` this script owns, so it can fault it:

    warm      (phase-s)   healthy
    stop      (10 s)      master SIGSTOPped (hung), then SIGCONT
    after-stop(phase-s)
    kill      (-)         master SIGKILLed, a new one started on the SAME port after 3 s
    after-kill(phase-s)

``--sessions`` agentic sessions (the demo's seeded Trajectory: each turn re-sends the previous
prompt + answer + a new chunk) run concurrently, one request at a time each, with a small local
KV cache so later turns must come from the store. Per phase: requests, failures (HTTP error or
empty answer; the policy is recompute, so the target is 0), p50/p99 TTFT, prompt-token hit rate,
store blocks loaded; seconds from the new master until the store serves loads again
(``vllm:hybridkv_store_loaded_blocks`` grows); the server's RSS and thread count sampled every
2 s (growth target < 5 %); processes and temp dirs left after shutdown.
Writes ``soak.json``, ``soak.md`` (the table) and ``soak.png`` (TTFT, hit rate, RSS over time).
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import signal
import statistics
import sys
import tempfile
import threading
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("VLLM_HOST_IP", "127.0.0.1")
os.environ.setdefault("GLOG_minloglevel", "2")

PHASES = ("warm", "stop", "after-stop", "kill", "after-kill")


def _pct(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))]


def _metric(client, name: str) -> float:  # noqa: ANN001 - agentic_demo.Client
    try:
        return sum(v for k, v in client.metrics().items() if k.split("{")[0] == name)
    except Exception:  # noqa: BLE001 - the server may be busy; a missing sample is fine
        return float("nan")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sessions", type=int, default=16)
    p.add_argument("--phase-s", type=float, default=60.0)
    p.add_argument("--stop-s", type=float, default=10.0)
    p.add_argument("--turns", type=int, default=6)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--num-gpu-blocks", type=int, default=64)
    p.add_argument("--timeout-s", type=float, default=2.0, help="the connector's timeout_s")
    p.add_argument("--kind", default="gemma3")
    p.add_argument("--out", default=str(ROOT / "bench" / "results" / "soak"))
    args = p.parse_args(argv)

    import psutil

    from hybridkv.cli.agentic_demo import Client, Trajectory
    from hybridkv.cli.server import VllmServer
    from hybridkv.cli.tiny_models import write_tiny_model
    from hybridkv.store.embedded_master import EmbeddedMaster

    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    work = pathlib.Path(tempfile.mkdtemp(prefix="hybridkv-soak-"))
    model = str(write_tiny_model(args.kind, pathlib.Path.home() / ".cache" / "hybridkv" / "tiny-models"
                                 / f"{args.kind}-seed0", seed=0))
    master = EmbeddedMaster(default_kv_lease_ttl_ms=5000)
    port = master.rpc_port
    master_dirs = [master.log_path.parent]  # each must be gone after shutdown
    kv = {"kv_connector": "HybridStoreConnector", "kv_connector_module_path": "hybridkv.connector",
          "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
          "kv_connector_extra_config": {"master_address": master.address, "global_segment_size": "512MiB",
                                        "timeout_s": args.timeout_s, "lookup_timeout_s": min(1.0, args.timeout_s)}}
    srv = VllmServer(model, max_model_len=2048, kv_transfer_config=kv, log_path=work / "vllm.log",
                     extra_args=["--num-gpu-blocks-override", str(args.num_gpu_blocks), "--seed", "0",
                                 "--max-num-batched-tokens", "512", "--max-num-seqs", "8"])
    records: list[dict] = []
    samples: list[dict] = []
    events: dict[str, float] = {}
    phase = {"name": "warm"}
    lock = threading.Lock()
    stop_all = threading.Event()
    srv.start()
    t0 = time.monotonic()
    try:
        proc = psutil.Process(srv.proc.pid)

        def session_loop(slot: int) -> None:
            client = Client(srv.url, timeout_s=120)
            gen, turn, prompt, answer = 0, 0, "", ""
            while not stop_all.is_set():
                traj = Trajectory(1000 * slot + gen, 600, 120)
                prompt = traj.prompt(turn, prompt, answer)
                start = time.monotonic()
                rec = {"t": start - t0, "phase": phase["name"], "slot": slot, "turn": turn}
                try:
                    c = client.complete(srv_model, prompt, args.max_tokens)
                    ok = bool(c.token_ids)
                    rec.update(ok=ok, ttft_ms=c.ttft_s * 1e3, prompt=c.prompt_tokens, cached=c.cached_tokens or 0)
                    answer = c.text
                except Exception as e:  # noqa: BLE001 - counted as a failure
                    ok = False
                    rec.update(ok=False, error=f"{type(e).__name__}: {str(e)[:200]}")
                rec["latency_s"] = time.monotonic() - start
                with lock:
                    records.append(rec)
                if not ok or turn + 1 >= args.turns:
                    gen, turn, prompt, answer = gen + 1, 0, "", ""
                    if not ok:
                        time.sleep(1.0)
                else:
                    turn += 1

        def sampler() -> None:
            client = Client(srv.url, timeout_s=10)
            while not stop_all.wait(2.0):
                try:
                    procs = [proc, *proc.children(recursive=True)]
                    rss = sum(p_.memory_info().rss for p_ in procs if p_.is_running())
                    threads = sum(p_.num_threads() for p_ in procs if p_.is_running())
                except psutil.Error:
                    continue
                samples.append({"t": time.monotonic() - t0, "phase": phase["name"], "rss_mib": rss / 2**20,
                                "threads": threads,
                                "loaded_blocks": _metric(client, "vllm:hybridkv_store_loaded_blocks_total")})

        srv_model = Client(srv.url).model_card()[0]
        workers = [threading.Thread(target=session_loop, args=(i,), daemon=True) for i in range(args.sessions)]
        workers.append(threading.Thread(target=sampler, daemon=True))
        for w in workers:
            w.start()

        def enter(name: str) -> None:
            phase["name"] = name
            events[name] = time.monotonic() - t0
            print(f"[{events[name]:7.1f} s] {name}", file=sys.stderr, flush=True)

        time.sleep(args.phase_s)
        enter("stop")
        os.kill(master.pid, signal.SIGSTOP)
        time.sleep(args.stop_s)
        os.kill(master.pid, signal.SIGCONT)
        enter("after-stop")
        time.sleep(args.phase_s)
        enter("kill")
        master.kill()
        time.sleep(3.0)
        master = EmbeddedMaster(default_kv_lease_ttl_ms=5000, rpc_port=port)
        master_dirs.append(master.log_path.parent)
        events["master_back"] = time.monotonic() - t0
        enter("after-kill")
        time.sleep(args.phase_s)
        stop_all.set()
        for w in workers:
            w.join(timeout=150)
    finally:
        stop_all.set()
        srv.stop()
        master.stop()
    time.sleep(2.0)
    left_procs = [p_.pid for p_ in psutil.process_iter(["cmdline"])
                  if any(f"--rpc_port={port}" in a for a in (p_.info["cmdline"] or []))]
    left_dirs = [str(d) for d in master_dirs if d.exists()]

    # Seconds from the new master until a store load is seen again.
    back = events["master_back"]
    before_back = [s["loaded_blocks"] for s in samples if s["t"] <= back and s["loaded_blocks"] == s["loaded_blocks"]]
    base = before_back[-1] if before_back else 0.0
    recovered = next((s["t"] - back for s in samples if s["t"] > back and s["loaded_blocks"] > base), None)
    rows = []
    for name in PHASES:
        rs = [r for r in records if r["phase"] == name]
        good = [r for r in rs if r.get("ok")]
        ttft = [r["ttft_ms"] for r in good]
        prompt = sum(r["prompt"] for r in good)
        rows.append({"phase": name, "requests": len(rs), "failures": len(rs) - len(good),
                     "ttft_p50_ms": _pct(ttft, 0.5), "ttft_p99_ms": _pct(ttft, 0.99),
                     "hit_rate": sum(r["cached"] for r in good) / prompt if prompt else None,
                     "max_latency_s": max((r["latency_s"] for r in rs), default=None)})
    warm = [s for s in samples if s["phase"] == "warm"]
    rss_growth = (samples[-1]["rss_mib"] / statistics.mean(x["rss_mib"] for x in warm[-3:]) - 1) if warm else None
    thr_growth = (samples[-1]["threads"] / statistics.mean(x["threads"] for x in warm[-3:]) - 1) if warm else None
    doc = {"args": vars(args), "phases": rows, "events": events, "store_loads_back_after_s": recovered,
           "rss_growth": rss_growth, "thread_growth": thr_growth, "left_processes": left_procs,
           "left_dirs": left_dirs, "samples": samples, "failure_examples": [r for r in records if not r.get("ok")][:5]}
    (out / "soak.json").write_text(json.dumps(doc, indent=1, default=str))

    def f(x, spec=".1f"):  # noqa: ANN001, ANN202
        return "n/a" if x is None else format(x, spec)

    lines = ["| phase | requests | failures | TTFT p50 ms | TTFT p99 ms | hit rate | max latency s |",
             "|---|---|---|---|---|---|---|"]
    lines += [f"| {r['phase']} | {r['requests']} | {r['failures']} | {f(r['ttft_p50_ms'])} | {f(r['ttft_p99_ms'])} "
              f"| {f(r['hit_rate'], '.3f')} | {f(r['max_latency_s'], '.2f')} |" for r in rows]
    lines += ["", f"store loads again {f(recovered, '.1f')} s after the new master (target <= 30)",
              f"RSS growth {f(None if rss_growth is None else 100 * rss_growth)} %, threads "
              f"{f(None if thr_growth is None else 100 * thr_growth)} % (target < 5 %)",
              f"left after shutdown: processes {left_procs or 'none'}, master dirs {left_dirs or 'none'}"]
    (out / "soak.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(3, 1, figsize=(9, 8), sharex=True)
        good = [r for r in records if r.get("ok")]
        ax[0].scatter([r["t"] for r in good], [r["ttft_ms"] for r in good], s=4)
        ax[0].set_ylabel("TTFT ms")
        ax[1].scatter([r["t"] for r in good], [r["cached"] / r["prompt"] for r in good], s=4)
        ax[1].set_ylabel("cached / prompt")
        ax[2].plot([s["t"] for s in samples], [s["rss_mib"] for s in samples])
        ax[2].set_ylabel("RSS MiB")
        ax[2].set_xlabel("s")
        for a in ax:
            for name, t in events.items():
                a.axvline(t, color="red", lw=0.6)
        fig.tight_layout()
        fig.savefig(out / "soak.png", dpi=100)
    except Exception as e:  # noqa: BLE001 - the table is the result; the plot is a bonus
        print(f"plot skipped: {e}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
