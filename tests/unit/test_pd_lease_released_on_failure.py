"""A decode read that ends without using the prefill side's blocks releases their lease.

A refused job (the scheduler found the layouts incompatible) and a refused handshake (the
prefill worker's layout differs) used to return before the release: the prefill worker kept
the blocks for ``lease_s``, and enough such requests filled its lease budget. Real parts:
grpcio on loopback, hybridkv's HandshakeServer and both sides' ``PDWorker`` (the decode side
with a real NIXL agent over a KV cache built by vLLM's allocation code), no engine.
"""

from __future__ import annotations

import time

import pytest

from hybridkv.connector.pd_handshake import HandshakeServer
from hybridkv.connector.pd_metadata import Lease, PDConnectorMetadata, ReadJob
from hybridkv.connector.pd_worker import PDWorker, PDWorkerSettings
from tests.unit.test_pd_params_auth import INFO, KEY, _kv


@pytest.fixture()
def prefill():
    w = PDWorker(PDWorkerSettings("prefill-engine", 0, 1, "127.0.0.1", 0, 5.0, 5.0, key=KEY), None)
    with HandshakeServer(INFO, on_release=w._released_by_decode, on_claim=w._claim, key=KEY) as s:
        w.test_port = s.port
        yield w
    w.shutdown()


def _decode(monkeypatch, with_nixl: bool) -> PDWorker:
    monkeypatch.setenv("UCX_NET_DEVICES", "lo")
    monkeypatch.setenv("UCX_MODULES", "^ib")
    config, caches = _kv() if with_nixl else (None, None)
    w = PDWorker(
        PDWorkerSettings(
            "decode-engine", 0, 1, "127.0.0.1", 0, 5.0, 5.0, serve_handshake=False, key=KEY
        ),
        config,
    )
    if with_nixl:
        w.register_kv_caches(caches)
    return w


def _ended(prefill: PDWorker, rid: str, within_s: float) -> bool:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        if rid in prefill.get_transfer_results().finished_sending:
            return True
        time.sleep(0.05)
    return False


def _failed(decode: PDWorker, rid: str, within_s: float) -> bool:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        if rid in decode.get_transfer_results().failed_recving:
            return True
        time.sleep(0.05)
    return False


@pytest.mark.parametrize("failure", ["refused job", "refused handshake"])
def test_a_read_that_will_not_happen_releases_the_lease(prefill, monkeypatch, failure):
    prefill.start_load_kv(PDConnectorMetadata(leases=[Lease("p1", "a" * 32, 60.0)]))
    decode = _decode(monkeypatch, with_nixl=failure == "refused handshake")
    try:
        job = ReadJob(
            "d1",
            "p1",
            "prefill-engine",
            "127.0.0.1",
            prefill.test_port,
            [[1]],
            [[2]],
            lease_id="a" * 32,
        )
        if failure == "refused job":
            job.refused = "prefill has 2 KV cache groups, decode 1"
        decode.start_load_kv(PDConnectorMetadata(reads=[job]))
        assert _failed(decode, "d1", 10.0)
        assert _ended(prefill, "p1", 10.0), (
            "the prefill side still holds the lease after the decode gave up"
        )
        assert prefill.take_stats().data.get("leases_released") == 1
    finally:
        decode.shutdown()
