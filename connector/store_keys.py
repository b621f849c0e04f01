"""The key schema both sides of HybridStoreConnector derive from the same config.

The scheduler probes and the workers write with this schema; both build it
from values every process has (model, dtype, KV cache groups, parallel sizes),
so a lookup names exactly the objects a save wrote.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from vllm.v1.kv_cache_interface import KVCacheConfig

from hybridkv.connector.block_layout import layout_rows
from hybridkv.store.keys import KeySchema, kv_identity

if TYPE_CHECKING:
    from vllm.config import VllmConfig


def store_key_schema(
    vllm_config: "VllmConfig",
    kv_cache_config: KVCacheConfig,
    namespace: str,
    tp_rank: int = 0,
    pp_rank: int = 0,
) -> KeySchema:
    """Schema for one rank; objects are shared only between identical layouts."""
    model = vllm_config.model_config
    parallel = vllm_config.parallel_config
    rows = layout_rows(kv_cache_config)
    rows.append({"namespace": namespace})
    return KeySchema.create(
        model_name=str(model.model),
        dtype=str(model.dtype),
        layout_rows=rows,
        tp_size=parallel.tensor_parallel_size,
        tp_rank=tp_rank,
        pp_size=parallel.pipeline_parallel_size,
        pp_rank=pp_rank,
        identity=kv_identity(vllm_config),
    )

