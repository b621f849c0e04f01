"""A diverged local hit that the store cannot extend must not cost the whole hit.

The local cache keeps a prompt's full-attention blocks but has evicted its
sliding-window tail (freed first when the request ended); the store holds both.
vLLM 0.32 asks the connector once, with the diverged length, and when the answer
is 0 falls back to the convergent local hit and loads NOTHING: in the agentic
replay 5 of 126 later turns got no hit at all that way. The installed lookup
must instead fall back itself, so the store is asked from the convergent length.
Oracle: vLLM's real KVCacheManager holding the union of local and store contents.
Real KVCacheManager, real mooncake_master.
"""

from __future__ import annotations

import random

import numpy as np
import pytest

from hybridkv.cli.harness.kv_manager import Geometry, cached_keys, fa, make_request, run_prefill, sw
from hybridkv.connector.store_config import StoreConnectorConfig
from hybridkv.connector.store_scheduler import StoreScheduler
from hybridkv.store.embedded_master import EmbeddedMaster
from hybridkv.store.keys import KeySchema
from hybridkv.store.mooncake_backend import MooncakeBackend

GEO = Geometry(specs=[fa(16), sw(16, 64)], hash_block_size=16, num_blocks=400, max_model_len=4096)
SW_GROUP = 1


@pytest.fixture()
def store():
    with (
        EmbeddedMaster() as master,
        MooncakeBackend(master.address, global_segment_size=64 << 20) as client,
    ):
        buf = np.zeros(64, dtype=np.uint8)
        client.register(int(buf.ctypes.data), buf.nbytes)
        yield client, buf


def _put(client, schema: KeySchema, buf, keys) -> None:  # noqa: ANN001
    names = [schema.key(g, h) for g, h in keys]
    assert client.put_from(names, [int(buf.ctypes.data)] * len(names), [64] * len(names)) == [
        0
    ] * len(names)


def _local_with_window_tail_evicted(tokens: list[int]):
    """A manager that ran ``tokens``, then lost the window's last block; and what it held before."""
    manager = GEO.manager()
    req = run_prefill(manager, GEO, tokens, free=False)
    blocks = manager.coordinator.get_blocks(req.request_id)
    manager.free(req)
    held = cached_keys(manager)
    tail = blocks[SW_GROUP][len(tokens) // 16 - 1]  # the window's last FULL block
    assert not tail.is_null and tail.block_hash is not None
    manager.evict_blocks({tail.block_id})
    return manager, held


def _union_oracle(tokens: list[int], query: list[int]) -> int:
    """vLLM's own hit for ``query`` on a manager holding everything ``tokens`` left."""
    manager = GEO.manager()
    run_prefill(manager, GEO, tokens)
    return manager.get_computed_blocks(make_request(GEO, query))[1]


def _admitted_hit(manager, sched: StoreScheduler, query: list[int]) -> tuple[int, int, bool]:  # noqa: ANN001
    """What the scheduler would admit: (local, external, diverged), as vLLM 0.32 decides it."""
    req = make_request(GEO, query)
    sched.on_new_request(req)
    _, local, _, diverged = manager.get_computed_blocks_for_connector(req)
    aligned = local - local % GEO.scheduler_block_size
    ext, _ = sched.get_num_new_matched_tokens(req, aligned)
    if diverged and ext == 0:  # vLLM's fallback: the convergent hit, nothing loaded
        local = manager.get_computed_blocks(req)[1]
    return local, ext, diverged


def test_store_serves_the_hit_when_it_holds_exactly_the_diverged_length(store):
    client, buf = store
    tokens = random.Random(1).choices(range(3, 30000), k=300)
    query = tokens + random.Random(2).choices(range(3, 30000), k=200)
    manager, held = _local_with_window_tail_evicted(tokens)
    schema = KeySchema.create("diverged-exact", "bf16", [{"g": 2}])
    _put(client, schema, buf, held)  # the store got every block the request computed
    sched = StoreScheduler(StoreConnectorConfig(), schema, client, world_size=1)
    sched.bind(manager)

    want = _union_oracle(tokens, query)
    assert want == 288  # 300 tokens -> 18 full blocks of 16
    convergent = manager.get_computed_blocks(make_request(GEO, query))[1]
    assert convergent < want, "the eviction must leave the local hit diverged"
    local, ext, diverged = _admitted_hit(manager, sched, query)
    assert not diverged, "a diverged hit the store cannot extend must not be reported"
    assert local == convergent and local + ext == want


def test_a_diverged_hit_the_store_extends_is_kept(store):
    client, buf = store
    tokens = random.Random(3).choices(range(3, 30000), k=300)
    longer = tokens + random.Random(4).choices(range(3, 30000), k=200)
    query = longer + [5, 6, 7]
    manager, _ = _local_with_window_tail_evicted(tokens)
    other = GEO.manager()
    run_prefill(other, GEO, longer)  # another instance ran the longer prompt and saved it
    schema = KeySchema.create("diverged-extended", "bf16", [{"g": 2}])
    _put(client, schema, buf, cached_keys(other))
    sched = StoreScheduler(StoreConnectorConfig(), schema, client, world_size=1)
    sched.bind(manager)

    local, ext, diverged = _admitted_hit(manager, sched, query)
    assert diverged and local == 288, "the local full-attention prefix is kept (not re-loaded)"
    assert local + ext == _union_oracle(longer, query) == 496
