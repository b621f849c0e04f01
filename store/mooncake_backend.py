"""Thin, bounded client over ``mooncake.store.MooncakeDistributedStore`` (0.3.13.post1).

The binding returns bare integers, blocks for tens of seconds when the master is gone or hung,
and runs on vLLM's scheduler and worker paths, where a stall is an outage. So this module keeps
few verbs, turns every failure into a per-key Mooncake code or a ``StoreError`` naming the
operation and the fix, and never blocks the caller beyond ``timeout_s``. Per-key verbs
(``put_from`` / ``get_into`` / ``put_bytes`` / ``remove``) return Mooncake's codes; ``exists``
(a ``list[bool]``) raises on failure; a call the client refuses or abandons (timeout, closed,
circuit open) raises ``StoreError`` with a hybridkv code, never a Mooncake one.

Binding facts (0.3.13.post1, tcp, P2PHANDSHAKE; the binding documents none of them)
* ``setup(...) -> int``: 0 ok; with no master listening it retries for about 90 s and returns
  -1, hence the TCP probe before it.
* ``batch_is_exist(keys) -> list[int]``: 1 / 0 / negative code (-900 dead, -901 hung master);
  renews the objects' lease. The master serves concurrent calls on several threads, hence
  ``exists_parts`` (bench/exists_split.py).
* ``register_buffer`` / ``unregister_buffer``: -600 for a region already (or not) registered.
  tcp does not need registration, RDMA does, so callers register; ``register`` is idempotent.
* ``batch_put_from``: an existing key answers 0 and KEEPS THE OLD VALUE (first writer wins);
  size 0 -> -600; larger than any free space -> -200.
* ``batch_get_into``: bytes read or -704 missing, -600 buffer too small (nothing written),
  -707 when the transfer outlasts the master's ``default_kv_lease_ttl`` (so the TTL must
  exceed the slowest batch transfer).
* ``get(key)`` answers ``b""`` for a missing key AND a dead master (``get_bytes`` asks
  ``get_size``); ``remove`` answers -706 while the object's lease runs.
* ``close()`` takes seconds (more with a dead master) and HOLDS THE GIL throughout (every other
  verb releases it), so it cannot be bounded from Python: reuse clients, close once.

Listeners: each client listens on a P2P handshake/RPC port and the TCP transport's data port,
which serves the whole registered memory, on all interfaces whatever ``local_hostname`` says;
``pin_listeners`` makes them bind ``local_hostname``'s address.

Master failure: a SIGKILLed master answers -900 at once, then each call blocks ~4.4 s;
``health_check()`` turns 2 a few seconds later. A master restarted on its port is rejoined
within about 1 s, holding no keys (the first put may answer -200 until the segment is
remounted). A hung master blocks calls ``MC_RPC_TIMEOUT_MS`` and answers -901.

How calls are bounded: every call runs on a small pool of daemon threads (not
``ThreadPoolExecutor``, whose exit join would turn one stuck call into a hung process) and the
caller waits at most ``timeout_s``, then gets ``StoreError(CALL_TIMEOUT)``. New calls fail at
once with ``CLIENT_STUCK`` while a metadata call (the master alone answers it) is stuck, or
while ``max_stuck_calls`` data calls are; the backend heals when abandoned calls return. An
RPC_FAIL / RPC_TIMEOUT opens a circuit (``retry_after_s``, half-open probes, doubling up to
``MAX_RETRY_FACTOR``; store/circuit.py) so calls fail fast with ``MASTER_UNREACHABLE``.
``exists_parts`` has one bound for all its parts. The hand-off costs tens of microseconds;
``timeout_s=None`` calls the binding directly. CAVEAT: an abandoned ``get_into`` may still
write its destination until ``stuck_calls`` is 0.

How long an abandoned call stays inside Mooncake: until Mooncake's own waits end it
(``MC_TCP_PROGRESS_TIMEOUT_SEC``, ``MC_TCP_STATUS_TIMEOUT_SEC``, ``MC_RPC_TIMEOUT_MS``, 30 s
each by default), its buffers pinned meanwhile. The backend sets all three to
``stall_bound_s`` (``timeout_s`` rounded up, at least ``STALL_FLOOR_S``) before the client
starts, unless the operator set them; they are process-wide, so the latest client's bound
applies (one client per process is the supported case). Healthy transfers progress
continuously, so the bound only shortens stalls.
"""

from __future__ import annotations

import contextlib
import ctypes
import math
import os
import queue
import socket
import threading
import time
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from concurrent.futures import wait as futures_wait
from types import TracebackType
from typing import Any, Callable, Iterable, Iterator, Mapping, Sequence, TypeVar

from hybridkv.store.circuit import Circuit
from hybridkv.store.cpu_affinity import unpinned
from hybridkv.store.logs import get_logger

__all__ = [
    "MooncakeBackend",
    "pin_listeners",
    "bound_mooncake_stalls",
    "without_own_stall_bounds",
    "StoreError",
    "ERROR_NAMES",
    "code_name",
    "OK",
    "NO_AVAILABLE_HANDLE",
    "INVALID_PARAMS",
    "OBJECT_NOT_FOUND",
    "OBJECT_ALREADY_EXISTS",
    "OBJECT_HAS_LEASE",
    "LEASE_EXPIRED",
    "TRANSFER_FAIL",
    "RPC_FAIL",
    "RPC_TIMEOUT",
    "CALL_TIMEOUT",
    "CLIENT_CLOSED",
    "CLIENT_STUCK",
    "MASTER_UNREACHABLE",
    "NOT_INSTALLED",
]

# --- Mooncake codes (mooncake-store/include/types.h ErrorCode; comment: when it is answered) -
OK = 0
INTERNAL_ERROR = -1  # setup() against an absent master, after ~90 s of retries
NO_AVAILABLE_HANDLE = -200  # put larger than the free segment space / segment not yet remounted
INVALID_PARAMS = -600  # buffer too small for get, size 0 put, double register_buffer
OBJECT_NOT_FOUND = -704  # get/get_size/remove of a missing key
OBJECT_ALREADY_EXISTS = -705
OBJECT_HAS_LEASE = -706  # remove while the lease of a recently read/put object runs
LEASE_EXPIRED = -707  # get_into whose transfer outlived the lease (64 MiB batch, 100 ms TTL)
TRANSFER_FAIL = -800
RPC_FAIL = -900  # master SIGKILLed (first call at once, later calls after ~4.4 s)
RPC_TIMEOUT = -901  # master SIGSTOPped, after 30 s

# --- hybridkv codes: the client refused or abandoned the call (outside Mooncake's range) ------
CALL_TIMEOUT = -10_001
CLIENT_CLOSED = -10_002
CLIENT_STUCK = -10_003
MASTER_UNREACHABLE = -10_004
NOT_INSTALLED = -10_005

ERROR_NAMES: dict[int, str] = {
    OK: "OK",
    INTERNAL_ERROR: "INTERNAL_ERROR",
    -100: "BUFFER_OVERFLOW",
    -101: "SHARD_INDEX_OUT_OF_RANGE",
    -102: "SEGMENT_NOT_FOUND",
    -103: "CLIENT_NOT_FOUND",
    NO_AVAILABLE_HANDLE: "NO_AVAILABLE_HANDLE",
    -300: "INVALID_VERSION",
    -400: "INVALID_KEY",
    -500: "WRITE_FAIL",
    INVALID_PARAMS: "INVALID_PARAMS",
    -601: "ILLEGAL_CLIENT",
    -700: "INVALID_WRITE",
    -701: "INVALID_READ",
    -702: "INVALID_REPLICA",
    -703: "REPLICA_IS_NOT_READY",
    OBJECT_NOT_FOUND: "OBJECT_NOT_FOUND",
    OBJECT_ALREADY_EXISTS: "OBJECT_ALREADY_EXISTS",
    OBJECT_HAS_LEASE: "OBJECT_HAS_LEASE",
    LEASE_EXPIRED: "LEASE_EXPIRED",
    TRANSFER_FAIL: "TRANSFER_FAIL",
    RPC_FAIL: "RPC_FAIL",
    RPC_TIMEOUT: "RPC_TIMEOUT",
    -1010: "UNAVAILABLE_IN_CURRENT_STATUS",
    -1011: "UNAVAILABLE_IN_CURRENT_MODE",
    -1700: "TENANT_QUOTA_EXCEEDED",
    CALL_TIMEOUT: "HKV_CALL_TIMEOUT",
    CLIENT_CLOSED: "HKV_CLIENT_CLOSED",
    CLIENT_STUCK: "HKV_CLIENT_STUCK",
    MASTER_UNREACHABLE: "HKV_MASTER_UNREACHABLE",
    NOT_INSTALLED: "HKV_NOT_INSTALLED",
}

_FIXES: dict[int, str] = {
    INTERNAL_ERROR: "check the master address and the client's stderr (glog) for the cause",
    NO_AVAILABLE_HANDLE: "the segments are full or not mounted yet: give the store more "
    "global_segment_size, lower the master's eviction watermark, or retry",
    INVALID_PARAMS: "check sizes (>0, buffer at least the object size) and that a buffer is not "
    "registered twice",
    OBJECT_NOT_FOUND: "the key is not in the store (never written, evicted, or lost with a master restart)",
    OBJECT_HAS_LEASE: "the object was read recently; retry after the master's default_kv_lease_ttl",
    RPC_FAIL: "the master is not reachable: is mooncake_master running at the configured address?",
    RPC_TIMEOUT: "the master did not answer in time: is it overloaded or stopped?",
    CALL_TIMEOUT: "the store did not answer within timeout_s; the master or a segment owner is "
    "hung or dead; raise timeout_s only if transfers are legitimately that slow",
    CLIENT_CLOSED: "the backend was closed; create a new MooncakeBackend",
    CLIENT_STUCK: "an earlier call is still blocked in Mooncake after its timeout; the backend "
    "recovers when it returns (check the master)",
    MASTER_UNREACHABLE: "a recent call found the master unreachable; calls fail fast for "
    "retry_after_s (doubled per failed probe, at most 4 x retry_after_s), then one is let "
    "through to probe again",
    NOT_INSTALLED: "pip install mooncake-transfer-engine-non-cuda==0.3.13.post1 and "
    "apt-get install -y libibverbs1 librdmacm1",
}

_UNREACHABLE_CODES = frozenset({RPC_FAIL, RPC_TIMEOUT})
# Calls that move object bytes to or from a segment owner; every other call needs the master only.
_DATA_OPS = frozenset({"put_from", "get_into", "put_from_parts", "get_into_parts"})
# The calls that read an object out of a segment. Mooncake 0.3.13's pip build waits for a
# read's transfer by polling on the calling thread (TransferEngineOperationState::
# wait_for_completion without USE_EVENT_DRIVEN_COMPLETION): a read from a stalled node burns a
# core for as long as it waits; writes do not poll (bench/read_poll_cpu.py). They run on their own
# threads at ``read_wait_nice`` (see MooncakeBackend).
_READ_OPS = frozenset({"get_into", "get_into_parts", "get_bytes"})

T = TypeVar("T")
_DEFAULT = object()  # "use self.timeout_s" (None already means unbounded)
_CLOSE_WAIT_S = 12.0  # close(): how long calls in flight may take to return first (a call
# against a dead master can block about 9 s; closing under it aborts the process)
logger = get_logger(__name__)


def code_name(code: int) -> str:
    """Name of a Mooncake or hybridkv code; unknown codes keep their number visible."""
    return ERROR_NAMES.get(code, f"UNKNOWN({code})")


class StoreError(Exception):
    """A store operation failed as a whole; ``code`` is a Mooncake or hybridkv code.

    ``pending`` (CALL_TIMEOUT only) is the abandoned call's future: it completes when the
    call has really returned, so a caller whose buffers the call may still touch knows
    when they are free again.
    """

    def __init__(self, op: str, code: int, detail: str = "", fix: str | None = None) -> None:
        self.op = op
        self.code = int(code)
        self.detail = detail
        self.pending: "Future[Any] | None" = None
        self.fix = fix if fix is not None else _FIXES.get(self.code, "")
        msg = f"mooncake {op} failed: {code_name(self.code)} ({self.code})"
        if detail:
            msg += f": {detail}"
        if self.fix:
            msg += f". Fix: {self.fix}"
        super().__init__(msg)


def _all_of(futs: Sequence["Future[Any]"]) -> "Future[None]":
    """A future that ends once every one of ``futs`` has (its result: None)."""
    out: "Future[None]" = Future()
    left = [len(futs)]
    lock = threading.Lock()

    def one_done(_f: "Future[Any]") -> None:
        with lock:
            left[0] -= 1
            last = left[0] == 0
        if last:
            out.set_result(None)

    for f in futs:
        f.add_done_callback(one_done)
    return out


class _DaemonPool:
    """Fixed set of daemon threads; a stuck call must never block interpreter exit.

    ``nice`` > 0: each thread lowers its own scheduling priority to that nice level when it
    starts (Linux: per thread; lowering needs no privilege, raising it back would, so a thread
    keeps it). See ``read_wait_nice`` for why the read calls want it."""

    def __init__(self, n: int, name: str, nice: int = 0) -> None:
        self._q: "queue.SimpleQueue[tuple[Future[Any], Callable[..., Any], tuple[Any, ...]] | None]" = queue.SimpleQueue()
        self.nice = int(nice)
        self._threads = [
            threading.Thread(target=self._run, name=f"{name}-{i}", daemon=True)
            for i in range(max(1, n))
        ]
        for t in self._threads:
            t.start()

    def _run(self) -> None:
        if self.nice > 0:
            try:
                os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), self.nice)
            except OSError as e:  # pragma: no cover - lowering one's own priority is always allowed
                logger.warning("could not lower the store read threads' priority: %s", e)
        while True:
            item = self._q.get()
            if item is None:
                return
            fut, fn, args = item
            if not fut.set_running_or_notify_cancel():
                continue
            try:
                fut.set_result(fn(*args))
            except BaseException as e:  # noqa: BLE001 - handed to the waiting caller
                fut.set_exception(e)

    def submit(self, fn: Callable[..., T], *args: Any) -> "Future[T]":
        fut: Future[T] = Future()
        self._q.put((fut, fn, args))
        return fut

    def shutdown(self, wait_s: float = 0.0) -> bool:
        """Stop the threads; wait up to ``wait_s`` for calls in flight. True if all returned.

        Closing the Mooncake client while one of these threads is still inside a call
        aborts the process (std::terminate, e.g. at interpreter exit with an epoch check in
        flight against a killed master), so close() waits here first.
        """
        for _ in self._threads:
            self._q.put(None)
        deadline = time.monotonic() + wait_s
        for t in self._threads:
            t.join(max(0.0, deadline - time.monotonic()))
        return not any(t.is_alive() for t in self._threads)


def _parse_address(addr: str) -> tuple[str, int]:
    host, sep, port = addr.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise StoreError(
            "setup",
            INVALID_PARAMS,
            f"master_address {addr!r} is not HOST:PORT",
            fix="pass the master as 'HOST:PORT', e.g. EmbeddedMaster().address",
        )
    return host, int(port)


# --- listeners on the configured host --------------------------------------------------------
# Mooncake 0.3.13's store client opens two TCP listeners in setup() and binds both to ALL
# interfaces, with no setting for the address (kvcache-ai/Mooncake's source):
#   * the P2P handshake / RPC listener: findAvailableTcpPort() in
#     mooncake-transfer-engine/src/transfer_metadata_plugin.cpp binds INADDR_ANY (IN6ADDR_ANY with
#     MC_USE_IPV6); transfer_engine_impl.cpp only *advertises* local_hostname, and
#     MC_TCP_BIND_ADDRESS is read only in the non-P2P "new RPC mapping" branch, to advertise too;
#   * the TCP transport's data listener: TcpContext in tcp_transport_session_impl.h binds
#     tcp::v6() (dual stack, "::") and falls back to tcp::v4() ("0.0.0.0").
# A real client listens on 0.0.0.0:<port> and [::]:<port> (tests/unit/test_store_listeners.py),
# whatever local_hostname, MC_TCP_BIND_ADDRESS, MC_RDMA_BIND_ADDRESS, MC_HANDSHAKE_PORT,
# MC_USE_IPV6 or MC_LEGACY_RPC_PORT_BINDING said; the whole registered KV cache is served on the
# data port. So hybridkv interposes bind() for Mooncake's own libraries only: their PLT slot for
# bind (the GOT entry, filled by the dynamic linker) is pointed at _wildcard_bind, which turns a
# wildcard address into the host the client advertises (local_hostname) and calls libc's bind.
# Peers connect to local_hostname anyway, so nothing reachable changes for them. An IPv6 wildcard
# becomes the IPv4-mapped host (::ffff:127.0.0.1): the socket stays dual stack and keeps accepting
# the IPv4 connections peers make. Specific addresses pass unchanged. Process-wide (one GOT per
# library): the host of the latest setup() applies; one host per process is the supported case.
# Linux/glibc, x86_64 and aarch64 ELF; anything else logs a warning and leaves the listeners as
# Mooncake opens them.

_BIND_T = ctypes.CFUNCTYPE(
    ctypes.c_int, ctypes.c_int, ctypes.c_void_p, ctypes.c_uint32, use_errno=True
)
_JUMP_RELOCS = {
    62: (6, 7),
    183: (1025, 1026),
}  # e_machine -> (GLOB_DAT, JUMP_SLOT): x86_64, aarch64
_bind_lock = threading.Lock()
_bind_to: "tuple[bytes, bytes] | None" = None  # (IPv4 4 bytes, IPv6 16 bytes); None: pass through
_bind_hook: Any = None  # the ctypes callback; must live as long as the process
_real_bind: Any = None
_patched_libs: set[str] = set()  # libraries whose bind() goes through the hook
_inspected_libs: set[str] = set()  # every Mooncake library read once (most never call bind)


def _host_of(local_hostname: str) -> str:
    """``local_hostname`` without Mooncake's optional ``:port`` (``[v6]:port`` too)."""
    h = local_hostname.strip()
    if h.startswith("["):
        return h[1 : h.index("]")] if "]" in h else h[1:]
    if h.count(":") == 1:
        return h.split(":", 1)[0]
    return h


def _listen_addresses(host: str) -> tuple[bytes, bytes]:
    """Packed (IPv4, IPv6) addresses to bind for ``host``: an IP literal or a resolvable name."""
    import ipaddress

    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        try:
            infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
        except OSError as e:
            raise StoreError(
                "setup",
                INVALID_PARAMS,
                f"local_hostname {host!r} does not resolve ({e})",
                fix="set local_hostname to this host's address as peers reach it",
            ) from e
        v4 = [i[4][0] for i in infos if i[0] == socket.AF_INET]
        ip = ipaddress.ip_address(v4[0] if v4 else infos[0][4][0])
        if ip.is_loopback and host != "localhost":  # e.g. Debian's "127.0.1.1 <hostname>" line
            logger.warning(
                "local_hostname %r resolves to %s here, so Mooncake's listeners "
                "bind loopback and peers on other hosts cannot reach them; set "
                "local_hostname to the IP address peers use",
                host,
                ip,
            )
    if ip.version == 4:
        return ip.packed, ipaddress.IPv6Address(f"::ffff:{ip}").packed
    # An IPv6 host: IPv4 sockets (the handshake unless MC_USE_IPV6) stay on IPv4 loopback.
    return ipaddress.IPv4Address("127.0.0.1").packed, ip.packed


def _wildcard_bind(fd: int, addr: int | None, addrlen: int) -> int:
    """bind() for Mooncake's libraries: a wildcard address becomes the configured host."""
    try:
        target = _bind_to
        if target is not None and addr:
            family = ctypes.c_uint16.from_address(addr).value
            if (
                family == socket.AF_INET
                and addrlen >= 8
                and ctypes.string_at(addr + 4, 4) == bytes(4)
            ):
                sa = ctypes.create_string_buffer(ctypes.string_at(addr, addrlen), addrlen)
                ctypes.memmove(ctypes.addressof(sa) + 4, target[0], 4)
                return int(_real_bind(fd, ctypes.addressof(sa), addrlen))
            if (
                family == socket.AF_INET6
                and addrlen >= 24
                and ctypes.string_at(addr + 8, 16) == bytes(16)
            ):
                sa = ctypes.create_string_buffer(ctypes.string_at(addr, addrlen), addrlen)
                ctypes.memmove(ctypes.addressof(sa) + 8, target[1], 16)
                return int(_real_bind(fd, ctypes.addressof(sa), addrlen))
    except Exception:  # noqa: BLE001 - a callback must not raise (ctypes would answer 0 = bound)
        logger.exception("bind interposer failed; binding as Mooncake asked")
    return int(_real_bind(fd, addr, addrlen))


def _bind_slots(path: str) -> list[int]:
    """Offsets (from the load base) of the GOT entries through which ``path`` calls bind()."""
    import struct

    with open(path, "rb") as f:
        data = f.read()
    if data[:4] != b"\x7fELF" or data[4] != 2 or data[5] != 1:  # 64-bit little endian only
        raise ValueError("not a 64-bit little-endian ELF")
    machine = struct.unpack_from("<H", data, 0x12)[0]
    if machine not in _JUMP_RELOCS:
        raise ValueError(f"ELF machine {machine} not handled")
    shoff = struct.unpack_from("<Q", data, 0x28)[0]
    shentsize, shnum = struct.unpack_from("<HH", data, 0x3A)
    sections = [
        struct.unpack_from("<IIQQQQIIQQ", data, shoff + i * shentsize) for i in range(shnum)
    ]
    slots = []
    for _name, kind, _fl, _va, off, size, link, _info, _al, _es in sections:
        if kind != 4:  # SHT_RELA
            continue
        symtab, strtab = sections[link], sections[sections[link][6]]
        for r in range(off, off + size, 24):
            r_offset, r_info = struct.unpack_from("<QQ", data, r)
            if (r_info & 0xFFFFFFFF) not in _JUMP_RELOCS[machine]:
                continue
            st_name = struct.unpack_from("<I", data, symtab[4] + (r_info >> 32) * 24)[0]
            start = strtab[4] + st_name
            if data[start : data.index(b"\0", start)] == b"bind":
                slots.append(r_offset)
    return slots


def _loaded_mooncake_libs() -> dict[str, int]:
    """Load base of every loaded shared object shipped in the mooncake wheel (dl_iterate_phdr)."""
    import os

    import mooncake

    pkg = os.path.realpath(os.path.dirname(mooncake.__file__))
    roots = (
        pkg + os.sep,
        os.path.dirname(pkg) + os.sep + "mooncake_",
    )  # mooncake/, mooncake_*.libs/

    class _Info(ctypes.Structure):
        _fields_ = [("addr", ctypes.c_size_t), ("name", ctypes.c_char_p)]

    found: dict[str, int] = {}

    def visit(info: Any, _size: int, _data: Any) -> int:
        name = (info.contents.name or b"").decode(errors="replace")
        if name and os.path.realpath(name).startswith(roots):
            found[os.path.realpath(name)] = int(info.contents.addr)
        return 0

    cb = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.POINTER(_Info), ctypes.c_size_t, ctypes.c_void_p)(
        visit
    )
    ctypes.CDLL(None).dl_iterate_phdr(cb, None)
    return found


def _write_slot(address: int, value: int) -> None:
    """Store a pointer in a GOT entry; a read-only one (full RELRO) is unprotected for the write."""
    import mmap

    page = address & ~(mmap.PAGESIZE - 1)
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    writable = False
    with open("/proc/self/maps") as maps:
        for line in maps:
            span, perms = line.split()[:2]
            lo, hi = (int(x, 16) for x in span.split("-"))
            if lo <= address < hi:
                writable = perms[1] == "w"
                break
    if not writable and libc.mprotect(page, mmap.PAGESIZE, 3) != 0:  # PROT_READ | PROT_WRITE
        raise OSError(ctypes.get_errno(), "mprotect of a GOT page failed")
    ctypes.c_void_p.from_address(address).value = value
    if not writable:
        libc.mprotect(page, mmap.PAGESIZE, 1)  # PROT_READ, as the dynamic linker left it


def pin_listeners(local_hostname: str | None) -> list[str]:
    """Make Mooncake's listeners in this process bind ``local_hostname``'s address (None: any).

    Installs the bind() interposer (see the comment above) in every loaded Mooncake library
    once, then sets the address the NEXT binds use: call it before ``setup()``. Returns the
    libraries whose bind() goes through the interposer; [] (and a warning) when this platform
    cannot be handled, in which case the listeners stay on all interfaces.
    """
    global _bind_to, _bind_hook, _real_bind
    target = None if local_hostname is None else _listen_addresses(_host_of(local_hostname))
    with _bind_lock:
        if target is not None or _patched_libs:
            try:
                if _bind_hook is None:
                    libc = ctypes.CDLL(None, use_errno=True)
                    _real_bind = _BIND_T(ctypes.cast(libc.bind, ctypes.c_void_p).value)
                    _bind_hook = _BIND_T(_wildcard_bind)
                hook = ctypes.cast(_bind_hook, ctypes.c_void_p).value
                for path, base in _loaded_mooncake_libs().items():
                    if path not in _inspected_libs:
                        for off in _bind_slots(path):
                            _write_slot(base + off, hook)
                            _patched_libs.add(path)
                        _inspected_libs.add(path)
            except (OSError, ValueError) as e:
                logger.warning(
                    "cannot pin Mooncake's listeners to %s (%s): they listen on ALL "
                    "interfaces; firewall their ports",
                    local_hostname,
                    e,
                )
                return []
        _bind_to = target
        return sorted(_patched_libs)


# The circuit's longest window, as a multiple of retry_after_s (1 s: 1, 2, 4, 4, ... s between
# probes while the master stays down): a master that comes back is noticed within 4 s (+ Mooncake's
# own ~1 s reconnect), well inside a 30 s recovery target (docs/soak.md), while a master that stays
# down costs one probe per 4 s instead of one per caller per second.
MAX_RETRY_FACTOR = 4.0
# How long a probe's slot is held when calls are unbounded (timeout_s None) and none reported.
PROBE_TTL_UNBOUNDED_S = 30.0


# Mooncake's own waits that decide how long a call we gave up on stays inside the binding
# (see the module docstring): TCP transfer progress and status (seconds), master RPCs (ms).
STALL_ENV_S = ("MC_TCP_PROGRESS_TIMEOUT_SEC", "MC_TCP_STATUS_TIMEOUT_SEC")
STALL_ENV_MS = "MC_RPC_TIMEOUT_MS"
STALL_ENV = (*STALL_ENV_S, STALL_ENV_MS)  # every wait variable hybridkv may set


# The shortest bound set: a master RPC that fails makes Mooncake's client ping fail, and 3
# failed pings reconnect it (non-HA). At 1-2 s a loaded master, or one stopped for 10 s, fails
# RPCs it would answer; 10 s still cuts Mooncake's 30 s waits to a third.
# What no bound fixes: a master stopped for about its --client_ttl (10 s) or longer may expire a
# segment owner when it resumes (before reading the pings queued meanwhile) and drop that
# segment's objects (rarely, at any bound: docs/soak.md). StoreScheduler._forget_missing handles
# the loss (tests/unit/test_store_segment_loss.py).
STALL_FLOOR_S = 10

# Set by the operator (present before hybridkv was imported): never overridden.
_OPERATOR_STALL_ENV = frozenset(n for n in STALL_ENV if n in os.environ)


def without_own_stall_bounds(env: "Mapping[str, str]") -> dict[str, str]:
    """``env`` (this process's environment) for a child process that will start its own store
    clients: minus the Mooncake wait variables ``bound_mooncake_stalls`` set here, keeping an
    operator's. Inherited, this process's bound would read as the operator's in the child and
    replace the child's own (e.g. a test's 30 s bound would reach a server it restarts, whose
    reads from a dead segment then wait 30-60 s instead of 10)."""
    own = {n for n in STALL_ENV if n not in _OPERATOR_STALL_ENV}
    return {k: v for k, v in env.items() if k not in own}


def bound_mooncake_stalls(stall_s: float | None) -> float | None:
    """Set Mooncake's transfer and RPC waits to ``stall_s`` (rounded up to whole seconds, at
    least ``STALL_FLOOR_S``) for the client about to start; an operator's value is kept. Each new client
    sets them again (its own bound; one client per process is the supported case).

    Returns the bound in force (seconds; the TCP progress wait, read back), or None when
    neither this call nor the environment sets one (Mooncake's 30 s then applies).
    """
    if stall_s is not None and stall_s > 0:
        whole = max(STALL_FLOOR_S, math.ceil(stall_s))
        for name, value in (
            (STALL_ENV_S[0], whole),
            (STALL_ENV_S[1], whole),
            (STALL_ENV_MS, whole * 1000),
        ):
            if name not in _OPERATOR_STALL_ENV:
                os.environ[name] = str(value)
    try:
        return float(os.environ[STALL_ENV_S[0]])
    except (KeyError, ValueError):
        return None


# --- the global segment's memory -------------------------------------------------------------
# Mooncake maps the global segment as anonymous memory in setup() and never touches it, so a
# page becomes resident only when the first object is written into it (by any client: peers'
# puts land here over TCP). The process's RSS therefore grows with the bytes the master places in
# untouched parts of the segment, up to global_segment_size, e.g. when a store node dies and its
# objects are saved again here (the RSS steps up by what is saved again; failed gets and exists
# themselves add no thread and no malloc arena). Populating the segment right after setup() makes
# that memory resident once, at start, where the operator budgeted it, instead of a late step.
# MADV_POPULATE_WRITE (Linux 5.14) faults the pages in without changing their content, so it
# is safe even after a peer has already written an object there.
_MADV_POPULATE_WRITE = 23


def _rw_anon_ranges() -> list[tuple[int, int]]:
    """[lo, hi) of this process's writable anonymous mappings."""
    out = []
    with open("/proc/self/maps") as f:
        for line in f:
            p = line.split()
            if len(p) == 5 and p[1].startswith("rw"):
                lo, hi = (int(x, 16) for x in p[0].split("-"))
                out.append((lo, hi))
    return out


def _new_ranges(
    before: list[tuple[int, int]], after: list[tuple[int, int]]
) -> list[tuple[int, int]]:
    """The parts of ``after`` that no range of ``before`` covers (merged mappings split back)."""
    res = []
    covered = sorted(before)
    for lo, hi in sorted(after):
        cur = lo
        for blo, bhi in covered:
            if bhi <= cur or blo >= hi:
                continue
            if blo > cur:
                res.append((cur, blo))
            cur = max(cur, bhi)
        if cur < hi:
            res.append((cur, hi))
    return res


def fault_in_segment(before: list[tuple[int, int]], segment_size: int) -> int:
    """Fault in the anonymous memory setup() mapped for a ``segment_size`` segment: the new
    writable anonymous ranges (since ``before``) of at least that size. Returns the bytes
    populated (0 and a warning where the kernel lacks MADV_POPULATE_WRITE)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    done = 0
    for lo, hi in _new_ranges(before, _rw_anon_ranges()):
        if hi - lo < segment_size:
            continue
        if libc.madvise(lo, hi - lo, _MADV_POPULATE_WRITE) != 0:
            logger.warning(
                "cannot populate the store segment (madvise: %s); its pages become "
                "resident as objects land in it",
                os.strerror(ctypes.get_errno()),
            )
            return done
        done += hi - lo
        break  # the segment's one mapping (a range holds it whole, or none does)
    if done < segment_size:
        # Mooncake mapped it otherwise (in pieces, e.g. MC_MAX_MR_SIZE chunks, or as hugepages):
        # nothing was populated, and the RSS grows as objects land, as without the setting.
        logger.warning(
            "populate_segment: no new mapping of the store segment's %d bytes was found; "
            "its pages become resident as objects land in it",
            segment_size,
        )
    return done


class MooncakeBackend:
    """One Mooncake store client with bounded calls; see the module docstring for semantics.

    ``global_segment_size`` is the memory this process contributes to the store (0: it only
    reads/writes other nodes' segments). ``local_buffer_size`` stages ``put_bytes``/``get_bytes``.
    ``timeout_s`` bounds every store call (None or 0: call directly, unbounded).
    ``max_stuck_calls``: abandoned DATA calls tolerated before new data calls are refused with
    CLIENT_STUCK (one stuck metadata call refuses everything: the master is hung). 1 suits one
    caller; a data path with independent requests wants more, so a call stuck on one hung
    segment owner does not refuse requests served by other nodes (each call is still bounded).
    ``listen_on_host`` (default True): Mooncake's two listeners (P2P handshake, TCP data) bind
    ``local_hostname``'s address instead of all interfaces (``pin_listeners``); False keeps
    Mooncake's own all-interfaces binds. ``listeners_pinned`` says whether the binds were pinned.
    ``stall_bound_s``: how long Mooncake may keep a call we gave up on (its TCP transfer and
    master RPC waits; default ``timeout_s`` rounded up, None: Mooncake's 30 s); see the module
    docstring. The attribute of the same name is the bound in force in this process.
    ``populate_segment`` (default False; the connector turns it on): make the global segment resident right after setup()
    (``fault_in_segment``) instead of page by page as objects land in it; ``segment_populated``
    is the bytes made resident.
    ``read_wait_nice`` (0-19; default 0, the connector sets 19): the read calls (``_READ_OPS``)
    run on their own threads at this nice level. Mooncake polls for a read's completion on
    the calling thread, so a read from a slow peer (a node whose own CPU is busy, e.g. the
    other engine on the same host) burns a core for as long as it waits, taking it from the
    forward pass and from the very peer that has to serve the read: under load those polls
    can take as much CPU as the forward pass. At nice 19 the poll only gets CPU nobody else wants (its bytes are
    moved by Mooncake's transfer threads, which keep their priority); the cost is noticing
    a finished read up to a scheduler period later on a saturated host. 0: one pool at
    normal priority for every call.
    """

    def __init__(
        self,
        master_address: str,
        local_hostname: str = "127.0.0.1",
        global_segment_size: int = 256 << 20,
        local_buffer_size: int = 64 << 20,
        protocol: str = "tcp",
        timeout_s: float | None = 5.0,
        retry_after_s: float = 1.0,
        workers: int = 4,
        rdma_devices: str = "",
        metadata_server: str = "P2PHANDSHAKE",
        max_stuck_calls: int = 1,
        listen_on_host: bool = True,
        stall_bound_s: Any = _DEFAULT,
        populate_segment: bool = False,
        read_wait_nice: int = 0,
    ) -> None:
        if (
            isinstance(read_wait_nice, bool)
            or not isinstance(read_wait_nice, int)
            or not 0 <= read_wait_nice <= 19
        ):
            raise ValueError(
                f"read_wait_nice={read_wait_nice!r}: expected a nice level 0-19 (0: off)"
            )
        self.read_wait_nice = read_wait_nice
        self.master_address = master_address
        self.max_stuck_calls = max(1, int(max_stuck_calls))
        # Stuck calls hold pool threads: keep some free so admitted calls are not queued.
        workers = max(int(workers), self.max_stuck_calls + 2)
        self._epoch = 0
        self._marker: str | None = None
        self._marker_stored = False
        self.timeout_s = timeout_s if timeout_s and timeout_s > 0 else None
        self.retry_after_s = float(retry_after_s)
        # A probe's call is bounded by timeout_s; its slot is freed after that if no verb reported.
        self._circuit = Circuit(
            self.retry_after_s,
            MAX_RETRY_FACTOR * self.retry_after_s,
            probe_ttl_s=(self.timeout_s or PROBE_TTL_UNBOUNDED_S) + self.retry_after_s + 1.0,
        )
        self.global_segment_size = int(global_segment_size)
        self.local_buffer_size = int(local_buffer_size)
        self._regions: dict[int, int] = {}
        self._lock = threading.Lock()
        self._stuck = 0
        self._stuck_meta = 0  # of which metadata calls (the master alone answers them)
        self._stuck_op = ""
        self._closed = False
        self._probe_call = (
            threading.local()
        )  # .probe: this thread's last call went as the circuit's probe
        self._pool: _DaemonPool | None = None
        self._read_pool: _DaemonPool | None = None  # the read calls' own threads (read_wait_nice)

        host, port = _parse_address(master_address)
        try:
            from mooncake.store import MooncakeDistributedStore
        except ImportError as e:  # includes a missing libibverbs.so.1
            raise StoreError("import", NOT_INSTALLED, str(e)) from e

        # setup() against a closed port retries for ~90 s; a TCP connect answers in microseconds.
        probe_s = min(self.timeout_s or 2.0, 2.0)
        try:
            with socket.create_connection((host, port), timeout=probe_s):
                pass
        except OSError as e:
            raise StoreError(
                "setup",
                RPC_FAIL,
                f"master {master_address} is not reachable ({e})",
                fix="start mooncake_master (tests: hybridkv.store.embedded_master.EmbeddedMaster) "
                "or correct master_address",
            ) from e

        # Mooncake binds its handshake and data listeners to all interfaces; bind them to the
        # address this client advertises instead (pin_listeners).
        self.listeners_pinned = (
            bool(pin_listeners(local_hostname if listen_on_host else None)) and listen_on_host
        )
        # Before setup(): an abandoned call must end within this, not Mooncake's 30 s.
        self.stall_bound_s = bound_mooncake_stalls(
            self.timeout_s if stall_bound_s is _DEFAULT else stall_bound_s
        )
        self._store = MooncakeDistributedStore()
        setup_timeout = max(self.timeout_s or 0.0, 30.0) if self.timeout_s else None
        maps_before = (
            _rw_anon_ranges() if populate_segment and self.global_segment_size > 0 else None
        )
        # The call threads, and the transfer threads Mooncake starts inside setup(), inherit
        # the creating thread's CPU affinity: keep them off the engine's pinned cores.
        with unpinned():
            self._pool = _DaemonPool(workers, name=f"mooncake-{port}")
            if read_wait_nice:
                self._read_pool = _DaemonPool(
                    workers, name=f"mooncake-read-{port}", nice=read_wait_nice
                )
            rc = self._bounded(
                "setup",
                self._store.setup,
                local_hostname,
                metadata_server,
                self.global_segment_size,
                self.local_buffer_size,
                protocol,
                rdma_devices,
                master_address,
                timeout=setup_timeout,
            )
        if rc != 0:
            self._pool.shutdown()
            if self._read_pool is not None:
                self._read_pool.shutdown()
            self._closed = True
            raise StoreError(
                "setup",
                rc,
                f"master={master_address} host={local_hostname} protocol={protocol} "
                f"segment={self.global_segment_size} local_buffer={self.local_buffer_size}",
                fix="check that the master is a mooncake_master of the same version, that the "
                "segment sizes fit in memory, and the client's stderr (glog)",
            )
        # Resident now rather than as objects land in it (see fault_in_segment).
        self.segment_populated = (
            fault_in_segment(maps_before, self.global_segment_size)
            if maps_before is not None
            else 0
        )

    # --- call machinery -----------------------------------------------------------------------

    @property
    def stuck_calls(self) -> int:
        """Calls abandoned after ``timeout_s`` that are still blocked inside Mooncake."""
        return self._stuck

    @property
    def circuit_open(self) -> bool:
        """True while a recent call found the master unreachable and none has answered since."""
        return self._circuit.is_open

    def _admit(self, op: str) -> bool:
        """Raise if the call may not go now; True when it goes as the circuit's probe."""
        if self._closed:
            raise StoreError(op, CLIENT_CLOSED)
        if self._stuck_meta or (
            op in _DATA_OPS and self._stuck - self._stuck_meta >= self.max_stuck_calls
        ):
            raise StoreError(
                op, CLIENT_STUCK, f"{self._stuck} abandoned call(s), last: {self._stuck_op}"
            )
        admitted, x = self._circuit.admit()
        if not admitted:
            raise StoreError(
                op,
                MASTER_UNREACHABLE,
                f"{self.master_address}; "
                + (f"next probe in {x:.2f}s" if x > 0 else "a probe call is in flight"),
            )
        return bool(x)

    def _bounded(
        self,
        op: str,
        fn: Callable[..., T],
        *args: Any,
        timeout: Any = _DEFAULT,
        while_waiting: Callable[[Callable[[], bool]], None] | None = None,
    ) -> T:
        """``fn(*args)`` on a pool thread, waited for at most ``timeout``.

        ``while_waiting(call_done)`` runs on the calling thread while the call is in flight
        (the binding releases the GIL, so both proceed at once): the data path hashes the
        next sub-batch there, until ``call_done()`` says the call has returned. Its time
        counts against the bound. Unbounded (direct) calls run it afterwards with a
        ``call_done`` that stays False (nothing to overlap). If it raises, the call
        is still waited for (bounded as ever) and the exception re-raised only once the
        call has returned; an abandoned call raises CALL_TIMEOUT with ``pending`` as usual.
        """
        wait = self.timeout_s if timeout is _DEFAULT else timeout
        if wait is not None and wait <= 0:
            wait = None
        if wait is None or self._pool is None:
            out = fn(*args)
            if while_waiting is not None:
                while_waiting(lambda: False)
            return out
        t0 = time.monotonic()
        pool = self._read_pool if op in _READ_OPS and self._read_pool is not None else self._pool
        fut = pool.submit(fn, *args)
        side_error: BaseException | None = None
        if while_waiting is not None:
            try:
                while_waiting(fut.done)
            except Exception as e:  # noqa: BLE001 - re-raised once the call cannot touch buffers
                side_error = e
        try:
            out = fut.result(timeout=max(0.0, wait - (time.monotonic() - t0)))
        except FutureTimeout:
            meta = op not in _DATA_OPS
            with self._lock:
                self._stuck += 1
                self._stuck_meta += meta
                self._stuck_op = op
            fut.add_done_callback(lambda _f: self._unstuck(meta))
            err = StoreError(
                op, CALL_TIMEOUT, f"no answer from {self.master_address} within {wait:.2f}s"
            )
            err.pending = fut
            raise err from side_error
        if side_error is not None:
            raise side_error
        return out

    def _unstuck(self, meta: bool) -> None:
        with self._lock:
            self._stuck -= 1
            self._stuck_meta -= meta

    def _call(
        self,
        op: str,
        fn: Callable[..., T],
        *args: Any,
        timeout: Any = _DEFAULT,
        while_waiting: Callable[[Callable[[], bool]], None] | None = None,
    ) -> T:
        with self._admitted(op):
            return self._bounded(op, fn, *args, timeout=timeout, while_waiting=while_waiting)

    @contextlib.contextmanager
    def _admitted(self, op: str) -> Iterator[None]:
        """Admit one call (``_admit``) and remember, for this thread's ``_note_codes``, whether
        it went as the circuit's probe; a probe that raises instead of answering is a failure."""
        probe = self._probe_call.probe = self._admit(op)
        try:
            yield
        except BaseException:
            self._probe_call.probe = False
            if probe:  # no answer to read: the master is not back yet
                self._circuit.failure(probe=True)
            raise

    def _call_concurrent(
        self,
        op: str,
        fn: Callable[..., T],
        arg_lists: Iterable[tuple[Any, ...]],
        timeout: Any = _DEFAULT,
    ) -> tuple[list[tuple[Any, ...]], list[T]]:
        """``fn(*args)`` for every ``args`` of ``arg_lists``, all in flight at once on the pool,
        each submitted as soon as the iterable yields it (the caller may build the next
        arguments while the first calls run: the binding releases the GIL). Returns the
        arguments and the results, both in ``arg_lists`` order.

        ONE bound for the whole set, counted from this call (as for a single call): on expiry
        every call still running is abandoned and counted in ``stuck_calls`` until it returns
        (``StoreError(CALL_TIMEOUT)``; its ``pending`` ends once all have). A call that raises
        is re-raised once every call has returned (the first failing one in order); so is an
        error from the iterable, after the calls already submitted have returned (or timed out)."""
        with self._admitted(op):
            return self._concurrent(fn, arg_lists, op, timeout)

    def _concurrent(
        self, fn: Callable[..., T], arg_lists: Iterable[tuple[Any, ...]], op: str, timeout: Any
    ) -> tuple[list[tuple[Any, ...]], list[T]]:
        wait = self.timeout_s if timeout is _DEFAULT else timeout
        if wait is not None and wait <= 0:
            wait = None
        if wait is None or self._pool is None:
            args_out = list(arg_lists)
            return args_out, [fn(*args) for args in args_out]
        t0 = time.monotonic()
        args_out: list[tuple[Any, ...]] = []
        futs: list[Future[T]] = []
        side_error: BaseException | None = None
        try:
            for args in arg_lists:
                args_out.append(args)
                futs.append(self._pool.submit(fn, *args))
        except Exception as e:  # noqa: BLE001 - re-raised once the submitted calls have ended
            side_error = e
        _done, running = futures_wait(futs, timeout=max(0.0, wait - (time.monotonic() - t0)))
        if running:
            meta = op not in _DATA_OPS
            with self._lock:
                self._stuck += len(running)
                self._stuck_meta += meta * len(running)
                self._stuck_op = op
            for fut in running:  # a call that returned meanwhile is released at once
                fut.add_done_callback(lambda _f: self._unstuck(meta))
            err = StoreError(
                op,
                CALL_TIMEOUT,
                f"no answer from {self.master_address} within {wait:.2f}s "
                f"({len(running)} of {len(futs)} concurrent calls)",
            )
            err.pending = _all_of(futs)
            raise err from side_error
        if side_error is not None:
            raise side_error
        return args_out, [fut.result() for fut in futs]

    def _note_codes(self, codes: Sequence[int]) -> None:
        probe, self._probe_call.probe = getattr(self._probe_call, "probe", False), False
        if any(c in _UNREACHABLE_CODES for c in codes):
            self._circuit.failure(probe)
        else:
            self._circuit.success()

    # --- master state -------------------------------------------------------------------------

    @property
    def master_epoch(self) -> int:
        """Times ``check_master_epoch`` found the master without this client's marker.

        A master that restarts comes back empty (every key gone); state kept beside the
        store that assumes keys are there (the scheduler's recently-saved set) must be
        dropped when this changes. Reading it costs no round trip.
        """
        return self._epoch

    def check_master_epoch(self, timeout_s: Any = _DEFAULT) -> int:
        """One existence query for a hard-pinned marker object this client wrote.

        Absent -> the master lost its objects (restart, or the marker's segment owner
        died): the epoch advances once and the marker is written again (retried on the
        next check while the store cannot take it yet). Raises StoreError like ``exists``.
        """
        if self._marker is None:
            import uuid

            self._marker = f"hkv-epoch/{uuid.uuid4().hex}"
        if self._marker_stored and not self.exists([self._marker], timeout_s=timeout_s)[0]:
            self._epoch += 1
            self._marker_stored = False
        if not self._marker_stored:
            self._marker_stored = self._put_marker(timeout_s) == 0
        return self._epoch

    def _put_marker(self, timeout_s: Any) -> int:
        from mooncake.store import ReplicateConfig

        cfg = ReplicateConfig()
        cfg.with_hard_pin = True  # never evicted: absence means the master lost it
        rc = self._call("put_marker", self._store.put, self._marker, b"1", cfg, timeout=timeout_s)
        self._note_codes([rc])
        return rc

    # --- verbs --------------------------------------------------------------------------------

    def exists(self, keys: Sequence[str], timeout_s: Any = _DEFAULT, shards: int = 1) -> list[bool]:
        """One ``batch_is_exist`` round trip; raises because a bool cannot say "unknown".

        ``timeout_s`` overrides the backend's bound for this call: the scheduler-side lookup
        usually wants a much tighter bound than a large transfer. ``shards`` > 1: the keys
        are asked as that many contiguous parts (``exists_parts``).
        """
        keys = list(keys)
        if not keys:
            return []
        n = max(1, min(int(shards), len(keys)))
        if n > 1:
            bounds = [len(keys) * i // n for i in range(n + 1)]
            return self.exists_parts(
                (keys[lo:hi] for lo, hi in zip(bounds, bounds[1:])), timeout_s=timeout_s
            )
        codes = self._call("exists", self._store.batch_is_exist, keys, timeout=timeout_s)
        return self._exists_answers(codes, len(keys))

    def exists_parts(self, parts: Iterable[Sequence[str]], timeout_s: Any = _DEFAULT) -> list[bool]:
        """One existence query asked as concurrent ``batch_is_exist`` calls, one per part.

        Every part is sent as soon as ``parts`` yields it and all are in flight at once on
        the call pool; the answers are joined in part order, so the result reads exactly like
        ``exists`` of the parts' keys concatenated. Why: the master serves concurrent calls
        on several threads, so a long query answers sooner than as one call, and the caller
        can name the next part while the first ones are in flight (bench/exists_split.py,
        bench/lookup_cost.py). Still one round trip for the caller, with
        one bound (``timeout_s``, as ``exists``; on expiry every part still running counts as a
        stuck metadata call until it returns), and the same codes: a negative one in any part
        fails the whole query (``StoreError`` with that code); a part answering a different
        number of codes than it has keys is an INTERNAL_ERROR, never a shifted answer.
        """
        sent, answers = self._call_concurrent(
            "exists",
            self._store.batch_is_exist,
            ((list(p),) for p in parts if len(p)),
            timeout=timeout_s,
        )
        if len(answers) != len(sent):
            raise StoreError(
                "exists", INTERNAL_ERROR, f"{len(sent)} parts sent, {len(answers)} answered"
            )
        codes: list[int] = []
        for (part,), got in zip(sent, answers):
            if len(got) != len(part):
                raise StoreError(
                    "exists",
                    INTERNAL_ERROR,
                    f"a part of {len(part)} keys answered {len(got)} codes",
                )
            codes += got
        return self._exists_answers(codes, len(codes))

    def _exists_answers(self, codes: Sequence[int], n_keys: int) -> list[bool]:
        # C-level passes only on the common path: a lookup asks ~12k keys at 128k tokens.
        if codes and min(codes) < 0:
            self._note_codes(codes)
            bad = [c for c in codes if c < 0]
            raise StoreError("exists", bad[0], f"{len(bad)} of {n_keys} lookups failed")
        self._probe_call.probe = False
        if n_keys:  # what _note_codes does for codes with no failure (no keys: no call answered)
            self._circuit.success()
        return list(map((1).__eq__, codes))

    def register(self, addr: int, size: int) -> None:
        """Register memory once; a region inside one already registered is a no-op.

        Mooncake answers -600 to a second registration of the same or an inner range, which
        would otherwise make "register the KV cache again after a reconfigure" an error.
        """
        if self._closed:
            raise StoreError("register", CLIENT_CLOSED)
        if size <= 0:
            raise StoreError("register", INVALID_PARAMS, f"size {size} must be > 0")
        with self._lock:
            for base, length in self._regions.items():
                if base <= addr and addr + size <= base + length:
                    return
            rc = self._store.register_buffer(int(addr), int(size))
            if rc != 0:
                raise StoreError(
                    "register",
                    rc,
                    f"addr=0x{addr:x} size={size} overlaps or was registered elsewhere",
                    fix="register whole allocations once; unregister before re-registering a changed region",
                )
            self._regions[int(addr)] = int(size)

    def unregister(self, addr: int) -> None:
        """Forget a region registered with ``register`` at exactly ``addr``; unknown: no-op."""
        with self._lock:
            if self._closed or addr not in self._regions:
                return
            rc = self._store.unregister_buffer(int(addr))
            del self._regions[addr]
        if rc != 0:
            raise StoreError("unregister", rc, f"addr=0x{addr:x}")

    def put_from(
        self,
        keys: Sequence[str],
        addrs: Sequence[int],
        sizes: Sequence[int],
        timeout_s: Any = _DEFAULT,
    ) -> list[int]:
        """Per key 0 or a negative Mooncake code; an existing key keeps its old value."""
        return self._batch("put_from", "batch_put_from", keys, addrs, sizes, timeout_s)

    def get_into(
        self,
        keys: Sequence[str],
        addrs: Sequence[int],
        sizes: Sequence[int],
        timeout_s: Any = _DEFAULT,
    ) -> list[int]:
        """Per key bytes read (the object size, may be < the buffer) or a negative code."""
        return self._batch("get_into", "batch_get_into", keys, addrs, sizes, timeout_s)

    def _batch(
        self,
        verb: str,
        binding: str,
        keys: Sequence[str],
        addrs: Sequence[Any],
        sizes: Sequence[Any],
        timeout_s: Any,
    ) -> list[int]:
        """One checked, bounded batch call of the binding's method ``binding``; per key its code."""
        keys, addrs, sizes = self._check_batch(verb, keys, addrs, sizes)
        if not keys:
            return []
        codes = self._call(
            verb, getattr(self._store, binding), keys, addrs, sizes, timeout=timeout_s
        )
        self._note_codes(codes)
        return list(codes)

    def put_from_parts(
        self,
        keys: Sequence[str],
        addrs: Sequence[Sequence[int]],
        sizes: Sequence[Sequence[int]],
        timeout_s: Any = _DEFAULT,
        while_waiting: Callable[[Callable[[], bool]], None] | None = None,
    ) -> list[int]:
        """Like ``put_from`` but each object is the concatenation of several regions.

        A KV block of a group lives in one region per layer; gathering them in
        C++ avoids a staging copy per block. ``while_waiting``: work for the calling
        thread while the call runs (see ``_bounded``); not run if the call is refused.
        """
        keys, addrs, sizes = self._check_parts("put_from_parts", keys, addrs, sizes)
        if not keys:
            return []
        codes = self._call(
            "put_from_parts",
            self._store.batch_put_from_multi_buffers,
            keys,
            addrs,
            sizes,
            timeout=timeout_s,
            while_waiting=while_waiting,
        )
        self._note_codes(codes)
        return list(codes)

    def get_into_parts(
        self,
        keys: Sequence[str],
        addrs: Sequence[Sequence[int]],
        sizes: Sequence[Sequence[int]],
        timeout_s: Any = _DEFAULT,
        while_waiting: Callable[[Callable[[], bool]], None] | None = None,
    ) -> list[int]:
        """Per key total bytes read into its regions (in order) or a negative code.
        ``while_waiting`` as for ``put_from_parts``."""
        keys, addrs, sizes = self._check_parts("get_into_parts", keys, addrs, sizes)
        if not keys:
            return []
        codes = self._call(
            "get_into_parts",
            self._store.batch_get_into_multi_buffers,
            keys,
            addrs,
            sizes,
            timeout=timeout_s,
            while_waiting=while_waiting,
        )
        self._note_codes(codes)
        return list(codes)

    def put_bytes(self, key: str, data: bytes) -> int:
        """Small objects (metadata, tests): 0 or a negative code; staged in the local buffer."""
        rc = self._call("put_bytes", self._store.put, key, data)
        self._note_codes([rc])
        return rc

    def replace_bytes(self, key: str, data: bytes) -> int:
        """Overwrite an object (``upsert``): 0 or a negative code. For repair and fault tests."""
        rc = self._call("replace_bytes", self._store.upsert, key, data)
        self._note_codes([rc])
        return rc

    def get_bytes(self, key: str) -> bytes | None:
        """The object, or None when it is missing; raises when the store cannot say.

        ``get`` answers b"" both for a missing key and a dead master; empty objects cannot be
        stored (-600), so an empty answer is classified with one ``get_size`` round trip.
        """
        data, size = self._call(
            "get_bytes", self._get_or_size, key
        )  # one admission: a probe's verdict is one
        if data:
            self._note_codes([0])
            return bytes(data)
        self._note_codes([size])
        if size == OBJECT_NOT_FOUND or size > 0:  # > 0: removed/replaced in between; report missing
            return None
        raise StoreError("get_bytes", size if size < 0 else INTERNAL_ERROR, f"key={key!r}")

    def _get_or_size(self, key: str) -> tuple[Any, int]:
        data = self._store.get(key)
        return (data, 0) if data else (data, self._store.get_size(key))

    def remove(self, key: str, force: bool = False) -> int:
        """0, -704 missing, -706 while the object's lease runs (``force`` skips the check)."""
        rc = self._call("remove", self._store.remove, key, force)
        self._note_codes([rc])
        return rc

    def close(self) -> None:
        """Idempotent. Blocks 1-2 s (about 10 s with a dead master) and CANNOT be bounded.

        ``MooncakeDistributedStore.close`` holds the GIL for its whole duration (no
        other Python thread runs meanwhile), so neither a worker thread nor a timeout
        can shorten it; every other verb releases the GIL. Reuse backends; close once at exit.
        """
        with self._lock:
            if self._closed:
                return
            self._closed = True
        deadline = time.monotonic() + _CLOSE_WAIT_S
        pools = [p for p in (self._pool, self._read_pool) if p is not None]
        if not all([p.shutdown(wait_s=max(0.0, deadline - time.monotonic())) for p in pools]):
            # A call is still inside Mooncake: closing under it would abort the
            # process. Leave the client to the process's exit instead.
            logger.warning(
                "store client %s closed with a call still in flight; "
                "not closing the Mooncake client under it",
                self.master_address,
            )
            return
        store = getattr(self, "_store", None)
        if store is not None:
            store.close()

    # --- internals ----------------------------------------------------------------------------

    @staticmethod
    def _check_batch(
        op: str, keys: Sequence[str], addrs: Sequence[int], sizes: Sequence[int]
    ) -> tuple[list[str], list[int], list[int]]:
        k, a, s = list(keys), [int(x) for x in addrs], [int(x) for x in sizes]
        if not (len(k) == len(a) == len(s)):
            raise StoreError(
                op,
                INVALID_PARAMS,
                f"{len(k)} keys, {len(a)} addrs, {len(s)} sizes",
                fix="pass one address and one size per key",
            )
        return k, a, s

    @staticmethod
    def _check_parts(
        op: str, keys: Sequence[str], addrs: Sequence[Sequence[int]], sizes: Sequence[Sequence[int]]
    ) -> tuple[list[str], list[list[int]], list[list[int]]]:
        k = list(keys)
        a = [[int(x) for x in row] for row in addrs]
        s = [[int(x) for x in row] for row in sizes]
        if not (len(k) == len(a) == len(s)) or any(len(x) != len(y) for x, y in zip(a, s)):
            raise StoreError(
                op,
                INVALID_PARAMS,
                f"{len(k)} keys, {len(a)} address rows, {len(s)} size rows",
                fix="pass one row of region addresses and one of sizes per key",
            )
        return k, a, s

    def __enter__(self) -> "MooncakeBackend":
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._closed else ("stuck" if self._stuck else "open")
        return (
            f"MooncakeBackend({self.master_address}, {state}, segment={self.global_segment_size})"
        )
