"""ClaimLease never holds a handshake thread waiting, the side channel bounds the calls it
holds, and a lease the decode side released cannot be claimed.

Real parts: grpcio's server and channels on loopback, hybridkv's HandshakeServer with a
deployment key, the prefill worker's lease bookkeeping (``PDWorker``, no engine), the real
client calls from threads.
"""

from __future__ import annotations

import threading
import time

import pytest

from hybridkv.connector.pd_handshake import (
    AgentInfoRequest,
    HandshakeError,
    HandshakeServer,
    LeaseRefused,
    claim_lease,
    release_blocks,
    request_agent_info,
)
from hybridkv.connector.pd_metadata import Lease, PDConnectorMetadata
from tests.unit.test_pd_params_auth import INFO, KEY, server, worker  # noqa: F401 (fixtures)


def test_agent_info_answers_while_eight_unknown_claims_are_pending(server):
    refused: list[BaseException] = []

    def claim(i: int) -> None:
        try:
            claim_lease(server.address, f"unknown-{i}", "a" * 32, 5.0, KEY)
        except LeaseRefused as e:
            refused.append(e)

    claims = [threading.Thread(target=claim, args=(i,)) for i in range(8)]
    for t in claims:
        t.start()
    time.sleep(0.2)  # every claim sent and waiting for its lease
    t0 = time.monotonic()
    info = request_agent_info(
        server.address, AgentInfoRequest("decode", 0, expected=None), 5.0, KEY
    )
    took = time.monotonic() - t0
    for t in claims:
        t.join(10.0)
    assert info.agent_metadata == b"nixl-meta"
    assert took < 1.0, f"GetAgentInfo took {took:.2f} s behind 8 pending claims"
    assert len(refused) == 8 and all("no such lease" in str(e) for e in refused)


def test_a_claim_waits_for_a_late_lease_without_a_thread(server, worker):
    """The lease reaches the worker 0.4 s after the claim: granted, while the claim held no
    handshake thread (a GetAgentInfo meanwhile is answered at once)."""
    timer = threading.Timer(
        0.4,
        worker.start_load_kv,
        args=(PDConnectorMetadata(leases=[Lease("late", "f" * 32, 9.0)]),),
    )
    timer.start()
    assert 8.0 < claim_lease(server.address, "late", "f" * 32, 5.0, KEY) <= 9.0
    timer.join()


def test_a_released_lease_is_not_claimed(server, worker):
    worker.start_load_kv(
        PDConnectorMetadata(leases=[Lease("rel", "b" * 32, 30.0), Lease("early", "c" * 32, 30.0)])
    )
    release_blocks(server.address, ["rel"], 5.0, KEY)  # the worker has not stepped since
    with pytest.raises(LeaseRefused, match="released the lease already"):
        claim_lease(server.address, "rel", "b" * 32, 5.0, KEY)
    assert worker.get_transfer_results().finished_sending == {"rel"}
    # a release that comes before the lease itself: the claim is refused once it arrives
    release_blocks(server.address, ["before"], 5.0, KEY)
    threading.Timer(
        0.3,
        worker.start_load_kv,
        args=(PDConnectorMetadata(leases=[Lease("before", "d" * 32, 30.0)]),),
    ).start()
    with pytest.raises(LeaseRefused, match="released the lease already"):
        claim_lease(server.address, "before", "d" * 32, 5.0, KEY)
    assert claim_lease(server.address, "early", "c" * 32, 5.0, KEY) > 0  # the control


def test_calls_past_the_bound_are_refused_at_once_with_the_reason(worker):
    """A server holding 2 calls at most (1 thread, 1 queued): the third is refused
    RESOURCE_EXHAUSTED at once and the client's error says what that means."""
    from hybridkv.connector import pd_handshake

    gate = threading.Event()

    def slow_release(ids, reader=0, readers=1):  # noqa: ANN001, ANN202
        gate.wait(10.0)

    old = pd_handshake.MAX_CONCURRENT_RPCS
    pd_handshake.MAX_CONCURRENT_RPCS = 2
    try:
        server = HandshakeServer(INFO, max_workers=1, on_release=slow_release, key=KEY)
    finally:
        pd_handshake.MAX_CONCURRENT_RPCS = old
    with server:
        held = [
            threading.Thread(target=release_blocks, args=(server.address, [f"r{i}"], 10.0, KEY))
            for i in range(2)
        ]
        for t in held:
            t.start()
        time.sleep(0.3)
        t0 = time.monotonic()
        with pytest.raises(HandshakeError, match="RESOURCE_EXHAUSTED.*refuses more"):
            request_agent_info(
                server.address, AgentInfoRequest("decode", 0, expected=None), 5.0, KEY
            )
        assert time.monotonic() - t0 < 1.0
        gate.set()
        for t in held:
            t.join(10.0)
        assert (
            request_agent_info(
                server.address, AgentInfoRequest("decode", 0, None), 5.0, KEY
            ).tp_rank
            == 0
        )
