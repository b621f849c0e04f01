"""``FailedLoads``: the deferral both connector schedulers owe a failed load (why:
connector/failed_loads.py, docs/vllm_upstream.md section 1). Through vLLM's real
scheduler: test_real_scheduler.py (store loads), test_pd_failed_reads_together.py (READs)."""

from __future__ import annotations

from hybridkv.connector.failed_loads import FailedLoads


def test_own_failed_load_defers_once_and_stays_failed_until_forgotten():
    f = FailedLoads()
    f.mark({"mine", "other"}, {"mine"}.__contains__)
    assert f.load_failed("mine") and not f.load_failed("other")  # another connector's failure
    assert not f.take_deferral("other")
    assert f.take_deferral("mine") and not f.take_deferral("mine")  # once, never again
    assert f.deferrals == 1
    assert f.load_failed("mine")  # still failed: its load must not be offered again
    f.forget("mine")
    assert not f.load_failed("mine") and len(f) == 0


def test_nothing_failed_nothing_deferred():
    f = FailedLoads()
    f.mark(set(), lambda r: True, lambda r: True)
    assert not f.take_deferral("r") and not f.load_failed("r") and f.deferrals == 0 and len(f) == 0


def test_another_connectors_failure_of_a_tracked_request_counts_as_failed_but_owes_no_deferral():
    """Under MultiConnector: the P/D READ failed; the store must not offer its copy (vLLM's
    stale reservation, connector/failed_loads.py) and must not skip the request a second time."""
    f = FailedLoads()
    f.mark({"theirs", "unknown"}, lambda r: False, {"theirs"}.__contains__)
    assert f.load_failed("theirs") and not f.load_failed(
        "unknown"
    )  # an untracked id is not remembered
    assert not f.take_deferral("theirs") and f.deferrals == 0
    f.mark({"theirs"}, {"theirs"}.__contains__)  # reported again as its own: owes the deferral now
    assert f.take_deferral("theirs") and not f.take_deferral("theirs")
    f.forget("theirs")
    assert len(f) == 0
