"""The scheduler's existence query asked as concurrent parts answers exactly like one call.

Why: a long-prompt lookup asks its ~12k keys as up to ``_LOOKUP_MAX_PARTS`` concurrent
``batch_is_exist`` calls (``MooncakeBackend.exists_parts``), each part named while the ones
before it are in flight, and joins the answers. A join that misorders or drops a part, or a
split that cuts a block's rank-major names apart (tensor parallel: a block is present only
when every rank's object is), would move a miss and change the hit. Real mooncake_master,
real vLLM coordinator (through ``StoreMirror``); the store holds every object of a
4096-token prompt except a few placed so that the hit depends on the answers of late
parts: one FA16 key deep in the prompt (only rank 1's object at TP2), and a window tail.
Parts of 64 keys here (the real size is ``_LOOKUP_PART_KEYS``), so every round trip is
split. Shown failing (planted in ``MooncakeBackend``, then reverted): parts joined in reverse
order -> 2 of 2 fail; the last part's answers dropped -> 2 of 2 fail (the backend's own tests,
tests/unit/test_backend_exists_codes.py, also fail 11 of 14 on each of these and on a join in
completion order).
"""

from __future__ import annotations

import random
from typing import Any, Iterator

import numpy as np
import pytest
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import init_none_hash

import hybridkv.connector.store_scheduler as store_scheduler
from hybridkv.cli.harness.kv_manager import Geometry, fa, make_request, mamba, sw
from hybridkv.connector.store_config import StoreConnectorConfig
from hybridkv.connector.store_scheduler import StoreScheduler
from hybridkv.store.embedded_master import EmbeddedMaster
from hybridkv.store.keys import KeySchema
from hybridkv.store.mooncake_backend import MooncakeBackend

# The lookup bench's geometry: FA16 + FA32 + SW16 (window 128) + Mamba64 align, unit 16.
GEO = Geometry(
    specs=[fa(16), fa(32, heads=2), sw(16, 128), mamba(64)],
    hash_block_size=16,
    num_blocks=3000,
    max_model_len=20000,
)
TOKENS = random.Random(11).choices(range(3, 30000), k=4096)


class PartsSpy:
    """Pass-through client: records the key count of every part of every ``exists_parts``."""

    def __init__(self, inner: MooncakeBackend) -> None:
        self._inner = inner
        self.queries: list[list[int]] = []

    def exists_parts(self, parts, timeout_s: Any = None) -> list[bool]:  # noqa: ANN001 - an iterable
        sizes: list[int] = []
        self.queries.append(sizes)

        def counted():
            for p in parts:
                sizes.append(len(p))
                yield p

        return self._inner.exists_parts(counted(), timeout_s=timeout_s)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


@pytest.fixture(scope="module")
def client() -> Iterator[MooncakeBackend]:
    init_none_hash(sha256)
    with (
        EmbeddedMaster() as master,
        MooncakeBackend(master.address, global_segment_size=64 << 20) as c,
    ):
        yield c


@pytest.mark.parametrize("tp", [1, 2])
def test_lookup_in_parts_equals_one_call_and_the_coordinator(client, monkeypatch, tp: int) -> None:
    schema = KeySchema.create(f"parts-tp{tp}", "bf16", [{"g": 4}], tp_size=tp)
    sched = StoreScheduler(StoreConnectorConfig(lookup_cache_s=0), schema, client, world_size=tp)
    sched.bind(GEO.manager())
    mirror = sched._mirror
    req = make_request(GEO, TOKENS)
    max_tokens = req.num_tokens - 1
    probe = mirror.probe_keys(req.block_hashes, max_tokens, 0)
    h = req.block_hashes
    # Absent on some rank: FA16's block ending at token 3008 (round trip 2, a late part) and
    # the window group's key at 2992 (a tail the hit below 3008 needs).
    holes = {(0, bytes(h[3008 // 16 - 1])), (2, bytes(h[2992 // 16 - 1]))}
    buf = np.zeros(64, dtype=np.uint8)
    client.register(int(buf.ctypes.data), buf.nbytes)
    names = [
        s.key(g, hh)
        for g, hh in probe
        for r, s in enumerate(schema.for_rank(i) for i in range(tp))
        if not (
            (g, hh) in holes and r == tp - 1
        )  # the last rank misses them (TP2: rank 0 has them)
    ]
    for lo in range(0, len(names), 512):
        part = names[lo : lo + 512]
        assert client.put_from(part, [int(buf.ctypes.data)] * len(part), [64] * len(part)) == [
            0
        ] * len(part)
    contents = set(probe) - holes
    want = mirror.longest_hit(h, max_tokens, contents)
    assert 2900 < want.tokens < 3008, want.tokens  # the holes decide the hit

    spy = PartsSpy(client)
    sched._client = spy
    monkeypatch.setattr(store_scheduler, "_LOOKUP_PART_KEYS", 64)
    got, _ = sched.get_num_new_matched_tokens(make_request(GEO, TOKENS), 0)
    plan = next(iter(sched._plans.values()))
    assert got == want.tokens and plan.hit == want
    # Every round trip went as parts: FA32 (128 keys per rank), the rest near its bound (282),
    # and the exact fallback (the hit ends far below the bound, where the window tail and the
    # Mamba state were not asked): 3 queries.
    assert len(spy.queries) == 3, spy.queries
    for (
        q
    ) in spy.queries:  # as many parts as the query's names allow, sizes within one block's names
        assert len(q) == min(store_scheduler._LOOKUP_MAX_PARTS, sum(q) // 64) > 1, spy.queries
        assert max(q) - min(q) <= tp and all(n % tp == 0 for n in q), spy.queries
    asked = sum(map(sum, spy.queries))
    assert asked == tp * len(plan.answers)  # every rank's name of every key asked, once

    # The same lookup as one call per round trip: the same hit and the same answers.
    sched._plans.clear()
    monkeypatch.setattr(store_scheduler, "_LOOKUP_PART_KEYS", 1 << 30)
    one, _ = sched.get_num_new_matched_tokens(make_request(GEO, TOKENS), 0)
    plan_one = next(iter(sched._plans.values()))
    assert len(spy.queries) == 3, "one call per round trip goes through exists, not exists_parts"
    assert one == got and plan_one.hit == plan.hit
    assert dict(plan_one.answers) == dict(plan.answers)
