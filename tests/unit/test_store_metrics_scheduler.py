"""The REAL StoreScheduler counts one decision per request, exact counts.

Real KVCacheManager, real mooncake_master, the grants geometry (full attention 16,
sliding window 16/64, Mamba align 64). Needs the RequestLedger wiring in
store_scheduler.py (lead's patch); fails on the per-call counting before it.
"""

from __future__ import annotations

import numpy as np
import pytest
from vllm.v1.outputs import KVConnectorOutput

from hybridkv.cli.harness.kv_manager import make_request
from hybridkv.connector.store_config import StoreConnectorConfig
from hybridkv.connector.store_scheduler import StoreScheduler
from hybridkv.store.embedded_master import EmbeddedMaster
from hybridkv.store.keys import KeySchema
from hybridkv.store.mooncake_backend import MooncakeBackend
from tests.unit.test_store_scheduler_grants import GEO, OFFER, TOKENS


@pytest.fixture(scope="module")
def stored():
    with (
        EmbeddedMaster() as master,
        MooncakeBackend(master.address, global_segment_size=64 << 20) as client,
    ):
        schema = KeySchema.create("metrics", "bf16", [{"g": 3}])
        manager = GEO.manager()
        sched = StoreScheduler(
            StoreConnectorConfig(lookup_cache_s=30), schema, client, world_size=2
        )
        sched.bind(manager)
        buf = np.zeros(64, dtype=np.uint8)
        client.register(int(buf.ctypes.data), buf.nbytes)
        req = make_request(GEO, TOKENS)
        missing = (2, req.block_hashes[528 // 16 - 1])  # no Mamba state at 528
        keys = [
            schema.key(g, h)
            for g, h in sched._mirror.probe_keys(req.block_hashes, req.num_tokens - 1, 0)
            if (g, h) != missing
        ]
        assert client.put_from(keys, [int(buf.ctypes.data)] * len(keys), [64] * len(keys)) == [
            0
        ] * len(keys)
        yield sched, manager


def _run(sched, manager, granted: int, asks: int = 3, failed: bool = False) -> dict:
    sched.take_stats()
    req = make_request(GEO, TOKENS)
    for _ in range(asks):  # re-asks while the request cannot be admitted
        assert sched.get_num_new_matched_tokens(req, 0) == (OFFER, True)
    blocks = manager.allocate_slots(
        req, 0, num_external_computed_tokens=granted, delay_cache_blocks=True
    )
    assert blocks is not None
    sched.update_state_after_alloc(req, manager.get_blocks(req.request_id), granted)
    sched._loads.clear()
    rid = req.request_id
    # Two workers (TP=2) report through vLLM's aggregated output: a set per request.
    sched.update_connector_output(
        KVConnectorOutput(finished_recving={rid}, failed_recving={rid} if failed else set())
    )
    sched.request_finished(req)
    manager.free(req)
    stats = sched.take_stats()
    return {
        k: v
        for k, v in (stats.data if stats else {}).items()
        if k in ("lookups", "query_tokens", "lookup_hits", "hit_tokens", "failed_loads")
        or k.startswith("hit_tokens.g")
    }


def test_a_hit_granted_fewer_counts_once_with_the_tokens_each_group_covers(stored):
    assert _run(*stored, granted=512) == {
        "lookups": 1,
        "query_tokens": 1000,
        "lookup_hits": 1,
        "hit_tokens": 512,
        "hit_tokens.g0": 512,
        "hit_tokens.g1": 64,
        "hit_tokens.g2": 512,  # ONE state stands for 512
    }


def test_a_refused_grant_is_one_failed_load_and_no_hit(stored):
    assert _run(*stored, granted=528) == {"lookups": 1, "query_tokens": 1000, "failed_loads": 1}


def test_a_failed_load_is_one_failed_load_and_no_hit(stored):
    assert _run(*stored, granted=OFFER, failed=True) == {
        "lookups": 1,
        "query_tokens": 1000,
        "failed_loads": 1,
    }
