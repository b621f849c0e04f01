"""One description of a hybrid model's KV cache groups, read from vLLM itself.

Every hybridkv module asks this object about the groups (block sizes, which
group is EAGLE, which may be trimmed, the hash unit, fine-grained hits) instead
of re-reading ``KVCacheSpec``s. The values are not recomputed here: they are
read off a real vLLM ``KVCacheCoordinator`` built with exactly the arguments the
scheduler's ``KVCacheManager`` gets, so they cannot drift from vLLM's own
resolution (``resolve_kv_cache_block_sizes``, ``partial_hash_hits_enabled``,
the EAGLE-group fallback, DCP block scaling).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from vllm.v1.core.kv_cache_coordinator import (
    HybridKVCacheCoordinator,
    KVCacheCoordinator,
    get_kv_cache_coordinator,
)
from vllm.v1.core.single_type_kv_cache_manager import (
    MambaManager,
    SingleTypeKVCacheManager,
)
from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheSpec, MambaSpec

from hybridkv.store import vllm_compat
from hybridkv.store.truncation import is_downward_closed

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.core.kv_cache_manager import KVCacheManager

# A lookup-only coordinator never allocates: two blocks (null + one spare) keep
# BlockPool construction cheap whatever the engine's real pool size is.
_LOOKUP_POOL_BLOCKS = 2


def state_column(num_tokens: int, block_size: int) -> int:
    """The column of a Mamba (align mode) group's block table that holds the state after
    ``num_tokens`` tokens: ``cdiv(num_tokens, block_size) - 1``, where vLLM's kernels read it.

    With speculative decoding vLLM appends ``num_speculative_blocks`` scratch blocks after that
    column, so "the table's last block" is a scratch block, never the state. Every reader of a
    state block (P/D pairing, store saves and loads) asks this function."""
    return -(-num_tokens // block_size) - 1


@dataclass(frozen=True)
class CoordinatorParams:
    """The arguments the scheduler passes to vLLM's KV cache coordinator.

    Kept as data so the store mirror and the geometry can rebuild an identical
    coordinator anywhere (scheduler process, tests, benchmarks).
    """

    kv_cache_config: KVCacheConfig
    max_model_len: int
    scheduler_block_size: int
    hash_block_size: int
    use_eagle: bool = False
    num_prefill_lookahead: int = 0
    dcp_world_size: int = 1
    pcp_world_size: int = 1
    # Tokens after each block its hash covers (vLLM's lookahead block hashes; 0: none).
    num_hash_lookahead_tokens: int = 0

    @classmethod
    def from_vllm_config(
        cls, vllm_config: "VllmConfig", kv_cache_config: KVCacheConfig
    ) -> "CoordinatorParams":
        """Resolve the parameters the way ``EngineCore`` and ``Scheduler`` do."""
        from vllm.v1.core.kv_cache_utils import resolve_kv_cache_block_sizes

        scheduler_block_size, hash_block_size = resolve_kv_cache_block_sizes(
            kv_cache_config, vllm_config
        )
        spec_cfg = vllm_config.speculative_config
        lookahead = vllm_compat.hash_lookahead_tokens(vllm_config)
        # Lookahead hashes prove the block's boundary token: the scheduler drops no EAGLE block.
        use_eagle = bool(spec_cfg is not None and spec_cfg.use_eagle_block_drop() and not lookahead)
        return cls(
            kv_cache_config=kv_cache_config,
            max_model_len=vllm_config.model_config.max_model_len,
            scheduler_block_size=scheduler_block_size,
            hash_block_size=hash_block_size,
            use_eagle=use_eagle,
            num_prefill_lookahead=vllm_config.num_prefill_lookahead_tokens,
            dcp_world_size=vllm_config.parallel_config.decode_context_parallel_size,
            pcp_world_size=1,
            num_hash_lookahead_tokens=lookahead,
        )

    @classmethod
    def from_kv_cache_manager(cls, manager: "KVCacheManager") -> "CoordinatorParams":
        """Read the parameters back off a live ``KVCacheManager``."""
        coordinator = manager.coordinator
        reprefill = coordinator.num_reprefillable_tokens
        return cls(
            kv_cache_config=manager.kv_cache_config,
            max_model_len=manager.max_model_len,
            scheduler_block_size=coordinator.scheduler_block_size,
            hash_block_size=coordinator.block_pool.hash_block_size,
            use_eagle=manager.use_eagle,
            num_prefill_lookahead=reprefill + 1 if reprefill else 0,
            dcp_world_size=getattr(coordinator, "dcp_world_size", 1),
            pcp_world_size=getattr(coordinator, "pcp_world_size", 1),
            num_hash_lookahead_tokens=vllm_compat.hash_lookahead_tokens(coordinator.block_pool),
        )

    def build_coordinator(self) -> KVCacheCoordinator:
        """A real vLLM coordinator over a tiny block pool, for lookups only."""
        lookup_config = dataclasses.replace(self.kv_cache_config, num_blocks=_LOOKUP_POOL_BLOCKS)
        return get_kv_cache_coordinator(
            kv_cache_config=lookup_config,
            max_model_len=self.max_model_len,
            max_in_flight_tokens=self.max_model_len,
            use_eagle=self.use_eagle,
            enable_caching=True,
            enable_kv_cache_events=False,
            dcp_world_size=self.dcp_world_size,
            pcp_world_size=self.pcp_world_size,
            scheduler_block_size=self.scheduler_block_size,
            hash_block_size=self.hash_block_size,
            num_prefill_lookahead=self.num_prefill_lookahead,
            **vllm_compat.coordinator_lookahead_kwargs(self.num_hash_lookahead_tokens),
        )


@dataclass(frozen=True)
class GroupInfo:
    """What hybridkv needs to know about one KV cache group."""

    group_id: int
    spec: KVCacheSpec
    spec_kind: str
    block_size: int  # DCP-resolved: the manager's block size, not the spec's
    prefix_cacheable: bool
    transfer_enabled: bool
    is_eagle: bool
    mamba_cache_mode: str | None
    manager_cls: type[SingleTypeKVCacheManager]
    downward_closed: bool
    layer_names: tuple[str, ...]

    @property
    def is_mamba(self) -> bool:
        return isinstance(self.spec, MambaSpec)


@dataclass(frozen=True)
class GroupGeometry:
    """Per-group facts plus the scheduler-wide block sizes of one model."""

    params: CoordinatorParams
    groups: tuple[GroupInfo, ...]
    scheduler_block_size: int
    hash_block_size: int
    fine_grained: bool  # sub-block (hash-unit) hits enabled
    cache_hit_alignment_tokens: int
    retention_interval: int | None

    @classmethod
    def from_params(cls, params: CoordinatorParams) -> "GroupGeometry":
        return cls.from_coordinator(params, params.build_coordinator())

    @classmethod
    def from_vllm_config(
        cls, vllm_config: "VllmConfig", kv_cache_config: KVCacheConfig
    ) -> "GroupGeometry":
        return cls.from_params(CoordinatorParams.from_vllm_config(vllm_config, kv_cache_config))

    @classmethod
    def from_kv_cache_manager(cls, manager: "KVCacheManager") -> "GroupGeometry":
        params = CoordinatorParams.from_kv_cache_manager(manager)
        return cls.from_coordinator(params, manager.coordinator)

    @classmethod
    def from_coordinator(
        cls, params: CoordinatorParams, coordinator: KVCacheCoordinator
    ) -> "GroupGeometry":
        groups = []
        for gid, (group, manager) in enumerate(
            zip(params.kv_cache_config.kv_cache_groups, coordinator.single_type_managers)
        ):
            spec = group.kv_cache_spec
            manager_cls = type(manager)
            groups.append(
                GroupInfo(
                    group_id=gid,
                    spec=spec,
                    spec_kind=type(spec).__name__,
                    block_size=manager.block_size,
                    prefix_cacheable=spec.prefix_cacheable,
                    transfer_enabled=group.enable_kv_transfer,
                    is_eagle=bool(manager.use_eagle)
                    or (isinstance(manager, MambaManager) and manager.drop_eagle_checkpoint_block),
                    mamba_cache_mode=getattr(spec, "mamba_cache_mode", None),
                    manager_cls=manager_cls,
                    downward_closed=is_downward_closed(manager_cls),
                    layer_names=tuple(group.layer_names),
                )
            )
        fine_grained = bool(
            isinstance(coordinator, HybridKVCacheCoordinator)
            and coordinator.enable_partial_hash_hits
        )
        alignment = (
            coordinator._cache_hit_alignment_tokens
            if isinstance(coordinator, HybridKVCacheCoordinator)
            else coordinator.scheduler_block_size
        )
        return cls(
            params=params,
            groups=tuple(groups),
            scheduler_block_size=coordinator.scheduler_block_size,
            hash_block_size=coordinator.block_pool.hash_block_size,
            fine_grained=fine_grained,
            cache_hit_alignment_tokens=alignment,
            retention_interval=params.kv_cache_config.prefix_cache_retention_interval,
        )

    @property
    def dense_group_ids(self) -> tuple[int, ...]:
        """Prefix-cacheable groups whose hits are downward-closed."""
        return tuple(g.group_id for g in self.groups if g.prefix_cacheable and g.downward_closed)

    @property
    def sparse_group_ids(self) -> tuple[int, ...]:
        """Prefix-cacheable groups whose hits are NOT downward-closed."""
        return tuple(
            g.group_id for g in self.groups if g.prefix_cacheable and not g.downward_closed
        )

    def describe(self) -> list[dict[str, Any]]:
        """Plain rows for logs and startup messages."""
        return [
            {
                "group": g.group_id,
                "spec": g.spec_kind,
                "block_size": g.block_size,
                "dense": g.downward_closed,
                "eagle": g.is_eagle,
                "cacheable": g.prefix_cacheable,
                "mamba_mode": g.mamba_cache_mode,
                "layers": len(g.layer_names),
            }
            for g in self.groups
        ]
