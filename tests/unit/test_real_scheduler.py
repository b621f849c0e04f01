"""A REAL vLLM ``Scheduler`` (whichever version is on the path) driving HybridStoreConnector.

Engine-free but otherwise the scheduler process as the engine builds it: a
``VllmConfig`` over a local tiny ``config.json``, a hand-built hybrid
``KVCacheConfig``, block sizes resolved by vLLM's own
``resolve_kv_cache_block_sizes`` (as ``EngineCore`` does), the connector built
by vLLM's ``KVConnectorFactory`` from ``kv_transfer_config``, a real
mooncake_master. One ``schedule()`` call runs lookup -> allocate ->
``update_state_after_alloc`` -> ``build_connector_meta``; the test asserts the
exact hit vLLM accepted and the exact load job (group, hash, block id) the
workers would receive. Then the worker's "load finished" goes back through
``update_from_output`` and vLLM resumes the prefill at the hit.

This is the test that fails on vLLM 0.33 if the reconciled lookup does not take
0.33's ``max_cache_hit_length`` (a TypeError inside ``schedule()``). CI runs it
under 0.32 and again with 0.33's Python on PYTHONPATH (scripts/test.sh).

Geometries (hash unit 16):
* window: full attention 16 + sliding window 16 (window 64) + Mamba align 64;
* two-dense: full attention 16 + full attention 32 + Mamba align 32 (a drafter
  booked as full attention at another block size, next to linear attention).
"""

from __future__ import annotations

import json
import random
from collections import Counter

import numpy as np
import pytest
from vllm.config import CacheConfig, KVTransferConfig, ModelConfig, SchedulerConfig, VllmConfig
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import (
    get_request_block_hasher,
    init_none_hash,
    resolve_cache_hit_alignment_tokens,
    resolve_kv_cache_block_sizes,
)
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
from vllm.v1.request import Request, RequestStatus
from vllm.v1.structured_output import StructuredOutputManager

from hybridkv.cli.harness.kv_manager import Geometry, fa, mamba, sw
from hybridkv.connector.store_connector import HybridStoreConnector
from hybridkv.connector.store_metadata import StoreConnectorMetadata, StoreWorkerMetadata
from hybridkv.store import vllm_compat
from hybridkv.store.embedded_master import EmbeddedMaster
from hybridkv.store.mooncake_backend import MooncakeBackend
from tests.unit.tiny_vllm_config import TINY_LLAMA

UNIT = 16
WINDOW = Geometry(
    specs=[fa(16), sw(16, 64), mamba(64)], hash_block_size=UNIT, num_blocks=600, max_model_len=4096
)
TWO_DENSE = Geometry(
    specs=[fa(16), fa(32), mamba(32)], hash_block_size=UNIT, num_blocks=600, max_model_len=4096
)
PROMPT = random.Random(7).choices(range(3, 30000), k=1000)


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    """A real master, a client holding a segment (the store's memory), a tiny model dir."""
    init_none_hash(sha256)
    model_dir = tmp_path_factory.mktemp("tiny-llama")
    (model_dir / "config.json").write_text(json.dumps(TINY_LLAMA))
    with (
        EmbeddedMaster() as master,
        MooncakeBackend(master.address, global_segment_size=64 << 20) as holder,
    ):
        buf = np.zeros(64, dtype=np.uint8)
        holder.register(int(buf.ctypes.data), buf.nbytes)
        yield master.address, holder, buf, model_dir


def _scheduler(
    geo: Geometry,
    master_address: str,
    model_dir,
    namespace: str,
    policy: str = "fail",
    role: str = "kv_both",
    **extra: object,
) -> Scheduler:
    """What ``EngineCore`` builds in the scheduler process, minus the workers (``role``: the
    connector's ``kv_role``; ``extra``: more ``kv_connector_extra_config`` keys)."""
    vllm_config = VllmConfig(
        model_config=ModelConfig(
            model=str(model_dir),
            skip_tokenizer_init=True,
            dtype="bfloat16",
            enforce_eager=True,
            max_model_len=geo.max_model_len,
        ),
        cache_config=CacheConfig(
            block_size=16, enable_prefix_caching=True, mamba_cache_mode="align"
        ),
        scheduler_config=SchedulerConfig(
            max_num_batched_tokens=2048,
            max_num_seqs=8,
            max_model_len=geo.max_model_len,
            is_encoder_decoder=False,
        ),
        kv_transfer_config=KVTransferConfig(
            kv_connector="HybridStoreConnector",
            kv_role=role,
            kv_connector_module_path="hybridkv.connector.store_connector",
            kv_load_failure_policy=policy,
            kv_connector_extra_config={
                "master_address": master_address,
                "namespace": namespace,
                "lookup_cache_s": 0,
                **extra,
            },
        ),
    )
    kv_cache_config = geo.kv_cache_config()
    vllm_config.cache_config.num_gpu_blocks = kv_cache_config.num_blocks
    block_size, hash_block_size = resolve_kv_cache_block_sizes(kv_cache_config, vllm_config)
    kv_cache_config.hash_block_size = hash_block_size
    kv_cache_config.cache_hit_alignment_tokens = resolve_cache_hit_alignment_tokens(
        kv_cache_config, vllm_config, block_size, hash_block_size
    )
    assert (block_size, hash_block_size) == (geo.scheduler_block_size, UNIT)
    return Scheduler(
        vllm_config=vllm_config,
        kv_cache_config=kv_cache_config,
        structured_output_manager=StructuredOutputManager(vllm_config),
        block_size=block_size,
        hash_block_size=hash_block_size,
    )


def _request(req_id: str, prompt: list[int] = PROMPT) -> Request:
    return Request(
        req_id,
        list(prompt),
        SamplingParams(max_tokens=1),
        None,
        block_hasher=get_request_block_hasher(UNIT, sha256),
    )


def _fill_store(sched: Scheduler, store, upto: int) -> None:
    """The store holds every group's object at every hash unit ending at or below ``upto``."""
    _, holder, buf, _ = store
    schema = sched.connector._scheduler._schema
    hashes = _request("probe").block_hashes
    keys = [
        schema.key(g, bytes(hashes[t // UNIT - 1]))
        for g in range(len(sched.kv_cache_config.kv_cache_groups))
        for t in range(UNIT, upto + 1, UNIT)
    ]
    assert holder.put_from(keys, [int(buf.ctypes.data)] * len(keys), [64] * len(keys)) == [0] * len(
        keys
    )


def _put_keys(sched: Scheduler, store, keys) -> None:
    """What the workers' saves of ``keys`` ((group, hash) pairs) would have written."""
    _, holder, buf, _ = store
    schema = sched.connector._scheduler._schema
    names = [schema.key(g, bytes(h)) for g, h in keys]
    assert holder.put_from(names, [int(buf.ctypes.data)] * len(names), [64] * len(names)) == [
        0
    ] * len(names)


def _worker_reply(
    out,
    finished_recving=(),
    loads=(),
    saves=(),
    sampled=None,
    saves_failed=False,
    failed_recving=(),
) -> ModelRunnerOutput:
    """What the workers would report for this step (no forward: only connector acks)."""
    req_ids = list(out.num_scheduled_tokens)
    meta = StoreWorkerMetadata(
        finished_saves=Counter({s.job_id: 1 for s in saves}),
        released_loads=Counter({j.load_id: 1 for j in loads}),
        failed_saves=Counter({s.job_id: 1 for s in saves} if saves_failed else {}),
    )
    return vllm_compat.model_runner_output(
        req_ids,
        sampled_token_ids=[list(sampled.get(r, [])) if sampled else [] for r in req_ids],
        kv_connector_output=KVConnectorOutput(
            finished_recving=set(finished_recving),
            failed_recving=set(failed_recving),
            kv_connector_worker_meta=meta,
        ),
    )


def _expected_job(
    sched: Scheduler, req: Request, positions: list[list[int]]
) -> list[tuple[int, bytes, int]]:
    """(group, key hash, block id) for block ``i`` of each group: its last hash unit's hash."""
    table = sched.kv_cache_manager.get_blocks(req.request_id).get_block_ids()
    out = []
    for gid, idxs in enumerate(positions):
        bs = sched.kv_cache_config.kv_cache_groups[gid].kv_cache_spec.block_size
        out += [
            (gid, bytes(req.block_hashes[(i + 1) * bs // UNIT - 1]), table[gid][i]) for i in idxs
        ]
    return sorted(out)


def _admit(sched: Scheduler, req: Request):
    """ONE real schedule() step: lookup -> allocate -> update_state_after_alloc -> build_connector_meta."""
    sched.add_request(req)
    out = sched.schedule()
    meta = out.kv_connector_metadata
    assert isinstance(meta, StoreConnectorMetadata)
    jobs = [j for j in meta.loads if j.req_id == req.request_id]
    assert len(jobs) == 1 and jobs[0].refused is None, jobs
    job = jobs[0]
    got = sorted(
        zip(job.blocks.group_ids, (bytes(h) for h in job.blocks.hashes), job.blocks.block_ids)
    )
    return out, job, got


def _finish_load_and_resume(sched: Scheduler, req: Request, out, job, hit: int) -> None:
    """The workers report the load done; the next step must resume the prefill AT the hit."""
    assert req.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    assert (
        req.request_id not in out.num_scheduled_tokens
    )  # an async load computes nothing this step
    sched.update_from_output(
        out, _worker_reply(out, finished_recving={req.request_id}, loads=[job])
    )
    nxt = sched.schedule()
    assert req.status == RequestStatus.RUNNING
    new = [r for r in nxt.scheduled_new_reqs if r.req_id == req.request_id]
    assert len(new) == 1 and new[0].num_computed_tokens == hit
    assert nxt.num_scheduled_tokens[req.request_id] > 0
    assert not sched.connector._scheduler._load_pins, (
        "the load's pins must be released by the worker ack"
    )


@pytest.mark.parametrize("geo_name", ["window", "two_dense"])
def test_store_hit_through_a_real_scheduler_step(store, geo_name):
    """Empty local cache; the store holds every group's state up to token 512 and nothing beyond."""
    geo = {"window": WINDOW, "two_dense": TWO_DENSE}[geo_name]
    sched = _scheduler(geo, store[0], store[3], f"rs-{geo_name}")
    assert isinstance(sched.connector, HybridStoreConnector)
    _fill_store(sched, store, 512)
    req = _request(f"{geo_name}-cold")
    out, job, got = _admit(sched, req)
    assert req.num_computed_tokens == 512
    if geo is WINDOW:
        # FA16: blocks 0..31; SW16/64: the window tail covering tokens 449..511 = blocks 28..31;
        # Mamba64: the state at 512 = block 7.
        positions = [list(range(32)), [28, 29, 30, 31], [7]]
    else:
        # FA16: 0..31; FA32: 0..15; Mamba32: the state at 512 = block 15.
        positions = [list(range(32)), list(range(16)), [15]]
    assert got == _expected_job(sched, req, positions)
    _finish_load_and_resume(sched, req, out, job, 512)


def _run_to_completion(
    sched: Scheduler,
    req: Request,
    saves_failed: bool = False,
    jobs: list | None = None,
    ack: bool = True,
) -> set[tuple[int, bytes]]:
    """Prefill ``req`` step by step as the engine would (workers ack every save, as
    failed with ``saves_failed``; none with ``ack=False``: a store that does not answer),
    then finish it; returns the keys its saves offered (``jobs``: gets its save jobs).
    A store hit's load is reported done (and loaded) in the step that issued it."""
    sched.add_request(req)
    offered = set()
    for _ in range(50):
        out = sched.schedule()
        meta = out.kv_connector_metadata
        for job in meta.saves:
            offered |= {(g, bytes(h)) for g, h in zip(job.blocks.group_ids, job.blocks.hashes)}
        if jobs is not None:
            jobs += meta.saves
        loads = [
            j for j in meta.loads if j.req_id == req.request_id and j.blocks and j.refused is None
        ]
        n = out.num_scheduled_tokens.get(req.request_id, 0)
        done = req.num_computed_tokens >= req.num_tokens  # schedule() already advanced it
        sched.update_from_output(
            out,
            _worker_reply(
                out,
                saves=meta.saves if ack else (),
                saves_failed=saves_failed,
                sampled={req.request_id: [5]} if done and n else None,
                finished_recving={req.request_id} if loads else (),
                loads=loads,
            ),
        )
        if req.is_finished():
            return offered
    raise AssertionError("prefill did not finish in 50 steps")


@pytest.mark.parametrize("failed", [False, True])
def test_a_save_the_workers_could_not_write_is_offered_again(store, failed):
    """The same prompt computed twice (local cache emptied in between). Saves acknowledged
    as written (and written here, as the workers would) are not offered again (the dedup):
    the second request loads the store's hit and recomputes the rest, whose state blocks
    are already stored (planted, no dedup: a Mamba state is offered again). Saves a worker
    reported failed or skipped are offered again, every key of them, instead of being
    taken as saved for up to 131,072 saves."""
    sched = _scheduler(WINDOW, store[0], store[3], f"resave-{failed}")
    first = _run_to_completion(sched, _request(f"resave-{failed}-a"), saves_failed=failed)
    assert first, "the first prefill offered nothing to save"
    if not failed:
        _put_keys(sched, store, first)
    assert sched.kv_cache_manager.reset_prefix_cache()
    req = _request(f"resave-{failed}-b")
    again = _run_to_completion(sched, req)
    assert again == (first if failed else set())
    assert not sched.connector._scheduler._save_keys, "keys of acknowledged jobs must not be kept"


def test_local_dense_prefix_cut_by_eviction_is_extended_from_the_store(store):
    """Two dense groups: the second one's local blocks evicted beyond 256 tokens.

    A first request prefills locally. Then FA32's block 8 (tokens 256..287) is
    evicted, so the local hits are FA16 992, FA32 256: the reconciled lookup
    reports 256 (the MIN of the dense hits) and the store, holding everything,
    extends it to 992 (the last hash unit below the 1000-token prompt's last
    token). The load must fill exactly the blocks beyond 256 of both dense
    groups and the Mamba state at 992, and nothing the local cache still
    provides.
    """
    sched = _scheduler(TWO_DENSE, store[0], store[3], "rs-evicted")
    _run_to_completion(sched, _request("first"))
    probe = _request("probe")
    pool = sched.kv_cache_manager.block_pool
    victim = pool.get_cached_block(probe.block_hashes[288 // UNIT - 1], [1])
    assert victim is not None, "the first request's FA32 block 8 must be in the local cache"
    sched.kv_cache_manager.evict_blocks({victim[0].block_id})
    _fill_store(sched, store, 992)
    req = _request("second")
    out, job, got = _admit(sched, req)
    assert req.num_computed_tokens == 992
    positions = [list(range(16, 62)), list(range(8, 31)), [30]]
    assert got == _expected_job(sched, req, positions)
    _finish_load_and_resume(sched, req, out, job, 992)


def test_saves_a_silent_store_holds_pin_at_most_their_share_of_the_cache(store):
    """A store that stops answering (a killed node: puts wait for ``timeout_s``): no worker
    acknowledges a save, so every save job keeps its blocks pinned. Five requests of 1000
    distinct tokens on a 300-block cache: the first request's save job pins its blocks,
    then saves in flight are at ``max_pinned_save_fraction`` (150 blocks) and each later
    request's block job is skipped (counted, its keys forgotten so that they are offered
    again) while vLLM keeps scheduling. When the store answers again, the pins go and the
    next request saves in full. Planted (no budget): the pool fills with pinned blocks
    and the third request never gets blocks ("prefill did not finish") -- the engine
    stall the CI soak found after a store node was killed."""
    geo = Geometry(
        specs=[fa(16), sw(16, 64), mamba(64)],
        hash_block_size=UNIT,
        num_blocks=300,
        max_model_len=4096,
    )
    sched = _scheduler(geo, store[0], store[3], "pin-budget", max_pinned_save_fraction=0.5)
    conn = sched.connector._scheduler
    counted: Counter = Counter()
    take = conn.take_stats

    def take_and_count():
        stats = take()
        counted.update({k: v for k, v in (stats.data if stats else {}).items() if "skipped" in k})
        return stats

    conn.take_stats = take_and_count
    sizes = []
    for i in range(5):
        jobs: list = []
        prompt = random.Random(100 + i).choices(range(3, 30000), k=1000)
        _run_to_completion(sched, _request(f"pin-{i}", prompt), jobs=jobs, ack=False)
        sizes.append([len(j.blocks) for j in jobs])
    first = sizes[0][0]  # FA16 62 blocks + the window group's 62 (both masked by vLLM's rule)
    assert first + first + 1 > 150, "the test needs a second block job to exceed the budget"
    assert sizes == [[first, 1]] + [[1]] * 4  # each later request: its Mamba state job only
    assert sum(len(p) for p in conn._pins.values()) == conn._pinned_save_blocks == first + 5 <= 150
    assert counted == {"skipped_saves": 4 * first, "pin_budget_skipped_jobs": 4}
    assert len(conn._recent) == first + 5, "the skipped jobs' keys must be offered again"
    conn.update_connector_output(
        KVConnectorOutput(
            kv_connector_worker_meta=StoreWorkerMetadata(
                finished_saves=Counter({job_id: 1 for job_id in conn._pins})
            )
        )
    )
    assert conn._pins == {} and conn._save_keys == {} and conn._pinned_save_blocks == 0
    jobs = []
    _run_to_completion(
        sched, _request("pin-after", random.Random(200).choices(range(3, 30000), k=1000)), jobs=jobs
    )
    assert [len(j.blocks) for j in jobs] == [first, 1]


@pytest.mark.parametrize(
    "load_fails, policy", [(False, "recompute"), (True, "recompute"), (True, "fail")]
)
def test_blocks_whose_load_failed_are_saved_again(store, load_fails, policy):
    """The store holds what this instance saved (keys 'saved recently'); a later load of
    them fails (corrupt object refused and removed, node gone): the request recomputes
    and must save those blocks again. A load that succeeded offers nothing again. With
    policy "fail" vLLM ends the request before the connector hears of the failure: the
    keys must still stop counting as saved."""
    sched = _scheduler(WINDOW, store[0], store[3], f"reload-{load_fails}-{policy}", policy=policy)
    offered = _run_to_completion(sched, _request(f"reload-{load_fails}-{policy}-a"))
    _fill_store(sched, store, 512)  # what the first prefill's saves would have written up to 512
    assert sched.kv_cache_manager.reset_prefix_cache()
    req = _request(f"reload-{load_fails}-{policy}-b")
    out, job, got = _admit(sched, req)
    # The loaded keys the first prefill offered (and the workers acknowledged): 'saved recently'.
    loaded = {(g, h) for g, h, _ in got} & offered
    assert len(loaded) >= 32, "the load must read blocks the first prefill saved"
    failed = {req.request_id} if load_fails else set()
    sched.update_from_output(
        out,
        _worker_reply(out, finished_recving={req.request_id}, loads=[job], failed_recving=failed),
    )
    if policy == "fail":
        assert req.is_finished() and not loaded & set(sched.connector._scheduler._recent)
        assert not sched.connector._scheduler._load_keys
        return
    again = set()
    for _ in range(50):
        out = sched.schedule()
        for j in out.kv_connector_metadata.saves:
            again |= {(g, bytes(h)) for g, h in zip(j.blocks.group_ids, j.blocks.hashes)}
        n = out.num_scheduled_tokens.get(req.request_id, 0)
        done = req.num_computed_tokens >= req.num_tokens
        sched.update_from_output(
            out,
            _worker_reply(
                out,
                saves=out.kv_connector_metadata.saves,
                sampled={req.request_id: [5]} if done and n else None,
            ),
        )
        if req.is_finished():
            break
    assert req.is_finished()
    if load_fails:
        assert loaded <= again, (
            f"{len(loaded - again)} recomputed blocks were not offered for saving again"
        )
    else:
        assert not again & loaded
    assert not sched.connector._scheduler._load_keys


def _fill_for(sched: Scheduler, store, req: Request, upto: int) -> None:
    """The store holds every group's object of ``req``'s prefix at every hash unit up to ``upto``."""
    _, holder, buf, _ = store
    schema = sched.connector._scheduler._schema
    keys = [
        schema.key(g, bytes(req.block_hashes[t // UNIT - 1]))
        for g in range(len(sched.kv_cache_config.kv_cache_groups))
        for t in range(UNIT, upto + 1, UNIT)
    ]
    assert holder.put_from(keys, [int(buf.ctypes.data)] * len(keys), [64] * len(keys)) == [0] * len(
        keys
    )


@pytest.mark.parametrize("num_blocks", [48, 56, 64, 72])
def test_loads_failing_together_do_not_stall_the_engine(store, num_blocks):
    """A store node dies: every async load in flight fails in the SAME step, in a KV cache
    they fill. vLLM 0.32 frees a failed load's blocks only when schedule() reaches the
    request in kv_holding_waiting, and stops at the first request that cannot allocate
    (its whole prompt must fit). Nothing runs: unless the first failed request steps
    aside, the others never give their blocks back (the soak's 120 s stall)."""
    geo = Geometry(
        specs=[fa(16), sw(16, 64)], hash_block_size=UNIT, num_blocks=num_blocks, max_model_len=4096
    )
    sched = _scheduler(geo, store[0], store[3], f"stall-{num_blocks}", policy="recompute")
    reqs = [
        _request(f"stall-{num_blocks}-{i}", random.Random(1000 + i).choices(range(3, 30000), k=300))
        for i in range(6)
    ]
    for r in reqs:
        _fill_for(sched, store, r, 288)
        sched.add_request(r)
    out = sched.schedule()
    loading = [r for r in reqs if r.status == RequestStatus.WAITING_FOR_REMOTE_KVS]
    assert len(loading) >= 2, "the test needs several loads in flight at once"
    jobs = out.kv_connector_metadata.loads
    ids = {r.request_id for r in loading}
    sched.update_from_output(
        out, _worker_reply(out, finished_recving=ids, loads=jobs, failed_recving=ids)
    )
    out = sched.schedule()
    # This very step: every failed load gave its blocks back (each stepped aside once).
    assert [r.status for r in loading] == [RequestStatus.WAITING] * len(loading)
    assert not any(
        any(g) for r in loading for g in sched.kv_cache_manager.get_block_ids(r.request_id)
    )
    assert sched.connector.get_kv_connector_stats().data["failed_load_deferrals"] == len(loading)
    for _ in range(40):
        if out.num_scheduled_tokens:
            break
        loads = out.kv_connector_metadata.loads  # later admissions' loads: these succeed
        sched.update_from_output(
            out, _worker_reply(out, finished_recving={j.req_id for j in loads}, loads=loads)
        )
        out = sched.schedule()
    assert out.num_scheduled_tokens, (
        f"engine stalled: free {sched.kv_cache_manager.block_pool.get_num_free_blocks()}, "
        f"{[(r.request_id, r.status.name, r.num_computed_tokens) for r in reqs]}"
    )


def test_after_another_connectors_failed_load_the_store_offers_nothing_and_does_not_defer(store):
    """Under MultiConnector every child sees every child's ``failed_recving``. After a P/D
    READ of a request failed, the store must not offer that request its copy of the prefix:
    vLLM still counts the request in ``_inflight_prefills`` and would reserve its prompt twice
    (the stall: tests/unit/test_failed_read_then_store_hit.py). Nor may it defer the request
    (the P/D scheduler defers its own failures): it answers 0 at once. A request whose load
    did not fail still gets the store's hit. The lookup cache (60 s here) holds the hit from
    before the failure: it must not answer for the failed request."""
    geo = Geometry(
        specs=[fa(16), sw(16, 64)], hash_block_size=UNIT, num_blocks=200, max_model_len=4096
    )
    sched = _scheduler(
        geo, store[0], store[3], "foreign-fail", policy="recompute", lookup_cache_s=60
    )
    conn = sched.connector._scheduler
    req = _request("foreign-fail-0", random.Random(77).choices(range(3, 30000), k=300))
    other = _request("foreign-fail-1", random.Random(78).choices(range(3, 30000), k=300))
    for r in (req, other):
        _fill_for(sched, store, r, 288)
        conn.on_new_request(r)
    assert conn.get_num_new_matched_tokens(req, 0) == (
        288,
        True,
    )  # asked before the P/D READ failed
    conn.update_connector_output(
        KVConnectorOutput(finished_recving={req.request_id}, failed_recving={req.request_id})
    )
    assert conn._failed_loads.load_failed(req.request_id)
    assert conn.get_num_new_matched_tokens(req, 0) == (0, False)  # an answer, not a deferral (None)
    assert conn._failed_loads.deferrals == 0
    assert conn.get_num_new_matched_tokens(other, 0) == (288, True)
    conn.request_finished(req)
    assert len(conn._failed_loads) == 0


def test_a_new_master_epoch_offers_every_saved_block_again(store):
    """The master lost its objects (the epoch marker this client wrote is gone: a restart, or
    its segment owner died). Keys saved before are not in the store any more, so they must
    stop counting as saved recently: the next step drops them all (``recent_saves_dropped``
    once) and later prefills save them again. Control in the same run: another request's
    prefill with no epoch change keeps the first request's keys (a different prompt, so its
    lookups never find them missing). Last in this file: the master's client is shared."""
    sched = _scheduler(WINDOW, store[0], store[3], "epoch")
    conn = sched.connector._scheduler
    client = conn._client
    first = _run_to_completion(sched, _request("epoch-a"))
    assert first and first <= set(conn._recent)
    second = _run_to_completion(
        sched, _request("epoch-b", random.Random(8).choices(range(3, 30000), k=1000))
    )
    assert first | second <= set(conn._recent)  # control: nothing dropped without a new epoch
    dropped: Counter = Counter()
    take = conn.take_stats  # vLLM's scheduler takes the stats each step: count what it takes

    def take_and_count():
        stats = take()
        dropped.update(
            {k: v for k, v in (stats.data if stats else {}).items() if k == "recent_saves_dropped"}
        )
        return stats

    conn.take_stats = take_and_count
    epoch = client.check_master_epoch()
    assert client.remove(client._marker, force=True) == 0  # what a master restart does to it
    assert (
        client.check_master_epoch() > epoch
    )  # (the session's epoch monitor may be the one that saw it)
    third = _run_to_completion(
        sched, _request("epoch-c", random.Random(9).choices(range(3, 30000), k=1000))
    )
    assert not (first | second) & set(conn._recent) and third <= set(conn._recent)
    conn.take_stats()
    assert dropped == {"recent_saves_dropped": 1}
