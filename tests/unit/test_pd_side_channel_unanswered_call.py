"""A side-channel call that gets no answer is sent again on a new channel within its bound.

A release on a cached channel has gone unanswered for the caller's whole bound (120 s in the
TP proxy e2e test) while the same prefill worker answered new channels at once, stalling the
decode rank's read thread and every READ queued behind it. The unanswered call cannot be
produced on demand, so the server's release handler stands in for it: it blocks on its first
call (a fault planted in the real gRPC server's callback, named as such) and answers later
calls at once.
"""

from __future__ import annotations

import threading
import time

import pytest

from hybridkv.connector import pd_handshake
from hybridkv.connector.pd_handshake import HandshakeError, HandshakeServer, release_blocks
from tests.unit.test_pd_params_auth import INFO, KEY

ATTEMPT_S = 1.0


def _server(hang_first: threading.Event) -> tuple[HandshakeServer, list[list[str]]]:
    calls: list[list[str]] = []

    def on_release(ids: list[str], reader: int, readers: int) -> None:
        calls.append(list(ids))
        if len(calls) == 1:
            hang_first.wait(30)  # the planted fault: the first call is never answered in time

    return HandshakeServer(INFO, on_release=on_release, key=KEY), calls


def test_an_unanswered_release_is_sent_again_and_answered_within_the_bound(monkeypatch):
    monkeypatch.setattr(pd_handshake, "RPC_ATTEMPT_S", ATTEMPT_S)
    hang = threading.Event()
    srv, calls = _server(hang)
    try:
        with srv:
            t = time.monotonic()
            release_blocks(srv.address, ["req-1"], 20.0, KEY)
            took = time.monotonic() - t
    finally:
        hang.set()
    assert calls == [["req-1"], ["req-1"]]  # the second attempt is a new call, answered
    assert ATTEMPT_S <= took < 20.0


def test_a_peer_that_never_answers_still_fails_at_the_callers_bound(monkeypatch):
    monkeypatch.setattr(pd_handshake, "RPC_ATTEMPT_S", ATTEMPT_S)
    stuck = threading.Event()

    def on_release(ids: list[str], reader: int, readers: int) -> None:
        stuck.wait(30)

    try:
        with HandshakeServer(INFO, on_release=on_release, key=KEY) as srv:
            t = time.monotonic()
            with pytest.raises(HandshakeError, match="DEADLINE_EXCEEDED"):
                release_blocks(srv.address, ["req-2"], 3.5, KEY)
            took = time.monotonic() - t
    finally:
        stuck.set()
    assert 3.5 <= took < 3.5 + 2.0
