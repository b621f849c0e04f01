"""Copy-on-write block copies end whole in every layer view, on whichever vLLM is on the path.

0.32/0.33 copy one view per address (a hybrid page shared by a Mamba state view
and an attention view is copied over the state's bytes only) and hybridkv redoes
the copy over every view; 0.34 copies every view geometry itself (vllm#55112)
and hybridkv then has nothing to redo (``block_copy_views`` returns no views).
"""

from __future__ import annotations

import torch
from vllm.v1.core.kv_cache_utils import KVCacheBlockCopy
from vllm.v1.worker.utils import copy_kv_cache_blocks_inplace

from hybridkv.connector.block_copies import block_copy_views, redo_block_copies
from hybridkv.store import vllm_compat

NUM_BLOCKS, PAGE, STATE = 6, 4096, 1120


def _shared_page_layers() -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """A state view and an attention view of the same pages, in an allocation that holds more
    than these pages (the CPU engine puts several layers in one): vLLM cannot copy the whole
    allocation's rows, it copies views."""
    whole = torch.randint(
        0,
        255,
        (2 * NUM_BLOCKS * PAGE,),
        dtype=torch.uint8,
        generator=torch.Generator().manual_seed(1),
    )
    buf = whole[: NUM_BLOCKS * PAGE]
    state = buf.as_strided((NUM_BLOCKS, 1, 1, STATE), (PAGE, STATE, STATE, 1))
    attn = buf.view(torch.bfloat16).view(NUM_BLOCKS, 2, 16, 64)
    assert state.data_ptr() == attn.data_ptr()
    return buf, {"layers.0.linear_attn": state, "layers.1.self_attn": attn}


def test_copies_are_whole_after_vllm_and_hybridkv_and_redone_only_where_vllm_falls_short():
    buf, layers = _shared_page_layers()
    pages = buf.view(NUM_BLOCKS, PAGE)
    before = pages.clone()
    views = block_copy_views(layers, NUM_BLOCKS)
    copy_kv_cache_blocks_inplace(layers.values(), NUM_BLOCKS, [KVCacheBlockCopy(1, 3)])
    vllm_whole = torch.equal(pages[3], before[1])
    assert torch.equal(pages[3, :STATE], before[1, :STATE])  # every version copies the first view
    assert vllm_compat.vllm_copies_whole_pages() == vllm_whole
    assert len(views) == (0 if vllm_whole else 2)
    redo_block_copies(views, [(1, 3)])
    assert torch.equal(pages[3], before[1])
    untouched = [b for b in range(NUM_BLOCKS) if b != 3]
    assert torch.equal(pages[untouched], before[untouched])
