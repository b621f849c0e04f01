"""Which master an engine talks to, and one store client per process.

Why: vLLM builds the connector twice per engine (a scheduler-side instance in the
engine core, a worker-side one in every worker process), and the worker side is
built FIRST. With no ``master_address`` configured, all of them must agree on one
embedded ``mooncake_master`` without any channel between them. They share the
engine id, so the first instance to take a file lock keyed by it starts the
master and publishes its address; the others read it. The owner stops it at
shutdown (and at interpreter exit). Instances in one process share one client,
because a Mooncake client contributes memory and costs a second to close.

Faults: the owner supervises its master (restarted on the same address, bounded,
logged; the record is updated with the new pid), and every shared client is
watched by a monitor thread that checks, every ``EPOCH_CHECK_S``, whether the
master still holds the client's marker object (``MooncakeBackend.check_master_epoch``):
state kept beside the store (the scheduler's recently-saved keys) is dropped when
``client.master_epoch`` changes, whether the master was embedded or external.
"""

from __future__ import annotations

import atexit
import fcntl
import json
import os
import re
import stat
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path

from hybridkv.store.embedded_master import EmbeddedMaster, MasterError, MasterSupervisor, _port_open
from hybridkv.store.logs import get_logger
from hybridkv.store.mooncake_backend import MooncakeBackend, StoreError

logger = get_logger(__name__)

_LOCK = threading.Lock()
_CLIENTS: dict[str, MooncakeBackend] = {}
_OWNED_MASTERS: dict[str, EmbeddedMaster] = {}
_SUPERVISORS: dict[str, MasterSupervisor] = {}
_MONITORS: dict[str, threading.Event] = {}  # address -> stop flag of its epoch monitor
EPOCH_CHECK_S = 2.0  # one existence query per client every this many seconds


class RendezvousError(MasterError):
    """The rendezvous directory is not private to us: using it could join a stranger's master."""


RENDEZVOUS_BASE: str | None = None  # None: tempfile.gettempdir(); tests point it elsewhere
_LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1")


def _rendezvous_dir() -> Path:
    """The private per-uid directory holding the lock and the master record.

    Why: it lives under a shared, world-writable /tmp, so another local user could plant it
    (or a symlink to it) and feed our engines a master of theirs. It is used only if it is a
    real directory (lstat: not a symlink) owned by us with no group/other permissions.
    """
    d = Path(RENDEZVOUS_BASE or tempfile.gettempdir()) / f"hybridkv-{os.getuid()}"
    try:
        os.mkdir(d, 0o700)
    except FileExistsError:
        pass
    st = os.lstat(d)
    problem = None
    if stat.S_ISLNK(st.st_mode):
        problem = "is a symlink"
    elif not stat.S_ISDIR(st.st_mode):
        problem = "is not a directory"
    elif st.st_uid != os.getuid():
        problem = f"is owned by uid {st.st_uid}, not {os.getuid()}"
    elif st.st_mode & 0o077:
        problem = f"has mode {stat.S_IMODE(st.st_mode):o} (group/other may access it)"
    if problem:
        raise RendezvousError(
            f"hybridkv: refusing the embedded master's rendezvous directory {d}: it {problem}. "
            f"Remove it (rm -rf {d}) or, if it is yours, chmod 700 {d}; or set master_address "
            "to an external master"
        )
    return d


def _open_nofollow(path: Path, flags: int) -> int:
    return os.open(path, flags | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)


def _write_record(record: Path, address: str, pid: int | None) -> None:
    """Write the record atomically: a fresh O_EXCL file of ours, renamed over the old one."""
    tmp = record.with_name(f"{record.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    try:
        os.unlink(tmp)
    except FileNotFoundError:
        pass
    fd = _open_nofollow(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL)
    with os.fdopen(fd, "w") as f:
        f.write(json.dumps({"address": address, "pid": pid}))
    os.replace(tmp, record)  # rename replaces a planted symlink itself, never its target


def _read_record(record: Path) -> dict | None:
    """The record if it is a regular file of ours (not followed through a symlink), else None."""
    try:
        fd = _open_nofollow(record, os.O_RDONLY)
    except (FileNotFoundError, OSError):
        return None
    with os.fdopen(fd) as f:
        st = os.fstat(f.fileno())
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid():
            return None
        try:
            info = json.loads(f.read())
        except ValueError:
            return None
    return info if isinstance(info, dict) else None


def _trusted_address(info: dict) -> str | None:
    """The recorded address if it is a loopback master our uid runs as that pid, else None.

    Why: the record is only a hint; joining the wrong endpoint would hand our KV to it.
    The pid must be alive, ours, a ``mooncake_master`` whose cmdline has ``--rpc_port=<port>``,
    and the port must answer.
    """
    try:
        address, pid = str(info["address"]), int(info["pid"])
        host, _, port_s = address.rpartition(":")
        port = int(port_s)
    except (KeyError, TypeError, ValueError):
        return None
    if host.strip("[]") not in _LOOPBACK_HOSTS or not 0 < port < 65536 or pid <= 0:
        return None
    try:
        if os.stat(f"/proc/{pid}").st_uid != os.getuid():
            return None
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return None  # dead (or not inspectable): not trusted
    if not argv or "mooncake_master" not in os.path.basename(argv[0].decode(errors="replace")):
        return None
    if f"--rpc_port={port}".encode() not in argv:
        return None
    return address if _port_open(port) else None


def embedded_master_address(engine_id: str, lease_ttl_ms: int) -> tuple[str, bool]:
    """Address of the embedded master for ``engine_id``; starts it if nobody has.

    Returns ``(address, owned)``: ``owned`` is True in the process that started it.
    """
    safe = re.sub(r"[^A-Za-z0-9_.-]", "_", engine_id)[:128]
    record = _rendezvous_dir() / f"{safe}.master.json"
    lock_fd = _open_nofollow(record.with_suffix(".lock"), os.O_RDWR | os.O_CREAT)
    with os.fdopen(lock_fd, "r+") as lock_file:
        fcntl.flock(lock_file, fcntl.LOCK_EX)
        try:
            info = _read_record(record)
            if info is not None:
                address = _trusted_address(info)
                if address is not None:
                    return address, False
                logger.warning("ignoring untrusted master record %s: %s", record, info)
            master = EmbeddedMaster(default_kv_lease_ttl_ms=lease_ttl_ms)
            _write_record(record, master.address, master.pid)

            def republish(m: EmbeddedMaster) -> None:
                _write_record(record, m.address, m.pid)

            with _LOCK:
                _OWNED_MASTERS[master.address] = master
                _SUPERVISORS[master.address] = MasterSupervisor(master, on_restart=republish)
            logger.info(
                "started embedded mooncake_master at %s (log %s)", master.address, master.log_path
            )
            return master.address, True
        finally:
            fcntl.flock(lock_file, fcntl.LOCK_UN)


@dataclass(frozen=True)
class ClientSettings:
    """Per-process client parameters (the first caller in a process decides them)."""

    local_hostname: str
    global_segment_size: int
    local_buffer_size: int
    protocol: str
    rdma_devices: str
    timeout_s: float
    # Abandoned calls tolerated before the client refuses new ones (CLIENT_STUCK): more than
    # one, so a call stuck on one hung segment owner does not refuse loads other nodes serve.
    max_stuck_calls: int = 4
    # Rebind Mooncake's wildcard listeners to local_hostname (MooncakeBackend listen_on_host).
    listen_on_host: bool = True
    # Make the global segment resident at start (MooncakeBackend populate_segment).
    populate_segment: bool = True
    # Nice level of the threads waiting for store reads (MooncakeBackend read_wait_nice).
    read_wait_nice: int = 0


def shared_client(master_address: str, settings: ClientSettings) -> MooncakeBackend:
    """The process's client for ``master_address`` (created on first use)."""
    with _LOCK:
        client = _CLIENTS.get(master_address)
        if client is None:
            client = MooncakeBackend(
                master_address,
                local_hostname=settings.local_hostname,
                global_segment_size=settings.global_segment_size,
                local_buffer_size=settings.local_buffer_size,
                protocol=settings.protocol,
                rdma_devices=settings.rdma_devices,
                timeout_s=settings.timeout_s,
                max_stuck_calls=settings.max_stuck_calls,
                listen_on_host=settings.listen_on_host,
                populate_segment=settings.populate_segment,
                read_wait_nice=settings.read_wait_nice,
            )
            _CLIENTS[master_address] = client
            _MONITORS[master_address] = _start_epoch_monitor(client)
        return client


def _start_epoch_monitor(client: MooncakeBackend) -> threading.Event:
    """A daemon thread that keeps ``client.master_epoch`` current (bounded calls, errors ignored)."""
    stop = threading.Event()
    try:
        client.check_master_epoch()  # the marker goes in now: a restart right after start still shows
    except StoreError:
        pass

    def run() -> None:
        seen = client.master_epoch
        while not stop.wait(EPOCH_CHECK_S):
            try:
                epoch = client.check_master_epoch(timeout_s=min(client.timeout_s or 1.0, 1.0))
            except StoreError:
                continue  # the master is down or slow: checked again once it answers
            if epoch != seen:
                logger.warning(
                    "the store master at %s lost its objects (restarted?): epoch %d",
                    client.master_address,
                    epoch,
                )
                seen = epoch

    thread = threading.Thread(target=run, name="hybridkv-store-epoch", daemon=True)
    stop.thread = thread  # type: ignore[attr-defined]  # joined by release_all
    thread.start()
    return stop


def release_all() -> None:
    """Close this process's clients, then stop the masters it owns (in that order)."""
    with _LOCK:
        clients = list(_CLIENTS.values())
        masters = list(_OWNED_MASTERS.values())
        supervisors = list(_SUPERVISORS.values())
        monitors = list(_MONITORS.values())
        for stop in monitors:
            stop.set()
        _CLIENTS.clear()
        _OWNED_MASTERS.clear()
        _SUPERVISORS.clear()
        _MONITORS.clear()
    for stop in monitors:  # no epoch check may be inside a client we close
        thread = getattr(stop, "thread", None)
        if thread is not None:
            thread.join(timeout=3.0)
    for supervisor in supervisors:  # a master stopped on purpose must not be restarted
        supervisor.stop()
    for client in clients:
        try:
            client.close()
        except Exception:  # noqa: BLE001 - shutdown must go on
            logger.debug("closing store client failed", exc_info=True)
    for master in masters:
        master.stop()


atexit.register(release_all)
