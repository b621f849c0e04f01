"""Where each group's blocks live in the worker's KV cache memory, in MANAGER blocks.

One store object (or one P/D transfer unit) is "block ``b`` of group ``g``": the
bytes of manager block ``b`` in every layer of the group, in the group's layer
order. This module is the single answer to "which bytes are block b of group g",
used by every transport (store zero-copy saves/loads, the staged path's
:class:`~hybridkv.connector.block_staging.BlockStager`, P/D reads), so they
cannot disagree.

vLLM hands the connector one view per layer (``allocate_kv_cache``), all views
overlaying one int8 allocation: attention ``[B, H, N, C]``, Mamba ``[B, 1, 1,
page_bytes]`` int8. When an attention backend needs blocks smaller than the
manager's (GPU kernels take 16/32/64 tokens under a 64..1920-token manager
block), ``B`` is the number of KERNEL blocks, ``num_blocks * k``, and manager
block ``b`` is kernel rows ``b*k .. b*k+k-1`` (vLLM's own
``group_kernel_blocks`` regroups them the same way). Mamba views in the same
pages are never split. So per layer view:

* ``k = dim0 / num_blocks`` must be an integer;
* one kernel row must be one dense span of memory (any dim order: LBHNC and
  LBNHC both are); a row split into per-head pieces (LHBNC, BHLNC) is refused,
  because every transfer would then need a descriptor per head;
* rows one row apart (``stride(0)`` = row bytes, what vLLM's split produces):
  manager block ``b`` is ONE region of ``k`` rows at ``base + b*k*stride(0)``;
  rows further apart (padding or other layers between them): ``k`` regions per
  block. Overlapping rows are refused.

:func:`block_geometry` derives this from shapes, strides and pointers only
(no copies, any device); :class:`KVLayout` applies it to every layer of every
group, and the stager builds its row views from the same function.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from functools import cached_property
from typing import TYPE_CHECKING

import numpy as np
import torch

if TYPE_CHECKING:
    from vllm.v1.kv_cache_interface import KVCacheConfig

_FIX = (
    "start vLLM with a layer-compact, block-contiguous KV cache layout "
    "(VLLM_KV_CACHE_LAYOUT unset, LBHNC or LBNHC)"
)


class LayoutError(RuntimeError, ValueError):
    """The KV cache tensors cannot be addressed manager block by manager block."""


@dataclass(frozen=True)
class BlockGeometry:
    """Where manager block ``b`` of one layer view lies.

    Region ``i`` of block ``b`` is ``offsets[i] + b * stride`` bytes after the
    view's first byte (``data_ptr``), ``sizes[i]`` bytes long. The byte order of
    a block is region order (ascending address).
    """

    stride: int  # bytes between consecutive manager blocks
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    storage_offset: int  # bytes from the storage's first byte to the view's
    kernel_rows: int  # kernel blocks per manager block (1: not split)
    block_format: str  # how a block's logical elements map to its bytes (see _block_format)

    @property
    def block_bytes(self) -> int:
        return sum(self.sizes)


def _dense_bytes(shape: Sequence[int], strides: Sequence[int], elem: int) -> int | None:
    """Bytes of a tensor that is one dense span in SOME dim order, else None."""
    dims = sorted((st * elem, sz) for sz, st in zip(shape, strides) if sz != 1)
    expected = elem
    for st, sz in dims:
        if st != expected:
            return None
        expected = st * sz
    return expected


def _block_format(t: torch.Tensor, k: int) -> str:
    """The logical -> byte map of one manager block, in a canonical form.

    Two engines can exchange a block byte for byte only if their maps agree;
    equal block bytes are not enough (a 64-token block split into 4 kernel
    rows of 16 under LBHNC orders heads and tokens differently from an
    unsplit one, under LBNHC it does not). vLLM's 4-D views ``[B, H, N, C]``
    are described as ``[H, k*N, C]`` (token ``t`` of the block = kernel row
    ``t // N``, position ``t % N``); other views as ``[k, ...]``. The
    description is ``elem|size:stride_bytes,...`` after dropping size-1 dims
    and merging dims that are contiguous in sequence, which is unique for a
    given map.
    """
    es = t.element_size()
    row = list(zip(t.shape[1:], (s * es for s in t.stride()[1:])))
    kdim = (k, t.stride(0) * es)
    dims = [row[0], kdim, *row[1:]] if t.dim() == 4 else [kdim, *row]
    merged: list[tuple[int, int]] = []
    for sz, st in dims:
        if sz == 1:
            continue
        if merged and merged[-1][1] == sz * st:
            psz, _ = merged.pop()
            merged.append((psz * sz, st))
        else:
            merged.append((sz, st))
    return f"{t.dtype}|" + ",".join(f"{sz}:{st}" for sz, st in merged)


def block_geometry(
    t: torch.Tensor, num_blocks: int, name: str = "", layout: str | None = None
) -> BlockGeometry:
    """Manager-block geometry of one layer view (dim 0 = ``num_blocks * k`` kernel rows).

    Raises :class:`LayoutError` naming the layer, the KV cache layout (vLLM's
    resolved ``kv_cache_layout``, when given), its shape/strides and the fix
    when the view cannot be addressed by manager block.
    """
    what = f"layer {name}" if name else "layer"
    if layout:
        what += f" (KV cache layout {layout})"
    if not isinstance(t, torch.Tensor):
        raise LayoutError(
            f"{what}: KV cache is a {type(t).__name__}, expected one tensor per layer"
        )
    if t.dim() < 2:
        raise LayoutError(
            f"{what}: KV cache is a flat {tuple(t.shape)} buffer (a spec without per-layer "
            "views lays out its own memory); hybridkv cannot address its blocks"
        )
    if num_blocks < 1:
        raise LayoutError(f"{what}: the KV cache has {num_blocks} blocks")
    rows = int(t.shape[0])
    if rows < num_blocks or rows % num_blocks:
        raise LayoutError(
            f"{what}: dim 0 has {rows} entries, not a multiple of the KV cache's {num_blocks} "
            f"blocks (shape {tuple(t.shape)}); hybridkv needs block-outermost views whose dim 0 "
            "is the manager block or its kernel blocks, as vLLM's allocate_kv_cache makes them"
        )
    k = rows // num_blocks
    es = t.element_size()
    row_bytes = _dense_bytes(t.shape[1:], t.stride()[1:], es)
    if row_bytes is None:
        raise LayoutError(
            f"{what}: one block is not contiguous (shape {tuple(t.shape)}, stride {t.stride()}: "
            f"a kernel row is split per head); {_FIX}"
        )
    row_stride = t.stride(0) * es
    if rows > 1 and row_stride < row_bytes:
        raise LayoutError(
            f"{what}: blocks overlap (dim 0 stride {row_stride} B < {row_bytes} B per block; "
            f"shape {tuple(t.shape)}, stride {t.stride()}); {_FIX}"
        )
    if k == 1:
        offsets, sizes = (0,), (row_bytes,)
        stride = row_stride if num_blocks > 1 else row_bytes
    elif row_stride == row_bytes:  # kernel rows back to back: the manager block is one span
        offsets, sizes = (0,), (k * row_bytes,)
        stride = k * row_stride
    else:  # something between kernel rows: one region per row
        offsets, sizes = tuple(j * row_stride for j in range(k)), (row_bytes,) * k
        stride = k * row_stride
    return BlockGeometry(
        stride=stride,
        offsets=offsets,
        sizes=sizes,
        storage_offset=t.storage_offset() * es,
        kernel_rows=k,
        block_format=_block_format(t, k),
    )


def view_key(t: torch.Tensor) -> tuple:
    """Identity of a layer view: a layer that reuses another's KV cache has the same key."""
    return (t.device, t.data_ptr(), t.dtype, tuple(t.shape), t.stride())


@dataclass(frozen=True)
class GroupLayout:
    """Base address, block stride and bytes of every region of one group's block.

    A region is one layer's block, or one kernel row of it when kernel rows are
    not adjacent (see :func:`block_geometry`); ``regions(ids)`` gives them in the
    object's byte order. ``tensor_names`` are the distinct layer views the
    regions come from (a layer that shares another's cache appears once).
    """

    group_id: int
    layer_names: tuple[str, ...]
    bases: np.ndarray  # int64 [R]: address of block 0's region
    strides: np.ndarray  # int64 [R]: bytes between consecutive manager blocks
    block_bytes: np.ndarray  # int64 [R]: bytes of the region
    tensor_names: tuple[str, ...] = ()
    num_blocks: int = 0  # manager blocks (0: not known, e.g. a peer's layout)
    kernel_rows: tuple[int, ...] = ()  # per tensor: kernel blocks per manager block
    block_formats: tuple[str, ...] = ()  # per tensor: BlockGeometry.block_format

    @property
    def object_bytes(self) -> int:
        return int(self.block_bytes.sum())

    def regions(self, block_ids: Sequence[int]) -> tuple[list[list[int]], list[list[int]]]:
        """Per block: the regions' addresses and sizes (one store object each)."""
        addrs = self.region_addrs(block_ids)
        sizes = np.broadcast_to(self.block_bytes, addrs.shape)
        return addrs.tolist(), sizes.tolist()

    def region_addrs(self, block_ids: Sequence[int]) -> np.ndarray:
        """int64 ``[len(block_ids), R]``: :meth:`regions`' addresses as an array (no Python lists:
        a 64-block, 16-layer READ builds 1024 rows per side)."""
        ids = np.asarray(block_ids, dtype=np.int64)
        if self.num_blocks and ids.size and (ids.min() < 0 or ids.max() >= self.num_blocks):
            raise ValueError(f"group {self.group_id}: block id outside 0..{self.num_blocks - 1}")
        addrs = self.bases[None, :] + ids[:, None] * self.strides[None, :]
        return addrs

    def object_regions(self, block_ids: Sequence[int]) -> tuple[list[list[int]], list[list[int]]]:
        """:meth:`regions` with neighbours that lie back to back merged: the same bytes of each
        object in the same order, in fewer parts (the store's descriptors per object).

        Region ``j`` of block ``b`` ends where region ``j + 1`` starts for every ``b`` exactly
        when the two have one block stride and ``bases[j] + block_bytes[j] == bases[j + 1]``,
        so the merge is a property of the layout: one part per block under block-outermost
        layouts (BLHNC / BLNHC); none under layer-outermost ones, where a block's layers are
        ``num_blocks`` pages apart.
        """
        return self.merged_layout.regions(block_ids)

    @cached_property
    def merged_layout(self) -> "GroupLayout":
        """This layout with consecutive regions that meet in every block merged (see :meth:`object_regions`)."""
        if len(self.bases) < 2:
            return self
        meet = (self.bases[:-1] + self.block_bytes[:-1] == self.bases[1:]) & (
            self.strides[:-1] == self.strides[1:]
        )
        if not meet.any():
            return self
        starts = np.concatenate(([0], np.nonzero(~meet)[0] + 1))
        return replace(
            self,
            bases=self.bases[starts],
            strides=self.strides[starts],
            block_bytes=np.add.reduceat(self.block_bytes, starts),
        )


def _group_num_blocks(kv_cache_config: "KVCacheConfig", group) -> int:  # noqa: ANN001
    if getattr(group, "host_resident", False):
        return int(kv_cache_config.hisparse_host_num_blocks)
    return int(kv_cache_config.num_blocks)


def _check_disjoint_in_block(
    gid: int, names: list[str], bases: list[int], sizes: list[int]
) -> None:
    """Two layer views of one group covering the same bytes would be moved twice."""
    order = sorted(range(len(bases)), key=bases.__getitem__)
    for a, b in zip(order, order[1:]):
        if bases[a] + sizes[a] > bases[b]:
            raise LayoutError(
                f"group {gid}: layers {names[a]} and {names[b]} overlap in block 0; "
                "one group's layers must own distinct bytes"
            )


@dataclass(frozen=True)
class KVLayout:
    """All groups' layouts plus the distinct memory allocations to register."""

    groups: tuple[GroupLayout | None, ...]  # None: group has no layer on this worker
    allocations: tuple[tuple[int, int], ...]  # (base address, bytes)

    @classmethod
    def from_kv_caches(
        cls, kv_cache_config: "KVCacheConfig", kv_caches: dict[str, torch.Tensor]
    ) -> "KVLayout":
        """Every group's manager-block regions; refuses (``LayoutError``) what cannot be addressed."""
        groups: list[GroupLayout | None] = []
        allocations: dict[int, int] = {}
        for gid, group in enumerate(kv_cache_config.kv_cache_groups):
            names = [n for n in group.layer_names if n in kv_caches]
            if not names:
                groups.append(None)
                continue
            num_blocks = _group_num_blocks(kv_cache_config, group)
            bases, strides, sizes, region_names = [], [], [], []
            tensor_names, kernel_rows, formats = [], [], []
            seen: set[tuple] = set()
            for name in names:
                t = kv_caches[name]
                geo = block_geometry(
                    t, num_blocks, name, getattr(kv_cache_config, "kv_cache_layout", None)
                )
                key = view_key(t)
                if key in seen:  # cross-layer KV sharing: the same view twice
                    continue
                seen.add(key)
                tensor_names.append(name)
                kernel_rows.append(geo.kernel_rows)
                formats.append(geo.block_format)
                for off, size in zip(geo.offsets, geo.sizes):
                    bases.append(t.data_ptr() + off)
                    strides.append(geo.stride)
                    sizes.append(size)
                    region_names.append(name)
                storage = t.untyped_storage()
                allocations[storage.data_ptr()] = storage.nbytes()
            _check_disjoint_in_block(gid, region_names, bases, sizes)
            groups.append(
                GroupLayout(
                    group_id=gid,
                    layer_names=tuple(names),
                    bases=np.asarray(bases, dtype=np.int64),
                    strides=np.asarray(strides, dtype=np.int64),
                    block_bytes=np.asarray(sizes, dtype=np.int64),
                    tensor_names=tuple(tensor_names),
                    num_blocks=num_blocks,
                    kernel_rows=tuple(kernel_rows),
                    block_formats=tuple(formats),
                )
            )
        return cls(groups=tuple(groups), allocations=tuple(sorted(allocations.items())))


def layer_specs(group) -> list:  # noqa: ANN001 - a vllm KVCacheGroupSpec
    """The specs of a group's layers (a ``UniformTypeKVCacheSpecs`` holds one per layer)."""
    from vllm.v1.kv_cache_interface import UniformTypeKVCacheSpecs

    spec = group.kv_cache_spec
    return (
        list(spec.kv_cache_specs.values()) if isinstance(spec, UniformTypeKVCacheSpecs) else [spec]
    )


def layout_rows(kv_cache_config: "KVCacheConfig") -> list[dict]:
    """What both scheduler and workers know about each group's bytes (for key schemas).

    Two engines share stored objects only if these rows agree (same block size,
    page size, layer count and dtype per group, and the same resolved
    ``kv_cache_layout``: LBHNC and LBNHC blocks have equal sizes, different byte
    orders), so they go into the key prefix.
    """
    from vllm.v1.kv_cache_interface import UniformTypeKVCacheSpecs

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
                "kv_cache_layout": kv_cache_config.kv_cache_layout,
            }
        )
    return rows


def coalesce(
    dst: np.ndarray,
    src: np.ndarray,
    sizes: np.ndarray,
    dst_dev: np.ndarray | None = None,
    src_dev: np.ndarray | None = None,
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """The fewest copies, each contiguous on BOTH sides, that move exactly the bytes of the given ones.

    Row ``i`` moves ``sizes[i]`` bytes from ``src[i]`` (on device ``src_dev[i]``) to ``dst[i]``
    (on ``dst_dev[i]``); destinations must not overlap (``ValueError`` naming the first
    overlap). Rows are sorted by destination and neighbours merged where the first ends exactly
    where the second starts on both sides, on the same devices. The result moves the same bytes
    to the same places, and no merged copy touches a byte outside the given rows: every transport
    that takes the regions of a hand-over or batch (P/D READ, the store's registered or
    GPU-direct path) can take these instead.

    What merges, for vLLM's layouts: one layer's regions of manager blocks whose ids are
    consecutive on both sides (the region fills its block stride: attention pages, kernel rows
    back to back), the layers of one block where the allocation places them back to back
    (block-outermost BLHNC / BLNHC), and head slices that meet. Padded pages (Mamba state
    smaller than the page) and non-consecutive ids stay separate rows.

    Returns ``(dst, src, sizes, dst_dev, src_dev)`` as int64 arrays (devices 0 when omitted).
    """
    d = np.asarray(dst, dtype=np.int64).reshape(-1)
    s = np.asarray(src, dtype=np.int64).reshape(-1)
    n = np.asarray(sizes, dtype=np.int64).reshape(-1)
    dd = np.zeros_like(d) if dst_dev is None else np.asarray(dst_dev, dtype=np.int64).reshape(-1)
    sd = np.zeros_like(d) if src_dev is None else np.asarray(src_dev, dtype=np.int64).reshape(-1)
    if not (len(d) == len(s) == len(n) == len(dd) == len(sd)):
        raise ValueError(
            f"row counts differ: dst {len(d)}, src {len(s)}, sizes {len(n)}, devs {len(dd)}/{len(sd)}"
        )
    if len(d) == 0:
        return d, s, n, dd, sd
    if (n <= 0).any():
        raise ValueError("a copy of zero or negative length")
    order = np.argsort(d) if (dd == dd[0]).all() else np.lexsort((d, dd))
    d, s, n, dd, sd = d[order], s[order], n[order], dd[order], sd[order]
    same_dev = dd[:-1] == dd[1:]
    over = np.nonzero(same_dev & (d[:-1] + n[:-1] > d[1:]))[0]
    if over.size:
        raise ValueError(f"destinations overlap at 0x{int(d[over[0] + 1]):x}")
    joins = same_dev & (sd[:-1] == sd[1:]) & (d[:-1] + n[:-1] == d[1:]) & (s[:-1] + n[:-1] == s[1:])
    starts = np.concatenate(([0], np.nonzero(~joins)[0] + 1))
    return d[starts], s[starts], np.add.reduceat(n, starts), dd[starts], sd[starts]


def run_lengths(ids: Sequence[int], peer: Sequence[int] | None = None) -> list[int]:
    """Lengths of the runs of ids one apart, in the given order, ascending or descending
    (``[3, 4, 5, 9, 10, 2]`` -> ``[3, 2, 1]``; ``[7, 6, 5, 9]`` -> ``[3, 1]``).

    With ``peer`` (the other side's ids, pair by pair): runs whose ids step the same way by one
    on BOTH sides, the pairs :func:`coalesce` can serve with one copy per region.
    """
    out: list[int] = []
    step = 0
    for i, b in enumerate(ids):
        d = b - ids[i - 1] if i else 0
        same = peer is None or (i and peer[i] - peer[i - 1] == d)
        if i and d in (1, -1) and same and (out[-1] == 1 or d == step):
            out[-1] += 1
            step = d
        else:
            out.append(1)
            step = 0
    return out
