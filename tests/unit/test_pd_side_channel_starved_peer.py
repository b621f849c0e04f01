"""A side-channel call to a prefill worker that is alive but gets no CPU for a while must be
bounded by its own timeout (``handshake_timeout_s``), not by gRPC's connect default.

Why: on the 2-core CI box, a TP2 -> TP2 P/D stack (4 ranks, 2 API servers, the proxy) starves
whole worker processes for 15-60 s (tests/e2e/test_pd_tp_proxy.py). gRPC gives up on a NEW
connection whose peer has not sent its HTTP/2 SETTINGS frame within 20 s (the channel's
``grpc.min_reconnect_backoff_ms`` default), whatever the call's deadline: measured here a
release with a 60 s bound failed after 20.1 s ("connection attempt timed out before receiving
SETTINGS frame", the failure of the lead's CI runs); with the channel's connect timeout set to
the call's bound (+ 1 s, CONNECT_MARGIN_MS, so the call's own deadline fires first) it is answered when the peer runs again (25.0 s), and a refused port still
fails at once (calls that fail drop their channel, so no backoff carries over). Real gRPC, a real HandshakeServer in a real process, stopped with SIGSTOP (the
starvation itself cannot be produced on demand; a stopped process is its limit case).
Shown failing: without the option (connector/pd_handshake.py before) -> HandshakeError at 20.1 s.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from hybridkv.connector.pd_handshake import release_blocks
from tests.freeze import freeze

STALL_S = 21.0  # just past gRPC's 20 s connect default: the shortest stall that shows the bug

SERVER = """
import time
from hybridkv.connector.pd_handshake import HandshakeServer
from tests.unit.test_pd_params_auth import INFO
s = HandshakeServer(INFO, on_release=lambda ids, reader=0, readers=1: None)
print(s.start(), flush=True)
time.sleep(300)
"""


def test_a_call_outlives_a_stalled_peer_within_its_own_bound():
    root = Path(__file__).resolve().parents[2]
    srv = subprocess.Popen(
        [sys.executable, "-c", SERVER], stdout=subprocess.PIPE, text=True, cwd=root
    )
    resume = threading.Timer(STALL_S, lambda: os.kill(srv.pid, signal.SIGCONT))
    try:
        port = int(srv.stdout.readline())
        freeze(srv.pid)
        resume.start()
        t = time.monotonic()
        release_blocks(f"127.0.0.1:{port}", ["req"], 60.0)  # raised HandshakeError at 20.1 s before
        assert STALL_S - 1 <= time.monotonic() - t < 60.0
    finally:
        resume.cancel()
        os.kill(srv.pid, signal.SIGCONT)
        srv.kill()
        srv.wait(timeout=30)
