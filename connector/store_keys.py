"""The key schema both sides of HybridStoreConnector derive from the same config.

The scheduler probes and the workers write with this schema; both build it
from values every process has (model, dtype, KV cache groups, parallel sizes),
so a lookup names exactly the objects a save wrote.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from vllm.v1.kv_cache_interface import KVCacheConfig

from hybridkv.connector.block_layout import layout_rows
from hybridkv.store.keys import KeySchema, kv_identity
from hybridkv.store.mirror import GroupedKeys

if TYPE_CHECKING:
    from vllm.config import VllmConfig


def store_key_schema(
    vllm_config: "VllmConfig",
    kv_cache_config: KVCacheConfig,
    namespace: str,
    tp_rank: int = 0,
    pp_rank: int = 0,
    tenant: str = "",
) -> KeySchema:
    """Schema for one rank; objects are shared only between identical layouts.

    ``tenant`` (store_auth.StoreSecret.tenant: an id of the deployment secret, '' without
    one) keeps deployments with different secrets on different keys."""
    model = vllm_config.model_config
    parallel = vllm_config.parallel_config
    rows = layout_rows(kv_cache_config)
    rows.append({"namespace": namespace})
    if tenant:
        rows.append({"tenant": tenant})
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


def rank_schemas(schema: KeySchema) -> tuple[KeySchema, ...]:
    """The schema as every tensor-parallel rank names its objects (rank 0 first).

    Each rank stores its own shard of every group under its own rank part (KV heads,
    Mamba/linear-attention heads and window tails alike: shards of one block are never
    identical, so none is deduplicated). The scheduler holds rank 0's schema and needs
    every rank's name to decide a hit.
    """
    return tuple(schema.for_rank(r, schema.pp_rank) for r in range(schema.tp_size))


class AllRankKeys:
    """One batched existence query over every rank's object of each block.

    A block is present only when EVERY rank holds its object: a hit that one rank
    cannot load fails that rank's load and the whole request recomputes.
    """

    def __init__(self, schema: KeySchema) -> None:
        self._schemas = rank_schemas(schema)

    @property
    def num_ranks(self) -> int:
        return len(self._schemas)

    def names(self, keys: Sequence[tuple[int, bytes]]) -> list[str]:
        """Store keys of ``keys`` (group, block hash), rank-major within each block.

        A :class:`GroupedKeys` (what ``StoreMirror.lookup`` asks) is named a group
        at a time (``KeySchema.names``), without a tuple per key."""
        schemas = self._schemas
        if not isinstance(keys, GroupedKeys):
            return [s.key(g, h) for g, h in keys for s in schemas]
        out: list[str] = []
        for gid, hashes in keys.parts:
            if len(schemas) == 1:
                out += schemas[0].names(gid, hashes)
            else:
                out += [
                    n
                    for per_block in zip(*(s.names(gid, hashes) for s in schemas))
                    for n in per_block
                ]
        return out

    def all_present(self, found: Sequence[bool]) -> list[bool]:
        """Fold :meth:`names`' answers back to one per block: present on every rank."""
        n = len(self._schemas)
        if len(found) % n:
            raise ValueError(f"{len(found)} answers for {n} ranks")
        if n == 1:
            return list(found)
        return [all(found[i : i + n]) for i in range(0, len(found), n)]
