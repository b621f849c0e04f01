"""Dense-reference reconciliation vs vLLM's single-group reference."""

from __future__ import annotations

import random

import pytest
from hypothesis import given
from hypothesis import strategies as st
from vllm.utils.math_utils import cdiv

from hybridkv.connector.dense_reference import (
    install_reconciled_lookup,
    reconcile_dense_hits,
    reconciled_computed_blocks_for_connector,
)
from hybridkv.store.geometry import GroupGeometry
from tests.unit.harness import (
    Geometry,
    evict_random,
    fa,
    make_request,
    mamba,
    run_prefill,
)
from tests.unit.strategies import PROPERTY, geometries, token_workloads


TWO_DENSE_PLUS_MAMBA = Geometry(
    specs=[fa(16, heads=1), fa(32, heads=2), mamba(32)],
    hash_block_size=16,
    num_blocks=300,
    label="fa16+fa32+mamba32",
)


def _evict_group_blocks_from(manager, request_id_blocks, group: int, first_block: int):
    manager.evict_blocks(set(request_id_blocks[group][first_block:]))


def test_vllm_reports_length_second_dense_group_does_not_cover():
    """Regression: FA16 + FA32 + Mamba, FA32 evicted deeper than FA16.

    vLLM's get_computed_blocks_for_connector takes group 0 (FA16) as the only
    dense reference and reports its hit; FA32's returned blocks cover only
    64 tokens. hybridkv reports a length every returned list covers.
    """
    geo = TWO_DENSE_PLUS_MAMBA
    manager = geo.manager()
    tokens = list(range(1000, 1257))  # 257 tokens
    req = run_prefill(manager, geo, tokens, free=False)
    block_ids = manager.get_block_ids(req.request_id)
    manager.free(req)
    # Evict FA32 (group 1) from token 64 on.
    _evict_group_blocks_from(manager, block_ids, group=1, first_block=2)

    query = make_request(geo, tokens + [7, 8, 9])
    blocks, vllm_len, _, vllm_diverged = manager.get_computed_blocks_for_connector(query)
    fa32_covered = len(blocks.blocks[1]) * 32
    assert vllm_len == 256
    assert fa32_covered == 64
    assert fa32_covered < vllm_len, "vLLM's reported length is not covered by FA32"

    geometry = GroupGeometry.from_kv_cache_manager(manager)
    ours, our_len, _, diverged = reconciled_computed_blocks_for_connector(manager, geometry, query)
    assert our_len == 64
    for gid, g in enumerate(geometry.groups):
        if g.downward_closed:
            assert len(ours.blocks[gid]) == cdiv(our_len, g.block_size)
    assert diverged  # Mamba's state sits at 256, not at 64


def test_install_replaces_method_on_bound_manager_only():
    geo = TWO_DENSE_PLUS_MAMBA
    bound, other = geo.manager(), geo.manager()
    install_reconciled_lookup(bound)
    assert "get_computed_blocks_for_connector" in vars(bound)
    assert "get_computed_blocks_for_connector" not in vars(other)


@pytest.mark.parametrize(
    "hits,dense,expect",
    [
        # one dense group: identical to vLLM's rule
        ([128, 64], [True, False], (False, 128, True)),
        ([128, 128], [True, False], (False, 128, False)),
        ([64, 128], [True, False], (True, 0, False)),
        # two dense groups: max guard, min report
        ([128, 64, 96], [True, True, False], (False, 64, True)),
        ([128, 64, 128], [True, True, False], (False, 64, True)),
        ([128, 64, 160], [True, True, False], (True, 0, False)),
        ([128, 128, 128], [True, True, False], (False, 128, False)),
        # a sparse group lagging below the reported length
        ([128, 96, 32], [True, True, False], (False, 96, True)),
        # no dense group at all: convergent lookup
        ([64, 64], [False, False], (True, 0, False)),
    ],
)
def test_reconcile_table(hits, dense, expect):
    r = reconcile_dense_hits(hits, dense)
    assert (r.fallback, r.reported_tokens, r.diverged) == expect


@PROPERTY
@given(hits=st.lists(st.integers(0, 20), min_size=2, max_size=6), data=st.data())
def test_guard_fires_exactly_when_sparse_deeper_than_every_dense(hits, data):
    dense = data.draw(st.lists(st.booleans(), min_size=len(hits), max_size=len(hits)))
    r = reconcile_dense_hits(hits, dense)
    dense_hits = [h for h, d in zip(hits, dense) if d]
    sparse_hits = [h for h, d in zip(hits, dense) if not d]
    if not dense_hits:
        assert r.fallback
        return
    assert r.fallback == any(h > max(dense_hits) for h in sparse_hits)
    if not r.fallback:
        assert r.reported_tokens == min(dense_hits)


@PROPERTY
@given(geo=geometries(), work=token_workloads(), seed=st.integers(0, 2**16))
def test_reconciled_lookup_on_real_managers(geo, work, seed):
    """Over random geometries and evictions: every returned dense list covers
    the reported length; the guard matches its definition; with ONE dense
    group and Mamba the answer equals vLLM's exactly."""
    prompts, queries = work
    rng = random.Random(seed)
    manager = geo.manager()
    for p in prompts:
        run_prefill(manager, geo, p, rng)
    evict_random(manager, rng, rng.choice([0.0, 0.3, 0.6]))
    geometry = GroupGeometry.from_kv_cache_manager(manager)
    coordinator = manager.coordinator
    for q in queries:
        req = make_request(geo, q)
        ours = reconciled_computed_blocks_for_connector(manager, geometry, req)
        blocks, reported, _, diverged = ours
        if not (geometry.dense_group_ids and geometry.sparse_group_ids):
            assert ours[:3][1] == manager.get_computed_blocks(req)[1]
            continue
        _, hits = coordinator.find_longest_cache_hit_per_group(req.block_hashes, req.num_tokens - 1)
        dense_hits = [hits[g] for g in geometry.dense_group_ids]
        sparse_hits = [hits[g] for g in geometry.sparse_group_ids]
        guard = any(h > max(dense_hits) for h in sparse_hits)
        if guard:
            assert (reported, diverged) == (manager.get_computed_blocks(req)[1], False)
        else:
            assert reported == min(dense_hits)
            for gid in geometry.dense_group_ids:
                assert len(blocks.blocks[gid]) * geometry.groups[gid].block_size >= reported
                assert len(blocks.blocks[gid]) == cdiv(reported, geometry.groups[gid].block_size)
        if len(geometry.dense_group_ids) == 1 and manager.kv_cache_config.has_mamba_layers:
            theirs = manager.get_computed_blocks_for_connector(req)
            assert theirs[1:] == ours[1:]
            assert [[b.block_id for b in g] for g in theirs[0].blocks] == [
                [b.block_id for b in g] for g in blocks.blocks
            ]
