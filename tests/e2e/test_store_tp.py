"""HybridStoreConnector at tensor_parallel_size=2 on the real vLLM CPU engine.

Each rank (one core each, ``VLLM_CPU_OMP_THREADS_BIND="0|1"``) stores its own shard of
every block under its own rank part (``tp2.<rank>``); the scheduler asks for every
rank's object of each probed block in ONE batched existence query and counts a block
only when all ranks hold it; saves unpin once every rank acknowledged them.

Per model (gemma3: sliding + full attention; qwen3-next: GDN linear attention + full
attention), sharing one engine per model within the module:

* 3 turns, local cache emptied before each: cached == the previous prompt's checkpoint
  (exact), greedy tokens + top-5 logprobs == a salted recompute;
* planted fault: rank 1's object of one full-attention block replaced by rank 1's real
  object of another block of the same prompt, sealed under the victim key: it loads
  (exact hit, no failed load) and the comparison FAILS; with the original back it matches;
* one rank's object missing (rank 1's block 1): the lookup offers nothing (exactly 0, no
  failed load: the hit was decided over BOTH ranks' objects; probing rank 0's keys only
  offered the hit and rank 1's load failed) and the output matches recompute;
* qwen3-next: the linear-attention (Mamba) state is stored per rank and the two ranks'
  shards differ (split by heads: deduplicating them would corrupt the model).

And a TP1 and a TP2 instance on one master and namespace: disjoint keys (rank part and
layout id), neither hits what the other saved; and save pins wait for both ranks' acks.
"""

from __future__ import annotations

import random
import uuid
from pathlib import Path

import pytest
from vllm.v1.kv_cache_interface import get_mamba_prefill_checkpoint_position

from hybridkv.cli.harness.llm_engine import (
    TIE_REDRAWS,
    VOCAB,
    compare,
    format_table,
    generate,
    kv_cache_layout,
    make_llm,
    metric,
    reset_local_cache,
    run_turns,
    store_transfer_config,
    tiny_model,
)
from hybridkv.store.cpu_affinity import usable_cpus
from hybridkv.store.mooncake_backend import MooncakeBackend
from hybridkv.store.object_trailer import TRAILER_BYTES, format_code_of, seal
from tests.docs_tables import observe

FIRST, GROWTH = 600, 300  # short prompts: 3 turns of 600 / 908 / 1216 tokens
_CPUS = sorted(usable_cpus())
# One core per rank (vLLM's CPU backend binds rank i to the i-th '|' part), as PDStack gives
# engines disjoint cores; the TP1 instance shares rank 1's core (one engine steps at a time).
RANK_BIND = f"{_CPUS[0]}|{_CPUS[-1]}"
TP1_BIND = f"{_CPUS[-1]}"
# model kind -> (hit alignment in tokens, extra engine args)
MODELS = {
    "gemma3": (128, {}),
    "qwen3next": (256, {"block_size": 256}),
}


def checkpoint(prev_len: int, align: int) -> int:
    return get_mamba_prefill_checkpoint_position(prev_len, align, False)


def rank_part(tp_size: int, rank: int) -> str:
    return f"/tp{tp_size}.{rank}-pp1.0/"


def keys_of(key_log: Path, group: int, part: str) -> list[str]:
    """Keys one rank saved for ``group``, in save order (a fresh request saves block i i-th)."""
    out = []
    for line in key_log.read_text().splitlines():
        key, gid, _ = line.split()
        if int(gid) == group and part in key:
            out.append(key)
    return out


def group_of(layout: dict, spec: str) -> int:
    return next(g["group"] for g in layout["groups"] if g["spec"] == spec)


def start_engine(kind: str, tp: int, master_address: str, key_log: Path, namespace: str, bind: str):
    align, engine_kw = MODELS[kind]
    mp = pytest.MonkeyPatch()
    mp.setenv("VLLM_CPU_OMP_THREADS_BIND", bind)
    try:
        return make_llm(
            tiny_model(kind),
            store_transfer_config(
                {
                    "master_address": master_address,
                    "key_log_path": str(key_log),
                    "namespace": namespace,
                }
            ),
            tensor_parallel_size=tp,
            max_model_len=2048,
            disable_log_stats=False,
            **engine_kw,
        )
    finally:
        mp.undo()  # the engine's processes have their environment already


def served(llm, prompt: list[int]) -> tuple[int, float, "object"]:
    """(cached tokens, failed loads during the request, comparison with a salted recompute)."""
    before = metric(llm, "vllm:hybridkv_store_failed_loads")
    got = generate(llm, prompt)
    failed = metric(llm, "vllm:hybridkv_store_failed_loads") - before
    ref = generate(llm, prompt, cache_salt=f"tp-recompute-{uuid.uuid4()}")
    assert ref.num_cached_tokens == 0
    return got.num_cached_tokens, failed, compare(got, ref)


@pytest.fixture(scope="module", autouse=True)
def insecure_serialization():
    """kv_cache_layout travels over collective_rpc: both the caller and the engine check it."""
    if len(_CPUS) < 2:
        pytest.fail(f"TP2 needs two usable CPUs (one per rank), this runner has {_CPUS}")
    mp = pytest.MonkeyPatch()
    mp.setenv("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
    yield
    mp.undo()


@pytest.fixture(scope="module")
def gemma3_tp2(master, tmp_path_factory):
    key_log = tmp_path_factory.mktemp("gemma3-tp2") / "keys.log"
    llm = start_engine("gemma3", 2, master.address, key_log, "tp-shared", RANK_BIND)
    yield llm, key_log
    del llm


@pytest.mark.parametrize("kind", list(MODELS))
def test_tp2_three_turns_fault_and_missing_rank_object(kind, master, gemma3_tp2, tmp_path):
    align, _ = MODELS[kind]
    if kind == "gemma3":
        llm, key_log = gemma3_tp2
    else:
        key_log = tmp_path / "keys.log"
        llm = start_engine(kind, 2, master.address, key_log, f"tp-{kind}", RANK_BIND)
    try:
        layout = llm.collective_rpc(kv_cache_layout)
        assert len(layout) == 2, "two tensor-parallel workers"
        dense = group_of(layout[0], "FullAttentionSpec")
        since = len(key_log.read_text().splitlines()) if key_log.exists() else 0

        rows, session = run_turns(
            llm,
            3,
            lambda prev, cur: checkpoint(prev, align),
            seed=5,
            first_tokens=FIRST,
            growth_tokens=GROWTH,
        )
        print("\n" + format_table(f"{kind} TP2 (local cache reset before every turn)", rows))
        assert [r.cached for r in rows] == [r.expected for r in rows]
        assert rows[0].expected == 0 and 0 < rows[1].cached < rows[2].cached
        assert all(r.matches_recompute for r in rows), [r.as_dict() for r in rows]

        # Every rank saved its own object of each block (same blocks, distinct keys).
        lines = key_log.read_text().splitlines()[since:]
        per_rank = [
            sorted(
                ln.split()[0].replace(rank_part(2, r), "/R/")
                for ln in lines
                if rank_part(2, r) in ln
            )
            for r in (0, 1)
        ]
        assert per_rank[0] and per_rank[0] == per_rank[1], "ranks saved different blocks"
        assert len(lines) == 2 * len(per_rank[0]), "a key of neither rank"

        first = [ln.split()[0] for ln in lines]
        rank1_dense = [k for k in keys_of(key_log, dense, rank_part(2, 1)) if k in first]
        victim, source = rank1_dense[0], rank1_dense[1]  # turn 1's blocks 0 and 1, rank 1
        last = session.prompt[: rows[2].prompt]
        hit = checkpoint(len(last), align)
        rng = random.Random(f"tp-{kind}")

        def tail() -> list[int]:
            return list(last[:hit]) + [rng.randrange(3, VOCAB) for _ in range(96)]

        with MooncakeBackend(master.address, global_segment_size=0) as client:
            if kind == "qwen3next":  # linear-attention state: one shard per rank, not identical
                mamba = group_of(layout[0], "MambaSpec")
                m0, m1 = (
                    keys_of(key_log, mamba, rank_part(2, 0)),
                    keys_of(key_log, mamba, rank_part(2, 1)),
                )
                assert m0 and len(m0) == len(m1)
                for a, b in zip(m0, m1):
                    pa, pb = client.get_bytes(a), client.get_bytes(b)
                    assert pa and pb and len(pa) == len(pb)
                    assert pa[:-TRAILER_BYTES] != pb[:-TRAILER_BYTES], (
                        f"{a} and {b}: identical shards"
                    )

            original = client.get_bytes(victim)
            wrong = client.get_bytes(source)[:-TRAILER_BYTES]
            assert original and wrong != original[:-TRAILER_BYTES]
            assert (
                client.replace_bytes(
                    victim, seal(victim, wrong, format_code=format_code_of(original))
                )
                == 0
            )
            # Another tail while the verdict is a near-tie at output position 0 (it compared
            # nothing: llm_engine.TIE_REDRAWS says why), as happens where the SSM state is bf16.
            for tails in range(1, TIE_REDRAWS + 1):
                reset_local_cache(llm)
                cached, failed, cmp = served(llm, tail())
                if cmp.tie_at != 0:
                    break
            print(
                f"  planted (rank 1, block 0 <- block 1): cached {cached} failed {failed} {cmp} tails {tails}"
            )
            assert client.replace_bytes(victim, original) == 0
            assert cached == hit and failed == 0, "the planted object was not loaded as valid"
            assert not cmp.matches, "one rank's wrong block went unnoticed: the check has no power"

            reset_local_cache(llm)
            cached, failed, cmp = served(llm, tail())
            print(f"  original back: cached {cached} failed {failed} {cmp}")
            assert cached == hit and failed == 0 and cmp.matches

            # Rank 1's object of turn 1's block 1 gone (rank 0's still there): the lookup
            # must see it missing and offer less; offering the full hit fails rank 1's load.
            assert client.remove(source, force=True) == 0
            reset_local_cache(llm)
            cached, failed, cmp = served(llm, tail())
            print(f"  rank 1's block 1 missing: cached {cached} failed {failed} {cmp}")
            assert failed == 0, "a hit was offered that rank 1 could not load"
            # Below block 1 the store has no window tail / Mamba state (turn 1 saved its
            # prompt checkpoint only), so the exact answer is 0.
            assert cached == 0, f"cached {cached}: block 1 is missing on rank 1"
            assert cmp.matches
        observe(
            "store-tp2",
            kind,
            {
                "cached per turn": " / ".join(str(r.cached) for r in rows),
                "checkpoint per turn": " / ".join(str(r.expected) for r in rows),
                "= recompute": f"{sum(r.matches_recompute for r in rows)}/{len(rows)}",
            },
        )
    finally:
        if kind != "gemma3":
            del llm


def test_tp1_and_tp2_on_one_master_never_serve_each_other(master, gemma3_tp2, tmp_path):
    """Same model, master and namespace: the keys differ (rank part and layout), so a TP1
    instance never reads TP2's half-head shards as whole blocks, nor the reverse."""
    tp2, tp2_log = gemma3_tp2
    tp1_log = tmp_path / "tp1-keys.log"
    tp1 = start_engine("gemma3", 1, master.address, tp1_log, "tp-shared", TP1_BIND)
    try:
        rng = random.Random("tp1-tp2")
        p1 = [rng.randrange(3, VOCAB) for _ in range(FIRST)]
        p2 = [rng.randrange(3, VOCAB) for _ in range(FIRST)]
        assert generate(tp1, p1).num_cached_tokens == 0
        reset_local_cache(tp1)  # saves acknowledged
        reset_local_cache(tp2)
        cached, failed, cmp = served(tp2, p1)
        assert (cached, failed, cmp.matches) == (0, 0, True), "TP2 served TP1's objects"
        reset_local_cache(tp2)
        assert generate(tp2, p2).num_cached_tokens == 0
        reset_local_cache(tp2)
        reset_local_cache(tp1)
        cached, failed, cmp = served(tp1, p2)
        assert (cached, failed, cmp.matches) == (0, 0, True), "TP1 served TP2's objects"
        # Control: each instance does hit its own saves of the same prompts.
        reset_local_cache(tp1)
        assert generate(tp1, p1 + p2[:50]).num_cached_tokens == checkpoint(len(p1), 128)
        k1 = {ln.split()[0] for ln in tp1_log.read_text().splitlines()}
        k2 = {ln.split()[0] for ln in tp2_log.read_text().splitlines()}
        assert k1 and k2 and not (k1 & k2)
        assert all(rank_part(1, 0) in k for k in k1) and not any(rank_part(1, 0) in k for k in k2)
        assert {k.split("/")[2] for k in k1}.isdisjoint({k.split("/")[2] for k in k2}), (
            "same layout id"
        )
    finally:
        del tp1


def test_save_pins_wait_for_every_rank():
    """A save job's source blocks stay pinned until BOTH ranks acknowledged it (engine-free:
    the scheduler side over vLLM's real BlockPool; the engine sums acks over workers)."""
    from collections import Counter
    from types import SimpleNamespace

    from vllm.v1.core.block_pool import BlockPool
    from vllm.v1.outputs import KVConnectorOutput

    from hybridkv.connector.store_config import StoreConnectorConfig
    from hybridkv.connector.store_metadata import StoreWorkerMetadata
    from hybridkv.connector.store_scheduler import StoreScheduler
    from hybridkv.store.keys import KeySchema

    pool = BlockPool(num_gpu_blocks=8, enable_caching=True, hash_block_size=16)
    schema = KeySchema.create("m", "bf16", [{"group": 0}], tp_size=2)
    sched = StoreScheduler(StoreConnectorConfig(), schema, None, world_size=2)
    sched._manager = SimpleNamespace(block_pool=pool)  # only the pool is touched by pins
    blocks = pool.get_new_blocks(2)
    sched._pins[7] = sched._pin([b.block_id for b in blocks])
    assert [b.ref_cnt for b in blocks] == [2, 2]
    sched.update_connector_output(
        KVConnectorOutput(kv_connector_worker_meta=StoreWorkerMetadata(Counter({7: 1})))
    )
    assert [b.ref_cnt for b in blocks] == [2, 2] and sched.has_pending_saves(), (
        "unpinned after one rank"
    )
    sched.update_connector_output(
        KVConnectorOutput(kv_connector_worker_meta=StoreWorkerMetadata(Counter({7: 1})))
    )
    assert [b.ref_cnt for b in blocks] == [1, 1] and not sched.has_pending_saves()
