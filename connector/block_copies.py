"""Redo vLLM 0.32/0.33's copy-on-write block copies in full, in every layer.

Why: a sub-block prefix hit (``--prefix-match-unit`` below the block size)
makes vLLM give the request a private copy of the hit's last block in every
group (``SingleTypeKVCacheManager._apply_cow``, Mamba align's
``allocate_new_blocks``); the scheduler sends the pairs as
``kv_cache_block_copies`` and the worker runs ``copy_kv_cache_blocks_inplace``
(``v1/worker/utils.py``), which copies each ``data_ptr`` ONCE. In a hybrid
model a full-attention layer and a Mamba/linear-attention layer share one
allocation at the same base address with different views, so only the first
view's bytes of each block are copied (tiny qwen3-next: the GDN view's 35,840
of 131,072 bytes) and the attention layer's K/V of the hit's partial block stay
whatever the new block held: every turn resumed from a sub-block hit computes
from a wrong prefix (tests/e2e/test_store_connector.py's local sub-block case
shows it with no connector; docs/vllm_upstream.md).
A hybridkv connector's worker therefore redoes each copy over every distinct
layer view before the forward. Redoing is idempotent: nothing writes these
blocks between vLLM's copy and this one. vLLM 0.34 dedups by view geometry
instead of by address and copies every view itself (vllm#55112); where vLLM
does (``vllm_compat.vllm_copies_whole_pages``, probed once), there is nothing
to redo and :func:`block_copy_views` returns no views.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata

from hybridkv.store import vllm_compat


@dataclass
class BlockCopiesMetadata(KVConnectorMetadata):
    """Base of each hybridkv connector's step metadata: vLLM's copy-on-write (src, dst)
    block pairs of this step, for the workers to redo in full."""

    block_copies: list[tuple[int, int]] = field(default_factory=list)


def block_copy_views(kv_caches: dict[str, torch.Tensor], num_blocks: int) -> list[torch.Tensor]:
    """One ``[num_blocks, ...]`` view per distinct layer view (address, block stride, block bytes).

    A view split into kernel blocks (dim 0 = ``num_blocks * k``) becomes
    ``[num_blocks, k, ...]``, so ``v[b]`` is the whole manager block (vLLM's
    ``group_kernel_blocks``; ``block_layout`` addresses the same rows). Flat
    buffers (specs without per-layer views) are not block-addressed: skipped.
    None at all where vLLM's own copy already covers every view.
    """
    if vllm_compat.vllm_copies_whole_pages():
        return []
    views, seen = [], set()
    for t in kv_caches.values():
        if not isinstance(t, torch.Tensor) or t.dim() < 2 or t.shape[0] % num_blocks:
            continue
        key = (t.device, t.data_ptr(), t.stride(0), t[0].numel() * t.element_size(), t.shape[0])
        if key in seen:
            continue
        seen.add(key)
        views.append(t.unflatten(0, (num_blocks, t.shape[0] // num_blocks)))
    return views


def step_block_copies(scheduler_output: Any) -> list[tuple[int, int]]:
    """This step's (src, dst) block pairs, for the connector metadata (scheduler side)."""
    copies = getattr(scheduler_output, "kv_cache_block_copies", None) or ()
    return [(int(c.src_block_id), int(c.dst_block_id)) for c in copies]


def redo_block_copies(views: Sequence[torch.Tensor], copies: Sequence[tuple[int, int]]) -> None:
    """Copy whole blocks ``src -> dst`` in every view (worker side, before the forward)."""
    if not copies or not views:
        return
    src = torch.tensor([c[0] for c in copies], dtype=torch.long)
    dst = torch.tensor([c[1] for c in copies], dtype=torch.long)
    for v in views:
        if v.device.type != "cpu":
            src, dst = src.to(v.device), dst.to(v.device)
        v[dst] = v[src]
