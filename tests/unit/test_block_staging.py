"""BlockStager on CPU: gather lays out slot = [layer0 block | layer1 block | ...],
scatter puts slots back into other block ids of a poisoned cache, touching
nothing else; the checker catches planted faults."""

from __future__ import annotations

import ctypes
import random

import pytest
import torch

from hybridkv.connector.block_staging import BlockStager

SENTINEL = 0x5A
NUM_BLOCKS = 40


def _padded_layer(num_blocks: int, block_size: int, gen: torch.Generator) -> torch.Tensor:
    """bf16 [num_blocks, 2, block_size, 16] living in a page of extra bytes
    (stride(0) > one block, like an attention page padded to a Mamba page)."""
    block_bytes = 2 * block_size * 16 * 2
    page = torch.randint(-128, 128, (num_blocks, block_bytes + 24), dtype=torch.int8, generator=gen)
    return page[:, :block_bytes].view(torch.bfloat16).view(num_blocks, 2, block_size, 16)


def _layers(block_size: int, mamba_page: int, seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [
        torch.randn(NUM_BLOCKS, 2, block_size, 4 * 16, generator=gen).to(torch.bfloat16),
        torch.randn(NUM_BLOCKS, block_size, 576, generator=gen).to(torch.bfloat16),
        torch.randint(-128, 128, (NUM_BLOCKS, 1, 1, mamba_page), dtype=torch.int8, generator=gen),
        _padded_layer(NUM_BLOCKS, block_size, gen),
        torch.randn(NUM_BLOCKS, 2, block_size, 4 * 16, generator=gen).to(torch.bfloat16),
    ]


def _storage_bytes(t: torch.Tensor) -> torch.Tensor:
    return torch.empty(0, dtype=torch.uint8).set_(t.untyped_storage())


def _poisoned_like(layers: list[torch.Tensor]) -> list[torch.Tensor]:
    """Same geometry (storage size, offset, strides: page padding included),
    every byte SENTINEL."""
    out = []
    for t in layers:
        s = torch.full((t.untyped_storage().nbytes(),), SENTINEL, dtype=torch.uint8)
        out.append(
            torch.empty(0, dtype=t.dtype).set_(
                s.untyped_storage(), t.storage_offset(), t.size(), t.stride()
            )
        )
    return out


def _block(t: torch.Tensor, b: int) -> torch.Tensor:
    return t[b].reshape(-1).view(torch.uint8)


def assert_moved(src, src_ids, dst, dst_ids) -> None:
    """dst block dst_ids[i] == src block src_ids[i] in every layer, and every
    other byte of every dst storage (other blocks, page padding) is SENTINEL."""
    for s, d in zip(src, dst):
        es = d.element_size()
        touched = torch.zeros(d.untyped_storage().nbytes(), dtype=torch.bool)
        nbytes = d[0].numel() * es
        for si, di in zip(src_ids, dst_ids):
            assert torch.equal(_block(d, di), _block(s, si)), f"block {di} differs from {si}"
            start = (d.storage_offset() + di * d.stride(0)) * es
            touched[start : start + nbytes] = True
        rest = _storage_bytes(d)[~touched]
        assert bool((rest == SENTINEL).all()), "bytes outside the moved blocks changed"


def _ids(rng: random.Random, n: int) -> tuple[list[int], list[int]]:
    src = rng.sample(range(NUM_BLOCKS), n)  # unsorted, distinct
    dst = rng.sample(range(NUM_BLOCKS), n)
    return src, dst


@pytest.mark.parametrize("kernel", ["index", "index_select"])
@pytest.mark.parametrize(
    "block_size,mamba_page,seed", [(16, 1024, 0), (32, 1000, 1), (16, 37, 2), (64, 4096, 3)]
)
def test_gather_layout_and_scatter_into_poisoned_cache(block_size, mamba_page, seed, kernel):
    rng = random.Random(seed)
    src = _layers(block_size, mamba_page, seed)
    stager = BlockStager(src, max_blocks_per_batch=24, kernel=kernel)
    assert stager.width == (1 if mamba_page % 2 else 8)
    assert stager.slot_bytes == sum(t[0].numel() * t.element_size() for t in src)
    src_ids, dst_ids = _ids(rng, 17)

    addrs = stager.gather(src_ids)
    assert len(addrs) == 17
    for i, (ptr, nbytes) in enumerate(addrs):
        assert nbytes == stager.slot_bytes
        want = torch.cat([_block(t, src_ids[i]) for t in src])
        assert torch.equal(stager.slot(i), want)
        got = torch.frombuffer(bytearray(ctypes.string_at(ptr, nbytes)), dtype=torch.uint8)
        assert torch.equal(got, want)

    dst = _poisoned_like(src)
    into = BlockStager(dst, max_blocks_per_batch=24, kernel=kernel)
    into.host[:17].copy_(stager.host[:17])  # what the store would write
    into.scatter(dst_ids)
    assert_moved(src, src_ids, dst, dst_ids)


def test_same_stager_round_trip_and_async_handles():
    src = _layers(16, 512, 7)
    cache = [t.clone() for t in src]
    stager = BlockStager(cache, max_blocks_per_batch=8)
    rng = random.Random(7)
    for _ in range(5):
        a = rng.sample(range(NUM_BLOCKS), 8)
        op = stager.gather_async(a)
        op.wait()
        assert op.done() and op.n == 8
        b = rng.sample(range(NUM_BLOCKS), 8)
        stager.scatter_async(b).wait()
        for t, s in zip(cache, src):
            for x, y in zip(a, b):
                assert torch.equal(_block(t, y), _block(s, x))
        src = [t.clone() for t in cache]
    assert stager.gather([]) == []


def _moved_with_fault(fault: str) -> None:
    rng = random.Random(11)
    src = _layers(16, 1024, 11)
    src_ids, dst_ids = _ids(rng, 10)
    stager = BlockStager(src, max_blocks_per_batch=10)
    stager.gather(src_ids)
    dst = _poisoned_like(src)
    into = BlockStager(dst, max_blocks_per_batch=10)
    into.host.copy_(stager.host)
    if fault == "flip_staging_byte":
        i, j = rng.randrange(10), rng.randrange(stager.slot_bytes)
        into.host[i, j] ^= 0xFF
    into.scatter(dst_ids)
    if fault == "write_untouched_block":
        other = next(b for b in range(NUM_BLOCKS) if b not in dst_ids)
        dst[2][other].view(-1)[3] ^= 1
    if fault == "swap_ids":
        dst_ids = [dst_ids[1], dst_ids[0], *dst_ids[2:]]
    if fault == "write_page_padding":
        _storage_bytes(dst[3])[-1] ^= 1
    assert_moved(src, src_ids, dst, dst_ids)


def test_checker_passes_without_fault():
    _moved_with_fault("none")


@pytest.mark.parametrize(
    "fault", ["flip_staging_byte", "write_untouched_block", "swap_ids", "write_page_padding"]
)
def test_checker_detects_planted_fault(fault):
    with pytest.raises(AssertionError):
        _moved_with_fault(fault)


def test_block_dense_in_another_dim_order_is_one_region():
    """LBNHC-like: [B, H, N, C] with N outside H in memory: a block is one dense span
    (not ``is_contiguous``), gathered in memory order."""
    t = torch.arange(5 * 3 * 2 * 4, dtype=torch.int32).view(5, 3, 2, 4).transpose(1, 2)
    stager = BlockStager([t], 3)
    assert stager.slot_bytes == 2 * 3 * 4 * 4
    stager.gather([4, 0])
    assert torch.equal(stager.slot(0).view(torch.int32), torch.arange(96, 120, dtype=torch.int32))
    assert torch.equal(stager.slot(1).view(torch.int32), torch.arange(0, 24, dtype=torch.int32))


def test_rejects_bad_ids_and_layers():
    src = _layers(16, 64, 5)
    stager = BlockStager(src, max_blocks_per_batch=4)
    with pytest.raises(ValueError):
        stager.gather([0, NUM_BLOCKS])
    with pytest.raises(ValueError):
        stager.gather([-1])
    with pytest.raises(ValueError):
        stager.gather([0, 1, 2, 3, 4])
    with pytest.raises(ValueError):
        stager.scatter([3, 3])
    stager.gather([3, 3])  # duplicates are fine for a gather
    assert torch.equal(stager.slot(0), stager.slot(1))
    with pytest.raises(ValueError, match="not contiguous"):  # a block split per head
        BlockStager([torch.zeros(8, 4, 2).transpose(0, 1)], 2)
    with pytest.raises(ValueError, match="not a multiple"):  # dim 0 is not num_blocks x k rows
        BlockStager([torch.zeros(10, 8)], 2, num_blocks=4)
    with pytest.raises(ValueError, match="overlap"):
        BlockStager([torch.zeros(10).as_strided((4, 4), (2, 1))], 2)
    with pytest.raises(ValueError):
        BlockStager([], 2)
    with pytest.raises(ValueError):
        BlockStager(src, 2, kernel="triton")
