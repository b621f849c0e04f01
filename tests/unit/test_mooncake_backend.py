"""MooncakeBackend and EmbeddedMaster against a real mooncake_master (no mocks).

Why real: the semantics the connector relies on (first writer wins, -704 for a missing key,
what a dead master does) are the master's, and a mock would only restate our assumptions.
Nothing skips: a missing binary or library is a failed test with the install hint.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import time
import uuid
from typing import Iterator

import numpy as np
import pytest

from hybridkv.store.embedded_master import (
    INSTALL_HINT,
    EmbeddedMaster,
    MasterError,
    find_master_binary,
)
from hybridkv.store.mooncake_backend import (
    CALL_TIMEOUT,
    CLIENT_CLOSED,
    CLIENT_STUCK,
    INVALID_PARAMS,
    MASTER_UNREACHABLE,
    OBJECT_HAS_LEASE,
    OBJECT_NOT_FOUND,
    RPC_FAIL,
    RPC_TIMEOUT,
    MooncakeBackend,
    StoreError,
    code_name,
)
from tests.freeze import freeze

LEASE_MS = 300
NO_HANG_S = 30.0  # generous: this asserts "does not hang", not latency


def _key(tag: str) -> str:
    return f"test/{tag}/{uuid.uuid4().hex}"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def master() -> Iterator[EmbeddedMaster]:
    with EmbeddedMaster(default_kv_lease_ttl_ms=LEASE_MS) as m:
        yield m


@pytest.fixture(scope="module")
def backend(master: EmbeddedMaster) -> Iterator[MooncakeBackend]:
    # One client per module: close() costs 1-2 s.
    b = MooncakeBackend(
        master.address, global_segment_size=128 << 20, local_buffer_size=32 << 20, timeout_s=10.0
    )
    yield b
    b.close()


@pytest.fixture(scope="module")
def buffers(backend: MooncakeBackend) -> tuple[np.ndarray, np.ndarray]:
    src = np.zeros(16 << 20, dtype=np.uint8)
    dst = np.zeros(16 << 20, dtype=np.uint8)
    backend.register(src.ctypes.data, src.nbytes)
    backend.register(dst.ctypes.data, dst.nbytes)
    return src, dst


# --- EmbeddedMaster -------------------------------------------------------------------------


def test_master_binary_is_installed() -> None:
    # Fails (does not skip) on a machine without the wheel: the message carries the fix.
    assert os.access(find_master_binary(), os.X_OK)


def test_embedded_master_address_stop_twice_and_context() -> None:
    m = EmbeddedMaster(default_kv_lease_ttl_ms=1000)
    assert re.fullmatch(r"127\.0\.0\.1:\d+", m.address)
    assert m.is_running() and m.log_path is not None and m.log_path.exists()
    pid = m.pid
    assert pid is not None
    with socket.create_connection(("127.0.0.1", m.rpc_port), timeout=1):
        pass
    m.stop()
    m.stop()  # second stop is a no-op
    assert not m.is_running()
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)
    with EmbeddedMaster() as m2:
        assert m2.is_running() and m2.address != ""
    assert not m2.is_running()


def test_embedded_master_missing_binary_says_how_to_install() -> None:
    with pytest.raises(MasterError) as ei:
        EmbeddedMaster(binary="/nonexistent/mooncake_master")
    assert "pip install mooncake-transfer-engine-non-cuda==0.3.13.post1" in str(ei.value)
    assert "libibverbs1" in str(ei.value) and "librdmacm1" in INSTALL_HINT


def test_embedded_master_early_exit_reports_log() -> None:
    with pytest.raises(MasterError, match="unknown command line flag"):
        EmbeddedMaster(extra_args=["--no_such_flag_hybridkv=1"])


# --- basic verbs ----------------------------------------------------------------------------


def test_exists_missing_and_present(backend: MooncakeBackend) -> None:
    k1, k2 = _key("ex1"), _key("ex2")
    assert backend.exists([]) == []
    assert backend.exists([k1, k2]) == [False, False]
    assert backend.put_bytes(k1, b"meta") == 0
    assert backend.exists([k1, k2, k1]) == [True, False, True]


def test_put_from_get_into_round_trip_numpy(
    backend: MooncakeBackend, buffers: tuple[np.ndarray, np.ndarray]
) -> None:
    src, dst = buffers
    rng = np.random.default_rng(0)
    sizes = [4096, 1, 100_000, 256 << 10, 3 << 20, 12345]
    offs = np.cumsum([0] + sizes[:-1]).tolist()
    src[: sum(sizes)] = rng.integers(0, 256, sum(sizes), dtype=np.uint8)
    dst[:] = 0
    keys = [_key(f"rt{i}") for i in range(len(sizes))]
    base_s, base_d = src.ctypes.data, dst.ctypes.data
    assert backend.put_from(keys, [base_s + o for o in offs], sizes) == [0] * len(keys)
    assert backend.exists(keys) == [True] * len(keys)
    # read back in reverse order into different places
    got = backend.get_into(keys[::-1], [base_d + o for o in offs[::-1]], sizes[::-1])
    assert got == sizes[::-1]
    assert np.array_equal(dst[: sum(sizes)], src[: sum(sizes)])


def test_put_from_get_into_round_trip_torch(backend: MooncakeBackend) -> None:
    import torch

    g = torch.Generator().manual_seed(1)
    blocks = torch.randn(8, 2, 16, 64, generator=g).to(torch.bfloat16)  # KV-cache-like layout
    out = torch.zeros_like(blocks)
    backend.register(blocks.data_ptr(), blocks.numel() * blocks.element_size())
    backend.register(out.data_ptr(), out.numel() * out.element_size())
    per = blocks[0].numel() * blocks.element_size()
    keys = [_key(f"blk{i}") for i in range(blocks.shape[0])]
    assert backend.put_from(keys, [blocks[i].data_ptr() for i in range(8)], [per] * 8) == [0] * 8
    assert backend.get_into(keys, [out[i].data_ptr() for i in range(8)], [per] * 8) == [per] * 8
    assert torch.equal(blocks.view(torch.int16), out.view(torch.int16))  # byte-exact


def test_put_on_existing_key_keeps_old_value(
    backend: MooncakeBackend, buffers: tuple[np.ndarray, np.ndarray]
) -> None:
    # Mooncake's put is first-writer-wins (upsert would overwrite): documented behaviour.
    src, dst = buffers
    k = _key("keep")
    src[:1000] = 7
    assert backend.put_from([k], [src.ctypes.data], [1000]) == [0]
    src[:1000] = 9
    assert backend.put_from([k], [src.ctypes.data], [1000]) == [0]
    assert backend.get_into([k], [dst.ctypes.data], [1000]) == [1000]
    assert (dst[:1000] == 7).all()
    kb = _key("keepb")
    assert backend.put_bytes(kb, b"first") == 0
    assert backend.put_bytes(kb, b"second") == 0
    assert backend.get_bytes(kb) == b"first"


def test_get_missing_key_gives_missing_code(
    backend: MooncakeBackend, buffers: tuple[np.ndarray, np.ndarray]
) -> None:
    src, dst = buffers
    present, missing = _key("p"), _key("missing")
    src[:64] = 3
    assert backend.put_from([present], [src.ctypes.data], [64]) == [0]
    dst[:8192] = 0
    res = backend.get_into([missing, present], [dst.ctypes.data, dst.ctypes.data + 4096], [64, 64])
    assert res == [OBJECT_NOT_FOUND, 64]
    assert (dst[:64] == 0).all() and (dst[4096:4160] == 3).all()
    assert backend.get_bytes(missing) is None
    assert code_name(OBJECT_NOT_FOUND) == "OBJECT_NOT_FOUND"


def test_buffer_too_small_and_larger_buffer(
    backend: MooncakeBackend, buffers: tuple[np.ndarray, np.ndarray]
) -> None:
    src, dst = buffers
    k = _key("small")
    src[:10000] = 5
    assert backend.put_from([k], [src.ctypes.data], [10000]) == [0]
    dst[:10000] = 0
    assert backend.get_into([k], [dst.ctypes.data], [9999]) == [INVALID_PARAMS]
    assert (dst[:10000] == 0).all()  # nothing written
    # a larger buffer is fine: the answer is the object size
    assert backend.get_into([k], [dst.ctypes.data], [20000]) == [10000]
    assert (dst[:10000] == 5).all()


def test_zero_size_put_and_batch_mismatch(
    backend: MooncakeBackend, buffers: tuple[np.ndarray, np.ndarray]
) -> None:
    src, _ = buffers
    assert backend.put_from([_key("z")], [src.ctypes.data], [0]) == [INVALID_PARAMS]
    assert backend.put_from([], [], []) == [] and backend.get_into([], [], []) == []
    with pytest.raises(StoreError) as ei:
        backend.put_from([_key("a"), _key("b")], [src.ctypes.data], [1, 1])
    assert ei.value.code == INVALID_PARAMS and ei.value.op == "put_from"


def test_register_is_idempotent(backend: MooncakeBackend) -> None:
    """A second registration of the same or an inner range is a no-op (Mooncake itself
    refuses it), the region really is registered once and really unregistered after."""
    buf = np.zeros(1 << 20, dtype=np.uint8)
    addr, n = buf.ctypes.data, buf.nbytes
    raw = backend._store  # the Mooncake client underneath, to see what it holds

    def round_trip(tag: str) -> None:
        buf[:256] = np.arange(256, dtype=np.uint8)
        k = _key(tag)
        assert backend.put_from([k], [addr], [256]) == [0]
        assert backend.get_into([k], [addr + 4096], [256]) == [256]
        assert bytes(buf[4096:4352]) == bytes(range(256))

    backend.register(addr, n)
    assert raw.register_buffer(addr, n) != 0, (
        "Mooncake accepted a duplicate: the wrapper guards nothing"
    )
    backend.register(addr, n)  # no-op, no error
    backend.register(addr + 4096, 4096)  # inner range: covered, no error
    round_trip("reg-1")
    backend.unregister(addr)
    backend.unregister(addr)  # unknown: no-op
    # Really unregistered in Mooncake: a raw registration succeeds again.
    assert raw.register_buffer(addr, n) == 0
    assert raw.unregister_buffer(addr) == 0
    backend.register(addr, n)  # again after unregister
    round_trip("reg-2")
    backend.unregister(addr)


def test_remove_respects_lease(backend: MooncakeBackend) -> None:
    k = _key("rm")
    assert backend.put_bytes(k, b"x" * 100) == 0
    assert backend.get_bytes(k) == b"x" * 100  # grants a lease
    assert backend.remove(k) == OBJECT_HAS_LEASE
    time.sleep(LEASE_MS / 1000 + 0.3)
    assert backend.remove(k) == 0
    assert backend.remove(k) == OBJECT_NOT_FOUND
    assert backend.exists([k]) == [False]


def test_error_message_names_op_and_fix() -> None:
    e = StoreError("get_into", RPC_FAIL, "detail")
    assert e.op == "get_into" and e.code == RPC_FAIL
    assert "get_into" in str(e) and "RPC_FAIL" in str(e) and "mooncake_master" in str(e)


# --- failure modes: no call may hang ----------------------------------------------------------


def test_setup_without_master_fails_fast() -> None:
    addr = f"127.0.0.1:{_free_port()}"
    t0 = time.monotonic()
    with pytest.raises(StoreError) as ei:
        MooncakeBackend(addr, global_segment_size=0)
    assert time.monotonic() - t0 < 5.0  # the raw setup() would retry for ~90 s
    assert ei.value.code == RPC_FAIL and ei.value.op == "setup" and addr in str(ei.value)


def _assert_failed(fn, bound_s: float = NO_HANG_S) -> float:
    """The call must fail (StoreError or only negative codes) and return within the bound."""
    t0 = time.monotonic()
    try:
        res = fn()
    except StoreError:
        pass
    else:
        assert all(c < 0 for c in res), res
    dt = time.monotonic() - t0
    assert dt < bound_s, dt
    return dt


def test_master_killed_next_calls_fail_within_bound() -> None:
    m = EmbeddedMaster(default_kv_lease_ttl_ms=LEASE_MS)
    b = MooncakeBackend(
        m.address,
        global_segment_size=32 << 20,
        local_buffer_size=8 << 20,
        timeout_s=3.0,
        retry_after_s=0.5,
    )
    try:
        buf = np.arange(1 << 16, dtype=np.uint8)
        b.register(buf.ctypes.data, buf.nbytes)
        k = _key("dead")
        assert b.put_from([k], [buf.ctypes.data], [4096]) == [0]
        m.kill()
        t0 = time.monotonic()
        for _ in range(2):
            _assert_failed(lambda: b.exists([k]))
            _assert_failed(lambda: b.put_from([_key("n")], [buf.ctypes.data], [4096]))
            _assert_failed(lambda: b.get_into([k], [buf.ctypes.data + 8192], [4096]))
        time.sleep(0.6)  # past retry_after_s: the next call probes Mooncake again
        _assert_failed(lambda: b.exists([k]))
        _assert_failed(lambda: b.get_bytes(k))
        assert time.monotonic() - t0 < NO_HANG_S
        # the failure is typed: a dead-master code, our timeout, or the open circuit
        with pytest.raises(StoreError) as ei:
            b.exists([k])
        assert ei.value.code in (
            RPC_FAIL,
            RPC_TIMEOUT,
            CALL_TIMEOUT,
            CLIENT_STUCK,
            MASTER_UNREACHABLE,
        )
    finally:
        t0 = time.monotonic()
        b.close()  # up to ~10 s with a dead master, holding the GIL: unboundable, but must end
        assert time.monotonic() - t0 < NO_HANG_S
        m.stop()
    with pytest.raises(StoreError) as ei:
        b.exists(["x"])
    assert ei.value.code == CLIENT_CLOSED


def test_hung_master_call_times_out_and_backend_recovers() -> None:
    # SIGSTOP: the binding itself would block 30 s (then -901); the backend gives up after timeout_s.
    m = EmbeddedMaster(default_kv_lease_ttl_ms=LEASE_MS)
    b = MooncakeBackend(
        m.address, global_segment_size=32 << 20, local_buffer_size=8 << 20, timeout_s=1.0
    )
    try:
        k = _key("hung")
        assert b.put_bytes(k, b"v") == 0
        assert m.pid is not None
        freeze(m.pid)
        try:
            t0 = time.monotonic()
            with pytest.raises(StoreError) as ei:
                b.exists([k], timeout_s=0.5)  # per-call bound overrides the backend's 1 s
            assert ei.value.code == CALL_TIMEOUT and time.monotonic() - t0 < 5.0
            assert b.stuck_calls == 1
            t0 = time.monotonic()
            with pytest.raises(StoreError) as ei:
                b.get_into([k], [0], [1])  # refused before touching Mooncake (addr 0 never used)
            assert ei.value.code == CLIENT_STUCK and time.monotonic() - t0 < 0.5
        finally:
            os.kill(m.pid, signal.SIGCONT)
        deadline = time.monotonic() + NO_HANG_S + 5
        while b.stuck_calls and time.monotonic() < deadline:
            time.sleep(0.05)
        assert b.stuck_calls == 0
        deadline = time.monotonic() + 10
        while True:  # the abandoned call may have opened the circuit briefly
            try:
                assert b.exists([k]) == [True]
                break
            except StoreError as e:
                assert e.code == MASTER_UNREACHABLE and time.monotonic() < deadline, e
                time.sleep(0.2)
    finally:
        b.close()
        m.stop()


# --- an external master SIGKILLed and restarted under two clients ------------------------------
# Two engines, each with its own client and segment, on ONE external master must get store
# service back after the master's restart. What could break it: segments not re-mounted on the
# new master, a reconnect that differs with two clients, a breaker that never half-opens. This
# checks exactly that without an engine: two real
# client PROCESSES (one client per process, as in the engines), each contributing a segment,
# writing and reading back every 0.2 s across a SIGKILL and a restart on the same port.
_RESTART_CLIENT = r"""
import json, sys, time
import numpy as np
from hybridkv.store.mooncake_backend import MooncakeBackend, StoreError
addr, name, dur = sys.argv[1], sys.argv[2], float(sys.argv[3])
b = MooncakeBackend(addr, global_segment_size=32 << 20, local_buffer_size=4 << 20, timeout_s=1.0, retry_after_s=0.5)
buf = np.full(65536, 7, dtype=np.uint8)
b.register(buf.ctypes.data, buf.nbytes)
print(json.dumps({"ready": name}), flush=True)
t_end, i = time.time() + dur, 0
while time.time() < t_end:
    i += 1
    key, t = f"restart/{name}/{i}", time.time()
    try:
        b.check_master_epoch()  # what the engines' epoch monitor does (session.py)
    except StoreError:
        pass
    try:
        rc = b.put_from([key], [buf.ctypes.data], [4096])[0]
    except StoreError as e:
        rc = e.code
    seen = None
    if rc == 0:
        try:
            seen = b.exists([key])[0]
        except StoreError as e:
            seen = e.code
    print(json.dumps({"t": t, "key": key, "rc": rc, "seen": seen, "epoch": b.master_epoch}), flush=True)
    time.sleep(0.2)
b.close()
"""
RESTART_RECOVERY_S = 5.0  # measured 1.0-1.2 s (client reconnect ~1 s + retry_after_s)


def _master_http(m: EmbeddedMaster, path: str) -> str:
    import urllib.request

    with urllib.request.urlopen(f"http://127.0.0.1:{m.metrics_port}{path}", timeout=2) as r:
        return r.read().decode()


def test_external_master_restart_under_two_clients_recovers_both() -> None:
    import json
    import subprocess
    import sys
    import threading

    m = EmbeddedMaster(default_kv_lease_ttl_ms=LEASE_MS)
    env = dict(os.environ, GLOG_minloglevel="2")
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _RESTART_CLIENT, m.address, name, "90"],
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
            env=env,
        )
        for name in ("a", "b")
    ]
    rows: dict[str, list[dict]] = {"a": [], "b": []}
    ready: list[str] = []

    def read(p: subprocess.Popen, name: str) -> None:
        for line in p.stdout:
            d = json.loads(line)
            (ready.append(name) if "ready" in d else rows[name].append(d))

    readers = [threading.Thread(target=read, args=(p, n), daemon=True) for p, n in zip(procs, "ab")]
    for t in readers:
        t.start()
    try:
        deadline = time.monotonic() + 60  # a loaded 2-core box starts processes slowly
        while len(ready) < 2 or min(len(r) for r in rows.values()) < 5:
            assert time.monotonic() < deadline, (
                f"clients did not start: {ready}, {[len(r) for r in rows.values()]}"
            )
            time.sleep(0.05)
        assert len(_master_http(m, "/get_all_segments").split()) == 2
        m.kill()
        time.sleep(1.0)
        m.restart()  # same rpc (and metrics) port: the clients keep their address
        t_restart = time.time()
        time.sleep(RESTART_RECOVERY_S + 1.0)
        segments = _master_http(m, "/get_all_segments").split()
        keys = set(_master_http(m, "/get_all_keys").split())
        t_stop = (
            time.time()
        )  # rows after this may be puts onto the segment of a client already killed
        for p in procs:  # enough seen: stop them (no close(): it only costs seconds here)
            p.kill()
            p.wait(timeout=10)
        for t in readers:
            t.join(timeout=5)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
        m.stop()
    assert len(segments) == 2, segments  # BOTH clients' segments re-mounted on the new master
    for name, got in rows.items():
        after = [r for r in got if t_restart < r["t"] < t_stop]
        ok = [r for r in after if r["rc"] == 0 and r["seen"] is True]
        assert ok, (name, after[:10])
        assert ok[0]["t"] - t_restart <= RESTART_RECOVERY_S, (name, ok[0]["t"] - t_restart)
        # No relapse once recovered, and what it wrote is held by the new master.
        later = [r for r in after if r["t"] >= ok[0]["t"]]
        assert all(r["rc"] == 0 and r["seen"] is True for r in later), (
            name,
            [r for r in later if r["rc"]][:5],
        )
        assert {
            r["key"] for r in later if r["t"] < t_restart + RESTART_RECOVERY_S + 0.5
        } <= keys  # (read at +6 s)
        assert (
            later[-1]["epoch"] == 1
        )  # the marker vanished once: state kept beside the store is dropped


# --- the global segment's memory (populate_segment) ------------------------------------------


def _rss_mib() -> float:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:")) / 1024


@pytest.mark.parametrize("populate", [True, False])
def test_objects_landing_in_a_populated_segment_do_not_grow_rss(populate: bool) -> None:
    """The soak's RSS step after a store node died (+87 MiB in the engine worker) was this
    process's own segment becoming resident page by page as the lost objects were saved again
    into it. Populated at setup, the segment is resident once, at start: 48 MiB of objects put
    into it (the only segment of a fresh master) grow RSS by little; the unpopulated control
    shows the step the measurement can see, and both read back what was put."""
    seg, total, size = 64 << 20, 48 << 20, 1 << 20
    src = np.random.default_rng(1).integers(
        0, 256, total, dtype=np.uint8
    )  # touched before measuring
    dst = np.zeros(total, dtype=np.uint8)
    # A get's lease covers its whole transfer: 48 MiB on a loaded host can outlast 300 ms
    # (every object LEASE_EXPIRED, -707); nothing here waits for a lease to end.
    with EmbeddedMaster(default_kv_lease_ttl_ms=5000) as m:
        before_setup = _rss_mib()
        b = MooncakeBackend(
            m.address,
            global_segment_size=seg,
            local_buffer_size=16 << 20,
            timeout_s=10.0,
            populate_segment=populate,
        )
        try:
            setup_growth = _rss_mib() - before_setup
            b.register(src.ctypes.data, src.nbytes)
            b.register(dst.ctypes.data, dst.nbytes)
            keys = [_key(f"pop{i}") for i in range(total // size)]
            offs = [i * size for i in range(len(keys))]
            rss0 = _rss_mib()
            assert b.put_from(keys, [src.ctypes.data + o for o in offs], [size] * len(keys)) == [
                0
            ] * len(keys)
            growth = _rss_mib() - rss0
            assert b.get_into(keys, [dst.ctypes.data + o for o in offs], [size] * len(keys)) == [
                size
            ] * len(keys)
            assert np.array_equal(dst, src)
        finally:
            b.close()
    print(
        f"\npopulate={populate}: populated {b.segment_populated >> 20} MiB, setup +{setup_growth:.0f} MiB, "
        f"48 MiB of puts +{growth:.1f} MiB"
    )
    if populate:
        assert b.segment_populated >= seg and setup_growth >= seg >> 20
        assert growth < 12, f"RSS grew {growth:.1f} MiB as objects landed in a populated segment"
    else:
        assert b.segment_populated == 0 and growth >= 40, f"control: RSS grew only {growth:.1f} MiB"


# --- reads wait at low priority (read_wait_nice) ---------------------------------------------


class _NiceRecorder:
    """The real Mooncake client, recording the nice level of the thread each call runs on."""

    def __init__(self, store: object) -> None:
        self._store = store
        self.nice: dict[str, set[int]] = {}

    def __getattr__(self, name: str) -> object:
        fn = getattr(self._store, name)
        if not callable(fn):
            return fn

        def call(*args: object) -> object:
            self.nice.setdefault(name, set()).add(
                os.getpriority(os.PRIO_PROCESS, 0)
            )  # this thread's
            return fn(*args)

        return call


@pytest.mark.parametrize("nice", [19, 0])
def test_reads_wait_on_threads_at_read_wait_nice(master: EmbeddedMaster, nice: int) -> None:
    """Mooncake 0.3.13 waits for a read by polling on the calling thread: a read from a slow
    peer burns a core for as long as it waits (measured with bench/read_poll_cpu.py: 2.9 s
    of CPU for a read from a node stalled 3 s; writes 0.00 s). In the P/D + store soak the
    prefill's reads from the busy decode's segment took as much CPU as its forward pass and
    every session stalled 20-30 s at once. So the read verbs run on their own threads at
    ``read_wait_nice``; writes, existence queries and the master's verbs keep normal priority
    (they do not poll). Real master and client; the recorder only notes the calling thread's
    nice level. 0: one pool at normal priority for everything, as before."""
    size, n = 16 << 10, 4
    src = np.random.default_rng(2).integers(0, 256, size * n, dtype=np.uint8)
    dst = np.zeros_like(src)
    b = MooncakeBackend(
        master.address,
        global_segment_size=16 << 20,
        local_buffer_size=16 << 20,
        timeout_s=10.0,
        read_wait_nice=nice,
    )
    try:
        rec = _NiceRecorder(b._store)
        b._store = rec
        b.register(src.ctypes.data, src.nbytes)
        b.register(dst.ctypes.data, dst.nbytes)
        keys = [_key(f"nice{i}") for i in range(n)]
        assert (
            b.put_from_parts(keys, [[src.ctypes.data + i * size] for i in range(n)], [[size]] * n)
            == [0] * n
        )
        assert b.exists(keys) == [True] * n
        assert (
            b.get_into_parts(keys, [[dst.ctypes.data + i * size] for i in range(n)], [[size]] * n)
            == [size] * n
        )
        assert b.get_into(keys[:1], [dst.ctypes.data], [size]) == [size]
        assert b.put_bytes(_key("nice-bytes"), b"x" * 100) == 0
        assert np.array_equal(dst, src)
    finally:
        b.close()
    verbs = (
        "batch_put_from_multi_buffers",
        "batch_is_exist",
        "put",
        "batch_get_into_multi_buffers",
        "batch_get_into",
    )
    assert {v: rec.nice.get(v) for v in verbs} == {
        "batch_put_from_multi_buffers": {0},
        "batch_is_exist": {0},
        "put": {0},
        "batch_get_into_multi_buffers": {nice},
        "batch_get_into": {nice},
    }, rec.nice
    with pytest.raises(ValueError, match="read_wait_nice=20"):
        MooncakeBackend(master.address, read_wait_nice=20)
