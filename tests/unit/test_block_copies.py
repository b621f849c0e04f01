"""vLLM 0.32's copy-on-write block copy misses layers that share an allocation; the redo fixes it.

The layout is qwen3-next's (tiny model, block 256): a GDN layer and a full-attention
layer view the same page of one buffer from the same base address, the GDN view
covering the first 35,840 bytes of each 131,072-byte page. vLLM's own
``copy_kv_cache_blocks_inplace`` is run first, exactly as the worker runs it.
"""

from __future__ import annotations

import torch
from vllm.v1.core.kv_cache_utils import KVCacheBlockCopy
from vllm.v1.worker.utils import copy_kv_cache_blocks_inplace

from hybridkv.connector.block_copies import block_copy_views, redo_block_copies

NUM_BLOCKS, PAGE, GDN_BYTES = 8, 131072, 35840


def _shared_layers() -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Two (GDN, attention) layer pairs in ONE allocation, as the CPU engine allocates them."""
    buf = torch.randint(
        0,
        255,
        (2 * NUM_BLOCKS * PAGE,),
        dtype=torch.uint8,
        generator=torch.Generator().manual_seed(0),
    )
    layers = {}
    for pair in range(2):
        part = buf[pair * NUM_BLOCKS * PAGE : (pair + 1) * NUM_BLOCKS * PAGE]
        gdn = part.as_strided((NUM_BLOCKS, 1, 1, GDN_BYTES), (PAGE, GDN_BYTES, GDN_BYTES, 1))
        attn = part.view(torch.bfloat16).view(NUM_BLOCKS, 2, 256, 128)
        assert gdn.data_ptr() == attn.data_ptr()
        layers[f"layers.{2 * pair}.linear_attn"] = gdn
        layers[f"layers.{2 * pair + 1}.self_attn"] = attn
    return buf, layers


def _pages(buf: torch.Tensor) -> torch.Tensor:
    return buf.view(2, NUM_BLOCKS, PAGE)


def test_vllm_copies_only_the_first_view_of_a_shared_page():
    """The defect the redo exists for. If this fails, vLLM copies whole pages now and
    connector/block_copies.py can go."""
    buf, layers = _shared_layers()
    copy_kv_cache_blocks_inplace(layers.values(), NUM_BLOCKS, [KVCacheBlockCopy(1, 3)])
    for page in _pages(buf):
        assert torch.equal(page[3, :GDN_BYTES], page[1, :GDN_BYTES])
        assert not torch.equal(page[3], page[1]), "vLLM now copies the whole page"


def test_redo_copies_whole_blocks_of_every_view_and_nothing_else():
    buf, layers = _shared_layers()
    before = _pages(buf).clone()
    views = block_copy_views(layers, NUM_BLOCKS)
    assert len(views) == 4  # every layer's view, though each pair shares a base address
    copy_kv_cache_blocks_inplace(
        layers.values(), NUM_BLOCKS, [KVCacheBlockCopy(1, 3), KVCacheBlockCopy(2, 5)]
    )
    redo_block_copies(views, [(1, 3), (2, 5)])
    untouched = [b for b in range(NUM_BLOCKS) if b not in (3, 5)]
    for page, old in zip(_pages(buf), before):
        assert torch.equal(page[3], old[1]) and torch.equal(page[5], old[2])
        assert torch.equal(page[untouched], old[untouched])
