"""A real ``mooncake_master`` as a child process, for tests and single-node runs.

Why a subprocess and not a mock: the behaviours hybridkv depends on (put keeps the old value,
leases, eviction, what a dead master does to a client) live in the master, so tests must talk
to the real one. Everything binds 127.0.0.1 on ports picked free at start, so parallel test
runs do not collide and nothing is exposed beyond loopback.

Deliberately NOT passed: ``--enable_http_metadata_server`` (it binds 0.0.0.0 whatever host is
given). Clients use ``"P2PHANDSHAKE"`` as metadata server, which needs no extra process.

Never outliving the owner: a master runs in its own session (a Ctrl-C must not kill it before
the clients that use it are closed), so neither the terminal nor ``atexit`` stops it when the
owner is SIGKILLed. Each master therefore gets a watchdog: a ``sh`` blocked reading a pipe
whose only write end the owner holds. When the owner exits in ANY way the kernel closes it, the
read returns, and the watchdog SIGKILLs that master (checked by its command line, so a
recycled pid is never hit) and removes its temporary directory. PR_SET_PDEATHSIG is not used:
it fires when the *thread* that forked exits, so a master started from a short-lived thread
would die with it.

Supervision (``MasterSupervisor``): a master that dies is restarted on the SAME ports, so
clients, which reconnect to the address by themselves, need no new address; restarts are
bounded and logged.
"""

from __future__ import annotations

import atexit
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from types import TracebackType

from hybridkv.store.cpu_affinity import unpinned
from hybridkv.store.local_ports import free_port, reports_port_in_use
from hybridkv.store.logs import get_logger

__all__ = [
    "EmbeddedMaster",
    "MasterError",
    "MasterSupervisor",
    "find_master_binary",
    "INSTALL_HINT",
]

logger = get_logger(__name__)

# Runs as the watchdog: blocks until the owner's end of the pipe closes (stdin EOF), then
# kills the master if that pid still runs THIS master (its --rpc_port), and removes the dir.
_WATCHDOG = (
    "read _ignored; "
    'if tr "\\0" " " < /proc/"$1"/cmdline 2>/dev/null | grep -q -- "--rpc_port=$2 "; then kill -KILL "$1"; fi; '
    '[ -n "$3" ] && rm -rf -- "$3"'
)

INSTALL_HINT = (
    "install it with `pip install mooncake-transfer-engine-non-cuda==0.3.13.post1` "
    "(CPU machines; `mooncake-transfer-engine==0.3.13.post1` on CUDA ones) and the system "
    "libraries with `apt-get install -y libibverbs1 librdmacm1`"
)

# Master processes still alive at interpreter exit: a test that crashed between start() and
# stop() must not leave a process holding ports (and CI runners waiting on it). The processes
# are held strongly (not the EmbeddedMaster objects) so a master whose owner was garbage
# collected without stop() is still reaped.
_LIVE: "set[subprocess.Popen[bytes]]" = set()
_LIVE_LOCK = threading.Lock()


def _stop_all_at_exit() -> None:
    with _LIVE_LOCK:
        procs = list(_LIVE)
        _LIVE.clear()
    for p in procs:
        try:
            if p.poll() is None:
                p.terminate()
                try:
                    p.wait(timeout=2.0)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait(timeout=2.0)
        except Exception:  # noqa: BLE001 - best effort during interpreter shutdown
            pass


atexit.register(_stop_all_at_exit)


class MasterError(RuntimeError):
    """The master could not be found or did not come up; the message says what to do."""


def find_master_binary(name: str = "mooncake_master") -> str:
    """Prefer the binary of the running interpreter's environment over PATH.

    The pip wheel installs ``mooncake_master`` into the venv's bin directory, which is not on
    PATH when the venv is used without activation (``.venv/bin/python -m pytest``).
    """
    beside = Path(sys.executable).parent / name
    if beside.is_file() and os.access(beside, os.X_OK):
        return str(beside)
    found = shutil.which(name)
    if found:
        return found
    raise MasterError(f"`{name}` not found next to {sys.executable} nor on PATH: {INSTALL_HINT}")


PORT_ATTEMPTS = 3  # start(): how many times self-chosen ports are chosen again when one was taken


class _PortInUse(Exception):
    """The master exited at start because its rpc or metrics port was taken (its log says so, or
    another process listens on one of them now)."""


def _free_port() -> int:
    # Outside the ephemeral range (local_ports). A race stays (another process could bind the
    # port before the master does): start() chooses again when the master exits on a taken
    # port, waits until THIS master listens on it (listener_is), so a squatter is refused.
    return free_port("127.0.0.1")


def _listening_inodes(port: int) -> set[str] | None:
    """Socket inodes listening on TCP ``port`` (any address), from /proc/net/tcp{,6}; None
    where the kernel does not expose them (not Linux)."""
    found: set[str] = set()
    seen_any = False
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as f:
                next(f, None)  # the header
                seen_any = True
                for line in f:
                    cols = line.split()
                    # local_address is HEXADDR:HEXPORT; state 0A is LISTEN; inode is column 9
                    if (
                        len(cols) > 9
                        and cols[3] == "0A"
                        and int(cols[1].rsplit(":", 1)[1], 16) == port
                    ):
                        found.add(cols[9])
        except OSError:
            continue
    return found if seen_any else None


def listener_is(pid: int, port: int) -> bool | None:
    """Whether process ``pid`` itself holds the socket listening on ``port``.

    Why: "the port accepts connections" is not "OUR master is up". Between ``_free_port``
    choosing a port and the master binding it, any other process (another test's server, or
    another local user squatting the port) may take it; the master then fails to bind while
    start() would see the port open and hand clients a foreign listener (the suspected cause
    of a unit test whose SIGSTOPped master still answered). None where /proc cannot tell
    (not Linux): callers fall back to the open port alone."""
    return listener_among([pid], port)


def listener_among(pids: list[int], port: int) -> bool | None:
    """Whether one of ``pids`` holds the socket listening on ``port`` (a server's process
    tree: cli/server.py). /proc/net/tcp{,6} is read once for all of them. None where /proc
    cannot tell: not Linux, or no pid's descriptors could be read."""
    inodes = _listening_inodes(port)
    if inodes is None:
        return None
    readable = False
    for pid in pids:
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:  # unreadable (or gone: the caller's poll() sees an exit): cannot tell
            continue
        readable = True
        for fd in fds:
            try:
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if target.startswith("socket:[") and target[8:-1] in inodes:
                return True
    return False if readable else None


def _port_open(port: int, timeout_s: float = 0.2) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=timeout_s):
            return True
    except OSError:
        return False


class EmbeddedMaster:
    """Owns one ``mooncake_master`` process; ``address`` is what clients pass as master.

    ``default_kv_lease_ttl_ms`` is the time an object stays unremovable/unevictable after a
    read or exists lookup (Mooncake's default is 10 s). Tests lower it so remove() works
    without long sleeps.

    ``start_timeout_s`` bounds how long start() waits for the rpc port: 30 s, because a host
    whose cores are all busy (engines importing vLLM) can need more than 10 s to exec and link
    mooncake_master (about 1 s on an idle host). A master that exits fails start() at once,
    whatever this bound.
    """

    def __init__(
        self,
        default_kv_lease_ttl_ms: int = 10_000,
        start_timeout_s: float = 30.0,
        extra_args: list[str] | None = None,
        binary: str | None = None,
        log_dir: str | None = None,
        start: bool = True,
        rpc_port: int | None = None,
        metrics_port: int | None = None,
    ) -> None:
        self.default_kv_lease_ttl_ms = int(default_kv_lease_ttl_ms)
        self.start_timeout_s = float(start_timeout_s)
        self.extra_args = list(extra_args or [])
        self._binary = binary
        self._log_dir_arg = log_dir
        self._proc: subprocess.Popen[bytes] | None = None
        self._log_file = None
        self.log_path: Path | None = None
        self.rpc_port: int | None = rpc_port
        self.metrics_port: int | None = metrics_port
        self._fixed_ports = rpc_port is not None
        self._tmp_dir: Path | None = None  # created by start(), removed by stop() / the watchdog
        self._watch_fd: int | None = None
        self._watchdog: subprocess.Popen[bytes] | None = None
        self._lock = threading.Lock()
        if start:
            self.start()

    @property
    def address(self) -> str:
        if self.rpc_port is None:
            raise MasterError("EmbeddedMaster has not been started")
        return f"127.0.0.1:{self.rpc_port}"

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    def is_running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def log_tail(self, n_lines: int = 30) -> str:
        if self.log_path is None or not self.log_path.exists():
            return "<no log>"
        lines = self.log_path.read_text(errors="replace").splitlines()
        return "\n".join(lines[-n_lines:])

    def start(self) -> "EmbeddedMaster":
        """Start the master and wait until it listens on its rpc port.

        Ports this master chose itself are chosen again (up to ``PORT_ATTEMPTS`` times) when
        the master exits because one was taken meanwhile: ``_free_port`` releases a port
        before the master binds it, and on a busy host another process (an outgoing
        connection's ephemeral port included) can take it. Fixed ports are not changed:
        clients already hold the address."""
        with self._lock:
            if self.is_running():
                return self
            for attempt in range(1, PORT_ATTEMPTS + 1):
                try:
                    return self._start_locked()
                except _PortInUse as e:
                    if self._fixed_ports or attempt == PORT_ATTEMPTS:
                        raise MasterError(str(e)) from None
                    logger.warning(
                        "mooncake_master could not bind port %s or %s (taken since it "
                        "was chosen); choosing new ports (attempt %d of %d)",
                        self.rpc_port,
                        self.metrics_port,
                        attempt + 1,
                        PORT_ATTEMPTS,
                    )
            raise AssertionError("unreachable")

    def _start_locked(self) -> "EmbeddedMaster":
        """One start with the ports chosen now (``self._lock`` held)."""
        binary = self._binary or find_master_binary()
        if self._log_dir_arg:
            log_dir = Path(self._log_dir_arg)
        else:
            log_dir = self._tmp_dir = Path(tempfile.mkdtemp(prefix="hybridkv-mooncake-master-"))
        log_dir.mkdir(parents=True, exist_ok=True)
        if not self._fixed_ports:
            self.rpc_port, self.metrics_port = _free_port(), _free_port()
        if self.metrics_port is None or self.metrics_port == self.rpc_port:
            self.metrics_port = _free_port()
            while self.metrics_port == self.rpc_port:
                self.metrics_port = _free_port()
        self.log_path = log_dir / f"mooncake_master.{self.rpc_port}.log"
        cmd = [
            binary,
            "--rpc_address=127.0.0.1",
            f"--rpc_port={self.rpc_port}",
            "--metrics_host=127.0.0.1",
            f"--metrics_port={self.metrics_port}",
            f"--default_kv_lease_ttl={self.default_kv_lease_ttl_ms}",
            *self.extra_args,
        ]
        self._log_file = open(self.log_path, "ab")  # noqa: SIM115 - closed in stop()
        try:
            # Own process group: a Ctrl-C in the terminal must not kill the master before
            # the clients that still reference it are closed.
            # Unpinned: started from a vLLM CPU worker it would inherit the core the
            # forward pass spins on and starve (see cpu_affinity).
            with unpinned():
                self._proc = subprocess.Popen(
                    cmd,
                    stdin=subprocess.DEVNULL,
                    stdout=self._log_file,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                )
        except OSError as e:
            self._close_log()
            raise MasterError(f"could not execute {binary}: {e}; {INSTALL_HINT}") from e
        with _LIVE_LOCK:
            _LIVE.add(self._proc)
        self._start_watchdog()
        deadline = time.monotonic() + self.start_timeout_s
        while True:
            if self._proc.poll() is not None:
                rc = self._proc.returncode
                tail = self.log_tail()  # before _reap: the watchdog removes the temp dir
                self._reap()
                hint = f"; {INSTALL_HINT}" if "cannot open shared object" in tail else ""
                # (an rpc port taken is not logged: the master just exits 1; it has exited, so
                # whoever listens on one of its ports now is another process)
                held = [p for p in (self.rpc_port, self.metrics_port) if p and _listening_inodes(p)]
                taken = reports_port_in_use(tail) or bool(held)
                error = _PortInUse if taken else MasterError
                why = "".join(f": another process listens on port {p}" for p in held)
                raise error(
                    f"mooncake_master exited with code {rc} during start{why} "
                    f"(cmd: {' '.join(cmd)}){hint}\n--- tail of {self.log_path} ---\n{tail}"
                )
            foreign = False
            if _port_open(self.rpc_port):
                ours = listener_is(self._proc.pid, self.rpc_port)
                if ours is not False:  # True, or /proc cannot tell
                    return self
                foreign = True  # another process holds the port; ours has not bound (yet)
            if time.monotonic() > deadline:
                tail = self.log_tail()
                why = (
                    f"another process listens on port {self.rpc_port}, not this master (pid "
                    f"{self._proc.pid}); choose a free rpc_port"
                    if foreign
                    else ""
                )
                self._kill_locked(timeout_s=2.0)
                raise MasterError(
                    f"mooncake_master did not listen on {self.address} within {self.start_timeout_s:.1f}s"
                    f"{': ' + why if why else ''} "
                    f"(cmd: {' '.join(cmd)})\n--- tail of {self.log_path} ---\n{tail}"
                )
            time.sleep(0.02)

    def restart(self) -> "EmbeddedMaster":
        """Start again on the same ports (after a crash): clients keep their address."""
        with self._lock:
            if self.is_running():
                return self
            self._reap()
            self._fixed_ports = self.rpc_port is not None
        return self.start()

    def _start_watchdog(self) -> None:
        """The process that kills this master and removes its dir once the owner is gone."""
        assert self._proc is not None
        read_fd, self._watch_fd = os.pipe()  # both non-inheritable: only the watchdog gets read_fd
        try:
            self._watchdog = subprocess.Popen(
                [
                    "sh",
                    "-c",
                    _WATCHDOG,
                    "hybridkv-master-watchdog",
                    str(self._proc.pid),
                    str(self.rpc_port),
                    str(self._tmp_dir or ""),
                ],
                stdin=read_fd,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                start_new_session=True,
            )
        finally:
            os.close(read_fd)

    def _release_watchdog(self) -> None:
        """Closing our end wakes the watchdog (no-op kill for a stopped master, dir removal)."""
        if self._watch_fd is not None:
            os.close(self._watch_fd)
            self._watch_fd = None
        if self._watchdog is not None:
            try:
                self._watchdog.wait(timeout=2.0)
            except subprocess.TimeoutExpired:
                pass
            self._watchdog = None

    def stop(self, timeout_s: float = 5.0) -> None:
        """SIGTERM, then SIGKILL after ``timeout_s``; removes the temp dir; no-op when stopped."""
        with self._lock:
            self._kill_locked(timeout_s)
            self._remove_tmp_dir()

    def _remove_tmp_dir(self) -> None:
        if self._tmp_dir is not None:
            shutil.rmtree(self._tmp_dir, ignore_errors=True)
            self._tmp_dir = None

    def kill(self) -> None:
        """SIGKILL without grace: what tests use to simulate a crashed master."""
        with self._lock:
            if self.is_running():
                assert self._proc is not None
                self._proc.send_signal(signal.SIGKILL)
            self._reap()

    def _kill_locked(self, timeout_s: float) -> None:
        proc = self._proc
        if proc is not None and proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                proc.kill()
        self._reap()

    def _reap(self) -> None:
        proc = self._proc
        if proc is not None:
            try:
                proc.wait(timeout=5.0)
            except subprocess.TimeoutExpired:
                pass
            with _LIVE_LOCK:
                _LIVE.discard(proc)
        self._proc = None
        self._close_log()
        self._release_watchdog()

    def _close_log(self) -> None:
        if self._log_file is not None:
            self._log_file.close()
            self._log_file = None

    def __enter__(self) -> "EmbeddedMaster":
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    def __repr__(self) -> str:
        state = "running" if self.is_running() else "stopped"
        port = self.rpc_port if self.rpc_port is not None else "-"
        return f"EmbeddedMaster(127.0.0.1:{port}, {state}, log={self.log_path})"


class MasterSupervisor:
    """Restarts a master that died, on its ports, a bounded number of times.

    Why: with an embedded master, offload otherwise stays off until the engine restarts.
    Clients reconnect to the same address by themselves (within about 1 s); the new
    master holds no objects, which clients see through ``MooncakeBackend.master_epoch``.
    ``on_restart`` runs after each successful restart (e.g. to publish the new pid).
    """

    def __init__(
        self,
        master: EmbeddedMaster,
        max_restarts: int = 5,
        poll_s: float = 0.25,
        backoff_s: float = 0.5,
        on_restart: Callable[[EmbeddedMaster], None] | None = None,
    ) -> None:
        self.master = master
        self.max_restarts = int(max_restarts)
        self.poll_s = float(poll_s)
        self.backoff_s = float(backoff_s)
        self.on_restart = on_restart
        self.restarts = 0
        self.last_restart_s: float | None = (
            None  # seconds from noticing the death to listening again
        )
        self.gave_up = False
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=self._run, name="hybridkv-master-supervisor", daemon=True
        )
        self._thread.start()

    def _run(self) -> None:
        failures = 0
        while not self._stop.wait(self.poll_s):
            if self.master.is_running():
                continue
            if self._stop.is_set():
                return
            if self.restarts >= self.max_restarts:
                self.gave_up = True
                logger.error(
                    "embedded mooncake_master at %s died again after %d restart(s); "
                    "not restarting (store offload stays off until the engine restarts). Log tail:\n%s",
                    self.master.address,
                    self.restarts,
                    self.master.log_tail(),
                )
                return
            t0 = time.monotonic()
            logger.warning(
                "embedded mooncake_master at %s died; restarting it (%d/%d). Log tail:\n%s",
                self.master.address,
                self.restarts + 1,
                self.max_restarts,
                self.master.log_tail(10),
            )
            try:
                self.master.restart()
            except MasterError as e:
                failures += 1
                self.restarts += 1
                logger.warning("restarting mooncake_master failed: %s", e)
                self._stop.wait(self.backoff_s * (2 ** min(failures, 5)))
                continue
            failures = 0
            self.restarts += 1
            self.last_restart_s = time.monotonic() - t0
            logger.warning(
                "mooncake_master restarted at %s in %.2fs (pid %s); it holds no objects",
                self.master.address,
                self.last_restart_s,
                self.master.pid,
            )
            if self.on_restart is not None:
                try:
                    self.on_restart(self.master)
                except Exception:  # noqa: BLE001 - supervision must go on
                    logger.exception("master restart callback failed")

    def stop(self) -> None:
        """Stop supervising (before stopping the master on purpose)."""
        self._stop.set()
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout=5.0)
