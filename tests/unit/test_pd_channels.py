"""P/D side-channel calls reuse one gRPC channel per peer, not a channel per call.

Real gRPC: a real HandshakeServer, the real client functions; the count of channels is
read off the client's own channel cache (how many it created), not a fake.
"""

from __future__ import annotations

import pytest

from hybridkv.connector import pd_handshake
from hybridkv.connector.pd_handshake import (
    HandshakeError,
    HandshakeServer,
    LeaseRefused,
    claim_lease,
    release_blocks,
)
from tests.unit.test_pd_params_auth import INFO, KEY, worker  # noqa: F401 (fixture)


def test_calls_to_one_peer_share_one_channel(worker):  # noqa: F811
    with HandshakeServer(
        INFO, on_release=lambda ids, reader=0, readers=1: None, on_claim=worker._claim, key=KEY
    ) as server:
        before = pd_handshake._channels.opened
        for i in range(20):
            release_blocks(server.address, [f"req-{i}"], 5.0, KEY)
        for i in range(2):  # (an unknown lease is refused after the worker's claim wait)
            with pytest.raises(LeaseRefused):  # a refusal is an answer: the channel stays
                claim_lease(server.address, f"unknown-{i}", "a" * 32, 5.0, KEY)
        release_blocks(server.address, ["last"], 5.0, KEY)
        assert pd_handshake._channels.opened - before == 1


def test_a_failed_call_drops_the_channel_and_a_restarted_peer_is_reached(worker):  # noqa: F811
    server = HandshakeServer(
        INFO, on_release=lambda ids, reader=0, readers=1: None, on_claim=worker._claim, key=KEY
    )
    server.start()
    address, port = server.address, int(server.address.rsplit(":", 1)[1])
    release_blocks(address, ["a"], 5.0, KEY)
    server.stop()
    before = pd_handshake._channels.opened
    with pytest.raises(HandshakeError, match="UNAVAILABLE|DEADLINE"):
        release_blocks(address, ["b"], 1.0, KEY)
    # The same port again (the prefill instance restarted): the next call works at once.
    with HandshakeServer(
        INFO,
        on_release=lambda ids, reader=0, readers=1: None,
        on_claim=worker._claim,
        key=KEY,
        port=port,
    ) as again:
        assert again.address == address
        release_blocks(address, ["c"], 5.0, KEY)
    # The failed call ran on the cached channel and dropped it; the restarted peer got a new one.
    assert pd_handshake._channels.opened - before == 1


def test_the_cache_is_bounded():
    cache = pd_handshake._Channels(capacity=3)
    for p in range(10):
        cache.get(f"127.0.0.1:{40000 + p}")  # channels connect lazily: nothing is dialled here
    assert len(cache) == 3 and cache.opened == 10
    cache.get("127.0.0.1:40009")
    assert cache.opened == 10  # the most recent is still cached
