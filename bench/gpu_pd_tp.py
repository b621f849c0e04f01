"""P/D across TP sizes on one GPU: hybridkv's decode READ plan over CUDA KV caches laid out as vLLM 0.33 lays them out.

    python bench/gpu_pd_tp.py --out DIR --kernel 32|544 --num-blocks 280 --sizes 4 16 64 256 --repeats 7
                                                   # device, one call for both kernels: ~3 min with the start
                                                   # (NIXL wheel + .vllm-mini carried; docs/gpu_results.md)
    python bench/gpu_pd_tp.py --render A.json B.json   # here: -> bench/results/gpu_pd_tp.{md,json,png}
    python bench/gpu_pd_tp.py --device cpu --num-blocks 24 --sizes 4 --repeats 1 --warmup 0  # CPU smoke (2 min)
    python bench/gpu_pd_tp.py --check-vllm         # here (CPU, vLLM 0.33 on PYTHONPATH): layouts == vLLM's

Geometry: qwen3-next-80B-A3B's per-layer shapes, fewer layers. Full attention: 2 KV heads of 256
(bf16), 1 per rank at TP2. GDN (gated delta net): 16 key / 32 value heads of 128, conv kernel 4,
conv + SSM state bf16, conv state in vLLM's default ``SD`` layout ``(state_len, conv_dim / tp)``,
SSM ``(v_heads / tp, 128, 128)`` (shapes == vLLM's ``gated_delta_net_state_shape``, checked on CPU by
``--check-vllm`` and tests/unit/test_gpu_pd_tp_plan.py). 4 attention layers + 12 GDN layers (3:1 like
qwen3-next): vLLM's hybrid overlay, one attention group and 3 GDN groups of 4 layers sharing 4 KV
tensors; block size 544 tokens (vLLM's hybrid page rule, platforms/interface.py: the smallest
multiple of 16 tokens whose attention page holds the GDN state; the same at TP1 and TP2), the GDN
page padded to the attention page; attention views split into 32-token kernel blocks (17 per
manager block, what a backend with kernel sizes 16/32/64 gets). One CUDA int8 allocation per rank,
views by vLLM's own ``create_kv_cache_views`` (through ``hybridkv.cli.harness.kv_views.allocate``, with
bench/gpu_data_path.py's ``.vllm-mini`` + connector-base shim where vLLM is not installed).

Processes: every rank is its own process with its own CUDA allocation on the one GPU and its own
NIXL agent (UCX cuda_ipc, ``UCX_CUDA_IPC_ENABLE_GET_ZCOPY=y``). Prefill ranks: hybridkv's
``PDWorker`` (``register_kv_caches`` on the CUDA views: VRAM registration, handshake server with
the layout descriptor and GDN state splits from ``pd_worker.group_state_splits``), random bytes
from a seed, leases issued through ``start_load_kv``. Decode ranks: ``PDWorker`` with
``start_load_kv(ReadJob)``, i.e. ``PDWorker._read``: the TP pairing (``pd_tp.rank_reads``), one
handshake per prefill rank, spans from ``pd_tp.read_spans`` (``head_slices`` for attention,
``mamba_slices`` for GDN conv + SSM), one ``read_blocks`` per prefill rank, wait, lease claims
and releases over gRPC. Cases TP2 -> TP1 and TP1 -> TP2.

Check (per case and decode rank): the decode allocation is poisoned, one hand-over is READ, and
the WHOLE allocation must equal the poison except exactly the expected bytes, computed here
independently of hybridkv's spans: the prefill ranks' tensors (regenerated from their seeds) are
concatenated by heads with torch (attention: KV heads; GDN conv: each of the q | k | v channel parts;
SSM: v heads) into the TP-independent whole, and this decode rank's share of it is sliced out and
written into the destination blocks through vLLM's views. Planted faults through the same
``PDWorker`` path (each must FAIL the check): ``swap`` = the prefill ranks' shares swapped
(``_plan`` patched: TP2->TP1 reads rank 1's heads/state where rank 0's belong and vice versa;
TP1->TP2 each decode rank takes the other's share); ``ssm`` = the SSM span one v head off
(``_slices`` patched: remote offset + one head, one head shorter, so it stays inside both pages).
A raw NIXL READ of the same rows is checked too.

Throughput per case and size (n attention blocks + 1 block of each GDN group per hand-over):
``hybridkv`` = what ``PDWorker._read`` posts (plan, ``_slices``, ``read_blocks`` per prefill rank,
all posted then waited) without the gRPC lease claim/release; ``raw`` = a second NIXL agent in the
same process on the same memory posting the SAME descriptor rows (``read_descriptors`` with the same
slices, built before the clock); ``job`` = the whole ``PDWorker`` job (start_load_kv -> finished,
lease claims and releases over gRPC included); D2D = torch copy of the same byte count. Paths
alternate; decode ranks line up on a barrier before each timed READ. GB/s = bytes of all decode
ranks / (earliest start -> latest end, CLOCK_MONOTONIC); ratio = median raw time / median hybridkv time.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import multiprocessing as mp
import os
import platform
import random
import statistics
import subprocess
import sys
import time
import types
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
import bench.gpu_data_path as gdp  # noqa: E402 - the machinery: .vllm-mini, shim, vLLM's allocate
from hybridkv.cli.harness import kv_views  # noqa: E402
from hybridkv.cli.harness.pd_tp_model import (  # noqa: E402
    ATTN_LAYERS,
    BLOCK,
    GDN_GROUPS,
    GDN_HEAD_K,
    GDN_HEAD_V,
    GDN_K_HEADS,
    GDN_KERNEL,
    GDN_V_HEADS,
    KERNEL,
    NUM_BLOCKS,
    SIZES,
    TOTAL_KV_HEADS,
    expected_groups,
    expected_image,
    gdn_shapes,
    pick,
    scenario,
    ssm_off_by_one,
    swapped_plan,
)

CHECK_BLOCKS = 16
CASES = (("TP2->TP1", 2, 1), ("TP1->TP2", 1, 2))
PLANTS = ("swap", "ssm")
LEASES = 400
SHIM_MAMBA = "vllm.model_executor.layers.mamba.mamba_utils"
UCX_ENV = {
    "UCX_TLS": "cuda_ipc,cuda_copy,tcp",
    "UCX_CUDA_IPC_ENABLE_GET_ZCOPY": "y",
    "UCX_CUDA_IPC_ENABLE_MNNVL": "n",
    "UCX_MEMTYPE_CACHE": "n",
    "UCX_NET_DEVICES": "lo",
    "UCX_MODULES": "^ib",
}


# ----------------------------------------------------------------------------- geometry


# ----------------------------------------------------------------------------- imports
def install_mamba_utils_shim() -> None:
    """SHIM for ``vllm.model_executor.layers.mamba.mamba_utils`` where it cannot be imported
    (the device has no vLLM config stack): only ``is_conv_state_dim_first``, which
    ``pd_worker.group_state_splits`` asks, answering as vLLM 0.33's does
    (``VLLM_SSM_CONV_STATE_LAYOUT`` == "DS"; unset: "SD", dim last)."""
    try:
        import vllm.model_executor.layers.mamba.mamba_utils  # noqa: F401

        return
    except Exception:  # noqa: BLE001 - its imports need vllm.config (pydantic, ...)
        pass
    parts = SHIM_MAMBA.split(".")
    for i in range(2, len(parts)):
        name = ".".join(parts[:i])
        if name not in sys.modules:
            m = types.ModuleType(name)
            m.__path__ = []
            sys.modules[name] = m
    mod = types.ModuleType(SHIM_MAMBA)
    mod.is_conv_state_dim_first = lambda: os.environ.get("VLLM_SSM_CONV_STATE_LAYOUT", "SD") == "DS"
    sys.modules[SHIM_MAMBA] = mod
    gdp.SHIM.append(SHIM_MAMBA)


def setup() -> None:
    gdp.setup_imports()
    install_mamba_utils_shim()


# ----------------------------------------------------------------------------- expected bytes


# ----------------------------------------------------------------------------- planted faults


# ----------------------------------------------------------------------------- rank processes
def _now() -> float:
    return time.clock_gettime(time.CLOCK_MONOTONIC)


def ucx_env(device: str) -> dict:
    """cuda_ipc zero-copy on the GPU (docs/gpu_results.md); on CPU (smoke runs) loopback defaults."""
    return UCX_ENV if device == "cuda" else {"UCX_NET_DEVICES": "lo", "UCX_MODULES": "^ib"}


def prefill_main(rank: int, tp: int, args, conn) -> None:
    """A prefill rank: CUDA KV cache with seeded random bytes, PDWorker serving the handshake, leases."""
    os.environ.update(ucx_env(args.device))
    setup()
    import torch

    from hybridkv.connector.pd_metadata import Lease, PDConnectorMetadata
    from hybridkv.connector.pd_worker import PDWorker, PDWorkerSettings, mamba_reslice_problem

    t0 = time.perf_counter()
    cache = gdp.make_cache(
        scenario(tp, args.num_blocks, kernel=args.kernel), torch.device(args.device, 0)
    )
    gdp.fill_random(cache, 1000 * tp + rank)
    gdp._sync()
    w = PDWorker(
        PDWorkerSettings(
            "prefill",
            rank,
            tp,
            "127.0.0.1",
            0,
            10.0,
            60.0,
            serve_handshake=True,
            total_kv_heads=TOTAL_KV_HEADS,
        ),
        cache.kvc,
    )
    w.register_kv_caches(cache.views)
    w.start_load_kv(
        PDConnectorMetadata(leases=[Lease(f"r{k}", f"L{k}", 1800.0) for k in range(LEASES)])
    )
    conn.send(
        {
            "port": w.handshake_metadata().port,
            "setup_s": time.perf_counter() - t0,
            "mamba_reslice_problem": mamba_reslice_problem(cache.kvc),
            "splits": [
                [s.to_wire() for s in g.splits()] if g is not None else None
                for g in w._local.groups
            ],
        }
    )
    conn.recv()
    w.shutdown()
    conn.send("bye")


def decode_main(rank: int, tp: int, ptp: int, ports: list[int], barrier, args, conn) -> None:
    try:
        conn.send(run_decode(rank, tp, ptp, ports, barrier, args))
    except BaseException as e:  # noqa: BLE001 - reported to the parent
        import traceback

        try:
            barrier.abort()
        except Exception:  # noqa: BLE001
            pass
        conn.send({"error": f"decode rank {rank}: {e!r}\n{traceback.format_exc()}"})


def run_decode(rank: int, tp: int, ptp: int, ports: list[int], barrier, args) -> dict:
    os.environ.update(ucx_env(args.device))
    setup()
    import torch

    import hybridkv.connector.pd_transport as pdt
    from hybridkv.connector.pd_handshake import fetch_agent_info
    from hybridkv.connector.pd_metadata import PDConnectorMetadata, ReadJob
    from hybridkv.connector.pd_worker import PDWorker, PDWorkerSettings

    dev = torch.device(args.device, 0)
    t_setup = time.perf_counter()
    cache = gdp.make_cache(scenario(tp, args.num_blocks, kernel=args.kernel), dev)
    refs = []  # the prefill ranks' caches, regenerated from their seeds (the check's independent source)
    for p in range(ptp):
        c = gdp.make_cache(scenario(ptp, args.num_blocks, kernel=args.kernel), dev)
        gdp.fill_random(c, 1000 * ptp + p)
        refs.append(c)
    gdp._sync()
    w = PDWorker(
        PDWorkerSettings(
            "decode",
            rank,
            tp,
            "127.0.0.1",
            0,
            10.0,
            60.0,
            serve_handshake=False,
            total_kv_heads=TOTAL_KV_HEADS,
        ),
        cache.kvc,
    )
    w.register_kv_caches(cache.views)
    tr = w._transport
    next_lease = iter(range(LEASES))

    def job(r, lo, lease=True):
        k = next(next_lease) if lease else LEASES + 1
        return ReadJob(
            req_id=f"d{rank}-r{k}",
            remote_req_id=f"r{k}",
            remote_engine_id="prefill",
            remote_host="127.0.0.1",
            remote_port=ports[0],
            remote_block_ids=r,
            local_block_ids=lo,
            lease_id=f"L{k}",
            remote_ports=list(ports),
        )

    def run_job(j) -> tuple[bool, float, float]:
        t0 = _now()
        w.start_load_kv(PDConnectorMetadata(reads=[j]))
        while True:
            res = w.get_transfer_results()
            if j.req_id in res.finished_recving:
                return j.req_id not in res.failed_recving, t0, _now()
            time.sleep(0.0002)

    # raw NIXL: a second agent on the same memory; the prefill ranks' metadata from the real handshake
    mem = tr.mem_kind
    rawa = pdt._make_agent(f"raw-d{rank}", ["UCX"], 100)
    reg = rawa.register_memory([(int(b), int(n), 0, "") for b, n in cache.layout.allocations], mem)
    raw_peers, layouts = {}, {}
    for p in range(ptp):
        info = fetch_agent_info(
            f"127.0.0.1:{ports[p]}",
            w._local,
            engine_id="bench-raw",
            tp_rank=rank,
            timeout_s=10,
            prefill_engine_id="prefill",
            prefill_rank=p,
        )
        raw_peers[p] = rawa.add_remote_agent(info.agent_metadata)
        layouts[p] = info.layout
    ldevs = [None if s is None else s.dev for s in tr.group_spaces]

    def rows(j):
        out = []
        for part in w._plan(j):
            pl = layouts[part.prefill_rank]
            out.append(
                (
                    part.prefill_rank,
                    *pdt.read_descriptors(
                        tr.layout.groups,
                        pl.group_layouts(),
                        j.remote_block_ids,
                        j.local_block_ids,
                        ldevs,
                        [None if s is None else s.dev for s in pl.memory_spaces()],
                        w._slices(part, pl, j),
                    ),
                )
            )
        return out

    def raw_read(j) -> tuple[float, float, int, int]:
        built = rows(j)  # before the clock
        t0 = _now()
        xs = []
        for p, loc, rem in built:
            h = rawa.initialize_xfer(
                "READ",
                rawa.get_xfer_descs(loc, mem),
                rawa.get_xfer_descs(rem, mem),
                raw_peers[p],
                b"",
            )
            xs.append((h, rawa.transfer(h)))
        for h, st in xs:
            while st == "PROC":
                st = rawa.check_xfer_state(h)
            assert st == "DONE", st
        t1 = _now()
        for h, _ in xs:
            rawa.release_xfer_handle(h)
        return (
            t0,
            t1,
            sum(len(loc) for _, loc, _ in built),
            sum(int(loc[:, 1].sum()) for _, loc, _ in built),
        )

    def ours(j) -> tuple[float, float, int, int]:
        """PDWorker._read's posts and waits (plan, _peer, _slices, read_blocks), no lease claim."""
        t0 = _now()
        hs = []
        for part in w._plan(j):
            peer, pl = w._peer(j, part.prefill_rank)
            hs.append(
                tr.read_blocks(
                    peer, j.remote_block_ids, j.local_block_ids, slices=w._slices(part, pl, j)
                )
            )
        for h in hs:
            tr.wait(h, 60.0)
        t1 = _now()
        for h in hs:
            tr.release(h)
        return t0, t1, sum(h.num_descs for h in hs), sum(h.nbytes for h in hs)

    def ours_poll(j) -> tuple[float, float, int, int]:
        """``ours`` with a spinning ``poll`` instead of ``PDTransport.wait`` (whose sleeps back off to
        1 ms between polls, for 2-core hosts): the difference is what that back-off costs here."""
        t0 = _now()
        hs = []
        for part in w._plan(j):
            peer, pl = w._peer(j, part.prefill_rank)
            hs.append(
                tr.read_blocks(
                    peer, j.remote_block_ids, j.local_block_ids, slices=w._slices(part, pl, j)
                )
            )
        for h in hs:
            while tr.poll(h) != "DONE":
                pass
        t1 = _now()
        for h in hs:
            tr.release(h)
        return t0, t1, sum(h.num_descs for h in hs), sum(h.nbytes for h in hs)

    rng = random.Random(17)  # the same ids on every decode rank (one scheduler)
    plan = [
        (p.prefill_rank, p.local_head0, p.remote_head0, p.num_heads, p.whole)
        for p in w._plan(job([[]], [[]], lease=False))
    ]
    spans_ex = {}
    j0 = job(*pick(cache.kvc, 1, random.Random(0)), lease=False)
    for part in w._plan(j0):
        sl = w._slices(part, w._peer(j0, part.prefill_rank)[1], j0)
        spans_ex[part.prefill_rank] = [None if s is None else s[0][:20] for s in sl]

    # ---------------------------------------------------------------- checks
    checks = {}

    def check(label, fn):
        src, dst = pick(cache.kvc, CHECK_BLOCKS, rng)
        ref = expected_groups(cache.kvc, [c.views for c in refs], rank, tp, ptp, src)
        exp = expected_image(cache, ref, dst)
        gdp.poison(cache)
        gdp._sync()
        ok = fn(job(src, dst))
        gdp._sync()
        diff = int((cache.buf != exp).sum().item())
        checks[label] = {
            "read_ok": ok,
            "exact": diff == 0,
            "wrong_bytes": diff,
            "expected_written_bytes": sum(r.numel() * r.element_size() for g in ref for r in g),
        }
        del exp, ref

    check("hybridkv", lambda j: run_job(j)[0])
    check("raw", lambda j: (raw_read(j), True)[1])
    plan_fn, slices_fn = w._plan, w._slices
    for plant in args.plants:
        if plant == "swap":
            w._plan = swapped_plan(w, plan_fn)
        else:
            w._slices = ssm_off_by_one(w, slices_fn)
        try:
            check(f"planted {plant}", lambda j: run_job(j)[0])
        finally:
            w._plan, w._slices = plan_fn, slices_fn
    check("hybridkv again", lambda j: run_job(j)[0])

    # ---------------------------------------------------------------- timing
    timing = []
    for n in args.sizes:
        t = {"ours": [], "raw": [], "job": [], "poll": []}
        info = None
        for i in range(args.warmup + args.repeats):
            order = [("ours", ours), ("raw", raw_read), ("job", None), ("poll", ours_poll)]
            order = order[i % 4 :] + order[: i % 4]
            for key, fn in order:
                src, dst = pick(cache.kvc, n, rng)
                j = job(src, dst, lease=key == "job")
                if tp > 1:
                    barrier.wait(60)
                if fn is None:
                    ok, t0, t1 = run_job(j)
                    assert ok, "job READ failed"
                else:
                    t0, t1, nd, nb = fn(j)
                    info = (nd, nb)
                if i >= args.warmup:
                    t[key].append((t0, t1))
        d2d = gdp.copy_baselines(info[1], dev, 3)["d2d"]
        build = []  # plan + spans + read_descriptors: inside hybridkv's time, outside raw's
        for _ in range(3):
            j = job(*pick(cache.kvc, n, rng), lease=False)
            b0 = time.perf_counter()
            rows(j)
            build.append(time.perf_counter() - b0)
        timing.append(
            {
                "n": n,
                "descs": info[0],
                "bytes": info[1],
                "times": t,
                "d2d_s": d2d,
                "build_s": statistics.median(build),
            }
        )
    w.shutdown()
    for rp in raw_peers.values():
        rawa.remove_remote_agent(rp)
    rawa.deregister_memory(reg)
    return {
        "rank": rank,
        "plan": plan,
        "spans_example": spans_ex,
        "checks": checks,
        "timing": timing,
        "setup_s": time.perf_counter() - t_setup,
    }


# ----------------------------------------------------------------------------- orchestration
def run_case(name: str, ptp: int, dtp: int, args) -> dict:
    ctx = mp.get_context("spawn")
    pre, pconns = [], []
    for r in range(ptp):
        a, b = ctx.Pipe()
        p = ctx.Process(target=prefill_main, args=(r, ptp, args, b), daemon=True)
        p.start()
        pre.append(p)
        pconns.append(a)
    infos = []
    for c in pconns:
        if not c.poll(180):
            raise SystemExit(f"{name}: a prefill rank did not start")
        infos.append(c.recv())
    ports = [i["port"] for i in infos]
    barrier = ctx.Barrier(dtp)
    dec, dconns = [], []
    for r in range(dtp):
        a, b = ctx.Pipe()
        p = ctx.Process(
            target=decode_main, args=(r, dtp, ptp, ports, barrier, args, b), daemon=True
        )
        p.start()
        dec.append(p)
        dconns.append(a)
    ranks = []
    for c in dconns:
        if not c.poll(args.case_timeout):
            ranks.append({"error": "decode rank timed out"})
        else:
            ranks.append(c.recv())
    for c in pconns:
        try:
            c.send("stop")
            c.poll(20) and c.recv()
        except (OSError, EOFError):
            pass
    for p in pre + dec:
        p.join(15)
        if p.is_alive():
            p.kill()
    return {"name": name, "prefill_tp": ptp, "decode_tp": dtp, "prefill": infos, "ranks": ranks}


def summarize(case: dict, kernel: int = KERNEL) -> list[dict]:
    """Per size: instance GB/s per path (all decode ranks' bytes / earliest start -> latest end)."""
    ranks = [r for r in case["ranks"] if "error" not in r]
    out = []
    for si, t0 in enumerate(ranks[0]["timing"]) if ranks else []:
        nbytes = sum(r["timing"][si]["bytes"] for r in ranks)
        row = {
            "case": case["name"],
            "kernel": kernel,
            "n": t0["n"],
            "bytes": nbytes,
            "descs": [r["timing"][si]["descs"] for r in ranks],
        }
        for key in ("ours", "raw", "job", "poll"):
            if key not in ranks[0]["timing"][si]["times"]:
                continue
            k = len(ranks[0]["timing"][si]["times"][key])
            row[key + "_s"] = [
                max(r["timing"][si]["times"][key][i][1] for r in ranks)
                - min(r["timing"][si]["times"][key][i][0] for r in ranks)
                for i in range(k)
            ]
        row["d2d_s"] = ranks[0]["timing"][si]["d2d_s"]
        row["build_s"] = max(r["timing"][si]["build_s"] for r in ranks)
        out.append(row)
    return out


def _gbs(row, key) -> float:
    return row["bytes"] / statistics.median(row[key + "_s"]) / 1e9


def markdown(doc: dict) -> str:
    m = doc["meta"]
    L = [
        "# P/D across TP sizes on one H200: hybridkv's decode READ plan (TP pairing, head spans, GDN re-slicing) "
        "over vLLM-0.33-laid-out CUDA KV caches",
        "",
        f"- command: `{m['command']}`; device: {m['device']}; torch {m['torch']}; {m['date']}; wall {m['wall_s']} s",
        f"- wheels: {m['wheels']}; vLLM: {m['vllm']}; shims: {m['shim']}; hybridkv commit {m['commit']}",
        f"- UCX: {m['ucx']}",
        "- how: see the docstring of bench/gpu_pd_tp.py. Geometry: qwen3-next's per-layer shapes (attention 2 KV "
        "heads x 256, GDN 16 k / 32 v heads x 128, conv kernel 4, bf16, conv in vLLM's default SD layout), "
        f"{ATTN_LAYERS} attention + {ATTN_LAYERS * GDN_GROUPS} GDN layers in one attention and {GDN_GROUPS} GDN "
        f"groups overlaying {ATTN_LAYERS} KV tensors, {BLOCK}-token blocks; attention kernel blocks (k) of "
        f"{m.get('kernel')} tokens ({BLOCK}: not split), {m.get('num_blocks')} blocks per rank, every rank its own process, CUDA allocation and NIXL agent on the one GPU.",
        "",
    ]
    L += [
        "## Byte-exact checks (decode allocation poisoned, one hand-over of "
        f"{CHECK_BLOCKS} attention blocks + 1 block per GDN group READ, WHOLE allocation compared with the "
        "independently sliced expectation)",
        "",
        "| case | kernel tokens | decode rank | plan: <- prefill rank (local head0, remote head0, heads) | path | "
        "READ reported ok | whole allocation == expected | wrong bytes | expected bytes written |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for c in doc["cases"]:
        for r in c["ranks"]:
            if "error" in r:
                L.append(
                    f"| {c['name']} | {c.get('kernel')} | ERROR | {r['error'].splitlines()[0]} | | | | | |"
                )
                continue
            plan = "; ".join(f"p{p} ({lh}, {rh}, {nh})" for p, lh, rh, nh, _ in r["plan"])
            for label, ch in r["checks"].items():
                want = not label.startswith("planted")
                verdict = (
                    ("**yes**" if ch["exact"] else "no")
                    if want
                    else ("no: **detected**" if not ch["exact"] else "yes: **NOT detected**")
                )
                L.append(
                    f"| {c['name']} | {c.get('kernel')} | {r['rank']} | {plan} | {label} | {ch['read_ok']} | {verdict} | "
                    f"{ch['wrong_bytes']} | {ch['expected_written_bytes']} |"
                )
    L += [
        "",
        "`planted swap`: the prefill ranks' shares swapped (PDWorker._plan patched); `planted ssm`: the SSM "
        "span one v head off (PDWorker._slices patched: remote offset + 1 head, 1 head shorter). Both through "
        "the same PDWorker job path; the READ itself succeeds, only the byte check can see them.",
        "",
    ]
    L += [
        "## Throughput: hybridkv READ vs raw NIXL READ of the same descriptor rows (same run)",
        "",
        "| case | kernel tokens | attention blocks + GDN blocks per hand-over | MiB (all decode ranks) | descriptors per decode rank | "
        "hybridkv GB/s | raw NIXL GB/s | **raw time / hybridkv time** | PDWorker job GB/s (incl. gRPC lease "
        "claim + release) | job / raw | D2D GB/s (same bytes) | span build ms (in hybridkv time) | hybridkv with "
        "spin poll instead of wait(): GB/s, raw / it |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in doc["rows"]:
        ratio = statistics.median(r["raw_s"]) / statistics.median(r["ours_s"])
        jr = statistics.median(r["raw_s"]) / statistics.median(r["job_s"])
        L.append(
            f"| {r['case']} | {r.get('kernel')} | {r['n']} + {GDN_GROUPS} | {r['bytes'] / 2**20:.1f} | {' / '.join(map(str, r['descs']))} "
            f"| {_gbs(r, 'ours'):.1f} | {_gbs(r, 'raw'):.1f} | **{ratio:.2f}** | {_gbs(r, 'job'):.1f} | {jr:.2f} | "
            f"{_gbs(r, 'd2d'):.0f} | {1e3 * r.get('build_s', float('nan')):.2f} | "
            + (
                f"{_gbs(r, 'poll'):.1f}, {statistics.median(r['raw_s']) / statistics.median(r['poll_s']):.2f} |"
                if r.get("poll_s")
                else "not run |"
            )
        )
    L += [
        "",
        f"{doc['meta']['repeats']} timed repeats after {doc['meta']['warmup']} warm-up per size, paths rotated; "
        "medians. GB/s = payload bytes of all decode ranks / (earliest start -> latest end).",
        "",
    ]
    for c in doc["cases"]:
        L.append(
            f"- {c['name']} (kernel {c.get('kernel')}): prefill mamba_reslice_problem = {[p['mamba_reslice_problem'] for p in c['prefill']]}; "
            f"GDN state splits (offset, rows, unit, parts) rank 0: {c['prefill'][0]['splits'][1]}"
        )
    if doc.get("notes"):
        L += ["", "## Notes", ""] + [f"- {n}" for n in doc["notes"]]
    return "\n".join(L) + "\n"


def plot(doc: dict, path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    rows = doc["rows"]
    fig, ax = plt.subplots(figsize=(max(9, 1.1 * len(doc["rows"])), 4.8))
    labels = [
        f"{r['case']} k{r.get('kernel')}\n{r['n']}+{GDN_GROUPS} blk, {r['bytes'] / 2**20:.0f} MiB"
        for r in rows
    ]
    for j, (k, lab) in enumerate(
        (
            ("ours", "hybridkv READ (PDWorker plan + spans)"),
            ("raw", "raw NIXL READ, same rows"),
            ("job", "PDWorker job incl. gRPC lease claim/release"),
        )
    ):
        ax.bar(
            [i + (j - 1) * 0.27 for i in range(len(rows))],
            [_gbs(r, k) for r in rows],
            0.27,
            label=lab,
        )
    for i, r in enumerate(rows):
        ax.annotate(
            f"x{statistics.median(r['raw_s']) / statistics.median(r['ours_s']):.2f}",
            (i, max(_gbs(r, "ours"), _gbs(r, "raw"))),
            ha="center",
            va="bottom",
            fontsize=8,
        )
    ax.set_xticks(range(len(rows)), labels, fontsize=7)
    ax.set_yscale("log")
    ax.set_ylabel("GB/s (all decode ranks, log)")
    ax.set_title(
        "P/D across TP sizes on one H200 (cuda_ipc): hybridkv vs raw NIXL of the same rows\n"
        "label = raw time / hybridkv time",
        fontsize=9,
    )
    ax.legend(fontsize=7)
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return True


def render(srcs: list[Path]) -> int:
    """Merge device JSONs (one per kernel size) into bench/results/gpu_pd_tp.*."""
    docs = [json.loads(p.read_text()) for p in srcs]
    for d in docs:
        for c in d["cases"]:
            c["kernel"] = d["meta"].get("kernel", KERNEL)
    doc = {
        "meta": {
            k: (
                "; ".join(sorted({str(d["meta"].get(k)) for d in docs}))
                if k not in ("repeats", "warmup")
                else docs[0]["meta"][k]
            )
            for k in docs[0]["meta"]
            if k != "addressing_files_sha1"
        },
        "cases": [c for d in docs for c in d["cases"]],
        "rows": [r for d in docs for r in d["rows"]],
    }
    doc["meta"]["addressing_files_sha1"] = docs[0]["meta"].get("addressing_files_sha1")
    notes = ROOT / "bench" / "results" / "gpu_pd_tp.notes.json"
    if notes.exists():
        doc["notes"] = json.loads(notes.read_text())
    res = ROOT / "bench" / "results"
    (res / "gpu_pd_tp.json").write_text(json.dumps(doc, indent=1))
    (res / "gpu_pd_tp.md").write_text(markdown(doc))
    print(markdown(doc))
    print("plot:", plot(doc, res / "gpu_pd_tp.png"))
    return 0


def check_vllm() -> int:
    """CPU, vLLM 0.33 with its config stack: the scenarios' configs and views == vLLM's, and the
    GDN shapes == vLLM's gated_delta_net_state_shape."""
    from vllm.model_executor.layers.mamba.mamba_utils import MambaStateShapeCalculator

    bad = 0
    for tp in (1, 2):
        got = gdn_shapes(tp)
        want = MambaStateShapeCalculator.gated_delta_net_state_shape(
            tp, GDN_K_HEADS, GDN_V_HEADS, GDN_HEAD_K, GDN_HEAD_V, GDN_KERNEL
        )
        same = tuple(map(tuple, want)) == got
        print(f"TP{tp} GDN shapes {got} == vLLM's {tuple(map(tuple, want))}: {same}")
        bad += not same
    bad += kv_views.check_vllm({f"qwen3-next-like TP{tp}": scenario(tp) for tp in (1, 2)})
    return 1 if bad else 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--sizes", type=int, nargs="*", default=list(SIZES))
    ap.add_argument("--cases", nargs="*", default=[c[0] for c in CASES])
    ap.add_argument("--plants", nargs="*", default=list(PLANTS))
    ap.add_argument("--case-timeout", type=float, default=240)
    ap.add_argument(
        "--device", default="cuda", help="cpu: a smoke run here (DRAM, UCX loopback), no results"
    )
    ap.add_argument("--num-blocks", type=int, default=NUM_BLOCKS)
    ap.add_argument(
        "--kernel",
        type=int,
        default=KERNEL,
        help=f"attention kernel block tokens ({BLOCK}: no split)",
    )
    ap.add_argument("--render", type=Path, nargs="*")
    ap.add_argument("--check-vllm", action="store_true")
    args = ap.parse_args()
    if args.render:
        setup()
        return render(args.render)
    if args.check_vllm:
        gdp.setup_imports()
        return check_vllm()
    setup()
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("needs a CUDA GPU (--device cpu: a smoke run)")
    t0 = time.time()
    cases, rows = [], []
    for name, ptp, dtp in CASES:
        if name not in args.cases:
            continue
        c = run_case(name, ptp, dtp, args)
        cases.append(c)
        rows += summarize(c, args.kernel)
        for r in c["ranks"]:
            print(
                f"{name} decode rank {r.get('rank', '?')}: "
                + (r["error"] if "error" in r else json.dumps(r["checks"])),
                flush=True,
            )
        for r in summarize(c, args.kernel):
            print(
                f"{name} n={r['n']}: {r['bytes'] / 2**20:.1f} MiB descs {r['descs']} hybridkv {_gbs(r, 'ours'):.1f} "
                f"raw {_gbs(r, 'raw'):.1f} job {_gbs(r, 'job'):.1f} d2d {_gbs(r, 'd2d'):.0f} GB/s "
                f"(at {time.time() - t0:.0f} s)",
                flush=True,
            )
    import importlib.metadata as md

    def ver(d):
        try:
            return md.version(d)
        except md.PackageNotFoundError:
            return "-"

    commit = (
        os.environ.get("HYBRIDKV_COMMIT")
        or subprocess.run(  # the device's .git can be stale
            ["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True, text=True
        ).stdout.strip()
    )
    doc = {
        "meta": {
            "command": "python bench/gpu_pd_tp.py " + " ".join(sys.argv[1:]),
            "device": f"{torch.cuda.get_device_name(0) if args.device == 'cuda' else 'CPU'} (kernel {platform.release()})",
            "torch": f"{torch.__version__} CUDA {torch.version.cuda}",
            "date": dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "wheels": ", ".join(
                f"{d} {ver(d)}" for d in ("nixl-cu13", "nixl", "grpcio") if ver(d) != "-"
            ),
            "vllm": "0.33 kv_cache_interface from "
            + sys.modules["vllm"].__file__.replace(str(ROOT) + "/", ""),
            "shim": ", ".join(gdp.SHIM),
            "commit": commit,
            "ucx": UCX_ENV,
            "repeats": args.repeats,
            "warmup": args.warmup,
            "wall_s": round(time.time() - t0),
            "kernel": args.kernel,
            "num_blocks": args.num_blocks,
            "addressing_files_sha1": {
                f: __import__("hashlib").sha1((ROOT / f).read_bytes()).hexdigest()[:10]
                for f in (
                    "connector/pd_tp.py",
                    "connector/pd_transport.py",
                    "connector/pd_worker.py",
                    "connector/block_layout.py",
                )
            },
        },
        "cases": cases,
        "rows": rows,
    }
    out = args.out or Path(os.environ.get("OUT", "."))
    out.mkdir(parents=True, exist_ok=True)
    (out / f"gpu_pd_tp.k{args.kernel}.json").write_text(json.dumps(doc, indent=1))
    bad = [
        f"{c['name']} r{r.get('rank')}"
        for c in cases
        for r in c["ranks"]
        if "error" in r
        or not all(ch["exact"] != k.startswith("planted") for k, ch in r["checks"].items())
    ]
    print(
        "checks:",
        "all as expected" if not bad else f"FAILED {bad}",
        f"({time.time() - t0:.0f} s)",
        flush=True,
    )
    return 1 if bad else 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    os.environ.setdefault("GLOG_minloglevel", "2")
    sys.exit(main())
