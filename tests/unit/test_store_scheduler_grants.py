"""The store scheduler when vLLM grants fewer external tokens than it offered.

Under MultiConnector a child is asked for its hit and then not chosen
(``update_state_after_alloc`` with 0), and the scheduler may grant fewer tokens
than offered. Real KVCacheManager, real mooncake_master, a hybrid geometry
(full attention 16, sliding window 16/64, Mamba align 64): the load job must
cover exactly the granted tokens with state at the granted boundary, or be
refused (the request then recomputes) when the store holds no state there.
"""

from __future__ import annotations

import random

import numpy as np
import pytest
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import init_none_hash
from vllm.v1.kv_cache_interface import get_mamba_prefill_checkpoint_position

from hybridkv.cli.harness.kv_manager import Geometry, fa, make_request, mamba, sw
from hybridkv.connector.store_config import StoreConnectorConfig
from hybridkv.connector.store_scheduler import StoreScheduler
from hybridkv.store.embedded_master import EmbeddedMaster
from hybridkv.store.keys import KeySchema
from hybridkv.store.mooncake_backend import MooncakeBackend

GEO = Geometry(
    specs=[fa(16), sw(16, 64), mamba(64)], hash_block_size=16, num_blocks=600, max_model_len=4096
)
TOKENS = random.Random(5).choices(range(3, 30000), k=1000)
# vLLM's own answer for the deepest state a 1000-token prompt can hit (hash unit 16): 992.
OFFER = get_mamba_prefill_checkpoint_position(len(TOKENS), 16, False)


@pytest.fixture(scope="module")
def stored():
    """A scheduler bound to a real manager, and a store holding every object of TOKENS."""
    init_none_hash(sha256)
    with (
        EmbeddedMaster() as master,
        MooncakeBackend(master.address, global_segment_size=64 << 20) as client,
    ):
        schema = KeySchema.create("grants", "bf16", [{"g": 3}])
        manager = GEO.manager()
        sched = StoreScheduler(StoreConnectorConfig(lookup_cache_s=0), schema, client, world_size=1)
        sched.bind(manager)
        buf = np.zeros(64, dtype=np.uint8)
        client.register(int(buf.ctypes.data), buf.nbytes)
        req = make_request(GEO, TOKENS)
        # Every object a lookup may probe, except the Mamba state at token 528.
        missing = (2, req.block_hashes[528 // 16 - 1])
        keys = [
            schema.key(g, h)
            for g, h in sched._mirror.probe_keys(req.block_hashes, req.num_tokens - 1, 0)
            if (g, h) != missing
        ]
        assert client.put_from(keys, [int(buf.ctypes.data)] * len(keys), [64] * len(keys)) == [
            0
        ] * len(keys)
        yield sched, manager


def _admit(sched: StoreScheduler, manager, granted: int):
    """Lookup, then allocate and notify like vLLM's scheduler does for an async load."""
    req = make_request(GEO, TOKENS)
    offered, load_async = sched.get_num_new_matched_tokens(req, 0)
    n_jobs = len(sched._loads)
    if granted:  # an async load: nothing to compute this step
        blocks = manager.allocate_slots(
            req, 0, num_external_computed_tokens=granted, delay_cache_blocks=True
        )
    else:  # not chosen: the request prefills normally
        blocks = manager.allocate_slots(req, 256)
    assert blocks is not None
    sched.update_state_after_alloc(req, manager.get_blocks(req.request_id), granted)
    job = sched._loads[-1] if len(sched._loads) > n_jobs else None
    assert req.request_id not in sched._plans, "the plan must not outlive the allocation"
    sched._loads.clear()
    manager.free(req)
    return offered, load_async, job


def _tokens_per_group(job) -> dict[int, int]:
    out: dict[int, int] = {}
    for gid in job.blocks.group_ids:
        out[gid] = out.get(gid, 0) + 1
    return out


def test_granted_all_loads_every_group_up_to_the_offer(stored):
    sched, manager = stored
    offered, load_async, job = _admit(sched, manager, granted=OFFER)
    assert (offered, load_async) == (OFFER, True)
    assert job is not None and job.refused is None
    per_group = _tokens_per_group(job)
    assert per_group[0] == OFFER // 16  # every full-attention block
    assert per_group[1] == 64 // 16  # the window tail only
    assert per_group[2] == 1  # one Mamba state, at the offer


def test_granted_fewer_at_a_checkpoint_loads_state_at_the_granted_boundary(stored):
    sched, manager = stored
    offered, _, job = _admit(sched, manager, granted=512)
    assert offered == OFFER
    assert job is not None and job.refused is None
    assert _tokens_per_group(job) == {0: 512 // 16, 1: 64 // 16, 2: 1}


def test_granted_fewer_where_no_state_exists_is_refused_not_guessed(stored):
    sched, manager = stored
    _, _, job = _admit(
        sched, manager, granted=528
    )  # a full-attention boundary, no Mamba state at 528
    assert job is not None and job.refused is not None and "528" in job.refused
    assert not job.blocks


def test_queried_and_not_chosen_leaves_no_job_and_no_plan(stored):
    sched, manager = stored
    offered, _, job = _admit(sched, manager, granted=0)
    assert offered == OFFER and job is None


def test_a_local_dense_prefix_is_extended_with_state_from_the_store(stored):
    """The divergent local hit: the local cache holds full-attention blocks to 512 but the
    window/Mamba state there is gone. The scheduler passes 512; the store must supply the
    rest and the sparse state at the NEW end (never claim a hit without state), without
    re-probing or re-loading the local full-attention prefix."""
    sched, _ = stored
    req = make_request(GEO, TOKENS)
    offered, load_async = sched.get_num_new_matched_tokens(req, 512)
    assert (offered, load_async) == (OFFER - 512, True)
    plan = sched._plans.pop(req.request_id)
    fa_positions = [idx for idx, _ in plan.hit.blocks[0]]
    assert fa_positions == list(range(OFFER // 16))  # the local ones are skipped at load time
    local = set(req.block_hashes[: 512 // 16])
    assert not any(g == 0 and h in local for g, h in plan.found), (
        "the local dense prefix was probed"
    )
    # One Mamba state, keyed by the hash unit ending at the new end (in its 64-token block).
    assert [(idx, h) for idx, (_, h) in plan.hit.blocks[2]] == [
        ((OFFER - 1) // 64, req.block_hashes[OFFER // 16 - 1])
    ]
    assert all(idx >= (OFFER - 64) // 16 for idx, _ in plan.hit.blocks[1])  # window tail only
    sched._recent_lookups.clear()
