"""The P/D side channel with a deployment secret, and the lease rules, on a real gRPC server.

Real parts: grpcio's server and channels on loopback, hybridkv's HandshakeServer, the
prefill worker's lease bookkeeping (``PDWorker``, no engine). What is tried: calls
without the secret or with another one (GetAgentInfo, ReleaseBlocks, ClaimLease), an
impostor server answering a decode worker, a lease claimed twice (n > 1 / proxy
replay), an expired lease, a claim racing the lease's arrival, and a skewed wall clock.
"""

from __future__ import annotations

import threading
import time

import grpc
import pytest

from hybridkv.connector.pd_auth import DeploymentKey
from hybridkv.connector.pd_handshake import (
    _CHANNEL_OPTIONS,
    _FULL_METHOD,
    _FULL_RELEASE_METHOD,
    CLAIM_WAIT_S,
    HANDSHAKE_VERSION,
    MAC_METADATA,
    AgentInfo,
    AgentInfoRequest,
    GroupDescriptor,
    HandshakeError,
    HandshakeServer,
    LayoutDescriptor,
    LeaseRefused,
    claim_lease,
    release_blocks,
    request_agent_info,
    request_mac,
)
from hybridkv.connector.pd_metadata import Lease, PDConnectorMetadata
from hybridkv.connector.pd_worker import PDWorker, PDWorkerSettings

KEY = DeploymentKey(b"k" * 32, "test")
OTHER = DeploymentKey(b"o" * 32, "other")
LAYOUT = LayoutDescriptor(
    tp_size=1,
    groups=(
        GroupDescriptor(
            0, "FullAttentionSpec", 16, "torch.bfloat16", None, (4096,), (0x1000,), (4096,)
        ),
    ),
)
INFO = AgentInfo(
    engine_id="prefill-engine",
    tp_rank=0,
    agent_name="p0",
    agent_metadata=b"nixl-meta",
    layout=LAYOUT,
)


@pytest.fixture()
def worker():
    w = PDWorker(PDWorkerSettings("prefill-engine", 0, 1, "127.0.0.1", 0, 5.0, 5.0, key=KEY), None)
    yield w
    w.shutdown()


@pytest.fixture()
def server(worker):
    released: list[list[str]] = []

    def on_release(ids: list[str], reader: int = 0, readers: int = 1) -> None:
        released.append(ids)
        worker._released_by_decode(ids)

    with HandshakeServer(INFO, on_release=on_release, on_claim=worker._claim, key=KEY) as s:
        s.released = released
        yield s


def _raw(address: str, method: str, body: bytes, metadata=()):  # noqa: ANN001, ANN202
    with grpc.insecure_channel(address, options=_CHANNEL_OPTIONS) as ch:
        return ch.unary_unary(
            method, request_serializer=lambda b: b, response_deserializer=lambda b: b
        )(body, timeout=5, metadata=metadata)


def test_agent_info_needs_the_secret(server):
    req = AgentInfoRequest("decode", 0, expected=None)
    assert request_agent_info(server.address, req, 5.0, KEY).agent_metadata == b"nixl-meta"
    for key in (None, OTHER):
        with pytest.raises(HandshakeError, match="UNAUTHENTICATED"):
            request_agent_info(server.address, req, 5.0, key)
    # a MAC copied from another body does not open this one
    body = (
        b'{"version": %d, "engine_id": "d", "tp_rank": 0, "expected_layout": null, "nonce": "1", "ts": %f}'
        % (HANDSHAKE_VERSION, time.time())
    )
    stolen = request_mac(KEY, "GetAgentInfo", body.replace(b'"1"', b'"2"'))
    with pytest.raises(grpc.RpcError) as e:
        _raw(server.address, _FULL_METHOD, body, ((MAC_METADATA, stolen),))
    assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
    # the control: that body with its own MAC is answered
    assert b"nixl_agent_metadata" in _raw(
        server.address,
        _FULL_METHOD,
        body,
        ((MAC_METADATA, request_mac(KEY, "GetAgentInfo", body)),),
    )


def test_forged_release_is_refused_and_frees_nothing(server, worker):
    worker.start_load_kv(PDConnectorMetadata(leases=[Lease("req-1", "a" * 32, 60.0)]))
    for key in (None, OTHER):
        with pytest.raises(HandshakeError, match="release on .*UNAUTHENTICATED"):
            release_blocks(server.address, ["req-1"], 5.0, key)
    with pytest.raises(grpc.RpcError) as e:
        _raw(server.address, _FULL_RELEASE_METHOD, b'{"request_ids": ["req-1"]}')
    assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert server.released == [] and worker.get_transfer_results().finished_sending == set()
    release_blocks(server.address, ["req-1"], 5.0, KEY)  # the control
    assert server.released == [["req-1"]] and worker.get_transfer_results().finished_sending == {
        "req-1"
    }


def test_an_impostor_server_is_not_believed(worker):
    """A listener without the secret (another local user on a freed port, a wrong address)
    cannot hand decode a layout or a lease answer."""
    for key in (None, OTHER):
        with HandshakeServer(INFO, on_claim=lambda r, lease, *_: 1000.0, key=key) as impostor:
            with pytest.raises(HandshakeError, match="no valid hkv-mac"):
                request_agent_info(impostor.address, AgentInfoRequest("decode", 0, None), 5.0, KEY)
            with pytest.raises(HandshakeError):
                claim_lease(impostor.address, "req-1", "a" * 32, 5.0, KEY)


def test_a_lease_is_claimed_once(server, worker):
    worker.start_load_kv(PDConnectorMetadata(leases=[Lease("req-2", "b" * 32, 30.0)]))
    remaining = claim_lease(server.address, "req-2", "b" * 32, 5.0, KEY)
    assert 29.0 < remaining <= 30.0
    with pytest.raises(LeaseRefused, match="claimed already"):
        claim_lease(
            server.address, "req-2", "b" * 32, 5.0, KEY
        )  # n > 1's second child, or a replay


def test_wrong_lease_id_unknown_and_expired_are_refused(server, worker):
    worker.start_load_kv(
        PDConnectorMetadata(leases=[Lease("req-3", "c" * 32, 30.0), Lease("req-4", "d" * 32, 0.3)])
    )
    with pytest.raises(LeaseRefused, match="no such lease"):
        claim_lease(server.address, "req-3", "e" * 32, 5.0, KEY)
    t0 = time.monotonic()
    with pytest.raises(LeaseRefused, match="no such lease"):
        claim_lease(server.address, "req-none", "c" * 32, 5.0, KEY)
    assert time.monotonic() - t0 >= CLAIM_WAIT_S * 0.9  # it waited for a late lease first
    time.sleep(0.35)
    with pytest.raises(LeaseRefused, match="lease on its blocks has expired"):
        claim_lease(server.address, "req-4", "d" * 32, 5.0, KEY)
    assert claim_lease(server.address, "req-3", "c" * 32, 5.0, KEY) > 0  # the control
    worker.get_transfer_results()  # req-4 ends (expired); req-3 is released next
    with pytest.raises(LeaseRefused, match="lease on its blocks has expired"):
        claim_lease(server.address, "req-4", "d" * 32, 5.0, KEY)
    worker._released_by_decode(["req-3"])
    assert worker.get_transfer_results().finished_sending == {"req-3"}
    with pytest.raises(LeaseRefused, match="released already"):
        claim_lease(server.address, "req-3", "c" * 32, 5.0, KEY)


def test_a_claim_that_races_the_lease_waits_for_it(server, worker):
    """Decode's claim may arrive before the prefill worker's next step delivers the lease."""
    timer = threading.Timer(
        0.4,
        worker.start_load_kv,
        args=(PDConnectorMetadata(leases=[Lease("req-5", "f" * 32, 9.0)]),),
    )
    timer.start()
    assert 8.0 < claim_lease(server.address, "req-5", "f" * 32, 5.0, KEY) <= 9.0
    timer.join()


def test_leases_ignore_the_wall_clock(server, worker, monkeypatch):
    """The worker's wall clock stepped by an hour either way (NTP, skew between hosts)
    changes nothing: TTLs are relative and counted on the prefill host's monotonic clock.
    (Only the worker module's clock is skewed: grpc's own deadlines use time.time.)"""
    import types

    from hybridkv.connector import pd_worker

    real = time.time
    for i, skew in enumerate((+3600.0, -3600.0)):
        monkeypatch.setattr(
            pd_worker,
            "time",
            types.SimpleNamespace(
                time=lambda s=skew: real() + s, monotonic=time.monotonic, sleep=time.sleep
            ),
        )
        worker.start_load_kv(PDConnectorMetadata(leases=[Lease(f"req-6{i}", "9" * 32, 20.0)]))
        assert worker.get_transfer_results().finished_sending == set()
        assert 19.0 < claim_lease(server.address, f"req-6{i}", "9" * 32, 5.0, KEY) <= 20.0


def _kv():  # noqa: ANN202 - a small KV cache built by vLLM's own allocation code
    import torch
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheGroupSpec
    from vllm.v1.worker.utils import allocate_kv_cache

    from hybridkv.store.vllm_compat import get_kv_cache_config_from_groups

    cfg = VllmConfig()
    cfg.cache_config.kv_cache_layout = "LBHNC"
    groups = [
        KVCacheGroupSpec(
            ["fa.0"],
            FullAttentionSpec(block_size=16, num_kv_heads=1, head_size=64, dtype=torch.bfloat16),
        )
    ]
    config = get_kv_cache_config_from_groups(cfg, groups, 1 << 20)
    return config, allocate_kv_cache(
        config, torch.device("cpu"), cfg.cache_config.get_resolved_kv_cache_layout()
    )


@pytest.mark.parametrize("serves", [False, True])
def test_only_prefill_capable_workers_serve_the_handshake(serves, monkeypatch):
    monkeypatch.setenv("UCX_NET_DEVICES", "lo")
    monkeypatch.setenv("UCX_MODULES", "^ib")
    config, caches = _kv()
    w = PDWorker(
        PDWorkerSettings("engine", 0, 1, "127.0.0.1", 0, 5.0, 5.0, serve_handshake=serves, key=KEY),
        config,
    )
    try:
        w.register_kv_caches(caches)
        meta = w.handshake_metadata()
        if not serves:
            assert meta is None and w._server is None
        else:
            assert meta is not None and meta.port > 0
            info = request_agent_info(
                f"127.0.0.1:{meta.port}", AgentInfoRequest("d", 0, None), 5.0, KEY
            )
            assert info.engine_id == "engine"
    finally:
        w.shutdown()
