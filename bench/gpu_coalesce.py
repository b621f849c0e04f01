"""P/D READ with coalesced descriptors: hybridkv vs raw NIXL per block, per run, and D2D.

    python bench/gpu_coalesce.py --out DIR                 # device: cuda, two processes, one GPU
    python bench/gpu_coalesce.py --device cpu --smoke      # here: the same code over DRAM (cma)
    python bench/gpu_coalesce.py --render DIR              # here: DIR/coalesce.json -> bench/results/gpu_coalesce.*

KV caches exactly as bench/gpu_data_path.py makes them (vLLM 0.33's ``create_kv_cache_views`` over
one int8 allocation, kernel blocks, layer-outermost; ``.vllm-mini`` + the connector-base shim on
the device). Two processes: prefill (KV cache with random bytes, ``PDTransport`` registered) and
decode (same layout, ``PDTransport`` + a raw ``nixl_agent``), UCX cuda_ipc with get_zcopy forced on.

Hand-over patterns (per scenario, ``n`` manager blocks of the attention group; a hybrid
scenario's Mamba group hands over one block, its last state, as vLLM's P/D does):
* ``contiguous``: ids consecutive on both sides;
* ``every other``: ids two apart on both sides (nothing coalesces);
* ``measured``: runs drawn from the joint (both sides) run-length distribution measured on the CPU
  engine (``bench/results/run_lengths.json``, ``bench/run_lengths.py``), placed at random with a
  gap between runs on each side.

Paths, one READ each, timed from post to DONE, alternating order, median of ``--repeats``:
``hybridkv`` = ``PDTransport.read_blocks`` + ``wait`` (coalesced rows); ``raw per block`` = a raw
agent's READ of ``read_descriptors``' (block, region) rows, the shape hybridkv posted before
coalescing (and what the in-tree NixlConnector posts, at kernel-block granularity); ``raw per run``
= a raw READ of the coalesced rows; ``D2D`` = torch copy of the same byte count, contiguous.

Checks, every pattern, for hybridkv and raw per run: the decode allocation is poisoned, the READ
runs, the WHOLE allocation must equal poison + the source blocks' bytes at the destination blocks,
written through vLLM's own ``group_kernel_blocks`` views (independent of hybridkv's addressing);
a planted one-block shift (first destination block one off) must fail that check.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import platform
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
import bench.gpu_data_path as gdp  # noqa: E402 - the machinery: .vllm-mini, shim, vLLM's allocate

SCENARIOS = {
    "FA 64 tok, kernel 16 (LBHNC), 16 layers": gdp.SCENARIOS["FA 64 tok, kernel 16 (LBHNC)"],
    "hybrid: 8 FA 128/k32 + 8 Mamba (LBHNC)": gdp.SCENARIOS[
        "hybrid: FA 128/k32 + Mamba overlay (LBHNC)"
    ],
    # block-outermost (vLLM splits no kernel blocks under it): a block's 16 layers are one span
    "FA 64 tok, unsplit (BLHNC), 16 layers": dict(
        layout="BLHNC",
        num_blocks=1280,
        batches=(64, 256),
        groups=[dict(kind="fa", layers=16, block=64, kernel=64, heads=8, head=128)],
    ),
}
PATTERNS = ("contiguous", "every other", "measured")
UCX_ENV = gdp.UCX_SETTINGS["cuda_ipc get_zcopy"]
DEFAULT_RUNS = {"1": 1}  # when no measurement exists: every run one block (the worst case)


def measured_runs() -> dict[str, int]:
    """The joint run-length histogram of the measured source with the most hand-overs."""
    p = ROOT / "bench" / "results" / "run_lengths.json"
    if not p.exists():
        return DEFAULT_RUNS
    pds = [
        src["pd"]
        for src in json.loads(p.read_text()).values()
        if src.get("pd", {}).get("handovers", 0) >= 5
    ]
    if not pds:
        return DEFAULT_RUNS
    return max(pds, key=lambda pd: pd["handovers"])["joint_runs"]["hist"]


def pattern_ids(
    pattern: str, n: int, nb: int, rng: random.Random, hist: dict[str, int]
) -> tuple[list[int], list[int]]:
    """(remote ids, local ids) of n blocks in [1, nb) following the pattern; each side's ids distinct."""
    if pattern == "contiguous":
        r0, l0 = rng.randrange(1, nb - n), rng.randrange(1, nb - n)
        return list(range(r0, r0 + n)), list(range(l0, l0 + n))
    if pattern == "every other":
        r0, l0 = rng.randrange(1, nb - 2 * n), rng.randrange(1, nb - 2 * n)
        return list(range(r0, r0 + 2 * n, 2)), list(range(l0, l0 + 2 * n, 2))
    lengths, weights = [int(k) for k in hist], list(hist.values())
    runs: list[int] = []
    while sum(runs) < n:
        runs.append(min(rng.choices(lengths, weights)[0], n - sum(runs)))

    # runs in a random order on each side, random gaps (>= 1 between runs) over the id space
    def place() -> list[list[int]]:
        order = list(range(len(runs)))
        rng.shuffle(order)
        spare = (nb - 1) - n - (len(runs) - 1)
        assert spare >= 0, "cache too small for the pattern"
        cuts = sorted(rng.randrange(0, spare + 1) for _ in range(len(runs)))
        out: list[list[int]] = [[] for _ in runs]
        pos, prev = 1, 0
        for k, i in enumerate(order):
            pos += cuts[k] - prev + (1 if k else 0)
            prev = cuts[k]
            out[i] = list(range(pos, pos + runs[i]))
            pos += runs[i]
        return out

    r, l_ = place(), place()
    return [b for x in r for b in x], [b for x in l_ for b in x]


def handover(
    cache, pattern: str, n: int, rng: random.Random, hist
) -> tuple[list[list[int]], list[list[int]]]:  # noqa: ANN001
    """Per group: attention n blocks by the pattern; a Mamba group 1 block beyond them."""
    nb = cache.kvc.num_blocks
    groups = len(cache.kvc.kv_cache_groups)
    half = nb // 2 if groups > 1 else nb  # attention ids in the lower half, Mamba's above
    r, l_ = pattern_ids(pattern, n, half, rng, hist)
    src, dst = [r], [l_]
    for g in range(1, groups):
        src.append([half + g])
        dst.append([half + groups + g])
    return src, dst


def nixlconnector_descs(cache, src: list[list[int]]) -> int:  # noqa: ANN001
    """What vLLM's in-tree NixlConnector posts for the same hand-over: one descriptor per
    registered region per KERNEL block (``nixl/base_worker.py``: ``_sync_block_size_with_kernel``
    multiplies num_blocks by manager/kernel; ``_build_fa_local`` builds one row per region per
    kernel block; ``_get_block_descs_ids`` picks rows, never merging), Mamba one per layer per block."""
    total = 0
    for g, ids in zip(cache.layout.groups, src):
        if g is None or not ids:
            continue
        total += len(ids) * sum(g.kernel_rows)  # tensors x kernel rows each
    return total


def decode(sc_name: str, args, q) -> None:  # noqa: ANN001
    gdp.setup_imports()
    import torch

    import hybridkv.connector.pd_transport as pdt

    sc = dict(SCENARIOS[sc_name])
    if args.smoke:
        sc["num_blocks"] = 40
    dev = torch.device(args.device)
    space = pdt.memory_space(dev.type, dev.index or 0)
    ctx = mp.get_context("spawn")
    a, b = ctx.Pipe()
    p = ctx.Process(target=gdp.pd_prefill, args=(b, sc_name, args.device, sc), daemon=True)
    p.start()
    meta, peer_groups = a.recv()
    cache = gdp.make_cache(sc, dev)
    ref_cache = gdp.make_cache(sc, dev)
    gdp.fill_random(ref_cache, 21)  # the prefill's bytes (same seed)
    tr = pdt.PDTransport("decode", cache.layout, memory=space)
    peer = tr.add_peer(meta, peer_groups, tr.group_spaces)
    rawa = pdt._make_agent("raw", ["UCX"], 100)
    reg = rawa.register_memory(
        [(int(b_), int(n_), space.dev, "") for b_, n_ in cache.layout.allocations], space.kind
    )
    rpeer = rawa.add_remote_agent(meta)
    hist = measured_runs()
    rng = random.Random(5)
    rows, checks = [], []
    sizes = (8,) if args.smoke else args.blocks

    def rows_for(src, dst, coalesce: bool):  # noqa: ANN001, ANN202
        loc, rem = pdt.read_descriptors(
            cache.layout.groups,
            peer_groups,
            src,
            dst,
            [space.dev] * len(src),
            [space.dev] * len(src),
        )
        return pdt.coalesced(loc, rem) if coalesce else (loc, rem)

    def ours(src, dst):  # noqa: ANN001, ANN202
        gdp._sync()
        t = time.perf_counter()
        h = tr.read_blocks(peer, src, dst)
        tr.wait(h, 300.0)
        return time.perf_counter() - t

    def raw(src, dst, coalesce):  # noqa: ANN001, ANN202
        loc, rem = rows_for(src, dst, coalesce)
        ld, rd = rawa.get_xfer_descs(loc, space.kind), rawa.get_xfer_descs(rem, space.kind)
        gdp._sync()
        t = time.perf_counter()
        h = rawa.initialize_xfer("READ", ld, rd, rpeer, b"")
        st = rawa.transfer(h)
        while st == "PROC":
            st = rawa.check_xfer_state(h)
        d = time.perf_counter() - t
        assert st == "DONE", st
        rawa.release_xfer_handle(h)
        return d

    def today(src, dst, coalesce=False):  # noqa: ANN001, ANN202
        """hybridkv's READ before coalescing: the same transport posting the (block, region)
        rows, waited for by the previous wait loop (both replayed here, named as such)."""
        saved = pdt.coalesced
        if not coalesce:
            pdt.coalesced = lambda loc, rem: (loc, rem)
        try:
            gdp._sync()
            t = time.perf_counter()
            h = tr.read_blocks(peer, src, dst)
            _previous_wait(tr, h, 300.0)
            return time.perf_counter() - t
        finally:
            pdt.coalesced = saved

    paths = {
        "hybridkv": ours,
        "today": today,
        "coalesced_previous_wait": lambda s, d: today(s, d, True),
        "raw_per_block": lambda s, d: raw(s, d, False),
        "raw_per_run": lambda s, d: raw(s, d, True),
    }
    for pattern in args.patterns:
        for n in sizes:
            src, dst = handover(cache, pattern, n, rng, hist)
            nbytes = gdp.batch_bytes(cache, src)
            ref = gdp.block_bytes_ref(ref_cache, src)
            exp = gdp.expected_after(cache, ref, dst)
            res = {}
            for nm in ("hybridkv", "raw_per_run"):
                gdp.poison(cache)
                gdp._sync()
                paths[nm](src, dst)
                gdp._sync()
                res[f"{nm}_exact"] = bool(torch.equal(cache.buf, exp))
                gdp.poison(cache)
                paths[nm](src, gdp.shifted(dst, cache))
                gdp._sync()
                res[f"{nm}_shift_detected"] = not bool(torch.equal(cache.buf, exp))
            del exp, ref
            checks.append({"scenario": sc_name, "pattern": pattern, "n": n, **res})
            times = {k: [] for k in paths}
            order = list(paths)
            for i in range(args.warmup + args.repeats):
                for k in order[i % len(order) :] + order[: i % len(order)]:
                    d = paths[k](src, dst)
                    if i >= args.warmup:
                        times[k].append(d)
            per_block, _ = rows_for(src, dst, False)
            per_run, _ = rows_for(src, dst, True)
            row = {
                "scenario": sc_name,
                "pattern": pattern,
                "n": n,
                "bytes": nbytes,
                "descs_per_block": int(len(per_block)),
                "descs_coalesced": int(len(per_run)),
                "descs_nixlconnector": nixlconnector_descs(cache, src),
                "joint_runs": [len(x) for x in _joint(src[0], dst[0])],
                "times_s": {**times, **gdp.copy_baselines(nbytes, dev, args.repeats)},
            }
            rows.append(row)
            print(
                f"{sc_name} {pattern} n={n} {nbytes / 2**20:.0f} MiB descs {row['descs_per_block']} -> "
                f"{row['descs_coalesced']}: "
                + " ".join(
                    f"{k} {nbytes / statistics.median(v) / 1e9:.1f}"
                    for k, v in row["times_s"].items()
                    if k != "h2d_pinned"
                )
                + f" GB/s; {res}",
                flush=True,
            )
    tr.shutdown()
    rawa.remove_remote_agent(rpeer)
    rawa.deregister_memory(reg)
    a.send("stop")
    a.recv()
    p.join(20)
    q.put({"rows": rows, "checks": checks, "hist": hist})


def _previous_wait(tr, handle, timeout_s: float) -> None:  # noqa: ANN001
    """``PDTransport.wait`` as it was before its spin window: a timer sleep from the first poll
    (50 us doubling to 1 ms), copied so that today's READ is measured side by side."""
    deadline = time.monotonic() + timeout_s
    pause = 0.0
    while tr.poll(handle) != "DONE":
        if time.monotonic() >= deadline:
            raise TimeoutError("READ not done")
        time.sleep(pause)
        pause = min(0.001, pause * 2 or 0.00005)


def _joint(r: list[int], l_: list[int]) -> list[list[int]]:
    out: list[list[int]] = []
    for i, x in enumerate(r):
        if i and x == r[i - 1] + 1 and l_[i] == l_[i - 1] + 1:
            out[-1].append(x)
        else:
            out.append([x])
    return out


def run(args) -> dict:  # noqa: ANN001
    out = {"rows": [], "checks": [], "errors": []}
    ctx = mp.get_context("spawn")
    base = dict(os.environ)
    if args.device != "cpu":
        os.environ.update(UCX_ENV)
    os.environ.setdefault("UCX_NET_DEVICES", "lo")
    for sc_name in SCENARIOS:
        q = ctx.Queue()
        p = ctx.Process(target=decode, args=(sc_name, args, q))
        p.start()
        try:
            r = q.get(timeout=400)
            out["rows"] += r["rows"]
            out["checks"] += r["checks"]
            out["hist"] = r["hist"]
        except Exception as e:  # noqa: BLE001 - recorded; the next scenario still runs
            out["errors"].append(f"{sc_name}: {type(e).__name__} {e}")
            print("error:", out["errors"][-1], flush=True)
        p.join(30)
        if p.is_alive():
            p.kill()
    os.environ.clear()
    os.environ.update(base)
    return out


def _gbs(r, k):  # noqa: ANN001, ANN202
    return r["bytes"] / statistics.median(r["times_s"][k]) / 1e9


def markdown(doc: dict) -> str:
    m = doc.get("meta", {})
    lines = [
        "# P/D READ with coalesced descriptors on the H200",
        "",
        f"- command: `{m.get('command', '')}`; device: {m.get('device', '?')}; torch {m.get('torch', '?')}; "
        f"{m.get('date', '')}; hybridkv commit {m.get('commit', '?')}; wheels: {m.get('wheels', '?')}",
        f"- UCX: {UCX_ENV}; two processes, one GPU, VRAM -> VRAM; median of {m.get('repeats', '?')} after "
        f"{m.get('warmup', '?')} warm-up; how: docstring of bench/gpu_coalesce.py",
        "",
        "| scenario | pattern | blocks | MiB | descs today | descs coalesced | NixlConnector descs | "
        "today GB/s | hybridkv GB/s | coalesced, previous wait GB/s | raw per block GB/s | raw per run GB/s | "
        "D2D GB/s | **hybridkv / today** | hybridkv / raw per run | hybridkv / D2D |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in doc.get("rows", []):
        g = {
            k: _gbs(r, k)
            for k in (
                "today",
                "hybridkv",
                "coalesced_previous_wait",
                "raw_per_block",
                "raw_per_run",
                "d2d",
            )
        }
        lines.append(
            f"| {r['scenario']} | {r['pattern']} | {r['n']} | {r['bytes'] / 2**20:.0f} | "
            f"{r['descs_per_block']} | {r['descs_coalesced']} | {r['descs_nixlconnector']} | "
            f"{g['today']:.1f} | {g['hybridkv']:.1f} | {g['coalesced_previous_wait']:.1f} | "
            f"{g['raw_per_block']:.1f} | {g['raw_per_run']:.1f} | {g['d2d']:.0f} | "
            f"**{g['hybridkv'] / g['today']:.2f}** | {g['hybridkv'] / g['raw_per_run']:.2f} | "
            f"{g['hybridkv'] / g['d2d']:.3f} |"
        )
    lines += [
        "",
        "Checks (poisoned decode allocation compared whole; planted one-block shift):",
        "",
    ]
    for c in doc.get("checks", []):
        lines.append(
            f"- {c['scenario']} / {c['pattern']} n={c['n']}: "
            + ", ".join(f"{k}={v}" for k, v in c.items() if k not in ("scenario", "pattern", "n"))
        )
    if doc.get("errors"):
        lines += ["", "Errors: " + "; ".join(doc["errors"])]
    lines += [
        "",
        f"Measured run-length histogram used for `measured` (joint runs: length -> count): {doc.get('hist')}",
        "",
    ]
    return "\n".join(lines)


def plot(doc: dict, path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    rows = doc.get("rows", [])
    if not rows:
        return False
    fig, ax = plt.subplots(figsize=(18, 7.5))
    short = {"LBHNC), 16": "FA LBHNC k16", "Mamba": "FA+Mamba LBHNC", "BLHNC": "FA BLHNC"}
    labels = [
        f"{next(v for k, v in short.items() if k in r['scenario'])}\n{r['pattern']} n={r['n']}\n"
        f"{r['descs_per_block']}->{r['descs_coalesced']} descs"
        for r in rows
    ]
    keys = (
        ("today", "hybridkv today (per block)"),
        ("hybridkv", "hybridkv (coalesced)"),
        ("raw_per_block", "raw NIXL per block"),
        ("raw_per_run", "raw NIXL per run"),
        ("d2d", "D2D copy"),
    )
    w = 0.16
    for j, (k, lab) in enumerate(keys):
        ax.bar(
            [i + (j - 2) * w for i in range(len(rows))], [_gbs(r, k) for r in rows], w, label=lab
        )
    ax.set_xticks(range(len(rows)), labels, fontsize=7, rotation=60, ha="right")
    ax.set_yscale("log")
    ax.set_ylabel("GB/s (log)")
    ax.set_title(
        "P/D READ VRAM->VRAM on one H200 (2 processes, UCX cuda_ipc get_zcopy)", fontsize=10
    )
    ax.legend(fontsize=8)
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return True


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--blocks", type=int, nargs="+", default=[64, 256])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--smoke", action="store_true", help="small caches, 8 blocks, 1 repeat")
    ap.add_argument("--patterns", nargs="+", default=list(PATTERNS), choices=PATTERNS)
    ap.add_argument("--render", type=Path)
    args = ap.parse_args()
    if args.render:
        doc = json.loads((args.render / "coalesce.json").read_text())
        res = ROOT / "bench" / "results"
        (res / "gpu_coalesce.json").write_text(json.dumps(doc, indent=1))
        md = markdown(doc)
        notes = res / "gpu_coalesce.notes.md"
        (res / "gpu_coalesce.md").write_text(
            md + ("\n" + notes.read_text() if notes.exists() else "")
        )
        print(md)
        print("plot:", plot(doc, res / "gpu_coalesce.png"))
        return 0
    gdp.setup_imports()
    import torch

    if args.smoke:
        args.repeats = 1
    t0 = time.time()
    doc = run(args)
    try:
        commit = (
            subprocess.run(
                ["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"],
                capture_output=True,
                text=True,
            ).stdout.strip()
            or "(no git on the device)"
        )
    except Exception:  # noqa: BLE001
        commit = "(no git)"
    import importlib.metadata as md

    def ver(d: str) -> str:
        try:
            return md.version(d)
        except md.PackageNotFoundError:
            return "-"

    doc["meta"] = {
        "command": " ".join(["python"] + sys.argv),
        "device": torch.cuda.get_device_name(0)
        if torch.cuda.is_available()
        else platform.processor() or "cpu",
        "torch": torch.__version__,
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "commit": os.environ.get("HYBRIDKV_COMMIT", commit),
        "repeats": args.repeats,
        "warmup": args.warmup,
        "seconds": round(time.time() - t0, 1),
        "wheels": f"nixl-cu13 {ver('nixl-cu13')}, nixl {ver('nixl')}",
    }
    text = json.dumps(doc, indent=1)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "coalesce.json").write_text(text)
    print(markdown(doc))
    return (
        0
        if not doc["errors"]
        and all(
            all(v for k, v in c.items() if k.endswith(("_exact", "_detected")))
            for c in doc["checks"]
        )
        else 1
    )


if __name__ == "__main__":
    raise SystemExit(main())
