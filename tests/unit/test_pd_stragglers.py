"""Timed-out P/D READs that may still write (connector/pd_stragglers.py): their blocks are kept
until each READ settles, by ONE thread for all of them, and one stuck for good is reported.

The READ handles are FAKES (a poll count until DONE, or a failure): a READ that stays in flight
for minutes needs a peer frozen mid-transfer, which the soak does with a real prefill
(bench/soak.py); what is under test here is the bookkeeping around poll/release, driven through
PDWorker's own read loop (its ``_read`` replaced by a fake that reports the timed-out READs).
"""

from __future__ import annotations

import logging
import threading
import time

from hybridkv.connector.pd_metadata import PDConnectorMetadata, ReadJob
from hybridkv.connector.pd_stragglers import StragglerDrain
from hybridkv.connector.pd_transport import TransferError
from hybridkv.connector.pd_worker import PDWorker, PDWorkerSettings


class FakeRead:
    """A READ handle that is in flight for ``polls`` polls, then DONE (or failed); with a
    ``gate``, in flight until the gate is set (its polls count only from then)."""

    def __init__(
        self, polls: int, fails: bool = False, gate: threading.Event | None = None
    ) -> None:
        self.polls, self.fails, self.released, self.gate = polls, fails, False, gate

    def poll(self) -> str:
        if self.gate is not None and not self.gate.is_set():
            return "PROC"
        if self.polls > 0:
            self.polls -= 1
            return "PROC"
        if self.fails:
            raise TransferError("FAKE: peer died")
        return "DONE"


class FakeTransport:
    """poll / release of FakeRead handles (what PDWorker's straggler drain calls)."""

    def poll(self, handle: FakeRead) -> str:
        return handle.poll()

    def release(self, handle: FakeRead) -> None:
        assert handle.polls == 0, "released while still in flight"
        handle.released = True

    def shutdown(self) -> None:
        pass


def _drain_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("hybridkv-pd-straggler")]


def _until(cond, within_s: float) -> bool:  # noqa: ANN001
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.01)
    return cond()


def test_each_request_is_freed_once_all_its_reads_settled_and_not_before() -> None:
    transport, settled, seen_open = FakeTransport(), [], []
    reads = {f"r{i}": [FakeRead(i % 5), FakeRead(3 + i % 2, fails=i % 3 == 0)] for i in range(12)}

    def on_settled(req_id: str) -> None:
        seen_open.extend(h for h in reads[req_id] if h.polls or not h.released)
        settled.append(req_id)

    drain = StragglerDrain(transport.poll, transport.release, on_settled)
    try:
        for req_id, handles in reads.items():
            drain.add(req_id, handles, blocks=4)
        assert _until(lambda: drain.pending() == 0, 10.0)
        assert (
            sorted(settled) == sorted(reads) and not seen_open
        )  # once each, every READ settled first
    finally:
        drain.stop()


def test_a_read_stuck_for_good_is_reported_once_and_keeps_its_blocks(vllm_caplog) -> None:
    transport, settled = FakeTransport(), []
    stuck = FakeRead(10**9)
    drain = StragglerDrain(
        transport.poll, transport.release, settled.append, warn_after_s=0.3, max_pause_s=0.05
    )
    try:
        with vllm_caplog.at_level(logging.WARNING, logger="vllm.hybridkv.connector.pd_stragglers"):
            drain.add("stuck", [stuck], blocks=7)
            drain.add("quick", [FakeRead(1)], blocks=2)
            assert _until(lambda: settled == ["quick"], 5.0), settled
            time.sleep(0.6)
        warned = [
            r.getMessage() for r in vllm_caplog.records if "still in flight" in r.getMessage()
        ]
        assert (
            len(warned) == 1 and "stuck" in warned[0] and "its 7 destination blocks" in warned[0]
        ), warned
        assert drain.pending() == 1 and settled == ["quick"] and not stuck.released
        stuck.polls = 0  # the peer is killed or resumes: the READ settles
        assert _until(lambda: settled == ["quick", "stuck"], 5.0) and stuck.released
    finally:
        drain.stop()


def test_worker_keeps_timed_out_reads_blocks_until_they_settle_on_one_thread(monkeypatch) -> None:
    """Through PDWorker's read loop: 16 requests whose READs timed out (the FAKE ``_read``
    returns them as still in flight). Their blocks are reported free (``take_released``) only
    as each READ settles, and one thread drains them all (it was one thread per request)."""
    # Gated: on a busy host the drain settled the first READs before the read loop had handed
    # it the last ones, so 16 open at once was never seen (12-03, beside a CI run).
    gate = threading.Event()
    handles = {f"q{i}": FakeRead(5 + i % 5, gate=gate) for i in range(16)}
    monkeypatch.setattr(
        PDWorker, "_read", lambda self, job: (False, [handles[job.req_id]])
    )  # FAKE read
    worker = PDWorker(PDWorkerSettings("decode", 0, 1, "127.0.0.1", 0, 1.0, 1.0), None)
    worker._transport = FakeTransport()
    released: set[str] = set()
    before = set(_drain_threads())  # another test's drain may still be ending
    try:
        jobs = [
            ReadJob(r, f"p-{r}", "prefill", "10.0.0.1", 1000, [[1]], [[2]], lease_id="0" * 32)
            for r in handles
        ]
        worker.start_load_kv(PDConnectorMetadata(reads=jobs))
        assert _until(lambda: worker.unsettled_reads() == 16, 5.0), worker.unsettled_reads()
        assert len(set(_drain_threads()) - before) == 1, [t.name for t in _drain_threads()]
        assert worker.take_released() == set()  # none settled: none freed
        gate.set()
        deadline = time.monotonic() + 10.0
        while len(released) < 16 and time.monotonic() < deadline:
            got = worker.take_released()
            assert all(handles[r].released for r in got)  # never freed with its READ still open
            released |= got
            time.sleep(0.01)
        assert released == set(handles) and worker.unsettled_reads() == 0
    finally:
        worker.shutdown()


def test_an_unexpected_error_on_one_read_keeps_its_blocks_and_the_others_drain(vllm_caplog) -> None:
    """A poll that raises something other than a transfer failure (a NIXL error type not mapped,
    a bug) says nothing about that READ: its blocks stay kept, and the one drain thread goes on
    freeing the other requests' blocks."""
    transport, settled = FakeTransport(), []

    def poll(handle: FakeRead) -> str:
        if handle.fails:
            raise RuntimeError("FAKE: an unmapped error")
        return transport.poll(handle)

    drain = StragglerDrain(poll, transport.release, settled.append, max_pause_s=0.05)
    try:
        odd = FakeRead(0, fails=True)
        drain.add("odd", [odd], blocks=3)
        drain.add("fine", [FakeRead(2)], blocks=3)
        assert _until(lambda: settled == ["fine"], 5.0), settled
        assert drain.pending() == 1 and not odd.released
        odd.fails = False  # the READ reports DONE at last
        assert _until(lambda: settled == ["fine", "odd"], 5.0) and odd.released
    finally:
        drain.stop()
