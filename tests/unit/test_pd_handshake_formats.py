"""The P/D handshake refuses two KV caches whose blocks hold equal bytes in a different order.

Why: GPU attention backends split a manager block into kernel blocks, and under
``VLLM_KV_CACHE_LAYOUT=LBHNC`` a block split 2 x 16 orders heads and tokens
differently from an unsplit 32-token block, with the same block bytes. Before
block formats travelled in the handshake such a pair passed every check and
decode would have read scrambled KV. Both caches here are built by vLLM's own
``allocate_kv_cache`` (CPU tensors), once with ``kernel_block_sizes``.
"""

from __future__ import annotations

import torch
from vllm.config import VllmConfig
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheGroupSpec
from vllm.v1.worker.utils import allocate_kv_cache

from hybridkv.connector.block_layout import KVLayout, layout_rows
from hybridkv.connector.pd_handshake import HANDSHAKE_VERSION, LayoutDescriptor, find_mismatches
from hybridkv.store.vllm_compat import get_kv_cache_config_from_groups


def _descriptor(kernel_block_sizes: list[int] | None, layout: str = "LBHNC") -> LayoutDescriptor:
    cfg = VllmConfig()
    cfg.cache_config.kv_cache_layout = layout
    spec = FullAttentionSpec(block_size=32, num_kv_heads=2, head_size=64, dtype=torch.bfloat16)
    config = get_kv_cache_config_from_groups(
        cfg, [KVCacheGroupSpec(["fa.0", "fa.1"], spec)], 4 << 20
    )
    caches = allocate_kv_cache(
        config,
        torch.device("cpu"),
        cfg.cache_config.get_resolved_kv_cache_layout(),
        kernel_block_sizes,
    )
    kv = KVLayout.from_kv_caches(config, caches)
    return LayoutDescriptor.from_kv(kv, layout_rows(config), tp_size=1).without_addresses()


def test_layouts_differing_only_in_block_format_are_refused_naming_the_fix():
    whole, split = _descriptor(None), _descriptor([16])
    a, b = whole.groups[0], split.groups[0]
    # everything the handshake compared before version 4 agrees ...
    assert (a.spec, a.block_size, a.dtype, a.sliding_window, a.block_bytes) == (
        b.spec,
        b.block_size,
        b.dtype,
        b.sliding_window,
        b.block_bytes,
    )
    assert a.block_formats != b.block_formats and len(a.block_formats) == 2
    problems = find_mismatches(whole, split)
    assert [m.field for m in problems] == ["group 0 block_formats"]
    msg = str(problems[0])
    assert (
        "same attention backend / kernel block size / VLLM_KV_CACHE_LAYOUT on both instances" in msg
    )
    assert msg.startswith(
        f"prefill group 0 block_formats={list(a.block_formats)} but decode has "
        f"{list(b.block_formats)}"
    )
    # ... and the formats survive the JSON trip, so the refusal happens across processes too
    assert LayoutDescriptor.from_json(split.to_json()).groups[0].block_formats == b.block_formats
    assert (
        find_mismatches(
            LayoutDescriptor.from_json(whole.to_json()), LayoutDescriptor.from_json(split.to_json())
        )
        == problems
    )


def test_equal_formats_pass_and_the_version_says_so():
    assert find_mismatches(_descriptor([16]), _descriptor([16])) == []
    assert find_mismatches(_descriptor(None), _descriptor(None)) == []
    assert HANDSHAKE_VERSION == 9
