"""GPU block path: paged KV blocks <-> pinned host slots (BlockStager) against
the pinned bandwidth of ONE contiguous buffer of the same bytes.

    python bench/gpu_block_path.py [--out DIR] [--repeats N] [--quick]

For each per-token size (MLA: 576 bf16 = 1152 B/token/layer; GQA: 8 kv heads
x 128 x K+V bf16 = 4096 B/token/layer), 32 layers per KV-cache group (one
separate paged tensor per layer, 512 MiB each, like vLLM), block sizes 16..256
tokens and batches of 64 and 256 random non-contiguous unsorted blocks:

* correctness first, per variant: gather random blocks and compare the slots
  with a reference gather; poison the whole cache, scatter into other block
  ids and check the moved blocks exactly and every other block still
  poisoned; once per case, a flipped staging byte must fail that check;
* then, per repeat (fresh random ids each time), wall-clock from call to
  completion: the contiguous pinned D2H and H2D of the batch's bytes (the
  limit, same pinned buffer) and gather/scatter of each stager variant.

Writes Markdown + PNG (+ the raw JSON) to --out, or Markdown + PNG to
bench/results/ when --out is not given. Needs a CUDA GPU.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
try:
    from hybridkv.connector.block_staging import BlockStager
except ImportError:  # repo copy without the package installed (device machine)
    import importlib.util

    _spec = importlib.util.spec_from_file_location(
        "block_staging", ROOT / "connector" / "block_staging.py"
    )
    _mod = importlib.util.module_from_spec(_spec)
    sys.modules["block_staging"] = _mod
    _spec.loader.exec_module(_mod)
    BlockStager = _mod.BlockStager

LAYOUTS = {
    # name: (bytes per token per layer, shape(num_blocks, block_size))
    "MLA": (1152, lambda nb, bs: (nb, bs, 576)),
    "GQA": (4096, lambda nb, bs: (nb, 2, bs, 8 * 128)),
}
VARIANTS = {
    # advanced-indexing kernels, chunk ramp from 8 MiB, per-chunk CUDA graphs
    "index": dict(kernel="index", use_cuda_graphs=True, first_chunk_bytes=8 << 20),
    # same, ramp from 32 MiB
    "index32": dict(kernel="index", use_cuda_graphs=True, first_chunk_bytes=32 << 20),
    # index_select / index_copy_ kernels, ramp from 8 MiB, graphs (second version)
    "index_select": dict(kernel="index_select", use_cuda_graphs=True, first_chunk_bytes=8 << 20),
    # first version: index_select, 2 x 128 MiB fixed chunks, eager
    "v1": dict(kernel="index_select", use_cuda_graphs=False, first_chunk_bytes=0),
}
MAIN = "index"  # the variant whose GB/s the table shows


def _default_variant() -> str | None:
    """The variant that matches BlockStager's current defaults."""
    import inspect

    p = inspect.signature(BlockStager.__init__).parameters
    graphs, first = p["use_cuda_graphs"].default, p["first_chunk_bytes"].default
    if first is None:
        first = (8 << 20) if graphs else (32 << 20)
    d = {"kernel": p["kernel"].default, "use_cuda_graphs": graphs, "first_chunk_bytes": first}
    for name, kw in VARIANTS.items():
        if {**d, **kw} == d:
            return name
    return None


LAYER_CACHE_BYTES = 512 << 20
SENTINEL = 0xA5


def _sync_time(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def _rows(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8).view(t.shape[0], -1)


def _check(stager: BlockStager, layers, n: int, rng: random.Random, plant: bool) -> dict:
    """Gather -> compare with reference; poison; scatter elsewhere -> compare."""
    nb = stager.num_blocks
    src = rng.sample(range(nb), n)
    dst = rng.sample(range(nb), n)
    for t in layers:
        t.view(torch.int16).random_()
    ids = torch.tensor(src, device=layers[0].device)
    ref = torch.cat([_rows(t).index_select(0, ids) for t in layers], dim=1)
    stager.gather(src)
    host = stager.host[:n].to(ref.device)
    gather_ok = torch.equal(host, ref)

    def scatter_ok(flip: bool) -> bool:
        for t in layers:
            t.view(torch.uint8).fill_(SENTINEL)
        if flip:
            i, j = rng.randrange(n), rng.randrange(stager.slot_bytes)
            stager.host[i, j] ^= 0xFF
        stager.scatter(dst)
        if flip:
            stager.host[i, j] ^= 0xFF
        didx = torch.tensor(dst, device=ref.device)
        untouched = torch.ones(nb, dtype=torch.bool, device=ref.device)
        untouched[didx] = False
        ok = True
        off = 0
        for t in layers:
            r = _rows(t)
            bb = r.shape[1]
            ok &= torch.equal(r.index_select(0, didx), ref[:, off : off + bb])
            ok &= bool((r == SENTINEL).all(dim=1)[untouched].all())
            off += bb
        return bool(ok)

    out = {"gather_ok": bool(gather_ok), "scatter_ok": scatter_ok(False)}
    if plant:
        out["planted_fault_detected"] = not scatter_ok(True)
    del ref, host
    return out


def run_case(layout: str, block_size: int, ns: list[int], args, dev) -> list[dict]:
    bpt, shape = LAYOUTS[layout]
    layer_block = bpt * block_size
    nb = LAYER_CACHE_BYTES // layer_block
    layers = [
        torch.empty(shape(nb, block_size), dtype=torch.bfloat16, device=dev)
        for _ in range(args.layers)
    ]
    for t in layers:
        t.view(torch.int16).random_()
    slot = layer_block * args.layers
    results = []
    for n in ns:
        batch = n * slot
        if batch > args.max_batch_bytes:
            print(f"skip {layout} bs={block_size} n={n}: batch {batch >> 20} MiB > cap", flush=True)
            continue
        rng = random.Random(1000 * block_size + n)
        stagers, checks = {}, {}
        for name, kw in VARIANTS.items():
            try:
                stagers[name] = BlockStager(layers, n, **kw)
                checks[name] = _check(stagers[name], layers, n, rng, plant=(name == MAIN))
            except Exception as e:  # keep measuring the other variants
                checks[name] = {"error": f"{type(e).__name__}: {e}"}
                stagers.pop(name, None)
        base = stagers.get(MAIN) or next(iter(stagers.values()))
        graphs = stagers.get(MAIN)
        contig = torch.empty(batch, dtype=torch.uint8, device=dev)
        host_flat = base.host.view(-1)[:batch]
        stream = torch.cuda.Stream(dev)

        def d2h():
            with torch.cuda.stream(stream):
                host_flat.copy_(contig, non_blocking=True)
            stream.synchronize()

        def h2d():
            with torch.cuda.stream(stream):
                contig.copy_(host_flat, non_blocking=True)
            stream.synchronize()

        times = {k: [] for k in ["limit_d2h", "limit_h2d"]}
        enqueue = {f"{v}_gather": [] for v in stagers}
        for v in stagers:
            times[f"{v}_gather"], times[f"{v}_scatter"] = [], []
        for rep in range(args.warmup + args.repeats):
            ids = rng.sample(range(nb), n)
            torch.cuda.synchronize(dev)
            sample = {"limit_d2h": _sync_time(d2h), "limit_h2d": _sync_time(h2d)}
            for v, st in stagers.items():
                torch.cuda.synchronize(dev)
                t0 = time.perf_counter()
                op = st.gather_async(ids)
                t1 = time.perf_counter()
                op.wait()
                t2 = time.perf_counter()
                sample[f"{v}_gather"] = t2 - t0
                enqueue[f"{v}_gather"].append(t1 - t0)
                torch.cuda.synchronize(dev)
                sample[f"{v}_scatter"] = _sync_time(lambda: st.scatter(ids))
            if rep >= args.warmup:
                for k, s in sample.items():
                    times[k].append(s)
        rec = {
            "layout": layout,
            "bytes_per_token_layer": bpt,
            "layers": args.layers,
            "block_size": block_size,
            "n_blocks": n,
            "cache_blocks": nb,
            "slot_bytes": slot,
            "batch_bytes": batch,
            "chunk_slots": base.chunk_slots,
            "chunks_gather_main": [c1 - c0 for c0, c1 in base.chunks(n, "gather")],
            "width": base.width,
            "graphs_captured": None if graphs is None else len(graphs._graphs),
            "checks": checks,
            "times_s": times,
            "enqueue_s": {k: statistics.median(v[args.warmup :]) for k, v in enqueue.items()},
        }
        results.append(rec)
        print(_line(rec), flush=True)
        del stagers, base, contig, host_flat
        torch.cuda.synchronize(dev)
    del layers
    torch.cuda.empty_cache()
    return results


def _bw(rec, key):
    ts = rec["times_s"].get(key) or []
    if not ts:
        return None
    b = rec["batch_bytes"] / 1e9
    return {"med": b / statistics.median(ts), "min": b / max(ts), "max": b / min(ts)}


def _ratio(rec, variant, op):
    lim = rec["times_s"]["limit_d2h" if op == "gather" else "limit_h2d"]
    ts = rec["times_s"].get(f"{variant}_{op}")
    if not ts:
        return None
    return statistics.median(lim) / statistics.median(ts)


def _line(rec) -> str:
    parts = [
        f"{rec['layout']} bs={rec['block_size']:>3} n={rec['n_blocks']:>3} "
        f"{rec['batch_bytes'] / 2**20:8.1f} MiB"
    ]
    for op, lim in (("gather", "limit_d2h"), ("scatter", "limit_h2d")):
        parts.append(f"{op}: lim {_bw(rec, lim)['med']:5.1f} GB/s")
        for v in VARIANTS:
            r = _ratio(rec, v, op)
            parts.append(f"{v} {r:.2f}" if r is not None else f"{v} -")
    bad = {v: c for v, c in rec["checks"].items() if not all(c.values()) or "error" in c}
    parts.append("checks ok" if not bad else f"CHECKS {bad}")
    return " | ".join(parts)


def _fmt(bw):
    return "-" if bw is None else f"{bw['med']:.1f} ({bw['min']:.1f}-{bw['max']:.1f})"


def _summary(results, dv: str) -> str:
    big = [
        (_ratio(r, dv, op), r, op)
        for r in results
        if r["block_size"] >= 64
        for op in ("gather", "scatter")
        if _ratio(r, dv, op) is not None
    ]
    small = [
        (_ratio(r, dv, op), r, op)
        for r in results
        if r["block_size"] < 64
        for op in ("gather", "scatter")
        if _ratio(r, dv, op) is not None
    ]
    if not big:
        return ""
    lo = min(big, key=lambda x: x[0])
    text = (
        f"**Summary ({dv}, the BlockStager default):** blocks of 64+ tokens reach "
        f"{lo[0]:.2f}-{max(b[0] for b in big):.2f} of the contiguous pinned bandwidth "
        f"(target 0.80; lowest: {lo[1]['layout']} {lo[1]['block_size']} tok x "
        f"{lo[1]['n_blocks']} blocks {lo[2]})"
    )
    if small:
        s_lo = min(small, key=lambda x: x[0])
        text += (
            f"; 16-32 token blocks {s_lo[0]:.2f}-{max(b[0] for b in small):.2f} (lowest: "
            f"{s_lo[1]['layout']} {s_lo[1]['block_size']} tok x {s_lo[1]['n_blocks']} "
            f"blocks {s_lo[2]}, a {s_lo[1]['batch_bytes'] / 2**20:.0f} MiB batch where "
            "the fixed per-chunk kernel and sync cost is not hidden)"
        )
    return text + "."


def markdown(results, meta) -> str:
    dv = _default_variant() or MAIN
    lines = [
        "# GPU block path: paged KV blocks <-> pinned host slots",
        "",
        f"- command: `{meta['command']}`",
        f"- device: {meta['device']} ({meta['runtime']}); torch {meta['torch']}, CUDA {meta['cuda']}; "
        f"nvidia-smi: {meta.get('nvidia_smi', '?')}",
        f"- date: {meta['date']}",
        f"- {meta['layers']} layers per group, one paged tensor per layer "
        f"({LAYER_CACHE_BYTES >> 20} MiB each); {meta['repeats']} timed repeats "
        f"after {meta['warmup']} warm-up, fresh random unsorted block ids each repeat",
        "- GB/s = batch bytes / wall time from call to completion (host wait included); "
        "'median (min-max)' over repeats. ratio = median contiguous time / median variant "
        "time, where contiguous = one pinned D2H (gather) or H2D (scatter) of the same "
        "bytes into the same pinned buffer (the limit).",
        "- variants (all: one row gather/scatter kernel per layer between the paged "
        "layer and a device chunk laid out like the host slots, one contiguous DMA per "
        "chunk, 2 x 128 MiB ping-pong chunks, kernel and copy streams overlapped): "
        "index = advanced indexing (aten.index.Tensor_out / index_put_), chunks ramp "
        "from 8 MiB (doubling; scatter ramps down), per-chunk kernels replayed from "
        "CUDA graphs; index32 = same, ramp from 32 MiB; index_select = index_select / "
        "index_copy_, ramp from 8 MiB, graphs; v1 = index_select / index_copy_, fixed "
        "128 MiB chunks, eager launches (the first version).",
        "- correctness (every case, every variant): slots == reference gather; scatter "
        "into other ids of a poisoned cache moves those blocks exactly and leaves every "
        "other block poisoned; a flipped staging byte is detected "
        f"(all passed: {meta['all_checks_ok']}).",
        "",
        _summary(results, dv),
        "",
        "| layout | B/tok/layer | block tok | blocks | batch MiB | op | contiguous GB/s | "
        f"{dv} GB/s | "
        + " | ".join(f"ratio {v}{' (default)' if v == dv else ''}" for v in VARIANTS)
        + f" | host ms in gather_async {dv} / v1 |",
        "|" + "---|" * (9 + len(VARIANTS)),
    ]
    for r in results:
        for op, lim in (("gather", "limit_d2h"), ("scatter", "limit_h2d")):
            rat = [_ratio(r, v, op) for v in VARIANTS]
            enq = (
                " / ".join(
                    f"{r['enqueue_s'].get(v + '_gather', float('nan')) * 1e3:.2f}"
                    for v in (dv, "v1")
                )
                if op == "gather"
                else ""
            )
            lines.append(
                f"| {r['layout']} | {r['bytes_per_token_layer']} | {r['block_size']} | "
                f"{r['n_blocks']} | {r['batch_bytes'] / 2**20:.0f} | {op} | {_fmt(_bw(r, lim))} | "
                f"{_fmt(_bw(r, dv + '_' + op))} | "
                + " | ".join(
                    "-" if x is None else f"**{x:.2f}**" if v == dv else f"{x:.2f}"
                    for v, x in zip(VARIANTS, rat)
                )
                + f" | {enq} |"
            )
    if meta.get("kernels"):
        lines += [
            "",
            "Device-side part alone (what the overlap has to hide): 32 layers, 64 random "
            "blocks (or 4: the fixed cost of one small chunk), GB/s of moved bytes and GPU "
            "time by CUDA events (median of 10), host time per launch (eager: per kernel):",
            "",
            "| layout | block tok | blocks | kernels (eager: GPU time includes waiting for the host's launches) | GB/s | GPU us | host us/launch |",
            "|---|---|---|---|---|---|---|",
        ]
        for k in meta["kernels"]:
            lines.append(
                f"| {k['layout']} | {k['block_size']} | {k['n_blocks']} | {k['kernel']} | "
                f"{k['GBps_median']:.0f} | {k.get('us_median', float('nan')):.0f} | "
                f"{k['host_us_per_launch']:.1f} |"
            )
    lines.append("")
    return "\n".join(lines)


def plot(results, path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5), sharey=True)
    for ax, op in zip(axes, ("gather", "scatter")):
        for layout in LAYOUTS:
            for n in sorted({r["n_blocks"] for r in results}):
                rs = [r for r in results if r["layout"] == layout and r["n_blocks"] == n]
                for v, style in ((_default_variant() or MAIN, "-o"), ("v1", ":x")):
                    pts = [(r["block_size"], _ratio(r, v, op)) for r in rs]
                    pts = [p for p in pts if p[1] is not None]
                    if pts:
                        ax.plot(*zip(*pts), style, label=f"{layout} n={n} {v}")
        ax.axhline(0.8, color="grey", lw=0.8, ls="--")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("block size (tokens)")
        ax.set_title(f"{op}: {'GPU->pinned' if op == 'gather' else 'pinned->GPU'}")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("fraction of contiguous pinned bandwidth (median)")
    axes[1].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return True


def _graphed(fn, dev):
    """fn captured into a CUDA graph; returns its replay."""
    s = torch.cuda.Stream(dev)
    s.wait_stream(torch.cuda.current_stream(dev))
    g = torch.cuda.CUDAGraph()
    with torch.cuda.stream(s):
        fn()
        g.capture_begin(capture_error_mode="thread_local")
        fn()
        g.capture_end()
    torch.cuda.current_stream(dev).wait_stream(s)
    torch.cuda.synchronize(dev)
    return g.replay


def kernel_rates(dev, layers_n: int = 32, reps: int = 10) -> list[dict]:
    """What the device-side part costs: per-layer index_select / index_copy_
    GB/s (moved bytes, CUDA events) for 64 random blocks, by element width and
    output layout, next to a plain contiguous device copy; and the host time of
    one eager launch."""
    out = []
    for layout, bs in (("GQA", 16), ("MLA", 64)):
        bpt, shape = LAYOUTS[layout]
        nb = LAYER_CACHE_BYTES // (bpt * bs)
        layers = [
            torch.empty(shape(nb, bs), dtype=torch.bfloat16, device=dev) for _ in range(layers_n)
        ]
        n, bb = 64, bpt * bs
        ids = torch.tensor(random.Random(0).sample(range(nb), n), device=dev)
        moved = n * bb * layers_n
        stage8 = torch.empty(n, bb * layers_n // 8, dtype=torch.int64, device=dev)
        tmp8 = [torch.empty(n, bb // 8, dtype=torch.int64, device=dev) for _ in layers]
        stage16 = stage8.view(torch.complex128)
        flat = torch.empty(moved, dtype=torch.uint8, device=dev)
        flat2 = torch.empty_like(flat)

        def rows(t, dt):
            return t.view(dt).view(nb, -1)

        e8 = bb // 8
        cases = {
            "index_select int64 -> strided slot chunk": lambda: [
                torch.index_select(
                    rows(t, torch.int64), 0, ids, out=stage8[:, i * e8 : (i + 1) * e8]
                )
                for i, t in enumerate(layers)
            ],
            "index_select int64 -> contiguous per layer": lambda: [
                torch.index_select(rows(t, torch.int64), 0, ids, out=tmp8[i])
                for i, t in enumerate(layers)
            ],
            "index_select complex128 (16 B) -> strided": lambda: [
                torch.index_select(
                    rows(t, torch.complex128),
                    0,
                    ids,
                    out=stage16[:, i * e8 // 2 : (i + 1) * e8 // 2],
                )
                for i, t in enumerate(layers)
            ],
            "index (aten.index.Tensor_out) int64 -> strided slot chunk": lambda: [
                torch.ops.aten.index.Tensor_out(
                    rows(t, torch.int64), [ids], out=stage8[:, i * e8 : (i + 1) * e8]
                )
                for i, t in enumerate(layers)
            ],
            "index_put_ int64 <- strided slot chunk": lambda: [
                rows(t, torch.int64).index_put_((ids,), stage8[:, i * e8 : (i + 1) * e8])
                for i, t in enumerate(layers)
            ],
            "index_copy_ int64 <- strided slot chunk": lambda: [
                rows(t, torch.int64).index_copy_(0, ids, stage8[:, i * e8 : (i + 1) * e8])
                for i, t in enumerate(layers)
            ],
            "index_copy_ complex128 <- strided": lambda: [
                rows(t, torch.complex128).index_copy_(
                    0, ids, stage16[:, i * e8 // 2 : (i + 1) * e8 // 2]
                )
                for i, t in enumerate(layers)
            ],
            "contiguous device copy (reference)": lambda: flat2.copy_(flat),
        }
        for k, kern in (
            ("index", "index (aten.index.Tensor_out) int64 -> strided slot chunk"),
            ("index_select", "index_select int64 -> strided slot chunk"),
        ):
            cases[f"graph replay of the 32 {k} kernels, 64 blocks"] = _graphed(cases[kern], dev)
        ids4, stage4 = ids[:4], stage8[:4]
        small = {
            "index": lambda: [
                torch.ops.aten.index.Tensor_out(
                    rows(t, torch.int64), [ids4], out=stage4[:, i * e8 : (i + 1) * e8]
                )
                for i, t in enumerate(layers)
            ],
            "index_select": lambda: [
                torch.index_select(
                    rows(t, torch.int64), 0, ids4, out=stage4[:, i * e8 : (i + 1) * e8]
                )
                for i, t in enumerate(layers)
            ],
        }
        for k, fn in small.items():
            cases[f"graph replay of the 32 {k} kernels, 4 blocks"] = _graphed(fn, dev)
        for name, fn in cases.items():
            for _ in range(2):
                fn()
            torch.cuda.synchronize(dev)
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            ms, host = [], []
            for _ in range(reps):
                a.record()
                h0 = time.perf_counter()
                fn()
                host.append(time.perf_counter() - h0)
                b.record()
                b.synchronize()
                ms.append(a.elapsed_time(b))
            launches = 1 if name.startswith(("contiguous", "graph")) else layers_n
            small_chunk = name.endswith(", 4 blocks")
            mv = moved * 4 // n if small_chunk else moved
            out.append(
                {
                    "layout": layout,
                    "block_size": bs,
                    "n_blocks": 4 if small_chunk else n,
                    "kernel": name if name.startswith(("contiguous", "graph")) else f"eager {name}",
                    "moved_bytes": mv,
                    "us_median": 1e3 * statistics.median(ms),
                    "GBps_median": mv / 1e6 / statistics.median(ms),
                    "host_us_per_launch": 1e6 * statistics.median(host) / launches,
                }
            )
            print(
                f"kernel {layout} bs={bs}: {name}: {out[-1]['GBps_median']:.0f} GB/s, "
                f"{out[-1]['us_median']:.0f} us, "
                f"{out[-1]['host_us_per_launch']:.1f} us host/launch",
                flush=True,
            )
        del layers, tmp8, stage8, stage16, flat, flat2
        torch.cuda.empty_cache()
    return out


def _args_without_out(argv: list[str]) -> list[str]:
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a == "--out":
            skip = True
        elif not a.startswith("--out="):
            out.append(a)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--max-batch-bytes", type=int, default=4 << 30)
    ap.add_argument("--quick", action="store_true", help="two small cases, 3 repeats")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("needs a CUDA GPU")
    dev = torch.device("cuda", 0)
    block_sizes, ns = [16, 32, 64, 128, 256], [64, 256]
    if args.quick:
        block_sizes, ns, args.repeats, args.layers = [16, 64], [64], 3, 8
    print(torch.cuda.get_device_name(dev), torch.__version__, torch.version.cuda, flush=True)
    results = []
    # Markdown + PNG go to --out, else bench/results/; raw JSON only to --out.
    outs = [args.out] if args.out else [ROOT / "bench" / "results"]
    raw = args.out
    for layout in LAYOUTS:
        for bs in block_sizes:
            results += run_case(layout, bs, ns, args, dev)
            if raw:  # partial results survive a kill
                raw.mkdir(parents=True, exist_ok=True)
                (raw / "gpu_block_path.partial.json").write_text(json.dumps(results))
    try:
        kernels = kernel_rates(dev, layers_n=args.layers)
    except Exception as e:  # diagnostics only
        print(f"kernel rates failed: {type(e).__name__}: {e}", flush=True)
        kernels = []
    all_ok = all(
        all(c.values()) and "error" not in c for r in results for c in r["checks"].values()
    )
    runtime = platform.release()
    meta = {
        "command": " ".join(["python bench/gpu_block_path.py", *_args_without_out(sys.argv[1:])]),
        "device": torch.cuda.get_device_name(dev),
        "runtime": f"kernel {runtime}",
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "date": dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "layers": args.layers,
        "repeats": args.repeats,
        "warmup": args.warmup,
        "all_checks_ok": all_ok,
        "kernels": kernels,
    }
    try:
        meta["nvidia_smi"] = subprocess.run(
            [
                "nvidia-smi",
                "--query-gpu=name,driver_version,pcie.link.gen.current,pcie.link.width.current",
                "--format=csv,noheader",
            ],
            capture_output=True,
            text=True,
            timeout=20,
        ).stdout.strip()
    except Exception:
        pass
    md = markdown(results, meta)
    print(md)
    for out in outs:
        out.mkdir(parents=True, exist_ok=True)
        (out / "gpu_block_path.md").write_text(md)
        print("plot:", plot(results, out / "gpu_block_path.png"))
    if raw:
        (raw / "gpu_block_path.json").write_text(
            json.dumps({"meta": meta, "results": results}, indent=1)
        )
        (raw / "gpu_block_path.partial.json").unlink(missing_ok=True)
    if not all_ok:
        sys.exit("correctness check failed")


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()
