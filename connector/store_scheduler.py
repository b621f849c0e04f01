"""Scheduler side of HybridStoreConnector: lookups, load plans, save plans, pins.

Lookups ask the store mirror (vLLM's own coordinator over the store's keys),
which probes only keys the coordinator can read beyond the local prefix hit
(two batched existence queries: the coarsest dense group, then the rest around
its bound), so the store offers exactly what the scheduler can accept. Saves follow the mirror's save mask
(every dense block, window tails, aligned Mamba checkpoints) and pin the source
blocks until every worker has written them, because a finished or preempted
request frees its blocks at once and vLLM would hand them to another request.
"""

from __future__ import annotations

import itertools
import time
from collections import Counter, OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from vllm.v1.core.kv_cache_utils import get_block_hash

from hybridkv.connector.block_copies import step_block_copies
from hybridkv.connector.dense_reference import install_reconciled_lookup
from hybridkv.connector.failed_loads import FailedLoads
from hybridkv.connector.log_once import warn_once
from hybridkv.connector.store_config import StoreConnectorConfig
from hybridkv.connector.store_keys import AllRankKeys
from hybridkv.connector.store_metadata import (
    BlockBatch,
    LoadJob,
    SaveJob,
    StoreConnectorMetadata,
    StoreWorkerMetadata,
)
from hybridkv.connector.store_stats import HybridStoreStats, RequestLedger, covered_tokens
from hybridkv.store import vllm_compat
from hybridkv.store.geometry import GroupGeometry
from hybridkv.store.keys import KeySchema
from hybridkv.store.logs import get_logger
from hybridkv.store.mirror import (
    BlockKey,
    GroupedKeys,
    KeyAnswers,
    ProbedHit,
    StoreHit,
    StoreMirror,
)
from hybridkv.store.mooncake_backend import MooncakeBackend, StoreError, code_name

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks, KVCacheManager
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

logger = get_logger(__name__, "store")

# Keys written by this engine recently: re-offering them costs a put round trip.
_RECENT_SAVES = 1 << 17
_MAX_PENDING_LOADS = 65_536  # loads whose keys wait for the workers' report (bounded)
_LOSS_CHECKS = 64  # absent keys per group a lookup checks against _recent (_forget_missing)
# A lookup's existence query is asked as up to this many concurrent parts of at least
# _LOOKUP_PART_KEYS keys each (MooncakeBackend.exists_parts; see _exists): the master serves
# them on several threads, so a long lookup answers sooner (bench/lookup_cost.py and
# bench/exists_split.py measure it: docs/results.md). 4 parts fit the backend's smallest call
# pool; each part holds at least 2048 keys, since a small query gains nothing from a split.
_LOOKUP_MAX_PARTS = 4
_LOOKUP_PART_KEYS = 2048


def _first_lost_unit(block_hashes: Sequence[bytes], lost: set[bytes]) -> int:
    """The first hash unit of the prompt whose key was found lost, in any group.

    A key is named by the hash unit it ends at (``StoreMirror.block_key``), so one
    unit is the same token in every group whatever its block size: the keys of a
    group from this unit on are its blocks ending at or after the earliest loss.
    0 (every key) if none is the prompt's: the answers come from this prompt's
    hashes, and forgetting too much only costs puts."""
    return next((i for i, h in enumerate(block_hashes) if h in lost), 0)


@dataclass
class _LoadPlan:
    """A lookup's answer, kept until the scheduler allocates (or drops) the request."""

    hit: StoreHit
    local_tokens: int
    answers: dict[
        BlockKey, bool
    ]  # every key the lookup asked: a smaller grant re-decides over them
    num_tokens: int
    at: float

    @property
    def found(self) -> frozenset[BlockKey]:
        return frozenset(k for k, ok in self.answers.items() if ok)


class StoreScheduler:
    """One per engine (in the engine core process)."""

    def __init__(
        self,
        cfg: StoreConnectorConfig,
        schema: KeySchema,
        client: MooncakeBackend | None,
        world_size: int,
    ) -> None:
        self._cfg = cfg
        self._schema = schema
        self._rank_keys = AllRankKeys(schema)  # a hit needs every tensor-parallel rank's object
        self._client = client
        self._world_size = world_size
        self._manager: KVCacheManager | None = None
        self._geometry: GroupGeometry | None = None
        self._mirror: StoreMirror | None = None
        self._requests: dict[str, Request] = {}
        self._plans: dict[str, _LoadPlan] = {}
        self._loads: list[LoadJob] = []
        self._saved_upto: dict[
            str, list[int]
        ] = {}  # req -> per group: blocks considered for saving
        self._tails_done: set[str] = set()
        # Requests whose async load failed: they recompute (never offered a hit again) and
        # skip their next admission once (get_num_new_matched_tokens).
        self._failed_loads = FailedLoads()
        self._recent_lookups: dict[str, tuple] = {}
        self._load_pins: dict[int, list[Any]] = {}
        self._load_acks: Counter[int] = Counter()
        self._recent: OrderedDict[BlockKey, None] = OrderedDict()
        self._save_keys: dict[int, list[BlockKey]] = {}  # save job -> its keys, while pinned
        # The keys of _save_keys with their job counts (_save_started/_save_ended keep both):
        # _forget_missing asks it per lost key instead of rebuilding it from every job.
        self._in_flight: Counter[BlockKey] = Counter()
        self._load_keys: dict[
            str, list[BlockKey]
        ] = {}  # request -> its load's keys, until reported
        # Requests with a load job of this connector (blocks or refused), until reported: a
        # failed one owes its deferral whether or not it had blocks.
        self._loading: set[str] = set()
        self._job_ids = itertools.count(1)
        self._pins: dict[int, list[Any]] = {}
        self._pinned_save_blocks = 0  # sum of len(self._pins[j]): what the pin budget counts
        self._acks: Counter[int] = Counter()
        self._stats = HybridStoreStats()
        self._ledger = RequestLedger(lambda: self._stats)  # one counted decision per admission
        self._master_epoch = client.master_epoch if client is not None else 0
        self._saves = True  # bind() sets the role's answer

    # ----------------------------------------------------------------- binding
    def bind(self, manager: "KVCacheManager", loads: bool = True, saves: bool = True) -> None:
        """Read the geometry off the live manager and install the dense reference. ``saves``:
        the role sends save jobs (``kv_producer`` / ``kv_both``); otherwise none is planned or
        pinned, since no worker would ever acknowledge it."""
        self._manager = manager
        self._saves = saves
        self._geometry = install_reconciled_lookup(manager, self._extends if loads else None)
        self._mirror = StoreMirror(self._geometry)
        logger.info("KV cache groups %s", self._geometry.describe())

    @property
    def geometry(self) -> GroupGeometry | None:
        return self._geometry

    # ------------------------------------------------------------------ lookup
    def on_new_request(self, request: "Request") -> None:
        self._requests[request.request_id] = request

    def _extends(self, request: "Request", num_computed_tokens: int) -> bool:
        """Can the store load beyond this (diverged) local hit? A yes is kept, so the
        scheduler's own call right after costs no second round trip; after a no, vLLM asks
        again from the convergent hit (a second lookup, counted in the lookup metrics)."""
        return self._matched_tokens(request, num_computed_tokens)[0] > 0

    def get_num_new_matched_tokens(
        self, request: "Request", num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        """External tokens beyond the block-aligned local hit; side-effect free on the store.

        ``None`` (vLLM: "not known yet", the request is skipped this step) exactly once
        after the request's async load failed, so that several loads failing in one step
        (a store node died) cannot stall vLLM's scheduler (why: connector/failed_loads.py;
        counted in ``failed_load_deferrals``)."""
        if self._failed_loads.take_deferral(request.request_id):
            self._stats.add("failed_load_deferrals")
            return None, False
        return self._matched_tokens(request, num_computed_tokens)

    def _matched_tokens(self, request: "Request", num_computed_tokens: int) -> tuple[int, bool]:
        self._plans.pop(request.request_id, None)
        if self._failed_loads.load_failed(request.request_id):
            # A failed load (this connector's or another's) recomputes: offering a load again
            # could loop, and vLLM's stale reservation could stall admission (failed_loads.py).
            # Checked before the lookup cache, whose answer may predate the failure.
            return 0, False
        if vllm_compat.skips_external_kv(request):
            return 0, False  # vLLM discards this request's external hit: no store round trip
        cached = self._recent_lookups.get(request.request_id)
        if cached is not None:
            key, at, answer, plan = cached
            if (
                key == (request.num_tokens, num_computed_tokens)
                and time.monotonic() - at < self._cfg.lookup_cache_s
            ):
                # The scheduler re-asks for a request it could not admit yet: same answer,
                # no round trip (a stale "present" only costs a failed load and a recompute).
                if plan is not None:
                    self._plans[request.request_id] = plan
                return answer
        answer = self._lookup(request, num_computed_tokens)
        self._recent_lookups[request.request_id] = (
            (request.num_tokens, num_computed_tokens),
            time.monotonic(),
            answer,
            self._plans.get(request.request_id),
        )
        return answer

    def _lookup(self, request: "Request", num_computed_tokens: int) -> tuple[int, bool]:
        mirror = self._mirror
        if mirror is None or self._client is None or not request.block_hashes:
            return 0, False
        max_tokens = request.num_tokens - 1
        unit = mirror.geometry.hash_block_size
        if min(len(request.block_hashes) * unit, max_tokens) <= num_computed_tokens:
            return 0, False
        t0 = time.perf_counter()
        try:
            probed = mirror.lookup(
                request.block_hashes, max_tokens, self._exists, num_computed_tokens
            )
        except StoreError as e:
            self._stats.add("lookup_errors")
            self._stats.add(f"fail.lookup_{code_name(e.code).lower()}")
            warn_once(logger, f"lookup:{e.code}", "lookup failed, treating as a miss: %s", e)
            self._ledger.offered(request.request_id, request.num_tokens, 0)
            return 0, False
        finally:
            self._stats.add_latency("lookup", time.perf_counter() - t0)
        self._count_probes(probed)
        self._forget_missing(request, probed.answers)
        hit = probed.hit
        ext = hit.tokens - num_computed_tokens
        self._ledger.offered(request.request_id, request.num_tokens, max(ext, 0))
        if ext <= 0:
            return 0, False
        self._plans[request.request_id] = _LoadPlan(
            hit, num_computed_tokens, probed.answers, request.num_tokens, time.monotonic()
        )
        return ext, True

    def _exists(self, keys: list[BlockKey]) -> list[bool]:
        """ONE batched existence query (a round trip) for the mirror's probe keys, every
        rank's object of each: a block counts only when all ranks hold it."""
        names = self._rank_keys.names
        parts = min(_LOOKUP_MAX_PARTS, len(keys) * self._rank_keys.num_ranks // _LOOKUP_PART_KEYS)
        if parts > 1 and isinstance(keys, GroupedKeys):
            # Concurrent parts, each named while the ones before it are in flight.
            found = self._client.exists_parts(
                map(names, keys.split(parts)), timeout_s=self._cfg.lookup_timeout_s
            )
        else:
            found = self._client.exists(
                names(keys), timeout_s=self._cfg.lookup_timeout_s, shards=max(parts, 1)
            )
        return self._rank_keys.all_present(found)

    def _forget_missing(self, request: "Request", answers: KeyAnswers) -> None:
        """Keys a lookup found absent are not in the store, whatever ``_recent`` believes.

        Why: the store can lose objects with no master restart, so the epoch marker
        (``MooncakeBackend.check_master_epoch``) does not see it: the master expires a
        segment owner whose pings it did not see for its client TTL (10 s by default)
        and drops every object in that segment. A master stopped for about its client TTL
        can expire segment owners as it resumes, before reading their queued pings
        (docs/soak.md); the epoch marker survives when it sits in a segment that is kept.
        Kept in ``_recent``, such blocks would be recomputed by every later request and
        saved by none, until the next master restart. A node that dies or an eviction
        does the same.

        So once a lookup finds a key it believes saved missing, the keys of the request's
        prompt from the earliest such key on leave ``_recent`` (:func:`_first_lost_unit`),
        in every group, and the recompute that follows saves them again. Earliest over ALL
        groups, not each group's own first loss: a lookup asks every dense key it can use
        but sparse keys (window tails, Mamba states) only near its hit, and a finer dense
        group only up to a block past it, so a group's keys further on may be lost unasked;
        forgotten now, the recompute saves them instead of each waiting for a later lookup
        to find it missing (one degraded hit each). Keys before that position stay
        (forgetting the whole prompt would make the recompute re-put every block it passes,
        stored or not): between the hit and the loss this lookup asked every key (the
        coordinator reads each group down from its candidate to the hit) and found none
        lost; below the hit (held locally, or loaded) this request computes nothing, so
        forgetting could not save them again, and a request that needs them asks for them
        itself. Left behind until a later lookup asks them: lost sparse keys between the
        ask range and a loss past a dense key never saved (a skipped save ends the hit
        there), and lost keys the checks below skip. Keys of save jobs still in flight
        stay: not landed yet is not lost. Only the first ``_LOSS_CHECKS`` absent keys per
        group are looked up in ``_recent`` (a dense group's first absent key is where a loss
        shows: a block's hash covers its whole prefix, so saved keys rarely follow one
        never saved; after a skipped or failed save they can, and a loss behind more than
        ``_LOSS_CHECKS`` such keys is caught by a later lookup, the hit ending earlier
        meanwhile). This costs well under a millisecond at 12k keys asked, against a lookup
        of tens of ms; checking every absent key would cost several ms. The keys of save
        jobs in flight are a running count (``_in_flight``), so telling in-flight keys
        from lost ones costs one probe per lost key, not a set of every pinned job's
        keys rebuilt per call.
        """
        recent, in_flight = self._recent, self._in_flight
        if not recent:
            return
        lost = {k[1] for k in answers.absent(_LOSS_CHECKS) if k in recent and k not in in_flight}
        if not lost:
            return
        first = _first_lost_unit(request.block_hashes, lost)
        hashes = [bytes(h) for h in request.block_hashes[first:]]
        self._forget(
            k
            for gid in range(len(self._mirror.geometry.groups))
            for k in zip(itertools.repeat(gid), hashes)
            if k not in in_flight
        )

    def _count_probes(self, probed: ProbedHit) -> None:
        self._stats.add("lookup_round_trips", probed.round_trips)
        self._stats.add("lookup_keys_probed", sum(probed.probed))
        if probed.fallback:
            self._stats.add("lookup_fallbacks")

    def update_state_after_alloc(
        self, request: "Request", blocks: "KVCacheBlocks", num_external_tokens: int
    ) -> None:
        """Turn the lookup's plan into a load job for the blocks just allocated."""
        req_id = request.request_id
        self._saved_upto.pop(req_id, None)  # (re)admitted: saving restarts from its new hit
        self._tails_done.discard(req_id)
        plan = self._plans.pop(req_id, None)
        self._recent_lookups.pop(
            req_id, None
        )  # admitted: the next lookup (after preemption) is fresh
        if num_external_tokens == 0 or plan is None:
            self._ledger.admitted(req_id, 0)
            return
        assert self._mirror is not None
        hit = plan.hit
        target = plan.local_tokens + num_external_tokens
        job = LoadJob(
            req_id, BlockBatch(generation=self._schema.generation), load_id=next(self._job_ids)
        )
        if target != hit.tokens:
            # Granted fewer tokens than offered: the sparse state must sit at the
            # granted boundary. Re-decide there over the answers had, asking the
            # store only for the sparse keys around the new boundary.
            try:
                probed = self._mirror.lookup(
                    request.block_hashes,
                    target,
                    self._exists,
                    plan.local_tokens,
                    known=plan.answers,
                )
            except StoreError as e:
                job.refused = (
                    f"granted {num_external_tokens} tokens; store lookup at {target} failed: {e}"
                )
                self._ledger.admitted(req_id, num_external_tokens, refused=True)
                self._post_load(job)
                return
            self._count_probes(probed)
            self._forget_missing(request, probed.answers)
            hit = probed.hit
        if hit.tokens != target:
            job.refused = (
                f"granted {num_external_tokens} tokens but the store has no state at {target}"
            )
            self._ledger.admitted(req_id, num_external_tokens, refused=True)
            self._post_load(job)
            return
        for group, entries in zip(self._mirror.geometry.groups, hit.blocks):
            table = blocks.blocks[group.group_id]
            for idx, (gid, block_hash) in entries:
                block = table[idx] if idx < len(table) else None
                if block is None or block.is_null:
                    job.refused = f"no block allocated for group {gid} position {idx}"
                    break
                if block.block_hash is not None:
                    cached = self._manager.block_pool.get_cached_block(block_hash, [gid])
                    if cached is not None and cached[0].block_id == block.block_id:
                        continue  # the local prefix cache already holds exactly this content
                    # A cached block of another prefix: writing it would corrupt that prefix.
                    job.refused = f"group {gid} position {idx} is a shared cached block"
                    break
                job.blocks.add(gid, block_hash, block.block_id)
            if job.refused:
                break
        if job.blocks:
            # Pinned until every worker's read into them has returned: a read that
            # timed out may still be writing while the request recomputes elsewhere.
            self._load_pins[job.load_id] = self._pin(job.blocks.block_ids)
            # Kept until the workers report the load (also after the request finished:
            # with policy "fail" vLLM ends it before telling the connector the load failed).
            self._load_keys[req_id] = list(zip(job.blocks.group_ids, job.blocks.hashes))
            while len(self._load_keys) > _MAX_PENDING_LOADS:  # bound: reports that never came
                self._load_keys.pop(next(iter(self._load_keys)))
        groups = [(g.block_size, g.is_mamba) for g in self._mirror.geometry.groups]
        self._ledger.admitted(
            req_id,
            num_external_tokens,
            covered_tokens(groups, job.blocks.group_ids, num_external_tokens),
            refused=job.refused is not None,
        )
        self._post_load(job)

    def _post_load(self, job: LoadJob) -> None:
        """Send a load job to the workers (refused ones too: the worker reports them failed)."""
        self._loading.add(job.req_id)
        self._loads.append(job)

    # -------------------------------------------------------------------- saves
    def build_connector_meta(self, scheduler_output: "SchedulerOutput") -> StoreConnectorMetadata:
        meta = StoreConnectorMetadata(
            loads=self._loads, block_copies=step_block_copies(scheduler_output)
        )
        self._loads = []
        state = scheduler_output.kv_connector_block_state
        if self._mirror is None or self._client is None or state is None or not self._saves:
            return meta
        if self._client.master_epoch != self._master_epoch:
            # The master lost its objects (restart): keys saved before are gone, offer them again.
            self._master_epoch = self._client.master_epoch
            self._recent.clear()
            self._stats.add("recent_saves_dropped")
        batch, states, tails = (BlockBatch(generation=self._schema.generation) for _ in range(3))
        spec_tokens = scheduler_output.scheduled_spec_decode_tokens
        for req_id, n in scheduler_output.num_scheduled_tokens.items():
            request = self._requests.get(req_id)
            block_ids = state.get_block_ids(req_id)
            if request is None or block_ids is None:
                continue
            end = request.num_computed_tokens + n - len(spec_tokens.get(req_id, ()))
            if not self._cfg.save_decode:
                end = min(end, request.num_prompt_tokens)
            self._plan_block_saves(request, block_ids, end, batch)
            self._plan_state_saves(request, states)
            if end >= request.num_prompt_tokens:
                self._plan_partial_tail_saves(request, tails)
        for req_id, offers in state.boundary_state_offloads.items():
            request = self._requests.get(req_id)
            if request is not None:
                self._plan_offered_state_saves(request, offers, states)
        for blocks, sync, snapshot in (
            (batch, False, False),
            (states, True, False),
            (tails, False, True),
        ):
            if blocks and self._within_pin_budget(blocks):
                meta.saves.append(self._pinned_job(blocks, sync, snapshot))
        return meta

    def _within_pin_budget(self, blocks: BlockBatch) -> bool:
        """May this save job pin its blocks? No (its keys forgotten, counted as skipped)
        when save jobs in flight already hold ``max_pinned_save_fraction`` of the KV cache.

        Why: a pinned block cannot be freed or handed to another request until every
        worker has written it. A slow or unreachable store node makes puts take up to
        ``timeout_s`` each while every step pins more, so with a small KV cache all of it
        ended up pinned by saves and new requests waited (an engine stall after a store
        node was killed). One job is always allowed when nothing is pinned, so saving
        never stops for good on a cache smaller than one request's blocks."""
        pinned = self._pinned_save_blocks
        budget = int(self._cfg.max_pinned_save_fraction * self._manager.block_pool.num_gpu_blocks)
        if pinned == 0 or pinned + len(blocks) <= budget:
            return True
        self._forget(
            zip(blocks.group_ids, blocks.hashes)
        )  # not saved: the next request computing it offers it again
        self._stats.add("skipped_saves", len(blocks))
        self._stats.add("pin_budget_skipped_jobs")
        return False

    def _pinned_job(self, blocks: BlockBatch, sync: bool, snapshot: bool = False) -> SaveJob:
        job = SaveJob(next(self._job_ids), blocks, sync=sync, snapshot=snapshot)
        self._pins[job.job_id] = self._pin(blocks.block_ids)
        self._pinned_save_blocks += len(blocks.block_ids)
        # Its keys, until every worker acknowledged it: a worker that could not write them
        # makes them unknown again (_forget_failed_saves).
        self._save_started(job.job_id, list(zip(blocks.group_ids, blocks.hashes)))
        return job

    def _save_started(self, job_id: int, keys: list[BlockKey]) -> None:
        """A pinned save job's keys are in flight until its last worker acknowledges it."""
        self._save_keys[job_id] = keys
        self._in_flight.update(keys)

    def _save_ended(self, job_id: int) -> None:
        """Its keys leave the in-flight count; a key another unacknowledged job also
        writes (offered again after it was forgotten) stays counted for that job."""
        in_flight = self._in_flight
        for key in self._save_keys.pop(job_id, ()):
            n = in_flight[key] - 1
            if n > 0:
                in_flight[key] = n
            else:
                in_flight.pop(key, None)

    def _pin(self, block_ids: list[int]) -> list[Any]:
        """Hold blocks (ref count + 1) so vLLM cannot hand them to another request."""
        pool = self._manager.block_pool
        pinned = [pool.blocks[b] for b in block_ids]
        pool.touch(pinned)
        return pinned

    def _plan_block_saves(
        self, request: "Request", block_ids: tuple[list[int], ...], end: int, batch: BlockBatch
    ) -> None:
        """Attention groups: blocks that are complete after this step, masked."""
        mirror = self._mirror
        groups = mirror.geometry.groups
        hashed_tokens = len(request.block_hashes) * mirror.geometry.hash_block_size
        end = min(end, hashed_tokens)
        upto = self._saved_upto.get(request.request_id)
        if upto is None:
            start_tokens = request.num_computed_tokens  # KV below it came from a hit
            upto = [start_tokens // g.block_size for g in groups]
            self._saved_upto[request.request_id] = upto
        for g in groups:
            if g.is_mamba or not g.prefix_cacheable:
                continue  # Mamba states come as exact hand-offs (boundary offloads)
            stop = end // g.block_size
            start = upto[g.group_id]
            if stop <= start:
                continue
            mask = mirror.save_mask(g.group_id, start, stop, request.num_prompt_tokens)
            table = block_ids[g.group_id]
            for i, keep in zip(range(start, stop), mask):
                if keep and i < len(table) and table[i]:
                    self._offer(
                        batch,
                        mirror.block_key(g.group_id, request.block_hashes, (i + 1) * g.block_size),
                        table[i],
                    )
            upto[g.group_id] = stop

    def _plan_state_saves(self, request: "Request", batch: BlockBatch) -> None:
        """Mamba 'align' groups: every state block vLLM has keyed for this prompt.

        Read off the group's block table because vLLM's boundary hand-offs do not
        include the prompt checkpoint a backend exports internally (the state
        most worth saving). Only prompt boundaries are saved: during decode the
        running state block is mutated in place.
        """
        coordinator = self._manager.coordinator
        for g in self._mirror.geometry.groups:
            if not (g.is_mamba and g.prefix_cacheable):
                continue
            table = coordinator.single_type_managers[g.group_id].req_to_blocks.get(
                request.request_id, ()
            )
            for block in table:
                if block.is_null or block.block_hash is None:
                    continue
                tokens = block.block_hash_num_tokens
                if tokens is None or tokens > request.num_prompt_tokens:
                    continue
                self._offer(
                    batch, (g.group_id, bytes(get_block_hash(block.block_hash))), block.block_id
                )

    def _plan_partial_tail_saves(self, request: "Request", batch: BlockBatch) -> None:
        """Fine-grained hits: attention blocks vLLM keyed at a sub-block prompt checkpoint.

        With ``--prefix-match-unit`` vLLM keys the block holding the prompt's last
        reachable hash unit by that unit; storing it lets the next turn resume
        there instead of a whole block earlier. Positions up to the key's
        boundary never change, so saving the block later is safe. Once per request.
        """
        if not self._mirror.geometry.fine_grained or request.request_id in self._tails_done:
            return
        self._tails_done.add(request.request_id)
        coordinator = self._manager.coordinator
        for g in self._mirror.geometry.groups:
            if g.is_mamba or not g.prefix_cacheable:
                continue
            table = coordinator.single_type_managers[g.group_id].req_to_blocks.get(
                request.request_id, ()
            )
            last = (request.num_prompt_tokens - 1) // g.block_size
            for block in table[max(0, last - 1) : last + 1]:
                tokens = block.block_hash_num_tokens
                if (
                    block.is_null
                    or block.block_hash is None
                    or tokens is None
                    or tokens % g.block_size == 0
                ):
                    continue
                self._offer(
                    batch, (g.group_id, bytes(get_block_hash(block.block_hash))), block.block_id
                )

    def _plan_offered_state_saves(
        self, request: "Request", offers: list[tuple[int, int, int]], batch: BlockBatch
    ) -> None:
        """vLLM's exact boundary hand-offs (same filter as the table scan)."""
        mirror = self._mirror
        unit = mirror.geometry.hash_block_size
        hashed_tokens = len(request.block_hashes) * unit
        for gid, block_id, tokens in offers:
            if (
                tokens % unit
                or tokens > min(hashed_tokens, request.num_prompt_tokens)
                or not block_id
            ):
                continue
            self._offer(batch, mirror.block_key(gid, request.block_hashes, tokens), block_id)

    def _offer(self, batch: BlockBatch, key: BlockKey, block_id: int) -> None:
        if key in self._recent:
            self._recent.move_to_end(key)
            return
        self._recent[key] = None
        if len(self._recent) > _RECENT_SAVES:
            self._recent.popitem(last=False)
        batch.add(key[0], key[1], block_id)

    def update_connector_output(self, output: "KVConnectorOutput") -> None:
        """Release pins of save jobs every worker has finished; remember failed loads."""
        failed = output.failed_recving or set()
        # Its own loads owe one deferral; another connector's failed load (a P/D READ under
        # MultiConnector) owes none, but the store then offers that request no load of its
        # copy either: vLLM would reserve the request's prompt twice and can stop admitting
        # anything (connector/failed_loads.py). Requests not finished yet only; marked before
        # the loop below pops _load_keys.
        self._failed_loads.mark(
            failed,
            lambda r: r in self._loading and r in self._requests,
            self._requests.__contains__,
        )
        for r in output.finished_recving or ():
            self._loading.discard(r)
            self._ledger.load_done(r, r not in failed)  # a set over workers: once per request
            keys = self._load_keys.pop(r, ())
            if r in failed:
                # The objects could not be loaded (missing, corrupt and removed, timed out):
                # the request recomputes those blocks; they must be saved again, not skipped
                # as "saved recently".
                self._forget(keys)
        meta = output.kv_connector_worker_meta
        if not isinstance(meta, StoreWorkerMetadata):
            return
        self._forget_failed_saves(meta.failed_saves)
        for job_id, unpinned in self._release(meta.finished_saves, self._acks, self._pins):
            self._save_ended(job_id)  # a save job ends here: keys and pins together
            self._pinned_save_blocks -= unpinned
        self._release(meta.released_loads, self._load_acks, self._load_pins)

    def _forget_failed_saves(self, failed: Counter) -> None:
        """A save job some worker skipped or could not finish: its keys leave ``_recent``.

        Why: ``_recent`` stops the same block from being offered again while it is
        believed saved; a skipped save (queue full, step budget) or a failed put left
        the block out of the store for as long as the key stayed there (up to 131,072
        saves), so later requests never saved it and missed. Now the next request that
        computes the block offers it again (a put of an object that landed after all
        answers 0 and keeps it)."""
        for job_id in failed:
            self._forget(self._save_keys.get(job_id, ()))

    def _forget(self, keys: Iterable[BlockKey]) -> None:
        """These keys are not (or no longer) in the store: offer them again when computed."""
        forgotten = 0
        for key in keys:
            if key in self._recent:
                del self._recent[key]
                forgotten += 1
        if forgotten:
            self._stats.add("recent_saves_forgotten", forgotten)

    def _release(
        self, reported: Counter, acks: Counter, pins: dict[int, list[Any]]
    ) -> list[tuple[int, int]]:
        """Unpin the blocks of every job all workers have reported done; returns those
        jobs with how many blocks each unpinned."""
        done = []
        for job_id, n in reported.items():
            acks[job_id] += n
            if acks[job_id] >= self._world_size:
                del acks[job_id]
                pinned = pins.pop(job_id, None)
                done.append((job_id, len(pinned or ())))
                if pinned is not None and self._manager is not None:
                    self._manager.block_pool.free_blocks(pinned)
        return done

    def reset(self) -> None:
        """Forget everything the store holds for this engine: move to the next key generation
        (``KeySchema.generation``). Objects of earlier generations are never looked up or loaded
        again (jobs planned before carry their own generation, so a save still in flight lands
        under the old keys), and every block is offered for saving again."""
        self._schema = self._schema.at_generation(self._schema.generation + 1)
        self._rank_keys = AllRankKeys(self._schema)
        self._recent.clear()
        self._recent_lookups.clear()
        logger.info("connector reset: store keys move to generation %d", self._schema.generation)

    def has_pending_saves(self) -> bool:
        return bool(self._pins or self._load_pins)

    def has_pin_only_blocks(self) -> bool:
        """Is some block held by this connector's pins alone? Then a free is really pending:
        it comes when those jobs end. A pinned block that a request also holds frees nothing
        then, so vLLM should preempt rather than wait for it (``has_pending_block_frees``)."""
        pins: Counter[int] = Counter()
        for pinned in itertools.chain(self._pins.values(), self._load_pins.values()):
            pins.update(block.block_id for block in pinned)
        pool = self._manager.block_pool if self._manager is not None else None
        return pool is not None and any(pool.blocks[b].ref_cnt <= n for b, n in pins.items())

    def request_finished(self, request: "Request") -> tuple[bool, dict[str, Any] | None]:
        req_id = request.request_id
        self._requests.pop(req_id, None)
        self._plans.pop(req_id, None)
        self._saved_upto.pop(req_id, None)
        self._tails_done.discard(req_id)
        self._failed_loads.forget(req_id)
        self._loading.discard(req_id)
        self._recent_lookups.pop(req_id, None)
        self._ledger.forget(req_id)
        return False, None

    def take_stats(self) -> HybridStoreStats | None:
        return self._stats.take()
