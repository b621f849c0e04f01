"""P/D transfer: PDTransport.read_blocks against a raw NIXL READ of the same descriptors.

    .venv/bin/python bench/pd_transfer.py [--repeats N] [--quick] [--out FILE] [--plot-only]

Two processes on loopback (UCX, ``UCX_NET_DEVICES=lo``; UCX picks cma on one
host unless ``UCX_TLS`` says otherwise). The prefill process builds a KV cache
with vLLM's own allocation code (one full-attention group of L layers whose
block is 64 KiB .. 1 MiB per layer), fills it with a position-dependent
pattern, registers it with a PDTransport and serves the hybridkv handshake. The
decode process handshakes, then for each case reads B scattered blocks (fresh
random remote and local ids each repeat) two ways, alternating so both see
the same machine noise:

* hybridkv: ``read_blocks(peer, remote_ids, local_ids, notif)`` + ``wait`` —
  block ids -> descriptors (``GroupLayout.regions``) -> one READ;
* raw NIXL (the baseline): a second agent in the same process, registered on
  the same memory, posting ``initialize_xfer`` + ``transfer`` + polling with the
  SAME descriptor arrays, built before the clock starts.

GB/s = bytes of the batch / wall time from call to completion. Also reported:
the descriptor build alone and an in-process memcpy of the batch's bytes
(scattered blocks, numpy) for scale. Moved bytes are checked against the
pattern once per case (a wrong byte aborts the run). Prints a table and writes
Markdown to bench/results/pd_transfer.md (or --out), every repeat to the .json and a
plot to the .png next to it; ``--plot-only`` re-renders .md and .png from that .json.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import multiprocessing as mp
import os
import platform
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("UCX_NET_DEVICES", "lo")
os.environ.setdefault(
    "UCX_MODULES", "^ib"
)  # else a segfault at exit (two libnl copies, see the test)

ROOT = Path(__file__).resolve().parents[1]
TILE = 65521  # prime: the pattern differs between any two blocks and layers
# (name, layers, block bytes per layer, blocks per read)
CASES = [
    ("64K x4L x64", 4, 64 << 10, 64),
    ("64K x4L x256", 4, 64 << 10, 256),
    ("64K x4L x512", 4, 64 << 10, 512),
    ("64K x16L x256", 16, 64 << 10, 256),
    ("256K x4L x64", 4, 256 << 10, 64),
    ("256K x4L x256", 4, 256 << 10, 256),
    ("1M x2L x64", 2, 1 << 20, 64),
    ("1M x4L x128", 4, 1 << 20, 128),
]
QUICK = [CASES[0], CASES[4], CASES[6]]
PROGRESS_DELAY_US = 100  # PDTransport's default


def build_kv(layers: int, block_bytes: int, num_blocks: int):
    """KV cache of one full-attention group, allocated exactly as vLLM's worker does."""
    import torch
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheGroupSpec
    from vllm.v1.worker.utils import allocate_kv_cache

    from hybridkv.connector.block_layout import KVLayout, layout_rows
    from hybridkv.store.vllm_compat import get_kv_cache_config_from_groups

    heads, head = 4, 128  # 2 KiB per token (K+V bf16)
    block_size = block_bytes // (heads * 2 * head * 2)
    spec = FullAttentionSpec(
        block_size=block_size, num_kv_heads=heads, head_size=head, dtype=torch.bfloat16
    )
    assert spec.page_size_bytes == block_bytes
    cfg = VllmConfig()
    cfg.cache_config.kv_cache_layout = "LBHNC"
    group = KVCacheGroupSpec([f"layer.{i}" for i in range(layers)], spec)
    kcc = get_kv_cache_config_from_groups(cfg, [group], num_blocks * layers * block_bytes)
    caches = allocate_kv_cache(
        kcc, torch.device("cpu"), cfg.cache_config.get_resolved_kv_cache_layout()
    )
    layout = KVLayout.from_kv_caches(kcc, caches)
    raw = torch.empty(0, dtype=torch.uint8).set_(next(iter(caches.values())).untyped_storage())
    return kcc, caches, layout, raw, layout_rows(kcc)


def _pattern(n: int):
    import numpy as np

    tile = np.random.default_rng(7).integers(0, 256, TILE, dtype=np.uint8)
    return np.resize(tile, n)


def prefill_main(conn) -> None:
    """Prefill process: per case a fresh KV cache, agent and handshake server."""
    from hybridkv.connector.pd_handshake import AgentInfo, HandshakeServer, LayoutDescriptor
    from hybridkv.connector.pd_transport import PDTransport

    state = None
    while True:
        cmd, *args = conn.recv()
        if state is not None:
            state[0].stop()
            state[1].shutdown()
            state = None
        if cmd == "stop":
            conn.send("bye")
            return
        name, layers, block_bytes, num_blocks = args
        kcc, caches, layout, raw, rows = build_kv(layers, block_bytes, num_blocks)
        raw.numpy()[:] = _pattern(raw.numel())
        transport = PDTransport(f"prefill-{name}", layout)
        info = AgentInfo(
            engine_id="bench-prefill",
            tp_rank=0,
            agent_name=transport.name,
            agent_metadata=transport.metadata(),
            layout=LayoutDescriptor.from_kv(layout, rows, tp_size=1),
        )
        server = HandshakeServer(info)
        conn.send(server.start())
        state = (server, transport, caches, raw)


def q(xs: list[float], p: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, round(p * (len(s) - 1))))]


def run_case(conn, case, repeats: int, warmup: int) -> dict:
    import numpy as np

    from hybridkv.connector.pd_handshake import LayoutDescriptor, fetch_agent_info
    from hybridkv.connector.pd_transport import PDTransport, _make_agent, read_descriptors

    name, layers, block_bytes, blocks = case
    num_blocks = 2 * blocks + 8  # room for scattered ids on both sides
    conn.send(("case", name, layers, block_bytes, num_blocks))
    port = conn.recv()
    kcc, caches, layout, raw, rows = build_kv(layers, block_bytes, num_blocks)
    raw.numpy()[:] = 0xA5  # touch every page before timing
    address = f"127.0.0.1:{port}"
    local_desc = LayoutDescriptor.from_kv(layout, rows, tp_size=1)
    hs = []
    for _ in range(5):
        t = time.perf_counter()
        info = fetch_agent_info(
            address, local_desc, engine_id="bench-decode", tp_rank=0, timeout_s=10
        )
        hs.append(time.perf_counter() - t)
    transport = PDTransport(f"decode-{name}", layout, progress_delay_us=PROGRESS_DELAY_US)
    peer = transport.add_peer(info.agent_metadata, info.layout.group_layouts())
    peer_groups = info.layout.group_layouts()

    # Same agent settings as PDTransport (progress thread with a delay: a stock nixl_agent's
    # spins a core, which on this 2-core host would slow whichever path runs next to it).
    raw_agent = _make_agent(f"raw-{name}", ["UCX"], PROGRESS_DELAY_US)
    base, size = layout.allocations[0]
    reg = raw_agent.register_memory([(base, size, 0, "")], "DRAM")
    raw_peer = raw_agent.add_remote_agent(info.agent_metadata)

    rng = np.random.default_rng(11)
    nbytes = blocks * layers * block_bytes
    mem = raw.numpy()

    def ids():
        r = rng.choice(num_blocks, blocks, replace=False).tolist()
        lo = rng.choice(num_blocks, blocks, replace=False).tolist()
        return [r], [lo]

    def hybridkv_read(r, lo) -> float:
        t = time.perf_counter()
        transport.wait(transport.read_blocks(peer, r, lo, notif=b"bench"), 60.0)
        return time.perf_counter() - t

    def raw_read(r, lo) -> float:
        loc, rem = read_descriptors(layout.groups, peer_groups, r, lo)  # outside the clock
        t = time.perf_counter()
        h = raw_agent.initialize_xfer(
            "READ",
            raw_agent.get_xfer_descs(loc, "DRAM"),
            raw_agent.get_xfer_descs(rem, "DRAM"),
            raw_peer,
            b"bench",
        )
        st = raw_agent.transfer(h)
        while st == "PROC":
            st = raw_agent.check_xfer_state(h)
        dt_ = time.perf_counter() - t
        assert st == "DONE", st
        raw_agent.release_xfer_handle(h)
        return dt_

    def check(r, lo) -> None:
        g = layout.groups[0]
        la, ls = g.regions(lo[0])
        ra, _ = peer_groups[0].regions(r[0])
        pat = np.random.default_rng(7).integers(0, 256, TILE, dtype=np.uint8)
        peer_base = int(peer_groups[0].bases[0])  # layer 0 starts the peer's allocation (offset 0)
        for k in range(0, blocks, max(1, blocks // 16)):
            for j in range(layers):
                off_l, off_r, n = la[k][j] - base, ra[k][j] - peer_base, ls[k][j]
                want = pat[(np.arange(n) + off_r) % TILE]
                if not np.array_equal(mem[off_l : off_l + n], want):
                    raise SystemExit(
                        f"{name}: block {r[0][k]}->{lo[0][k]} layer {j} has wrong bytes"
                    )

    # correctness, both paths
    for fn in (hybridkv_read, raw_read):
        mem[:] = 0xA5
        r, lo = ids()
        fn(r, lo)
        check(r, lo)

    ours, base_t, build = [], [], []
    for i in range(warmup + repeats):
        for first in (hybridkv_read, raw_read) if i % 2 == 0 else (raw_read, hybridkv_read):
            r, lo = ids()
            d = first(r, lo)
            if i >= warmup:
                (ours if first is hybridkv_read else base_t).append(d)
        r, lo = ids()
        t = time.perf_counter()
        read_descriptors(layout.groups, peer_groups, r, lo)
        build.append(time.perf_counter() - t)

    # memcpy of the same scattered blocks inside one process, for scale
    g = layout.groups[0]
    cp = []
    for _ in range(max(3, repeats // 3)):
        r, lo = ids()
        src, sz = g.regions(r[0])
        dst, _ = g.regions(lo[0])
        t = time.perf_counter()
        for srow, drow in zip(src, dst):
            for s, d_ in zip(srow, drow):
                mem[d_ - base : d_ - base + block_bytes] = mem[s - base : s - base + block_bytes]
        cp.append(time.perf_counter() - t)

    transport.shutdown()
    raw_agent.remove_remote_agent(raw_peer)
    raw_agent.deregister_memory(reg)
    gbs = lambda ts: [nbytes / t / 1e9 for t in ts]  # noqa: E731
    return {
        "name": name,
        "layers": layers,
        "block_bytes": block_bytes,
        "blocks": blocks,
        "mib": nbytes / (1 << 20),
        "descs": blocks * layers,
        "ours": gbs(ours),
        "raw": gbs(base_t),
        "ratio": statistics.median(base_t) / statistics.median(ours),
        "build_us": statistics.median(build) * 1e6,
        "memcpy": statistics.median(gbs(cp)),
        "handshake_ms": statistics.median(hs) * 1e3,
    }


def idle_agent_cpu() -> dict[int, float]:
    """CPU share of one idle agent's progress thread, by progress delay (0 = stock nixl_agent)."""
    import resource

    from hybridkv.connector.pd_transport import _make_agent

    def cpu() -> float:
        r = resource.getrusage(resource.RUSAGE_SELF)
        return r.ru_utime + r.ru_stime

    out = {}
    for delay in (0, 10, PROGRESS_DELAY_US):
        agent = _make_agent(f"idle-{delay}", ["UCX"], delay)
        c0, t0 = cpu(), time.perf_counter()
        time.sleep(1.0)
        out[delay] = 100 * (cpu() - c0) / (time.perf_counter() - t0)
        del agent
    return out


def fmt(xs: list[float]) -> str:
    return f"{statistics.median(xs):.2f} [{q(xs, 0.25):.2f}-{q(xs, 0.75):.2f}]"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--quick", action="store_true", help="3 cases, 5 repeats")
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "pd_transfer.md")
    ap.add_argument(
        "--plot-only",
        action="store_true",
        help="no run: re-render the .md and .png from the .json next to --out",
    )
    args = ap.parse_args()
    if args.plot_only:
        write_outputs(json.loads(args.out.with_suffix(".json").read_text()), args.out)
        return
    cases, repeats = (QUICK, 5) if args.quick else (CASES, args.repeats)

    load0 = os.getloadavg()
    ctx = mp.get_context("spawn")
    conn, child = ctx.Pipe()
    proc = ctx.Process(target=prefill_main, args=(child,), daemon=True)
    proc.start()
    rows = []
    try:
        for case in cases:
            res = run_case(conn, case, repeats, args.warmup)
            rows.append(res)
            print(
                f"{res['name']:>14}  {res['mib']:6.0f} MiB  {res['descs']:5d} descs  "
                f"hybridkv {fmt(res['ours'])}  raw {fmt(res['raw'])}  ratio {res['ratio']:.2f}  "
                f"build {res['build_us']:.0f} us  memcpy {res['memcpy']:.2f} GB/s",
                flush=True,
            )
        conn.send(("stop",))
        conn.recv()
    finally:
        proc.join(10)
        if proc.is_alive():
            proc.kill()
    load1 = os.getloadavg()
    idle = idle_agent_cpu()
    print(
        "idle agent CPU % of a core by progress delay (us):", {k: round(v) for k, v in idle.items()}
    )

    from importlib.metadata import version

    cmd = (
        "python bench/pd_transfer.py"
        + (" --quick" if args.quick else "")
        + (f" --repeats {args.repeats}" if args.repeats != 15 and not args.quick else "")
    )
    doc = {
        "meta": {
            "command": cmd,
            "host": f"{platform.machine()}, {os.cpu_count()} cores, {platform.platform()}; Python "
            f"{platform.python_version()}; nixl-cu12 {version('nixl-cu12')}",
            "load0": load0[0],
            "load1": load1[0],
            "ucx": {k: os.environ.get(k) for k in ("UCX_NET_DEVICES", "UCX_MODULES", "UCX_TLS")},
            "date": f"{dt.datetime.now(dt.timezone.utc):%Y-%m-%d %H:%M} UTC",
            "repeats": repeats,
            "warmup": args.warmup,
            "progress_delay_us": PROGRESS_DELAY_US,
            "idle_agent_cpu_pct": {str(k): v for k, v in idle.items()},
        },
        "rows": rows,
    }
    write_outputs(doc, args.out)


def paired_bars(ax, rows: list[dict], ours_label: str, raw_label: str) -> None:  # noqa: ANN001 - a matplotlib Axes
    """Both paths of each row (``ours`` / ``raw`` GB/s per repeat) side by side: median bar,
    p25-p75 whisker, every repeat as a dot (bench/pd_transfer_tp.py draws the same)."""
    width = 0.38
    for j, (key, label, color) in enumerate(
        (("ours", ours_label, "tab:blue"), ("raw", raw_label, "tab:gray"))
    ):
        xs = [i + (j - 0.5) * width for i in range(len(rows))]
        meds = [statistics.median(r[key]) for r in rows]
        lo = [m - q(r[key], 0.25) for m, r in zip(meds, rows)]
        hi = [q(r[key], 0.75) - m for m, r in zip(meds, rows)]
        ax.bar(xs, meds, width, yerr=[lo, hi], capsize=3, color=color, label=label)
        for x, r in zip(xs, rows):
            ax.scatter([x] * len(r[key]), r[key], s=6, color="k", zorder=3)


def plot(rows: list[dict], path: Path) -> str:
    """GB/s per case, both paths: median bar, p25-p75 whisker, every repeat as a dot."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(11, 4.2))
    paired_bars(ax, rows, "hybridkv read_blocks", "raw NIXL READ")
    ax.scatter(
        range(len(rows)),
        [r["memcpy"] for r in rows],
        marker="_",
        s=300,
        color="tab:red",
        label="in-process memcpy (scale)",
        zorder=4,
    )
    for i, r in enumerate(rows):
        ax.annotate(
            f"x{r['ratio']:.2f}",
            (i, max(max(r["ours"]), max(r["raw"]))),
            ha="center",
            va="bottom",
            fontsize=8,
        )
    ax.set_xticks(range(len(rows)), [r["name"] for r in rows], fontsize=8)
    ax.set_ylabel("GB/s (batch bytes / call -> completion)")
    ax.set_title(
        "P/D transfer on one host (UCX loopback): hybridkv PDTransport.read_blocks vs raw NIXL READ\n"
        "median, whisker p25-p75, dots = repeats, label = ratio (raw time / hybridkv time)",
        fontsize=9,
    )
    ax.grid(axis="y", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return matplotlib.__version__


def write_outputs(doc: dict, out: Path) -> None:
    """Markdown (``out``), JSON and PNG next to it (same stem)."""
    m, rows = doc["meta"], doc["rows"]
    idle = m["idle_agent_cpu_pct"]
    out.parent.mkdir(parents=True, exist_ok=True)
    png, js = out.with_suffix(".png"), out.with_suffix(".json")
    doc["meta"]["matplotlib"] = plot(rows, png)
    js.write_text(json.dumps(doc, indent=2) + "\n")
    ucx = m["ucx"]
    lines = [
        "# P/D transfer: PDTransport.read_blocks vs raw NIXL READ",
        "",
        f"- command: `{m['command']}` (re-render without a run: `python bench/pd_transfer.py --plot-only`)",
        f"- host: {m['host']}",
        f"- load average at start / end: {m['load0']:.2f} / {m['load1']:.2f} (a shared machine: other work was running)",
        f"- UCX_NET_DEVICES={ucx['UCX_NET_DEVICES']}, UCX_MODULES={ucx['UCX_MODULES']}, "
        f"UCX_TLS={ucx['UCX_TLS'] or '(unset: UCX picks cma on one host)'}",
        f"- date: {m['date']}",
        f"- two processes (prefill: KV cache + PDTransport + handshake server; decode: PDTransport + a "
        f"second raw nixl_agent on the same memory). One full-attention group, KV allocated by vLLM's "
        f"allocate_kv_cache; {m['repeats']} timed repeats after {m['warmup']} warm-up, the two paths alternated; "
        "fresh random scattered remote and local block ids every read.",
        "- GB/s = batch bytes / wall time from call to completion, `median [p25-p75]`. hybridkv = "
        "`read_blocks(..., notif)` + `wait` (block ids -> descriptors -> one READ). raw = "
        "`initialize_xfer` + `transfer` + poll on the same descriptor arrays, built before the clock "
        "(same notif). ratio = median raw time / median hybridkv time. build = `read_descriptors` "
        "alone (included in hybridkv's time). memcpy = numpy copy of the same scattered blocks "
        "inside one process. handshake = gRPC GetAgentInfo round trip incl. validation.",
        "- correctness: both paths' moved bytes were checked against the prefill pattern once per case.",
        f"- agents: progress thread with a {m['progress_delay_us']} us delay (PDTransport's default; the raw "
        "agent is built the same way). Idle CPU of one agent, % of a core, by delay: "
        + ", ".join(f"{k} us: {v:.0f} %" for k, v in idle.items())
        + " (0 us = the stock `nixl_agent`, which hard-codes it).",
        f"- files: `{out.name}` (this table), `{js.name}` (every repeat), `{png.name}` (plot, matplotlib "
        f"{m['matplotlib']}).",
        "",
        "| case | layers | block/layer | blocks | MiB/read | descs | hybridkv GB/s | raw NIXL GB/s | ratio | build us | memcpy GB/s | handshake ms |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['name']} | {r['layers']} | {r['block_bytes'] >> 10} KiB | {r['blocks']} | {r['mib']:.0f} | "
            f"{r['descs']} | {fmt(r['ours'])} | {fmt(r['raw'])} | **{r['ratio']:.2f}** | {r['build_us']:.0f} | "
            f"{r['memcpy']:.2f} | {r['handshake_ms']:.1f} |"
        )
    out.write_text("\n".join(lines) + "\n")
    print("\n".join(lines[-len(rows) - 2 :]))
    print(f"wrote {out}, {js.name}, {png.name}")


if __name__ == "__main__":
    sys.exit(main())
