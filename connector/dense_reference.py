"""Reconciling per-group local hits when a model has SEVERAL dense groups.

Why this exists: vLLM 0.32's ``KVCacheManager.get_computed_blocks_for_connector``
takes ``coordinator.full_attention_group_id`` -- the FIRST full-attention group
only -- as "the dense reference". It reports that group's per-group hit as the
local prefix and falls back to the convergent lookup only if some group hit
deeper than it. With two dense groups at different block sizes (a drafter booked
as full attention, Gemma4's per-layer head sizes) that is wrong: when the second
dense group was evicted deeper, vLLM reports a length whose blocks that group
does not hold, and the scheduler resumes on missing KV (HTTP 200, corrupted
generations).

The rule here, over per-group hits ``h``:

* dense groups = the downward-closed ones (:func:`hybridkv.store.truncation.is_downward_closed`);
* eviction guard: fall back to the convergent lookup iff some non-dense group
  hit deeper than the MAX of the dense hits (only then is it evidence that dense
  blocks were evicted);
* reported local length: the MIN of the dense hits, every dense group trimmed to
  it (every returned block list covers it);
* strict reference: a sparse group whose hit lies ABOVE the reported length
  (between the min and the max dense hit: e.g. FA16 = 64, FA32 = 128,
  Mamba = 128) is re-queried at the reported length with vLLM's own per-group
  lookup. Its state found there locally -> that group converges (no store
  round trip); absent -> its list is the shorter answer of that re-query. So no
  group's block table ever runs past the reported tokens (a longer list would
  leave blocks in the table that the computed tokens do not cover);
* diverged: after the re-query, some group's hit is below the reported length
  (with one dense group the guard already excludes sparse hits above it, so
  the answer equals vLLM's exactly).

With a single dense group all of this reduces to vLLM's current answer.

A diverged hit is only worth reporting if the connector can extend it: vLLM
0.32 asks the connector ONCE, with the diverged length, and if the answer is 0
falls back to the convergent hit and loads nothing. When the store held exactly
the diverged length (an agent's turn 2: the local cache kept the full-attention
blocks but evicted the window tail; the store holds both), that throws away a
whole hit that the store could serve from the convergent length (the in-tree
connector, which never reports diverged hits, serves it). So the
installed lookup asks ``extends(request, length)`` first and falls back to the
convergent hit itself when the answer is no; vLLM then asks from there.
"""

from __future__ import annotations

import types
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from vllm.v1.core.kv_cache_coordinator import HybridKVCacheCoordinator

from hybridkv.store import vllm_compat
from hybridkv.store.geometry import GroupGeometry
from hybridkv.store.truncation import trim_to_hit

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks, KVCacheManager
    from vllm.v1.request import Request


@dataclass(frozen=True)
class ReconciledHit:
    """Outcome of :func:`reconcile_dense_hits`."""

    fallback: bool  # use the convergent lookup (get_computed_blocks)
    reported_tokens: int  # local prefix to report when not falling back
    # some group lacks valid state at reported_tokens, judged on the FIRST lookup;
    # the installed lookup re-queries sparse groups above it (requery_at_reported)
    diverged: bool


def reconcile_dense_hits(
    hits: Sequence[int],
    dense: Sequence[bool],
    cacheable: Sequence[bool] | None = None,
) -> ReconciledHit:
    """Max-guard / min-report over per-group hit lengths (pure)."""
    if cacheable is None:
        cacheable = [True] * len(hits)
    dense_hits = [h for h, d, c in zip(hits, dense, cacheable) if d and c]
    if not dense_hits:
        return ReconciledHit(fallback=True, reported_tokens=0, diverged=False)
    deepest_dense = max(dense_hits)
    sparse_hits = [h for h, d, c in zip(hits, dense, cacheable) if c and not d]
    if any(h > deepest_dense for h in sparse_hits):
        return ReconciledHit(fallback=True, reported_tokens=0, diverged=False)
    reported = min(dense_hits)
    diverged = any(h < reported for h in hits) or any(h > reported for h in sparse_hits)
    return ReconciledHit(fallback=False, reported_tokens=reported, diverged=diverged)


# (request, block-aligned local length) -> can the connector load beyond it?
Extends = Callable[["Request", int], bool]


def reconciled_computed_blocks_for_connector(
    manager: "KVCacheManager",
    geometry: GroupGeometry,
    request: "Request",
    extends: Extends | None = None,
    max_cache_hit_length: int | None = None,
) -> tuple["KVCacheBlocks", int, int, bool]:
    """Drop-in for ``KVCacheManager.get_computed_blocks_for_connector``.

    Same return contract: (blocks, local computed tokens, shared-prefix
    boundary, hit_diverged). Per-group hits come from vLLM's own
    ``find_longest_cache_hit_per_group``; only the choice of reference differs.
    With ``extends``, a diverged hit the connector cannot extend is replaced by
    the convergent one (vLLM would fall back to it anyway, but without asking
    the connector again). ``max_cache_hit_length`` is vLLM 0.33's cap on the
    hit (0.32's scheduler never passes it; None = ``num_tokens - 1``).
    """
    coordinator = manager.coordinator

    def convergent() -> tuple["KVCacheBlocks", int, int, bool]:
        return *vllm_compat.get_computed_blocks(manager, request, max_cache_hit_length), False

    if not (
        isinstance(coordinator, HybridKVCacheCoordinator)
        and geometry.dense_group_ids
        and geometry.sparse_group_ids
    ):
        return convergent()
    if not manager.prefix_cache_lookup_enabled(request):
        return manager.empty_kv_cache_blocks, 0, 0, False

    max_length = vllm_compat.max_cache_hit_length(request, max_cache_hit_length)
    computed, hits = coordinator.find_longest_cache_hit_per_group(request.block_hashes, max_length)
    dense = [g.downward_closed for g in geometry.groups]
    cacheable = [g.prefix_cacheable for g in geometry.groups]
    result = reconcile_dense_hits(hits, dense, cacheable)
    if result.fallback:
        return convergent()
    reported = result.reported_tokens
    computed, hits = list(computed), list(hits)
    trim_to_hit(
        computed,
        [g.block_size for g in geometry.groups],
        [d and c for d, c in zip(dense, cacheable)],
        reported,
    )
    requery_at_reported(coordinator, request, computed, hits, dense, cacheable, reported)
    diverged = any(h < reported for h, c in zip(hits, cacheable) if c)
    if diverged and extends is not None:
        # The scheduler passes the connector the hit cut to its block size.
        aligned = reported - reported % geometry.scheduler_block_size
        if not extends(request, aligned):
            return convergent()
    blocks = manager.create_kv_cache_blocks(tuple(computed))
    # Per-group lookups do not detect an uncached shared prefix (boundary 0),
    # exactly as vLLM's version.
    return blocks, reported, 0, diverged


def requery_at_reported(
    coordinator: HybridKVCacheCoordinator,
    request: "Request",
    computed: list,
    hits: list[int],
    dense: Sequence[bool],
    cacheable: Sequence[bool],
    reported: int,
) -> None:
    """Re-ask every sparse group that hit ABOVE ``reported`` at ``reported``.

    In place over ``computed`` / ``hits``. A sparse group's hit is state at its
    own boundary (a window tail, a recurrent checkpoint): its list cannot be
    cut like a dense one. The answer comes from vLLM's own per-group lookup
    capped at ``reported`` (same manager classes, EAGLE margins and alignment
    as the first lookup), so a state cached AT the reported length is found
    (hit == reported: that group converges) and otherwise the group lags with
    a list that ends below the reported length.
    """
    above = [
        g for g, (h, d, c) in enumerate(zip(hits, dense, cacheable)) if c and not d and h > reported
    ]
    if not above:
        return
    again, hits_again = coordinator.find_longest_cache_hit_per_group(request.block_hashes, reported)
    for g in above:
        computed[g] = list(again[g])
        hits[g] = min(hits_again[g], reported)


def install_reconciled_lookup(
    manager: "KVCacheManager", extends: Extends | None = None
) -> GroupGeometry:
    """Replace ``get_computed_blocks_for_connector`` on THIS manager only.

    Called from a hybridkv connector's ``bind_kv_cache_manager``; the scheduler
    uses the method only when the connector reports
    ``supports_divergent_local_hybrid_hits``. Other managers (other engines in
    the same process, tests) keep vLLM's method.
    """
    geometry = GroupGeometry.from_kv_cache_manager(manager)

    def _lookup(
        self: "KVCacheManager", request: "Request", max_cache_hit_length: int | None = None
    ):
        # vLLM 0.33's scheduler passes (request, max_cache_hit_length); 0.32's (request).
        return reconciled_computed_blocks_for_connector(
            self, geometry, request, extends, max_cache_hit_length
        )

    manager.get_computed_blocks_for_connector = types.MethodType(_lookup, manager)
    return geometry
