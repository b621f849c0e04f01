"""Every transport addresses MANAGER blocks, whatever kernel block size vLLM picked.

GPU attention backends split a manager block (64..256 tokens here) into kernel
blocks (16/32/64); vLLM's ``allocate_kv_cache(..., kernel_block_sizes)`` then
hands the connector views whose dim 0 is the kernel block. The caches here are
built by vLLM's own planning (``get_kv_cache_config_from_groups``) and
allocation code on CPU tensors, for several manager/kernel sizes, layouts, and
hybrid overlays whose attention groups (split) and Mamba group (never split)
share pages. A distinct value is written into every (layer, manager block,
kernel row, token, head, channel) through the views the attention backend
uses; each group owns its own block ids, as vLLM's block pool guarantees.

The expected bytes of block ``b`` come from vLLM's placement contract, not from
the tensors: layer ``l`` of a ``KVCacheTensor`` starts at ``offset + l *
layer_stride + b * block_stride``, its content is
``compute_layer_kv_cache_shape_bytes(spec, 1)`` bytes. Checked exactly (==)
against ``GroupLayout.regions`` (store zero-copy and P/D addresses) and the
store's staged path (``build_stager_pools`` -> ``BlockStager.gather``), plus a
round trip a -> b through both that must land in b's kernel rows and nowhere
else.
"""

from __future__ import annotations

import ctypes
import math
from dataclasses import dataclass

import numpy as np
import pytest
import torch
from vllm.config import VllmConfig
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    MambaSpec,
    SlidingWindowSpec,
    compute_layer_kv_cache_shape_bytes,
)
from vllm.v1.worker.utils import allocate_kv_cache

from hybridkv.connector.block_layout import KVLayout, LayoutError, block_geometry
from hybridkv.connector.block_staging import BlockStager
from hybridkv.connector.store_staging import build_stager_pools
from hybridkv.store.vllm_compat import get_kv_cache_config_from_groups

NBYTES = 12 * 4 * 8192  # ~12 blocks of every group


def fa(bs: int, heads: int, head: int) -> FullAttentionSpec:
    return FullAttentionSpec(block_size=bs, num_kv_heads=heads, head_size=head, dtype=torch.float32)


def sw(bs: int, heads: int, head: int) -> SlidingWindowSpec:
    return SlidingWindowSpec(
        block_size=bs,
        num_kv_heads=heads,
        head_size=head,
        dtype=torch.float32,
        sliding_window=2 * bs,
    )


def mamba(bs: int, page: int) -> MambaSpec:
    return MambaSpec(
        block_size=bs,
        shapes=((3, 16),),
        dtypes=(torch.float32,),
        mamba_cache_mode="align",
        page_size_padded=page,
    )


@dataclass
class Case:
    layout: str
    groups: list[tuple[list[str], object]]  # (layer names, spec)
    kernel: list[int]  # kernel block size per group
    share: dict[str, str] | None = None  # layer -> layer whose cache it reuses

    @property
    def label(self) -> str:
        sizes = "+".join(
            f"{type(s).__name__[:2]}{s.block_size}/{k}"
            for (_, s), k in zip(self.groups, self.kernel)
        )
        return f"{self.layout}-{sizes}" + ("-shared" if self.share else "")


def _single(layout: str, bs: int, kernel: int) -> Case:
    return Case(layout, [(["fa.0", "fa.1"], fa(bs, 2, 8))], [kernel])


def _hybrid(layout: str, split: bool, share: bool = False) -> Case:
    """Full attention 128 + sliding window 64 + a second full-attention group at 256
    (the drafter case) + Mamba, all 8 KiB pages overlaying each other."""
    heads = 2 if layout in ("LBNHC", "BLNHC") else 1  # LBNHC differs from LBHNC only with >1 head
    groups = [
        (["fa.0", "fa.1"], fa(128, heads, 8 // heads)),
        (["sw.0", "sw.1"], sw(64, heads, 16 // heads)),
        (["m.0", "m.1"], mamba(128, 8192)),
        (["fa2.0"], fa(256, heads, 4 // heads)),
    ]
    kernel = [32, 16, 128, 64] if split else [128, 64, 128, 256]
    return Case(layout, groups, kernel, {"fa.2": "fa.0"} if share else None)


CASES = [
    _single("LBHNC", 64, 16),
    _single("LBHNC", 128, 32),
    _single("LBNHC", 256, 64),
    _single("LBHNC", 128, 128),
    _hybrid("LBHNC", split=True),
    _hybrid("LBNHC", split=True),
    _hybrid("LBHNC", split=True, share=True),
    _hybrid("LBHNC", split=False),
    _hybrid("BLHNC", split=False),  # block-outermost: vLLM never splits it (checked below)
]


class Cache:
    """One worker's KV cache as vLLM allocates it, a pattern in every owned block, and
    the expected bytes of every (group, block) from vLLM's placement contract."""

    def __init__(self, case: Case):
        cfg = VllmConfig()
        cfg.cache_config.kv_cache_layout = case.layout
        groups = [KVCacheGroupSpec(list(names), spec) for names, spec in case.groups]
        self.config: KVCacheConfig = get_kv_cache_config_from_groups(cfg, groups, NBYTES)
        self.config.kv_cache_layout = case.layout  # as the engine core records it
        self.caches = allocate_kv_cache(
            self.config,
            torch.device("cpu"),
            cfg.cache_config.get_resolved_kv_cache_layout(),
            case.kernel,
        )
        self.num_blocks = self.config.num_blocks
        self.pages = self._pages()  # layer -> (offset of block 0, block stride, content bytes)
        for layer, target in (
            case.share or {}
        ).items():  # cross-layer KV sharing, as the runner does it
            gid = next(
                g for g, grp in enumerate(self.config.kv_cache_groups) if target in grp.layer_names
            )
            self.config.kv_cache_groups[gid].layer_names.append(layer)
            self.caches[layer] = self.caches[target]
            self.pages[layer] = self.pages[target]
        self.kernel = case.kernel
        first = next(iter(self.caches.values()))
        self.raw = torch.empty(0, dtype=torch.uint8).set_(first.untyped_storage())
        self.raw.copy_(
            torch.randint(
                0,
                256,
                self.raw.shape,
                dtype=torch.uint8,
                generator=torch.Generator().manual_seed(7),
            )
        )
        self.codes: dict[tuple[str, int], np.ndarray] = {}
        self._write_patterns()

    def _pages(self) -> dict[str, tuple[int, int, int]]:
        out = {}
        for t in self.config.kv_cache_tensors:
            for li, name in enumerate(t.layers):
                spec = self.spec(name)
                content = math.prod(compute_layer_kv_cache_shape_bytes(spec, 1)[1:])
                out[name] = (t.offset + li * t.layer_stride, t.block_stride, content)
        return out

    def spec(self, layer: str):  # noqa: ANN201
        return next(g.kv_cache_spec for g in self.config.kv_cache_groups if layer in g.layer_names)

    @property
    def num_groups(self) -> int:
        return len(self.config.kv_cache_groups)

    def owned(self, gid: int) -> list[int]:
        """Block ids group ``gid`` owns (a block id belongs to one group at a time)."""
        return [b for b in range(self.num_blocks) if b % self.num_groups == gid]

    def layers(self, gid: int) -> list[str]:
        """The group's distinct layer views, in the group's order (a shared one counted once)."""
        out, seen = [], set()
        for name in self.config.kv_cache_groups[gid].layer_names:
            if id(self.caches[name]) not in seen:
                seen.add(id(self.caches[name]))
                out.append(name)
        return out

    def manager_view(self, name: str) -> torch.Tensor:
        """``[num_blocks, k, ...]``: manager block b = kernel rows b*k .. b*k+k-1."""
        t = self.caches[name]
        return t.unflatten(0, (self.num_blocks, t.shape[0] // self.num_blocks))

    def _write_patterns(self) -> None:
        """Through vLLM's (kernel-block) views: attention element (layer, manager block b,
        kernel row j, head, token, channel) gets a value unique in the whole cache; a
        Mamba page gets seeded bytes unique per (layer, block)."""
        code_base = 1
        for gid in range(self.num_groups):
            for name in self.layers(gid):
                mv = self.manager_view(name)
                per_block = mv[0].numel()
                for b in self.owned(gid):
                    if mv.dtype == torch.float32:
                        vals = torch.arange(code_base, code_base + per_block, dtype=torch.float64)
                        mv[b].copy_(vals.view(mv[b].shape).to(torch.float32))
                        self.codes[name, b] = vals.numpy().astype(np.float32)
                    else:
                        g = torch.Generator().manual_seed(1000 * code_base + b)
                        vals = torch.randint(-128, 128, mv[b].shape, dtype=torch.int8, generator=g)
                        mv[b].copy_(vals)
                        self.codes[name, b] = vals.reshape(-1).numpy()
                    code_base += per_block
        assert code_base < 1 << 24, "codes must stay exact in float32"

    def page(self, name: str, b: int) -> tuple[int, int]:
        """(start, end) of layer ``name``'s content of block ``b`` in the allocation."""
        off, stride, content = self.pages[name]
        return off + b * stride, off + b * stride + content

    def expected(self, gid: int, b: int) -> bytes:
        mem = self.raw.numpy()
        return b"".join(mem[slice(*self.page(name, b))].tobytes() for name in self.layers(gid))

    def check_pattern(self, gid: int, b: int, obj: bytes) -> None:
        """The object holds every token of every kernel row of block b of each layer (order-free)."""
        pos = 0
        for name in self.layers(gid):
            _, _, content = self.pages[name]
            part = np.frombuffer(obj[pos : pos + content], dtype=self.codes[name, b].dtype)
            assert np.array_equal(np.sort(part), np.sort(self.codes[name, b])), (
                f"group {gid} block {b} layer {name}: not that block's tokens"
            )
            pos += content
        assert pos == len(obj)


def _read(addrs: list[int], sizes: list[int]) -> bytes:
    return b"".join(ctypes.string_at(a, n) for a, n in zip(addrs, sizes))


@pytest.fixture(scope="module", params=CASES, ids=lambda c: c.label)
def cache(request) -> Cache:
    return Cache(request.param)


def _stager(cache: Cache, layout: KVLayout, gid: int) -> BlockStager:
    pools = build_stager_pools(layout, cache.caches, 8, 1 << 30, lambda ptr, n: None)
    return pools[gid]["save"].acquire()


def test_vllm_views_are_kernel_blocks(cache):
    """The premise: split groups' views really have num_blocks * k rows."""
    for gid, k in enumerate(cache.kernel):
        spec = cache.config.kv_cache_groups[gid].kv_cache_spec
        for name in cache.layers(gid):
            assert cache.caches[name].shape[0] == cache.num_blocks * (spec.block_size // k)


def test_regions_are_exactly_each_manager_block(cache):
    layout = KVLayout.from_kv_caches(cache.config, cache.caches)
    for gid in range(cache.num_groups):
        g = layout.groups[gid]
        contents = [cache.pages[n][2] for n in cache.layers(gid)]
        assert g.object_bytes == sum(contents)
        assert g.tensor_names == tuple(cache.layers(gid))
        ids = cache.owned(gid)
        addrs, sizes = g.regions(ids)
        for b, a, s in zip(ids, addrs, sizes):
            obj = _read(a, s)
            assert obj == cache.expected(gid, b), f"group {gid} block {b}: wrong bytes"
            cache.check_pattern(gid, b, obj)


def test_staged_gather_is_exactly_each_manager_block(cache):
    layout = KVLayout.from_kv_caches(cache.config, cache.caches)
    for gid in range(cache.num_groups):
        stager = _stager(cache, layout, gid)
        assert stager.slot_bytes == layout.groups[gid].object_bytes
        ids = cache.owned(gid)[::-1][:8]  # unsorted
        slots = stager.gather(ids)
        for b, (ptr, n) in zip(ids, slots):
            obj = ctypes.string_at(ptr, n)
            assert obj == cache.expected(gid, b), f"group {gid} block {b}: staged bytes differ"
            cache.check_pattern(gid, b, obj)


def _touched_outside(cache: Cache, before: np.ndarray, gid: int, dst: list[int]) -> int:
    allowed = np.zeros(before.size, dtype=bool)
    for name in cache.layers(gid):
        for b in dst:
            allowed[slice(*cache.page(name, b))] = True
    return int((cache.raw.numpy() != before)[~allowed].sum())


@pytest.mark.parametrize("path", ["staged", "regions"])
def test_round_trip_lands_in_the_target_blocks_kernel_rows(cache, path):
    """Move blocks a -> b as a save + load (staged) or a transport (regions) would:
    b's kernel rows now hold a's, every other byte of the allocation is unchanged."""
    layout = KVLayout.from_kv_caches(cache.config, cache.caches)
    saved = cache.raw.clone()
    try:
        for gid in range(cache.num_groups):
            ids = cache.owned(gid)
            src, dst = [ids[0], ids[2]], [ids[3], ids[1]]
            before = cache.raw.numpy().copy()
            want = {
                name: [cache.manager_view(name)[a].clone() for a in src]
                for name in cache.layers(gid)
            }
            if path == "staged":
                stager = _stager(cache, layout, gid)
                stager.gather(src)
                stager.scatter(dst)
            else:
                g = layout.groups[gid]
                s_addr, sizes = g.regions(src)
                d_addr, _ = g.regions(dst)
                staged = [_read(a, s) for a, s in zip(s_addr, sizes)]  # read all first: like a READ
                for obj, da, ds in zip(staged, d_addr, sizes):
                    pos = 0
                    for a, n in zip(da, ds):
                        ctypes.memmove(a, obj[pos : pos + n], n)
                        pos += n
            for name in cache.layers(gid):
                mv = cache.manager_view(name)
                for b, w in zip(dst, want[name]):
                    assert torch.equal(mv[b].view(torch.uint8), w.view(torch.uint8)), (
                        f"{path}: group {gid} layer {name}: block {b} does not hold the moved block"
                    )
            assert _touched_outside(cache, before, gid, dst) == 0, (
                f"{path}: bytes outside the target blocks changed"
            )
    finally:
        cache.raw.copy_(saved)


def test_shared_layer_is_moved_once():
    cache = Cache(_hybrid("LBHNC", split=True, share=True))
    layout = KVLayout.from_kv_caches(cache.config, cache.caches)
    g = layout.groups[0]
    assert "fa.2" in g.layer_names and g.tensor_names == ("fa.0", "fa.1")
    assert g.object_bytes == 2 * 8192


def test_split_manager_block_is_one_region_per_layer():
    """vLLM's kernel rows are back to back: a 128-token block split 4 x 32 is one 8 KiB
    region per layer (not 4 descriptors), at a stride of one manager block."""
    cache = Cache(_hybrid("LBHNC", split=True))
    layout = KVLayout.from_kv_caches(cache.config, cache.caches)
    for gid, k in enumerate([4, 4, 1, 4]):
        g = layout.groups[gid]
        assert g.kernel_rows == (k,) * len(cache.layers(gid))
        assert len(g.block_bytes) == len(cache.layers(gid))
        assert g.strides.tolist() == [8192] * len(cache.layers(gid))


def test_block_format_tells_split_from_unsplit_where_bytes_differ():
    """LBHNC with 2 heads orders a split block [row, head, token] but an unsplit one
    [head, token]: same bytes, different meaning, so formats differ. LBNHC puts tokens
    outside heads, so splitting does not reorder and the formats agree."""

    def fmt(layout: str, kernel: int) -> str:
        c = Cache(Case(layout, [(["fa.0"], fa(128, 2, 8))], [kernel]))
        return KVLayout.from_kv_caches(c.config, c.caches).groups[0].block_formats[0]

    assert fmt("LBHNC", 32) != fmt("LBHNC", 128)
    assert fmt("LBNHC", 32) == fmt("LBNHC", 128)
    assert fmt("LBHNC", 128) != fmt("LBNHC", 128)


def test_vllm_refuses_to_split_block_outermost_layouts():
    """Why BLHNC appears only unsplit above: vLLM itself refuses to split it."""
    case = _hybrid("BLHNC", split=True)
    with pytest.raises(ValueError, match="cannot be split"):
        Cache(case)


def test_per_head_layout_is_refused_naming_the_layout_and_the_fix():
    cache = Cache(Case("LHBNC", [(["fa.0", "fa.1"], fa(64, 2, 8))], [64]))
    with pytest.raises(LayoutError, match=r"KV cache layout LHBNC.*not contiguous.*LBHNC or LBNHC"):
        KVLayout.from_kv_caches(cache.config, cache.caches)


def test_dim0_not_a_multiple_of_the_block_count_is_refused():
    cache = Cache(_single("LBHNC", 64, 16))
    bad = dict(cache.caches)
    bad["fa.1"] = bad["fa.1"][:-1]
    with pytest.raises(LayoutError, match="not a multiple"):
        KVLayout.from_kv_caches(cache.config, bad)


def test_padded_kernel_rows_are_one_region_each():
    """Kernel rows a constant stride apart with bytes between them (no vLLM layout makes
    this today): block b = k regions, b*k+j at j * row stride; the stager agrees."""
    num_blocks, k, row, pad = 5, 4, 64, 16  # bytes
    buf = torch.arange(num_blocks * k * (row + pad), dtype=torch.int32).view(torch.uint8)[
        : num_blocks * k * (row + pad)
    ]
    t = buf.as_strided((num_blocks * k, 2, row // 2), (row + pad, row // 2, 1))
    geo = block_geometry(t, num_blocks)
    assert geo.offsets == tuple(j * (row + pad) for j in range(k)) and geo.sizes == (row,) * k
    assert geo.stride == k * (row + pad)
    stager = BlockStager([t], 2, num_blocks=num_blocks)
    stager.gather([3, 1])
    for i, b in enumerate([3, 1]):
        want = torch.cat([t[b * k + j].reshape(-1) for j in range(k)])
        assert torch.equal(stager.slot(i), want)
