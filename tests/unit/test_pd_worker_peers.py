"""PDWorker's per-peer read threads, bounded memory, and leases read by several decode ranks.

No engine and no NIXL here: the read itself (``PDWorker._read``) is replaced by a FAKE that
blocks on an event, because what is under test is the dispatch around it (which thread a
job waits on), not the transfer (tests/unit/test_pd_transport.py and the e2e tests move real
bytes). The lease tests call the prefill side's claim/release handlers directly, as the
gRPC side channel does.
"""

from __future__ import annotations

import threading
import time

import pytest

import hybridkv.connector.pd_worker as pd_worker
from hybridkv.connector.pd_handshake import LeaseRefused
from hybridkv.connector.pd_metadata import Lease, PDConnectorMetadata, ReadJob
from hybridkv.connector.pd_worker import ENDED_LEASES_KEPT, PDWorker, PDWorkerSettings


def _worker() -> PDWorker:
    return PDWorker(PDWorkerSettings("decode", 0, 1, "127.0.0.1", 0, 1.0, 1.0), None)


def _job(req: str, port: int) -> ReadJob:
    return ReadJob(req, f"p-{req}", "prefill", "10.0.0.1", port, [[1]], [[2]], lease_id="0" * 32)


def _done(worker: PDWorker, req: str, within_s: float) -> bool:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        with worker._lock:
            if req in worker._recv_done:
                return True
        time.sleep(0.01)
    return False


def _stalled_peer_run(monkeypatch) -> tuple[bool, bool]:
    """(B done while A's peer is stalled, A done after the stall ends)."""
    stall = threading.Event()

    def fake_read(self, job):  # noqa: ANN001 - FAKE read: peer 1000 hangs until released
        if job.remote_port == 1000:
            stall.wait(10)
        return True, None

    monkeypatch.setattr(PDWorker, "_read", fake_read)
    worker = _worker()
    try:
        worker.start_load_kv(PDConnectorMetadata(reads=[_job("a", 1000), _job("b", 2000)]))
        b_first = _done(worker, "b", 2.0)
        stall.set()
        a_done = _done(worker, "a", 5.0)
        return b_first, a_done
    finally:
        stall.set()
        worker.stop_reads(join_s=5)


def test_a_stalled_peer_delays_only_its_own_requests(monkeypatch):
    assert _stalled_peer_run(monkeypatch) == (True, True)


def test_control_one_shared_read_thread_would_fail_it(monkeypatch):
    monkeypatch.setattr(
        pd_worker, "MAX_PEER_THREADS", 0
    )  # planted: every peer on the overflow thread
    assert _stalled_peer_run(monkeypatch) == (False, True)


def test_idle_peer_threads_exit_and_come_back(monkeypatch):
    monkeypatch.setattr(pd_worker, "PEER_IDLE_S", 0.2)
    monkeypatch.setattr(PDWorker, "_read", lambda self, job: (True, None))  # FAKE read
    worker = _worker()
    try:
        worker.start_load_kv(PDConnectorMetadata(reads=[_job("a", 1000)]))
        assert _done(worker, "a", 2.0)
        deadline = time.monotonic() + 3
        while worker._peer_queues and time.monotonic() < deadline:
            time.sleep(0.05)
        assert worker._peer_queues == {}  # the idle thread left and took its queue along
        worker.start_load_kv(PDConnectorMetadata(reads=[_job("b", 1000)]))
        assert _done(worker, "b", 2.0)  # nothing lost across the exit
    finally:
        worker.stop_reads(join_s=5)


def test_releases_of_unknown_leases_are_bounded():
    worker = _worker()
    try:
        for i in range(ENDED_LEASES_KEPT + 100):
            worker._released_by_decode([f"forged-{i}"])
        assert len(worker._decode_released) == ENDED_LEASES_KEPT
        assert (
            "forged-0" not in worker._decode_released
            and f"forged-{ENDED_LEASES_KEPT + 99}" in worker._decode_released
        )
    finally:
        worker.stop_reads(join_s=5)


def test_a_lease_read_by_two_decode_ranks_grants_each_once_and_frees_after_both():
    """Prefill TP1 -> decode TP2: both decode ranks read the one prefill rank."""
    worker = _worker()
    try:
        worker.start_load_kv(PDConnectorMetadata(leases=[Lease("r1", "l" * 32, 60.0)]))
        assert worker._claim("r1", "l" * 32, reader=0, readers=2) > 0
        with pytest.raises(LeaseRefused, match="claimed already"):
            worker._claim("r1", "l" * 32, reader=0, readers=2)
        assert worker._claim("r1", "l" * 32, reader=1, readers=2) > 0
        with pytest.raises(LeaseRefused, match="claimed already"):
            worker._claim(
                "r1", "l" * 32, reader=2, readers=2
            )  # a third reader of a two-reader lease
        worker._released_by_decode(["r1"], reader=0, readers=2)
        assert (
            worker.get_transfer_results().finished_sending == set()
        )  # rank 1 may still be reading
        worker._released_by_decode(["r1"], reader=1, readers=2)
        assert worker.get_transfer_results().finished_sending == {"r1"}
    finally:
        worker.stop_reads(join_s=5)


class _FakeTransport:
    """FAKE of PDTransport's peer bookkeeping only (no NIXL)."""

    def __init__(self, busy: set[str]) -> None:
        self.busy, self.removed = busy, []

    def open_reads(self, name: str) -> int:
        return 1 if name in self.busy else 0

    def remove_peer(self, name: str) -> None:
        self.removed.append(name)


def test_peers_are_bounded_but_never_one_with_a_read_in_flight(monkeypatch):
    monkeypatch.setattr(pd_worker, "MAX_PEERS", 3)
    worker = _worker()
    try:
        worker._transport = _FakeTransport(busy={"p0"})
        for i in range(5):
            worker._peers[("h", i)] = (f"p{i}", None)
            worker._forget_idle_peers()
        assert [v[0] for v in worker._peers.values()] == ["p0", "p3", "p4"]
        assert worker._transport.removed == ["p1", "p2"]
    finally:
        worker._transport = None
        worker.stop_reads(join_s=5)


def test_a_peer_read_thread_is_not_pinned_to_the_core_of_the_thread_that_starts_it(monkeypatch):
    """vLLM pins the worker's main thread (the one calling start_load_kv) to its core; a read
    thread started there inherited that core and queued its READs, claims and releases
    behind the forward pass (a suspect in the P/D soak's 30-50 s stalls). The read thread
    runs on every usable CPU. Planted (started without unpinned()): it sees the one core."""
    import os

    from hybridkv.store.cpu_affinity import usable_cpus

    cpus = sorted(usable_cpus())
    if len(cpus) < 2:
        pytest.fail(f"needs two usable CPUs to pin one, this runner has {cpus}")
    seen: list[set[int]] = []

    def fake_read(self, job):  # noqa: ANN001 - FAKE read: records the read thread's CPUs
        seen.append(os.sched_getaffinity(0))
        return True, None

    monkeypatch.setattr(PDWorker, "_read", fake_read)
    worker = _worker()
    result: list[bool] = []

    def pinned_caller() -> None:  # a worker main thread vLLM pinned to one core
        os.sched_setaffinity(0, {cpus[0]})
        worker.start_load_kv(PDConnectorMetadata(reads=[_job("a", 1000)]))
        result.append(_done(worker, "a", 5.0))

    try:
        caller = threading.Thread(target=pinned_caller)
        caller.start()
        caller.join(10)
        assert result == [True]
        assert seen == [set(cpus)], f"the read thread ran on {seen}, not on every usable CPU {cpus}"
    finally:
        worker.stop_reads(join_s=5)


def test_peers_looked_up_added_and_forgotten_by_many_read_threads_at_once(monkeypatch):
    """Per-peer read threads share ``_peers``: one thread forgetting an idle peer while another
    moves it to the end raised KeyError, which ended a read after another rank's READ was
    posted (then untracked: its blocks freed while it could still write). FAKE handshake and
    transport: only the bookkeeping is under test."""
    import sys
    from types import SimpleNamespace

    monkeypatch.setattr(pd_worker, "MAX_PEERS", 2)
    layout = SimpleNamespace(group_layouts=lambda: (), memory_spaces=lambda: ())
    monkeypatch.setattr(
        pd_worker,
        "fetch_agent_info",
        lambda address, *a, **k: SimpleNamespace(agent_metadata=address, layout=layout),
    )

    class Transport(_FakeTransport):
        def add_peer(self, metadata, groups, spaces):  # noqa: ANN001
            return f"agent-{metadata}"

    worker = _worker()
    worker._transport = Transport(busy=set())
    errors: list[BaseException] = []

    def hammer(seed: int) -> None:
        for i in range(3000):
            try:
                worker._peer(_job("r", 1000 + (seed * 7 + i) % 6), 0)
            except BaseException as e:  # noqa: BLE001
                errors.append(e)
                return

    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        threads = [threading.Thread(target=hammer, args=(k,)) for k in range(6)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        sys.setswitchinterval(old)
        worker._transport = None
        worker.stop_reads(join_s=5)
    assert errors == []
    assert len(worker._peers) <= 2
