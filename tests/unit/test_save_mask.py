"""Save masks: saving only the masked blocks loses no hit (sufficient), and
every masked window/Mamba block serves some hit (minimal)."""

from __future__ import annotations

import random

import pytest
from hypothesis import event, given, target
from hypothesis import strategies as st

from hybridkv.cli.harness.kv_manager import Geometry, fa, make_request, mamba, run_prefill
from hybridkv.store.geometry import CoordinatorParams, GroupGeometry
from hybridkv.store.mirror import StoreMirror
from tests.unit.strategies import PROPERTY, geometries, note_geometry


def _prompt_len(geo, data) -> int:
    """Long enough to hold two scheduler blocks and a window plus its tail block: a
    shorter prompt has every hit 0 or keeps every block, and tests nothing."""
    low = max(2 * geo.scheduler_block_size, 96)
    return data.draw(st.integers(low, low + 320), label="prompt tokens")


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


def _known_retention_gap(geo) -> bool:
    """Mamba + a retention interval + EAGLE on ONE flagged group: the save mask drops the
    prompt's Mamba checkpoint that vLLM's local cache keeps (see the strict xfail below)."""
    has_mamba = any(s.__class__.__name__ == "MambaSpec" for s in geo.specs)
    return has_mamba and geo.retention_interval is not None and geo.eagle_group is not None


GAP = Geometry(
    specs=[fa(32), fa(64, heads=2), mamba(32)],
    hash_block_size=32,
    num_blocks=1200,
    retention_interval=0,
    eagle_group=0,
    use_eagle=True,
)


@pytest.mark.xfail(
    strict=True,
    reason=(
        "store/mirror.py save_mask under retention interval 0 keeps the Mamba state at the "
        "replay boundary 64 only; vLLM's local cache also keeps the state at 128 (block 7, "
        "block_hash_num_tokens 128). Not from the manager's own prompt checkpoint, as first "
        "thought: the coordinator sets drop_eagle_checkpoint_block=True on every Mamba manager "
        "under use_eagle, so that is 64 too. Which rule keeps 128 is not identified yet"
    ),
)
def test_retention_with_one_flagged_eagle_group_keeps_the_prompt_checkpoint():
    tokens = [random.Random(1).randrange(50) for _ in range(160)]
    mirror = _mirror(GAP)
    _, masked = _all_and_masked(mirror, make_request(GAP, tokens).block_hashes, len(tokens))
    manager = GAP.manager()
    run_prefill(manager, GAP, tokens, random.Random(0))
    resend = make_request(GAP, tokens)
    local = manager.get_computed_blocks(resend)[1]
    part = mirror.longest_hit(resend.block_hashes, len(tokens) - 1, {k for _, k in masked}).tokens
    assert local == 128
    assert part == local  # today 64: the Mamba state at 128 is not in the mask


@PROPERTY
@given(geo=geometries(require_sparse=True), data=st.data(), seed=st.integers(0, 2**16))
def test_masked_save_is_sufficient(geo, data, seed):
    """Only geometries with a sparse group: for dense-only models the mask keeps every
    block and the property holds trivially.

    Without a retention interval, the masked store serves every hit the full store
    would. With vLLM's ``prefix_cache_retention_interval`` some hits are dropped on
    purpose; then the masked store must serve at least what vLLM's own local cache
    serves after the same prompt (the real manager, prefilled chunk by chunk).
    """
    n = _prompt_len(geo, data)
    rng = random.Random(seed)
    tokens = [rng.randrange(50) for _ in range(n)]
    mirror = _mirror(geo)
    hashes = make_request(geo, tokens).block_hashes
    everything, masked = _all_and_masked(mirror, hashes, n)
    masked_keys = {k for _, k in masked}
    manager = geo.manager()
    run_prefill(manager, geo, tokens, random.Random(seed))
    hits = []
    for q in _queries(geo, tokens, rng):
        full = mirror.longest_hit(q.block_hashes, q.num_tokens - 1, everything).tokens
        part = mirror.longest_hit(q.block_hashes, q.num_tokens - 1, masked_keys).tokens
        local = manager.get_computed_blocks(q)[1]
        if geo.retention_interval is None:
            assert part == full, geo.label
        # Fine-grained Mamba: the prompt's sub-block checkpoint is a partial block
        # this oracle's store does not hold (test_masked_sparse_blocks_are_each_needed
        # adds it), so vLLM's local cache can legitimately serve more.
        if not (_known_retention_gap(geo) or mirror.geometry.fine_grained):
            assert part >= local, (geo.label, q.num_tokens)
        hits.append(full)
    note_geometry(geo)
    event(f"retention interval: {geo.retention_interval}")
    event(f"known retention gap (masked >= local not checked): {_known_retention_gap(geo)}")
    dropped = len(everything) - len(masked_keys)
    informative = dropped > 0 and any(hits)
    event(f"mask drops a block and some hit > 0: {informative}")
    event(f"every hit 0: {not any(hits)}")
    target(dropped / len(everything), label="fraction of blocks the mask drops")


@PROPERTY
@given(
    geo=geometries(allow_eagle=False, require_sparse=True, allow_retention=False),
    data=st.data(),
    seed=st.integers(0, 2**16),
)
def test_masked_sparse_blocks_are_each_needed(geo, data, seed):
    """Without EAGLE. With EAGLE, vLLM's window mask keeps tail blocks that
    only a peek past a *partially evicted* run could use; this oracle does
    not model such evictions, so EAGLE minimality is left to the note. Without a
    retention interval too: this oracle's lookups do not model its segments."""
    n = _prompt_len(geo, data)
    note_geometry(geo)
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
    checked = 0
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
        checked += 1
    event(f"sparse blocks checked for need: {min(checked, 5)}{'+' if checked >= 5 else ''}")
