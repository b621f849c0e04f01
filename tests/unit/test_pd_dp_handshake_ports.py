"""Each DP rank of a P/D instance serves its own handshake port.

At ``--data-parallel-size`` N vLLM starts N engine cores, each with its own workers and
HybridPDConnector (engine id ``<engine_id>_dp<rank>``), on one host. A configured
``handshake_port`` P is rank 0's; each worker must get a port no other worker of the instance
binds, across DP ranks too: DP rank d, TP rank r of a TP-t instance serves P + d * t + r (as
vLLM's NixlConnector offsets its side-channel port by the DP rank). Two real worker-side
connectors (DP ranks 0 and 1, TP1) with real gRPC handshake servers and NIXL agents.
"""

from __future__ import annotations

import pytest

from hybridkv.cli.server import free_port
from hybridkv.connector.pd_handshake import AgentInfoRequest, request_agent_info
from tests.unit.pd_real_scheduler import model_dir  # noqa: F401 (fixture)
from tests.unit.test_pd_params_auth import _kv


def _producer(model_dir, port: int, dp_rank: int, kv_cache_config):  # noqa: ANN001, ANN202, F811
    """A worker-side HybridPDConnector of DP rank ``dp_rank`` (as vLLM's engine core sets it)."""
    from vllm.config import KVTransferConfig, ModelConfig, VllmConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from hybridkv.connector.pd_connector import HybridPDConnector

    cfg = VllmConfig(model_config=ModelConfig(model=str(model_dir), skip_tokenizer_init=True))
    cfg.kv_transfer_config = KVTransferConfig(
        kv_connector="HybridPDConnector",
        kv_role="kv_producer",
        engine_id=f"prefill_dp{dp_rank}",
        kv_connector_extra_config={"allow_unauthenticated": True, "handshake_port": port},
    )
    cfg.parallel_config.data_parallel_size = 2
    cfg.parallel_config.data_parallel_index = dp_rank
    return HybridPDConnector(cfg, KVConnectorRole.WORKER, kv_cache_config)


def test_two_dp_ranks_with_a_configured_port_each_serve_their_own(model_dir, monkeypatch):  # noqa: F811
    monkeypatch.setenv("UCX_NET_DEVICES", "lo")
    monkeypatch.setenv("UCX_MODULES", "^ib")
    base = free_port()
    connectors = []
    try:
        for dp_rank in range(2):
            config, caches = _kv()
            conn = _producer(model_dir, base, dp_rank, config)
            connectors.append(conn)
            conn.register_kv_caches(caches)
        ports = [c.get_handshake_metadata().port for c in connectors]
        assert ports == [base, base + 1]
        for dp_rank, port in enumerate(ports):
            info = request_agent_info(
                f"127.0.0.1:{port}", AgentInfoRequest("decode", 0, None), 5.0, None
            )
            assert info.engine_id == f"prefill_dp{dp_rank}"
    finally:
        for c in connectors:
            c.shutdown()


@pytest.mark.parametrize(
    "dp, tp, want",
    [(1, 1, [100]), (1, 2, [100, 101]), (2, 1, [100, 101]), (2, 2, [100, 101, 102, 103])],
)
def test_every_dp_and_tp_rank_gets_a_port_of_its_own(dp, tp, want):
    from hybridkv.connector.pd_connector import handshake_port_of

    got = [
        handshake_port_of(100, tp_rank, tp, dp_rank)
        for dp_rank in range(dp)
        for tp_rank in range(tp)
    ]
    assert got == want
    assert handshake_port_of(0, 1, 2, 1) == 0  # 0: a free port, whatever the rank
