"""The prefill's lease budget counts physical blocks: leases of requests sharing one long
system prompt hold its blocks once, and count once.

Real parts: vLLM's ``Scheduler`` and ``KVCacheManager`` with HybridPDConnector loaded as
EngineCore builds them (tests/unit/pd_real_scheduler.py); the shared prefix is a real
prefix-cache hit, so the requests' block lists name the same blocks.
"""

from __future__ import annotations

from hybridkv.cli.harness.kv_manager import Geometry, fa
from hybridkv.connector.pd_auth import write_secret_file
from hybridkv.connector.pd_metadata import PDHandshakeMetadata, PDWorkerMetadata
from tests.unit.pd_real_scheduler import model_dir, pd_request, pd_scheduler, worker_reply  # noqa: F401

BLOCK = 16
NUM_BLOCKS = 64  # budget: max_lease_fraction 0.5 -> 32 blocks
SYSTEM = list(range(1000, 1000 + 8 * BLOCK))  # 8 shared blocks


def _hand_over(sched, rid: str, prompt: list[int]) -> dict | None:  # noqa: ANN001
    sched.add_request(pd_request(rid, prompt, {"do_remote_decode": True}, BLOCK))
    out = sched.schedule()
    outputs = sched.update_from_output(
        out,
        worker_reply(
            out,
            {r: [7] for r in out.num_scheduled_tokens},
            kv_connector_worker_meta=PDWorkerMetadata({}),
        ),
    )
    done = [o for eo in outputs.values() for o in eo.outputs if o.request_id == rid]
    assert len(done) == 1
    return done[0].kv_transfer_params


def _scheduler(model_dir, tmp_path):  # noqa: ANN001, ANN202
    geo = Geometry([fa(BLOCK)], hash_block_size=BLOCK, num_blocks=NUM_BLOCKS, max_model_len=4096)
    sched = pd_scheduler(
        model_dir, "kv_producer", geo, str(write_secret_file(tmp_path / "s")), max_num_seqs=4
    )
    sched.connector.set_xfer_handshake_metadata({0: PDHandshakeMetadata("127.0.0.1", 45678, 0)})
    return sched


def test_shared_prefix_blocks_count_once(model_dir, tmp_path):  # noqa: F811
    sched = _scheduler(model_dir, tmp_path)
    handed = []
    for i in range(6):  # 8 shared + 2 own blocks each: 60 per lease summed, 20 physical
        params = _hand_over(sched, f"r{i}", SYSTEM + list(range(i * 100, i * 100 + 2 * BLOCK - 1)))
        handed.append(params is not None and bool(params.get("remote_block_ids")))
    # Before: the 4th request (30 + 10 > 32 counted per lease) handed nothing over.
    assert handed == [True] * 6
    assert len(_shared_ids(sched)) == 8  # held by all six leases
    assert sched.connector._lease_pins.physical_blocks == 8 + 6 * 2


def _shared_ids(sched) -> list[int]:  # noqa: ANN001
    pool = sched.kv_cache_manager.block_pool
    return [b.block_id for b in pool.blocks if b.ref_cnt == 6]


def test_distinct_prompts_still_stop_at_the_budget(model_dir, tmp_path):  # noqa: F811
    sched = _scheduler(model_dir, tmp_path)
    handed = [
        _hand_over(sched, f"d{i}", list(range(i * 1000 + 1, i * 1000 + 10 * BLOCK))) is not None
        for i in range(4)
    ]  # 10 blocks each: 10, 20, 30, then 40 > 32
    assert handed == [True, True, True, False]
    assert sched.connector.leases_refused == 1
    assert sched.connector._lease_pins.physical_blocks == 30
