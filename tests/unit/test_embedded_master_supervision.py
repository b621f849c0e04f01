"""The embedded master never outlives its owner, is restarted when it dies, and clients recover.

All against real ``mooncake_master`` processes and real Mooncake clients: what a client does
when its master dies and comes back on the same port (reconnect, segment remount, every key
gone) is Mooncake's behaviour, measured here, not assumed. Recovery times are printed
(``pytest -s`` shows them) and bounded.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import numpy as np

from hybridkv.store.embedded_master import EmbeddedMaster, MasterSupervisor
from hybridkv.store.mooncake_backend import MooncakeBackend, StoreError

RECOVERY_BOUND_S = 30.0  # the target for the hit rate to come back

_OWNER = r"""
import sys, time
from hybridkv.store.embedded_master import EmbeddedMaster
m = EmbeddedMaster()
print(m.pid, m.log_path.parent, flush=True)
time.sleep(3600)
"""


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def _until(cond, bound_s: float, step_s: float = 0.02) -> float | None:
    """Seconds until ``cond()`` held, or None past the bound."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < bound_s:
        if cond():
            return time.monotonic() - t0
        time.sleep(step_s)
    return None


def test_sigkilled_owner_takes_its_master_and_temp_dir_along() -> None:
    owner = subprocess.Popen([sys.executable, "-c", _OWNER], stdout=subprocess.PIPE, text=True)
    pid_s, dir_s = owner.stdout.readline().split()
    master_pid, tmp = int(pid_s), Path(dir_s)
    assert _alive(master_pid) and tmp.is_dir()
    owner.send_signal(signal.SIGKILL)  # no atexit, no finally: only the watchdog can act
    owner.wait(timeout=10)
    took = _until(lambda: not _alive(master_pid) and not tmp.exists(), 10.0)
    print(f"\nowner SIGKILLed: master gone and {tmp} removed after {took}s")
    assert took is not None, f"master alive={_alive(master_pid)} dir exists={tmp.exists()}"


def test_stop_removes_the_temp_dir_and_the_watchdog() -> None:
    m = EmbeddedMaster()
    tmp, watchdog = m.log_path.parent, m._watchdog
    assert tmp.is_dir() and watchdog is not None and watchdog.poll() is None
    m.stop()
    assert not tmp.exists()
    assert watchdog.poll() is not None  # no watchdog left waiting on a closed pipe


def _hits_again(client: MooncakeBackend, buf: np.ndarray) -> bool:
    """A fresh object can be written and found: the store serves hits again."""
    key = f"recovery/{uuid.uuid4().hex}"
    try:
        return client.put_from([key], [buf.ctypes.data], [4096]) == [0] and client.exists(
            [key]
        ) == [True]
    except StoreError:
        return False


def _client(address: str) -> tuple[MooncakeBackend, np.ndarray]:
    client = MooncakeBackend(
        address,
        global_segment_size=32 << 20,
        local_buffer_size=8 << 20,
        timeout_s=2.0,
        retry_after_s=0.5,
    )
    buf = np.arange(8192, dtype=np.uint8)
    client.register(buf.ctypes.data, buf.nbytes)
    return client, buf


def test_supervised_master_is_restarted_and_the_client_hits_again() -> None:
    master = EmbeddedMaster(default_kv_lease_ttl_ms=1000)
    restarted: list[int | None] = []
    sup = MasterSupervisor(
        master, max_restarts=2, poll_s=0.1, on_restart=lambda m: restarted.append(m.pid)
    )
    client, buf = _client(master.address)
    try:
        old_key = f"before/{uuid.uuid4().hex}"
        assert client.put_from([old_key], [buf.ctypes.data], [4096]) == [0]
        assert client.check_master_epoch() == 0 and client.check_master_epoch() == 0
        address, old_pid = master.address, master.pid
        os.kill(old_pid, signal.SIGKILL)  # a crash, not master.kill(): the supervisor must notice
        t0 = time.monotonic()
        took = _until(lambda: _hits_again(client, buf), RECOVERY_BOUND_S, step_s=0.1)
        print(
            f"\nsupervised master SIGKILLed: restarted in {sup.last_restart_s}s, "
            f"client writes+finds again after {took}s"
        )
        assert took is not None
        assert sup.restarts == 1 and restarted == [master.pid] and master.pid != old_pid
        assert master.address == address  # same port: the client needed no new address
        assert client.exists([old_key]) == [False]  # the new master holds none of the old objects
        # The client can tell: its marker is gone, so the epoch moves on exactly once.
        assert client.check_master_epoch() == 1 and client.check_master_epoch() == 1
        assert time.monotonic() - t0 < RECOVERY_BOUND_S
        # Bounded: the third death is not restarted (max_restarts=2 -> one more restart, then stop).
        os.kill(master.pid, signal.SIGKILL)
        assert _until(lambda: sup.restarts == 2 and master.is_running(), 10.0) is not None
        os.kill(master.pid, signal.SIGKILL)
        assert _until(lambda: sup.gave_up, 10.0) is not None
        assert not master.is_running() and sup.restarts == 2
    finally:
        sup.stop()
        client.close()
        master.stop()


def test_external_master_restarted_on_its_port_client_reconnects_and_breaker_closes() -> None:
    """No supervisor: an operator's master dies and another one comes up on the same port."""
    first = EmbeddedMaster(default_kv_lease_ttl_ms=1000)
    port = first.rpc_port
    client, buf = _client(first.address)
    second = None
    try:
        assert _hits_again(client, buf) and client.check_master_epoch() == 0
        first.kill()
        down = _until(lambda: not _hits_again(client, buf), 10.0)
        assert down is not None  # the client sees the outage (RPC_FAIL / open circuit)
        t0 = time.monotonic()
        second = EmbeddedMaster(default_kv_lease_ttl_ms=1000, rpc_port=port)
        took = _until(lambda: _hits_again(client, buf), RECOVERY_BOUND_S, step_s=0.1)
        print(f"\nexternal master replaced on port {port}: client writes+finds again after {took}s")
        assert took is not None and time.monotonic() - t0 < RECOVERY_BOUND_S
        assert not client.circuit_open  # the circuit closed again (a success closes it)
        assert client.check_master_epoch() == 1
    finally:
        client.close()
        first.stop()
        if second is not None:
            second.stop()


def test_session_supervises_its_master_and_clients_see_the_new_epoch(monkeypatch) -> None:
    """The connector's path: embedded_master_address + shared_client, as vLLM builds them."""
    import json

    from hybridkv.store import session

    monkeypatch.setattr(session, "EPOCH_CHECK_S", 0.2)
    engine = f"supervision-{uuid.uuid4().hex[:8]}"
    address, owned = session.embedded_master_address(engine, 1000)
    assert owned
    try:
        settings = session.ClientSettings("127.0.0.1", 32 << 20, 8 << 20, "tcp", "", 2.0)
        client = session.shared_client(address, settings)
        assert client.max_stuck_calls == 4 and client.master_epoch == 0
        record = session._rendezvous_dir() / f"{engine}.master.json"
        old_pid = json.loads(record.read_text())["pid"]
        os.kill(old_pid, signal.SIGKILL)
        took = _until(lambda: client.master_epoch == 1, RECOVERY_BOUND_S, step_s=0.05)
        print(f"\nsession master SIGKILLed: client epoch 0 -> 1 after {took}s")
        assert took is not None
        info = json.loads(record.read_text())
        assert info["address"] == address and info["pid"] != old_pid and _alive(info["pid"])
        # Another instance of this engine finds the restarted master, it does not start a second.
        assert session.embedded_master_address(engine, 1000) == (address, False)
    finally:
        session.release_all()
    assert not _alive(info["pid"])  # stopped on purpose: not restarted by the supervisor
