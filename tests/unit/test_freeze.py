"""tests/freeze.py: ``freeze`` returns only once every thread of the process is stopped."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from tests.freeze import freeze, thread_states, wait_stopped

# Eight threads that spin, so a thread that has not taken the stop yet shows as running.
_SPINNERS = """
import threading
def spin():
    while True:
        pass
for _ in range(8):
    threading.Thread(target=spin, daemon=True).start()
print("up", flush=True)
spin()
"""


def test_freeze_stops_every_thread_and_refuses_a_process_that_does_not_stop() -> None:
    proc = subprocess.Popen([sys.executable, "-c", _SPINNERS], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline() == "up\n"
        assert len(thread_states(proc.pid)) == 9
        # Under the GIL most spinners wait (S) at any instant: seen running once within 2 s.
        deadline, seen_running = time.monotonic() + 2.0, False
        while not seen_running and time.monotonic() < deadline:
            seen_running = "R" in thread_states(proc.pid)
            time.sleep(0.001)
        assert seen_running
        freeze(proc.pid)
        assert set(thread_states(proc.pid)) == {"T"}
        os.kill(proc.pid, signal.SIGCONT)
        # A process that is running is not taken for stopped: the wait gives up and says why.
        with pytest.raises(AssertionError, match="not stopped"):
            wait_stopped([proc.pid], timeout_s=0.2)
    finally:
        proc.kill()
        proc.wait()
    freeze(proc.pid)  # gone: nothing to wait for
    with pytest.raises(ProcessLookupError):
        thread_states(proc.pid)
