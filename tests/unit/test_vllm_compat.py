"""hybridkv.store.vllm_compat against the REAL vLLM on the path (0.32, and 0.33 in CI's second pass).

Each helper is checked against what that vLLM itself does, so the same test
fails on either version if the helper picks the other version's behaviour.
"""

from __future__ import annotations

import json
import random

import pytest
from vllm.config import ModelConfig, VllmConfig
from vllm.v1.core.kv_cache_coordinator import get_kv_cache_coordinator

from hybridkv.cli.harness.kv_manager import Geometry, fa, make_request, mamba, run_prefill, sw
from hybridkv.store import vllm_compat
from tests.unit.tiny_vllm_config import TINY_LLAMA

GEO = Geometry(
    specs=[fa(16), sw(16, 64), mamba(64)], hash_block_size=16, num_blocks=400, max_model_len=4096
)
TOKENS = random.Random(3).choices(range(3, 30000), k=700)


def test_lookup_bound_defaults_to_all_but_the_last_token_and_caps_the_hit_where_vllm_can():
    manager = GEO.manager()
    run_prefill(manager, GEO, TOKENS)
    req = make_request(GEO, TOKENS)
    assert vllm_compat.max_cache_hit_length(req) == 699
    assert vllm_compat.max_cache_hit_length(req, 300) == 300
    # The default bound is vLLM's own lookup, on either version.
    _, hit, _ = vllm_compat.get_computed_blocks(manager, req)
    _, same, _ = vllm_compat.get_computed_blocks(manager, req, 699)
    assert hit == same == 688  # the prompt's Mamba checkpoint: the last hash unit (16) below 699
    if vllm_compat.LOOKUP_TAKES_MAX_CACHE_HIT_LENGTH:  # 0.33: the bound reaches vLLM
        _, capped, _ = vllm_compat.get_computed_blocks(manager, req, 300)
        assert capped == 256
    else:  # 0.32 cannot bound the lookup: refusing beats a hit past the caller's bound
        with pytest.raises(ValueError, match="cannot bound a hit at 300"):
            vllm_compat.get_computed_blocks(manager, req, 300)


@pytest.mark.parametrize("use_eagle", [False, True])
def test_eagle_drop_groups_are_the_groups_vllm_gives_the_eagle_drop(use_eagle):
    """A drafter group flagged ``is_eagle_group``, with the scheduler's block drop on or off."""
    geo = Geometry(
        specs=[fa(16), fa(32), mamba(32)], hash_block_size=16, eagle_group=1, use_eagle=use_eagle
    )
    coordinator = get_kv_cache_coordinator(
        kv_cache_config=geo.kv_cache_config(),
        max_model_len=4096,
        max_in_flight_tokens=4096,
        use_eagle=use_eagle,
        enable_caching=True,
        enable_kv_cache_events=False,
        dcp_world_size=1,
        pcp_world_size=1,
        scheduler_block_size=geo.scheduler_block_size,
        hash_block_size=16,
    )
    truth = {g for g, m in enumerate(coordinator.single_type_managers) if m.use_eagle}
    assert vllm_compat.eagle_drop_group_ids(coordinator) == truth
    if use_eagle:
        assert truth == {1}


def test_kv_cache_configs_group_layers_like_the_engine(tmp_path):
    """Two full-attention layers + a sliding-window layer: the helper must reach vLLM's
    grouping on either version."""
    (tmp_path / "config.json").write_text(json.dumps(TINY_LLAMA))
    cfg = VllmConfig(
        model_config=ModelConfig(
            model=str(tmp_path),
            skip_tokenizer_init=True,
            dtype="bfloat16",
            enforce_eager=True,
            max_model_len=4096,
        )
    )
    cfg.cache_config.kv_cache_layout = "LBHNC"  # what the CPU attention backend resolves to
    specs = {"a": fa(16), "b": fa(16), "w": sw(16, 64)}
    (config,) = vllm_compat.get_kv_cache_configs(cfg, [specs], [64 << 20])
    groups = sorted(tuple(g.layer_names) for g in config.kv_cache_groups)
    assert groups == [
        ("a",),
        ("b",),
        ("w",),
    ]  # hybrid: vLLM groups layers by count, one layer each here
    assert config.num_blocks > 0


def test_cached_block_ids_are_the_blocks_vllm_would_hit():
    """0.32/0.33 map keys to blocks (or dicts of them), 0.34 to int ids (+ ``_dup_ids``)."""
    manager = GEO.manager()
    run_prefill(manager, GEO, TOKENS)
    cache = manager.block_pool.cached_block_hash_to_block
    ids = vllm_compat.cached_block_ids(cache)
    assert len(ids) > 40 and all(len(v) == 1 for v in ids.values())
    for key, (block_id,) in ids.items():
        assert cache.get_one_block(key).block_id == block_id
        assert manager.block_pool.blocks[block_id].block_hash == key


def test_head_major_slots_and_state_alignment_default_to_the_older_layout():
    import torch
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    plain = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=8, dtype=torch.float16)
    assert vllm_compat.kv_head_major_slots(plain) is False
    assert vllm_compat.mamba_state_alignment(mamba(64)) == 1

    if "kv_head_major_slots" in FullAttentionSpec.__dataclass_fields__:  # 0.34
        packed = FullAttentionSpec(
            block_size=16,
            num_kv_heads=2,
            head_size=8,
            dtype=torch.float16,
            kv_head_major_slots=True,
        )
        assert vllm_compat.kv_head_major_slots(packed) is True


def test_model_runner_output_builds_on_this_vllm():
    out = vllm_compat.model_runner_output(["a", "b"], sampled_token_ids=[[1], []])
    assert out.req_ids == ["a", "b"] and out.sampled_token_ids == [[1], []]
