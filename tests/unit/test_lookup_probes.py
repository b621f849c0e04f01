"""The store lookup asks only for what vLLM's coordinator can read, and stays exact.

``StoreMirror.lookup`` probes the coarsest dense group first, then finer dense
groups up to its bound and the sparse groups around the candidate, then runs
vLLM's own coordinator over the answers. These tests hold it to the real
``KVCacheManager`` (same hit, block for block), check that no key the
coordinator read went unasked (an unasked key is read as absent, so that would
make the answer a guess), and pin the per-group probed/consulted counts on the
bench geometry, where the cost must follow the consulted keys, not the prompt.
"""

from __future__ import annotations

import random

from hypothesis import event, given
from hypothesis import strategies as st

from hybridkv.cli.harness.kv_manager import (
    Geometry,
    cached_keys,
    fa,
    make_request,
    mamba,
    run_prefill,
    sw,
)
from hybridkv.store.geometry import CoordinatorParams, GroupGeometry
from hybridkv.store.mirror import StoreMirror
from tests.unit.strategies import (
    PROPERTY,
    evictions,
    geometries,
    note_geometry,
    prefill_and_evict,
    token_workloads,
)

# The lookup bench's geometry: FA16 + FA32 + SW16 (window 128) + Mamba64 align, unit 16.
BENCH = Geometry(
    specs=[fa(16), fa(32, heads=2), sw(16, 128), mamba(64)],
    hash_block_size=16,
    num_blocks=3000,
    max_model_len=20000,
)


def _mirror_for(manager) -> StoreMirror:  # noqa: ANN001 - vLLM KVCacheManager
    return StoreMirror(GroupGeometry.from_params(CoordinatorParams.from_kv_cache_manager(manager)))


def _counting_exists(contents: set, calls: list):
    def exists(keys):
        calls.append(list(keys))
        return [k in contents for k in keys]

    return exists


@PROPERTY
@given(
    geo=geometries(),
    work=token_workloads(),
    seed=st.integers(0, 2**16),
    eviction=evictions(),
    local_share=st.sampled_from([0.0, 0.0, 0.5, 1.0]),
)
def test_probed_lookup_equals_manager_and_reads_only_asked_keys(
    geo, work, seed, eviction, local_share
):
    prompts, queries = work
    manager = geo.manager()
    prefill_and_evict(manager, geo, prompts, random.Random(seed), eviction)
    note_geometry(geo)
    contents = cached_keys(manager)
    mirror = _mirror_for(manager)
    sbs = mirror.geometry.scheduler_block_size
    for q in queries:
        req = make_request(geo, q)
        _, want, _ = manager.get_computed_blocks(req)
        # A local dense prefix the scheduler could pass (at most vLLM's own hit).
        local = int(want * local_share) // sbs * sbs
        full = mirror.longest_hit(req.block_hashes, req.num_tokens - 1, contents, local)
        calls: list = []
        got = mirror.lookup(
            req.block_hashes, req.num_tokens - 1, _counting_exists(contents, calls), local
        )
        event(f"round trips: {got.round_trips}")
        assert got.hit.tokens == want, geo.label
        assert got.hit == full, (
            geo.label
        )  # same blocks, positions and keys (tied to vLLM's pool elsewhere)
        assert got.unasked_reads == 0
        assert got.round_trips == len(calls) <= (3 if got.fallback else 2)
        asked = [k for c in calls for k in c]
        assert len(asked) == len(set(asked)), "a key was asked twice"
        # Never a key the complete probe set would not ask, and never more of them.
        assert set(asked) <= set(mirror.probe_keys(req.block_hashes, req.num_tokens - 1, local))
        assert sum(got.probed) == len(asked)


def _store_everything(mirror: StoreMirror, req) -> set:  # noqa: ANN001 - vLLM Request
    return set(mirror.probe_keys(req.block_hashes, req.num_tokens - 1, 0))


def test_full_hit_probes_per_group_what_the_coordinator_reads():
    """4096 tokens, every object stored: FA16 and FA32 are read block by block (FA32 plus
    one hash unit of its last, fine-grained block), the window group 8 blocks, Mamba one
    state. Probed: FA32 128 boundaries (round trip 1); FA16 256, FA32's one interior unit,
    the window 17 and Mamba 8 around the candidate (round trip 2) -- 410 keys where the
    complete probe set has 1024."""
    manager = BENCH.manager()
    mirror = _mirror_for(manager)
    req = make_request(BENCH, random.Random(1).choices(range(3, 30000), k=4096))
    contents = _store_everything(mirror, req)
    calls: list = []
    got = mirror.lookup(
        req.block_hashes, req.num_tokens - 1, _counting_exists(contents, calls), record=True
    )
    assert got.hit == mirror.longest_hit(req.block_hashes, req.num_tokens - 1, contents)
    assert got.hit.tokens == 4095 // 16 * 16
    assert (got.round_trips, got.fallback, got.unasked_reads) == (2, False, 0)
    assert [len(c) for c in calls] == [128, 256 + 1 + 17 + 8]
    assert {g for g, _ in calls[0]} == {1}, "round trip 1 is the coarsest dense group only"
    assert got.probed == (256, 129, 17, 8)
    assert got.consulted == (255, 128, 8, 1)
    assert len(contents) == 1024


def test_sparse_probes_do_not_grow_with_the_prompt_and_dense_ones_follow_the_hit():
    """4x the prompt: the sparse groups' probes stay the same; a partial hit (the store
    holds the first 1024 tokens of a 16384-token prompt) probes the finer dense group
    only up to the coarse group's bound, not across the prompt."""
    manager = BENCH.manager()
    mirror = _mirror_for(manager)
    tokens = random.Random(2).choices(range(3, 30000), k=16384)
    req = make_request(BENCH, tokens)
    contents = _store_everything(mirror, req)
    got = mirror.lookup(
        req.block_hashes, req.num_tokens - 1, _counting_exists(contents, []), record=True
    )
    assert (got.round_trips, got.fallback) == (2, False)
    assert got.probed == (1024, 513, 17, 8)
    assert got.consulted == (1023, 512, 8, 1)

    short = make_request(BENCH, tokens[:1025])
    prefix = _store_everything(mirror, short)  # everything a 1025-token prompt saves (64 units)
    got = mirror.lookup(
        req.block_hashes, req.num_tokens - 1, _counting_exists(prefix, []), record=True
    )
    assert got.hit == mirror.longest_hit(req.block_hashes, req.num_tokens - 1, prefix)
    assert got.hit.tokens == 1024
    assert (got.round_trips, got.fallback, got.unasked_reads) == (2, False, 0)
    # FA32: the whole prompt at 32-token boundaries (round trip 1, the one prompt-long part)
    # plus its 3 interior units up to the reach (cap 1056 + one 64-token block); FA16 only up
    # to that reach: 1120 / 16 keys for 65 read. The sparse groups: a constant neighbourhood.
    assert got.probed == (1120 // 16, 16384 // 32 + 3, 23, 14)
    assert got.consulted == (1024 // 16 + 1, 1024 // 32, 8, 1)


def test_state_far_below_the_candidate_takes_the_exact_fallback():
    """A prompt that diverges inside an earlier one: the dense hit ends near the
    divergence but vLLM cached Mamba states only at its chunk ends, far below. The
    two-round-trip probes cannot see them; the third asks the complete set up to the
    bound and the answer equals vLLM's."""
    manager = BENCH.manager()
    rng = random.Random(1)
    tokens = [rng.randrange(3, 30000) for _ in range(3000)]
    run_prefill(manager, BENCH, tokens)
    contents = cached_keys(manager)
    mirror = _mirror_for(manager)
    req = make_request(BENCH, tokens[:1000] + [5] * 500)
    _, want, _ = manager.get_computed_blocks(req)
    calls: list = []
    got = mirror.lookup(
        req.block_hashes, req.num_tokens - 1, _counting_exists(contents, calls), record=True
    )
    assert got.hit.tokens == want == 768
    assert (got.round_trips, got.fallback, got.unasked_reads) == (3, True, 0)
    assert got.hit == mirror.longest_hit(req.block_hashes, req.num_tokens - 1, contents)


def test_known_answers_are_not_asked_again():
    """Re-deciding at a smaller grant reuses the first lookup's answers: only the
    sparse keys around the new boundary are asked (one round trip)."""
    manager = BENCH.manager()
    mirror = _mirror_for(manager)
    req = make_request(BENCH, random.Random(3).choices(range(3, 30000), k=2048))
    contents = _store_everything(mirror, req)
    first = mirror.lookup(
        req.block_hashes, req.num_tokens - 1, _counting_exists(contents, []), record=True
    )
    calls: list = []
    again = mirror.lookup(
        req.block_hashes, 1024, _counting_exists(contents, calls), known=first.answers
    )
    assert again.hit == mirror.longest_hit(req.block_hashes, 1024, contents)
    assert again.hit.tokens == 1024 and again.round_trips == 1
    assert not set(calls[0]) & set(first.answers), "an answer already had was asked again"
    assert {g for g, _ in calls[0]} == {1, 2, 3}  # FA32's interior units near 1024, window, Mamba
