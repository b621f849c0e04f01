"""Where each group's blocks live in the worker's KV cache memory.

One store object (or one P/D transfer unit) is "block ``b`` of group ``g``": the
bytes of block ``b`` in every layer of the group, in the group's layer order.
This module is the single answer to "which bytes are block b of group g", used
by every transport (store saves/loads, P/D reads), so they cannot disagree.

vLLM 0.32 hands the connector one view per layer whose dim 0 is the block id
(attention ``[num_blocks, 2, block_size, heads*dim]``, Mamba ``[num_blocks, 1, 1,
page_bytes]`` int8), all views overlaying one int8 allocation. A layer's block
must be contiguous (``view[b]``); a layout where it is not is refused at
registration with the layout named, because splitting blocks per head would
multiply the descriptors of every transfer.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from vllm.v1.kv_cache_interface import KVCacheConfig, UniformTypeKVCacheSpecs


class LayoutError(RuntimeError):
    """The KV cache tensors cannot be addressed block by block."""


@dataclass(frozen=True)
class GroupLayout:
    """Base address, block stride and block bytes of every layer of one group."""

    group_id: int
    layer_names: tuple[str, ...]
    bases: np.ndarray  # int64 [L]
    strides: np.ndarray  # int64 [L]: bytes between consecutive blocks
    block_bytes: np.ndarray  # int64 [L]: bytes of one block of one layer

    @property
    def object_bytes(self) -> int:
        return int(self.block_bytes.sum())

    def regions(self, block_ids: Sequence[int]) -> tuple[list[list[int]], list[list[int]]]:
        """Per block: the layer regions' addresses and sizes (one store object each)."""
        ids = np.asarray(block_ids, dtype=np.int64)
        addrs = self.bases[None, :] + ids[:, None] * self.strides[None, :]
        sizes = np.broadcast_to(self.block_bytes, addrs.shape)
        return addrs.tolist(), sizes.tolist()


@dataclass(frozen=True)
class KVLayout:
    """All groups' layouts plus the distinct memory allocations to register."""

    groups: tuple[GroupLayout | None, ...]  # None: group has no layer on this worker
    allocations: tuple[tuple[int, int], ...]  # (base address, bytes)

    @classmethod
    def from_kv_caches(
        cls, kv_cache_config: KVCacheConfig, kv_caches: dict[str, torch.Tensor]
    ) -> "KVLayout":
        groups: list[GroupLayout | None] = []
        allocations: dict[int, int] = {}
        num_blocks = kv_cache_config.num_blocks
        for gid, group in enumerate(kv_cache_config.kv_cache_groups):
            names = [n for n in group.layer_names if n in kv_caches]
            if not names:
                groups.append(None)
                continue
            bases, strides, sizes = [], [], []
            seen: set[int] = set()
            for name in names:
                t = kv_caches[name]
                if isinstance(t, (list, tuple)):
                    raise LayoutError(
                        f"layer {name}: KV cache is a {type(t).__name__}, expected one tensor per layer"
                    )
                if t.shape[0] < num_blocks:
                    raise LayoutError(
                        f"layer {name}: dim 0 has {t.shape[0]} entries but the KV cache has "
                        f"{num_blocks} blocks; hybridkv needs block-outermost views"
                    )
                if not t[0].is_contiguous():
                    raise LayoutError(
                        f"layer {name}: one block is not contiguous (shape {tuple(t.shape)}, stride "
                        f"{t.stride()}); use a block-contiguous KV cache layout "
                        "(VLLM_KV_CACHE_LAYOUT unset or LBNHC/LBHNC)"
                    )
                if t.data_ptr() in seen:  # cross-layer KV sharing: same tensor twice
                    continue
                seen.add(t.data_ptr())
                elem = t.element_size()
                bases.append(t.data_ptr())
                strides.append(t.stride(0) * elem)
                sizes.append(t[0].numel() * elem)
                storage = t.untyped_storage()
                allocations[storage.data_ptr()] = storage.nbytes()
            groups.append(
                GroupLayout(
                    group_id=gid,
                    layer_names=tuple(names),
                    bases=np.asarray(bases, dtype=np.int64),
                    strides=np.asarray(strides, dtype=np.int64),
                    block_bytes=np.asarray(sizes, dtype=np.int64),
                )
            )
        return cls(groups=tuple(groups), allocations=tuple(sorted(allocations.items())))


def layer_specs(group) -> list:  # noqa: ANN001 - a vllm KVCacheGroupSpec
    """The specs of a group's layers (a ``UniformTypeKVCacheSpecs`` holds one per layer)."""
    spec = group.kv_cache_spec
    return list(spec.kv_cache_specs.values()) if isinstance(spec, UniformTypeKVCacheSpecs) else [spec]


def layout_rows(kv_cache_config: KVCacheConfig) -> list[dict]:
    """What both scheduler and workers know about each group's bytes (for key schemas).

    Two engines share stored objects only if these rows agree (same block size,
    page size, layer count and dtype per group), so they go into the key prefix.
    """
    rows = []
    for gid, group in enumerate(kv_cache_config.kv_cache_groups):
        spec = group.kv_cache_spec
        if isinstance(spec, UniformTypeKVCacheSpecs):
            spec = next(iter(spec.kv_cache_specs.values()))
        rows.append(
            {
                "group": gid,
                "spec": type(spec).__name__,
                "block_size": spec.block_size,
                "page_bytes": spec.page_size_bytes,
                "layers": len(group.layer_names),
                "dtype": str(getattr(spec, "dtype", getattr(spec, "dtypes", ""))),
                "window": getattr(spec, "sliding_window", None),
            }
        )
    return rows
