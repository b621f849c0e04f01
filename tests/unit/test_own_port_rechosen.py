"""Ports our own servers choose: outside the ephemeral range, and chosen again when taken.

Why: a P/D stack chooses its proxy's port, boots two engines for a minute, and only then starts
the proxy; a port from the ephemeral range can be taken meanwhile, and the proxy then dies with
"[Errno 98] ... address already in use", erroring every e2e test on that stack.
Real sockets, real processes and the real proxy; the vLLM servers are stand-in HTTP servers
(named as such: only their port handling is under test, and a real engine boot costs 47 s).
"""

from __future__ import annotations

import socket
import sys

import pytest

from hybridkv.cli import pd_stack, server
from hybridkv.store import local_ports
from hybridkv.store.local_ports import candidate_ranges, ephemeral_range, free_port

# A stand-in vLLM server: binds the port given after --port, answers 200 to every GET; like
# uvicorn, a taken port is an OSError "Address already in use" and exit code 1.
_STAND_IN = """
import http.server, sys
port = int(sys.argv[sys.argv.index("--port") + 1])
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200); self.end_headers(); self.wfile.write(b"ok")
    def log_message(self, *a):
        pass
http.server.HTTPServer(("127.0.0.1", port), H).serve_forever()
"""


class _StandInServer(server.VllmServer):
    def command(self) -> list[str]:
        return [sys.executable, "-c", _STAND_IN, "--port", str(self.port)]


def _squat(port: int, *, listen: bool = False) -> socket.socket:
    """Take ``port`` the way another process's socket does: bound, not listening (/health gets
    a refused connection, and our server's bind fails); or, with ``listen``, a listener that
    never answers, bound past a TIME_WAIT our own server left on the port."""
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    if listen:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind(("127.0.0.1", port))
    if listen:
        s.listen()
    return s


def test_free_ports_are_outside_the_ephemeral_range():
    low, high = ephemeral_range()
    if not candidate_ranges((low, high)):
        pytest.fail(
            f"this host's ephemeral range {low}-{high} leaves no port >= {local_ports.LOWEST_PORT} outside it"
        )
    ports = [free_port() for _ in range(50)]
    assert all(not (low <= p <= high) and p >= local_ports.LOWEST_PORT for p in ports), ports
    assert len(set(ports)) > 40  # random: concurrent callers rarely collide


def test_candidate_ranges_at_the_edges():
    assert candidate_ranges((32768, 60999)) == [range(20000, 32768), range(61000, 65536)]
    assert candidate_ranges((1024, 65535)) == []
    assert candidate_ranges((40000, 65535)) == [range(20000, 40000)]
    assert candidate_ranges((10000, 30000)) == [range(30001, 65536)]


def test_no_port_outside_the_range_falls_back_to_the_kernels_choice(monkeypatch):
    monkeypatch.setattr(local_ports, "ephemeral_range", lambda: (1024, 65535))
    port = free_port()
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))  # free


def test_a_taken_candidate_is_skipped(monkeypatch):
    port = free_port()
    while not local_ports._bindable("127.0.0.1", port + 1):
        port = free_port()
    monkeypatch.setattr(local_ports, "candidate_ranges", lambda ephemeral: [range(port, port + 2)])
    with _squat(port):
        assert {free_port() for _ in range(20)} == {port + 1}


def _hand_out_first(monkeypatch, module, port: int) -> None:
    handed = iter([port])
    real = local_ports.free_port
    monkeypatch.setattr(module, "free_port", lambda *a, **k: next(handed, None) or real())


def test_a_server_whose_own_port_was_taken_starts_on_a_new_one(monkeypatch, tmp_path):
    taken = free_port()
    _hand_out_first(monkeypatch, server, taken)
    with _squat(taken):
        srv = _StandInServer("/m", log_path=tmp_path / "srv.log", startup_timeout_s=20)
        assert srv.port == taken
        try:
            srv.start()
            assert srv.port != taken
            assert server.wait_healthy(srv.url, srv.proc, 5) is None
        finally:
            srv.stop()


def test_a_port_given_by_the_caller_is_kept_and_the_start_fails(tmp_path):
    taken = free_port()
    with _squat(taken):
        srv = _StandInServer("/m", port=taken, log_path=tmp_path / "srv.log", startup_timeout_s=20)
        with pytest.raises(server.ServerStartError, match="exited with code 1"):
            srv.start()
        assert srv.port == taken


def test_a_restart_keeps_the_port_it_was_healthy_on(tmp_path):
    srv = _StandInServer("/m", log_path=tmp_path / "srv.log", startup_timeout_s=20)
    srv.start()
    port = srv.port
    srv.stop()
    try:
        with _squat(port, listen=True):
            with pytest.raises(server.ServerStartError):
                srv.start()  # the proxy holds this URL: moving would strand it
        assert srv.port == port
    finally:
        srv.stop()


def test_a_pd_stack_proxy_whose_port_was_taken_starts_on_a_new_one(monkeypatch, tmp_path):
    monkeypatch.setattr(pd_stack, "VllmServer", _StandInServer)
    taken = free_port()
    _hand_out_first(monkeypatch, pd_stack, taken)
    with _squat(taken):
        stack = pd_stack.PDStack("/m", log_dir=tmp_path, startup_timeout_s=20)
        assert stack.proxy_port == taken
        with stack:
            assert stack.proxy_port != taken
            assert server.wait_healthy(stack.url, stack._proxy, 5) is None
        assert "address already in use" not in (tmp_path / "proxy.log").read_text().lower()
