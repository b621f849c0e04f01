"""The one rule for which KV cache groups may be cut back to a shorter hit.

A group is *downward-closed* when a hit of length L implies a valid hit at every
shorter aligned length, so its block list may be trimmed to any reconciled hit.
Full attention (and MLA, R-SWA, sink attention: every manager that keeps vLLM's
left-to-right prefix scan) is; sliding window, chunked local and Mamba/linear
attention are not: their hit needs state *at* the boundary (a window tail, a
recurrent checkpoint) that a shorter prefix does not have.

vLLM 0.32 has no such property and its coordinator tests
``isinstance(spec, FullAttentionSpec)`` inline. hybridkv derives the answer from
the group's *manager class* instead (the class that decides hits), and every
hybridkv caller -- the connector's dense-reference reconciliation and the store
mirror -- goes through :func:`is_downward_closed` / :func:`trim_to_hit`. A
custom spec registered with vLLM's ``KVCacheSpecRegistry`` therefore flips both
sides at once.
"""

from __future__ import annotations

from collections.abc import MutableSequence, Sequence

from vllm.utils.math_utils import cdiv
from vllm.v1.core.single_type_kv_cache_manager import (
    FullAttentionManager,
    SingleTypeKVCacheManager,
)

_PREFIX_SCAN_FINDER = FullAttentionManager.find_longest_cache_hit.__func__


def is_downward_closed(manager_cls: type[SingleTypeKVCacheManager]) -> bool:
    """True iff the manager decides hits with vLLM's prefix scan.

    The prefix scan stops at the first missing block (hashes are chained), so
    every shorter aligned prefix of a hit is itself a hit. A manager that
    overrides the finder (window tails, Mamba checkpoints, circular buffers)
    decides hits by state at the boundary and is not downward-closed. A
    manager that retains a longer hit on purpose (HiSparse source) is not
    trimmed by vLLM either, so it is not treated as trimmable here.
    """
    finder = getattr(manager_cls.find_longest_cache_hit, "__func__", None)
    return finder is _PREFIX_SCAN_FINDER and not manager_cls.retains_longer_hit


def trim_to_hit(
    blocks_by_group: Sequence[MutableSequence[object]],
    block_sizes: Sequence[int],
    downward_closed: Sequence[bool],
    hit_tokens: int,
) -> None:
    """Cut every downward-closed group's block list to cover ``hit_tokens``.

    In place, like vLLM's coordinator. Non-closed groups are left alone: their
    lists describe state at their own boundary and cannot be cut.
    """
    for blocks, block_size, closed in zip(blocks_by_group, block_sizes, downward_closed):
        if closed:
            del blocks[cdiv(hit_tokens, block_size) :]
