"""Worker side of HybridPDConnector: handshake service, NIXL reads, leases.

Prefill workers register the KV cache with NIXL and serve the gRPC handshake;
they report a lease ended (``finished_sending`` here; the connector hands it to the
scheduler in its worker metadata, pd_lease_pins) when the
decode side says it is done with them (``ReleaseBlocks`` on the gRPC side channel,
after its READ or when it reads nothing) or the lease expires. Not a NIXL
notification: polling NIXL for notifications on every engine step stalls the
very READs it waits for, until the lease expires (every P/D request then waits
lease_s). Decode workers
handshake once per peer (refusing a layout mismatch there), then pull each
request's blocks with one batched READ on a background thread; a failed or
timed-out read is reported per request (``failed_recving``), so vLLM recomputes
or fails it according to ``kv_load_failure_policy`` and never runs on partial KV.

Leases: the prefill worker counts a lease's TTL on its own monotonic clock from when
it learns of it. Decode claims the lease over the side channel right AFTER its READ
ended, and uses the bytes only if the claim succeeds: the prefill side grants a claim
only while the lease still holds the blocks (not expired, not released, not claimed
before), so a granted claim proves the blocks were untouched for the whole READ,
which began after the lease was issued. No clock of one host is compared with
another's (not even their rates), and a lease is used once: n > 1 children or a
replayed request whose claim is refused recompute, whatever their READ copied.
(Claiming before the READ would need the prefill side's remaining time turned into
a decode-side deadline, and would put a round trip to a frozen peer ahead of the
READ.) Decode-only workers serve no handshake.
"""

from __future__ import annotations

import os
import queue
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorTransferResults
from vllm.v1.kv_cache_interface import KVCacheConfig

from hybridkv.connector.block_layout import KVLayout, layer_specs, layout_rows
from hybridkv.connector.log_once import warn_once
from hybridkv.connector.pd_auth import DeploymentKey
from hybridkv.connector.pd_handshake import (
    AgentInfo,
    HandshakeError,
    HandshakeServer,
    LayoutDescriptor,
    LeasePending,
    LeaseRefused,
    claim_lease,
    fetch_agent_info,
    release_blocks,
)
from hybridkv.connector.pd_idle import wake
from hybridkv.connector.pd_metadata import PDConnectorMetadata, PDHandshakeMetadata, ReadJob
from hybridkv.connector.pd_stats import HybridPDStats
from hybridkv.connector.pd_stragglers import StragglerDrain
from hybridkv.connector.pd_tp import (
    RankRead,
    StateSplit,
    rank_reads,
    read_spans,
    readers_of,
    spec_state_splits,
)
from hybridkv.connector.pd_transport import (
    PDTransport,
    ReadHandle,
    TransferError,
    TransferTimeout,
    allocation_spaces,
)
from hybridkv.store.cpu_affinity import unpinned
from hybridkv.store.logs import get_logger
from hybridkv.store.vllm_compat import kv_head_major_slots

# A claim can arrive before the prefill worker's next step hands it the lease (the
# scheduler issued the params at finish): decode asks again for CLAIM_WAIT_S
# (pd_handshake), while no handshake thread waits.
# How many ended leases the prefill worker remembers, to tell a late claim why it is refused
# (and how many releases of leases it does not hold yet it keeps).
ENDED_LEASES_KEPT = 4096
# Decode: each prefill instance (host, rank 0's port) gets its own read thread, so a stalled
# peer delays only its own requests; past this many peers with live threads, further peers
# share one overflow thread. A peer's thread exits after PEER_IDLE_S without work.
MAX_PEER_THREADS = 16
PEER_IDLE_S = 60.0
# Decode: NIXL peers (handshaken prefill workers) kept; the least recently used one without a
# READ in flight is removed past this (prefill restarts bring new ports).
MAX_PEERS = 64

logger = get_logger(__name__, "P/D")


def _state_splits_or_raise(group) -> tuple[StateSplit, ...]:  # noqa: ANN001 - a vllm KVCacheGroupSpec
    from vllm.model_executor.layers.mamba.mamba_utils import is_conv_state_dim_first
    from vllm.utils.torch_utils import get_dtype_size
    from vllm.v1.kv_cache_interface import MambaSpec

    specs = layer_specs(group)
    if not specs or not any(isinstance(sp, MambaSpec) for sp in specs):
        return ()
    if not all(isinstance(sp, MambaSpec) for sp in specs) or len(set(specs)) != 1:
        raise ValueError("the group's layers have different Mamba specs")
    spec = specs[0]
    return spec_state_splits(
        str(spec.mamba_type),
        spec.shapes,
        [get_dtype_size(d) for d in spec.dtypes],
        bool(is_conv_state_dim_first()),
        bool(getattr(spec, "tp_replicated", False)),
    )


def group_state_splits(group) -> tuple[StateSplit, ...]:  # noqa: ANN001 - a vllm KVCacheGroupSpec
    """A Mamba group's per-rank state splits for the handshake (empty: not a Mamba group,
    or a kind pd_tp does not re-slice, which then pairs only at equal TP sizes). The conv
    orientation is the one this process's layers bind (VLLM_SSM_CONV_STATE_LAYOUT)."""
    try:
        return _state_splits_or_raise(group)
    except ValueError as e:
        logger.info("Mamba group state not re-sliced across TP sizes: %s", e)
        return ()


def group_head_slots(group) -> tuple[int, bool]:  # noqa: ANN001 - a vllm KVCacheGroupSpec
    """(``num_head_slots``, ``kv_head_major_slots``) of a group's attention spec: the slots per
    page where packing diverges from one per KV head (0: one per head, or not attention), and
    whether they are grouped by head (vLLM 0.34; False before). The handshake refuses slots
    not grouped by head across TP sizes (a head's bytes are then not one run)."""
    spec = layer_specs(group)[0]
    return int(getattr(spec, "num_head_slots", None) or 0), kv_head_major_slots(spec)


def mamba_reslice_problem(kv_cache_config) -> str | None:  # noqa: ANN001 - a vllm KVCacheConfig
    """Why this instance's Mamba state cannot be re-sliced across TP sizes (None: no Mamba
    group, or every one is GDN state): ``LocalLayout.mamba_problem`` for the scheduler."""
    for gid, group in enumerate(kv_cache_config.kv_cache_groups):
        try:
            _state_splits_or_raise(group)
        except ValueError as e:
            return f"group {gid}: {e}"
    return None


@dataclass(frozen=True)
class PDWorkerSettings:
    engine_id: str
    tp_rank: int
    tp_size: int
    host: str
    port: int
    handshake_timeout_s: float
    read_timeout_s: float
    serve_handshake: bool = True  # prefill-capable roles only
    key: DeploymentKey | None = None
    # store.keys.kv_identity(vllm_config), compared with the peer's in the handshake; None:
    # the caller has no config (an empty identity is sent, so a configured peer refuses it).
    kv_identity: dict[str, str] | None = None
    # The model's KV heads per attention layer over all ranks (ModelConfig.get_total_num_kv_heads):
    # decides which head range of which prefill rank a decode rank reads when the TP sizes differ.
    total_kv_heads: int = 0


@dataclass
class _Lease:
    lease_id: str
    expires: float  # time.monotonic() on this (prefill) host
    claimed_by: set[int] = field(default_factory=set)  # decode ranks whose claim was granted
    released_by: set[int] = field(default_factory=set)  # decode ranks done with the blocks


class PDWorker:
    def __init__(self, settings: PDWorkerSettings, kv_cache_config: KVCacheConfig) -> None:
        self._s = settings
        self._kv_cache_config = kv_cache_config
        self._transport: PDTransport | None = None
        self._server: HandshakeServer | None = None
        self._local: LayoutDescriptor | None = None
        # (host, port) -> NIXL name, layout; least recently used first
        self._peers: OrderedDict[tuple[str, int], tuple[str, LayoutDescriptor]] = OrderedDict()
        # Per-peer read threads look peers up, add them, forget idle ones and drop failed ones
        # at once: unlocked, one thread's KeyError could end a read with another rank's READ
        # posted and untracked (its blocks freed while it may still write).
        self._peers_lock = threading.Lock()
        self._lock = threading.Lock()
        self._recv_done: set[str] = set()
        self._recv_failed: set[str] = set()
        self._leases: dict[str, _Lease] = {}
        self._ended: OrderedDict[str, str] = OrderedDict()  # req id -> why its lease ended
        self._decode_released: OrderedDict[str, None] = OrderedDict()  # bounded: ENDED_LEASES_KEPT
        self._released: set[str] = set()  # reads whose target blocks nothing writes into anymore
        self._stats = HybridPDStats()  # this rank's counters (pd_stats), emptied by take_stats
        self._cause = threading.local()  # per read thread: why its current read failed (_failed)
        # Timed-out READs that may still write: one thread for all, their blocks kept meanwhile.
        self._stragglers = StragglerDrain(
            self._poll_straggler, self._release_straggler, self._release
        )
        self._jobs: queue.Queue[ReadJob | None] = (
            queue.Queue()
        )  # overflow: peers past MAX_PEER_THREADS
        self._peer_queues: dict[tuple[str, int], queue.Queue[ReadJob | None]] = {}
        self._read_threads: list[threading.Thread] = []
        self._closed = False
        self._thread = threading.Thread(
            target=self._run_reads, args=(self._jobs, None), name="hybridkv-pd-read", daemon=True
        )
        self._thread.start()

    # ------------------------------------------------------------ registration
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        layout = KVLayout.from_kv_caches(self._kv_cache_config, kv_caches)
        if self._s.host in ("127.0.0.1", "localhost"):
            # Single-host pair: keep UCX on loopback (it would otherwise pick other interfaces),
            # and off its IB module, whose second copy of libnl-route crashes the process at
            # exit on hosts with rdma-core installed (as Mooncake needs).
            os.environ.setdefault("UCX_NET_DEVICES", "lo")
            os.environ.setdefault("UCX_MODULES", "^ib")
        name = f"hybridkv-{self._s.engine_id}-tp{self._s.tp_rank}"
        # CUDA caches register as VRAM on their own device, host caches as DRAM
        self._transport = PDTransport(name, layout, memory=allocation_spaces(layout, kv_caches))
        if self._s.kv_identity is None:
            warn_once(
                logger,
                "pd-no-kv-identity",
                "P/D worker has no kv_identity: the handshake cannot check model, revision, "
                "quantization or --kv-cache-dtype against the peer",
            )
        kv_heads = [
            int(getattr(layer_specs(g)[0], "num_kv_heads", 0) or 0)
            for g in self._kv_cache_config.kv_cache_groups
        ]
        self._local = LayoutDescriptor.from_kv(
            layout,
            layout_rows(self._kv_cache_config),
            self._s.tp_size,
            spaces=self._transport.group_spaces,
            kv_identity=self._s.kv_identity,
            kv_heads=kv_heads,
            total_kv_heads=self._s.total_kv_heads,
            state_splits=[group_state_splits(g) for g in self._kv_cache_config.kv_cache_groups],
            head_slots=[group_head_slots(g) for g in self._kv_cache_config.kv_cache_groups],
        )
        info = AgentInfo(
            engine_id=self._s.engine_id,
            tp_rank=self._s.tp_rank,
            agent_name=name,
            agent_metadata=self._transport.metadata(),
            layout=self._local,
        )
        if not self._s.serve_handshake:
            logger.info("NIXL agent %s (decode only: no handshake service)", name)
            return
        self._server = HandshakeServer(
            info,
            host=self._s.host,
            port=self._s.port,
            on_release=self._released_by_decode,
            on_claim=self._claim,
            key=self._s.key,
        )
        port = self._server.start()
        logger.info(
            "NIXL agent %s, handshake on %s:%d (%s)",
            name,
            self._s.host,
            port,
            "authenticated" if self._s.key is not None else "UNAUTHENTICATED",
        )

    def handshake_metadata(self) -> PDHandshakeMetadata | None:
        if self._server is None:
            return None
        return PDHandshakeMetadata(
            host=self._s.host,
            port=int(self._server.address.rpartition(":")[2]),
            tp_rank=self._s.tp_rank,
        )

    # ------------------------------------------------------------------ decode
    def start_load_kv(self, meta: PDConnectorMetadata) -> None:
        for job in meta.reads:
            self._route(job)
        if meta.leases:
            now = time.monotonic()
            with self._lock:
                for lease in meta.leases:
                    # A renewed lease (same request, still held) is the same hand-over: counted
                    # once, so leases = released + expired + held.
                    self._stats.add("leases", lease.req_id not in self._leases)
                    self._leases[lease.req_id] = _Lease(lease.lease_id, now + lease.ttl_s)

    def _route(self, job: ReadJob) -> None:
        """Queue ``job`` on its prefill instance's read thread (started on first use)."""
        key = (
            job.remote_host,
            job.remote_ports[0],
        )  # ReadJob fills remote_ports (at least rank 0's)
        with self._lock:  # puts and a thread's idle exit are decided under one lock: no job is lost
            if self._closed:
                return
            q = self._peer_queues.get(key)
            if q is None and len(self._peer_queues) < MAX_PEER_THREADS and not job.refused:
                q = self._peer_queues[key] = queue.Queue()
                t = threading.Thread(
                    target=self._run_reads,
                    args=(q, key),
                    daemon=True,
                    name=f"hybridkv-pd-read-{key[1]}",
                )
                # Started from the worker's main thread, which vLLM pins to its core: a thread
                # inherits that affinity and would queue behind the forward pass there (READs,
                # claims and releases, and the straggler drains it starts). The gRPC, NIXL and
                # Mooncake threads are kept off the pinned core the same way.
                with unpinned():
                    t.start()
                self._read_threads = [x for x in self._read_threads if x.is_alive()] + [t]
            (q if q is not None else self._jobs).put(job)

    def _next_job(
        self, q: "queue.Queue[ReadJob | None]", key: tuple[str, int] | None
    ) -> ReadJob | None:
        if key is None:
            return q.get()
        while True:
            try:
                return q.get(timeout=PEER_IDLE_S)
            except queue.Empty:
                with self._lock:
                    if q.empty():
                        self._peer_queues.pop(key, None)
                        return None

    def _run_reads(self, q: "queue.Queue[ReadJob | None]", key: tuple[str, int] | None) -> None:
        while (job := self._next_job(q, key)) is not None:
            if job.release_only:
                self._send_release(job)
                continue
            ok, straggler = False, None
            self._cause.name = (
                None  # set by _failed on this thread, counted below with failed_reads
            )
            try:
                ok, straggler = self._read(job)
            except Exception:  # noqa: BLE001 - reported as a failed load, never a crash
                logger.exception("read for %s crashed", job.req_id)
                self._failed("crash")
            if not ok:  # every time (the cause may be a warn_once): provenance checks look for it
                logger.warning(
                    "READ for %s from %s:%d failed or was refused; no KV used, "
                    "kv_load_failure_policy applies",
                    job.req_id,
                    job.remote_host,
                    job.remote_port,
                )
            with self._lock:
                self._recv_done.add(job.req_id)
                if not ok:
                    self._recv_failed.add(job.req_id)
                    # One lock hold for both: a stats interval never sees a cause without its failure.
                    self._stats.add("failed_reads")
                    cause = self._cause.name or "crash"
                    self._stats.add(f"fail.{cause}")
                    if cause == "TransferTimeout":
                        self._stats.add("timed_out_reads")
            if straggler is None:
                self._release(job.req_id)
            else:
                self._stragglers.add(
                    job.req_id, straggler, blocks=sum(len(ids) for ids in job.local_block_ids)
                )
            if not ok and job.remote_host and job.lease_id:
                # This decode will not read these blocks: the prefill side frees them now instead
                # of holding them for lease_s (a READ still in flight only reads them, and what
                # it copies is discarded).
                self._send_release(job)

    def _plan(self, job: ReadJob) -> list[RankRead]:
        """The prefill ranks (and head ranges) this decode rank reads for ``job``."""
        return rank_reads(
            self._s.tp_rank, self._s.tp_size, len(job.remote_ports), self._s.total_kv_heads
        )

    def _address(self, job: ReadJob, prefill_rank: int) -> str:
        return f"{job.remote_host}:{job.remote_ports[prefill_rank]}"

    def _send_release(self, job: ReadJob, plan: list[RankRead] | None = None) -> None:
        """Tell every prefill rank this rank reads that it may free ``job``'s blocks (read
        done, or nothing to read).

        Over the gRPC side channel. Best effort: if a peer cannot be reached, its lease
        expires on its own."""
        try:
            plan = self._plan(job) if plan is None else plan
        except ValueError as e:
            warn_once(logger, "pd_release_plan", "cannot release %s: %s", job.remote_req_id, e)
            return
        prefill_tp = len(job.remote_ports)
        for part in plan:
            address = self._address(job, part.prefill_rank)
            try:
                release_blocks(
                    address,
                    [job.remote_req_id],
                    self._s.handshake_timeout_s,
                    self._s.key,
                    reader=self._s.tp_rank,
                    readers=readers_of(part.prefill_rank, self._s.tp_size, prefill_tp),
                )
            except Exception as e:  # noqa: BLE001 - runs on the read thread, which must survive
                warn_once(
                    logger,
                    f"pd_release:{type(e).__name__}",
                    "could not release %s on %s (its lease expires instead): %s",
                    job.remote_req_id,
                    address,
                    e,
                )

    def _released_by_decode(
        self, request_ids: list[str], reader: int = 0, readers: int = 1
    ) -> None:
        """Prefill side, on a gRPC thread: decode rank ``reader`` is done with these requests'
        blocks; they are free once all ``readers`` decode ranks reading this rank said so."""
        with self._lock:
            for rid in request_ids:
                lease = self._leases.get(rid)
                if lease is not None:
                    lease.released_by.add(reader)
                if lease is None or len(lease.released_by) >= readers:
                    # (lease not known yet: kept, bounded, until the worker learns of it)
                    self._decode_released[rid] = None
                    self._decode_released.move_to_end(rid)
            while len(self._decode_released) > ENDED_LEASES_KEPT:
                self._decode_released.popitem(last=False)
        wake()  # an engine pacing its idle steps in this process frees the blocks now (pd_idle)

    def _claim(self, req_id: str, lease_id: str, reader: int = 0, readers: int = 1) -> float:
        """Prefill side, on a gRPC thread: decode rank ``reader``'s READ of ``req_id``'s
        blocks has ended; granted only while the lease holds them, once per reader.
        Returns the seconds left."""
        with self._lock:
            lease = self._leases.get(req_id)
            if lease is None and req_id in self._ended:
                raise LeaseRefused(f"request {req_id}: {self._ended[req_id]}")
            if lease is None:
                raise LeasePending(req_id)  # the next step may deliver it: decode asks again
            if lease.lease_id != lease_id:
                raise LeaseRefused(f"request {req_id}: no such lease (never issued here)")
            if reader in lease.released_by or req_id in self._decode_released:
                raise LeaseRefused(
                    f"request {req_id}: the decode side released the lease already; a lease is "
                    "read once, so this one recomputes"
                )
            if reader in lease.claimed_by or len(lease.claimed_by) >= readers:
                raise LeaseRefused(
                    f"request {req_id}: the lease was claimed already; a lease is read once "
                    "(n > 1 or a replayed request), so this one recomputes"
                )
            remaining = lease.expires - time.monotonic()
            if remaining <= 0:
                raise LeaseRefused(f"request {req_id}: the lease on its blocks has expired")
            lease.claimed_by.add(reader)
            return remaining

    def _release(self, req_id: str) -> None:
        with self._lock:
            self._released.add(req_id)

    def _poll_straggler(self, handle: ReadHandle) -> str:
        transport = self._transport
        return "DONE" if transport is None else transport.poll(handle)

    def _release_straggler(self, handle: ReadHandle) -> None:
        if self._transport is not None:
            self._transport.release(handle)

    def unsettled_reads(self) -> int:
        """Requests whose timed-out READs may still write (their blocks kept out of use)."""
        return self._stragglers.pending()

    def _slices(self, part: RankRead, peer_layout: LayoutDescriptor, job: ReadJob) -> list | None:
        """Per group: the spans to move from ``part``'s prefill rank (None: whole blocks)."""
        assert self._local is not None and self._transport is not None
        kernel_rows = [() if g is None else g.kernel_rows for g in self._transport.layout.groups]
        return read_spans(
            part,
            self._local.groups,
            peer_layout.groups,
            kernel_rows,
            job.remote_block_ids,
            self._s.tp_size,
            len(job.remote_ports),
            self._s.tp_rank,
        )

    def _read(self, job: ReadJob) -> tuple[bool, list[ReadHandle] | None]:
        """(read ok, READs still in flight after a timeout or None).

        One READ per prefill rank this rank needs (one when the TP sizes are equal),
        all posted before any is waited for, all under one deadline; then the lease of
        every one is claimed: the bytes count only if every claim is granted."""
        if job.refused:
            warn_once(
                logger, "pd_refused", "request %s cannot be read: %s", job.req_id, job.refused
            )
            self._failed("refused")
            return False, None
        assert self._transport is not None and self._local is not None
        t0 = time.perf_counter()
        handles: list[ReadHandle] = []
        failed_address = None
        try:
            plan = self._plan(job)
            prefill_tp = len(job.remote_ports)
            for part in plan:
                failed_address = self._address(job, part.prefill_rank)
                peer, peer_layout = self._peer(job, part.prefill_rank)
                handles.append(
                    self._transport.read_blocks(
                        peer,
                        job.remote_block_ids,
                        job.local_block_ids,
                        slices=self._slices(part, peer_layout, job),
                    )
                )
            deadline = time.monotonic() + self._s.read_timeout_s
            for handle in handles:
                self._transport.wait(handle, max(0.0, deadline - time.monotonic()))
            for handle in handles:
                self._transport.release(handle)
            # Only now: granted claims prove the leases held the blocks until after the READs.
            for part in plan:
                failed_address = self._address(job, part.prefill_rank)
                claim_lease(
                    failed_address,
                    job.remote_req_id,
                    job.lease_id,
                    self._s.handshake_timeout_s,
                    self._s.key,
                    reader=self._s.tp_rank,
                    readers=readers_of(part.prefill_rank, self._s.tp_size, prefill_tp),
                )
            self._send_release(job, plan)
            # Provenance: the one line that proves this request's KV arrived over NIXL (tests
            # and operators match it; a failed or discarded READ never prints it).
            per_group = [len(ids) for ids in job.remote_block_ids]
            ranks = [part.prefill_rank for part in plan]
            self._count_read(
                sum(per_group),
                sum(h.nbytes for h in handles),
                time.perf_counter() - t0,
                sum(h.num_descs for h in handles),
                sum(h.num_regions for h in handles),
            )
            logger.info(
                "read %d blocks (%d bytes) for %s from %s at %s:%d (per group %s) "
                "rank %d/%d <- prefill ranks %s/%d",
                sum(per_group),
                sum(h.nbytes for h in handles),
                job.req_id,
                job.remote_engine_id,
                job.remote_host,
                job.remote_port,
                per_group,
                self._s.tp_rank,
                self._s.tp_size,
                ranks,
                prefill_tp,
            )
            return True, None
        except LeaseRefused as e:
            logger.warning("read of request %s discarded, recomputing: %s", job.req_id, e)
            self._failed("LeaseRefused")
            return False, None
        except HandshakeError as e:
            logger.error("%s", e)  # a setup error: every occurrence matters
            self._failed("HandshakeError")
            return False, self._open_reads(handles)
        except ValueError as e:  # a TP plan or span the layouts cannot serve
            logger.error("read of %s from %s refused: %s", job.req_id, failed_address, e)
            self._failed("plan")
            return False, self._open_reads(handles)
        except TransferError as e:
            warn_once(
                logger,
                f"pd_read:{type(e).__name__}",
                "read of %s from %s failed: %s",
                job.req_id,
                failed_address,
                e,
            )
            with self._peers_lock:
                for port in job.remote_ports:
                    self._peers.pop((job.remote_host, port), None)  # re-handshake next time
            self._failed("TransferTimeout" if isinstance(e, TransferTimeout) else "TransferError")
            return False, self._open_reads(handles)

    def _count_read(
        self, blocks: int, nbytes: int, seconds: float, descriptors: int = 0, regions: int = 0
    ) -> None:
        """A request's read on this rank succeeded (its KV is used): the provenance line's numbers,
        and the descriptors its READs posted against the (block, region) pairs they covered."""
        with self._lock:
            self._stats.add("reads")
            self._stats.add("read_blocks", blocks)
            self._stats.add("read_bytes", nbytes)
            self._stats.add("read_descriptors", descriptors)
            self._stats.add("read_regions", regions)
            self._stats.add("read_seconds", seconds)
            self._stats.add_latency("read", seconds)

    def _failed(self, cause: str) -> None:
        """Why this thread's current read failed; the read loop counts it with ``failed_reads``
        (once per job, the last cause named: an error after a cause is a crash)."""
        self._cause.name = cause

    def _open_reads(self, handles: list[ReadHandle]) -> list[ReadHandle] | None:
        """The READs of a failed job that may still write (kept pinned until they settle)."""
        assert self._transport is not None
        still = []
        for h in handles:
            try:
                if self._transport.poll(h) != "DONE":
                    still.append(h)
            except TransferError:
                pass  # failed: writes nothing more
        return still or None

    def _peer(self, job: ReadJob, prefill_rank: int) -> tuple[str, LayoutDescriptor]:
        key = (job.remote_host, job.remote_ports[prefill_rank])
        with self._peers_lock:
            peer = self._peers.get(key)
            if peer is not None:
                self._peers.move_to_end(key)
        if (
            peer is None
        ):  # the handshake runs outside the lock: a stalled peer holds up only its own reads
            info = fetch_agent_info(
                f"{job.remote_host}:{key[1]}",
                self._local,
                engine_id=self._s.engine_id,
                tp_rank=self._s.tp_rank,
                timeout_s=self._s.handshake_timeout_s,
                prefill_engine_id=job.remote_engine_id,
                key=self._s.key,
                prefill_rank=prefill_rank,
            )
            name = self._transport.add_peer(
                info.agent_metadata, info.layout.group_layouts(), info.layout.memory_spaces()
            )
            peer = (name, info.layout)
            with self._peers_lock:
                self._peers[key] = peer
                self._forget_idle_peers()
        return peer

    def _forget_idle_peers(self) -> None:
        """Past MAX_PEERS, remove the least recently used peers that have no READ in flight
        (removing one with a READ open would not stop its writes). ``_peers_lock`` held."""
        assert self._transport is not None
        for key in list(self._peers):
            if len(self._peers) <= MAX_PEERS:
                return
            name = self._peers[key][0]
            if self._transport.open_reads(name) == 0:
                del self._peers[key]
                self._transport.remove_peer(name)

    # ----------------------------------------------------------------- results
    def get_transfer_results(self) -> KVConnectorTransferResults:
        sending: set[str] = set()
        with self._lock:
            recv, failed = self._recv_done, self._recv_failed
            self._recv_done, self._recv_failed = set(), set()
            now = time.monotonic()
            for req_id, lease in list(self._leases.items()):
                if req_id in self._decode_released or now >= lease.expires:
                    if req_id not in self._decode_released:
                        warn_once(
                            logger,
                            "pd_lease_expired",
                            "lease of %s expired before the decode side read it",
                            req_id,
                        )
                        self._ended[req_id] = "the lease on its blocks has expired"
                        self._stats.add("leases_expired")
                    else:
                        self._ended[req_id] = (
                            "the lease was released already (a lease is read once: n > 1 or "
                            "a replayed request recomputes)"
                        )
                        self._stats.add("leases_released")
                    while len(self._ended) > ENDED_LEASES_KEPT:
                        self._ended.popitem(last=False)
                    sending.add(req_id)
                    del self._leases[req_id]
                    self._decode_released.pop(req_id, None)
        return KVConnectorTransferResults(
            finished_sending=sending, finished_recving=recv, failed_recving=failed
        )

    def take_stats(self) -> HybridPDStats | None:
        """This rank's counters since the last call (None: nothing counted)."""
        with self._lock:
            return self._stats.take()

    def take_released(self) -> set[str]:
        with self._lock:
            released, self._released = self._released, set()
        return released

    def has_leases(self) -> bool:
        return bool(self._leases)

    def stop_reads(self, join_s: float = 0.0) -> bool:
        """No new reads; each read thread exits after the jobs queued before this. Waits up
        to ``join_s`` for them; True if all exited."""
        with self._lock:
            self._closed = True
            queues = list(self._peer_queues.values())
            threads = [self._thread, *self._read_threads]
        for q in queues:
            q.put(None)
        self._jobs.put(None)
        deadline = time.monotonic() + join_s
        for t in threads:
            t.join(max(0.0, deadline - time.monotonic()))
        return not any(t.is_alive() for t in threads)

    def shutdown(self) -> None:
        self.stop_reads()
        self._stragglers.stop()
        if self._server is not None:
            self._server.stop()
        if self._transport is not None:
            self._transport.shutdown()
