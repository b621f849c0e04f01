"""Worker side of HybridStoreConnector: batched, asynchronous block moves.

On the CPU engine the KV cache is host memory, so its one allocation is
registered with the store client and every block moves zero-copy: batched
``batch_put_from_multi_buffers`` / ``batch_get_into_multi_buffers`` calls, each
object gathered from its layers' regions in C++. A job is split into sub-batches
(``plan_spans``) so that the trailer's hash of one sub-batch runs while another is
in its store call (a separate pass over every byte would add up to a third of the
job; see ``_move_parts``). Moves run on background threads (a small load pool, one
save thread) so the forward pass never waits for the store; results are reported
through vLLM's per-request channels: ``finished_recving``/``failed_recving`` (failed
loads recompute) and worker metadata (finished saves release the scheduler's pins).

Faults: every store call goes through the backend's bounded call
(``timeout_s``, or less where a deadline is nearer), so a call stuck on a hung
master or segment owner counts in the backend's CLIENT_STUCK gate and later calls
fail fast instead of piling up. Loads run on a small pool, each request under its
own deadline (``load_deadline_s`` from when the step handed it over), so a request
whose objects sit on a hung node does not delay another's. Synchronous state saves
share ONE budget per step (``step_save_budget_s``): a dead store costs the forward
pass at most that, whatever the number of groups or batches. Asynchronous saves
queue up to ``save_queue_blocks`` blocks; a job beyond that is skipped at once
(counted as ``skipped_saves``) so its source blocks are unpinned instead of held.

Snapshots: a save job flagged ``snapshot`` (a partial tail: the block decode keeps
writing beyond the key's boundary) is first copied into host staging slots, and
the trailer's check and the put are computed from that copy, bytes that can no
longer change. Zero-copy from live KV would checksum one version and store
another, an object that then fails verification for as long as it is stored.
"""

from __future__ import annotations

import queue
import threading
import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorTransferResults
from vllm.v1.kv_cache_interface import KVCacheConfig

from hybridkv.connector.block_layout import KVLayout
from hybridkv.connector.log_once import warn_once
from hybridkv.connector.store_auth import StoreSecret
from hybridkv.connector.store_config import StoreConnectorConfig
from hybridkv.connector.store_metadata import (
    BlockBatch,
    LoadJob,
    SaveJob,
    StoreConnectorMetadata,
    StoreWorkerMetadata,
)
from hybridkv.connector.store_staging import (
    StagerPool,
    build_stager_pools,
    device_fence,
    device_staging_bytes,
    needs_staging,
    staging_budget_problem,
)
from hybridkv.connector.store_stats import HybridStoreStats
from hybridkv.store import malloc_trim
from hybridkv.store.call_pool import CallPool
from hybridkv.store.cpu_affinity import unpinned
from hybridkv.store.keys import KeySchema
from hybridkv.store.logs import get_logger
from hybridkv.store.mooncake_backend import (
    CALL_TIMEOUT,
    INTERNAL_ERROR,
    OBJECT_NOT_FOUND,
    MooncakeBackend,
    StoreError,
    code_name,
)
from hybridkv.store.object_trailer import (
    TRAILER_BYTES,
    TrailerArena,
    block_format_code,
    checksum_parts,
    must_remove,
    size_verdict,
    tag_kind,
)

logger = get_logger(__name__, "store")

_MIN_CALL_S = 0.01  # less time left than this before a deadline: do not start the call
_SNAPSHOT_SLOTS = 4  # objects per snapshot buffer (partial tails: about one per group and request)


_UNCHECKED = "unchecked"  # a load's object whose trailer has not been checked (yet)


def plan_spans(
    object_bytes: list[int],
    max_objects: int,
    first_bytes: int,
    max_bytes: int,
    ramp_down: bool = False,
) -> list[tuple[int, int]]:
    """Consecutive [lo, hi) sub-batches of a job's objects, one store call each.

    Why a ramp: a save must hash sub-batch 0 before its put can start, and a load can
    verify its last sub-batch only after the last get; every other hash runs during a
    call. So sizes double from ``first_bytes`` up to ``max_bytes`` (at least one object,
    at most ``max_objects`` per call; ``ramp_down``: mirrored, the last one smallest).
    ``first_bytes`` <= 0: plain batches of ``max_objects`` (no overlap).
    """
    n = len(object_bytes)
    sizes = object_bytes[::-1] if ramp_down else object_bytes
    spans: list[tuple[int, int]] = []
    lo, target = 0, first_bytes
    while lo < n:
        hi, acc = lo, 0
        while (
            hi < n
            and hi - lo < max_objects
            and (first_bytes <= 0 or hi == lo or acc + sizes[hi] <= target)
        ):
            acc += sizes[hi]
            hi += 1
        spans.append((lo, hi))
        lo, target = hi, min(2 * target, max_bytes)
    if ramp_down:
        spans = [(n - hi, n - lo) for lo, hi in reversed(spans)]
    return spans


class _SpanRun:
    """One job's objects, its sub-batches and what each has become (one job thread owns it)."""

    def __init__(
        self,
        keys: list[str],
        addrs: list[list[int]],
        sizes: list[list[int]],
        expect: list[int],
        spans: list[tuple[int, int]],
    ) -> None:
        self.keys, self.addrs, self.sizes, self.expect, self.spans = (
            keys,
            addrs,
            sizes,
            expect,
            spans,
        )
        self.arenas: dict[
            int, tuple[TrailerArena, "Future[Any] | None"]
        ] = {}  # span -> (arena, call still running)
        self.codes: list[int] = [0] * len(keys)
        self.verdicts: list[str | None] = [_UNCHECKED] * len(keys)
        self.pending: "Future[Any] | None" = (
            None  # an abandoned call (its span's buffers are not free)
        )
        self._span_index = [i for i, (lo, hi) in enumerate(spans) for _ in range(lo, hi)]

    def arena(self, i: int, pool: CallPool[TrailerArena]) -> TrailerArena:
        if i not in self.arenas:
            self.arenas[i] = (pool.acquire(), None)
        return self.arenas[i][0]

    def span_of(self, j: int) -> int:
        return self._span_index[j]


@dataclass
class _LoadResult:
    req_id: str
    ok: bool


@dataclass(frozen=True)
class WorkerLimits:
    """How much a slow or dead store may cost; defaults derive from ``timeout_s``.

    Read from the connector config when it declares the same names (so adding a
    config key needs no change here), else the defaults below.
    """

    load_workers: int = 4  # loads in flight at once (each request has its own deadline)
    load_deadline_s: float = 5.0  # one request's whole load, queueing included
    step_save_budget_s: float = 5.0  # all synchronous saves of one step together
    save_queue_blocks: int = 1024  # async save blocks queued or in flight; beyond: skipped
    # Sub-batches whose trailer hash overlaps the store call (see ``plan_spans``): the
    # first (save) / last (load) one is hashed exposed, so it starts small and doubles.
    # 0: one call per max_batch_blocks, hashed before the put / after the get (serial).
    overlap_first_bytes: int = 8 << 20
    overlap_max_bytes: int = 128 << 20

    @classmethod
    def from_config(cls, cfg: StoreConnectorConfig) -> "WorkerLimits":
        d = {
            "load_deadline_s": cfg.timeout_s,
            "step_save_budget_s": cfg.timeout_s,
            "save_queue_blocks": 4 * cfg.max_batch_blocks,
        }
        return cls(
            **{f: getattr(cfg, f, d.get(f, getattr(cls, f))) for f in cls.__dataclass_fields__}
        )


class _JobThread:
    """Daemon threads draining a queue of callables (one thread: ordered; never blocks the caller)."""

    def __init__(self, name: str, threads: int = 1) -> None:
        self._q: queue.Queue[Callable[[], None] | None] = queue.Queue()
        self._idle = threading.Event()
        self._idle.set()
        self._pending = 0
        self._lock = threading.Lock()
        self._threads = [
            threading.Thread(target=self._run, name=f"{name}-{i}", daemon=True)
            for i in range(max(1, threads))
        ]
        for t in self._threads:
            t.start()

    def submit(self, fn: Callable[[], None]) -> None:
        with self._lock:
            self._pending += 1
            self._idle.clear()
        self._q.put(fn)

    def _run(self) -> None:
        while (fn := self._q.get()) is not None:
            try:
                fn()
            except Exception:  # noqa: BLE001 - a job failure is reported by the job itself
                logger.exception("job crashed")
            finally:
                with self._lock:
                    self._pending -= 1
                    if not self._pending:
                        self._idle.set()

    def wait_idle(self, timeout_s: float) -> bool:
        return self._idle.wait(timeout_s)

    def stop(self) -> None:
        for _ in self._threads:
            self._q.put(None)


def layout_format_code(layout: KVLayout | None) -> int:
    """The trailer's ``block_format_code`` of a worker's KV cache: every group's block byte order."""
    groups = layout.groups if layout is not None else ()
    return block_format_code(
        [f"{g.group_id}:{','.join(g.block_formats)}" for g in groups if g is not None]
    )


class StoreWorker:
    """One per worker process (rank)."""

    def __init__(
        self,
        cfg: StoreConnectorConfig,
        kv_cache_config: KVCacheConfig,
        schema: KeySchema,
        client: MooncakeBackend,
        limits: WorkerLimits | None = None,
        secret: StoreSecret | None = None,
        cache_config: Any = None,
    ) -> None:
        """``secret``: the deployment secret the connector already loaded for the keys (loaded
        from ``cfg`` when not given), so the MAC and the key prefix come from one read.
        ``cache_config``: vLLM's, whose memory budget a GPU KV cache's staging must fit
        beside (None: not checked)."""
        self._cfg = cfg
        self._cache_config = cache_config
        self._limits = limits or WorkerLimits.from_config(cfg)
        self._kv_cache_config = kv_cache_config
        self._schema = schema
        self._client = client
        self._layout: KVLayout | None = None
        self._loads = _JobThread("hybridkv-store-load", self._limits.load_workers)
        self._saves = _JobThread("hybridkv-store-save")
        self._queued_save_blocks = 0
        self._lock = threading.Lock()
        self._done_loads: list[_LoadResult] = []
        self._done_saves: Counter[int] = Counter()
        self._failed_saves: Counter[int] = Counter()  # done, but not every object written
        self._released_loads: Counter[int] = Counter()
        self._stats = HybridStoreStats()
        self._mac = (
            secret or StoreSecret.load(cfg)
        ).object_mac()  # None: XXH3 trailers (no secret, logged)
        self._arenas: CallPool[TrailerArena] = CallPool(
            lambda: TrailerArena(
                cfg.max_batch_blocks, client.register, tag_kind(self._mac), self.format_code
            )
        )
        self._staging: dict[int, dict[str, StagerPool]] | None = None
        self._snapshots: dict[int, dict[str, StagerPool]] | None = None  # built on first use
        self._kv_caches: dict[str, torch.Tensor] = {}
        self._on_cuda = False
        self._trimmer = malloc_trim.start(cfg.malloc_trim_interval_s)

    @property
    def format_code(self) -> int:
        """The trailer's code of this worker's block byte order (``layout_format_code``)."""
        return layout_format_code(self._layout)

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self._layout = KVLayout.from_kv_caches(self._kv_cache_config, kv_caches)
        self._kv_caches = dict(kv_caches)
        self._on_cuda = any(t.device.type == "cuda" for t in kv_caches.values())
        if needs_staging(kv_caches, self._cfg.staging):
            if self._on_cuda:
                self._check_device_budget(kv_caches)
            self._staging = build_stager_pools(
                self._layout,
                kv_caches,
                self._cfg.max_batch_blocks,
                self._cfg.staging_buffer_size,
                self._client.register,
            )
        else:
            for base, nbytes in self._layout.allocations:
                self._client.register(base, nbytes)
        logger.info(
            "worker: %d group(s), object bytes %s, %s",
            len(self._layout.groups),
            [g.object_bytes if g else 0 for g in self._layout.groups],
            f"staged through host buffers ({ {g: p['save'].slots for g, p in self._staging.items()} } slots)"
            if self._staging is not None
            else f"zero-copy from {len(self._layout.allocations)} registered allocation(s)",
        )

    def _check_device_budget(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Refuse to start when the device staging does not fit outside vLLM's budget."""
        assert self._layout is not None
        if self._cache_config is None:
            return
        device = next(t.device for t in kv_caches.values() if t.device.type == "cuda")
        needed = device_staging_bytes(
            [g.object_bytes for g in self._layout.groups if g is not None],
            self._cfg.max_batch_blocks,
            self._cfg.staging_buffer_size,
            self._limits.load_workers + 1,
        )
        total = torch.cuda.get_device_properties(device).total_memory
        problem = staging_budget_problem(self._cache_config, total, needed)
        if problem is not None:
            raise RuntimeError(problem)

    # ------------------------------------------------------------------- loads
    def start_load_kv(self, meta: StoreConnectorMetadata) -> None:
        deadline = time.monotonic() + self._limits.load_deadline_s
        for job in meta.loads:
            self._loads.submit(lambda job=job: self._run_load(job, deadline))

    def _run_load(self, job: LoadJob, deadline: float | None = None) -> None:
        ok, pending = False, None
        try:
            if job.refused:
                self._fail("load_refused", f"request {job.req_id}: {job.refused}")
            elif self._layout is None:
                self._fail("not_registered", "load before register_kv_caches")
            else:
                ok, pending = self._move(job.blocks, load=True, deadline=deadline)
        finally:
            if not ok:  # per worker (x TP); the request's one count is the scheduler's ledger
                self._stat("rank_failed_loads")
            with self._lock:
                self._done_loads.append(_LoadResult(job.req_id, ok))
            # The target blocks stay pinned by the scheduler until no read into them runs.
            self._after(pending, lambda: self._released(job.load_id))

    # ------------------------------------------------------------------- saves
    def wait_for_save(self, meta: StoreConnectorMetadata) -> None:
        """Queue this step's saves; the forward that wrote the blocks has finished.

        Synchronous jobs (state blocks the next forward may overwrite) run here under
        ONE deadline for the step; asynchronous ones are queued while the queue has room.
        """
        fence = device_fence(self._on_cuda) if meta.saves else None
        step_deadline = time.monotonic() + self._limits.step_save_budget_s
        for job in meta.saves:
            if job.sync:
                if step_deadline - time.monotonic() < _MIN_CALL_S:
                    self._skip_save(job, "save_step_budget")
                else:
                    self._run_save(job, fence, step_deadline)
            elif not self._reserve_save(len(job.blocks)):
                self._skip_save(job, "save_queue_full")
            else:
                self._saves.submit(lambda job=job: self._run_queued_save(job, fence))

    def _reserve_save(self, n: int) -> bool:
        with self._lock:
            # An empty queue takes any job (a long prompt may exceed the bound alone):
            # queued blocks stay below save_queue_blocks + one job.
            if (
                self._queued_save_blocks
                and self._queued_save_blocks + n > self._limits.save_queue_blocks
            ):
                return False
            self._queued_save_blocks += n
            return True

    def _run_queued_save(self, job: SaveJob, fence: "torch.cuda.Event | None") -> None:
        try:
            self._run_save(job, fence)
        finally:
            with self._lock:
                self._queued_save_blocks -= len(job.blocks)

    def _skip_save(self, job: SaveJob, cause: str) -> None:
        """Not written (store too slow for the budget, or queue full): unpin now, count it."""
        self._stat("skipped_saves", len(job.blocks))
        self._stat(f"fail.{cause}", len(job.blocks))
        warn_once(
            logger,
            cause,
            "skipped saving %d block(s): %s",
            len(job.blocks),
            "this step's synchronous save budget is spent"
            if cause == "save_step_budget"
            else f"the save queue holds {self._limits.save_queue_blocks} blocks already",
        )
        self._ack_save(job.job_id, ok=False)

    def _run_save(
        self, job: SaveJob, fence: "torch.cuda.Event | None" = None, deadline: float | None = None
    ) -> None:
        pending, ok = None, False
        try:
            if fence is not None:
                fence.synchronize()  # the forward that wrote these blocks has finished on the device
            if self._layout is not None:
                snapshot = job.snapshot
                ok, pending = self._move(
                    job.blocks, load=False, deadline=deadline, snapshot=snapshot
                )
                if ok:
                    self._log_keys(job.blocks)
        finally:
            # Acknowledge (unpin the source blocks) only once no write from them runs.
            self._after(pending, lambda: self._ack_save(job.job_id, ok))

    def _ack_save(self, job_id: int, ok: bool = True) -> None:
        with self._lock:
            self._done_saves[job_id] += 1
            if not ok:
                self._failed_saves[job_id] += 1

    def _released(self, load_id: int) -> None:
        with self._lock:
            self._released_loads[load_id] += 1

    @staticmethod
    def _after(pending: "Future[Any] | None", fn: Callable[[], None]) -> None:
        """Run ``fn`` now, or when an abandoned store call has really returned."""
        if pending is None or pending.done():
            fn()
        else:
            pending.add_done_callback(lambda _f: fn())

    def _bounded_call(
        self,
        op: str,
        fn: Callable[..., list[int]],
        keys: list[str],
        addrs: list,
        sizes: list,
        deadline: float | None,
        side: Callable[[Callable[[], bool]], None] | None = None,
    ) -> tuple[list[int] | None, StoreError | None, "Future[Any] | None"]:
        """One store call through the backend's bounded call, WITHOUT letting it outlive its buffers.

        The backend waits at most ``timeout_s`` (or until ``deadline``) and counts an
        abandoned call in its CLIENT_STUCK gate. A Mooncake call cannot be cancelled:
        after a timeout it may still read or write the KV blocks, so the returned
        future (None when no call is left running) tells when it really ended; the
        blocks and buffers stay pinned until then and are never reused under it.
        ``side`` runs on this thread while the call is in flight (the next sub-batch's hash).
        """
        timeout = self._cfg.timeout_s
        if deadline is not None:
            timeout = min(timeout, deadline - time.monotonic())
            if timeout < _MIN_CALL_S:
                return (
                    None,
                    StoreError(op, CALL_TIMEOUT, "the request's deadline passed before the call"),
                    None,
                )
        try:
            return fn(keys, addrs, sizes, timeout_s=timeout, while_waiting=side), None, None
        except StoreError as e:
            return None, e, e.pending
        except Exception as e:  # noqa: BLE001 - surfaced as a store failure
            return None, StoreError(op, INTERNAL_ERROR, repr(e)), None

    # ---------------------------------------------------------------- transfer
    def _move(
        self, blocks: BlockBatch, load: bool, deadline: float | None = None, snapshot: bool = False
    ) -> tuple[bool, "Future[Any] | None"]:
        """Move every object of ``blocks``, each checked by its trailer.

        Returns (all moved, pending): ``pending`` (not None only when the transfer
        stopped early) is set when the last call issued has really returned.
        """
        assert self._layout is not None
        by_group: dict[int, list[int]] = {}
        for i, gid in enumerate(blocks.group_ids):
            if self._layout.groups[gid] is not None:  # else this rank holds no layer of the group
                by_group.setdefault(gid, []).append(i)
        if self._staging is not None:
            return self._move_staged(blocks, by_group, load, deadline, self._staging)
        if snapshot and not load:  # staged saves are snapshots already
            self._stat("snapshot_blocks", len(blocks))
            return self._move_staged(blocks, by_group, load, deadline, self._snapshot_pools())
        keys, addrs, sizes, expect = [], [], [], []
        schema = self._schema.at_generation(blocks.generation)
        for gid, idxs in by_group.items():
            layout = self._layout.groups[gid]
            a, s = layout.object_regions([blocks.block_ids[i] for i in idxs])
            keys.extend(schema.key(gid, blocks.hashes[i]) for i in idxs)
            addrs.extend(a)
            sizes.extend(s)
            expect.extend([layout.object_bytes] * len(idxs))
        return self._move_parts(keys, addrs, sizes, expect, load, deadline)

    def _snapshot_pools(self) -> dict[int, dict[str, StagerPool]]:
        """Host slots for snapshot saves of a zero-copy worker (only the save thread builds them)."""
        if self._snapshots is None:
            assert self._layout is not None
            largest = max(g.object_bytes for g in self._layout.groups if g is not None)
            with unpinned():
                self._snapshots = build_stager_pools(
                    self._layout,
                    self._kv_caches,
                    _SNAPSHOT_SLOTS,
                    _SNAPSHOT_SLOTS * largest,
                    self._client.register,
                )
        return self._snapshots

    def _move_staged(
        self,
        blocks: BlockBatch,
        by_group: dict[int, list[int]],
        load: bool,
        deadline: float | None,
        pools: dict[int, dict[str, StagerPool]],
    ) -> tuple[bool, "Future[Any] | None"]:
        """Through host staging slots: gather then put (save), get then scatter (load)."""
        all_ok = True
        schema = self._schema.at_generation(blocks.generation)
        for gid, idxs in by_group.items():
            pool = pools[gid]["load" if load else "save"]
            for lo in range(0, len(idxs), pool.slots):
                part = idxs[lo : lo + pool.slots]
                ids = [blocks.block_ids[i] for i in part]
                keys = [schema.key(gid, blocks.hashes[i]) for i in part]
                stager = pool.acquire()
                pending: "Future[Any] | None" = None
                try:
                    if not load:
                        stager.gather(ids)
                    slots = stager.slot_addresses(len(ids))
                    ok, pending = self._move_parts(
                        keys,
                        [[a] for a, _ in slots],
                        [[n] for _, n in slots],
                        [stager.slot_bytes] * len(ids),
                        load,
                        deadline,
                    )
                    if load and ok:
                        stager.scatter(
                            ids
                        )  # verified bytes only: a failed load leaves the cache untouched
                finally:
                    self._after(pending, lambda pool=pool, stager=stager: pool.release(stager))
                all_ok = all_ok and ok
                if (load and not ok) or pending is not None:
                    return False, pending
        return all_ok, None

    def _move_parts(
        self,
        keys: list[str],
        addrs: list[list[int]],
        sizes: list[list[int]],
        expect: list[int],
        load: bool,
        deadline: float | None = None,
    ) -> tuple[bool, "Future[Any] | None"]:
        """Objects given as host regions, in sub-batches whose trailer work overlaps the calls.

        A save hashes sub-batch i+1 while sub-batch i is in the put; a load verifies
        sub-batch i-1 while sub-batch i is in the get (the binding and XXH3/BLAKE3 all
        release the GIL: the hash runs on this thread, the copy on the call's). Only the
        first (save) or last (load) sub-batch's hash is exposed, and ``overlap_first_bytes``
        keeps that one small. Each object is still checked against its own trailer exactly as
        a serial pass would; a load reports success only once every object passed.
        """
        # Loads plan their sub-batches (ramped down: the last one is verified exposed);
        # saves size theirs as they go (``_save_spans``).
        spans = (
            plan_spans(
                expect,
                self._cfg.max_batch_blocks,
                self._limits.overlap_first_bytes,
                self._limits.overlap_max_bytes,
                ramp_down=True,
            )
            if load
            else []
        )
        overlap = self._limits.overlap_first_bytes > 0 and (len(spans) > 1 or not load)
        run = _SpanRun(keys, addrs, sizes, expect, spans)
        try:
            return (self._load_spans if load else self._save_spans)(run, overlap, deadline)
        finally:
            # An arena is reused only once no store call can still touch it.
            for arena, done in run.arenas.values():
                self._after(done, lambda arena=arena: self._arenas.release(arena))

    def _span_call(
        self,
        run: "_SpanRun",
        i: int,
        load: bool,
        deadline: float | None,
        side: Callable[[Callable[[], bool]], None] | None,
    ) -> tuple[list[int] | None, StoreError | None]:
        """The store call of sub-batch ``i`` (objects + their trailer slots), ``side`` run meanwhile."""
        lo, hi = run.spans[i]
        arena = run.arena(i, self._arenas)
        part_addrs = [run.addrs[j] + [arena.addr(j - lo)] for j in range(lo, hi)]
        part_sizes = [run.sizes[j] + [TRAILER_BYTES] for j in range(lo, hi)]
        op = "get_into_parts" if load else "put_from_parts"
        fn = self._client.get_into_parts if load else self._client.put_from_parts
        t0 = time.perf_counter()
        codes, err, done = self._bounded_call(
            op, fn, run.keys[lo:hi], part_addrs, part_sizes, deadline, side
        )
        run.arenas[i] = (arena, done)
        if err is not None:
            run.pending = done
            self._fail(
                f"{'load' if load else 'save'}_{code_name(err.code).lower()}",
                str(err),
                n=hi - lo,
                load=load,
            )
            return None, err
        dt = time.perf_counter() - t0
        self._stat("load_seconds" if load else "save_seconds", dt)
        self._stat(
            "load_parts" if load else "save_parts", sum(len(run.addrs[j]) for j in range(lo, hi))
        )
        with self._lock:
            self._stats.add_latency("load" if load else "save", dt)
        return codes, None

    def _seal_from(
        self,
        run: "_SpanRun",
        i: int,
        lo: int,
        stop: int,
        budget: int | None,
        call_done: Callable[[], bool] | None = None,
    ) -> int:
        """Write the trailers of objects ``lo, lo+1, ...`` into sub-batch ``i``'s arena (slot
        ``j - lo``) until ``stop``, ``budget`` bytes, or ``call_done()``; at least one. Returns
        the end (exclusive): sub-batch ``i`` is then ``[lo, end)``."""
        arena = run.arena(i, self._arenas)
        j, acc = lo, 0
        while j < stop and (
            j == lo
            or (
                (budget is None or acc + run.expect[j] <= budget)
                and not (call_done is not None and call_done())
            )
        ):
            arena.write(j - lo, checksum_parts(run.keys[j], run.addrs[j], run.sizes[j], self._mac))
            acc += run.expect[j]
            j += 1
        return j

    def _save_spans(
        self, run: "_SpanRun", overlap: bool, deadline: float | None
    ) -> tuple[bool, "Future[Any] | None"]:
        """Saves size their sub-batches as they go: while sub-batch i is in the put, the
        objects after it are hashed until the put returns (or a sub-batch's limit), and
        exactly those form sub-batch i+1. The put never waits for a hash it could do
        without, and a hash slower than the put just makes the sub-batches smaller. Only
        sub-batch 0 (``overlap_first_bytes``) is hashed before any put."""
        n, cap = len(run.keys), self._cfg.max_batch_blocks
        limits = self._limits
        all_ok = True
        lo, hi = (
            0,
            self._seal_from(
                run, 0, 0, min(n, cap), limits.overlap_first_bytes if overlap else None
            ),
        )
        while lo < n:
            i = len(run.spans)
            run.spans.append((lo, hi))
            upcoming = [hi]  # where sub-batch i+1 ends, once its objects are sealed

            def side(call_done: Callable[[], bool], i: int = i + 1, lo: int = hi) -> None:
                upcoming[0] = self._seal_from(
                    run, i, lo, min(n, lo + cap), limits.overlap_max_bytes, call_done
                )

            if overlap and hi < n:
                run.arena(
                    i + 1, self._arenas
                )  # acquired here, not in the side work (it may register)
            codes, err = self._span_call(
                run, i, False, deadline, side if overlap and hi < n else None
            )
            if err is not None:  # the store is unwell: stop; unpin when the call returns
                return False, run.pending
            moved = moved_bytes = 0
            for j, code in zip(range(lo, hi), codes):
                if code == 0:
                    moved += 1
                    moved_bytes += run.expect[j]
                else:
                    all_ok = False
                    self._fail(
                        f"save_{code_name(code).lower()}",
                        f"{run.keys[j]}: code {code}, expected 0",
                        load=False,
                    )
            self._stat("saved_blocks", moved)
            self._stat("saved_bytes", moved_bytes)
            lo = hi
            if lo < n:  # serially: the next plain batch, hashed now
                hi = (
                    upcoming[0]
                    if overlap
                    else self._seal_from(run, i + 1, lo, min(n, lo + cap), None)
                )
        return all_ok, None

    def _verdict(self, run: "_SpanRun", j: int, arena: TrailerArena, lo: int) -> str | None:
        """Check object ``j`` (slot ``j - lo`` of ``arena``) against its trailer; kept in ``run``."""
        bad = run.verdicts[j] = arena.verdict(
            j - lo, checksum_parts(run.keys[j], run.addrs[j], run.sizes[j], self._mac)
        )
        return bad

    def _check_span(self, run: "_SpanRun", i: int) -> None:
        """Verdicts of sub-batch ``i``'s objects that arrived whole, up to the first refused one."""
        lo, hi = run.spans[i]
        arena = run.arenas[i][0]
        for j in range(lo, hi):
            if run.codes[j] != run.expect[j] + TRAILER_BYTES:
                return  # accounted (and the load refused) without a check
            if self._verdict(run, j, arena, lo) is not None:
                return  # the request recomputes; its other objects need no checking

    def _load_spans(
        self, run: "_SpanRun", overlap: bool, deadline: float | None
    ) -> tuple[bool, "Future[Any] | None"]:
        fetched = 0  # objects whose call answered
        for i, (lo, hi) in enumerate(run.spans):
            run.arena(i, self._arenas).clear(hi - lo)
            side = None
            if overlap and i > 0:

                def side(call_done: Callable[[], bool], i: int = i - 1) -> None:
                    self._check_span(run, i)

            codes, err = self._span_call(run, i, True, deadline, side)
            if err is not None:
                break  # the request fails; what arrived before is still accounted (as one call was)
            run.codes[lo:hi] = codes
            fetched = hi
            if not overlap:
                self._check_span(run, i)
            # Stop at the first refused object: the request recomputes.
            if any(c != run.expect[j] + TRAILER_BYTES for j, c in zip(range(lo, hi), codes)) or any(
                v is not None and v != _UNCHECKED
                for v in run.verdicts[run.spans[max(0, i - 1)][0] : hi]
            ):
                break
        moved = moved_bytes = 0
        all_ok = True
        for j in range(fetched):
            code, want = run.codes[j], run.expect[j]
            total = want + TRAILER_BYTES
            if code == OBJECT_NOT_FOUND:
                cause = "load_evicted"
            elif code >= 0 and code != total:
                cause = f"load_{size_verdict(code, want)}"  # short, or another trailer format
            elif code < 0:
                cause = f"load_{code_name(code).lower()}"
            else:
                bad = run.verdicts[j]
                if bad == _UNCHECKED:  # the last sub-batch (exposed: ramped small), or one left
                    # unchecked because the load stopped at a refused object after it
                    i = run.span_of(j)
                    bad = self._verdict(run, j, run.arenas[i][0], run.spans[i][0])
                cause = (
                    None if bad is None else f"load_{bad}"
                )  # corrupt, unauthenticated, format_mismatch
                if must_remove(bad):  # wrong for every reader: not offered again
                    self._remove_refused(run.keys[j])
            if cause is None:
                moved += 1
                moved_bytes += want
                continue
            all_ok = False
            self._fail(cause, f"{run.keys[j]}: code {code}, expected {total}", load=True)
            break  # the request recomputes; its other objects need no checking
        self._stat("loaded_blocks", moved)
        self._stat("loaded_bytes", moved_bytes)
        return all_ok and fetched == len(run.keys), run.pending

    def _remove_refused(self, key: str) -> None:
        """Remove an object that failed verification (force: our own get just renewed its lease)."""
        try:
            rc = self._client.remove(key, force=True)
        except StoreError as e:
            rc = e.code
        self._stat("removed_objects" if rc == 0 else "fail.remove_refused_object")

    def _log_keys(self, blocks: BlockBatch) -> None:
        if not self._cfg.key_log_path:
            return
        with open(self._cfg.key_log_path, "a") as f:
            for gid, h, b in zip(blocks.group_ids, blocks.hashes, blocks.block_ids):
                layout = self._layout.groups[gid] if self._layout else None
                if layout is not None:
                    f.write(
                        f"{self._schema.at_generation(blocks.generation).key(gid, h)} {gid} {layout.object_bytes}\n"
                    )

    def _fail(self, cause: str, detail: str, n: int = 1, load: bool = True) -> None:
        self._stat(f"fail.{cause}", n)
        if not load:
            self._stat("failed_saves", n)
        warn_once(logger, cause, "%s", detail)

    # ----------------------------------------------------------------- results
    def get_transfer_results(self) -> KVConnectorTransferResults:
        with self._lock:
            done, self._done_loads = self._done_loads, []
        finished = {r.req_id for r in done}
        failed = {r.req_id for r in done if not r.ok}
        return KVConnectorTransferResults(
            finished_sending=set(), finished_recving=finished, failed_recving=failed
        )

    def build_worker_meta(self) -> StoreWorkerMetadata | None:
        with self._lock:
            if not self._done_saves and not self._released_loads:
                return None
            done, self._done_saves = self._done_saves, Counter()
            released, self._released_loads = self._released_loads, Counter()
            failed, self._failed_saves = self._failed_saves, Counter()
        return StoreWorkerMetadata(done, released, failed)

    def _stat(self, name: str, value: float = 1) -> None:
        with self._lock:
            self._stats.add(name, value)

    def take_stats(self) -> HybridStoreStats | None:
        with self._lock:
            return self._stats.take()

    def drain(self, timeout_s: float) -> bool:
        """Wait (bounded) until no load or save job is queued or running: vLLM is about to
        release the KV cache's memory, which their gathers and scatters read and write.
        True if both queues went idle in time."""
        deadline = time.monotonic() + timeout_s
        loads_idle = self._loads.wait_idle(timeout_s)
        return self._saves.wait_idle(max(0.0, deadline - time.monotonic())) and loads_idle

    def shutdown(self, timeout_s: float = 10.0) -> None:
        """Let queued saves finish (bounded), then stop the threads."""
        self._saves.wait_idle(timeout_s)
        self._loads.stop()
        self._saves.stop()
        if self._trimmer is not None:
            t = self._trimmer
            logger.info(
                "malloc_trim every %.0f s: %d calls, %d released memory, %.1f ms mean, %.1f ms max",
                t.interval_s,
                t.calls,
                t.released,
                1e3 * t.total_s / max(1, t.calls),
                1e3 * t.max_s,
            )
            t.stop()
