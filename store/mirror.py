"""The store's answer to "how much of this prompt can you serve?", decided by vLLM.

The store must decide hits with exactly the rules the scheduler uses, or a
lookup promises tokens the scheduler's KV layout cannot accept (silent
corruption) or misses hits it could serve. vLLM's in-tree Mooncake store
connector copies the coordinator's fixed-point loop for this; hybridkv does
not. :class:`StoreMirror` builds a *real* vLLM coordinator with the scheduler's
arguments (see :mod:`hybridkv.store.geometry`) and swaps its block pool for
:class:`StoreBackedBlockPool`, whose "cached blocks" are the store's keys. The
fixed-point loop, fine-grained hash-unit hits, the EAGLE drop, sliding-window
tails and Mamba checkpoints are then vLLM's own code paths.

Keys are addressed by *hash unit*: a block of any size that holds valid KV up to
token ``t`` is stored under the request's block hash of the hash unit ending at
``t`` (vLLM's ``BlockHashListWithBlockSize`` fingerprints a block by the hash of
its last hash unit, and fine-grained partial entries use the raw unit hash), so
one scheme serves every group and every granularity.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass

from vllm.v1.core.kv_cache_coordinator import replay_boundaries
from vllm.v1.core.kv_cache_utils import (
    KVCacheBlock,
    get_block_hash,
    get_group_id,
    make_block_hash_with_group_id,
)

from hybridkv.store import vllm_compat
from hybridkv.store.geometry import GroupGeometry

# (group id, block hash bytes): one stored object per group per hash unit.
BlockKey = tuple[int, bytes]
# Answers existence for a batch of keys in ONE round trip.
BatchExists = Callable[[Sequence[BlockKey]], Sequence[bool]]


class StoreBackedBlockPool:
    """Duck-typed ``BlockPool`` whose cached-block map is the store's contents.

    vLLM's hit finders only call ``get_cached_block`` and read
    ``hash_block_size`` / ``null_block``; everything else a real pool does
    (allocation, eviction, events) has no meaning for a store.
    """

    def __init__(self, hash_block_size: int) -> None:
        self.hash_block_size = hash_block_size
        self.null_block = KVCacheBlock(block_id=0, is_null=True)
        self._present: Callable[[BlockKey], bool] = lambda key: False

    def bind(self, present: Callable[[BlockKey], bool]) -> None:
        """Point the pool at one lookup's view of the store."""
        self._present = present

    def get_cached_block(
        self, block_hash: bytes, kv_cache_group_ids: list[int]
    ) -> list[KVCacheBlock] | None:
        # Same contract as BlockPool.get_cached_block: a hit only when every
        # group sharing the spec holds the hash.
        for gid in kv_cache_group_ids:
            if not self._present((gid, bytes(block_hash))):
                return None
        out = []
        for gid in kv_cache_group_ids:
            block = KVCacheBlock(block_id=1)
            # The returned block carries its key, so a hit tells the caller
            # exactly which stored object fills which block position.
            block.set_block_hash(make_block_hash_with_group_id(block_hash, gid))
            out.append(block)
        return out


@dataclass(frozen=True)
class StoreHit:
    """A lookup's result.

    ``tokens``: the reconciled hit length, exactly what vLLM's coordinator
    returns over the same contents. ``blocks``: per group, ``(block_index,
    key)`` for every non-null block the hit uses (a sparse group lists only its
    window tail or checkpoint).
    """

    tokens: int
    blocks: tuple[tuple[tuple[int, BlockKey], ...], ...]


class StoreMirror:
    """Store-side hit computation and save/probe planning for one model."""

    def __init__(self, geometry: GroupGeometry) -> None:
        self.geometry = geometry
        self._coordinator = geometry.params.build_coordinator()
        self._pool = StoreBackedBlockPool(geometry.hash_block_size)
        self._coordinator.block_pool = self._pool
        for manager in self._coordinator.single_type_managers:
            manager.block_pool = self._pool
        self._dense_ids = frozenset(geometry.dense_group_ids)

    # ------------------------------------------------------------------ lookup
    def probe_keys(
        self,
        block_hashes: Sequence[bytes],
        max_tokens: int,
        local_dense_tokens: int = 0,
    ) -> list[BlockKey]:
        """Every key a lookup of ``max_tokens`` may consult, minus local ones.

        Dense groups below ``local_dense_tokens`` are held by the local prefix
        cache (the scheduler passes that hit), so they are not probed. Sparse
        groups are probed from the start: their state at a later boundary
        cannot be inferred from a local hit. Fine-grained groups are probed at
        every hash unit, others at their block boundaries. The probe range
        reaches one block past ``max_tokens`` because EAGLE groups match one
        drop unit beyond the candidate before dropping it.
        """
        geo = self.geometry
        unit = geo.hash_block_size
        num_units = len(block_hashes)
        max_block = max(g.block_size for g in geo.groups)
        limit_units = min(num_units, (max_tokens + max_block) // unit)
        keys: list[BlockKey] = []
        for g in geo.groups:
            if not g.prefix_cacheable:
                continue
            step_units = (
                1
                if geo.fine_grained and g.manager_cls.supports_fine_grained_hash_lookup
                else g.block_size // unit
            )
            first_end_unit = step_units
            if g.downward_closed and local_dense_tokens:
                first_end_unit = (local_dense_tokens // unit // step_units + 1) * step_units
            for end_unit in range(first_end_unit, limit_units + 1, step_units):
                keys.append((g.group_id, bytes(block_hashes[end_unit - 1])))
        return keys

    def longest_hit(
        self,
        block_hashes: Sequence[bytes],
        max_tokens: int,
        present: Collection[BlockKey] | BatchExists,
        local_dense_tokens: int = 0,
    ) -> StoreHit:
        """The hit vLLM's coordinator would compute over these contents.

        ``present`` is either the set of keys the store holds, or a batched
        existence call (asked once, for :meth:`probe_keys`). Dense groups are
        taken as present below ``local_dense_tokens``.
        """
        if callable(present):
            probe = self.probe_keys(block_hashes, max_tokens, local_dense_tokens)
            answers = present(probe)
            found = {key for key, ok in zip(probe, answers) if ok}
        else:
            found = present
        local = self._local_hashes(block_hashes, local_dense_tokens)
        dense = self._dense_ids
        self._pool.bind(lambda key: key in found or (key[1] in local and key[0] in dense))
        try:
            blocks_by_group, hit_tokens, _ = self._coordinator.find_longest_cache_hit(
                list(block_hashes), max_tokens
            )
        finally:
            self._pool.bind(lambda key: False)
        per_group = []
        for blocks in blocks_by_group:
            entries = []
            for idx, block in enumerate(blocks):
                if block.is_null or block.block_hash is None:
                    continue
                key = block.block_hash
                entries.append((idx, (get_group_id(key), bytes(get_block_hash(key)))))
            per_group.append(tuple(entries))
        return StoreHit(tokens=hit_tokens, blocks=tuple(per_group))

    def _local_hashes(
        self, block_hashes: Sequence[bytes], local_dense_tokens: int
    ) -> frozenset[bytes]:
        """Hashes of the hash units the local prefix cache holds for dense groups."""
        units = local_dense_tokens // self.geometry.hash_block_size
        return frozenset(bytes(h) for h in block_hashes[:units])

    # -------------------------------------------------------------------- save
    def save_mask(
        self,
        group_id: int,
        start_block: int,
        end_block: int,
        num_prompt_tokens: int,
        shared_prefix_boundary: int = 0,
    ) -> list[bool]:
        """Which of blocks ``[start_block, end_block)`` a save must write.

        Delegates to the group's vLLM manager (``reachable_block_mask``) with
        the arguments its own ``cache_blocks`` uses, so the store keeps exactly
        the blocks a lookup can reach: every block for dense groups, the
        window tails for sliding window, the aligned checkpoints for Mamba.
        """
        geo = self.geometry
        group = geo.groups[group_id]
        n = end_block - start_block
        if not group.prefix_cacheable:
            return [False] * n
        manager = self._coordinator.single_type_managers[group_id]
        boundaries = list(
            replay_boundaries(
                num_prompt_tokens,
                geo.scheduler_block_size,
                use_eagle=bool(vllm_compat.eagle_drop_group_ids(self._coordinator)),
            )
        )
        if shared_prefix_boundary:
            boundaries.append(shared_prefix_boundary)
        mask = group.manager_cls.reachable_block_mask(
            start_block=start_block,
            end_block=end_block,
            alignment_tokens=manager.cache_hit_alignment_tokens,
            kv_cache_spec=group.spec,
            use_eagle=manager.use_eagle,
            retention_interval=geo.retention_interval,
            reachable_boundaries=boundaries,
            dcp_world_size=manager.dcp_world_size,
        )
        mask = [True] * n if mask is None else list(mask)
        if group.is_mamba:
            # vLLM's dense Mamba mask keeps every block, but its finder only
            # accepts a state block that ends on the hit alignment; others can
            # never serve a hit (and in align mode usually hold no state).
            align = manager.cache_hit_alignment_tokens
            mask = [
                m and ((start_block + i + 1) * group.block_size) % align == 0
                for i, m in enumerate(mask)
            ]
        return mask

    def block_key(self, group_id: int, block_hashes: Sequence[bytes], end_token: int) -> BlockKey:
        """Key of group ``group_id``'s object holding valid KV up to ``end_token``."""
        unit = self.geometry.hash_block_size
        assert end_token % unit == 0, "objects end on hash-unit boundaries"
        return (group_id, bytes(block_hashes[end_token // unit - 1]))
