"""P/D transfers stop when vLLM releases the KV cache's memory (unregister_kv_caches).

vLLM 0.34 calls ``unregister_kv_caches`` before giving back the KV cache's physical memory
(``release_kv_cache_memory``, a checkpoint, a weight update borrowing the cache, sleep) and
``restore_kv_caches`` after re-committing it, without asking ``supports_sleep_mode`` except
for sleep. A real worker-side HybridPDConnector (kv_producer, a real NIXL agent over a CPU KV
cache allocated by vLLM, a real gRPC handshake service) holds a lease; after the release no
decode peer may fetch its agent metadata (registrations of the released memory) or have a
lease claim granted (the guard that makes a decode discard a READ it already posted), and
restoring the memory does not bring them back. The store's release waits for its own jobs,
whose gathers and scatters touch the cache (a real StoreWorker on a real mooncake_master).
"""

from __future__ import annotations

import pytest

from hybridkv.cli.server import free_port
from hybridkv.connector.pd_handshake import (
    AgentInfoRequest,
    HandshakeError,
    claim_lease,
    request_agent_info,
)
from hybridkv.connector.pd_metadata import Lease, PDConnectorMetadata
from hybridkv.connector.store_connector import HybridStoreConnector
from hybridkv.connector.store_metadata import BlockBatch, SaveJob, StoreConnectorMetadata
from hybridkv.store.keys import KeySchema
from tests.unit.pd_real_scheduler import model_dir  # noqa: F401 (fixture)
from tests.unit.store_rig import StoreRig, no_env_secret, rigs, store  # noqa: F401 - fixtures
from tests.unit.test_pd_params_auth import _kv


def _producer(model_dir, port: int, kv_cache_config):  # noqa: ANN001, ANN202, F811
    from vllm.config import KVTransferConfig, ModelConfig, VllmConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from hybridkv.connector.pd_connector import HybridPDConnector

    cfg = VllmConfig(model_config=ModelConfig(model=str(model_dir), skip_tokenizer_init=True))
    cfg.kv_transfer_config = KVTransferConfig(
        kv_connector="HybridPDConnector",
        kv_role="kv_producer",
        engine_id="prefill-release",
        kv_connector_extra_config={"allow_unauthenticated": True, "handshake_port": port},
    )
    return HybridPDConnector(cfg, KVConnectorRole.WORKER, kv_cache_config)


def test_released_kv_memory_stops_p_d_transfers_until_restart(model_dir, monkeypatch):  # noqa: F811
    monkeypatch.setenv("UCX_NET_DEVICES", "lo")
    monkeypatch.setenv("UCX_MODULES", "^ib")
    config, caches = _kv()
    conn = _producer(model_dir, free_port(), config)
    try:
        conn.register_kv_caches(caches)
        address = f"127.0.0.1:{conn.get_handshake_metadata().port}"
        ask = AgentInfoRequest("decode", 0, None)
        assert request_agent_info(address, ask, 5.0).engine_id == "prefill-release"
        # The engine step that hands the worker two finished requests' leases.
        conn.bind_connector_metadata(
            PDConnectorMetadata(leases=[Lease("r1", "a" * 32, 30.0), Lease("r2", "b" * 32, 30.0)])
        )
        conn.start_load_kv(None)
        assert claim_lease(address, "r1", "a" * 32, 5.0) > 0  # granted while memory is held

        conn.unregister_kv_caches()  # as vLLM's worker calls it, before releasing the memory
        with pytest.raises(HandshakeError, match="unreachable"):
            request_agent_info(address, ask, 2.0)
        with pytest.raises(HandshakeError, match="UNAVAILABLE"):
            claim_lease(address, "r2", "b" * 32, 2.0, wait_s=0)
        assert conn.get_handshake_metadata() is None

        conn.unregister_kv_caches()  # idempotent, as vLLM's contract says
        conn.restore_kv_caches()  # memory back: transfers stay off until a restart
        with pytest.raises(HandshakeError, match="unreachable"):
            request_agent_info(address, ask, 2.0)
    finally:
        conn.shutdown()


def test_store_release_waits_for_the_jobs_that_touch_the_kv_cache(store, rigs):  # noqa: F811
    """An asynchronous save of 64 blocks is queued when vLLM unregisters the KV cache: the
    call returns only once the save has read every block (all 64 saved)."""
    rig = StoreRig(store[0], KeySchema(model_id="release", layout_id="fa16"), 64, seed=3)
    rigs.append(rig)
    batch = BlockBatch()
    for b in range(64):
        batch.add(0, b.to_bytes(4, "big") * 8, b)
    rig.worker.wait_for_save(StoreConnectorMetadata(saves=[SaveJob(1, batch)]))
    connector = HybridStoreConnector.__new__(HybridStoreConnector)  # worker side: only _worker
    connector._worker = rig.worker
    connector.unregister_kv_caches()
    stats = rig.worker.take_stats()
    assert stats is not None and stats.data.get("saved_blocks") == 64
