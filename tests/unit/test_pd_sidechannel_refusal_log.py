"""Refusals of the side channel log at most one warning per peer host and kind per interval.

Real parts: grpcio's server and channels on loopback, hybridkv's HandshakeServer with a
deployment key, real calls without the secret (each refused UNAUTHENTICATED).
"""

from __future__ import annotations

import logging

import pytest

from hybridkv.connector.pd_handshake import (
    AgentInfoRequest,
    HandshakeError,
    HandshakeServer,
    request_agent_info,
)
from tests.unit.test_pd_params_auth import INFO, KEY


def test_fifty_refused_calls_from_one_peer_log_one_warning(vllm_caplog):
    vllm_caplog.set_level(logging.WARNING)
    with HandshakeServer(INFO, key=KEY) as server:
        for _ in range(50):
            with pytest.raises(HandshakeError, match="UNAUTHENTICATED"):
                request_agent_info(server.address, AgentInfoRequest("decode", 0, None), 5.0, None)
    lines = [
        r
        for r in vllm_caplog.records
        if "GetAgentInfo from" in r.getMessage() and "refused" in r.getMessage()
    ]
    assert len(lines) == 1  # before: 50, one per call


def test_peers_are_told_apart_by_host_and_kind_and_the_next_line_counts_the_rest(vllm_caplog):
    import time

    from hybridkv.connector.pd_refusal_log import RefusalLog

    vllm_caplog.set_level(logging.WARNING)
    log = RefusalLog(logging.getLogger("test.refusals"), interval_s=0.3)
    assert log.warn("ipv4:10.0.0.1:5000", "mac", "refused")
    assert not log.warn("ipv4:10.0.0.1:6000", "mac", "refused")  # same host, another port
    assert not log.warn("ipv4:10.0.0.1:6001", "mac", "refused")
    assert log.warn("ipv4:10.0.0.2:5000", "mac", "refused")  # another host
    assert log.warn("ipv4:10.0.0.1:5000", "replay", "refused")  # another kind
    time.sleep(0.35)
    assert log.warn("ipv4:10.0.0.1:5000", "mac", "refused")
    assert "and 2 more such refusals of this peer" in vllm_caplog.records[-1].getMessage()
