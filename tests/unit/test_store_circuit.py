"""The store client's circuit breaker (store/circuit.py): exponential backoff between probes and
ONE probe at a time (half-open), on its own clock, then on a real mooncake_master killed and
restarted on its port (an external master restart: reconnect with backoff, breaker
half-open)."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from hybridkv.store.circuit import Circuit
from hybridkv.store.embedded_master import EmbeddedMaster
from hybridkv.store.mooncake_backend import MASTER_UNREACHABLE, MooncakeBackend, StoreError


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def test_closed_circuit_admits_every_call_and_none_is_a_probe() -> None:
    c = Circuit(1.0, 4.0, probe_ttl_s=10.0, clock=Clock())
    assert [c.admit() for _ in range(3)] == [(True, False)] * 3
    assert not c.is_open


def test_windows_double_per_failed_probe_up_to_the_cap_and_one_probe_at_a_time() -> None:
    clock = Clock()
    c = Circuit(1.0, 4.0, probe_ttl_s=10.0, clock=clock)
    c.failure(probe=False)  # the first failure, circuit closed: opens it
    windows = []
    for _ in range(5):
        refused, left = c.admit()
        assert refused is False
        windows.append(left)
        clock.t += left
        assert c.admit() == (True, True)  # the window is over: this call probes
        assert c.admit() == (False, 0.0)  # ... and the others wait for its verdict
        c.failure(probe=True)  # the probe found the master still down
    assert windows == [1.0, 2.0, 4.0, 4.0, 4.0]
    c.success()
    assert c.admit() == (True, False) and not c.is_open
    c.failure(probe=False)  # a new outage starts again from the base window
    assert c.admit() == (False, 1.0)


def test_a_probe_that_never_reports_frees_its_slot_after_its_ttl() -> None:
    clock = Clock()
    c = Circuit(1.0, 4.0, probe_ttl_s=3.0, clock=clock)
    c.failure(probe=False)
    clock.t += 1.0
    assert c.admit() == (True, True)
    clock.t += 2.9
    assert c.admit() == (False, 0.0)
    clock.t += 0.2
    assert c.admit() == (True, True)


def test_concurrent_callers_at_the_end_of_a_window_admit_exactly_one_probe() -> None:
    clock = Clock()
    c = Circuit(1.0, 4.0, probe_ttl_s=10.0, clock=clock)
    c.failure(probe=False)
    clock.t += 1.0
    start, got = threading.Barrier(16), []

    def call() -> None:
        start.wait()
        got.append(c.admit())

    threads = [threading.Thread(target=call) for _ in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(got) == [(False, 0.0)] * 15 + [(True, True)]


def test_calls_in_flight_when_the_master_died_do_not_stretch_the_window_or_free_the_probe_slot() -> (
    None
):
    """A dying master fails every call in flight together (each ~4.4 s later): only the first
    opens the circuit; the stragglers' failures neither double the window nor let a second
    probe through while the probe runs."""
    clock = Clock()
    c = Circuit(1.0, 4.0, probe_ttl_s=10.0, clock=clock)
    c.failure(probe=False)
    c.failure(probe=False)
    c.failure(probe=False)
    assert c.admit() == (False, 1.0)
    clock.t += 1.0
    assert c.admit() == (True, True)
    c.failure(probe=False)  # a call from before the outage fails while the probe runs
    assert c.admit() == (False, 0.0)  # the probe still holds its slot
    c.failure(probe=True)
    assert c.admit() == (False, 2.0)


def test_bad_settings_are_refused_with_the_fields_named() -> None:
    with pytest.raises(ValueError, match="max_s"):
        Circuit(2.0, 1.0, probe_ttl_s=1.0)


def _code_and_seconds(fn) -> tuple[int | str, float]:  # noqa: ANN001
    t0 = time.monotonic()
    try:
        fn()
        return "ok", time.monotonic() - t0
    except StoreError as e:
        return e.code, time.monotonic() - t0


def test_killed_master_one_probe_per_window_windows_double_restart_closes_it() -> None:
    """A real master, SIGKILLed: once a call has said "unreachable", 4 callers at once after the
    window: ONE goes to Mooncake (the probe), 3 fail at once; its failure doubles the window
    (a call after the first window's length is still refused). The master restarted on its port:
    the next probe answers and the circuit closes."""
    m = EmbeddedMaster(default_kv_lease_ttl_ms=1000)
    b = MooncakeBackend(
        m.address,
        global_segment_size=16 << 20,
        local_buffer_size=4 << 20,
        timeout_s=10.0,
        retry_after_s=1.0,
    )
    try:
        buf = np.arange(4096, dtype=np.uint8)
        b.register(buf.ctypes.data, buf.nbytes)
        assert b.put_from(["circuit/k"], [buf.ctypes.data], [4096]) == [0]
        m.kill()
        code, took = _code_and_seconds(lambda: b.exists(["circuit/k"]))
        assert code != "ok" and b.circuit_open, (code, took)  # the binding's RPC failure opened it
        time.sleep(1.05)  # the first window (retry_after_s)
        start, results = threading.Barrier(4), []

        def call() -> None:
            start.wait()
            results.append(_code_and_seconds(lambda: b.exists(["circuit/k"])))

        threads = [threading.Thread(target=call) for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        refused = [r for r in results if r[0] == MASTER_UNREACHABLE]
        probes = [r for r in results if r[0] != MASTER_UNREACHABLE]
        print(f"\nfirst failure {code} in {took:.2f} s; after the window: {results}")
        assert len(probes) == 1 and probes[0][0] != "ok", results
        assert all(s < 0.5 for _, s in refused), results
        time.sleep(1.2)  # past the first window's length: the second (2 s) still holds
        assert _code_and_seconds(lambda: b.exists(["circuit/k"]))[0] == MASTER_UNREACHABLE
        m.restart()
        # The probe is a get_bytes of the key the new master does not hold: get answers b"" and
        # get_size says "missing", both under the probe's one admission (as two calls the second
        # was refused while the first held the probe slot, and no verdict ever came).
        deadline, answered = time.monotonic() + 15.0, False
        while time.monotonic() < deadline and not answered:
            try:
                assert b.get_bytes("circuit/k") is None
                answered = True
            except StoreError:
                time.sleep(0.1)
        assert answered and not b.circuit_open
        assert b.exists(["circuit/k"]) == [False]
    finally:
        b.close()
        m.stop()
