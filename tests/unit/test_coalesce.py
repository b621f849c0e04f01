"""Coalescing a hand-over's (block, region) copies into the fewest descriptors contiguous on both sides.

Layouts come from vLLM's own planning and ``allocate_kv_cache`` (the caches of
test_kernel_blocks: kernel splits under LBHNC / LBNHC, hybrid overlays whose Mamba pages share
attention's, block-outermost BLHNC; and test_pd_tp's TP head slices). Every check compares the
WHOLE destination allocation: the coalesced copies, applied with ``memmove`` (what a NIXL READ
does), must leave exactly the bytes the per-region copies leave, and a hand-over planted one block
off must not. Descriptor counts and bytes are exact (==), derived from vLLM's placement contract
(``KVCacheTensor`` layer and block strides), not from the code under test.
"""

from __future__ import annotations

import ctypes

import numpy as np
import pytest
import torch

from hybridkv.connector.block_layout import KVLayout, coalesce, run_lengths
from hybridkv.connector.pd_tp import rank_reads
from hybridkv.connector.pd_transport import coalesced, read_descriptors
from tests.unit.test_kernel_blocks import CASES, Cache, _hybrid, _single
from tests.unit.test_pd_tp import Cache as TPCache
from tests.unit.test_pd_tp import _spans

POISON = 0x5A


def _pair(case):  # noqa: ANN001, ANN202
    """(prefill cache with random bytes, decode layout, decode raw bytes) of one case."""
    src = Cache(case)
    dst = Cache(case)
    return (
        src,
        KVLayout.from_kv_caches(src.config, src.caches),
        dst,
        KVLayout.from_kv_caches(dst.config, dst.caches),
    )


def _apply(rows_local: np.ndarray, rows_remote: np.ndarray) -> None:
    for (la, n, _), (ra, n2, _) in zip(rows_local.tolist(), rows_remote.tolist(), strict=True):
        assert n == n2
        ctypes.memmove(int(la), int(ra), int(n))


def _after(dst: Cache, local: np.ndarray, remote: np.ndarray) -> np.ndarray:
    dst.raw.fill_(POISON)
    _apply(local, remote)
    return dst.raw.numpy().copy()


def _handover(
    case_groups: int, runs: list[tuple[int, int, int]], nb: int
) -> tuple[list[list[int]], list[list[int]]]:
    """runs: (group, first remote id, first local id, length) -> per-group id lists."""
    r = [[] for _ in range(case_groups)]
    l_ = [[] for _ in range(case_groups)]
    for g, r0, l0, n in runs:
        assert r0 + n <= nb and l0 + n <= nb
        r[g].extend(range(r0, r0 + n))
        l_[g].extend(range(l0, l0 + n))
    return r, l_


def _rows(src_layout: KVLayout, dst_layout: KVLayout, r_ids, l_ids):  # noqa: ANN001, ANN202
    return read_descriptors(dst_layout.groups, src_layout.groups, r_ids, l_ids)


def _random_handover(cache: Cache, rng: np.random.Generator, contiguous: bool):
    """Per group up to 3 blocks of vLLM's one pool (ids distinct across groups and sides):
    consecutive on both sides (``contiguous``) or scattered."""
    nb, groups = cache.num_blocks, cache.num_groups
    if contiguous:
        chunk = nb // (2 * groups)
        n = min(3, chunk)
        starts = [int(c * chunk + rng.integers(0, chunk - n + 1)) for c in range(2 * groups)]
        return (
            [list(range(starts[2 * g], starts[2 * g] + n)) for g in range(groups)],
            [list(range(starts[2 * g + 1], starts[2 * g + 1] + n)) for g in range(groups)],
        )
    n = min(3, nb // (2 * groups))
    pick = [int(x) for x in rng.permutation(nb)[: 2 * n * groups]]
    return (
        [pick[2 * n * g : 2 * n * g + n] for g in range(groups)],
        [pick[2 * n * g + n : 2 * n * (g + 1)] for g in range(groups)],
    )


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.label)
@pytest.mark.parametrize("contiguous", [True, False], ids=["runs", "scattered"])
def test_coalesced_copies_move_exactly_the_regions_bytes(case, contiguous):
    """Any layout vLLM makes: coalesced == per-region, whole allocation compared; a one-block
    shift is caught."""
    src, sl, dst, dl = _pair(case)
    rng = np.random.default_rng(3)
    r_ids, l_ids = _random_handover(src, rng, contiguous)
    local, remote = _rows(sl, dl, r_ids, l_ids)
    want = _after(dst, local, remote)
    c_local, c_remote = coalesced(local, remote)
    assert len(c_local) <= len(local)
    assert int(c_local[:, 1].sum()) == int(local[:, 1].sum())
    assert np.array_equal(_after(dst, c_local, c_remote), want)
    # planted: the first block of the first group read one block off
    shifted = [list(ids) for ids in r_ids]
    g = next(i for i, ids in enumerate(shifted) if ids)
    shifted[g][0] = shifted[g][0] + 1 if shifted[g][0] + 1 < src.num_blocks else shifted[g][0] - 1
    s_local, s_remote = coalesced(*_rows(sl, dl, shifted, l_ids))
    assert not np.array_equal(_after(dst, s_local, s_remote), want)


def _page_fills_stride(cache: Cache, gid: int) -> bool:
    name = cache.layers(gid)[0]
    _, stride, content = cache.pages[name]
    return content == stride


def test_single_group_runs_are_one_descriptor_per_layer_and_run():
    """FA 64 tokens in kernel rows of 16 (LBHNC): runs 4, 1, 2 of ids consecutive on both sides
    -> 2 layers x 3 runs, each run's bytes = run length x page."""
    case = _single("LBHNC", 64, 16)
    src, sl, dst, dl = _pair(case)
    nb = src.num_blocks
    assert _page_fills_stride(src, 0)
    r_ids, l_ids = _handover(1, [(0, 2, 5, 4), (0, 8, 1, 1), (0, 10, 11, 2)], nb)
    local, remote = _rows(sl, dl, r_ids, l_ids)
    assert len(local) == 2 * 7  # one region per layer per block (kernel rows back to back)
    c_local, c_remote = coalesced(local, remote)
    page = src.pages["fa.0"][2]
    assert sorted(c_local[:, 1].tolist()) == sorted([4 * page, 1 * page, 2 * page] * 2)
    assert len(c_local) == 6
    assert np.array_equal(_after(dst, c_local, c_remote), _after(dst, local, remote))


def test_every_other_block_does_not_coalesce():
    case = _single("LBNHC", 256, 64)
    src, sl, dst, dl = _pair(case)
    r_ids = [[0, 2, 4]]
    l_ids = [[1, 3, 5]]
    local, remote = _rows(sl, dl, r_ids, l_ids)
    c_local, _ = coalesced(local, remote)
    assert len(c_local) == len(local) == 2 * 3
    # consecutive on one side only: still one descriptor per block
    local, remote = _rows(sl, dl, [[0, 1, 2]], [[1, 3, 5]])
    assert len(coalesced(local, remote)[0]) == 6


def test_hybrid_overlay_mamba_padded_pages_stay_per_block():
    """FA 128/k32 + SW 64/k16 + Mamba (192 B state in an 8 KiB page) + FA 256/k64, LBHNC:
    a 3-block run of FA -> 1 per layer; SW every other block -> per block; Mamba run of 2 ->
    per block (its state does not fill the page)."""
    case = _hybrid("LBHNC", split=True)
    src, sl, dst, dl = _pair(case)
    assert _page_fills_stride(src, 0) and not _page_fills_stride(src, 2)
    # any ids of vLLM's one pool (the byte compare does not rely on the rig's per-group patterns)
    r_ids = [[9, 10, 11], [20, 22], [0, 1], []]
    l_ids = [[13, 14, 15], [17, 19], [5, 6], []]
    local, remote = _rows(sl, dl, r_ids, l_ids)
    layers = [len(sl.groups[g].block_bytes) for g in range(4)]
    assert layers == [2, 2, 2, 1]
    assert len(local) == 2 * 3 + 2 * 2 + 2 * 2
    c_local, c_remote = coalesced(local, remote)
    assert len(c_local) == 2 * 1 + 2 * 2 + 2 * 2
    page = src.pages["fa.0"][1]
    mamba_bytes = src.pages["m.0"][2]
    assert sorted(c_local[:, 1].tolist()) == sorted(
        [3 * page] * 2 + [src.pages["sw.0"][2]] * 4 + [mamba_bytes] * 4
    )
    assert np.array_equal(_after(dst, c_local, c_remote), _after(dst, local, remote))


def test_attention_block_before_a_mamba_block_meets_it():
    """Groups overlay one allocation: FA block 9 of layer l ends where block 10 of the same
    layer slot starts, which the Mamba group holds; the two copies meet on both sides -> one."""
    case = _hybrid("LBHNC", split=True)
    src, sl, dst, dl = _pair(case)
    r_ids = [[9], [], [10], []]
    l_ids = [[20], [], [21], []]
    local, remote = _rows(sl, dl, r_ids, l_ids)
    c_local, c_remote = coalesced(local, remote)
    assert len(local) == 4 and len(c_local) == 2
    page = src.pages["fa.0"][1]
    assert sorted(c_local[:, 1].tolist()) == [page + src.pages["m.0"][2]] * 2
    assert np.array_equal(_after(dst, c_local, c_remote), _after(dst, local, remote))


def test_block_outermost_run_is_one_descriptor():
    """BLHNC: a block's layers lie back to back, and block b+1 follows block b: a run of 5
    consecutive ids on both sides is ONE descriptor of 5 x (layers x page)."""
    case = _single("BLHNC", 128, 128)
    src, sl, dst, dl = _pair(case)
    t = src.config.kv_cache_tensors[0]
    assert t.layer_stride * len(t.layers) == t.block_stride  # vLLM's block-outermost placement
    local, remote = _rows(sl, dl, [[3, 4, 5, 6, 7]], [[6, 7, 8, 9, 10]])
    assert len(local) == 10
    c_local, c_remote = coalesced(local, remote)
    assert c_local[:, 1].tolist() == [5 * t.block_stride]
    assert np.array_equal(_after(dst, c_local, c_remote), _after(dst, local, remote))
    # the store's objects: one part per block, same bytes in the same order
    addrs, sizes = sl.groups[0].regions([3, 8])
    m_addrs, m_sizes = sl.groups[0].object_regions([3, 8])
    assert m_sizes == [[t.block_stride]] * 2 and m_addrs == [[a[0]] for a in addrs]
    assert [sum(s) for s in sizes] == [sum(s) for s in m_sizes]


def test_layer_outermost_objects_keep_one_part_per_layer():
    case = _single("LBHNC", 64, 16)
    src, sl, _, _ = _pair(case)
    assert sl.groups[0].object_regions([3, 1]) == sl.groups[0].regions([3, 1])


def test_adjacent_layers_meet_at_the_last_block():
    """Layer-outermost: layer l's last block ends where layer l+1's block 0 starts
    (layer_stride = num_blocks x page); a hand-over holding both, on both sides, merges them."""
    case = _single("LBHNC", 64, 16)
    src, sl, dst, dl = _pair(case)
    nb = src.num_blocks
    t = src.config.kv_cache_tensors[0]
    assert t.layer_stride == nb * t.block_stride
    local, remote = _rows(sl, dl, [[nb - 1, 0]], [[nb - 1, 0]])
    c_local, c_remote = coalesced(local, remote)
    assert len(local) == 4 and len(c_local) == 3
    assert np.array_equal(_after(dst, c_local, c_remote), _after(dst, local, remote))


def test_tp_head_slices_coalesce_exactly():
    """Prefill TP2 -> decode TP1: each rank's spans are head halves of every block; byte-exact,
    and halves of consecutive blocks never meet (the other rank's heads lie between)."""
    full = TPCache(4)
    gen = torch.Generator().manual_seed(11)
    ranks = [TPCache(2) for _ in range(2)]
    for rank in ranks:
        rank.raw.copy_(torch.randint(0, 256, (rank.raw.numel(),), dtype=torch.uint8, generator=gen))
    plan = rank_reads(0, 1, 2, 4)
    r_ids = [[3, 4, 5], [9, 10]]
    l_ids = [[6, 7, 8], [1, 2]]
    for part, src in zip(plan, ranks, strict=True):
        sl = _spans(full, src, part)
        local, remote = read_descriptors(
            full.layout.groups, src.layout.groups, r_ids, l_ids, slices=sl
        )
        c_local, c_remote = coalesced(local, remote)
        full.raw.fill_(POISON)
        _apply(local, remote)
        want = full.raw.numpy().copy()
        full.raw.fill_(POISON)
        _apply(c_local, c_remote)
        assert np.array_equal(full.raw.numpy(), want)
        assert len(c_local) == len(local)


def test_coalesce_refuses_overlapping_destinations_and_keeps_devices_apart():
    with pytest.raises(ValueError, match="overlap"):
        coalesce(np.array([0, 8]), np.array([100, 200]), np.array([16, 8]))
    d, s, n, dd, sd = coalesce(
        np.array([0, 8, 16]),
        np.array([100, 108, 116]),
        np.array([8, 8, 8]),
        np.array([0, 0, 1]),
        np.array([0, 0, 0]),
    )
    assert d.tolist() == [0, 16] and n.tolist() == [16, 8] and dd.tolist() == [0, 1]


def test_run_lengths():
    assert run_lengths([3, 4, 5, 9, 10, 2]) == [3, 2, 1]
    assert run_lengths([7, 6, 5, 9, 10, 11]) == [3, 3]
    assert run_lengths([1, 2, 1]) == [2, 1]
    assert run_lengths([4, 5, 6, 8], peer=[9, 10, 2, 3]) == [2, 1, 1]
    assert run_lengths([7, 6, 5], peer=[3, 2, 1]) == [3]
    assert run_lengths([7, 6, 5], peer=[1, 2, 3]) == [
        1,
        1,
        1,
    ]  # reversed on one side: no copy spans two


def test_descending_runs_on_both_sides_coalesce():
    """vLLM frees a request's blocks tail first, so later allocations often get ids counting
    down: descending on both sides is contiguous memory on both sides."""
    case = _single("LBHNC", 64, 16)
    src, sl, dst, dl = _pair(case)
    local, remote = _rows(sl, dl, [[7, 6, 5]], [[3, 2, 1]])
    c_local, c_remote = coalesced(local, remote)
    assert len(c_local) == 2 and c_local[:, 1].tolist() == [3 * src.pages["fa.0"][2]] * 2
    assert np.array_equal(_after(dst, c_local, c_remote), _after(dst, local, remote))
    local, remote = _rows(sl, dl, [[7, 6, 5]], [[1, 2, 3]])
    assert len(coalesced(local, remote)[0]) == 6
    assert run_lengths([]) == []
