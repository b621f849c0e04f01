"""The store mirror's hit equals vLLM's real KVCacheManager hit, block for block."""

from __future__ import annotations

import random

from hypothesis import event, given
from hypothesis import strategies as st

from hybridkv.cli.harness.kv_manager import (
    cached_keys,
    make_request,
    nonnull_positions,
)
from hybridkv.store.geometry import CoordinatorParams, GroupGeometry
from hybridkv.store.mirror import StoreMirror
from tests.unit.strategies import (
    PROPERTY,
    evictions,
    geometries,
    lookups_differ_from_vllm,
    note_geometry,
    prefill_and_evict,
    token_workloads,
)


def _mirror_for(manager) -> StoreMirror:
    return StoreMirror(GroupGeometry.from_params(CoordinatorParams.from_kv_cache_manager(manager)))


@PROPERTY
@given(geo=geometries(), work=token_workloads(), seed=st.integers(0, 2**16), eviction=evictions())
def test_mirror_hit_equals_manager_hit(geo, work, seed, eviction):
    prompts, queries = work
    rng = random.Random(seed)
    manager = geo.manager()
    prefill_and_evict(manager, geo, prompts, rng, eviction)
    note_geometry(geo)
    event(f"eviction: {eviction.describe()}")
    contents = cached_keys(manager)
    mirror = _mirror_for(manager)
    requests = [make_request(geo, q) for q in queries]
    event(f"hybridkv lookup differs from vLLM's: {lookups_differ_from_vllm(manager, requests)}")
    best = 0
    for req in requests:
        blocks, want, _ = manager.get_computed_blocks(req)
        got = mirror.longest_hit(req.block_hashes, req.num_tokens - 1, contents)
        assert got.tokens == want, geo.label
        best = max(best, want)
        # Same blocks, same positions, same keys, in every group.
        for gid, group_blocks in enumerate(blocks.blocks):
            positions = nonnull_positions(group_blocks)
            assert [i for i, _ in got.blocks[gid]] == positions, (geo.label, gid)
            for (idx, key), block in zip(got.blocks[gid], [group_blocks[i] for i in positions]):
                assert key[0] == gid
                # The key names this very block in vLLM's pool. (A block can be
                # registered under several hashes: a full block also serves a
                # fine-grained hit at one of its hash units.)
                cached = manager.block_pool.get_cached_block(key[1], [gid])
                assert cached is not None and cached[0].block_id == block.block_id, (gid, idx)
        # The batched-existence path probes enough keys to reach the same hit.
        calls = []

        def exists(keys):
            calls.append(len(keys))
            return [k in contents for k in keys]

        via_probe = mirror.longest_hit(req.block_hashes, req.num_tokens - 1, exists)
        assert via_probe.tokens == want
        assert len(calls) == 1, "one batched existence query per lookup"
    event(f"some query hits: {best > 0}")


@PROPERTY
@given(geo=geometries(), work=token_workloads(), seed=st.integers(0, 2**16), eviction=evictions())
def test_local_dense_prefix_is_not_probed_and_does_not_change_hit(geo, work, seed, eviction):
    """Given the local dense hit, the mirror probes only beyond it and still
    computes the hit over (local dense blocks + store).

    Two local lengths per query: the convergent hit, and the DIVERGED one the
    connector's dense reference reports (the min of the dense groups' own hits),
    where a sparse group may lack state: the local prefix vouches for dense blocks
    only, so the hit must stay the convergent one (a mirror that took sparse keys
    inside the local prefix as present would report the diverged length).
    """
    prompts, queries = work
    rng = random.Random(seed)
    manager = geo.manager()
    prefill_and_evict(manager, geo, prompts, rng, eviction)
    note_geometry(geo)
    contents = cached_keys(manager)
    mirror = _mirror_for(manager)
    geometry = mirror.geometry
    sbs = geometry.scheduler_block_size
    diverged = 0
    for q in queries:
        req = make_request(geo, q)
        _, want, _ = manager.get_computed_blocks(req)
        locals_ = {want // sbs * sbs}
        if geometry.dense_group_ids and geometry.sparse_group_ids:  # a hybrid coordinator
            _, per_group = manager.coordinator.find_longest_cache_hit_per_group(
                req.block_hashes, req.num_tokens - 1
            )
            dense_local = min(per_group[g] for g in geometry.dense_group_ids) // sbs * sbs
            diverged += dense_local > want
            locals_.add(dense_local)
        for local in sorted(locals_):
            probe = mirror.probe_keys(req.block_hashes, req.num_tokens - 1, local)
            unit = geometry.hash_block_size
            local_hashes = {bytes(h) for h in req.block_hashes[: local // unit]}
            for gid, h in probe:
                if gid in geometry.dense_group_ids:
                    assert h not in local_hashes
            got = mirror.longest_hit(
                req.block_hashes,
                req.num_tokens - 1,
                lambda keys: [k in contents for k in keys],
                local_dense_tokens=local,
            )
            assert got.tokens == want, (geo.label, local)
    event(f"a query's dense-reference local length exceeds the convergent hit: {diverged > 0}")
