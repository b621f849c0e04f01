"""Request counters mean one decision per request: exact counts.

The ledger is driven the way the scheduler drives it (lookup answers, admission, the
workers' per-request load outcome); each test is a sequence the old counting got wrong
(counted per lookup call, per re-ask, for a refused hit, once per worker).
"""

from __future__ import annotations

from hybridkv.connector.store_stats import COUNTERS, HybridStoreStats, RequestLedger, covered_tokens


def _ledger(max_requests: int = 1 << 16) -> tuple[RequestLedger, HybridStoreStats]:
    stats = HybridStoreStats()
    return RequestLedger(lambda: stats, max_requests), stats


def test_re_asks_and_the_diverged_pre_lookup_count_one_lookup() -> None:
    ledger, stats = _ledger()
    ledger.offered("r", 1000, 0)  # the dense reference's pre-lookup from the diverged local hit: no
    for _ in range(3):  # the scheduler re-asks while it cannot admit the request
        ledger.offered("r", 1000, 512)
    ledger.admitted("r", 512, {0: 512})
    assert stats.data == {"lookups": 1, "query_tokens": 1000}  # the hit waits for its load
    ledger.load_done("r", ok=True)
    assert stats.data == {
        "lookups": 1,
        "query_tokens": 1000,
        "lookup_hits": 1,
        "hit_tokens": 512,
        "hit_tokens.g0": 512,
    }
    assert len(ledger) == 0


def test_granted_fewer_tokens_counts_what_was_granted() -> None:
    ledger, stats = _ledger()
    ledger.offered("r", 800, 512)
    ledger.admitted("r", 256, {0: 256})
    ledger.load_done("r", ok=True)
    assert stats.data["hit_tokens"] == 256 and stats.data["lookup_hits"] == 1


def test_refused_and_failed_loads_are_not_hits_and_count_once_per_request() -> None:
    ledger, stats = _ledger()
    ledger.offered("refused", 600, 256)
    ledger.admitted("refused", 256, {0: 256}, refused=True)  # e.g. no state at the granted boundary
    ledger.offered("failed", 600, 256)
    ledger.admitted("failed", 256, {0: 256})
    ledger.load_done("failed", ok=False)
    ledger.load_done("failed", ok=False)  # a second report (another step, another rank): no count
    assert stats.data == {"lookups": 2, "query_tokens": 1200, "failed_loads": 2}


def test_no_grant_and_no_lookup() -> None:
    ledger, stats = _ledger()
    ledger.offered("zero", 300, 128)
    ledger.admitted("zero", 0)  # the scheduler took no external tokens
    ledger.admitted("never-asked", 128)  # no lookup answer: the store was not consulted
    ledger.load_done("never-asked", ok=True)
    assert stats.data == {"lookups": 1, "query_tokens": 300}


def test_a_finished_request_leaves_nothing_and_state_is_bounded() -> None:
    ledger, stats = _ledger(max_requests=2)
    ledger.offered("a", 10, 5)
    ledger.forget("a")  # aborted before admission
    for i in range(5):
        ledger.offered(f"q{i}", 10, 5)
    for i in range(5):
        ledger.offered(f"g{i}", 10, 5)
        ledger.admitted(f"g{i}", 5)
    assert (
        len(ledger) == 3
    )  # offers: q4 (q0-q3 dropped, g* admitted); grants: g3, g4 (oldest dropped)
    assert stats.data == {"lookups": 5, "query_tokens": 50}


def test_a_mamba_state_covers_the_granted_tokens_not_one_block() -> None:
    groups = [(16, False), (64, True), (32, False)]
    # 3 attention blocks of group 0, ONE state of group 1, 2 window-tail blocks of group 2.
    assert covered_tokens(groups, [0, 0, 0, 1, 2, 2], granted_tokens=192) == {0: 48, 1: 192, 2: 64}
    assert covered_tokens(groups, [], granted_tokens=192) == {}


def test_worker_counters_reach_prometheus() -> None:
    # Names the worker counts must be declared, or observe() drops them silently.
    for name in ("skipped_saves", "snapshot_blocks", "failed_loads", "lookup_round_trips"):
        assert name in COUNTERS
