"""Fixtures shared by the end-to-end tests."""

from __future__ import annotations

import pytest

from hybridkv.cli.server import log_tail
from hybridkv.store.embedded_master import EmbeddedMaster


@pytest.fixture(scope="module")
def master():
    """A real mooncake_master per test module; a short KV lease so tests can remove objects."""
    with EmbeddedMaster(default_kv_lease_ttl_ms=2_000) as m:
        yield m


LOG_TAIL_LINES = 12
LOG_TAIL_FILES = 6
LOG_LINE_CHARS = 240
LOG_TAIL_BYTES = 64 << 10  # read from each log's end only: an engine's log can be large


def _log_tails(root) -> str:  # noqa: ANN001
    """The last lines of each server / proxy log the test wrote under its tmp_path."""
    logs = sorted((p for p in root.rglob("*.log") if p.is_file()), key=lambda p: p.stat().st_mtime)
    parts = []
    for path in logs[-LOG_TAIL_FILES:]:
        lines = log_tail(path, LOG_TAIL_LINES, LOG_TAIL_BYTES).splitlines()
        parts.append(f"--- {path.relative_to(root)} (last {len(lines)} lines) ---\n"
                     + "\n".join(line[:LOG_LINE_CHARS] for line in lines))
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
