"""tests/e2e/conftest.py's "server logs" section of a failed e2e test: besides each log's last
lines, the lines before the server's shutdown, polls left out (a soak's stalled decode shows
only in its shutdown lines)."""

from __future__ import annotations

from tests.e2e.conftest import LOG_TAIL_LINES, _log_tails

STALL = "(APIServer pid=1) INFO [loggers.py:335] Engine 000: Running: 0 reqs, Waiting: 7 reqs, Deferred: 5 reqs"
SHUTDOWN = [
    "(APIServer pid=1) INFO [launcher.py:254] [shutdown] API server: shutdown triggered",
    *[
        f"(APIServer pid=1) WARNING [system_utils.py:225] [shutdown] force killing sub process {i}"
        for i in range(20)
    ],
    "INFO:     Shutting down",
    "INFO:     Application shutdown complete.",
]


def test_a_stopped_servers_section_shows_its_state_before_the_shutdown(tmp_path):
    log = tmp_path / "soak_pd.decode.log"
    polls = ['INFO:     127.0.0.1:5 - "GET /metrics HTTP/1.1" 200 OK'] * 30
    log.write_text("\n".join(["boot"] * 40 + [STALL] + polls + SHUTDOWN) + "\n")
    section = _log_tails(tmp_path)
    last, before = section.split("--- soak_pd.decode.log (last ")[1:]
    assert STALL not in last and "Application shutdown complete." in last
    assert before.startswith(f"{LOG_TAIL_LINES} lines before its shutdown, polls left out) ---")
    assert before.rstrip().endswith(STALL)
    assert "GET /metrics" not in before and "[shutdown]" not in before


def test_a_log_without_a_shutdown_is_shown_once(tmp_path):
    log = tmp_path / "proxy.log"
    log.write_text("\n".join(f"line {i}" for i in range(30)) + "\n")
    section = _log_tails(tmp_path)
    assert section.count("--- proxy.log") == 1
    assert section.rstrip().endswith("line 29")
