"""A prefill instance, a decode instance and ``hybridkv proxy`` in front, on loopback.

What a P/D user runs, as one context manager: the demo's ``--pd`` mode and the
end-to-end tests talk to the proxy like a client would, and to the decode
instance directly for metrics, cache resets and the recompute reference.
Each process is a real subprocess (the proxy through the ``hybridkv`` CLI).
"""

from __future__ import annotations

import os
import pathlib
import signal
import subprocess
import sys
from collections.abc import Sequence
from types import TracebackType

from hybridkv.cli.server import (
    HOST,
    PORT_ATTEMPTS,
    ServerStartError,
    VllmServer,
    exited_on_taken_port,
    free_port,
    wait_healthy,
)
from hybridkv.connector.pd_auth import SECRET_ENV, SECRET_FILE_ENV, write_secret_file
from hybridkv.store.cpu_affinity import format_cpu_list, usable_cpus

PD_MODULE = "hybridkv.connector"


def pd_transfer_config(role: str, module_path: bool = True) -> dict:
    """HybridPDConnector for ``kv_producer`` (prefill) or ``kv_consumer`` (decode)."""
    cfg = {
        "kv_connector": "HybridPDConnector",
        "kv_role": role,
        "kv_load_failure_policy": "recompute",
    }
    if module_path:
        cfg["kv_connector_module_path"] = PD_MODULE
    return cfg


def with_extra_config(cfg: dict, **extra: object) -> dict:
    """A copy of the kv-transfer config ``cfg`` with ``extra`` added to its
    ``kv_connector_extra_config`` (the caller's dicts are not changed)."""
    return {
        **cfg,
        "kv_connector_extra_config": {**cfg.get("kv_connector_extra_config", {}), **extra},
    }


OMP_BIND_ENV = "VLLM_CPU_OMP_THREADS_BIND"
NOBIND = "nobind"  # vLLM's value for "do not bind this engine's threads"


def split_cpus(cpus: set[int] | None = None) -> tuple[str, str] | None:
    """Disjoint ``VLLM_CPU_OMP_THREADS_BIND`` values for prefill and decode on one host.

    Why: each vLLM CPU engine binds its OpenMP threads to every usable core, and while
    prefill holds blocks under a lease its engine steps in a tight loop. Two engines on
    the same cores then starve each other's step messages: measured on this 2-core
    machine, a decode leg took 5-62 s (the lease) in 4 of 8 turns, against 0.2-0.9 s in
    7 of 8 turns with one core each. None when there are fewer than two cores.
    """
    ordered = sorted(cpus if cpus is not None else usable_cpus())
    if len(ordered) < 2:
        return None
    half = len(ordered) // 2
    return format_cpu_list(ordered[:half]), format_cpu_list(ordered[half:])


def rank_cpus(
    prefill_tp: int, decode_tp: int, cpus: set[int] | None = None
) -> tuple[str, str] | None:
    """``VLLM_CPU_OMP_THREADS_BIND`` values for a prefill and a decode instance at any TP size:
    one ``|``-separated core list per rank (vLLM's CPU worker binds rank r to the r-th).

    At TP1 -> TP1 this is :func:`split_cpus` (disjoint halves). Otherwise, with at least one
    core per rank of both instances, every rank gets its own equal run of cores, prefill's
    ranks first. With fewer cores than ranks (TP2 -> TP2 on 2 cores): ``nobind`` for both
    (vLLM leaves the threads to the kernel). Why not one core per rank with the instances
    sharing cores, as the in-process tests/e2e/test_pd_tp.py pins them: measured through
    the servers, a prefill rank's gRPC handshake thread, pinned to the core its own step
    loop spins on while a lease is held, did not answer decode for 35 s ("connection
    attempt timed out") or the READ ended after the 60 s lease, from the first or second
    turn on (2 runs of 2, qwen3-next TP2 -> TP2); unpinned every READ landed (measured at
    TP2 -> TP2 only). tests/e2e/test_pd_store_multiconnector.py unpins its TP2 ranks for a
    like reason. None when there is one core.
    """
    if prefill_tp == decode_tp == 1:
        return split_cpus(cpus)
    ordered = sorted(cpus if cpus is not None else usable_cpus())
    slots = prefill_tp + decode_tp
    if len(ordered) >= slots:
        size = len(ordered) // slots
        runs = [ordered[i * size : (i + 1) * size] for i in range(slots)]
        return "|".join(map(format_cpu_list, runs[:prefill_tp])), "|".join(
            map(format_cpu_list, runs[prefill_tp:])
        )
    if len(ordered) < 2:
        return None
    return NOBIND, NOBIND


OMP_THREADS_ENV = "OMP_NUM_THREADS"
# The instances keep the proxy's idle connections 75 s (the proxy drops its own after 2 s), not
# uvicorn's 5 s: an instance process starved of CPU for longer than its keep-alive closes a
# pooled connection whose next request already waits unread (uvloop runs the expired timer
# first), and the proxy answers the client 502 "decode instance unreachable: ReadError" (one
# request in a P/D soak of 2026-12-02, 51 s into its warm phase). docs/config.md.
KEEP_ALIVE_ENV = "VLLM_HTTP_TIMEOUT_KEEP_ALIVE"
INSTANCE_KEEP_ALIVE_S = 75


def keep_alive_env() -> dict[str, str]:
    """The instances' keep-alive, unless the user set one."""
    return {} if KEEP_ALIVE_ENV in os.environ else {KEEP_ALIVE_ENV: str(INSTANCE_KEEP_ALIVE_S)}


def disjoint_core_envs(
    prefill_tp: int = 1, decode_tp: int = 1, cpus: set[int] | None = None
) -> tuple[dict[str, str], dict[str, str]]:
    """Extra environment for the prefill and the decode server: each rank its own cores
    (:func:`rank_cpus`), unless the user chose a binding (``VLLM_CPU_OMP_THREADS_BIND``
    set) or there are too few cores.

    With fewer cores than ranks (``nobind``) each rank also gets ``OMP_NUM_THREADS`` = its
    share of the cores (at least 1), unless the user set it: unbound, vLLM leaves torch at one
    OpenMP thread per core in EVERY rank (4 ranks x 2 threads on 2 cores), and libgomp's
    threads spin-wait between parallel regions, which took the CPU from the ranks' gRPC side
    channel and read threads (a ClaimLease reached a prefill rank 56 s after it was sent, a
    peer set-up took 15 s: tests/e2e/test_pd_tp_proxy.py)."""
    if OMP_BIND_ENV in os.environ:
        return {}, {}
    split = rank_cpus(prefill_tp, decode_tp, cpus)
    if split is None:
        return {}, {}
    envs = {OMP_BIND_ENV: split[0]}, {OMP_BIND_ENV: split[1]}
    if split == (NOBIND, NOBIND) and OMP_THREADS_ENV not in os.environ:
        n = len(cpus if cpus is not None else usable_cpus())
        share = str(max(1, n // (prefill_tp + decode_tp)))
        for env in envs:
            env[OMP_THREADS_ENV] = share
    return envs


def _keep_log(log: pathlib.Path | None) -> pathlib.Path | None:
    """Rename a server's log to ``NAME.N.log`` (the first free N) before it is restarted."""
    if log is None or not log.exists():
        return None
    n = 1
    while (old := log.with_name(f"{log.stem}.{n}{log.suffix}")).exists():
        n += 1
    log.rename(old)
    return old


class PDStack:
    """Start prefill, decode (in parallel), then the proxy; stop all on exit."""

    def __init__(
        self,
        model: str | os.PathLike,
        *,
        max_model_len: int = 4096,
        extra_args: Sequence[str] = (),
        log_dir: str | os.PathLike,
        startup_timeout_s: float = 300.0,
        prefill_config: dict | None = None,
        decode_config: dict | None = None,
        prefill_tp: int = 1,
        decode_tp: int = 1,
        prefill_args: Sequence[str] = (),
        decode_args: Sequence[str] = (),
        allow_mamba_cross_tp: bool = False,
        decode_dp: int = 1,
    ) -> None:
        """``prefill_tp`` / ``decode_tp``: each instance's ``--tensor-parallel-size`` (P/D pairs
        any sizes where one divides the other; see connector/pd_tp.py); ``decode_dp``: the decode
        instance's ``--data-parallel-size`` (one engine core per DP rank behind one API server,
        each rank ``decode_tp`` wide, each its own connector and block pool); ``prefill_args`` /
        ``decode_args``: one side's extra server arguments, after ``extra_args``.
        ``allow_mamba_cross_tp``: set the decode instance's switch of that name (its
        ``kv_connector_extra_config``; a decode-side setting, so the prefill's config is left
        as given): without it a hybrid Mamba / GDN model paired across TP sizes is refused per
        request and recomputed (connector/pd_tp.py says why it is off by default)."""
        log_dir = pathlib.Path(log_dir)
        self._model, self._log_dir, self._extra_args = model, log_dir, tuple(extra_args)
        self._common = dict(max_model_len=max_model_len, startup_timeout_s=startup_timeout_s)
        self.prefill_tp = prefill_tp
        self.decode_dp = decode_dp
        self.prefill = VllmServer(
            model,
            kv_transfer_config=prefill_config or pd_transfer_config("kv_producer"),
            log_path=log_dir / "prefill.log",
            extra_args=self._args(prefill_tp, prefill_args),
            **self._common,
        )
        self.decode = self._decode_server(
            decode_tp, decode_config, decode_args, allow_mamba_cross_tp
        )
        decode_config = self.decode.kv_transfer_config
        for name, value in (
            disjoint_core_envs(prefill_tp, decode_tp * decode_dp)[0] | keep_alive_env()
        ).items():
            self.prefill.extra_env.setdefault(name, value)
        # One deployment secret for the pair (signs kv_transfer_params and the side channel),
        # fresh per stack, unless the caller configured one.
        self.secret_file: pathlib.Path | None = None
        configured = any(
            (cfg or {}).get("kv_connector_extra_config", {}).get("auth_secret_file")
            or (cfg or {}).get("kv_connector_extra_config", {}).get("allow_unauthenticated")
            for cfg in (prefill_config, decode_config)
        )
        if (
            not configured
            and not os.environ.get(SECRET_ENV)
            and not os.environ.get(SECRET_FILE_ENV)
        ):
            self.secret_file = write_secret_file(log_dir / "pd-secret")
            for server in (self.prefill, self.decode):
                server.extra_env.setdefault(SECRET_FILE_ENV, str(self.secret_file))
        self.proxy_port = free_port()
        self.proxy_log = log_dir / "proxy.log"
        self._proxy: subprocess.Popen | None = None
        self.startup_timeout_s = startup_timeout_s

    def _args(self, tp: int, own: Sequence[str], dp: int = 1) -> list[str]:
        return [
            *self._extra_args,
            *(["--tensor-parallel-size", str(tp)] if tp != 1 else []),
            *(["--data-parallel-size", str(dp)] if dp != 1 else []),
            *own,
        ]

    def _decode_server(
        self,
        decode_tp: int,
        decode_config: dict | None,
        decode_args: Sequence[str],
        allow_mamba_cross_tp: bool,
        port: int | None = None,
    ) -> VllmServer:
        """The decode server for this stack's prefill: its TP and DP sizes, config (with the
        switch merged in) and its cores for the pair (:func:`disjoint_core_envs`: DP x TP ranks,
        one ``|``-separated core list each, which vLLM's CPU worker slices per DP rank)."""
        decode_config = decode_config or pd_transfer_config("kv_consumer")
        if allow_mamba_cross_tp:
            decode_config = with_extra_config(decode_config, allow_mamba_cross_tp=True)
        server = VllmServer(
            self._model,
            port=port,
            kv_transfer_config=decode_config,
            log_path=self._log_dir / "decode.log",
            extra_args=self._args(decode_tp, decode_args, self.decode_dp),
            **self._common,
        )
        for name, value in (
            disjoint_core_envs(self.prefill_tp, decode_tp * self.decode_dp)[1] | keep_alive_env()
        ).items():
            server.extra_env.setdefault(name, value)
        return server

    def replace_decode(
        self,
        decode_tp: int = 1,
        *,
        decode_config: dict | None = None,
        decode_args: Sequence[str] = (),
        allow_mamba_cross_tp: bool = False,
    ) -> pathlib.Path | None:
        """Stop the decode server and start another one on its port (the proxy's ``--decode``
        URL), e.g. at another ``--tensor-parallel-size``, with the stack's secret; wait until it
        is healthy. The prefill and the proxy keep running (what a rolling change of the decode
        tier does). Its previous log is kept as ``decode.N.log`` (returned). Its cores are the
        decode share of :func:`rank_cpus` for the new pair (the prefill keeps the binding it
        started with)."""
        port, old_env = self.decode.port, self.decode.extra_env
        self.decode.stop()
        old = _keep_log(self.decode.log_path)
        self.decode = self._decode_server(
            decode_tp, decode_config, decode_args, allow_mamba_cross_tp, port=port
        )
        if SECRET_FILE_ENV in old_env:
            self.decode.extra_env.setdefault(SECRET_FILE_ENV, old_env[SECRET_FILE_ENV])
        self.decode.start()
        return old

    @property
    def url(self) -> str:
        """The front door (what clients call)."""
        return f"http://{HOST}:{self.proxy_port}"

    def proxy_command(self) -> list[str]:
        return [
            sys.executable,
            "-m",
            "hybridkv.cli.main",
            "proxy",
            "--prefill",
            self.prefill.url,
            "--decode",
            self.decode.url,
            "--port",
            str(self.proxy_port),
        ]

    def start(self) -> None:
        # Both engines boot at once (each spends most of its start in imports and loading).
        for server in (self.prefill, self.decode):
            server.start_async()
        for server in (self.prefill, self.decode):
            server.wait_started()
        self.proxy_log.parent.mkdir(parents=True, exist_ok=True)
        # The proxy's port was chosen when the stack was built, a minute before it binds it
        # (both engines boot first): one taken meanwhile is chosen again (PORT_ATTEMPTS).
        for attempt in range(1, PORT_ATTEMPTS + 1):
            with open(self.proxy_log, "wb") as log:
                self._proxy = subprocess.Popen(
                    self.proxy_command(),
                    stdin=subprocess.DEVNULL,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                )
            problem = wait_healthy(self.url, self._proxy, 60)
            if not problem:
                return
            if attempt == PORT_ATTEMPTS or not exited_on_taken_port(self._proxy, self.proxy_log):
                raise ServerStartError(
                    f"hybridkv proxy {problem}; log: {self.proxy_log}\n"
                    + self.proxy_log.read_text()[-3000:]
                )
            taken, self.proxy_port = self.proxy_port, free_port()
            print(
                f"hybridkv: proxy port {taken} was taken before it bound; starting it again on "
                f"{self.proxy_port} (attempt {attempt + 1} of {PORT_ATTEMPTS})",
                file=sys.stderr,
            )

    def kill_prefill(self) -> None:
        """SIGKILL the prefill server's whole process group (API server, engine core, workers:
        what an OOM kill or a lost host does) and reap it. The proxy keeps running."""
        proc = self.prefill.proc
        if proc is None:
            return
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait(timeout=30)
        self.prefill.stop()  # the group is gone: only forgets the process

    def restart_prefill(self) -> pathlib.Path | None:
        """Start the prefill server again on its port (the proxy's ``--prefill`` URL) and wait
        until it is healthy. Its previous log is kept as ``prefill.N.log`` (returned)."""
        old = _keep_log(self.prefill.log_path)
        self.prefill.start()
        return old

    def stop(self) -> None:
        proxy, self._proxy = self._proxy, None
        if proxy is not None:
            try:
                os.killpg(proxy.pid, signal.SIGTERM)
                proxy.wait(timeout=10)
            except (ProcessLookupError, subprocess.TimeoutExpired):
                try:
                    os.killpg(proxy.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        self.decode.stop()
        self.prefill.stop()

    def __enter__(self) -> "PDStack":
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()
