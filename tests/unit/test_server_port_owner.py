"""A server is healthy only when its own process tree answers on its port.

``VllmServer`` / ``PDStack`` pick a free port and the server binds it only after 10-30 s
of imports. A process that takes the port meanwhile (another run's server, another local
user) answered /health with 200 and was taken for ours: the proxy would have sent clients'
prompts to it. Real sockets and real processes; the squatter is a plain HTTP server.
"""

from __future__ import annotations

import http.server
import subprocess
import sys
import threading

from hybridkv.cli.server import free_port, wait_healthy

_HEALTH = """
import http.server, sys
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200); self.end_headers(); self.wfile.write(b"ok")
    def log_message(self, *a):
        pass
http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), H).serve_forever()
"""


class _Ok(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        self.send_response(200)
        self.end_headers()
        self.wfile.write(b"ok")

    def log_message(self, *args: object) -> None:
        pass


def test_a_squatter_answering_health_is_not_taken_for_the_server():
    port = free_port()
    squatter = http.server.HTTPServer(("127.0.0.1", port), _Ok)
    threading.Thread(target=squatter.serve_forever, daemon=True).start()
    server = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])  # never binds
    try:
        why = wait_healthy(f"http://127.0.0.1:{port}", server, 10)
    finally:
        server.kill()
        squatter.shutdown()
        squatter.server_close()
    assert why is not None and f"another process listens on port {port}" in why, why


def test_the_servers_own_listener_in_a_child_process_is_healthy():
    port = free_port()
    # sh runs python as a child (not exec'd): the listener belongs to a descendant of proc
    server = subprocess.Popen(["sh", "-c", f"\"{sys.executable}\" -c '{_HEALTH}' {port}; true"])
    try:
        assert wait_healthy(f"http://127.0.0.1:{port}", server, 30) is None
    finally:
        subprocess.run(["pkill", "-P", str(server.pid)], check=False)
        server.kill()
