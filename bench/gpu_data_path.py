"""GPU data path: hybridkv's own worker code over CUDA KV caches laid out as vLLM 0.33 lays them out.

    python bench/gpu_data_path.py --part store --out DIR   # device call 1 (Mooncake wheel)
    python bench/gpu_data_path.py --part pd --out DIR      # device call 2 (NIXL wheel)
    python bench/gpu_data_path.py --render DIR [DIR ...]   # here: merge -> bench/results/gpu_data_path.*
    python bench/gpu_data_path.py --check-vllm             # here (CPU): the bench's layouts == vLLM's

KV caches. Per scenario ONE CUDA int8 allocation and per-layer views made by vLLM 0.33's own
``create_kv_cache_views`` (``vllm.v1.kv_cache_interface``), called exactly as vLLM's
``allocate_kv_cache`` calls it (its 20-line loop is copied here because ``vllm/v1/worker/utils.py``
imports the model runner), with ``kernel_block_sizes`` so attention views are split into kernel
blocks. The ``KVCacheConfig`` is built here for vLLM's layer-outermost layout
(``layer_stride = page * num_blocks``, ``block_stride = page``, groups aliasing from byte 0);
``--check-vllm`` (run on CPU with vLLM 0.33's Python on PYTHONPATH) checks it equals
``get_kv_cache_config_from_groups`` and that every view equals vLLM's ``allocate_kv_cache``
(shape, stride, storage offset, dtype). Scenarios: see ``SCENARIOS``.

How vLLM is present without vLLM. The device has no vLLM. Two things stand in:
* ``.vllm-mini/``: the 30 pure-Python files of vLLM 0.33 that ``import vllm.v1.kv_cache_interface``
  loads (copied unmodified from the 0.33 wheel; ignored by git, carried to the device). So specs,
  ``KVCacheConfig`` and ``create_kv_cache_views`` are vLLM's own code.
* A SHIM, made by this bench (``_install_connector_base_shim``) only when the real module cannot be
  imported: ``vllm.distributed.kv_transfer.kv_connector.v1.base`` (``KVConnectorMetadata``,
  ``KVConnectorWorkerMetadata``, ``KVConnectorTransferResults``) and ``...v1.metrics``
  (``KVConnectorStats``, ``KVConnectorPromMetrics``): plain base classes / dataclasses with vLLM's
  field names, which ``StoreWorker`` only subclasses or constructs (the real modules import
  vLLM's config stack: pydantic, fastapi, ...). Recorded in the results as ``shim``.

(a) Store (``--part store``): a real ``mooncake_master`` (from the wheel) and ONE
``MooncakeBackend`` client with its own segment in this process (tcp; P2PHANDSHAKE), like
bench/store_data_path.py. Per scenario and batch of N manager blocks (random distinct ids):
* ``staged``: hybridkv's ``StoreWorker`` (its ``register_kv_caches`` builds the ``BlockStager``
  pools for CUDA caches): save = ``wait_for_save(SaveJob)`` until acknowledged (gather on the GPU,
  one D2H per chunk, CRC-32 trailer, ``batch_put_from_multi_buffers``), load = ``start_load_kv``
  (get, CRC check, H2D, scatter) until reported finished;
* ``direct``: GPU-direct: the CUDA allocation registered once (``register_buffer``), objects
  put/got straight from/to the manager-block regions of ``GroupLayout.regions`` with
  ``put_from_parts`` / ``get_into_parts`` (no trailer: ``checksum_parts`` reads host memory, which
  is why ``StoreWorker`` stages CUDA caches);
* baselines in the same run, same bytes: raw Mooncake ``batch_put_from`` / ``batch_get_into`` of
  one contiguous buffer per object from pinned host memory and from device memory; the device's own
  D2D copy and a pinned D2H / H2D copy of the batch bytes (contiguous).
(b) P/D READ (``--part pd``): two processes on the GPU (prefill: KV cache + NIXL agent; decode:
same layout). Decode reads N blocks with hybridkv's ``PDTransport.read_blocks`` + ``wait``
(``read_descriptors`` over ``GroupLayout.regions`` on both sides; both transports register VRAM
through ``pd_transport.memory_space`` of the cache's device, as the connector does), alternated with a raw
``nixl_agent`` READ of the SAME descriptor arrays built before the clock, for each UCX setting in
``UCX_SETTINGS`` (agents read UCX_* at creation, so each setting is a fresh process pair).

Correctness, every case, every path: the target's whole allocation is poisoned (0xA5), the blocks
are moved, then the whole allocation must equal the poison with the source blocks' bytes written
at the destination blocks, read through vLLM's own ``group_kernel_blocks`` view of each layer
(independent of hybridkv's addressing). Negative control per part and scenario: one block moved one
block off (a planted shift, through the same real path) must fail that check.

GB/s = batch payload bytes / wall time from call to completion, median over repeats; ratio =
median baseline time / median hybridkv time.
"""

from __future__ import annotations

import argparse
import datetime as dt
import glob
import json
import os
import platform
import random
import statistics
import subprocess
import sys
import time
import types
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# The benchmark runs from this checkout where hybridkv is not installed (the device): its package
# directories are then hybridkv's.
try:
    import hybridkv.cli  # noqa: F401
except ImportError:
    _pkg = types.ModuleType("hybridkv")
    _pkg.__path__ = [str(ROOT)]
    sys.modules["hybridkv"] = _pkg

from hybridkv.cli.harness import kv_views  # noqa: E402
from hybridkv.cli.harness.kv_views import (  # noqa: E402
    batch_bytes,
    block_bytes_ref,
    build_config,
    expected_after,
    fill_random,
    make_cache,
    pick_blocks,
    poison,
    shifted,
)

SHIM: list[str] = []  # module names this bench had to stand in for

# name -> groups (kind, layers, block tokens, kernel tokens, heads/shape), layout, num_blocks, batches
SCENARIOS = {
    "FA 64 tok, kernel 16 (LBHNC)": dict(
        layout="LBHNC",
        num_blocks=1280,
        batches=(64, 256),
        groups=[dict(kind="fa", layers=16, block=64, kernel=16, heads=8, head=128)],
    ),
    "FA 128 tok, kernel 32 (LBNHC)": dict(
        layout="LBNHC",
        num_blocks=1280,
        batches=(64, 256),
        groups=[dict(kind="fa", layers=16, block=128, kernel=32, heads=4, head=128)],
    ),
    "hybrid: FA 128/k32 + Mamba overlay (LBHNC)": dict(
        layout="LBHNC",
        num_blocks=2560,
        batches=(64, 256),
        groups=[
            dict(kind="fa", layers=8, block=128, kernel=32, heads=4, head=128),
            dict(kind="mamba", layers=8, block=128, shapes=((3, 4096), (16, 64, 64))),
        ],
    ),
}
UCX_SETTINGS = {
    # what NIXL/UCX picks by itself on this VM: READ is tcp "software emulation" (no NVLink seen)
    "UCX defaults": {},
    # cuda_ipc get_zcopy forced on (UCX disables it when NVML reports no NVLink)
    "cuda_ipc get_zcopy": {
        "UCX_TLS": "cuda_ipc,cuda_copy,tcp",
        "UCX_CUDA_IPC_ENABLE_GET_ZCOPY": "y",
        "UCX_CUDA_IPC_ENABLE_MNNVL": "n",
        "UCX_MEMTYPE_CACHE": "n",
    },
}
SLOW_SETTINGS = {"UCX defaults"}  # only the smallest batch, 2 repeats (0.5 GB/s)


# ----------------------------------------------------------------------------- imports
def _install_connector_base_shim() -> None:
    """SHIM for the two vLLM connector modules StoreWorker imports (see module docstring)."""
    try:
        import vllm.distributed.kv_transfer.kv_connector.v1.base  # noqa: F401
        import vllm.distributed.kv_transfer.kv_connector.v1.metrics  # noqa: F401

        return
    except Exception:  # noqa: BLE001 - absent, or its config stack is missing
        pass
    for name in [n for n in sys.modules if n.startswith("vllm.distributed")]:
        del sys.modules[name]
    from typing import Any

    base = types.ModuleType("vllm.distributed.kv_transfer.kv_connector.v1.base")

    class KVConnectorMetadata:  # noqa: D401 - vLLM's is an empty ABC
        pass

    class KVConnectorWorkerMetadata:
        def aggregate(self, other):  # noqa: ANN001
            raise NotImplementedError

    class KVConnectorHandshakeMetadata:  # vLLM's is an empty ABC too (pd_metadata subclasses it)
        pass

    @dataclass
    class KVConnectorTransferResults:
        finished_sending: set = field(default_factory=set)
        finished_recving: set = field(default_factory=set)
        failed_recving: set = field(default_factory=set)

    base.KVConnectorMetadata = KVConnectorMetadata
    base.KVConnectorWorkerMetadata = KVConnectorWorkerMetadata
    base.KVConnectorHandshakeMetadata = KVConnectorHandshakeMetadata
    base.KVConnectorTransferResults = KVConnectorTransferResults
    metrics = types.ModuleType("vllm.distributed.kv_transfer.kv_connector.v1.metrics")

    @dataclass
    class KVConnectorStats:
        data: dict[str, Any] = field(default_factory=dict)

    class KVConnectorPromMetrics:
        def __init__(self, *args: Any, **kw: Any) -> None:
            pass

    metrics.KVConnectorStats = KVConnectorStats
    metrics.KVConnectorPromMetrics = KVConnectorPromMetrics
    parts = "vllm.distributed.kv_transfer.kv_connector.v1".split(".")
    for i in range(2, len(parts) + 1):
        name = ".".join(parts[:i])
        if name not in sys.modules:
            m = types.ModuleType(name)
            m.__path__ = []
            sys.modules[name] = m
    sys.modules[base.__name__] = base
    sys.modules[metrics.__name__] = metrics
    SHIM.extend([base.__name__, metrics.__name__])


def setup_imports() -> None:
    """vLLM 0.33's kv_cache_interface (``.vllm-mini`` where vLLM is not installed), the shim."""
    mini = ROOT / ".vllm-mini"
    try:
        import vllm.v1.kv_cache_interface as kci

        kci.create_kv_cache_views  # noqa: B018 - 0.33's view maker
    except (ImportError, AttributeError):
        if not mini.is_dir():
            raise SystemExit(
                "needs vLLM 0.33's kv_cache_interface: PYTHONPATH=/work/vllm033 or .vllm-mini/"
            ) from None
        for n in [n for n in sys.modules if n == "vllm" or n.startswith("vllm.")]:
            del sys.modules[n]
        sys.path.insert(0, str(mini))
        import vllm.v1.kv_cache_interface  # noqa: F401
    _install_connector_base_shim()


# ----------------------------------------------------------------------------- layouts


def _sync() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _med(xs):
    return statistics.median(xs)


def copy_baselines(nbytes: int, device, repeats: int) -> dict:
    """D2D, pinned D2H and H2D of nbytes, contiguous, wall time incl. sync."""
    import torch

    a = torch.empty(nbytes, dtype=torch.uint8, device=device)
    b = torch.empty_like(a)
    h = torch.empty(nbytes, dtype=torch.uint8, pin_memory=device.type == "cuda")
    out = {"d2d": [], "d2h_pinned": [], "h2d_pinned": []}
    for _ in range(repeats + 1):
        for k, fn in (
            ("d2d", lambda: b.copy_(a)),
            ("d2h_pinned", lambda: h.copy_(a, non_blocking=True)),
            ("h2d_pinned", lambda: a.copy_(h, non_blocking=True)),
        ):
            _sync()
            t = time.perf_counter()
            fn()
            _sync()
            out[k].append(time.perf_counter() - t)
    return {k: v[1:] for k, v in out.items()}


# ----------------------------------------------------------------------------- (a) store
def _find_master() -> str | None:
    for p in sys.path:
        for f in glob.glob(os.path.join(p, "mooncake", "mooncake_master")):
            os.chmod(f, 0o755)
            return f
    return None


def run_store(args) -> dict:
    import torch

    import hybridkv.connector.store_worker as sw
    from hybridkv.connector.block_layout import layout_rows
    from hybridkv.connector.store_config import StoreConnectorConfig
    from hybridkv.connector.store_metadata import (
        BlockBatch,
        LoadJob,
        SaveJob,
        StoreConnectorMetadata,
    )
    from hybridkv.store.embedded_master import EmbeddedMaster
    from hybridkv.store.keys import KeySchema
    from hybridkv.store.mooncake_backend import MooncakeBackend

    dev = torch.device(args.device)
    rows, checks = [], []
    max_bytes = max(batch_bytes_est(sc) for sc in SCENARIOS.values())
    segment = int(4.6 * max_bytes) + (512 << 20)  # 4 systems' objects per repeat
    ids = iter(range(1, 1 << 30))
    keep = []
    with EmbeddedMaster(default_kv_lease_ttl_ms=60_000, binary=_find_master()) as master:
        client = MooncakeBackend(master.address, global_segment_size=segment, timeout_s=300)
        raw = client._store
        for name, sc in SCENARIOS.items():
            if args.quick and name != next(iter(SCENARIOS)):
                continue
            cache = make_cache(sc, dev)
            kvc = cache.kvc
            cfg = StoreConnectorConfig(
                timeout_s=300,
                staging_buffer_size=512 << 20,
                staging="always" if dev.type == "cpu" else "auto",
            )
            schema = KeySchema.create(f"gpu-bench-{len(rows)}", "bf16", layout_rows(kvc))
            worker = sw.StoreWorker(cfg, kvc, schema, client)
            worker.register_kv_caches(cache.views)  # CUDA: builds BlockStager pools (staged path)
            assert worker._staging is not None
            client.register(
                cache.buf.data_ptr(), cache.buf.numel()
            )  # GPU-direct: the CUDA allocation
            rng = random.Random(7)
            for n in sc["batches"]:
                if args.quick and n != sc["batches"][0]:
                    continue
                src, dst = pick_blocks(cache, n, rng)
                nbytes = batch_bytes(cache, src)
                obj_sizes = [
                    cache.layout.groups[g].object_bytes for g, s in enumerate(src) for _ in s
                ]

                def batch(block_ids, hs):
                    b = BlockBatch()
                    for g, (bids, hh) in enumerate(zip(block_ids, hs)):
                        for h, bid in zip(hh, bids):
                            b.add(g, h, bid)
                    return b

                def staged_save(hs):
                    job = SaveJob(next(ids), batch(src, hs))
                    t = time.perf_counter()
                    worker.wait_for_save(StoreConnectorMetadata(saves=[job]))
                    assert worker._saves.wait_idle(600)
                    d = time.perf_counter() - t
                    wm = worker.build_worker_meta()
                    assert wm is not None and wm.finished_saves.get(job.job_id) == 1, wm
                    st = worker.take_stats()
                    assert st is None or not any(k.startswith("fail") for k in st.data), st.data
                    return d

                def staged_load(to, hs):
                    job = LoadJob(f"l{next(ids)}", batch(to, hs), load_id=next(ids))
                    t = time.perf_counter()
                    worker.start_load_kv(StoreConnectorMetadata(loads=[job]))
                    assert worker._loads.wait_idle(600)
                    _sync()
                    d = time.perf_counter() - t
                    res = worker.get_transfer_results()
                    worker.build_worker_meta()
                    st = worker.take_stats()
                    ok = job.req_id in res.finished_recving and not res.failed_recving
                    assert ok, (res, st and st.data)
                    return d

                def dkeys(hs):
                    return [schema.key(g, h) + "/direct" for g, hh in enumerate(hs) for h in hh]

                def regions(block_ids):
                    a, s = [], []
                    for g, bids in enumerate(block_ids):
                        if bids:
                            ga, gs = cache.layout.groups[g].regions(bids)
                            a += ga
                            s += gs
                    return a, s

                def direct_save(hs):
                    a, s = regions(src)
                    t = time.perf_counter()
                    codes = client.put_from_parts(dkeys(hs), a, s, timeout_s=None)
                    d = time.perf_counter() - t
                    assert all(c == 0 for c in codes), set(codes)
                    return d

                def direct_load(to, hs):
                    a, s = regions(to)
                    _sync()
                    t = time.perf_counter()
                    codes = client.get_into_parts(dkeys(hs), a, s, timeout_s=None)
                    d = time.perf_counter() - t
                    assert codes == obj_sizes, set(codes)
                    return d

                rawbufs = {
                    "host": torch.empty(nbytes, dtype=torch.uint8, pin_memory=dev.type == "cuda"),
                    "gpu": torch.empty(nbytes, dtype=torch.uint8, device=dev),
                }
                for b in rawbufs.values():
                    b.fill_(1)
                    client.register(b.data_ptr(), b.numel())
                offs = [0]
                for s in obj_sizes:
                    offs.append(offs[-1] + s)

                def raw_op(where, save, hs):
                    base = rawbufs[where].data_ptr()
                    keys = [f"raw-{where}-{h.hex()}" for hh in hs for h in hh]
                    addrs = [base + o for o in offs[:-1]]
                    t = time.perf_counter()
                    codes = (raw.batch_put_from if save else raw.batch_get_into)(
                        keys, addrs, obj_sizes
                    )
                    d = time.perf_counter() - t
                    assert all(c == 0 for c in codes) if save else list(codes) == obj_sizes, set(
                        codes
                    )
                    return d

                # ---- correctness (untimed): staged, direct, planted shift through each
                res = {}
                for path, save, load in (
                    ("staged", staged_save, staged_load),
                    ("direct", direct_save, direct_load),
                ):
                    hs = [
                        [random.Random(f"{path}{g}{i}").randbytes(32) for i in range(len(s))]
                        for g, s in enumerate(src)
                    ]
                    fill_random(cache, 11)
                    ref = block_bytes_ref(cache, src)
                    save(hs)
                    poison(cache)
                    load(dst, hs)
                    exp = expected_after(cache, ref, dst)
                    res[f"{path}_exact"] = bool(torch.equal(cache.buf, exp))
                    poison(cache)
                    load(shifted(dst, cache), hs)  # planted fault: one block one off
                    res[f"{path}_shift_detected"] = not bool(torch.equal(cache.buf, exp))
                    del ref, exp
                    raw.remove_all(True)
                checks.append({"scenario": name, "n": n, **res})
                print(f"store {name} n={n}: {res}", flush=True)

                # ---- timing: fresh keys per repeat (a put on an existing key is a no-op)
                times = {
                    k: []
                    for k in (
                        "staged_save",
                        "staged_load",
                        "direct_save",
                        "direct_load",
                        "raw_host_save",
                        "raw_host_load",
                        "raw_gpu_save",
                        "raw_gpu_load",
                    )
                }
                fill_random(cache, 12)
                for rep in range(args.warmup + args.repeats):
                    order = [
                        ("staged", staged_save, staged_load),
                        ("direct", direct_save, direct_load),
                        ("raw_host", None, None),
                        ("raw_gpu", None, None),
                    ]
                    order = order[rep % 4 :] + order[: rep % 4]
                    sample = {}
                    for path, save, load in order:
                        hs = [
                            [
                                random.Random(f"t{rep}{path}{g}{i}").randbytes(32)
                                for i in range(len(s))
                            ]
                            for g, s in enumerate(src)
                        ]
                        if save is None:
                            where = path.split("_")[1]
                            sample[f"{path}_save"] = raw_op(where, True, hs)
                            sample[f"{path}_load"] = raw_op(where, False, hs)
                        else:
                            sample[f"{path}_save"] = save(hs)
                            sample[f"{path}_load"] = load(dst, hs)
                    raw.remove_all(True)
                    if rep >= args.warmup:
                        for k, v in sample.items():
                            times[k].append(v)
                base = copy_baselines(nbytes, dev, args.repeats)
                row = {
                    "scenario": name,
                    "n": n,
                    "bytes": nbytes,
                    "objects": len(obj_sizes),
                    "object_bytes": sorted(set(obj_sizes)),
                    "regions_per_object": [
                        len(cache.layout.groups[g].block_bytes) for g in range(len(src))
                    ],
                    "times_s": {**times, **base},
                }
                rows.append(row)
                print(_store_line(row), flush=True)
                for b in rawbufs.values():
                    client.unregister(b.data_ptr())
                del rawbufs
            client.unregister(cache.buf.data_ptr())
            worker.shutdown()
            # The stagers' pinned buffers stay registered with the client (StoreWorker has no
            # unregister): keep them alive so no later allocation lands on a registered range.
            keep.append(worker)
            del cache
            torch.cuda.empty_cache()
        client.close()
    return {"store_rows": rows, "store_checks": checks}


def batch_bytes_est(sc: dict) -> int:
    kvc, _, _ = build_config(dict(sc, num_blocks=4))
    page = kvc.kv_cache_tensors[0].block_stride
    layers = max(g["layers"] for g in sc["groups"])
    return max(sc["batches"]) * page * layers


def _gbs(row, key):
    return row["bytes"] / _med(row["times_s"][key]) / 1e9


def _store_line(r) -> str:
    parts = [f"store {r['scenario']} n={r['n']} {r['bytes'] / 2**20:.0f} MiB"]
    for k in (
        "staged_save",
        "staged_load",
        "direct_save",
        "direct_load",
        "raw_host_save",
        "raw_host_load",
        "raw_gpu_save",
        "raw_gpu_load",
        "d2d",
        "d2h_pinned",
    ):
        parts.append(f"{k} {_gbs(r, k):.1f}")
    return " | ".join(parts) + " GB/s"


# ----------------------------------------------------------------------------- (b) P/D
def pd_prefill(conn, sc_name: str, device: str, sc: dict) -> None:
    """Prefill process: KV cache on GPU 0, random fill, PDTransport (VRAM) registered."""
    setup_imports()
    import torch

    import hybridkv.connector.pd_transport as pdt

    cache = make_cache(sc, torch.device(device))
    fill_random(cache, 21)
    _sync()
    tr = pdt.PDTransport(
        "prefill",
        cache.layout,
        memory=pdt.memory_space(torch.device(device).type, torch.device(device).index or 0),
    )
    conn.send((tr.metadata(), cache.layout.groups))
    conn.recv()
    tr.shutdown()
    conn.send("bye")


def pd_decode(setting: str, sc_name: str, sc: dict, args, q) -> None:
    """Decode process: same layout; hybridkv read_blocks vs raw NIXL READ, checks, D2D."""
    import multiprocessing as mp

    setup_imports()
    import torch

    import hybridkv.connector.pd_transport as pdt

    mem = pdt.memory_space(
        torch.device(args.device).type, torch.device(args.device).index or 0
    ).kind
    dev = torch.device(args.device)
    ctx = mp.get_context("spawn")
    a, b = ctx.Pipe()
    p = ctx.Process(target=pd_prefill, args=(b, sc_name, args.device, sc), daemon=True)
    p.start()
    meta, peer_groups = a.recv()
    cache = make_cache(sc, dev)
    ref_cache = make_cache(sc, dev)  # the prefill's bytes, regenerated from the same seed
    fill_random(ref_cache, 21)
    tr = pdt.PDTransport("decode", cache.layout, memory=pdt.memory_space(dev.type, dev.index or 0))
    peer = tr.add_peer(
        meta, peer_groups, tr.group_spaces
    )  # the prefill's cache is on the same device
    rawa = pdt._make_agent("raw", ["UCX"], 100)
    reg = rawa.register_memory(
        [(int(b_), int(n_), 0, "") for b_, n_ in cache.layout.allocations], mem
    )
    rpeer = rawa.add_remote_agent(meta)
    rng = random.Random(5)
    rows, checks = [], []
    slow = setting in SLOW_SETTINGS
    for n in sc["batches"][:1] if (slow or args.quick) else sc["batches"]:
        src, dst = pick_blocks(cache, n, rng)
        nbytes = batch_bytes(cache, src)

        def ours(r, lo):
            _sync()
            t = time.perf_counter()
            tr.wait(tr.read_blocks(peer, r, lo), 300.0)
            return time.perf_counter() - t

        def raw_read(r, lo):
            loc, rem = pdt.read_descriptors(cache.layout.groups, peer_groups, r, lo)
            ld, rd = rawa.get_xfer_descs(loc, mem), rawa.get_xfer_descs(rem, mem)
            _sync()
            t = time.perf_counter()
            h = rawa.initialize_xfer("READ", ld, rd, rpeer, b"")
            st = rawa.transfer(h)
            while st == "PROC":
                st = rawa.check_xfer_state(h)
            d = time.perf_counter() - t
            assert st == "DONE", st
            rawa.release_xfer_handle(h)
            return d

        ref = block_bytes_ref(ref_cache, src)
        res = {}
        for nm, fn in (("hybridkv", ours), ("raw", raw_read)):
            poison(cache)
            _sync()
            fn(src, dst)
            exp = expected_after(cache, ref, dst)
            res[f"{nm}_exact"] = bool(torch.equal(cache.buf, exp))
            if nm == "hybridkv":
                poison(cache)
                fn(src, shifted(dst, cache))
                res["hybridkv_shift_detected"] = not bool(torch.equal(cache.buf, exp))
            del exp
        del ref
        checks.append({"setting": setting, "scenario": sc_name, "n": n, **res})
        reps = 2 if slow else args.repeats
        t_ours, t_raw = [], []
        for i in range(args.warmup + reps):
            s2, d2 = pick_blocks(cache, n, rng)
            pair = (
                ((ours, t_ours), (raw_read, t_raw))
                if i % 2 == 0
                else ((raw_read, t_raw), (ours, t_ours))
            )
            for fn, acc in pair:
                d = fn(s2, d2)
                if i >= args.warmup:
                    acc.append(d)
        loc, _ = pdt.read_descriptors(cache.layout.groups, peer_groups, src, dst)
        row = {
            "setting": setting,
            "scenario": sc_name,
            "n": n,
            "bytes": nbytes,
            "descs": int(len(loc)),
            "desc_bytes": sorted({int(x) for x in loc[:, 1]}),
            "times_s": {
                "hybridkv_read": t_ours,
                "raw_read": t_raw,
                **copy_baselines(nbytes, dev, 5),
            },
        }
        rows.append(row)
        print(
            f"pd [{setting}] {sc_name} n={n} {nbytes / 2**20:.0f} MiB {len(loc)} descs: "
            f"hybridkv {_gbs(row, 'hybridkv_read'):.1f} raw {_gbs(row, 'raw_read'):.1f} "
            f"d2d {_gbs(row, 'd2d'):.0f} GB/s; checks {res}",
            flush=True,
        )
    tr.shutdown()
    rawa.remove_remote_agent(rpeer)
    rawa.deregister_memory(reg)
    a.send("stop")
    a.recv()
    p.join(20)
    q.put({"pd_rows": rows, "pd_checks": checks})


def run_pd(args) -> dict:
    import multiprocessing as mp

    out = {"pd_rows": [], "pd_checks": [], "pd_errors": []}
    ctx = mp.get_context("spawn")
    base_env = dict(os.environ)
    for setting, env in UCX_SETTINGS.items():
        for sc_name in SCENARIOS:
            if args.quick and sc_name != next(iter(SCENARIOS)):
                continue
            if setting in SLOW_SETTINGS and sc_name != next(iter(SCENARIOS)):
                continue
            os.environ.clear()
            os.environ.update(base_env)
            os.environ.update(env)
            os.environ.setdefault("UCX_NET_DEVICES", "lo")
            q = ctx.Queue()
            p = ctx.Process(target=pd_decode, args=(setting, sc_name, SCENARIOS[sc_name], args, q))
            p.start()
            try:
                r = q.get(timeout=240)
                out["pd_rows"] += r["pd_rows"]
                out["pd_checks"] += r["pd_checks"]
            except Exception as e:  # noqa: BLE001 - recorded, next setting still runs
                out["pd_errors"].append(f"{setting} / {sc_name}: {type(e).__name__} {e}")
                print("pd error:", out["pd_errors"][-1], flush=True)
            p.join(30)
            if p.is_alive():
                p.kill()
    os.environ.clear()
    os.environ.update(base_env)
    out["ucx_settings"] = UCX_SETTINGS
    return out


# ----------------------------------------------------------------------------- output
def _ratio(row, base, ours):
    return _med(row["times_s"][base]) / _med(row["times_s"][ours])


def _f(row, key):
    ts = row["times_s"][key]
    return f"{row['bytes'] / _med(ts) / 1e9:.1f}"


def markdown(doc: dict) -> str:
    m = doc["meta"]
    lines = [
        "# GPU data path on the H200: hybridkv worker code over vLLM-0.33-laid-out CUDA KV caches",
        "",
        f"- commands: `{m.get('commands', '')}`; device: {m.get('device', '?')}; torch {m.get('torch', '?')}; "
        f"dates: {m.get('dates', '?')}",
        f"- wheels on the device: {m.get('wheels', '?')}; vLLM: {m.get('vllm', '?')}; shim: {m.get('shim') or 'none'}",
        f"- hybridkv commit: {m.get('commit', '?')}",
        "",
        "How it is measured: see the docstring of bench/gpu_data_path.py (scenarios, paths, baselines, checks).",
        "GB/s = payload bytes / wall time, median of the timed repeats. Ratios = baseline median time / "
        "hybridkv median time (>1: hybridkv faster).",
        "",
    ]
    sc_rows = doc.get("scenarios", {})
    if sc_rows:
        lines += [
            "## Layouts (views from vLLM 0.33's create_kv_cache_views; hybridkv's KVLayout of them)",
            "",
            "| scenario | group | layer view shape | stride | kernel rows / manager block | regions per object | object bytes |",
            "|---|---|---|---|---|---|---|",
        ]
        for s in sc_rows:
            lines.append(
                f"| {s['scenario']} | {s['group']} | {s['shape']} | {s['stride']} | {s['kernel_rows']} | "
                f"{s['regions']} | {s['object_bytes']} |"
            )
        lines.append("")
    sr = doc.get("store_rows", [])
    if sr:
        lines += [
            "## (a) Store: staged (StoreWorker + BlockStager) and GPU-direct (register_buffer on the CUDA "
            "allocation) vs raw Mooncake of the same bytes, D2D, pinned D2H/H2D",
            "",
            "| scenario | blocks | MiB | op | staged GB/s | direct GB/s | raw Mooncake host GB/s | raw Mooncake GPU GB/s "
            "| D2D GB/s | pinned D2H/H2D GB/s | **staged / raw host** | **direct / raw GPU** | staged / pinned copy | direct / D2D |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for r in sr:
            for op, pin in (("save", "d2h_pinned"), ("load", "h2d_pinned")):
                lines.append(
                    f"| {r['scenario']} | {r['n']} | {r['bytes'] / 2**20:.0f} | {op} | {_f(r, 'staged_' + op)} | "
                    f"{_f(r, 'direct_' + op)} | {_f(r, 'raw_host_' + op)} | {_f(r, 'raw_gpu_' + op)} | {_f(r, 'd2d')} | "
                    f"{_f(r, pin)} | **{_ratio(r, 'raw_host_' + op, 'staged_' + op):.2f}** | "
                    f"**{_ratio(r, 'raw_gpu_' + op, 'direct_' + op):.2f}** | {_ratio(r, pin, 'staged_' + op):.3f} | "
                    f"{_ratio(r, 'd2d', 'direct_' + op):.4f} |"
                )
        lines.append("")
        lines.append(
            "Store checks (poisoned target, whole allocation compared; planted one-block shift):"
        )
        lines.append("")
        for c in doc.get("store_checks", []):
            lines.append(
                f"- {c['scenario']} n={c['n']}: "
                + ", ".join(f"{k}={v}" for k, v in c.items() if k not in ("scenario", "n"))
            )
        lines.append("")
    pr = doc.get("pd_rows", [])
    if pr:
        lines += [
            "## (b) P/D READ VRAM -> VRAM, two processes, one GPU: PDTransport.read_blocks vs raw NIXL (same descriptors)",
            "",
            "| UCX setting | scenario | blocks | MiB | descriptors x bytes | hybridkv GB/s | raw NIXL GB/s | D2D GB/s "
            "| **hybridkv / raw NIXL** | hybridkv / D2D | pinned D2H GB/s |",
            "|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for r in pr:
            lines.append(
                f"| {r['setting']} | {r['scenario']} | {r['n']} | {r['bytes'] / 2**20:.0f} | {r['descs']} x "
                f"{'/'.join(str(b >> 10) + ' KiB' for b in r['desc_bytes'])} | {_f(r, 'hybridkv_read')} | "
                f"{_f(r, 'raw_read')} | {_f(r, 'd2d')} | **{_ratio(r, 'raw_read', 'hybridkv_read'):.2f}** | "
                f"{_ratio(r, 'd2d', 'hybridkv_read'):.3f} | {_f(r, 'd2h_pinned')} |"
            )
        lines += [
            "",
            "UCX settings: "
            + "; ".join(
                f"{k}: {v or '(nothing set)'}" for k, v in doc.get("ucx_settings", {}).items()
            ),
            "",
            "P/D checks (poisoned target, whole allocation compared; planted one-block shift):",
            "",
        ]
        for c in doc.get("pd_checks", []):
            lines.append(
                f"- [{c['setting']}] {c['scenario']} n={c['n']}: "
                + ", ".join(
                    f"{k}={v}" for k, v in c.items() if k not in ("setting", "scenario", "n")
                )
            )
        for e in doc.get("pd_errors", []):
            lines.append(f"- ERROR {e}")
        lines.append("")
    if doc.get("notes"):
        lines += ["## Notes", ""] + [f"- {n}" for n in doc["notes"]] + [""]
    return "\n".join(lines)


def plot(doc: dict, path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    sr, pr = doc.get("store_rows", []), doc.get("pd_rows", [])
    fig, axes = plt.subplots(1, 2, figsize=(15, 6.5))
    if sr:
        ax = axes[0]
        labels, series = (
            [],
            {k: [] for k in ("staged", "direct", "raw_host", "raw_gpu", "pinned copy")},
        )
        for r in sr:
            for op, pin in (("save", "d2h_pinned"), ("load", "h2d_pinned")):
                labels.append(f"{r['scenario'].split(' (')[0][:18]}\nn={r['n']} {op}")
                for k in ("staged", "direct", "raw_host", "raw_gpu"):
                    series[k].append(r["bytes"] / _med(r["times_s"][f"{k}_{op}"]) / 1e9)
                series["pinned copy"].append(r["bytes"] / _med(r["times_s"][pin]) / 1e9)
        w = 0.16
        for j, (k, v) in enumerate(series.items()):
            ax.bar([i + (j - 2) * w for i in range(len(labels))], v, w, label=k)
        ax.set_xticks(range(len(labels)), labels, fontsize=6, rotation=70, ha="right")
        ax.set_yscale("log")
        ax.set_ylabel("GB/s (log)")
        ax.set_title(
            "(a) store: hybridkv staged / GPU-direct vs raw Mooncake, pinned copy", fontsize=9
        )
        ax.legend(fontsize=7)
        ax.grid(axis="y", alpha=0.3)
    if pr:
        ax = axes[1]
        labels = [f"{r['setting']}\n{r['scenario'].split(' (')[0][:18]} n={r['n']}" for r in pr]
        for j, (k, lab) in enumerate(
            (
                ("hybridkv_read", "hybridkv read_blocks"),
                ("raw_read", "raw NIXL READ"),
                ("d2d", "D2D copy"),
            )
        ):
            ax.bar(
                [i + (j - 1) * 0.27 for i in range(len(pr))],
                [r["bytes"] / _med(r["times_s"][k]) / 1e9 for r in pr],
                0.27,
                label=lab,
            )
        ax.set_xticks(range(len(pr)), labels, fontsize=6, rotation=70, ha="right")
        ax.set_yscale("log")
        ax.set_ylabel("GB/s (log)")
        ax.set_title("(b) P/D READ VRAM->VRAM, 2 processes, 1 H200", fontsize=9)
        ax.legend(fontsize=7)
        ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return True


def layout_summary() -> list[dict]:
    """Per scenario and group: a layer view and what hybridkv's KVLayout made of it (CPU, meta)."""
    import torch

    out = []
    for name, sc in SCENARIOS.items():
        cache = make_cache(sc, torch.device("cpu"), num_blocks=8)
        for gid, g in enumerate(cache.kvc.kv_cache_groups):
            v = cache.views[g.layer_names[0]]
            gl = cache.layout.groups[gid]
            out.append(
                {
                    "scenario": name,
                    "group": f"{gid} {type(g.kv_cache_spec).__name__} bs "
                    f"{g.kv_cache_spec.block_size}",
                    "shape": str(tuple(v.shape)).replace(" ", ""),
                    "stride": str(v.stride()).replace(" ", ""),
                    "kernel_rows": gl.kernel_rows[0] if gl.kernel_rows else "?",
                    "regions": len(gl.block_bytes),
                    "object_bytes": gl.object_bytes,
                }
            )
        del cache
    return out


def check_vllm() -> int:
    """``--check-vllm``: every scenario's layout == vLLM's own (CPU, vLLM with its config stack)."""
    return kv_views.check_vllm(SCENARIOS)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--part", choices=("store", "pd"))
    ap.add_argument("--out", type=Path)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--device", default="cuda", help="cpu: smoke-test the store part here (no GPU)")
    ap.add_argument(
        "--smoke", action="store_true", help="tiny caches (40 blocks, batches of 8), 1 repeat"
    )
    ap.add_argument(
        "--render", nargs="*", type=Path, help="merge part JSONs into bench/results/gpu_data_path.*"
    )
    ap.add_argument("--check-vllm", action="store_true")
    args = ap.parse_args()
    setup_imports()
    if args.check_vllm:
        return check_vllm()
    if args.render is not None:
        doc = {"meta": {}}
        for p in args.render:
            part = json.loads(Path(p).read_text())
            for k, v in part.items():
                if k == "meta":
                    for mk, mv in v.items():
                        doc["meta"].setdefault(mk, [])
                        if mv not in doc["meta"][mk]:
                            doc["meta"][mk].append(mv)
                else:
                    doc[k] = doc.get(k, []) + v if isinstance(v, list) else v
        doc["meta"] = {k: "; ".join(map(str, v)) for k, v in doc["meta"].items()}
        doc["scenarios"] = layout_summary()
        notes = Path(ROOT / "bench" / "results" / "gpu_data_path.notes.json")
        if notes.exists():
            doc["notes"] = json.loads(notes.read_text())
        res = ROOT / "bench" / "results"
        (res / "gpu_data_path.json").write_text(json.dumps(doc, indent=1))
        (res / "gpu_data_path.md").write_text(markdown(doc))
        print(markdown(doc))
        print("plot:", plot(doc, res / "gpu_data_path.png"))
        return 0
    import torch

    if args.device != "cpu" and not torch.cuda.is_available():
        raise SystemExit("needs a CUDA GPU")
    if args.smoke:
        for sc in SCENARIOS.values():
            sc.update(num_blocks=40, batches=(8,))
        args.repeats = 1
    t0 = time.time()
    doc = run_store(args) if args.part == "store" else run_pd(args)
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

    def ver(d):
        try:
            return md.version(d)
        except md.PackageNotFoundError:
            return "-"

    doc["meta"] = {
        "commands": f"python bench/gpu_data_path.py --part {args.part}"
        + (" --quick" if args.quick else ""),
        "device": f"{torch.cuda.get_device_name(0) if args.device != 'cpu' else 'CPU'} (kernel {platform.release()})",
        "torch": f"{torch.__version__} CUDA {torch.version.cuda}",
        "dates": dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "wheels": ", ".join(
            f"{d} {ver(d)}"
            for d in ("nixl-cu13", "nixl", "mooncake-transfer-engine-cuda13", "isal")
            if ver(d) != "-"
        ),
        "vllm": "0.33 kv_cache_interface from "
        + sys.modules["vllm"].__file__.replace(str(ROOT) + "/", ""),
        "shim": ", ".join(SHIM),
        "commit": commit,
        "addressing_files_sha1": {
            f: __import__("hashlib").sha1((ROOT / f).read_bytes()).hexdigest()[:10]
            for f in (
                "connector/block_layout.py",
                "connector/block_staging.py",
                "connector/pd_transport.py",
                "connector/store_worker.py",
            )
        },
        "wall_s": round(time.time() - t0),
    }
    out = args.out or Path(os.environ.get("OUT", "."))
    out.mkdir(parents=True, exist_ok=True)
    (out / f"gpu_data_path.{args.part}.json").write_text(json.dumps(doc, indent=1))
    bad = [
        c
        for c in doc.get("store_checks", []) + doc.get("pd_checks", [])
        if not all(v for k, v in c.items() if k.endswith(("_exact", "_detected")))
    ]
    print(
        "checks:",
        "all passed" if not bad else f"FAILED {bad}",
        f"({time.time() - t0:.0f} s)",
        flush=True,
    )
    return 1 if bad or doc.get("pd_errors") else 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    os.environ.setdefault("GLOG_minloglevel", "2")
    sys.exit(main())
