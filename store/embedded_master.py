"""A real ``mooncake_master`` as a child process, for tests and single-node runs.

Why a subprocess and not a mock: the behaviours hybridkv depends on (put keeps the old value,
leases, eviction, what a dead master does to a client) live in the master, so tests must talk
to the real one. Everything binds 127.0.0.1 on ports picked free at start, so parallel test
runs do not collide and nothing is exposed beyond loopback.

Deliberately NOT passed: ``--enable_http_metadata_server`` (it binds 0.0.0.0 whatever host is
given). Clients use ``"P2PHANDSHAKE"`` as metadata server, which needs no extra process.
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
from pathlib import Path
from types import TracebackType

from hybridkv.store.cpu_affinity import unpinned

__all__ = ["EmbeddedMaster", "MasterError", "find_master_binary", "INSTALL_HINT"]

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


def _free_port() -> int:
    # A tiny race (another process could take the port before the master binds it) is
    # accepted: start() detects a master that exits early and reports its log.
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


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
    """

    def __init__(
        self,
        default_kv_lease_ttl_ms: int = 10_000,
        start_timeout_s: float = 10.0,
        extra_args: list[str] | None = None,
        binary: str | None = None,
        log_dir: str | None = None,
        start: bool = True,
    ) -> None:
        self.default_kv_lease_ttl_ms = int(default_kv_lease_ttl_ms)
        self.start_timeout_s = float(start_timeout_s)
        self.extra_args = list(extra_args or [])
        self._binary = binary
        self._log_dir_arg = log_dir
        self._proc: subprocess.Popen[bytes] | None = None
        self._log_file = None
        self.log_path: Path | None = None
        self.rpc_port: int | None = None
        self.metrics_port: int | None = None
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
        with self._lock:
            if self.is_running():
                return self
            binary = self._binary or find_master_binary()
            log_dir = Path(self._log_dir_arg or tempfile.mkdtemp(prefix="hybridkv-mooncake-master-"))
            log_dir.mkdir(parents=True, exist_ok=True)
            self.rpc_port, self.metrics_port = _free_port(), _free_port()
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
            deadline = time.monotonic() + self.start_timeout_s
            while True:
                if self._proc.poll() is not None:
                    rc = self._proc.returncode
                    self._reap()
                    tail = self.log_tail()
                    hint = f"; {INSTALL_HINT}" if "cannot open shared object" in tail else ""
                    raise MasterError(
                        f"mooncake_master exited with code {rc} during start "
                        f"(cmd: {' '.join(cmd)}){hint}\n--- tail of {self.log_path} ---\n{tail}"
                    )
                if _port_open(self.rpc_port):
                    return self
                if time.monotonic() > deadline:
                    self._kill_locked(timeout_s=2.0)
                    raise MasterError(
                        f"mooncake_master did not listen on {self.address} within {self.start_timeout_s:.1f}s "
                        f"(cmd: {' '.join(cmd)})\n--- tail of {self.log_path} ---\n{self.log_tail()}"
                    )
                time.sleep(0.02)

    def stop(self, timeout_s: float = 5.0) -> None:
        """SIGTERM, then SIGKILL after ``timeout_s``; a no-op when already stopped."""
        with self._lock:
            self._kill_locked(timeout_s)

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
