"""StoreWorker under store faults, against a REAL mooncake_master and real segment owners.

Why real: what a hung node does to a call (here: a get from a SIGSTOPped segment owner
blocks 30 s, then answers -800) is Mooncake's behaviour; a fake would only restate our
guess. Each segment owner is a separate process holding a segment; objects are placed
in ONE chosen owner's segment (Mooncake's ``preferred_segment``), so a test can stop
exactly the node that holds one request's objects. The worker's own client holds no
segment: every object it reads or writes lives in an owner process.

Bounds asserted: ``elapsed <= 2 x timeout + SLACK`` (the issue's criterion), plus the
metric that says which path ran (the backend's bounded call: ``stuck_calls`` and the
CLIENT_STUCK refusal, which the old worker-private timeout thread never fed).
"""

from __future__ import annotations

import os
import pickle
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass

import pytest
import torch
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec

from hybridkv.connector.store_config import StoreConnectorConfig
from hybridkv.connector.store_metadata import BlockBatch, LoadJob, SaveJob, StoreConnectorMetadata
from hybridkv.connector.store_worker import StoreWorker, WorkerLimits
from hybridkv.store.embedded_master import EmbeddedMaster
from hybridkv.store.keys import KeySchema
from hybridkv.store.mooncake_backend import MooncakeBackend
from hybridkv.store.object_trailer import seal
from tests.freeze import freeze

NUM_BLOCKS = 16
SLACK_S = 0.75  # scheduling noise on the shared 2-core machine
SCHEMA = KeySchema(model_id="faults", layout_id="fa16")

# A segment owner: mounts a segment, puts the given sealed objects into ITS OWN segment,
# says READY, then idles until killed.
_HOLDER = r"""
import pickle, sys, time
from mooncake.store import MooncakeDistributedStore, ReplicateConfig
master, path = sys.argv[1], sys.argv[2]
s = MooncakeDistributedStore()
assert s.setup("127.0.0.1", "P2PHANDSHAKE", 32 << 20, 8 << 20, "tcp", "", master) == 0
cfg = ReplicateConfig()
cfg.preferred_segment = s.get_hostname()
for key, value in pickle.load(open(path, "rb")).items():
    rc = s.put(key, value, cfg)
    assert rc == 0, (key, rc)
print("READY", s.get_hostname(), flush=True)
time.sleep(3600)
"""


@dataclass
class Holder:
    proc: subprocess.Popen
    name: str

    def stop(self) -> None:
        freeze(self.proc.pid)

    def cont(self) -> None:
        os.kill(self.proc.pid, signal.SIGCONT)


@pytest.fixture
def holders() -> Iterator[list[Holder]]:
    started: list[Holder] = []
    yield started
    for h in started:
        if h.proc.poll() is None:
            h.cont()
            h.proc.kill()
            h.proc.wait(timeout=10)


def start_holder(
    master: EmbeddedMaster, objects: dict[str, bytes], started: list[Holder]
) -> Holder:
    fd, path = tempfile.mkstemp(prefix="hybridkv-holder-", suffix=".pkl")
    with os.fdopen(fd, "wb") as f:
        pickle.dump(objects, f)
    env = dict(os.environ, GLOG_minloglevel="2")
    proc = subprocess.Popen(
        [sys.executable, "-c", _HOLDER, master.address, path],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        env=env,
    )
    holder = Holder(proc, "")
    started.append(holder)
    try:
        line = proc.stdout.readline().split()
    finally:
        os.unlink(path)
    assert line and line[0] == "READY", f"segment owner did not start (rc={proc.poll()})"
    holder.name = line[1]
    return holder


@pytest.fixture
def master() -> Iterator[EmbeddedMaster]:
    # One per test: a killed owner's segment stays registered at the master for ~10 s and
    # would take the next test's puts.
    with EmbeddedMaster(default_kv_lease_ttl_ms=2000) as m:
        yield m


class Rig:
    """A StoreWorker over a one-group host KV cache (block b = bytes of ``kv[b]``)."""

    def __init__(
        self, master: EmbeddedMaster, timeout_s: float, limits: WorkerLimits, max_stuck: int
    ) -> None:
        self.timeout_s = timeout_s
        self.client = MooncakeBackend(
            master.address,
            global_segment_size=0,
            local_buffer_size=4 << 20,
            timeout_s=timeout_s,
            max_stuck_calls=max_stuck,
        )
        g = torch.Generator().manual_seed(14)
        self.kv = torch.randn(NUM_BLOCKS, 2, 16, 64, generator=g).to(torch.bfloat16)
        spec = FullAttentionSpec(block_size=16, num_kv_heads=1, head_size=64, dtype=torch.bfloat16)
        kvc = KVCacheConfig(
            num_blocks=NUM_BLOCKS,
            kv_cache_tensors=[],
            kv_cache_groups=[KVCacheGroupSpec(["l0"], spec)],
        )
        cfg = StoreConnectorConfig(
            master_address=master.address, timeout_s=timeout_s, max_batch_blocks=4
        )
        self.worker = StoreWorker(cfg, kvc, SCHEMA, self.client, limits)
        self.worker.register_kv_caches({"l0": self.kv})
        self.stats: dict = {}
        self.saw_released: set[int] = set()
        self.saw_acks: dict[int, int] = {}
        self.saw_failed: dict[int, int] = {}  # save jobs acknowledged as not (fully) written

    def payload(self, block: int) -> bytes:
        return self.kv[block].view(torch.int16).numpy().tobytes()

    def sealed(self, tag: str, blocks: list[int]) -> dict[str, bytes]:
        return {
            SCHEMA.key(0, _hash(tag, b)): seal(
                SCHEMA.key(0, _hash(tag, b)), self.payload(b), format_code=self.worker.format_code
            )
            for b in blocks
        }

    def load_job(
        self, req: str, tag: str, src_blocks: list[int], dst_blocks: list[int], load_id: int
    ) -> LoadJob:
        batch = BlockBatch()
        for s, d in zip(src_blocks, dst_blocks):
            batch.add(0, _hash(tag, s), d)
        return LoadJob(req, batch, load_id=load_id)

    def wait_loads(
        self, reqs: set[str], t0: float, bound_s: float
    ) -> dict[str, tuple[bool, float]]:
        """req -> (loaded ok, seconds from t0 until the worker reported it)."""
        out: dict[str, tuple[bool, float]] = {}
        while set(out) != reqs and time.monotonic() - t0 < bound_s:
            res = self.worker.get_transfer_results()
            now = time.monotonic() - t0
            for r in res.finished_recving:
                out[r] = (r not in res.failed_recving, now)
            time.sleep(0.005)
        return out

    def poll(self) -> None:
        meta = self.worker.build_worker_meta()
        if meta is not None:
            self.saw_released.update(meta.released_loads)
            for k, v in meta.finished_saves.items():
                self.saw_acks[k] = self.saw_acks.get(k, 0) + v
            for k, v in meta.failed_saves.items():
                self.saw_failed[k] = self.saw_failed.get(k, 0) + v
        stats = self.worker.take_stats()
        if stats is not None:
            for k, v in stats.data.items():
                if not isinstance(v, list):
                    self.stats[k] = self.stats.get(k, 0) + v

    def close(self, holders: list[Holder]) -> None:
        """Resume every owner and let abandoned calls return first: a Mooncake client
        closed under a call still blocked in it can crash the process."""
        for h in holders:
            if h.proc.poll() is None:
                h.cont()
        _wait(lambda: self.client.stuck_calls == 0, 40.0)
        self.worker.shutdown(timeout_s=1.0)
        self.client.close()


def _hash(tag: str, block: int) -> bytes:
    return f"{tag}-{block}".encode().ljust(32, b".")


def _wait(cond, bound_s: float) -> bool:
    t0 = time.monotonic()
    while not cond():
        if time.monotonic() - t0 > bound_s:
            return False
        time.sleep(0.02)
    return True


def test_load_from_sigstopped_owner_is_bounded_and_trips_the_stuck_gate(master, holders) -> None:
    t = 1.0
    rig = Rig(master, t, WorkerLimits(load_deadline_s=t), max_stuck=1)
    try:
        hung = start_holder(master, rig.sealed("hung", [1, 2]), holders)
        hung.stop()
        rig.kv[8:10] = 0
        t0 = time.monotonic()
        rig.worker.start_load_kv(
            StoreConnectorMetadata(loads=[rig.load_job("A", "hung", [1, 2], [8, 9], 11)])
        )
        res = rig.wait_loads({"A"}, t0, 10.0)
        assert res["A"][0] is False
        assert res["A"][1] <= 2 * t + SLACK_S, res
        rig.poll()
        # The backend's bounded call ran (the old private timeout thread left stuck_calls at 0).
        assert rig.client.stuck_calls == 1
        assert (
            rig.stats["fail.load_hkv_call_timeout"] == 2 and rig.stats["rank_failed_loads"] == 1
        )  # (blocks)
        assert 11 not in rig.saw_released  # the abandoned read may still write blocks 8-9
        # The stuck client is detected on the data path: the next load is refused at once.
        t1 = time.monotonic()
        rig.worker.start_load_kv(
            StoreConnectorMetadata(loads=[rig.load_job("B", "hung", [1], [10], 12)])
        )
        res = rig.wait_loads({"B"}, t1, 10.0)
        assert res["B"][0] is False and res["B"][1] <= 0.25 + SLACK_S, res
        rig.poll()
        assert rig.stats["fail.load_hkv_client_stuck"] == 1 and rig.stats["rank_failed_loads"] == 2
        assert 12 in rig.saw_released  # refused before any call: nothing can write block 10
        # The owner resumes: the abandoned call returns, its target blocks are released.
        hung.cont()
        assert _wait(lambda: rig.client.stuck_calls == 0, 40.0)
        assert _wait(lambda: (rig.poll(), 11 in rig.saw_released)[1], 5.0)
    finally:
        rig.close(holders)


def test_one_request_against_a_hung_node_does_not_delay_another(master, holders) -> None:
    t = 2.0
    rig = Rig(master, t, WorkerLimits(load_workers=4, load_deadline_s=t), max_stuck=4)
    try:
        hung = start_holder(master, rig.sealed("slow", [1, 2, 3]), holders)
        start_holder(master, rig.sealed("fine", [4, 5, 6]), holders)
        hung.stop()
        rig.kv[10:13] = 0
        t0 = time.monotonic()
        # One step hands over both loads, the hung one FIRST (a serial load thread would
        # make B wait the whole timeout behind A).
        rig.worker.start_load_kv(
            StoreConnectorMetadata(
                loads=[
                    rig.load_job("A", "slow", [1, 2, 3], [7, 8, 9], 21),
                    rig.load_job("B", "fine", [4, 5, 6], [10, 11, 12], 22),
                ]
            )
        )
        res = rig.wait_loads({"A", "B"}, t0, 20.0)
        assert res["B"][0] is True and res["B"][1] < t / 2, res
        assert res["A"][0] is False and t - 0.05 <= res["A"][1] <= 2 * t + SLACK_S, res
        for src, dst in zip([4, 5, 6], [10, 11, 12]):
            assert torch.equal(rig.kv[dst].view(torch.int16), rig.kv[src].view(torch.int16))
        rig.poll()
        assert rig.stats["loaded_blocks"] == 3
        assert rig.stats["fail.load_hkv_call_timeout"] == 3 and rig.stats["rank_failed_loads"] == 1
    finally:
        rig.close(holders)


def test_synchronous_saves_share_one_budget_per_step(master, holders) -> None:
    t, budget = 2.0, 2.5  # per call it would take 3 x 2.0 s; a per-call bound alone 2 x 2.0 s
    rig = Rig(master, t, WorkerLimits(step_save_budget_s=budget), max_stuck=4)
    try:
        hung = start_holder(master, {}, holders)  # the only segment: every put lands there
        hung.stop()
        jobs = []
        for j in range(3):  # e.g. three Mamba groups' state blocks in one step
            batch = BlockBatch()
            batch.add(0, _hash("state", j), j + 1)
            jobs.append(SaveJob(100 + j, batch, sync=True))
        t0 = time.monotonic()
        rig.worker.wait_for_save(StoreConnectorMetadata(saves=jobs))
        elapsed = time.monotonic() - t0
        assert budget - 0.05 <= elapsed <= budget + SLACK_S, elapsed
        rig.poll()
        assert (
            rig.stats["fail.save_hkv_call_timeout"] == 2
        )  # job 1: 2.0 s, job 2: the 0.5 s left (1 block each)
        assert rig.stats["fail.save_step_budget"] == 1 and rig.stats["skipped_saves"] == 1
        assert rig.saw_acks == {
            102: 1
        }  # skipped: unpinned at once; the others when their calls end
        assert rig.saw_failed == {
            102: 1
        }  # ... and reported not written (the scheduler offers it again)
        hung.cont()
        assert _wait(lambda: (rig.poll(), rig.saw_acks == {100: 1, 101: 1, 102: 1})[1], 40.0), (
            rig.saw_acks
        )
        assert rig.saw_failed == {100: 1, 101: 1, 102: 1}  # timed out, timed out, skipped
    finally:
        rig.close(holders)


def test_full_save_queue_skips_and_counts(master, holders) -> None:
    t = 1.0
    rig = Rig(master, t, WorkerLimits(save_queue_blocks=3), max_stuck=4)
    try:
        hung = start_holder(master, {}, holders)
        hung.stop()

        def job(job_id: int, blocks: list[int]) -> SaveJob:
            batch = BlockBatch()
            for b in blocks:
                batch.add(0, _hash(f"q{job_id}", b), b)
            return SaveJob(job_id, batch)

        t0 = time.monotonic()
        rig.worker.wait_for_save(
            StoreConnectorMetadata(saves=[job(1, [1, 2]), job(2, [3, 4]), job(3, [5])])
        )
        assert time.monotonic() - t0 < 0.25  # asynchronous: the forward pass never waits
        rig.poll()
        # 2 + 2 > 3: job 2 skipped (unpinned now); job 3 fits beside job 1.
        assert rig.stats["skipped_saves"] == 2 and rig.stats["fail.save_queue_full"] == 2
        assert rig.saw_acks == {2: 1} and rig.saw_failed == {2: 1}
        hung.cont()
        assert _wait(lambda: (rig.poll(), rig.saw_acks == {1: 1, 2: 1, 3: 1})[1], 40.0), (
            rig.saw_acks
        )
        before = rig.stats.get(
            "saved_blocks", 0
        )  # jobs 1 and 3: written if the owner resumed in time
        # Room again once the queue drained: a new job is written, not skipped, even one
        # larger than the whole bound (a long prompt must not be refused for ever).
        rig.worker.wait_for_save(StoreConnectorMetadata(saves=[job(4, [6, 7, 8, 9, 10])]))
        assert _wait(lambda: (rig.poll(), 4 in rig.saw_acks)[1], 10.0)
        assert rig.stats["skipped_saves"] == 2 and rig.stats["saved_blocks"] - before == 5, (
            rig.stats
        )
        assert 4 not in rig.saw_failed and 2 in rig.saw_failed  # written: not offered again
    finally:
        rig.close(holders)


def _save_while_writing(rig: Rig, blocks: list[int], snapshot: bool, job_id: int) -> None:
    """Save ``blocks`` while decode writes their V half (filling the block past the key's
    boundary; the K half stays fixed, as positions below the boundary do).

    The write is injected at the worst moment, deterministically: after the worker computed
    the trailer's check and right before the (real) put reads the bytes; a racing thread
    hits that window only by chance. Named fault injection, the put itself is Mooncake's.
    """
    words = rig.kv.view(torch.int16)
    real_put = rig.client.put_from_parts

    def put_after_decode_wrote(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        words[blocks, 1] += 1
        return real_put(*args, **kwargs)

    rig.client.put_from_parts = put_after_decode_wrote
    try:
        batch = BlockBatch()
        for b in blocks:
            batch.add(0, _hash(f"tail{job_id}", b), b)
        job = SaveJob(job_id, batch)
        job.snapshot = snapshot  # (SaveJob.snapshot: the scheduler flags partial tails)
        rig.worker.wait_for_save(StoreConnectorMetadata(saves=[job]))
        assert _wait(lambda: (rig.poll(), job_id in rig.saw_acks)[1], 20.0)
    finally:
        del rig.client.put_from_parts


def test_snapshot_save_of_a_block_being_written_stores_a_verifiable_object(master, holders) -> None:
    rig = Rig(master, 5.0, WorkerLimits(), max_stuck=4)
    try:
        start_holder(master, {}, holders)
        src, dst = [1, 2, 3, 4], [9, 10, 11, 12]
        keys_before = rig.kv[src, 0].clone()
        _save_while_writing(rig, src, snapshot=True, job_id=1)
        assert rig.stats["saved_blocks"] == 4 and rig.stats["snapshot_blocks"] == 4
        rig.kv[dst] = 0
        t0 = time.monotonic()
        rig.worker.start_load_kv(
            StoreConnectorMetadata(loads=[rig.load_job("S", "tail1", src, dst, 31)])
        )
        assert rig.wait_loads({"S"}, t0, 10.0)["S"][0] is True  # every object verified
        assert torch.equal(rig.kv[dst, 0].view(torch.int16), keys_before.view(torch.int16))
        rig.poll()
        assert rig.stats["loaded_blocks"] == 4 and "rank_failed_loads" not in rig.stats
        # Control, the same write without the snapshot: the check is computed over one
        # version of the live bytes and another is stored, so the objects fail verification.
        _save_while_writing(rig, src, snapshot=False, job_id=2)
        t0 = time.monotonic()
        rig.worker.start_load_kv(
            StoreConnectorMetadata(loads=[rig.load_job("Z", "tail2", src, dst, 32)])
        )
        assert rig.wait_loads({"Z"}, t0, 10.0)["Z"][0] is False
        rig.poll()
        assert rig.stats["fail.load_corrupt_object"] == 1  # (the first bad object stops the load)
    finally:
        rig.close(holders)


def test_a_call_stuck_on_one_node_leaves_lookups_alone_a_hung_master_refuses_all(
    master, holders
) -> None:
    """Which stuck calls refuse which: a hung segment owner sticks only data calls (the
    master still answers lookups), a hung master sticks metadata calls and then every call
    must fail fast, whatever ``max_stuck_calls`` the data path tolerates."""
    import numpy as np

    from hybridkv.store.mooncake_backend import CALL_TIMEOUT, CLIENT_STUCK, StoreError

    client = MooncakeBackend(
        master.address,
        global_segment_size=0,
        local_buffer_size=4 << 20,
        timeout_s=1.0,
        max_stuck_calls=4,
    )
    buf = np.zeros(8192, dtype=np.uint8)
    client.register(buf.ctypes.data, buf.nbytes)
    node = start_holder(master, {"faults/on-node": b"x" * 4096}, holders)
    try:
        node.stop()
        with pytest.raises(StoreError) as ei:
            client.get_into(["faults/on-node"], [buf.ctypes.data], [4096])
        assert ei.value.code == CALL_TIMEOUT and client.stuck_calls == 1
        t0 = time.monotonic()
        assert client.exists(["faults/on-node"]) == [True]  # the lookup path is not refused
        assert time.monotonic() - t0 < 0.5
        node.cont()
        assert _wait(lambda: client.stuck_calls == 0, 40.0)
        freeze(master.pid)
        try:
            with pytest.raises(StoreError) as ei:
                client.exists(["faults/on-node"], timeout_s=0.5)
            assert ei.value.code == CALL_TIMEOUT
            t0 = time.monotonic()
            for call in (
                lambda: client.get_into(["faults/on-node"], [buf.ctypes.data], [4096]),
                lambda: client.put_from(["faults/new"], [buf.ctypes.data], [4096]),
                lambda: client.exists(["faults/on-node"]),
            ):
                with pytest.raises(StoreError) as ei:
                    call()
                assert ei.value.code == CLIENT_STUCK
            assert time.monotonic() - t0 < 0.5
        finally:
            os.kill(master.pid, signal.SIGCONT)
        assert _wait(lambda: client.stuck_calls == 0, 40.0)
    finally:
        for h in holders:
            h.cont()
        _wait(lambda: client.stuck_calls == 0, 40.0)
        client.close()


# --- how long an ABANDONED call keeps its blocks ---------------------------------------------
# The caller gives up after timeout_s, but a Mooncake call cannot be cancelled: its KV blocks stay
# pinned until it really returns. Left to Mooncake that is 30 s (TCP "no transfer progress" /
# master RPC timeout); under the P/D + store soak such pins, in a prefill whose small cache was
# otherwise held by P/D leases, stalled every session ~30 s. The backend bounds Mooncake's own
# waits (``stall_bound_s``, from timeout_s), so the blocks come back within timeout + that bound
# while the fault is STILL there. Old code: released only once the owner/master resumed.


def _stall_bound(rig: Rig) -> float:
    bound = rig.client.stall_bound_s
    # One value per process (the first client's, or the environment's): these tests need the
    # floor (10 s, a third of Mooncake's own 30 s waits), not Mooncake's default.
    from hybridkv.store.mooncake_backend import STALL_FLOOR_S

    assert bound is not None and bound <= STALL_FLOOR_S, f"Mooncake stall bound in force: {bound}"
    return bound


def test_abandoned_load_from_a_hung_owner_releases_its_blocks_within_the_bound(
    master, holders
) -> None:
    t = 1.0
    rig = Rig(master, t, WorkerLimits(load_deadline_s=t), max_stuck=1)
    try:
        bound = _stall_bound(rig)
        hung = start_holder(master, rig.sealed("hung", [1, 2, 3]), holders)
        # The connection to the owner is up (engines that stall have talked before). NOT bounded:
        # a FIRST contact with an owner that never answers blocks in Mooncake's P2P handshake
        # (SocketHandShakePlugin::exchangeMetadata, measured > 40 s; no MC_* setting bounds it).
        t0 = time.monotonic()
        rig.worker.start_load_kv(
            StoreConnectorMetadata(loads=[rig.load_job("W", "hung", [3], [7], 40)])
        )
        assert rig.wait_loads({"W"}, t0, 10.0)["W"][0] is True
        hung.stop()  # stays stopped until the end of the test
        t0 = time.monotonic()
        rig.worker.start_load_kv(
            StoreConnectorMetadata(loads=[rig.load_job("A", "hung", [1, 2], [8, 9], 41)])
        )
        res = rig.wait_loads({"A"}, t0, 10.0)
        assert res["A"][0] is False and res["A"][1] <= t + SLACK_S, res
        assert _wait(lambda: (rig.poll(), 41 in rig.saw_released)[1], t + bound + 2 * SLACK_S)
        released_after = time.monotonic() - t0
        assert released_after <= t + bound + 2 * SLACK_S, released_after
        assert rig.client.stuck_calls == 0  # the call really ended (TRANSFER_FAIL inside Mooncake)
        rig.poll()
        assert rig.stats["fail.load_hkv_call_timeout"] == 2 and rig.stats["rank_failed_loads"] == 1
        # The stuck gate healed by itself: the next call is admitted (and bounded again).
        t1 = time.monotonic()
        rig.worker.start_load_kv(
            StoreConnectorMetadata(loads=[rig.load_job("B", "hung", [1], [10], 42)])
        )
        res = rig.wait_loads({"B"}, t1, 10.0)
        assert res["B"][0] is False and res["B"][1] <= t + SLACK_S, res
        rig.poll()
        # B was admitted (not refused as CLIENT_STUCK) and failed within the bound: on the dropped
        # connection Mooncake answers TRANSFER_FAIL at once, or the call times out again.
        assert "fail.load_hkv_client_stuck" not in rig.stats
        assert (
            rig.stats.get("fail.load_transfer_fail", 0) + rig.stats["fail.load_hkv_call_timeout"]
            == 2 + 1
        ), rig.stats
        assert rig.stats["loaded_blocks"] == 1  # the warm-up only
    finally:
        rig.close(holders)


def test_hung_master_costs_a_load_and_a_save_at_most_the_bound(master, holders) -> None:
    """SIGSTOP of the real master: the load fails within timeout_s, and the load's target
    blocks and the save's source blocks are released within timeout_s + the stall bound,
    while the master is still stopped (before: only once it was SIGCONTed)."""
    t = 1.0
    rig = Rig(master, t, WorkerLimits(load_deadline_s=t), max_stuck=4)
    try:
        bound = _stall_bound(rig)
        start_holder(master, rig.sealed("m", [1, 2, 3]), holders)
        t0 = time.monotonic()  # the connection to the owner is up (see the test above)
        rig.worker.start_load_kv(
            StoreConnectorMetadata(loads=[rig.load_job("W", "m", [3], [12], 50)])
        )
        assert rig.wait_loads({"W"}, t0, 10.0)["W"][0] is True
        save = BlockBatch()
        for b in (4, 5):
            save.add(0, _hash("m-save", b), b)
        freeze(master.pid)
        try:
            t0 = time.monotonic()
            rig.worker.start_load_kv(
                StoreConnectorMetadata(loads=[rig.load_job("L", "m", [1, 2, 3], [9, 10, 11], 51)])
            )
            rig.worker.wait_for_save(StoreConnectorMetadata(saves=[SaveJob(52, save)]))
            assert time.monotonic() - t0 < 0.25  # the forward pass never waits
            res = rig.wait_loads({"L"}, t0, 10.0)
            assert res["L"][0] is False and res["L"][1] <= t + SLACK_S, res
            done = _wait(
                lambda: (rig.poll(), 51 in rig.saw_released and 52 in rig.saw_acks)[1],
                t + bound + 2 * SLACK_S,
            )
            elapsed = time.monotonic() - t0
            assert done, (rig.saw_released, rig.saw_acks, elapsed)
            assert elapsed <= t + bound + 2 * SLACK_S, elapsed
            assert rig.saw_failed == {52: 1}  # not written: the scheduler offers it again
            assert master.is_running()  # still the stopped master: nothing was resumed
        finally:
            os.kill(master.pid, signal.SIGCONT)
        rig.poll()
        assert rig.stats["rank_failed_loads"] == 1 and rig.stats["failed_saves"] == 2
    finally:
        rig.close(holders)
