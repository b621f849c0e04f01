"""Fixtures shared by the end-to-end tests."""

from __future__ import annotations

import os

import pytest

from hybridkv.cli.harness import engine_start
from hybridkv.cli.server import log_tail
from hybridkv.store.embedded_master import EmbeddedMaster


@pytest.fixture(scope="package", autouse=True)
def engines_start_by_fork():
    """The e2e engines start their processes by fork, as vLLM does on GPU, not by the CPU
    platform's spawn, which imports vLLM again in every engine core and worker (8-13 s of a core
    each here; cli/harness/engine_start.py says how and why it is the same code). This is the suite's
    default (to keep the e2e tests within their time budget); ``HYBRIDKV_ENGINE_START=spawn pytest tests/e2e`` runs
    vLLM's own spawn path instead, and the store demo test keeps that path either way.
    The fork server starts here, before any test takes the set of its engines' pids (a fork
    server started by an engine's boot would be counted, and killed, as that engine's)."""
    chosen = os.environ.get(engine_start.ENV)
    if chosen is None:  # servers read it too (VllmServer.command)
        os.environ[engine_start.ENV] = "fork"
    try:
        if not engine_start.fork_requested():
            yield
            return
        engine_start.install_forkserver()
        yield
        engine_start.restore_spawn()
    finally:
        if chosen is None:
            del os.environ[engine_start.ENV]


@pytest.fixture(scope="module")
def master():
    """A real mooncake_master per test module; a short KV lease so tests can remove objects."""
    with EmbeddedMaster(default_kv_lease_ttl_ms=2_000) as m:
        yield m


LOG_TAIL_LINES = 12
LOG_TAIL_FILES = 6
LOG_LINE_CHARS = 240
LOG_TAIL_BYTES = 256 << 10  # read from each log's end only: an engine's log can be large
# Lines of a server's own shutdown (the plain tail of a server stopped after a failed test is
# mostly these) and the harness's /metrics polls: the lines before them say what the server
# was doing when the test failed (a soak's stalled decode: its requests waiting, deferred).
_SHUTDOWN_MARKS = (
    "[shutdown]",
    "Shutting down",
    "shutdown triggered",
    "Waiting for application shutdown",
    "Application shutdown complete",
    "Finished server process",
)
_POLL_MARKS = ('"GET /metrics', '"GET /health')


def _before_shutdown(lines: list[str]) -> list[str]:
    """The last lines before the server's shutdown began, without /metrics and /health polls."""
    first = next(
        (i for i, line in enumerate(lines) if any(m in line for m in _SHUTDOWN_MARKS)), len(lines)
    )
    kept = [line for line in lines[:first] if not any(m in line for m in _POLL_MARKS)]
    return kept[-LOG_TAIL_LINES:]


def _log_tails(root) -> str:  # noqa: ANN001
    """The last lines of each server / proxy log the test wrote under its tmp_path, and where
    they differ, its last lines before its shutdown (polls left out)."""
    logs = sorted((p for p in root.rglob("*.log") if p.is_file()), key=lambda p: p.stat().st_mtime)
    parts = []
    for path in logs[-LOG_TAIL_FILES:]:
        all_lines = log_tail(path, 1 << 30, LOG_TAIL_BYTES).splitlines()
        lines = all_lines[-LOG_TAIL_LINES:]
        parts.append(
            f"--- {path.relative_to(root)} (last {len(lines)} lines) ---\n"
            + "\n".join(line[:LOG_LINE_CHARS] for line in lines)
        )
        before = _before_shutdown(all_lines)
        if before and before != lines:
            parts.append(
                f"--- {path.relative_to(root)} (last {len(before)} lines before its shutdown, "
                "polls left out) ---\n" + "\n".join(line[:LOG_LINE_CHARS] for line in before)
            )
    return "\n".join(parts)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):  # noqa: ANN001
    """A failed e2e test (or its setup: a server that did not start) shows the tails of the
    logs its servers wrote. Why: CI shows only part of its output, and an HTTP error (a reset, a
    timeout) does not say which process stopped answering or why; the servers' own last lines
    do. Never raises: an error here would be pytest's INTERNALERROR and end the whole run."""
    report = yield
    try:
        tmp = getattr(item, "funcargs", {}).get("tmp_path")
        if report.failed and call.when in ("setup", "call") and tmp is not None:
            tails = _log_tails(tmp)
            if tails:
                report.sections.append(("server logs", tails))
    except Exception as e:  # noqa: BLE001 - see the docstring
        report.sections.append(("server logs", f"(could not read them: {e!r})"))
    return report
