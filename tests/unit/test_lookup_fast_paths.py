"""The lookup's bulk paths name and fold exactly what the per-key paths do.

``StoreMirror.lookup`` hands the store a :class:`GroupedKeys` (one hash list per
group) and gets back per-group answers (:class:`KeyAnswers`) and per-group hit
blocks (:class:`HitBlocks`), so a 128k-token lookup makes no tuple per key. Each
bulk form must equal the per-key form it replaces: the names the workers save
under (``KeySchema.key``), every rank's name of each block in rank-major order,
the answers a re-decision reuses, and the ``(position, key)`` pairs a load plan
reads. The key itself keeps the whole block hash and every identity part
(model/layout/tenant in the prefix, group, rank).
"""

from __future__ import annotations

import hashlib
import random

import pytest

from hybridkv.cli.harness.kv_manager import Geometry, fa, make_request, mamba, sw
from hybridkv.connector.store_keys import AllRankKeys
from hybridkv.store.geometry import CoordinatorParams, GroupGeometry
from hybridkv.store.keys import KEY_SCHEME_VERSION, KeySchema
from hybridkv.store.mirror import GroupedKeys, HitBlocks, KeyAnswers, StoreMirror

ROWS = [{"group": 0, "spec": "FullAttentionSpec", "block_size": 16}]
BENCH = Geometry(
    specs=[fa(16), fa(32, heads=2), sw(16, 128), mamba(64)],
    hash_block_size=16,
    num_blocks=3000,
    max_model_len=20000,
)


def _hashes(n: int, size: int = 32) -> list[bytes]:
    return [hashlib.sha256(f"h{i}".encode()).digest()[:size] for i in range(n)]


def test_key_carries_the_whole_hash_and_every_identity_part():
    schema = KeySchema.create("m", "bfloat16", ROWS, tp_size=2)
    h = bytes(range(32))
    key = schema.key(3, h)
    assert (
        key == f"{KEY_SCHEME_VERSION}/{schema.model_id}/{schema.layout_id}/g3/tp2.0-pp1.0/{h.hex()}"
    )
    # Hashes that share their first 16 bytes (a counter padded to 32) stay apart.
    assert schema.key(3, h[:16] + bytes(16)) != schema.key(3, h[:16] + bytes([1]) + bytes(15))
    assert schema.key(2, h) != key and schema.for_rank(1).key(3, h) != key
    assert KeySchema.create("m", "bfloat16", ROWS + [{"tenant": "t"}], tp_size=2).key(3, h) != key


@pytest.mark.parametrize("size", [16, 32])
def test_bulk_names_equal_per_key_names(size):
    schema = KeySchema.create("m", "bfloat16", ROWS)
    hashes = _hashes(300, size) + [b"same-prefix-1234" + bytes([i]) * 16 for i in range(3)]
    assert schema.names(1, hashes) == [schema.key(1, h) for h in hashes]


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_all_rank_names_of_grouped_keys_equal_the_per_key_path(tp):
    """Rank-major within each block, groups in ``parts`` order, for 1, 2 and 4 ranks; and
    the answers fold back to one per block (present only on every rank)."""
    rank_keys = AllRankKeys(KeySchema.create("m", "bfloat16", ROWS, tp_size=tp))
    hashes = _hashes(40)
    grouped = GroupedKeys([(0, hashes[:25]), (2, hashes[10:40:3]), (1, [])])
    flat = list(grouped)
    assert flat == [(0, h) for h in hashes[:25]] + [(2, h) for h in hashes[10:40:3]]
    names = rank_keys.names(grouped)
    assert names == rank_keys.names(flat)  # the per-key path, from a plain list
    assert len(names) == tp * len(flat) and len(set(names)) == len(names)
    rng = random.Random(tp)
    found = [rng.random() < 0.8 for _ in names]
    folded = rank_keys.all_present(found)
    assert folded == [all(found[i * tp : (i + 1) * tp]) for i in range(len(flat))]


def test_grouped_keys_is_a_sequence_of_group_hash_pairs():
    hashes = _hashes(6)
    keys = GroupedKeys([(1, hashes[:2]), (3, hashes[2:6])])
    flat = [
        (1, hashes[0]),
        (1, hashes[1]),
        (3, hashes[2]),
        (3, hashes[3]),
        (3, hashes[4]),
        (3, hashes[5]),
    ]
    assert len(keys) == 6 and list(keys) == flat
    assert [keys[i] for i in range(-6, 6)] == flat + flat
    assert keys[1:4] == flat[1:4]
    with pytest.raises(IndexError):
        keys[6]


def _mirror() -> StoreMirror:
    return StoreMirror(
        GroupGeometry.from_params(CoordinatorParams.from_kv_cache_manager(BENCH.manager()))
    )


def test_answers_and_hit_blocks_equal_their_per_key_forms():
    """A lookup's per-group answers read like the dict of every key asked, re-deciding
    over them equals re-deciding over that dict, and the hit's blocks are the
    ``(position, (group, hash))`` pairs of the complete-contents hit."""
    mirror = _mirror()
    req = make_request(BENCH, random.Random(5).choices(range(3, 30000), k=2048))
    contents = set(
        mirror.probe_keys(req.block_hashes, req.num_tokens - 1, 0)[::7]
    )  # a sparse store
    asked: list = []

    def exists(keys):
        asked.extend(keys)
        return [k in contents for k in keys]

    got = mirror.lookup(req.block_hashes, req.num_tokens - 1, exists)
    assert isinstance(got.answers, KeyAnswers)
    as_dict = {k: k in contents for k in asked}
    assert dict(got.answers) == as_dict and len(got.answers) == len(as_dict)
    assert got.found == frozenset(k for k in asked if k in contents)
    assert all(k in got.answers for k in asked) and (9, b"x") not in got.answers
    again = mirror.lookup(req.block_hashes, 1024, exists, known=got.answers)
    via_dict = mirror.lookup(req.block_hashes, 1024, exists, known=as_dict)
    assert again.hit == via_dict.hit and again.probed == via_dict.probed
    want = mirror.longest_hit(req.block_hashes, req.num_tokens - 1, contents)
    assert got.hit == want
    for blocks in got.hit.blocks:
        assert isinstance(blocks, HitBlocks)
        pairs = tuple(blocks)
        assert blocks == pairs and pairs == tuple(blocks[i] for i in range(len(blocks)))
        assert all(key in contents for _, key in pairs)


def test_hit_blocks_compare_by_position_and_key():
    h = _hashes(3)
    a = HitBlocks(1, range(3), h)
    assert a == ((0, (1, h[0])), (1, (1, h[1])), (2, (1, h[2])))
    assert a == HitBlocks(1, [0, 1, 2], list(h))
    assert a != HitBlocks(1, [1, 2, 3], h)  # same keys, other positions
    assert a != HitBlocks(0, range(3), h)  # other group
    assert a != HitBlocks(1, range(3), [h[0], h[2], h[1]])
    assert hash(a) == hash(HitBlocks(1, [0, 1, 2], list(h)))
