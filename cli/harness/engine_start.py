"""Start vLLM's engine processes by fork on the CPU platform, as vLLM does on GPU.

Why: vLLM's CPU platform forces the ``spawn`` start method (``platforms/cpu.py`` sets
``VLLM_WORKER_MULTIPROC_METHOD=spawn``, so that each worker's OpenMP reads the ``OMP_*``
environment vLLM sets for it). Every spawned process then imports vLLM again: 8-13 s of a
core each, two per engine (engine core, worker; one more per TP rank), the largest share of
the e2e tests' time. On GPU, vLLM starts both by fork
(its default, ``VLLM_WORKER_MULTIPROC_METHOD=fork``, unless CUDA is already initialized), so
fork is the path GPU users run; vLLM's CPU worker binds its OpenMP threads to the cores vLLM
chose for it itself (``init_cpu_threads_env``), so a forked worker runs where a spawned one
would. Only the start method changes: the same processes, the same code in each, the same
parent/child tree under a server.

Asked for by ``HYBRIDKV_ENGINE_START=fork`` (unset or ``spawn``: vLLM's own spawn). The e2e
tests set it unless the caller chose (tests/e2e/conftest.py, for the start time it saves); the
store demo test keeps vLLM's own spawn path:

- a server: ``python -m hybridkv.cli.harness.engine_start vllm.entrypoints.openai.api_server ARGS``
  (what :class:`hybridkv.cli.server.VllmServer` runs then): the API server forks its engine
  core, the engine core forks its workers.
- an in-process ``LLM`` (:func:`install_forkserver`): the caller has threads (Mooncake, NIXL
  and gRPC clients in a test process), where fork is not safe, so the engine core starts from
  a fork server that imported vLLM once and runs no threads; the caller's environment, CPU
  affinity, working directory and stdout/stderr (fds 1 and 2, passed over the fork server's
  socket) at ``Process()`` are applied in the child (a fork server's children would otherwise
  inherit the server's, frozen at its start, and a test that points fds 1 and 2 at a log
  file would find nothing there). The engine core forks its workers.
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.forkserver
import os
import runpy
import sys
from collections.abc import Callable
from typing import Any

ENV = "HYBRIDKV_ENGINE_START"  # "fork": start engine processes by fork (see the docstring)
_IN_FORK_SERVER = "HYBRIDKV_ENGINE_START_FORK_SERVER"  # set only while the fork server starts
# What the engine core and its workers import; the fork server imports it once.
ENGINE_MODULES = (
    "vllm.v1.engine.core",
    "vllm.v1.executor.multiproc_executor",
    "vllm.v1.worker.cpu_worker",
)


def fork_requested() -> bool:
    """Whether ``HYBRIDKV_ENGINE_START`` asks for fork (anything else but unset/"spawn" is refused)."""
    value = os.environ.get(ENV, "spawn")
    if value not in ("spawn", "fork"):
        raise ValueError(
            f"{ENV}={value!r}: use 'fork' (engine processes start by fork) or 'spawn' (vLLM's own)"
        )
    return value == "fork"


class _StartMethods:
    """Stands in for the ``multiprocessing`` module inside ``vllm.utils.system_utils``: vLLM's
    ``get_mp_context()`` asks it for ``spawn`` (the CPU platform's choice) and gets ``spawn_as``."""

    def __init__(self, spawn_as: Callable[[], Any]) -> None:
        self._spawn_as = spawn_as

    def get_context(self, method: str | None = None) -> Any:
        return self._spawn_as() if method == "spawn" else multiprocessing.get_context(method)

    def __getattr__(self, name: str) -> Any:
        return getattr(multiprocessing, name)


class _CallersStdio:
    """The caller's fds 1 and 2, as they point when its ``Process()`` is started.

    Pickled for a fork server (``multiprocessing.reduction.DupFd``), each fd travels over the
    server's socket; the child gets a copy of each and :meth:`apply` puts them in place."""

    def __init__(self, fds: tuple[Any, ...] = ()) -> None:
        self._fds = fds

    def __reduce__(self) -> tuple[Any, ...]:
        from multiprocessing import reduction

        return (_CallersStdio, ((reduction.DupFd(1), reduction.DupFd(2)),))

    def apply(self) -> None:
        sys.stdout.flush()
        sys.stderr.flush()
        for target_fd, handle in zip((1, 2), self._fds):
            fd = handle.detach()
            if fd != target_fd:
                os.dup2(fd, target_fd)


def _run_with_callers_state(
    env: dict[str, str],
    cpus: set[int],
    cwd: str,
    stdio: _CallersStdio,
    target: Callable[..., Any],
    args: tuple,
    kwargs: dict,
) -> Any:
    """In a fork server's child: the environment, affinity, directory and stdout/stderr the
    caller had."""
    stdio.apply()
    os.environ.clear()
    os.environ.update(env)
    os.sched_setaffinity(0, cpus)
    os.chdir(cwd)
    return target(*args, **kwargs)


class _ForkServerWithCallersState:
    """A ``forkserver`` context whose processes start with the caller's state (see above)."""

    def __init__(self) -> None:
        self._ctx = multiprocessing.get_context("forkserver")

    def Process(
        self,
        group: None = None,
        target: Callable[..., Any] | None = None,
        name: str | None = None,  # noqa: N802
        args: tuple = (),
        kwargs: dict | None = None,
        *,
        daemon: bool | None = None,
    ) -> Any:
        state = (
            dict(os.environ),
            os.sched_getaffinity(0),
            os.getcwd(),
            _CallersStdio(),
            target,
            tuple(args),
            dict(kwargs or {}),
        )
        return self._ctx.Process(
            group=group, target=_run_with_callers_state, name=name, args=state, daemon=daemon
        )

    def __getattr__(self, name: str) -> Any:
        return getattr(self._ctx, name)


def _replace_spawn(spawn_as: Callable[[], Any]) -> None:
    """Make vLLM's ``get_mp_context()`` use ``spawn_as`` where it would spawn; fails loudly if
    this vLLM builds its context elsewhere (a silent no-op would only make the tests slow)."""
    import vllm.utils.system_utils as system_utils

    get_mp_context = system_utils.get_mp_context
    if "multiprocessing" not in get_mp_context.__code__.co_names:
        raise RuntimeError(
            f"{ENV}=fork: this vLLM's get_mp_context does not call multiprocessing.get_context; "
            f"unset {ENV} (vLLM's own spawn) or update hybridkv.cli.harness.engine_start"
        )
    system_utils.multiprocessing = _StartMethods(spawn_as)


def install_fork() -> None:
    """In this process, vLLM starts its engine processes by fork (this process has no threads
    that a fork could copy mid-operation: a fresh server, an engine core)."""
    _replace_spawn(lambda: multiprocessing.get_context("fork"))


def install_forkserver() -> None:
    """In this (threaded) process, vLLM starts its engine core from a fork server that has
    imported vLLM (once per process; later calls return at once); its workers fork from it."""
    import vllm.utils.system_utils as system_utils

    if isinstance(system_utils.multiprocessing, _StartMethods):
        return
    multiprocessing.set_forkserver_preload([__name__])
    os.environ[_IN_FORK_SERVER] = "1"
    try:
        multiprocessing.forkserver.ensure_running()  # started now: its pid is in "before" sets
    finally:
        del os.environ[_IN_FORK_SERVER]
    _replace_spawn(_ForkServerWithCallersState)


def restore_spawn() -> None:
    """Undo :func:`install_fork` / :func:`install_forkserver` in this process (the fork server,
    if any, stays idle until this process exits)."""
    import vllm.utils.system_utils as system_utils

    system_utils.multiprocessing = multiprocessing


def main(argv: list[str] | None = None) -> None:
    """``python -m hybridkv.cli.harness.engine_start MODULE ARGS...``: run MODULE as ``__main__`` with
    engine processes started by fork."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv:
        raise SystemExit(
            "usage: python -m hybridkv.cli.harness.engine_start MODULE [ARGS...] "
            "(e.g. vllm.entrypoints.openai.api_server --model ...)"
        )
    install_fork()
    sys.argv = argv
    runpy.run_module(argv[0], run_name="__main__", alter_sys=True)


if os.environ.get(_IN_FORK_SERVER) == "1":  # imported by the fork server (install_forkserver)
    import importlib

    for _module in ENGINE_MODULES:
        importlib.import_module(_module)
    install_fork()

if __name__ == "__main__":
    main()
