"""MultiConnector's "not chosen" call to the P/D child, without an engine.

Moved from tests/e2e (real engines only): it drives PDScheduler/PDWorker directly with a
stand-in request (SimpleNamespace: the scheduler reads only these fields). The e2e
multiconnector test shows the same release end to end (prefill's reset succeeds fast).
"""

from __future__ import annotations

ALIGN = 128  # gemma3 tiny model: scheduler block, as in the e2e test
LEASE_S = 60.0


def test_pd_child_not_chosen_only_releases_the_prefill_lease():
    """Engine-free: MultiConnector's ``update_state_after_alloc(request, blocks, 0)`` to the
    P/D child queues a release, pins nothing, and its worker never reports the request as
    received (a non-chosen child's finished_recving would end the chosen store load early)."""
    from types import SimpleNamespace

    from hybridkv.connector.pd_scheduler import PDScheduler
    from hybridkv.connector.pd_worker import PDWorker, PDWorkerSettings

    # Two groups of 128-token blocks, no deployment key (unauthenticated: the MAC is not
    # what this test is about; tests/unit/test_pd_params.py covers it).
    sched = PDScheduler(
        "decode",
        False,
        LEASE_S,
        (),
        ALIGN,
        can_prefill=False,
        group_block_sizes=(ALIGN, ALIGN),
        num_blocks=16,
    )
    params = {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "remote_engine_id": "prefill",
        "remote_request_id": "p-1",
        "remote_host": "127.0.0.1",
        "remote_port": 1,
        "remote_block_ids": [[1, 2], [3, 4]],
        "remote_num_tokens": 256,
        "remote_lease_id": "0" * 32,
    }
    request = SimpleNamespace(
        request_id="d-1",
        kv_transfer_params=params,
        num_prompt_tokens=300,
        block_hashes=[b"h1", b"h2"],
    )
    assert sched.get_num_new_matched_tokens(request, 0) == (256, True)  # offered, then not chosen
    sched.update_state_after_alloc(request, None, 0)
    meta = sched.build_connector_meta(None)
    assert [(j.req_id, j.remote_req_id, j.release_only, j.local_block_ids) for j in meta.reads] == [
        ("d-1", "p-1", True, [])
    ]
    assert not sched.has_pins()
    sched.update_state_after_alloc(request, None, 0)  # re-admission (preemption): nothing more
    assert sched.build_connector_meta(None).reads == []

    worker = PDWorker(PDWorkerSettings("decode", 0, 1, "127.0.0.1", 0, 1.0, 1.0), None)
    try:
        worker.start_load_kv(meta)
        assert worker.stop_reads(join_s=5)  # drain: the read threads exit after the release job
        results = worker.get_transfer_results()
        assert not results.finished_recving and not results.failed_recving
        assert not worker.take_released()
    finally:
        worker.shutdown()
