"""A captured side-channel request (body and MAC) opens nothing a second time.

Real parts: grpcio's server and channels on loopback, hybridkv's HandshakeServer with a
deployment key, the prefill worker's lease bookkeeping (``PDWorker``, no engine), and the
real client calls, whose (body, MAC) are captured on the way out and sent again raw by a
caller without the secret.
"""

from __future__ import annotations

import json

import grpc
import pytest

from hybridkv.connector import pd_handshake
from hybridkv.connector.pd_handshake import (
    _CHANNEL_OPTIONS,
    MAC_METADATA,
    SERVICE,
    AgentInfoRequest,
    claim_lease,
    release_blocks,
    request_agent_info,
    request_mac,
)
from hybridkv.connector.pd_metadata import Lease, PDConnectorMetadata
from tests.unit.test_pd_params_auth import INFO, KEY, server, worker  # noqa: F401 (fixtures)


@pytest.fixture()
def captured(monkeypatch):
    """Every (method, body, MAC) the real client signs, in order."""
    seen: list[tuple[str, bytes, str]] = []
    real = pd_handshake.request_mac

    def tap(key, method, body):  # noqa: ANN001, ANN202
        mac = real(key, method, body)
        seen.append((method, body, mac))
        return mac

    monkeypatch.setattr(pd_handshake, "request_mac", tap)
    return seen


def _replay(address: str, method: str, body: bytes, mac: str) -> grpc.StatusCode:
    with grpc.insecure_channel(address, options=_CHANNEL_OPTIONS) as ch:
        try:
            ch.unary_unary(
                f"/{SERVICE}/{method}",
                request_serializer=lambda b: b,
                response_deserializer=lambda b: b,
            )(body, timeout=5, metadata=((MAC_METADATA, mac),))
        except grpc.RpcError as e:
            return e.code()
    return grpc.StatusCode.OK


def test_a_replayed_request_is_unauthenticated(server, worker, captured):
    worker.start_load_kv(PDConnectorMetadata(leases=[Lease("req-1", "a" * 32, 60.0)]))
    info = request_agent_info(
        server.address, AgentInfoRequest("decode", 0, expected=None), 5.0, KEY
    )
    assert info.agent_metadata == b"nixl-meta"
    assert claim_lease(server.address, "req-1", "a" * 32, 5.0, KEY) > 0
    release_blocks(server.address, ["req-1"], 5.0, KEY)
    assert [m for m, _, _ in captured] == ["GetAgentInfo", "ClaimLease", "ReleaseBlocks"]
    for method, body, mac in captured:
        assert _replay(server.address, method, body, mac) == grpc.StatusCode.UNAUTHENTICATED, method


def test_a_body_outside_the_window_is_refused_even_with_its_own_mac(server):
    import time

    for age in (-400.0, 400.0):
        body = json.dumps(
            {
                **AgentInfoRequest("decode", 0, expected=None).to_json(),
                "nonce": "0" * 32,
                "ts": time.time() + age,
            }
        ).encode()
        assert (
            _replay(server.address, "GetAgentInfo", body, request_mac(KEY, "GetAgentInfo", body))
            == grpc.StatusCode.UNAUTHENTICATED
        )
    # the control: a fresh body with its MAC is answered once, then refused
    body = json.dumps(
        {
            **AgentInfoRequest("decode", 0, expected=None).to_json(),
            "nonce": "1" * 32,
            "ts": time.time(),
        }
    ).encode()
    mac = request_mac(KEY, "GetAgentInfo", body)
    assert _replay(server.address, "GetAgentInfo", body, mac) == grpc.StatusCode.OK
    assert _replay(server.address, "GetAgentInfo", body, mac) == grpc.StatusCode.UNAUTHENTICATED


def test_the_nonce_memory_is_bounded_and_dropping_never_reopens_a_replay():
    from hybridkv.connector.pd_replay import ReplayGuard

    now = [1000.0]
    guard = ReplayGuard(window_s=60.0, capacity=4, clock=lambda: now[0])
    bodies = [{"ts": now[0] - 10 + i, "nonce": f"{i:032x}"} for i in range(10)]
    assert [guard.refusal(b) for b in bodies] == [None] * 10
    assert len(guard) == 4
    assert all(guard.refusal(b) is not None for b in bodies)  # the 6 dropped ones: below the floor
    assert guard.refusal({"ts": now[0], "nonce": "f" * 32}) is None  # fresh bodies still pass
    now[0] += 61.0  # every remembered nonce has left the window
    assert guard.refusal({"ts": now[0], "nonce": "e" * 32}) is None and len(guard) == 1
    assert "nonce" in guard.refusal({"ts": now[0], "nonce": ""})
    assert "timestamp" in guard.refusal({"nonce": "d" * 32})
