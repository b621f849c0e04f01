"""vLLM general plugin: makes ``"kv_connector": "HybridStoreConnector"`` work without a module path.

vLLM calls every ``vllm.general_plugins`` entry point in each of its processes
(frontend, engine core, workers) before building connectors. The name equals
the class name because MultiConnector rebuilds child stats by class name.
"""

from __future__ import annotations

CONNECTORS = {
    "HybridStoreConnector": "hybridkv.connector.store_connector",
    "HybridPDConnector": "hybridkv.connector.pd_connector",
}


def register() -> None:
    """Idempotent: vLLM raises on a second registration of the same name."""
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    for name, module in CONNECTORS.items():
        if name not in KVConnectorFactory._registry:
            KVConnectorFactory.register_connector(name, module, name)
