"""What the store connector's pins promise vLLM's scheduler, through a REAL ``Scheduler``.

- A ``kv_consumer`` store (the decode side's child in a P/D + store ``MultiConnector``) never
  sends save jobs, so it must plan and pin none: pins no worker acknowledges would grow to
  ``max_pinned_save_fraction`` of the cache, keep ``has_pending_block_frees()`` (vLLM then never
  preempts) and ``has_pending_push_work()`` (an idle engine keeps stepping) True, and make
  ``reset_prefix_cache`` fail for good.
- ``has_pending_block_frees()`` is True only while some block is held by pins alone (a free is
  then really pending); a pinned block that a running request also holds frees nothing when
  its save ends, so vLLM must preempt instead of waiting.
- ``reset_cache()`` (``reset_prefix_cache(reset_connector=True)``) means it: nothing stored
  before the reset is loaded by this engine after it (its keys move to a new generation).
"""

from __future__ import annotations

import random

from hybridkv.cli.harness.kv_manager import Geometry, fa, mamba, sw
from tests.unit.test_real_scheduler import UNIT, _request, _run_to_completion, _scheduler, store  # noqa: F401

GEO = Geometry(
    specs=[fa(16), sw(16, 64), mamba(64)], hash_block_size=UNIT, num_blocks=200, max_model_len=4096
)


def _prompt(seed: int) -> list[int]:
    return random.Random(seed).choices(range(3, 30000), k=1000)


def test_a_consumer_store_plans_no_saves_and_pins_nothing(store):
    sched = _scheduler(GEO, store[0], store[3], "consumer-pins", role="kv_consumer")
    conn = sched.connector._scheduler
    for i in range(2):
        jobs: list = []
        _run_to_completion(sched, _request(f"consumer-{i}", _prompt(300 + i)), jobs=jobs, ack=False)
        assert jobs == []
    assert conn._pins == {} and conn._pinned_save_blocks == 0
    assert not sched.connector.has_pending_block_frees()
    assert not sched.connector.has_pending_push_work()
    assert sched.reset_prefix_cache()


def test_pending_block_frees_only_when_a_pin_alone_holds_a_block(store):
    """A request running: its blocks are pinned by a save no worker acknowledged yet, and it
    still holds them, so no free is pending. Once it finishes, the pins alone hold them."""
    sched = _scheduler(GEO, store[0], store[3], "pending-frees")
    req = _request("frees-a", _prompt(400))
    sched.add_request(req)
    sched.add_request(_request("reset-new", _prompt(83)))
    out = sched.schedule()
    assert out.kv_connector_metadata.saves, "the first chunk's full blocks are saved"
    conn = sched.connector._scheduler
    assert conn._pins
    assert not sched.connector.has_pending_block_frees()
    sched.finish_requests(
        req.request_id,
        __import__("vllm.v1.request", fromlist=["RequestStatus"]).RequestStatus.FINISHED_ABORTED,
    )
    assert sched.connector.has_pending_block_frees()
    assert sched.connector.has_pending_push_work()


def test_reset_means_nothing_stored_before_is_loaded_again(store):
    """``reset_prefix_cache(reset_connector=True)`` (a weight update; ``pause`` with
    ``clear_cache``): the store held this prompt's prefix and served it; after the reset the
    same prompt gets no store hit, a save planned before the reset still names the old keys
    (it holds KV of the old weights), new jobs name the new ones, and objects saved under the
    new keys are served again."""
    from tests.unit.test_real_scheduler import _fill_for

    geo = Geometry(
        specs=[fa(16), sw(16, 64)], hash_block_size=UNIT, num_blocks=600, max_model_len=4096
    )
    sched = _scheduler(geo, store[0], store[3], "reset-generation", policy="recompute")
    conn = sched.connector._scheduler
    prompt = random.Random(81).choices(range(3, 30000), k=300)
    before = _request("reset-before", prompt)
    _fill_for(sched, store, before, 288)
    conn.on_new_request(before)
    assert conn.get_num_new_matched_tokens(before, 0) == (288, True)
    running = _request("reset-running", _prompt(82))
    sched.add_request(running)
    planned = sched.schedule().kv_connector_metadata.saves
    assert planned and {j.blocks.generation for j in planned} == {0}

    assert (
        sched.reset_connector_cache() is True
    )  # vLLM's call for reset_prefix_cache(reset_connector=True)
    after = _request("reset-after", prompt)
    conn.on_new_request(after)
    assert conn.get_num_new_matched_tokens(after, 0) == (0, False)
    assert {j.blocks.generation for j in planned} == {0}
    sched.add_request(_request("reset-new", _prompt(83)))
    out = sched.schedule()
    assert out.kv_connector_metadata.saves and {
        j.blocks.generation for j in out.kv_connector_metadata.saves
    } == {1}
    _fill_for(sched, store, after, 288)  # the new generation's objects, as its workers save them
    again = _request("reset-again", prompt)
    conn.on_new_request(again)
    assert conn.get_num_new_matched_tokens(again, 0) == (288, True)


def test_a_refused_load_with_no_blocks_still_owes_its_deferral(store):
    """A load job refused before any block was added (here: no block allocated where the hit's
    first object goes) is reported failed like any other of this connector's loads, so it owes
    the one skipped admission that keeps loads failing together from stalling vLLM
    (connector/failed_loads.py): ``get_num_new_matched_tokens`` answers None once, then 0."""
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.outputs import KVConnectorOutput

    from tests.unit.test_real_scheduler import _fill_for

    geo = Geometry(
        specs=[fa(16), sw(16, 64)], hash_block_size=UNIT, num_blocks=200, max_model_len=4096
    )
    sched = _scheduler(geo, store[0], store[3], "refused-empty", policy="recompute")
    conn = sched.connector._scheduler
    req = _request("refused-empty-0", random.Random(79).choices(range(3, 30000), k=300))
    _fill_for(sched, store, req, 288)
    conn.on_new_request(req)
    assert conn.get_num_new_matched_tokens(req, 0) == (288, True)
    null = sched.kv_cache_manager.block_pool.null_block
    conn.update_state_after_alloc(req, KVCacheBlocks(tuple([null] * 18 for _ in range(2))), 288)
    (job,) = conn._loads
    assert job.refused == "no block allocated for group 0 position 0" and not job.blocks
    conn.update_connector_output(
        KVConnectorOutput(finished_recving={req.request_id}, failed_recving={req.request_id})
    )
    assert conn.get_num_new_matched_tokens(req, 0) == (None, False)
    assert conn.get_num_new_matched_tokens(req, 0) == (0, False)
