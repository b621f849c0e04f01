"""Save masks: saving only the masked blocks loses no hit (sufficient), and
every masked window/Mamba block serves some hit (minimal)."""

from __future__ import annotations

import random

from hypothesis import given
from hypothesis import strategies as st

from hybridkv.store.geometry import CoordinatorParams, GroupGeometry
from hybridkv.store.mirror import StoreMirror
from tests.unit.harness import make_request
from tests.unit.strategies import PROPERTY, geometries



def _mirror(geo) -> StoreMirror:
    params = CoordinatorParams(
        kv_cache_config=geo.kv_cache_config(),
        max_model_len=geo.max_model_len,
        scheduler_block_size=geo.scheduler_block_size,
        hash_block_size=geo.hash_block_size,
        use_eagle=geo.use_eagle,
        num_prefill_lookahead=1 if geo.use_eagle else 0,
    )
    return StoreMirror(GroupGeometry.from_params(params))


def _all_and_masked(mirror, hashes, n_tokens):
    everything, masked = set(), set()
    for g in mirror.geometry.groups:
        if not g.prefix_cacheable:
            continue
        n_blocks = n_tokens // g.block_size
        mask = mirror.save_mask(g.group_id, 0, n_blocks, num_prompt_tokens=n_tokens)
        for i in range(n_blocks):
            key = mirror.block_key(g.group_id, hashes, (i + 1) * g.block_size)
            everything.add(key)
            if mask[i]:
                masked.add((i, key))
    return everything, masked


def _queries(geo, tokens, rng):
    """Later lookups that share a prefix with the saved prompt at every
    hit-aligned boundary, plus a resend and an extension."""
    unit = geo.hash_block_size
    out = [list(tokens), list(tokens) + [rng.randrange(50) for _ in range(40)]]
    for cut in range(unit, len(tokens) + 1, unit):
        out.append(list(tokens[:cut]) + [999])
    return [make_request(geo, q) for q in out]


@PROPERTY
@given(geo=geometries(), n=st.integers(32, 320), seed=st.integers(0, 2**16))
def test_masked_save_is_sufficient(geo, n, seed):
    rng = random.Random(seed)
    tokens = [rng.randrange(50) for _ in range(n)]
    mirror = _mirror(geo)
    hashes = make_request(geo, tokens).block_hashes
    everything, masked = _all_and_masked(mirror, hashes, n)
    masked_keys = {k for _, k in masked}
    for q in _queries(geo, tokens, rng):
        full = mirror.longest_hit(q.block_hashes, q.num_tokens - 1, everything).tokens
        part = mirror.longest_hit(q.block_hashes, q.num_tokens - 1, masked_keys).tokens
        assert part == full, geo.label


@PROPERTY
@given(geo=geometries(allow_eagle=False), n=st.integers(32, 256), seed=st.integers(0, 2**16))
def test_masked_sparse_blocks_are_each_needed(geo, n, seed):
    """Without EAGLE. With EAGLE, vLLM's window mask keeps tail blocks that
    only a peek past a *partially evicted* run could use; this oracle does
    not model such evictions, so EAGLE minimality is left to the note."""
    rng = random.Random(seed)
    tokens = [rng.randrange(50) for _ in range(n)]
    mirror = _mirror(geo)
    hashes = make_request(geo, tokens).block_hashes
    _, masked = _all_and_masked(mirror, hashes, n)
    masked_keys = {k for _, k in masked}
    # A continuation of this prompt saves its own masked blocks past the end;
    # EAGLE hits at the end are only verifiable with them (one drop unit
    # beyond), so minimality is judged with them present.
    continuation = tokens + [rng.randrange(50) for _ in range(128)]
    cont_hashes = make_request(geo, continuation).block_hashes
    _, cont_masked = _all_and_masked(mirror, cont_hashes, len(continuation))
    for idx, key in cont_masked:
        if (idx + 1) * mirror.geometry.groups[key[0]].block_size > n:
            masked_keys.add(key)
    extra_positions = []
    if mirror.geometry.fine_grained:
        # Fine-grained Mamba checkpoints can sit at any hash unit (vLLM saves
        # the prompt's checkpoint there); window tails must serve them too.
        unit = mirror.geometry.hash_block_size
        for g in mirror.geometry.groups:
            if g.is_mamba:
                for u in range(1, len(continuation) // unit + 1):
                    key = mirror.block_key(g.group_id, cont_hashes, u * unit)
                    masked_keys.add(key)
                    extra_positions.append((u * unit, key))
    queries = _queries(geo, tokens, rng) + [make_request(geo, continuation)]
    # Every stored object of a group, by the token its valid KV ends at.
    group_keys = {}
    for idx, key in list(masked) + list(cont_masked):
        end = (idx + 1) * mirror.geometry.groups[key[0]].block_size
        group_keys.setdefault(key[0], []).append((end, key))
    for end, key in extra_positions:
        group_keys.setdefault(key[0], []).append((end, key))
    sparse = set(mirror.geometry.sparse_group_ids)
    for idx, key in masked:
        if key[0] not in sparse:
            continue
        own_end = (idx + 1) * mirror.geometry.groups[key[0]].block_size
        # The store evicts too: a state is useful if some lookup uses it, with
        # everything present or once the same group's objects from some
        # deeper position on are gone (then the continuation probes deepest).
        cont = queries[-1]
        scenarios = [(masked_keys, queries)] + [
            (masked_keys - {k for e, k in group_keys[key[0]] if e >= cut}, [cont])
            for cut in sorted({e for e, _ in group_keys[key[0]] if e > own_end})
        ]
        used = any(
            key in {k for per_group in hit.blocks for _, k in per_group}
            for contents, qs in scenarios
            for hit in (mirror.longest_hit(q.block_hashes, q.num_tokens - 1, contents) for q in qs)
        )
        # A block no lookup uses could be dropped without loss: not minimal.
        assert used, (geo.label, key[0], idx)
