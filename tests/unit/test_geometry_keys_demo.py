"""Geometry read off vLLM, the key schema, and the README demo command."""

from __future__ import annotations

from hybridkv.cli.harness.kv_manager import Geometry, fa, mamba, sw
from hybridkv.store.geometry import CoordinatorParams, GroupGeometry
from hybridkv.store.keys import KEY_SCHEME_VERSION, KeySchema


def test_geometry_matches_vllm_resolution():
    geo = Geometry(specs=[fa(16), fa(32, heads=2), mamba(32)], hash_block_size=16)
    manager = geo.manager()
    from_manager = GroupGeometry.from_kv_cache_manager(manager)
    rebuilt = GroupGeometry.from_params(CoordinatorParams.from_kv_cache_manager(manager))
    assert from_manager.describe() == rebuilt.describe()
    assert from_manager.scheduler_block_size == 32
    assert from_manager.hash_block_size == 16
    assert from_manager.fine_grained  # Mamba align with blocks larger than the hash unit
    assert from_manager.cache_hit_alignment_tokens == 16
    assert from_manager.dense_group_ids == (0, 1)
    assert from_manager.sparse_group_ids == (2,)
    assert [g.block_size for g in from_manager.groups] == [16, 32, 32]


def test_window_disables_fine_grained_and_eagle_flags_follow_vllm():
    geo = Geometry(
        specs=[fa(32), sw(32, 64, heads=2), mamba(64)],
        hash_block_size=16,
        eagle_group=0,
        use_eagle=True,
    )
    g = GroupGeometry.from_kv_cache_manager(geo.manager())
    # vLLM refuses sub-block hits when a window group needs block-aligned lookups.
    assert not g.fine_grained
    assert g.cache_hit_alignment_tokens == 64
    assert g.groups[0].is_eagle and not g.groups[1].is_eagle
    assert g.sparse_group_ids == (1, 2)


def test_key_schema_separates_models_layouts_ranks_and_groups():
    rows = [{"group": 0, "spec": "FullAttentionSpec", "block_size": 16}]
    a = KeySchema.create("m", "bfloat16", rows)
    h = bytes(range(32))
    key = a.key(0, h)
    assert key.startswith(f"{KEY_SCHEME_VERSION}/") and key.endswith(h.hex())
    assert a.key(1, h) != key
    assert a.for_rank(1).key(0, h) != key
    assert KeySchema.create("m", "float16", rows).key(0, h) != key
    other_layout = [{"group": 0, "spec": "FullAttentionSpec", "block_size": 32}]
    assert KeySchema.create("m", "bfloat16", other_layout).key(0, h) != key


def test_readme_demo_runs_against_real_master():
    from hybridkv.cli.main import main

    assert main(["mirror-demo", "--turns", "2"]) == 0
