"""What hybridkv's connector classes declare to vLLM (connector/vllm_hooks.py), asked the way vLLM asks.

vLLM asks these of the CLASS, through ``KVConnectorFactory`` and MultiConnector,
before any connector instance exists; the answers cannot depend on the role or
the device, and these tests ask for every role and ``kv_buffer_device``.
"""

from __future__ import annotations

import pytest
from vllm.config import KVTransferConfig
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1

from hybridkv.connector.pd_connector import HybridPDConnector
from hybridkv.connector.store_connector import HybridStoreConnector
from hybridkv.store import vllm_compat

ROLES = ("kv_producer", "kv_consumer", "kv_both")
DEVICES = ("cuda", "cpu")


def _config(name: str, role: str, device: str) -> KVTransferConfig:
    return KVTransferConfig(
        kv_connector=name,
        kv_role=role,
        kv_buffer_device=device,
        kv_connector_module_path="hybridkv.connector",
    )


def _multi(role: str, device: str, *children: str) -> KVTransferConfig:
    return KVTransferConfig(
        kv_connector="MultiConnector",
        kv_role=role,
        kv_buffer_device=device,
        kv_connector_extra_config={
            "connectors": [
                {
                    "kv_connector": c,
                    "kv_role": role,
                    "kv_connector_module_path": "hybridkv.connector",
                }
                if c.startswith("Hybrid")
                else {"kv_connector": c, "kv_role": role}
                for c in children
            ]
        },
    )


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("role", ROLES)
def test_kv_cache_access_per_connector(role, device):
    """0.34: P/D registers the KV cache with NIXL and exports it to same-host peers (as vLLM's
    NixlConnector with a device buffer); the store registers it with Mooncake. MultiConnector ORs
    its children's flags. Before 0.34 vLLM has no such hook and no enum: nothing asks."""
    if not hasattr(KVConnectorBase_V1, "kv_cache_access"):
        assert vllm_compat.kv_cache_access_flags("REGISTERS") is None
        return
    from vllm.config.kv_transfer import KVCacheAccess

    pd = KVConnectorFactory.kv_cache_access(_config("HybridPDConnector", role, device))
    st = KVConnectorFactory.kv_cache_access(_config("HybridStoreConnector", role, device))
    both = KVConnectorFactory.kv_cache_access(
        _multi(role, device, "HybridPDConnector", "HybridStoreConnector")
    )
    assert pd == KVCacheAccess.REGISTERS | KVCacheAccess.EXPORTS_FABRIC
    assert st == KVCacheAccess.REGISTERS
    assert both == KVCacheAccess.REGISTERS | KVCacheAccess.EXPORTS_FABRIC
    assert pd.needs_single_chunk() and st.needs_single_chunk()


@pytest.mark.parametrize("role", ROLES)
def test_sleep_mode_declined_and_lookahead_hashes_per_connector(role):
    """Sleep/wake re-commits KV memory that hybridkv's workers registered and advertised to
    peers, so both classes answer False (vLLM then refuses --enable-sleep-mode at startup).
    Lookahead block hashes: both True (the store's keys are the scheduler's hashes; P/D hands
    over only blocks whose hashes decode computes); a MultiConnector answers True only if every
    child does."""
    answers = {HybridPDConnector: True, HybridStoreConnector: True}
    for cls, lookahead in answers.items():
        cfg = _config(cls.__name__, role, "cuda")
        if hasattr(KVConnectorBase_V1, "supports_sleep_mode"):
            assert cls.supports_sleep_mode(cfg) is False
        assert cls.supports_lookahead_block_hashes(cfg) is lookahead
    if hasattr(KVConnectorBase_V1, "supports_sleep_mode"):
        multi = _multi(role, "cuda", "HybridPDConnector", "HybridStoreConnector")
        cls = KVConnectorFactory.get_connector_class(multi)
        assert cls.supports_sleep_mode(multi) is False
        if hasattr(cls, "supports_lookahead_block_hashes"):  # 0.34
            assert cls.supports_lookahead_block_hashes(multi) is True
            store_and_sibling = _multi(
                role, "cuda", "HybridStoreConnector", "MooncakeStoreConnector"
            )
            assert cls.supports_lookahead_block_hashes(store_and_sibling) is True


def test_may_load_async_is_vllms_default():
    """0.34's ``may_load_async``: neither class overrides it (P/D: ``do_remote_prefill``; a store
    hit is unknown before the lookup)."""
    if not hasattr(KVConnectorBase_V1, "may_load_async"):
        pytest.skip("vLLM < 0.34 has no may_load_async")
    assert HybridPDConnector.may_load_async is KVConnectorBase_V1.may_load_async
    assert HybridStoreConnector.may_load_async is KVConnectorBase_V1.may_load_async
