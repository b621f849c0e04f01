"""Objects lost with no master restart must not stay "saved recently".

Why: otherwise the hit rate after a long master SIGSTOP falls to almost nothing and stays
there until the next master restart (docs/soak.md). Mechanism (real processes, no engine):
``mooncake_master`` expires a client whose pings it has not seen for
``--client_ttl`` (10 s by default) and unmounts its segment, dropping every object in it.
A master stopped ~10 s or more finds every client's TTL run out when it resumes; a client is
expired when the master's monitor thread runs before the pings queued during the stop are read
(a race; the expiry is logged within 1 ms of the resume), rarely and at any
MC_RPC_TIMEOUT_MS (docs/soak.md). The client then remounts an EMPTY segment.
The scheduler's epoch marker (``MooncakeBackend.check_master_epoch``) lives in one segment: when
another segment is dropped, the epoch does not change, ``_recent`` keeps the lost keys, and
every later request recomputes those blocks without ever saving them again.

Here the same master path (client_expired -> unmount_expired_mem_segment) is driven
deterministically: the segment owner that holds the saved objects is SIGSTOPped past a short
``--client_ttl`` while the master and the segment holding the marker keep running (a master
SIGSTOP expires clients only by the race above, which a test cannot hold still). Then the same
prompt is computed again: its lookup finds the keys missing, so its saves must offer them again.
Planted (the scheduler does not forget keys a lookup found missing): nothing is offered again.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections import Counter
from contextlib import contextmanager

import numpy as np
import pytest
from mooncake.store import ReplicateConfig
from vllm.v1.outputs import KVConnectorOutput

from hybridkv.connector.store_metadata import StoreWorkerMetadata
from hybridkv.store.embedded_master import EmbeddedMaster
from hybridkv.store.mirror import KeyAnswers, _GroupAnswers
from hybridkv.store.mooncake_backend import MooncakeBackend
from hybridkv.store.session import release_all
from tests.freeze import freeze
from tests.unit.test_real_scheduler import (
    WINDOW,
    _request,
    _run_to_completion,
    _scheduler,
)
from tests.unit.tiny_vllm_config import TINY_LLAMA

CLIENT_TTL_S = 2  # the master's --client_ttl: how long a silent client keeps its segment

# A store node: mounts a segment, prints its segment name, lives until stdin closes.
_NODE = """
import sys
from hybridkv.store.mooncake_backend import MooncakeBackend
b = MooncakeBackend(sys.argv[1], global_segment_size=16 << 20, timeout_s=5.0)
print(b._store.get_hostname(), flush=True)
sys.stdin.read()
"""


def _segment_of(client: MooncakeBackend, key: str) -> str:
    """The transport endpoint of the segment holding ``key``'s replica."""
    desc = client._store.get_replica_desc(key)
    return str(desc[0].get_memory_descriptor().buffer_descriptor.transport_endpoint) if desc else ""


@pytest.fixture
def tiny_model(tmp_path):
    import json

    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import init_none_hash

    init_none_hash(sha256)
    (tmp_path / "config.json").write_text(json.dumps(TINY_LLAMA))
    return tmp_path


def test_keys_of_a_dropped_segment_are_saved_again(tiny_model):
    with EmbeddedMaster(
        default_kv_lease_ttl_ms=1000, extra_args=[f"--client_ttl={CLIENT_TTL_S}"]
    ) as master:
        # The segment that keeps the scheduler's epoch marker: the only one when the scheduler starts.
        keeper = MooncakeBackend(master.address, global_segment_size=16 << 20, timeout_s=5.0)
        node = None
        try:
            sched = _scheduler(WINDOW, master.address, tiny_model, "segment-loss")
            conn = sched.connector._scheduler
            client = conn._client
            assert client.check_master_epoch() == 0 and client._marker_stored
            marker_at = _segment_of(client, client._marker)  # the keeper's: the only segment yet

            # The segment that will be dropped, holding what the workers wrote.
            node = subprocess.Popen(
                [sys.executable, "-c", _NODE, master.address],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.DEVNULL,
            )
            node_segment = node.stdout.readline().decode().strip()
            assert node_segment.startswith("127.0.0.1:"), node_segment

            req = _request("segment-loss-a")
            first = _run_to_completion(sched, req)
            assert len(first) > 60, "the first prefill offered too little to save"
            names = [conn._schema.key(g, h) for g, h in sorted(first)]
            buf = np.zeros(64, dtype=np.uint8)
            cfg = ReplicateConfig()
            cfg.preferred_segment = node_segment
            assert keeper._store.batch_put_from(
                names, [int(buf.ctypes.data)] * len(names), [64] * len(names), cfg
            ) == [0] * len(names)
            placed = Counter(_segment_of(keeper, n) for n in names)
            assert len(placed) == 1 and marker_at not in placed, (placed, marker_at)
            assert all(keeper.exists(names))

            # The node stops answering pings: the master expires it and drops its segment.
            t0 = time.monotonic()
            freeze(node.pid)
            try:
                while any(keeper.exists(names)) and time.monotonic() - t0 < CLIENT_TTL_S + 8:
                    time.sleep(0.2)
            finally:
                os.kill(node.pid, signal.SIGCONT)
            assert not any(keeper.exists(names)), (
                "the master did not drop the stopped node's segment"
            )
            # What the epoch check sees: the marker is still there, no restart to notice.
            assert client.exists([client._marker]) == [True]
            assert client.check_master_epoch() == 0

            assert sched.kv_cache_manager.reset_prefix_cache()
            again = _run_to_completion(sched, _request("segment-loss-b"))
            assert again == first, (
                f"{len(first - again)} of {len(first)} lost blocks were recomputed "
                "but not offered for saving again"
            )
        finally:
            release_all()  # the scheduler's shared client, before its master goes
            if node is not None:
                node.stdin.close()
                try:
                    node.wait(timeout=15)
                except subprocess.TimeoutExpired:
                    node.kill()
                    node.wait()
            keeper.close()


@contextmanager
def _scheduler_on_a_fresh_master(tiny_model, tag: str):  # noqa: ANN001, ANN202
    """(the store scheduler, a request of its prompt) on a master of its own that holds one
    segment; the store clients are released after."""
    with (
        EmbeddedMaster() as master,
        MooncakeBackend(master.address, global_segment_size=16 << 20) as _holder,
    ):
        try:
            sched = _scheduler(WINDOW, master.address, tiny_model, tag)
            yield sched.connector._scheduler, _request(tag)
        finally:
            release_all()


def test_a_save_still_in_flight_is_not_taken_as_lost(tiny_model):
    """A key whose save job is not acknowledged yet reads as missing (not landed): alone it
    forgets nothing. A saved key found missing at the prompt's first block forgets every key
    of the prompt from there on (all groups: sparse keys far from the hit are not asked)
    except those still in flight."""
    with _scheduler_on_a_fresh_master(tiny_model, "in-flight") as (conn, req):
        h = [bytes(x) for x in req.block_hashes]
        landed, pending, far, other = (0, h[0]), (0, h[1]), (2, h[40]), (0, b"x" * 32)
        conn._recent.update(dict.fromkeys([landed, pending, far, other]))
        conn._save_started(7, [pending])
        conn._forget_missing(req, KeyAnswers([_GroupAnswers({h[0]: True, h[1]: False}), {}, {}]))
        assert list(conn._recent) == [landed, pending, far, other]
        conn._forget_missing(req, KeyAnswers([_GroupAnswers({h[0]: False, h[1]: False}), {}, {}]))
        assert list(conn._recent) == [pending, other]


def test_a_loss_forgets_from_the_earliest_lost_position_on(tiny_model):
    """Keys before the first lost one stay "saved recently"; from it on, every group's go.

    Geometry: full attention 16 (group 0), sliding window 16/64 (1), Mamba 64 (2), hash
    unit 16; a key is named by the hash unit its block ends at (``h[i]``: tokens up to
    16 * (i + 1)). A dense loss at h[5]: the dense keys this lookup found present before it
    and the Mamba state at 64 (not asked) stay (planted, the old rule forgetting the whole
    prompt: they go, and the recompute would re-put blocks still stored); the present dense
    key after it, a far window tail and the Mamba state at 128 (neither asked) go. A Mamba
    state lost at 64 before a dense loss at 96: the dense key ending at 80, found present,
    goes too (planted, each group from its own first loss: it stays), the one at 48 stays:
    the earliest loss over all groups bounds what this lookup can vouch for."""
    with _scheduler_on_a_fresh_master(tiny_model, "first-lost") as (conn, req):
        h = [bytes(x) for x in req.block_hashes]
        other = (0, b"x" * 32)  # another prompt's key
        before, lost, after = (
            [(0, h[3]), (0, h[4]), (2, h[3])],
            (0, h[5]),
            [(0, h[6]), (1, h[40]), (2, h[7])],
        )
        conn._recent.update(dict.fromkeys([*before, lost, *after, other]))
        dense = _GroupAnswers({h[3]: True, h[4]: True, h[5]: False, h[6]: True})
        conn._forget_missing(req, KeyAnswers([dense, {}, {}]))
        assert list(conn._recent) == [*before, other]

        conn._recent.clear()
        kept, gone = [(0, h[2])], [(0, h[4]), (2, h[3]), (0, h[5])]
        conn._recent.update(dict.fromkeys([*kept, *gone, other]))
        dense = _GroupAnswers({h[2]: True, h[4]: True, h[5]: False})
        conn._forget_missing(req, KeyAnswers([dense, {}, _GroupAnswers({h[3]: False})]))
        assert list(conn._recent) == [*kept, other]


def test_a_key_two_saves_write_is_in_flight_until_both_end(tiny_model):
    """A key forgotten while its save was in flight is offered again and written by a second
    job: it stays in flight (not lost) until BOTH jobs are acknowledged (the running count,
    ``_in_flight``, counts jobs per key; planted as a set: the first job's end drops it and
    the absent key is taken as lost), then a lookup finding it absent forgets it (planted,
    the count never decremented: never forgotten)."""
    with _scheduler_on_a_fresh_master(tiny_model, "in-flight-twice") as (conn, req):
        key = (0, bytes(req.block_hashes[0]))
        conn._recent[key] = None
        conn._save_started(7, [key])
        conn._save_started(8, [key])
        absent = KeyAnswers([_GroupAnswers({key[1]: False}), {}, {}])
        for job, forgotten in ((7, False), (8, True)):
            conn.update_connector_output(
                KVConnectorOutput(
                    kv_connector_worker_meta=StoreWorkerMetadata(finished_saves=Counter({job: 1}))
                )
            )
            conn._forget_missing(req, absent)
            assert (key not in conn._recent) == forgotten, f"after job {job} ended"
        assert not conn._save_keys and not conn._in_flight
