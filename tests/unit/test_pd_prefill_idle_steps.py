"""A prefill engine idle apart from unread leases does not step, and a lease's end reported
by the workers frees its blocks.

Real parts: vLLM's ``Scheduler`` with HybridPDConnector loaded as EngineCore builds it
(tests/unit/pd_real_scheduler.py), driven the way ``EngineCore.run_busy_loop`` drives it:
step while ``has_requests()``, 1 ms sleep after a step that ran no model. The workers'
replies are written by the test (no forward pass); a lease's end arrives as the workers
report it (``PDLeaseWorkerMetadata.leases_ended``).
"""

from __future__ import annotations

import time

from hybridkv.cli.harness.kv_manager import Geometry, fa
from hybridkv.connector.pd_auth import write_secret_file
from tests.unit.pd_real_scheduler import (
    model_dir,  # noqa: F401 (a fixture)
    pd_request,
    pd_scheduler,
    prefill_leg,
    worker_reply,
)

BLOCK = 16
HOLD_S = 1.0


def _engine_steps(sched, until: float) -> int:  # noqa: ANN001
    """EngineCore's loop until ``until`` or no work; returns the steps run."""
    steps = 0
    while time.monotonic() < until and sched.has_requests():
        out = sched.schedule()
        sched.update_from_output(out, worker_reply(out))
        steps += 1
        if not out.total_num_scheduled_tokens:
            time.sleep(0.001)  # EngineCore._process_engine_step after a step without a model run
    return steps


def test_an_unread_lease_does_not_keep_the_engine_stepping(model_dir, tmp_path):  # noqa: F811
    geo = Geometry([fa(BLOCK)], hash_block_size=BLOCK, num_blocks=64, max_model_len=4096)
    sched = pd_scheduler(
        model_dir, "kv_producer", geo, str(write_secret_file(tmp_path / "s")), max_num_seqs=4
    )
    pool = sched.kv_cache_manager.block_pool
    free_before = pool.get_num_free_blocks()
    prompt = list(range(1, 3 * BLOCK + 2))
    params = prefill_leg(sched, pd_request("p1", prompt, {"do_remote_decode": True}, BLOCK))
    held = [b for group in params["remote_block_ids"] for b in group if b]
    steps = _engine_steps(sched, time.monotonic() + HOLD_S)
    # Before: the finished request stayed in vLLM's scheduler until the lease ended, and the
    # engine stepped about once per ms (600 empty steps in 1 s here).
    assert steps <= 2, f"{steps} steps in {HOLD_S} s with one unread lease and nothing to run"
    assert not sched.has_requests()
    assert all(pool.blocks[b].ref_cnt == 1 for b in held)  # the lease holds them, nothing else
    assert pool.get_num_free_blocks() == free_before - len(held)
    # The next step (any request's) carries the workers' report that the lease ended.
    from hybridkv.connector.pd_lease_pins import PDLeaseWorkerMetadata

    out = sched.schedule()
    sched.update_from_output(
        out, worker_reply(out, kv_connector_worker_meta=PDLeaseWorkerMetadata({}, {"p1": 1}))
    )
    assert all(pool.blocks[b].ref_cnt == 0 for b in held)
    assert pool.get_num_free_blocks() == free_before
    assert sched.connector._scheduler._leased_blocks == 0  # the lease budget counts them no more
