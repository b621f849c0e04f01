"""Dense-reference reconciliation vs vLLM's single-group reference."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
from hypothesis import example, given
from hypothesis import strategies as st
from vllm.utils.math_utils import cdiv

from hybridkv.cli.harness.kv_manager import (
    Geometry,
    evict_random,
    fa,
    make_request,
    mamba,
    run_prefill,
)
from hybridkv.connector.dense_reference import (
    install_reconciled_lookup,
    reconcile_dense_hits,
    reconciled_computed_blocks_for_connector,
)
from hybridkv.store import vllm_compat
from hybridkv.store.geometry import GroupGeometry
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


# --- strict dense reference: sparse groups re-queried at the reported length ---


def _prefill_in_chunks(manager, geo, tokens, chunks):
    """Prefill ``tokens`` with the given chunk sizes (each chunk end is a Mamba
    align checkpoint), like the scheduler would, and free the request."""
    req = make_request(geo, tokens)
    computed, num_local, _ = manager.get_computed_blocks(req)
    assert num_local == 0
    first = True
    for chunk in chunks:
        if first:
            out = manager.allocate_slots(
                req, chunk, num_new_computed_tokens=0, new_computed_blocks=computed
            )
            first = False
        else:
            out = manager.allocate_slots(req, chunk)
        assert out is not None
        req.num_computed_tokens += chunk
    assert req.num_computed_tokens == len(tokens)
    block_ids = manager.get_block_ids(req.request_id)
    manager.free(req)
    return block_ids


def _seed_case_fa16_64_fa32_128_mamba_128(keep_mamba_state_at_64: bool):
    """The seed scenario: FA16 hit 64, FA32 hit 128, Mamba hit 128.

    Chunks 64 + 64 + 129 leave Mamba states at 64, 128 and the prompt's end;
    evictions then cut FA16 at 64, FA32 at 128 and Mamba beyond 128 (and at
    64 when asked)."""
    geo = TWO_DENSE_PLUS_MAMBA
    manager = geo.manager()
    tokens = list(range(2000, 2257))
    ids = _prefill_in_chunks(manager, geo, tokens, [64, 64, 129])
    query = make_request(geo, tokens + [1, 2, 3])
    # Mamba align mode moves states between blocks: find them by lookup.
    lookup = manager.coordinator.find_longest_cache_hit_per_group
    state_at = {n: lookup(query.block_hashes, n)[0][2][-1].block_id for n in (64, 128)}
    mamba_deeper = {b.block_id for b in lookup(query.block_hashes, 256)[0][2] if not b.is_null}
    victims = set(ids[0][4:]) | set(ids[1][4:]) | (mamba_deeper - set(state_at.values()))
    if not keep_mamba_state_at_64:
        victims.add(state_at[64])
    manager.evict_blocks(victims)
    _, hits = manager.coordinator.find_longest_cache_hit_per_group(
        query.block_hashes, query.num_tokens - 1
    )
    assert tuple(hits) == (64, 128, 128), hits
    return geo, manager, query, state_at


def test_sparse_state_at_reported_length_is_a_convergent_hit():
    """Mamba's state AT 64 is cached: the hit converges at 64 (no store round
    trip) and Mamba's list ends at 64. Before the strict reference, hybridkv
    reported 64 with Mamba's 128-token list and called the hit diverged."""
    geo, manager, query, state_at = _seed_case_fa16_64_fa32_128_mamba_128(
        keep_mamba_state_at_64=True
    )
    geometry = GroupGeometry.from_kv_cache_manager(manager)
    blocks, reported, _, diverged = reconciled_computed_blocks_for_connector(
        manager, geometry, query
    )
    assert (reported, diverged) == (64, False)
    assert [len(b) for b in blocks.blocks] == [4, 2, 2]
    assert blocks.blocks[2][1].block_id == state_at[64]
    assert blocks.blocks[2][0].is_null


def test_sparse_state_absent_at_reported_length_is_diverged_with_a_list_ending_there():
    geo, manager, query, state_at = _seed_case_fa16_64_fa32_128_mamba_128(
        keep_mamba_state_at_64=False
    )
    geometry = GroupGeometry.from_kv_cache_manager(manager)
    calls = []
    blocks, reported, _, diverged = reconciled_computed_blocks_for_connector(
        manager, geometry, query, extends=lambda r, n: calls.append(n) or True
    )
    assert (reported, diverged) == (64, True)
    assert calls == [64]
    assert [len(b) for b in blocks.blocks[:2]] == [4, 2]
    assert len(blocks.blocks[2]) * 32 <= 64
    assert state_at[128] not in {b.block_id for b in blocks.blocks[2]}


def test_installed_lookup_takes_vllm_033_cap():
    """vLLM 0.33's scheduler calls get_computed_blocks_for_connector(request,
    max_cache_hit_length); the installed method takes it and caps the hit."""
    geo, manager, query, _ = _seed_case_fa16_64_fa32_128_mamba_128(keep_mamba_state_at_64=True)
    install_reconciled_lookup(manager)
    assert manager.get_computed_blocks_for_connector(query)[1:] == (64, 0, False)
    capped = manager.get_computed_blocks_for_connector(query, 32)
    assert capped[1] <= 32


@st.composite
def _multi_dense_geometries(draw) -> Geometry:
    """2-3 dense groups at >= 2 DISTINCT block sizes plus Mamba and/or a window:
    the geometries where the dense reference matters (every example)."""
    from hybridkv.cli.harness.kv_manager import sw

    n_fa = draw(st.integers(2, 3))
    sizes = draw(
        st.lists(st.sampled_from([16, 32, 64]), min_size=n_fa, max_size=n_fa).filter(
            lambda s: len(set(s)) >= 2
        )
    )
    with_mamba = draw(st.booleans())
    with_window = (not with_mamba) or draw(st.booleans())
    mamba_bs = draw(st.sampled_from([32, 64])) if with_mamba else None
    fine_grained = with_mamba and draw(st.booleans())
    if with_mamba and not fine_grained:
        sizes = [max(s, mamba_bs) if s < mamba_bs else s for s in sizes]
        if len(set(sizes)) < 2:
            sizes = [mamba_bs, 2 * mamba_bs] + sizes[2:]
    specs = [fa(s, heads=i + 1) for i, s in enumerate(sizes)]
    if with_window:
        floor = 16 if (not with_mamba or fine_grained) else mamba_bs
        wbs = draw(st.sampled_from([s for s in (16, 32, 64) if s >= floor]))
        specs.append(sw(wbs, draw(st.sampled_from([24, 48, 64, 100])), heads=1))
    if with_mamba:
        specs.append(mamba(mamba_bs))
    if with_mamba:
        hash_block = 16 if fine_grained else mamba_bs
    else:
        import math
        from functools import reduce

        hash_block = reduce(math.gcd, [s.block_size for s in specs])
    return Geometry(
        specs=specs,
        hash_block_size=hash_block,
        num_blocks=draw(st.sampled_from([80, 200])) * len(specs),
        label=f"fa={sizes} window={with_window} mamba={mamba_bs} fg={fine_grained}",
    )


def _evict_per_group(manager, rng: random.Random) -> None:
    """Evict each group's cached blocks from a random depth on (and a few at
    random): groups lose their tails at DIFFERENT depths, the case where
    per-group hits spread out and the dense reference decides."""
    pool = manager.block_pool
    by_group: dict[int, list] = {}
    from vllm.v1.core.kv_cache_utils import get_group_id

    for key, ids in vllm_compat.cached_block_ids(pool.cached_block_hash_to_block).items():
        by_group.setdefault(get_group_id(key), []).extend(pool.blocks[i] for i in ids)
    victims = set()
    for blocks in by_group.values():
        if rng.random() < 0.7:
            cut = rng.random()
            ordered = sorted(blocks, key=lambda b: b.block_id)
            victims |= {b.block_id for b in ordered[int(cut * len(ordered)) :]}
        victims |= {b.block_id for b in blocks if rng.random() < 0.1}
    if victims:
        manager.evict_blocks(victims)


def _window_realloc_case() -> dict:
    """The example CI found (see the file's "why"): FA32 + FA16 + a 24-token
    window at 16; the window's hit blocks drop out of the window at the
    reported length and come back as fresh blocks of the same request."""
    from hybridkv.cli.harness.kv_manager import sw

    case = json.loads(
        (Path(__file__).parent / "data" / "dense_reference_window_realloc.json").read_text()
    )
    geo = Geometry(
        specs=[fa(32, heads=1), fa(16, heads=2), sw(16, 24, heads=1)],
        hash_block_size=16,
        num_blocks=240,
        label=case["geometry"],
    )
    return {"geo": geo, "work": (case["prompts"], case["queries"]), "seed": case["seed"]}


@PROPERTY
@given(geo=_multi_dense_geometries(), work=token_workloads(), seed=st.integers(0, 2**16))
@example(**_window_realloc_case())
def test_strict_reference_block_tables_match_reported_tokens(geo, work, seed):
    """Over 2-3 dense groups at different block sizes + Mamba / window, random
    evictions: after the reconciled lookup, a real allocate_slots (the
    scheduler's step) gives every group a block table that agrees with the
    reported tokens: no returned list runs past them (every block the request
    will write from there on is a fresh block, never a cached one), every dense
    list covers them exactly, and ``diverged`` is True exactly when some sparse
    group's state is not cached AT the reported length (vLLM's own per-group
    lookup capped there is the judge)."""
    from hypothesis import event

    prompts, queries = work
    rng = random.Random(seed)
    manager = geo.manager()
    for p in prompts:
        run_prefill(manager, geo, p, rng)
    _evict_per_group(manager, rng)
    geometry = GroupGeometry.from_kv_cache_manager(manager)
    coordinator = manager.coordinator
    for q in queries:
        req = make_request(geo, q)
        _, first_hits = coordinator.find_longest_cache_hit_per_group(
            req.block_hashes, req.num_tokens - 1
        )
        blocks, reported, _, diverged = reconciled_computed_blocks_for_connector(
            manager, geometry, req
        )
        dense_hits = [first_hits[g] for g in geometry.dense_group_ids]
        if any(first_hits[g] > max(dense_hits) for g in geometry.sparse_group_ids):
            event("guard: convergent fallback")
            assert diverged is False
            continue
        assert reported == min(dense_hits)
        if len(set(dense_hits)) > 1:
            event("dense hits differ")
        if any(first_hits[g] > reported for g in geometry.sparse_group_ids):
            event("sparse group above reported: re-queried")
        _, at = coordinator.find_longest_cache_hit_per_group(req.block_hashes, reported)
        present = {g: at[g] == reported for g in geometry.sparse_group_ids}
        event(f"diverged={diverged}")
        assert diverged == (not all(present.values())), (first_hits, at, reported)
        for gid, g in enumerate(geometry.groups):
            if g.downward_closed:
                assert len(blocks.blocks[gid]) == cdiv(reported, g.block_size)
            else:
                assert len(blocks.blocks[gid]) <= cdiv(reported, g.block_size)
        # The scheduler's allocation for this hit (reported local tokens, the
        # rest new); the blocks it will write must never be cached ones.
        if reported == 0:
            continue
        # Each hit block's hash at lookup time: a hit block may come back as a
        # written block only after vLLM dropped it from the table (out of the
        # window), evicted it from the prefix cache and reallocated it; then it
        # no longer carries the hash it was a hit under.
        hit_hash = {
            b.block_id: b.block_hash for group in blocks.blocks for b in group if not b.is_null
        }
        out = manager.allocate_slots(
            req,
            req.num_tokens - reported,
            num_new_computed_tokens=reported,
            new_computed_blocks=blocks,
        )
        if out is None:
            continue
        for gid, g in enumerate(geometry.groups):
            table = coordinator.single_type_managers[gid].req_to_blocks[req.request_id]
            assert len(table) == cdiv(req.num_tokens, g.block_size), (gid, len(table))
            hit_list = [b.block_id for b in blocks.blocks[gid]]
            # Full hit blocks are taken as they are; a partial tail block of the
            # hit gets a private copy (vLLM's copy-on-write), so it may differ.
            first_written = reported // g.block_size
            full = min(first_written, len(hit_list))
            # (Window blocks that fall out of the window are nulled by vLLM.)
            assert all(t.is_null or t.block_id == h for t, h in zip(table[:full], hit_list)), gid
            # Blocks from the token the request computes next onwards get written:
            # none of them may be a block of the looked-up (cached) hit that still
            # holds that hit's KV (same hash), nor one the table also reads as a hit.
            written = {b.block_id for b in table[first_written:] if not b.is_null}
            hit_ids = {i for i, b in zip(hit_list, blocks.blocks[gid]) if not b.is_null}
            pool = manager.block_pool
            reused = {i for i in written & hit_ids if pool.blocks[i].block_hash == hit_hash[i]}
            assert not reused, (
                f"group {gid}: the request would write into cached hit blocks {reused}"
            )
            if written & hit_ids:
                event("window: a hit block dropped, evicted and reallocated")
                assert not written & {t.block_id for t in table[:full] if not t.is_null}, gid
        manager.free(req)
