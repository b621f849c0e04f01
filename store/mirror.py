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
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from dataclasses import dataclass
from itertools import compress, count, islice, repeat

from vllm.v1.core.kv_cache_coordinator import replay_boundaries
from vllm.v1.core.kv_cache_utils import KVCacheBlock

from hybridkv.store import vllm_compat
from hybridkv.store.geometry import GroupGeometry

# (group id, block hash bytes): one stored object per group per hash unit.
BlockKey = tuple[int, bytes]
# Answers existence for a batch of keys in ONE round trip.
BatchExists = Callable[[Sequence[BlockKey]], Sequence[bool]]


class GroupedKeys(Sequence[BlockKey]):
    """One round trip's keys, held per group: ``parts`` = ``(group id, block hashes)``.

    A long-prompt lookup asks for tens of thousands of keys; holding them as one
    hash list per group (slices of the request's hash list) spares a tuple per
    key, and lets the store side name them a group at a time
    (``AllRankKeys.names``). It is still a ``Sequence`` of ``(group, hash)`` in
    ``parts`` order for any other ``BatchExists``.
    """

    __slots__ = ("parts", "_len")

    def __init__(self, parts: list[tuple[int, list[bytes]]]) -> None:
        self.parts = parts
        self._len = sum(len(hs) for _, hs in parts)

    def __len__(self) -> int:
        return self._len

    def split(self, n: int) -> list["GroupedKeys"]:
        """``n`` contiguous pieces (sizes differing by at most one) that concatenate to these
        keys in order: one store query asked as concurrent parts (``MooncakeBackend.exists_parts``)."""
        n = max(1, min(n, self._len))
        cuts = [self._len * i // n for i in range(1, n)] + [self._len]
        out: list[GroupedKeys] = []
        cur: list[tuple[int, list[bytes]]] = []
        pos = 0  # keys before the current group's start
        cut = iter(cuts)
        end = next(cut)
        for gid, hashes in self.parts:
            lo = 0
            while pos + len(hashes) >= end and lo <= end - pos:
                if end - pos > lo:
                    cur.append((gid, hashes[lo : end - pos]))
                lo = end - pos
                out.append(GroupedKeys(cur))
                cur = []
                end = next(cut, None)
                if end is None:
                    return out
            if lo < len(hashes):
                cur.append((gid, hashes[lo:]))
            pos += len(hashes)
        return out

    def __iter__(self) -> Iterator[BlockKey]:
        for gid, hashes in self.parts:
            yield from zip(repeat(gid), hashes)

    def __getitem__(self, idx):  # noqa: ANN001, ANN204 - Sequence protocol (int or slice)
        if isinstance(idx, slice):
            return list(self)[idx]
        if idx < 0:
            idx += self._len
        for gid, hashes in self.parts:
            if idx < len(hashes):
                return gid, hashes[idx]
            idx -= len(hashes)
        raise IndexError("GroupedKeys index out of range")


class _GroupAnswers(dict):
    """One group's answers, block hash -> present.

    Reading a hash nobody asked reads as absent and is recorded in ``unknown``
    (so the caller knows whether the coordinator's answer is exact); ``in`` does
    not record."""

    __slots__ = ("unknown",)

    def __init__(self, *args) -> None:  # noqa: ANN002 - dict's own arguments
        super().__init__(*args)
        self.unknown: list[bytes] = []

    def __missing__(self, block_hash: bytes) -> bool:
        self.unknown.append(block_hash)
        return False


class _NoAnswers:
    """The pool's view while no lookup is bound: every group empty (every key absent)."""

    def __getitem__(self, group_id: int) -> _GroupAnswers:
        return _GroupAnswers()


class KeyAnswers(Mapping[BlockKey, bool]):
    """Every key a lookup asked -> present, held per group (no tuple per key).

    What :class:`ProbedHit` hands back for a later re-decision (``known=``)."""

    __slots__ = ("_by_group",)

    def __init__(self, by_group: Sequence[Mapping[bytes, bool]]) -> None:
        self._by_group = by_group

    def group(self, group_id: int) -> Mapping[bytes, bool]:
        return self._by_group[group_id]

    def __getitem__(self, key: BlockKey) -> bool:
        gid, h = key
        if 0 <= gid < len(self._by_group) and dict.__contains__(self._by_group[gid], h):
            return dict.__getitem__(self._by_group[gid], h)
        raise KeyError(key)

    def __contains__(self, key: object) -> bool:
        try:
            self[key]  # type: ignore[index]
        except (KeyError, TypeError, ValueError):
            return False
        return True

    def __iter__(self) -> Iterator[BlockKey]:
        for gid, answers in enumerate(self._by_group):
            yield from zip(repeat(gid), answers)

    def __len__(self) -> int:
        return sum(map(len, self._by_group))

    def absent(self, first: int | None = None) -> Iterator[BlockKey]:
        """The keys the store answered absent, per group in the order asked (ascending
        positions within a round trip); ``first``: at most that many per group."""
        for gid, answers in enumerate(self._by_group):
            yield from zip(repeat(gid), islice((h for h, ok in answers.items() if not ok), first))


class StoreBackedBlockPool:
    """Duck-typed ``BlockPool`` whose cached-block map is the store's contents.

    vLLM's hit finders only call ``get_cached_block`` and read
    ``hash_block_size`` / ``null_block``; everything else a real pool does
    (allocation, eviction, events) has no meaning for a store.

    A hit hands vLLM's finders the block hash itself as the "block": they only
    collect, position and trim the blocks they are given (they read no field of
    them; checked on vLLM 0.32 and 0.33, and a field read would raise here rather
    than answer wrongly), so the hit's blocks carry their keys without a stand-in
    object per block (a long-prompt lookup reads tens of thousands).
    """

    def __init__(self, hash_block_size: int) -> None:
        self.hash_block_size = hash_block_size
        self.null_block = KVCacheBlock(block_id=0, is_null=True)
        self._views: Sequence[_GroupAnswers] | _NoAnswers = _NoAnswers()
        # Every key vLLM's finders read during one bound lookup (None: not recorded).
        self.consulted: set[BlockKey] | None = None

    def bind(self, views: Sequence[_GroupAnswers] | None, record: bool = False) -> None:
        """Point the pool at one lookup's answers (per group id); None unbinds."""
        self._views = _NoAnswers() if views is None else views
        self.consulted = set() if record else None
        if record:
            self.get_cached_block = self._recorded_get  # type: ignore[method-assign]
        else:
            self.__dict__.pop("get_cached_block", None)

    def get_cached_block(
        self, block_hash: bytes, kv_cache_group_ids: list[int]
    ) -> list[bytes] | None:
        # Same contract as BlockPool.get_cached_block: a hit only when every
        # group sharing the spec holds the hash.
        views = self._views
        if len(kv_cache_group_ids) == 1:
            return [block_hash] if views[kv_cache_group_ids[0]][block_hash] else None
        for gid in kv_cache_group_ids:
            if not views[gid][block_hash]:
                return None
        return [block_hash] * len(kv_cache_group_ids)

    def _recorded_get(self, block_hash: bytes, kv_cache_group_ids: list[int]) -> list[bytes] | None:
        """``get_cached_block`` that also records every key read (tests, benchmarks)."""
        assert self.consulted is not None
        for gid in kv_cache_group_ids:
            self.consulted.add((gid, block_hash))
            if not self._views[gid][block_hash]:
                return None
        return [block_hash] * len(kv_cache_group_ids)


class HitBlocks(Sequence[tuple[int, BlockKey]]):
    """One group's blocks of a hit: ``(block_index, key)`` for every non-null block.

    Held as the positions and the block hashes vLLM's finders returned (a long
    hit has tens of thousands: no tuple per block until someone iterates). Compares
    equal to any sequence of the same ``(block_index, key)`` pairs.
    """

    __slots__ = ("group_id", "positions", "hashes")

    def __init__(self, group_id: int, positions: Sequence[int], hashes: Sequence[bytes]) -> None:
        self.group_id = group_id
        self.positions = positions
        self.hashes = hashes

    def __len__(self) -> int:
        return len(self.hashes)

    def __iter__(self) -> Iterator[tuple[int, BlockKey]]:
        return zip(self.positions, zip(repeat(self.group_id), self.hashes))

    def __getitem__(self, idx):  # noqa: ANN001, ANN204 - Sequence protocol (int or slice)
        if isinstance(idx, slice):
            return tuple(self)[idx]
        return self.positions[idx], (self.group_id, self.hashes[idx])

    def __eq__(self, other: object) -> bool:
        if isinstance(other, HitBlocks):
            return (
                self.group_id == other.group_id
                and list(self.positions) == list(other.positions)
                and list(self.hashes) == list(other.hashes)
            )
        if isinstance(other, Sequence):
            return tuple(self) == tuple(other)
        return NotImplemented

    def __hash__(self) -> int:
        return hash(tuple(self))

    def __repr__(self) -> str:
        return f"HitBlocks({tuple(self)!r})"


@dataclass(frozen=True)
class StoreHit:
    """A lookup's result.

    ``tokens``: the reconciled hit length, exactly what vLLM's coordinator
    returns over the same contents. ``blocks``: per group, ``(block_index,
    key)`` for every non-null block the hit uses (a sparse group lists only its
    window tail or checkpoint; :class:`HitBlocks`).
    """

    tokens: int
    blocks: tuple[Sequence[tuple[int, BlockKey]], ...]


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
    answers: Mapping[BlockKey, bool]
    round_trips: int
    fallback: bool
    unasked_reads: int  # keys the coordinator read but nobody asked (read as absent): 0
    probed: tuple[int, ...]
    consulted: tuple[int, ...]

    @property
    def found(self) -> frozenset[BlockKey]:
        return frozenset(k for k, ok in self.answers.items() if ok)


def _hash_list(block_hashes: Sequence[bytes]) -> list[bytes]:
    """The request's hashes as a list of exact ``bytes`` (the keys' second half)."""
    hashes = block_hashes if type(block_hashes) is list else list(block_hashes)
    if set(map(type, hashes)) - {bytes}:
        hashes = [bytes(h) for h in hashes]
    return hashes


def _leading_run(answers: _GroupAnswers, hashes: list[bytes]) -> int:
    """How many of ``hashes`` (all answered) are present before the first absent one."""
    found = list(map(answers.__getitem__, hashes))
    try:
        return found.index(False)
    except ValueError:
        return len(found)


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
        assert [g.group_id for g in geometry.groups] == list(range(len(geometry.groups)))

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
           checkpoints): :meth:`_near_parts`;
        3. vLLM's coordinator over the answers. A key it reads that was never
           asked is recorded; only if there is one (a sparse state far below the
           candidate, a finer dense group shorter than the coarse one) is one
           more ``exists`` sent: every key :meth:`probe_keys` lists up to
           ``cap``, after which the answer is complete and exact.

        ``exists`` receives a :class:`GroupedKeys`. ``known``: answers already
        had (re-deciding at a smaller grant); keys in it are not asked again.
        ``record``: count the keys the coordinator reads
        (``ProbedHit.consulted``; tests and benchmarks).
        """
        geo = self.geometry
        unit = geo.hash_block_size
        hashes = _hash_list(block_hashes)
        answers = self._answers_from(known)
        probed = [0] * len(geo.groups)
        trips = 0

        def ask(parts: list[tuple[int, list[bytes]]]) -> None:
            nonlocal trips
            batch = []
            for gid, hs in parts:
                have = answers[gid]
                if have:
                    hs = [h for h in hs if h not in have]
                if hs:
                    batch.append((gid, hs))
            if not batch:
                return
            keys = GroupedKeys(batch)
            found = exists(keys)
            if len(found) != len(keys):
                raise ValueError(f"exists answered {len(found)} of {len(keys)} keys")
            trips += 1
            off = 0
            for gid, hs in batch:
                answers[gid].update(zip(hs, map(bool, found[off : off + len(hs)])))
                probed[gid] += len(hs)
                off += len(hs)

        local_units = local_dense_tokens // unit
        limit_tokens = self._probe_limit_units(len(hashes), max_tokens) * unit
        dense = [g for g in geo.groups if g.group_id in self._dense_ids]
        cap, bound = max_tokens, min(max_tokens, limit_tokens)
        coarse_ids: frozenset[int] = frozenset()
        if dense:
            coarse_bs = max(g.block_size for g in dense)
            coarse_ids = frozenset(g.group_id for g in dense if g.block_size == coarse_bs)
            grids = [
                (gid, self._grid(hashes, local_dense_tokens, limit_tokens, coarse_bs))
                for gid in sorted(coarse_ids)
            ]
            ask(grids)
            # Phase 1 of each coarse finder: the leading run of present blocks (local ones count).
            start = local_dense_tokens // coarse_bs * coarse_bs
            bound = min(start + coarse_bs * _leading_run(answers[gid], hs) for gid, hs in grids)
            cap = min(max_tokens, bound + coarse_bs)
        ask(self._near_parts(hashes, cap, bound, local_dense_tokens, coarse_ids))
        hit, unknown, consulted = self._decide(hashes, cap, answers, local_units, record)
        fallback = bool(unknown)
        if fallback:
            ask(self._probe_parts(hashes, cap, local_dense_tokens))
            hit, unknown, consulted = self._decide(hashes, cap, answers, local_units, record)
        return ProbedHit(
            hit=hit,
            answers=KeyAnswers(answers),
            round_trips=trips,
            fallback=fallback,
            unasked_reads=len(unknown),
            probed=tuple(probed),
            consulted=tuple(Counter(gid for gid, _ in consulted)[g.group_id] for g in geo.groups)
            if record
            else (),
        )

    def _answers_from(self, known: Mapping[BlockKey, bool] | None) -> list[_GroupAnswers]:
        """Per group id, a fresh answer map holding ``known``'s answers."""
        n = len(self.geometry.groups)
        if isinstance(known, KeyAnswers):
            return [_GroupAnswers(known.group(gid)) for gid in range(n)]
        answers = [_GroupAnswers() for _ in range(n)]
        for (gid, h), ok in (known or {}).items():
            answers[gid][bytes(h)] = bool(ok)
        return answers

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

    def _grid(self, hashes: list[bytes], lo: int, hi: int, step_tokens: int) -> list[bytes]:
        """Hashes of the hash units ending at multiples of ``step_tokens`` in ``(lo, hi]``."""
        unit = self.geometry.hash_block_size
        step = step_tokens // unit
        first = (max(lo, 0) // unit // step + 1) * step
        last = min(hi // unit, len(hashes))
        return hashes[first - 1 : last : step]

    def _near_parts(
        self,
        hashes: list[bytes],
        cap: int,
        bound: int,
        local_dense_tokens: int,
        asked_grids: frozenset[int],
    ) -> list[tuple[int, list[bytes]]]:
        """Second round trip: what the coordinator reads once the dense bound is known.

        Dense groups: block boundaries up to the reach past ``cap`` (except the
        groups in ``asked_grids``, whose boundaries round trip 1 asked up to the
        probe limit, which the reach never passes) and, where fine-grained, every
        hash unit above ``bound`` (the first non-full block's interior). Sparse
        groups: their probe grid over the span a hit near the bound can need (one
        window for sliding window, none for Mamba) plus two scheduler blocks of
        slack for alignment; anything deeper is the fallback.
        """
        geo = self.geometry
        unit = geo.hash_block_size
        reach = self._probe_limit_units(len(hashes), cap) * unit
        slack = 2 * geo.scheduler_block_size
        parts: list[tuple[int, list[bytes]]] = []
        for g in geo.groups:
            if not g.prefix_cacheable:
                continue
            step = self._step_units(g) * unit
            if g.group_id in self._dense_ids:
                hs = (
                    []
                    if g.group_id in asked_grids
                    else self._grid(hashes, local_dense_tokens, reach, g.block_size)
                )
                if step < g.block_size:
                    # Its finder's phase 1 stops at the bound or at cap's last full block.
                    tail = min(bound, cap // g.block_size * g.block_size)
                    tails = self._grid(hashes, max(local_dense_tokens, tail), reach, step)
                    hs = list(dict.fromkeys(hs + tails)) if hs else tails
                parts.append((g.group_id, hs))
                continue
            window = getattr(g.spec, "sliding_window", 0) or 0
            span = -(-max(window - 1, 0) // g.block_size) * g.block_size + (
                g.block_size if window else 0
            )
            parts.append((g.group_id, self._grid(hashes, bound - span - slack, reach, step)))
        return parts

    def _decide(
        self,
        hashes: list[bytes],
        max_tokens: int,
        answers: list[_GroupAnswers],
        local_units: int,
        record: bool = False,
    ) -> tuple["StoreHit", set[BlockKey], set[BlockKey]]:
        """vLLM's coordinator over known answers: (hit, unasked keys it read, keys it read).

        A key with no answer reads as absent and is reported, so the caller knows
        whether the hit is exact. Dense groups hold the first ``local_units`` hash
        units locally (present whatever the answers say).
        """
        local = dict.fromkeys(hashes[:local_units], True) if local_units else None
        views = []
        for gid, group_answers in enumerate(answers):
            if local is not None and gid in self._dense_ids:
                view = _GroupAnswers(group_answers)
                view.update(local)
            else:
                view = group_answers
                view.unknown = []
            views.append(view)
        self._pool.bind(views, record=record)
        try:
            blocks_by_group, hit_tokens, _ = self._coordinator.find_longest_cache_hit(
                list(hashes), max_tokens
            )
            consulted = self._pool.consulted if record else set()
        finally:
            self._pool.bind(None)
        unknown = {(gid, h) for gid, view in enumerate(views) for h in view.unknown}
        return self._store_hit(blocks_by_group, hit_tokens), unknown, consulted or set()

    @staticmethod
    def _store_hit(blocks_by_group, hit_tokens: int) -> "StoreHit":  # noqa: ANN001 - pool blocks
        """The hit's blocks per group: the hit blocks are block hashes, the others null."""
        out = []
        for gid, blocks in enumerate(blocks_by_group):
            hit = list(map(isinstance, blocks, repeat(bytes)))
            if all(hit):
                out.append(HitBlocks(gid, range(len(blocks)), blocks))
            else:
                out.append(
                    HitBlocks(gid, list(compress(count(), hit)), list(compress(blocks, hit)))
                )
        return StoreHit(tokens=hit_tokens, blocks=tuple(out))

    def _probe_parts(
        self, hashes: list[bytes], max_tokens: int, local_dense_tokens: int
    ) -> list[tuple[int, list[bytes]]]:
        """:meth:`probe_keys`, per group."""
        geo = self.geometry
        unit = geo.hash_block_size
        limit_units = self._probe_limit_units(len(hashes), max_tokens)
        parts = []
        for g in geo.groups:
            if not g.prefix_cacheable:
                continue
            step_units = self._step_units(g)
            first_end_unit = step_units
            if g.downward_closed and local_dense_tokens:
                first_end_unit = (local_dense_tokens // unit // step_units + 1) * step_units
            parts.append((g.group_id, hashes[first_end_unit - 1 : limit_units : step_units]))
        return parts

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
        return list(
            GroupedKeys(self._probe_parts(_hash_list(block_hashes), max_tokens, local_dense_tokens))
        )

    def longest_hit(
        self,
        block_hashes: Sequence[bytes],
        max_tokens: int,
        present: Collection[BlockKey] | BatchExists,
        local_dense_tokens: int = 0,
    ) -> StoreHit:
        """The hit vLLM's coordinator would compute over these contents.

        ``present`` is either the set of keys the store holds, or a batched
        existence call (asked once, for :meth:`probe_keys`, as a
        :class:`GroupedKeys`). Dense groups are taken as present below
        ``local_dense_tokens``.
        """
        hashes = _hash_list(block_hashes)
        answers = [_GroupAnswers() for _ in self.geometry.groups]
        if callable(present):
            keys = GroupedKeys(self._probe_parts(hashes, max_tokens, local_dense_tokens))
            found = present(keys)
            if len(found) != len(keys):
                raise ValueError(f"exists answered {len(found)} of {len(keys)} keys")
            off = 0
            for gid, hs in keys.parts:
                answers[gid].update(zip(hs, map(bool, found[off : off + len(hs)])))
                off += len(hs)
        else:
            for gid, h in present:
                answers[gid][bytes(h)] = True
        # Complete contents: a key not in them is absent (the unknown ones are simply misses).
        return self._decide(
            hashes, max_tokens, answers, local_dense_tokens // self.geometry.hash_block_size
        )[0]

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
