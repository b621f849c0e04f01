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

from collections import Counter
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass

from vllm.v1.core.kv_cache_coordinator import replay_boundaries
from vllm.v1.core.kv_cache_utils import KVCacheBlock

from hybridkv.store import vllm_compat
from hybridkv.store.geometry import GroupGeometry

# (group id, block hash bytes): one stored object per group per hash unit.
BlockKey = tuple[int, bytes]
# Answers existence for a batch of keys in ONE round trip.
BatchExists = Callable[[Sequence[BlockKey]], Sequence[bool]]


class _StoredBlock:
    """What the pool hands vLLM's finders for a hit: a stand-in carrying its store key.

    The finders only collect, position and trim the blocks they are given (they
    read no field of them), so a slotted object replaces a ``KVCacheBlock`` plus
    its hash-with-group bytes: a long-prompt lookup makes tens of thousands.
    """

    __slots__ = ("key",)
    is_null = False
    block_id = 1

    def __init__(self, key: BlockKey) -> None:
        self.key = key


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
        # Every key vLLM's finders read during one bound lookup (None: not recorded).
        self.consulted: set[BlockKey] | None = None

    def bind(self, present: Callable[[BlockKey], bool], record: bool = False) -> None:
        """Point the pool at one lookup's view of the store."""
        self._present = present
        self.consulted = set() if record else None

    def get_cached_block(
        self, block_hash: bytes, kv_cache_group_ids: list[int]
    ) -> list[_StoredBlock] | None:
        # Same contract as BlockPool.get_cached_block: a hit only when every
        # group sharing the spec holds the hash. The returned blocks carry their
        # keys, so a hit tells exactly which stored object fills which position.
        h = bytes(block_hash)
        out = []
        for gid in kv_cache_group_ids:
            key = (gid, h)
            if self.consulted is not None:
                self.consulted.add(key)
            if not self._present(key):
                return None
            out.append(_StoredBlock(key))
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


@dataclass(frozen=True)
class ProbedHit:
    """A :meth:`StoreMirror.lookup`: the hit plus what it cost.

    ``answers``: every key asked (present or not), reusable by a later
    re-decision. ``probed`` / ``consulted``: per group, keys asked vs distinct
    keys vLLM's coordinator read (local dense keys included; empty unless
    recorded). ``fallback``: the
    third round trip was needed. ``unasked_reads``: keys the final run read that
    were never asked nor local (always 0: the answer is exact).
    """

    hit: StoreHit
    answers: dict[BlockKey, bool]
    round_trips: int
    fallback: bool
    unasked_reads: int  # keys the coordinator read but nobody asked (read as absent): 0
    probed: tuple[int, ...]
    consulted: tuple[int, ...]

    @property
    def found(self) -> frozenset[BlockKey]:
        return frozenset(k for k, ok in self.answers.items() if ok)


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
    def lookup(
        self,
        block_hashes: Sequence[bytes],
        max_tokens: int,
        exists: BatchExists,
        local_dense_tokens: int = 0,
        known: Mapping[BlockKey, bool] | None = None,
        record: bool = False,
    ) -> "ProbedHit":
        """The coordinator's hit, asking the store only for keys it can consult.

        vLLM's coordinator reads dense groups block by block from the start up
        to their first miss, and sparse groups only right-to-left from the
        candidate until a window tail / checkpoint is found. So:

        1. one batched ``exists`` of the coarsest dense group(s) at their own
           block boundaries: its first miss bounds every dense group, hence the
           hit (``cap``; the coordinator is then asked for at most ``cap``
           tokens, which cannot change its answer, and so never reads a dense
           key past it);
        2. one batched ``exists`` of the finer dense groups' boundaries up to
           ``cap``, every hash unit next to ``cap`` (fine-grained tails), and
           the sparse groups around the candidate only (window tails, Mamba
           checkpoints): :meth:`_near_keys`;
        3. vLLM's coordinator over the answers. A key it reads that was never
           asked is recorded; only if there is one (a sparse state far below the
           candidate, a finer dense group shorter than the coarse one) is one
           more ``exists`` sent: every key :meth:`probe_keys` lists up to
           ``cap``, after which the answer is complete and exact.

        ``known``: answers already had (re-deciding at a smaller grant); keys
        in it are not asked again. ``record``: count the keys the coordinator
        reads (``ProbedHit.consulted``; tests and benchmarks).
        """
        geo = self.geometry
        unit = geo.hash_block_size
        answers: dict[BlockKey, bool] = dict(known or {})
        probed: Counter[int] = Counter()
        trips = 0

        def ask(keys: list[BlockKey]) -> None:
            nonlocal trips
            keys = [k for k in dict.fromkeys(keys) if k not in answers]
            if not keys:
                return
            trips += 1
            for key, ok in zip(keys, exists(keys), strict=True):
                answers[key] = bool(ok)
            probed.update(g for g, _ in keys)

        local = self._local_hashes(block_hashes, local_dense_tokens)
        dense_ids = self._dense_ids
        limit_tokens = self._probe_limit_units(len(block_hashes), max_tokens) * unit
        dense = [g for g in geo.groups if g.group_id in dense_ids]
        cap, bound = max_tokens, min(max_tokens, limit_tokens)
        if dense:
            coarse_bs = max(g.block_size for g in dense)
            coarse = [g for g in dense if g.block_size == coarse_bs]
            grids = [self._grid_keys(g, block_hashes, local_dense_tokens, limit_tokens, coarse_bs) for g in coarse]
            ask([key for grid in grids for key in grid])
            # Phase 1 of each coarse finder: the leading run of present blocks (local ones count).
            start = local_dense_tokens // coarse_bs * coarse_bs
            bound = min(
                start + coarse_bs * next((i for i, key in enumerate(grid) if not answers[key]), len(grid))
                for grid in grids
            )
            cap = min(max_tokens, bound + coarse_bs)
        ask(self._near_keys(block_hashes, cap, bound, local_dense_tokens))
        hit, unknown, consulted = self._decide(block_hashes, cap, answers, local, False, record)
        fallback = bool(unknown)
        if fallback:
            ask(self.probe_keys(block_hashes, cap, local_dense_tokens))
            hit, unknown, consulted = self._decide(block_hashes, cap, answers, local, False, record)
        return ProbedHit(
            hit=hit,
            answers=answers,
            round_trips=trips,
            fallback=fallback,
            unasked_reads=len(unknown),
            probed=tuple(probed[g.group_id] for g in geo.groups),
            consulted=tuple(Counter(gid for gid, _ in consulted)[g.group_id] for g in geo.groups)
            if record
            else (),
        )

    def _probe_limit_units(self, num_units: int, max_tokens: int) -> int:
        """Hash units a lookup may read: one block past ``max_tokens`` (EAGLE's margin)."""
        max_block = max(g.block_size for g in self.geometry.groups)
        return min(num_units, (max_tokens + max_block) // self.geometry.hash_block_size)

    def _step_units(self, group) -> int:  # noqa: ANN001 - GroupInfo
        """Hash units between two keys a finder of this group can read."""
        geo = self.geometry
        if geo.fine_grained and group.manager_cls.supports_fine_grained_hash_lookup:
            return 1
        return group.block_size // geo.hash_block_size

    def _grid_keys(
        self, group, block_hashes: Sequence[bytes], lo: int, hi: int, step_tokens: int  # noqa: ANN001
    ) -> list[BlockKey]:
        """Keys of ``group`` ending at multiples of ``step_tokens`` in ``(lo, hi]``."""
        unit = self.geometry.hash_block_size
        step = step_tokens // unit
        first = (max(lo, 0) // unit // step + 1) * step
        last = min(hi // unit, len(block_hashes))
        gid = group.group_id
        return [(gid, bytes(block_hashes[e - 1])) for e in range(first, last + 1, step)]

    def _near_keys(
        self, block_hashes: Sequence[bytes], cap: int, bound: int, local_dense_tokens: int
    ) -> list[BlockKey]:
        """Second round trip: what the coordinator reads once the dense bound is known.

        Dense groups: block boundaries up to the reach past ``cap`` and, where
        fine-grained, every hash unit above ``bound`` (the first non-full block's
        interior). Sparse groups: their probe grid over the span a hit near the
        bound can need (one window for sliding window, none for Mamba) plus two
        scheduler blocks of slack for alignment; anything deeper is the fallback.
        """
        geo = self.geometry
        unit = geo.hash_block_size
        reach = self._probe_limit_units(len(block_hashes), cap) * unit
        slack = 2 * geo.scheduler_block_size
        keys: list[BlockKey] = []
        for g in geo.groups:
            if not g.prefix_cacheable:
                continue
            step = self._step_units(g) * unit
            if g.group_id in self._dense_ids:
                keys += self._grid_keys(g, block_hashes, local_dense_tokens, reach, g.block_size)
                if step < g.block_size:
                    # Its finder's phase 1 stops at the bound or at cap's last full block.
                    tail = min(bound, cap // g.block_size * g.block_size)
                    keys += self._grid_keys(g, block_hashes, max(local_dense_tokens, tail), reach, step)
                continue
            window = getattr(g.spec, "sliding_window", 0) or 0
            span = -(-max(window - 1, 0) // g.block_size) * g.block_size + (g.block_size if window else 0)
            keys += self._grid_keys(g, block_hashes, bound - span - slack, reach, step)
        return keys

    def _decide(
        self,
        block_hashes: Sequence[bytes],
        max_tokens: int,
        answers: Mapping[BlockKey, bool] | Collection[BlockKey],
        local: frozenset[bytes],
        complete: bool,
        record: bool = False,
    ) -> tuple["StoreHit", set[BlockKey], set[BlockKey]]:
        """vLLM's coordinator over known answers: (hit, unasked keys it read, keys it read).

        ``complete``: ``answers`` is everything the store holds (a key not in it
        is absent). Otherwise a key with no answer reads as absent and is
        reported, so the caller knows whether the hit is exact.
        """
        dense = self._dense_ids
        unknown: set[BlockKey] = set()
        if complete:
            has = (
                (lambda key: answers.get(key, False))  # type: ignore[union-attr]
                if isinstance(answers, Mapping)
                else answers.__contains__
            )

            def present(key: BlockKey) -> bool:
                return has(key) or (key[1] in local and key[0] in dense)
        else:
            get = answers.get  # type: ignore[union-attr]

            def present(key: BlockKey) -> bool:
                if key[1] in local and key[0] in dense:
                    return True
                ok = get(key)
                if ok is None:
                    unknown.add(key)
                    return False
                return ok

        self._pool.bind(present, record=record)
        try:
            blocks_by_group, hit_tokens, _ = self._coordinator.find_longest_cache_hit(
                list(block_hashes), max_tokens
            )
            consulted = self._pool.consulted if record else set()
        finally:
            self._pool.bind(lambda key: False)
        return self._store_hit(blocks_by_group, hit_tokens), unknown, consulted

    @staticmethod
    def _store_hit(blocks_by_group, hit_tokens: int) -> "StoreHit":  # noqa: ANN001 - pool blocks
        return StoreHit(
            tokens=hit_tokens,
            blocks=tuple(
                tuple((idx, block.key) for idx, block in enumerate(blocks) if not block.is_null)
                for blocks in blocks_by_group
            ),
        )

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
        limit_units = self._probe_limit_units(len(block_hashes), max_tokens)
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
        return self._decide(block_hashes, max_tokens, found, local, complete=True)[0]

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
