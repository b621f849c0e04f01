"""P/D data path: decode READs whole blocks of every KV-cache group from prefill over NIXL.

Why a wrapper around ``nixl_agent``: the connector needs four things NIXL
leaves to the caller — block ids turned into byte descriptors by the one
addressing rule of ``block_layout`` (never re-derived here), one batched READ
per request instead of one per block or group, in the fewest descriptors
contiguous on both sides (``block_layout.coalesce``: each descriptor costs
the link about the same up to MiBs), a wait that cannot hang on a
dead peer, and NIXL's untyped exceptions turned into :class:`TransferError`
with the peer and the size named. The lease (when prefill may free its blocks)
stays in the connector, which releases it over its own gRPC side channel
(``pd_handshake.release_blocks``); the NIXL notification API here
(:meth:`PDTransport.get_notifs`, ``notif=``) is not used by the connector:
polling notifications on every engine step stalls the READs it waits for.

Facts this relies on (NIXL 1.5.1, UCX backend, checked on a CPU host):

- Regions are registered as ``(addr, len, dev, "")`` tuples under ONE memory
  type per registration: host KV caches as ``"DRAM"`` (dev 0), CUDA ones as
  ``"VRAM"`` with their CUDA device index (:func:`memory_space`); a transfer
  descriptor list likewise has one memory type and a device per row. Each
  side's type and devices travel in the handshake, so the READ plan names the
  peer's memory as the peer registered it. On the CPU engine every KV tensor is
  a view of one int8 allocation, so registration is one region
  (``KVLayout.allocations``).
- Both agents need NIXL's progress thread (the default): with it off, a READ
  never completes while the prefill process is not calling into NIXL.
- With UCX's default transports on one host, ``cma`` moves the bytes and the
  copy runs inside ``transfer()`` itself: the post returns "DONE" after the
  copy, so :meth:`read_blocks` can block for the size of the read. Over
  ``UCX_TLS=tcp`` (and across hosts) the post returns "PROC" and
  :meth:`wait` polls.
- A READ's notification is delivered to the *target* (prefill) agent after the
  data was read; the target does not need the initiator's metadata for that.
- A peer that died makes ``transfer()`` or ``check_xfer_state()`` raise
  ``NIXL_ERR_REMOTE_DISCONNECT`` at once; a descriptor outside registered memory
  makes ``initialize_xfer`` raise ``NIXL_ERR_NOT_FOUND``.
- Releasing an in-flight READ is not a fence: over tcp, a READ from a stalled
  (SIGSTOPped) peer keeps landing bytes in the destination after
  ``release_xfer_handle`` and ``remove_remote_agent`` once the peer resumes;
  destroying the agent stops it. So a timed-out READ stays open here and its
  destination blocks stay the caller's until it settles.
- ``UCX_NET_DEVICES`` (e.g. ``lo`` for single-host runs) is read when the agent
  is created; this module does not set it. ``UCX_TLS=`` (empty) makes agent
  creation fail: leave it unset or name transports.
- On a host with the system rdma-core installed (``libibverbs1``, which the
  Mooncake store needs), every process that created a UCX agent segfaults at
  exit (two libnl-route copies: nixl's bundled one and the system one loaded
  by the rdma-core providers). ``UCX_MODULES=^ib`` (no IB transport; fine for
  CPU loopback) avoids it. Set by the deployment, not here: RDMA hosts need IB.
"""

from __future__ import annotations

import bisect
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np

from hybridkv.connector.block_layout import GroupLayout, KVLayout, coalesce


@dataclass(frozen=True)
class MemorySpace:
    """Where an allocation lives, as NIXL names it: memory type and device id.

    Why it matters: registering CUDA memory as ``"DRAM"`` makes UCX treat device
    pointers as host pointers (a failed or wrong copy), so each allocation is
    registered, and each READ descriptor built, with its own type and device.
    """

    kind: Literal["DRAM", "VRAM"]
    dev: int


HOST = MemorySpace("DRAM", 0)


def memory_space(device_type: str, index: int | None) -> MemorySpace:
    """The NIXL memory space of a tensor on torch device ``(device_type, index)``.

    cpu -> ``DRAM`` dev 0; cuda -> ``VRAM`` with the CUDA device index (which a
    CUDA tensor always has). Anything else cannot be registered: ``ValueError``.
    """
    if device_type == "cpu":
        return HOST
    if device_type == "cuda":
        if index is None:
            raise ValueError("a CUDA KV cache without a device index (use the tensor's own device)")
        return MemorySpace("VRAM", int(index))
    raise ValueError(
        f"KV cache on device type {device_type!r}: hybridkv P/D registers host (cpu) or CUDA memory only"
    )


def allocation_spaces(layout: KVLayout, kv_caches: Mapping[str, Any]) -> tuple[MemorySpace, ...]:
    """The memory space of each of ``layout.allocations``, from the tensors' own devices."""
    by_base: dict[int, MemorySpace] = {}
    for name, t in kv_caches.items():
        base = t.untyped_storage().data_ptr()
        space = memory_space(t.device.type, t.device.index)
        if by_base.setdefault(base, space) != space:
            raise ValueError(f"{name}: allocation 0x{base:x} seen on {by_base[base]} and {space}")
    try:
        return tuple(by_base[base] for base, _ in layout.allocations)
    except KeyError as e:
        raise ValueError(
            f"allocation 0x{e.args[0]:x} of the layout is no tensor's storage"
        ) from None


def group_spaces(layout: KVLayout, spaces: Sequence[MemorySpace]) -> tuple[MemorySpace | None, ...]:
    """Per group: the memory space of the allocation holding its regions (None: no layer).

    A group whose regions lie in allocations of different spaces, or outside
    every allocation, is refused (``ValueError``): its READ rows could not name
    one device."""
    if len(spaces) != len(layout.allocations):
        raise ValueError(f"{len(spaces)} memory spaces for {len(layout.allocations)} allocations")
    starts = [base for base, _ in layout.allocations]
    out: list[MemorySpace | None] = []
    for g in layout.groups:
        if g is None:
            out.append(None)
            continue
        found: set[MemorySpace] = set()
        for base in g.bases.tolist():
            i = bisect.bisect_right(starts, int(base)) - 1
            if i < 0 or int(base) >= starts[i] + layout.allocations[i][1]:
                raise ValueError(
                    f"group {g.group_id}: region 0x{int(base):x} lies in no registered allocation"
                )
            found.add(spaces[i])
        if len(found) != 1:
            raise ValueError(
                f"group {g.group_id}: regions in several memory spaces {sorted(map(str, found))}"
            )
        out.append(found.pop())
    return tuple(out)


def _one_kind(spaces: Sequence[MemorySpace | None], whose: str) -> str:
    """NIXL descriptor lists carry one memory type: a side must use one."""
    kinds = {s.kind for s in spaces if s is not None}
    if len(kinds) > 1:
        raise TransferError(
            f"{whose} KV cache mixes memory types {sorted(kinds)}; one P/D READ names one type per side"
        )
    return kinds.pop() if kinds else HOST.kind


#: How long :meth:`PDTransport.wait` polls without sleeping before it backs off. A coalesced
#: GPU READ is done in well under a millisecond (256 MiB in 16 descriptors: 0.25 ms over cuda_ipc
#: on an H200), while one timer sleep of the backoff costs 50-1000 us: sleeping from the first
#: poll held such a READ to a quarter of the link. At most this much CPU per READ.
WAIT_SPIN_S = 0.001


class TransferError(RuntimeError):
    """A P/D READ could not be set up or did not complete."""


class TransferTimeout(TransferError):
    """A P/D READ did not complete within the caller's bound; it is still in flight."""


def _nixl():
    """Import NIXL lazily: the scheduler process imports the connector but never transfers."""
    try:
        from nixl import _bindings
        from nixl._api import nixl_agent, nixl_agent_config
    except ImportError as e:  # pragma: no cover - environment problem, reported as such
        raise TransferError(
            f"NIXL is not importable ({e}); install nixl-cu12==1.5.1 and nixl==1.5.1 --no-deps"
        ) from e
    errors = tuple(
        getattr(_bindings, n)
        for n in dir(_bindings)
        if n.startswith("nixl") and n.endswith("Error") and isinstance(getattr(_bindings, n), type)
    )
    return _bindings, nixl_agent, nixl_agent_config, errors


def _make_agent(name: str, backends: Sequence[str], progress_delay_us: int):
    """A ``nixl_agent`` whose progress thread sleeps ``progress_delay_us`` between polls.

    ``nixl_agent.__init__`` hard-codes ``pthrDelay = 0``: its UCX progress thread
    then spins a whole core even when idle (a whole core per agent; a 10-100 us
    delay brings it to a few percent). On a CPU inference host that core
    belongs to the engine. So the wrapper is built with no backend and no
    thread (cheap), its binding agent is swapped for one built with the
    delay, and the backends are created through the public ``create_backend``.
    """
    bindings, nixl_agent, nixl_agent_config, _ = _nixl()
    agent = nixl_agent(name, nixl_agent_config(enable_prog_thread=False, backends=[]))
    cfg = bindings.nixlAgentConfig()
    cfg.useProgThread = True  # without it a READ stalls until the target calls into NIXL
    cfg.useListenThread = False  # metadata travels over hybridkv's handshake
    cfg.syncMode = bindings.NIXL_THREAD_SYNC_NONE  # what the wrapper picks without a listener
    cfg.pthrDelay = int(progress_delay_us)
    cfg.captureTelemetry = False
    agent.agent = bindings.nixlAgent(name, cfg)
    for backend in backends:
        agent.create_backend(backend, {})
    return agent


def read_descriptors(
    local_groups: Sequence[GroupLayout | None],
    remote_groups: Sequence[GroupLayout | None],
    remote_block_ids: Sequence[Sequence[int]],
    local_block_ids: Sequence[Sequence[int]],
    local_devs: Sequence[int | None] | None = None,
    remote_devs: Sequence[int | None] | None = None,
    slices: Sequence[Sequence[Sequence[tuple[int, int, int]]] | None] | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """Local and remote ``(addr, len, dev)`` rows, uint64 ``[N, 3]``, of one batched READ.

    ``dev`` is the group's device id on that side (``local_devs[g]`` /
    ``remote_devs[g]``; None or omitted: 0, i.e. host memory).

    Row ``i`` of both arrays is the same layer of the same block: block
    ``remote_block_ids[g][k]`` of group ``g`` on the peer lands in block
    ``local_block_ids[g][k]`` here. Addresses come from
    :meth:`GroupLayout.regions` on both sides. Raises ``ValueError`` for a
    request that would read wrong bytes (length or size mismatch, a group
    absent on one side, two rows writing the same local bytes).

    ``slices[g]`` (prefill and decode at different TP sizes, ``pd_tp.head_slices``):
    per region of group ``g``, the ``(local offset, remote offset, length)`` spans of a
    block to move instead of the whole region; the regions' sizes then differ between
    the sides, and every span must lie inside its region on both.
    """
    if not (
        len(local_groups) == len(remote_groups) == len(remote_block_ids) == len(local_block_ids)
    ):
        raise ValueError(
            f"group counts differ: local layout {len(local_groups)}, peer layout "
            f"{len(remote_groups)}, remote ids {len(remote_block_ids)}, local ids {len(local_block_ids)}"
        )
    local_parts: list[np.ndarray] = []
    remote_parts: list[np.ndarray] = []
    sizes: list[np.ndarray] = []
    l_devs: list[np.ndarray] = []
    r_devs: list[np.ndarray] = []
    for gid, (lg, rg, r_ids, l_ids) in enumerate(
        zip(local_groups, remote_groups, remote_block_ids, local_block_ids, strict=True)
    ):
        if len(r_ids) != len(l_ids):
            raise ValueError(
                f"group {gid}: {len(r_ids)} remote block ids but {len(l_ids)} local ones"
            )
        if len(r_ids) == 0:
            continue
        if lg is None or rg is None:
            side = "this worker" if lg is None else "the peer"
            raise ValueError(
                f"group {gid} has no layer on {side} but {len(r_ids)} blocks were asked for"
            )
        if min(r_ids) < 0 or min(l_ids) < 0:
            raise ValueError(f"group {gid}: negative block id")
        group_slices = slices[gid] if slices is not None else None
        l_addr = lg.region_addrs(l_ids)
        r_addr = rg.region_addrs(r_ids)
        if group_slices is None:
            if not np.array_equal(lg.block_bytes, rg.block_bytes):
                raise ValueError(
                    f"group {gid}: per-layer block bytes differ (local {lg.block_bytes.tolist()}, peer "
                    f"{rg.block_bytes.tolist()}); the handshake should have refused this peer"
                )
            local_parts.append(l_addr.reshape(-1).astype(np.uint64))
            remote_parts.append(r_addr.reshape(-1).astype(np.uint64))
            # regions() sizes are block_bytes per layer, block after block: same rows, no list trip
            sizes.append(np.tile(lg.block_bytes.astype(np.uint64), len(l_ids)))
        else:
            reg, lo, ro, n = _span_table(gid, group_slices, lg.block_bytes, rg.block_bytes)
            la = l_addr[:, reg] + lo[None, :]
            ra = r_addr[:, reg] + ro[None, :]
            local_parts.append(la.reshape(-1).astype(np.uint64))
            remote_parts.append(ra.reshape(-1).astype(np.uint64))
            sizes.append(np.tile(n.astype(np.uint64), len(l_ids)))
        n = len(sizes[-1])
        l_devs.append(
            np.full(n, int((local_devs[gid] if local_devs else None) or 0), dtype=np.uint64)
        )
        r_devs.append(
            np.full(n, int((remote_devs[gid] if remote_devs else None) or 0), dtype=np.uint64)
        )
    if not sizes:
        empty = np.zeros((0, 3), dtype=np.uint64)
        return empty, empty.copy()
    size = np.concatenate(sizes)
    local = np.concatenate(local_parts)
    _check_disjoint(local, size)
    return (
        np.stack([local, size, np.concatenate(l_devs)], axis=1),
        np.stack([np.concatenate(remote_parts), size, np.concatenate(r_devs)], axis=1),
    )


def coalesced(local: np.ndarray, remote: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The rows of :func:`read_descriptors` as the fewest descriptors contiguous on both sides
    (``block_layout.coalesce``): the same bytes from the same places to the same places.

    Blocks whose ids run consecutively on both sides become one descriptor per layer (or per
    run across layers, where the allocation places them back to back), which is what the
    link's per-descriptor cost asks for: one cuda_ipc copy per descriptor, about 8 us whatever
    its size up to 4 MiB.
    """
    if len(local) == 0:
        return local, remote
    d, s, n, dd, sd = coalesce(
        local[:, 0].astype(np.int64),
        remote[:, 0].astype(np.int64),
        local[:, 1].astype(np.int64),
        local[:, 2].astype(np.int64),
        remote[:, 2].astype(np.int64),
    )
    return (
        np.stack([d, n, dd], axis=1).astype(np.uint64),
        np.stack([s, n, sd], axis=1).astype(np.uint64),
    )


def _span_table(
    gid: int,
    group_slices: Sequence[Sequence[tuple[int, int, int]]],
    local_bytes: np.ndarray,
    remote_bytes: np.ndarray,
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Flatten one group's per-region spans into (region index, local offset, remote
    offset, length) arrays; refuses a span outside its region on either side."""
    if len(group_slices) != len(local_bytes) or len(group_slices) != len(remote_bytes):
        raise ValueError(
            f"group {gid}: spans for {len(group_slices)} regions, local has {len(local_bytes)}, "
            f"peer {len(remote_bytes)}"
        )
    rows = [
        (i, int(lo), int(ro), int(n)) for i, spans in enumerate(group_slices) for lo, ro, n in spans
    ]
    for i, lo, ro, n in rows:
        if (
            n <= 0
            or lo < 0
            or ro < 0
            or lo + n > int(local_bytes[i])
            or ro + n > int(remote_bytes[i])
        ):
            raise ValueError(
                f"group {gid} region {i}: span ({lo}, {ro}, {n}) outside {int(local_bytes[i])} local / "
                f"{int(remote_bytes[i])} peer bytes"
            )
    t = np.asarray(rows, dtype=np.int64).reshape(-1, 4)
    return t[:, 0], t[:, 1], t[:, 2], t[:, 3]


def _check_disjoint(addr: np.ndarray, size: np.ndarray) -> None:
    """Two rows writing the same local bytes means a block id was given twice
    (groups overlay one allocation, so also across groups)."""
    order = np.argsort(addr)
    a, s = addr[order], size[order]
    overlap = np.nonzero(a[:-1] + s[:-1] > a[1:])[0]
    if overlap.size:
        i = int(overlap[0])
        raise ValueError(
            f"local destinations overlap at 0x{int(a[i + 1]):x}: a local block id is used twice "
            "(KV-cache groups share one block pool, so block ids must be distinct across groups)"
        )


@dataclass(eq=False)
class ReadHandle:
    """One posted READ. Opaque to callers; pass it to poll/wait/release."""

    peer: str
    num_descs: int  # descriptors posted (coalesced)
    nbytes: int
    num_regions: int = 0  # (block, region) pairs before coalescing
    _xfer: object | None = field(default=None, repr=False)
    state: Literal["PROC", "DONE", "ERR", "RELEASED"] = "PROC"

    @property
    def done(self) -> bool:
        return self.state == "DONE"


class PDTransport:
    """One worker's NIXL agent for P/D: registers the KV allocations once, READs blocks.

    Both roles use it: prefill registers its KV cache, publishes
    :meth:`metadata` through the handshake and collects decode's completion
    notifications with :meth:`get_notifs`; decode adds the peer
    (:meth:`add_peer`) and reads (:meth:`read_blocks` + :meth:`wait`). Calls
    are serialised by a lock (the agent runs with NIXL's default no-sync mode);
    over cma that lock is held for the copy inside :meth:`read_blocks`.
    """

    def __init__(
        self,
        agent_name: str,
        layout: KVLayout,
        *,
        backends: Sequence[str] = ("UCX",),
        progress_delay_us: int = 100,
        memory: MemorySpace | Sequence[MemorySpace] = HOST,
    ) -> None:
        """``memory``: the space of every allocation, or one per ``layout.allocations``
        (:func:`allocation_spaces`); the default is host memory (CPU KV caches)."""
        *_, self._errors = _nixl()
        spaces = (
            (memory,) * len(layout.allocations)
            if isinstance(memory, MemorySpace)
            else tuple(memory)
        )
        try:
            self.group_spaces = group_spaces(layout, spaces)
        except ValueError as e:
            raise TransferError(f"NIXL agent {agent_name!r}: {e}") from e
        self.mem_kind = _one_kind(spaces, "this worker's")
        self.name = agent_name
        self.layout = layout
        self._lock = threading.Lock()
        try:
            self._agent = _make_agent(agent_name, backends, progress_delay_us)
        except self._errors as e:
            raise TransferError(
                f"cannot create NIXL agent {agent_name!r} with backends {list(backends)}: {e!r}; "
                "check UCX_TLS / UCX_NET_DEVICES (an empty UCX_TLS fails)"
            ) from e
        if not self._agent.backends:
            raise TransferError(
                f"NIXL agent {agent_name!r}: none of the backends {list(backends)} is available "
                f"(plugins: {self._agent.get_plugin_list()})"
            )
        regions = [
            (int(base), int(n), sp.dev, "")
            for (base, n), sp in zip(layout.allocations, spaces, strict=True)
        ]
        try:
            self._reg = self._agent.register_memory(regions, self.mem_kind) if regions else None
        except self._errors as e:
            raise TransferError(
                f"NIXL agent {agent_name!r}: registering {len(regions)} KV region(s) failed: {e!r}"
            ) from e
        self._peers: dict[
            str, tuple[tuple[GroupLayout | None, ...], tuple[MemorySpace | None, ...], str]
        ] = {}
        self._open: set[ReadHandle] = set()
        self._leaked: list[object] = []  # NIXL handles whose release failed; retried at shutdown

    # ------------------------------------------------------------------ peers
    def metadata(self) -> bytes:
        """This agent's NIXL metadata (connection info + registered regions) for the handshake."""
        with self._lock:
            return self._live().get_agent_metadata()

    def add_peer(
        self,
        peer_metadata: bytes,
        peer_groups: Sequence[GroupLayout | None],
        peer_spaces: Sequence[MemorySpace | None] | None = None,
    ) -> str:
        """Load a peer's NIXL metadata and remember its block addressing; returns the peer name.

        ``peer_groups`` is the peer's layout from the handshake
        (``AgentInfo.layout.group_layouts()``), ``peer_spaces`` its memory space
        per group (``AgentInfo.layout.memory_spaces()``; None: host memory); both
        must have this worker's group count.
        """
        if len(peer_groups) != len(self.layout.groups):
            raise TransferError(
                f"peer layout has {len(peer_groups)} groups but this worker has {len(self.layout.groups)}"
            )
        spaces = (
            tuple(peer_spaces)
            if peer_spaces is not None
            else tuple(None if g is None else HOST for g in peer_groups)
        )
        if len(spaces) != len(peer_groups):
            raise TransferError(
                f"peer gave {len(spaces)} memory spaces for {len(peer_groups)} groups"
            )
        kind = _one_kind(spaces, "the peer's")
        with self._lock:
            try:
                name = self._live().add_remote_agent(peer_metadata)
            except self._errors as e:
                raise TransferError(
                    f"NIXL agent {self.name!r}: loading peer metadata failed: {e!r}"
                ) from e
            name = name.decode() if isinstance(name, bytes) else str(name)
            self._peers[name] = (tuple(peer_groups), spaces, kind)
            return name

    def open_reads(self, peer: str) -> int:
        """READs from ``peer`` still in flight (posted, not yet settled or released)."""
        with self._lock:
            return sum(1 for h in self._open if h.peer == peer)

    def remove_peer(self, peer: str) -> None:
        """Forget a peer (disconnects). Its open reads are released first, which is
        not a fence (see :meth:`release`)."""
        with self._lock:
            for h in [h for h in self._open if h.peer == peer]:
                self._release_locked(h)
            if self._peers.pop(peer, None) is not None:
                try:
                    self._agent.remove_remote_agent(peer)
                except self._errors:
                    pass  # already gone: nothing left to tear down

    # ------------------------------------------------------------------ reads
    def read_blocks(
        self,
        peer: str,
        remote_block_ids: Sequence[Sequence[int]],
        local_block_ids: Sequence[Sequence[int]],
        notif: bytes = b"",
        slices: Sequence[Sequence[Sequence[tuple[int, int, int]]] | None] | None = None,
    ) -> ReadHandle:
        """Post ONE READ of the given blocks of every group; ``notif`` reaches the peer when done.

        Per group ``g``: peer block ``remote_block_ids[g][k]`` -> local block
        ``local_block_ids[g][k]`` (all layers of the group). Callers drop null
        blocks. With nothing to read the notification is sent on its own and
        the handle is already done. May block for the copy (see module doc).
        ``slices``: per group, the head spans to move when the TP sizes differ
        (see :func:`read_descriptors`).
        """
        if self._agent is None:
            raise TransferError(f"P/D transport {self.name!r} is shut down")
        try:
            peer_groups, peer_spaces, peer_kind = self._peers[peer]
        except KeyError:
            raise TransferError(
                f"unknown peer {peer!r}: call add_peer with its handshake answer first"
            ) from None
        try:
            local, remote = read_descriptors(
                self.layout.groups,
                peer_groups,
                remote_block_ids,
                local_block_ids,
                [None if s is None else s.dev for s in self.group_spaces],
                [None if s is None else s.dev for s in peer_spaces],
                slices,
            )
            regions = len(local)
            local, remote = coalesced(local, remote)
        except ValueError as e:
            raise TransferError(f"READ from {peer!r} refused: {e}") from e
        handle = ReadHandle(
            peer=peer,
            num_descs=len(local),
            nbytes=int(local[:, 1].sum()) if len(local) else 0,
            num_regions=regions,
        )
        with self._lock:
            self._live()
            if len(local) == 0:
                if notif:
                    self._notify_locked(peer, notif)
                handle.state = "DONE"
                return handle
            what = f"READ of {handle.nbytes} bytes ({handle.num_descs} descriptors, {handle.num_regions} regions) from {peer!r}"
            try:
                xfer = self._agent.initialize_xfer(
                    "READ",
                    self._agent.get_xfer_descs(local, self.mem_kind),
                    self._agent.get_xfer_descs(remote, peer_kind),
                    peer,
                    notif,
                )
            except self._errors as e:
                raise TransferError(
                    f"{what} could not be set up: {e!r} (a block outside the registered KV cache on "
                    "either side, or the peer's metadata is stale)"
                ) from e
            handle._xfer = xfer
            self._open.add(handle)
            try:
                state = self._agent.transfer(xfer)
            except self._errors as e:
                self._fail_locked(handle)
                raise TransferError(
                    f"{what} failed at post: {e!r}; is the prefill instance alive?"
                ) from e
            if state == "ERR":
                self._fail_locked(handle)
                raise TransferError(f"{what} failed at post; is the prefill instance alive?")
            if state == "DONE":
                self._finish_locked(handle)
            return handle

    def poll(self, handle: ReadHandle) -> Literal["DONE", "PROC"]:
        """Non-blocking state of a READ; raises :class:`TransferError` if it failed."""
        with self._lock:
            if handle.state == "DONE":
                return "DONE"
            if handle.state != "PROC":
                raise TransferError(f"READ from {handle.peer!r} is {handle.state.lower()}")
            try:
                state = self._live().check_xfer_state(handle._xfer)
            except self._errors as e:
                self._fail_locked(handle)
                raise TransferError(
                    f"READ of {handle.nbytes} bytes from {handle.peer!r} failed: {e!r}; "
                    "the prefill instance may have died"
                ) from e
            if state == "ERR":
                self._fail_locked(handle)
                raise TransferError(f"READ of {handle.nbytes} bytes from {handle.peer!r} failed")
            if state == "DONE":
                self._finish_locked(handle)
                return "DONE"
            return "PROC"

    def wait(self, handle: ReadHandle, timeout_s: float) -> None:
        """Block until the READ is done; never longer than ``timeout_s`` past the call.

        On timeout :class:`TransferTimeout` is raised and the READ stays open:
        releasing it would not stop NIXL from writing its destination blocks
        (see :meth:`release`), so the caller keeps those blocks until
        :meth:`poll` reports DONE or an error (a dead peer errors at once).
        A failure raises :class:`TransferError`.
        """
        start = time.monotonic()
        deadline = start + timeout_s
        spin_until = start + min(WAIT_SPIN_S, timeout_s)
        pause = 0.0
        while self.poll(handle) != "DONE":
            now = time.monotonic()
            if now >= deadline:
                raise TransferTimeout(
                    f"READ of {handle.nbytes} bytes from {handle.peer!r} not done after "
                    f"{timeout_s:g} s; still in flight (keep its destination blocks until poll() "
                    "settles it). Check that the prefill instance is alive and not stalled"
                )
            if now < spin_until:  # poll without a timer sleep (see WAIT_SPIN_S)
                time.sleep(0)
                continue
            # then back off so a 2-core host is not starved by polling
            time.sleep(pause)
            pause = min(0.001, pause * 2 or 0.00005)

    def release(self, handle: ReadHandle) -> None:
        """Stop tracking a READ that is still in flight. Idempotent.

        NOT a fence: over UCX tcp a READ from a stalled peer keeps writing its
        destination after release (and after remove_peer) once the peer
        resumes. Only reuse the destination blocks of a released READ
        when the peer is known dead; :meth:`shutdown` destroys the agent, which
        does stop late writes.
        """
        with self._lock:
            self._release_locked(handle)

    # ------------------------------------------------------------------ notifications
    def send_notif(self, peer: str, msg: bytes) -> None:
        """A notification not tied to a READ (e.g. "nothing to read, release the blocks")."""
        with self._lock:
            self._notify_locked(peer, msg)

    def get_notifs(self) -> dict[str, list[bytes]]:
        """New notifications since the last call, by sending agent name (prefill: reads done)."""
        with self._lock:
            return {
                (k.decode() if isinstance(k, bytes) else str(k)): list(v)
                for k, v in self._live().get_new_notifs().items()
            }

    # ------------------------------------------------------------------ teardown
    def shutdown(self) -> None:
        """Release open reads, drop peers, deregister the KV cache and destroy the agent.

        Destroying the agent stops UCX's progress thread, the one way known
        to guarantee no in-flight READ writes the KV cache afterwards. Idempotent.
        """
        with self._lock:
            if self._agent is None:
                return
            for h in list(self._open):
                self._release_locked(h)
            for x in self._leaked:
                try:
                    x.release()
                except self._errors:
                    pass
            self._leaked.clear()
            for peer in list(self._peers):
                try:
                    self._agent.remove_remote_agent(peer)
                except self._errors:
                    pass
            self._peers.clear()
            reg, self._reg = self._reg, None
            try:
                if reg is not None:
                    self._agent.deregister_memory(reg)
            except self._errors as e:
                raise TransferError(
                    f"NIXL agent {self.name!r}: deregistering the KV cache failed: {e!r}"
                ) from e
            finally:
                # Handles hold the agent too; with them gone this is the last reference.
                self._agent = None

    def __enter__(self) -> "PDTransport":
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    # ------------------------------------------------------------------ internals (lock held)
    def _live(self):
        if self._agent is None:
            raise TransferError(f"P/D transport {self.name!r} is shut down")
        return self._agent

    def _notify_locked(self, peer: str, msg: bytes) -> None:
        try:
            self._live().send_notif(peer, msg)
        except self._errors as e:
            raise TransferError(
                f"notification to {peer!r} failed: {e!r}; is the prefill instance alive?"
            ) from e

    def _finish_locked(self, handle: ReadHandle) -> None:
        self._drop_locked(handle)
        handle.state = "DONE"

    def _fail_locked(self, handle: ReadHandle) -> None:
        self._drop_locked(handle)
        handle.state = "ERR"

    def _release_locked(self, handle: ReadHandle) -> None:
        if handle.state == "PROC":
            self._drop_locked(handle)
            handle.state = "RELEASED"

    def _drop_locked(self, handle: ReadHandle) -> None:
        self._open.discard(handle)
        xfer, handle._xfer = handle._xfer, None
        if xfer is None:
            return
        try:
            xfer.release()
        except self._errors:
            # NIXL could not cancel it yet; keep it so shutdown retries instead of the GC.
            self._leaked.append(xfer)


__all__ = [
    "HOST",
    "MemorySpace",
    "PDTransport",
    "ReadHandle",
    "TransferError",
    "TransferTimeout",
    "allocation_spaces",
    "coalesced",
    "group_spaces",
    "memory_space",
    "read_descriptors",
]
