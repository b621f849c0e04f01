"""vLLM-facing side of hybridkv; ``kv_connector_module_path: "hybridkv.connector"``.

Import is kept lazy so that vLLM's frontend (which imports the connector class
to build its stats) does not pull the store client in.
"""

from __future__ import annotations

from typing import Any

__all__ = ["HybridPDConnector", "HybridStoreConnector"]


def __getattr__(name: str) -> Any:
    if name == "HybridStoreConnector":
        from hybridkv.connector.store_connector import HybridStoreConnector

        return HybridStoreConnector
    if name == "HybridPDConnector":
        from hybridkv.connector.pd_connector import HybridPDConnector

        return HybridPDConnector
    raise AttributeError(f"module 'hybridkv.connector' has no attribute {name!r}")
