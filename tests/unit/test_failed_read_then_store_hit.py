"""A failed P/D READ, then the store's copy of the same prefix, through a REAL vLLM ``Scheduler``.

The P/D + store deployment: decode runs vLLM's ``MultiConnector(HybridPDConnector,
HybridStoreConnector)``. The prefill instance dies mid-READ; the READ fails; the request
must recompute. vLLM 0.32 and 0.33 keep such a request in ``Scheduler._inflight_prefills``
after its failed load has freed its blocks (nothing discards it until the request is
admitted and finishes its prefill, is preempted or finishes). Every later ASYNC admission
reserves ``_inflight_prefill_reserved_blocks()``: that stale entry's whole prompt, the
request's own included. So if any connector then offers this request an async load (the
store holds its prefix), vLLM needs its prompt's blocks twice over; when that does not fit
it stops the waiting loop at this request, every step, with nothing running: the engine
admits nothing until the client gives up (a P/D decode then logs "Running 0, Waiting N,
KV fetch: 1 waiting to start" with 0 % KV cache used).

hybridkv's answer: after ANY connector's load of a request failed, the store offers that
request nothing (it recomputes: a plain admission, which clears the stale entry). The vLLM
code and the fix to report upstream: docs/vllm_upstream.md.

Real parts: both schedulers are vLLM's (no workers), the prefill leg returns real signed
``kv_transfer_params``, the store is a real ``mooncake_master`` holding the prefix.
"""

from __future__ import annotations

import random
import tempfile
from pathlib import Path

import numpy as np
import pytest
from vllm.distributed.kv_transfer.kv_connector.v1.multi_connector import (
    MultiKVConnectorWorkerMetadata,
)
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.request import RequestStatus

from hybridkv.cli.harness.kv_manager import Geometry, fa, sw
from hybridkv.connector.pd_auth import write_secret_file
from hybridkv.connector.pd_metadata import PDWorkerMetadata
from hybridkv.connector.store_connector import HybridStoreConnector
from hybridkv.store.embedded_master import EmbeddedMaster
from hybridkv.store.mooncake_backend import MooncakeBackend
from tests.unit.pd_real_scheduler import (  # noqa: F401 (model_dir: fixture)
    model_dir,
    pd_request,
    pd_scheduler,
    prefill_leg,
    worker_reply,
)

BS = 16
PROMPT_TOKENS = 300  # hand-over 288 tokens; the whole prompt needs 19 + 6 blocks here
SECRET = str(write_secret_file(Path(tempfile.mkdtemp(prefix="hkv-pd-store-")) / "secret"))


@pytest.fixture(scope="module")
def store():
    """A real master and a client holding a segment (the store's memory)."""
    with (
        EmbeddedMaster() as master,
        MooncakeBackend(master.address, global_segment_size=64 << 20) as holder,
    ):
        buf = np.zeros(64, dtype=np.uint8)
        holder.register(int(buf.ctypes.data), buf.nbytes)
        yield master.address, holder, buf


def _geo(num_blocks: int) -> Geometry:
    return Geometry(
        [fa(BS), sw(BS, 64)], hash_block_size=BS, num_blocks=num_blocks, max_model_len=4096
    )


def _store_child(sched: Scheduler) -> HybridStoreConnector:
    (store_child,) = [c for c in sched.connector._connectors if isinstance(c, HybridStoreConnector)]
    return store_child


def _fill(sched: Scheduler, store, block_hashes, upto: int) -> None:
    """The store holds every group's object of this prefix up to token ``upto`` (what an
    earlier turn's saves wrote)."""
    _, holder, buf = store
    schema = _store_child(sched)._scheduler._schema
    keys = [
        schema.key(g, bytes(block_hashes[t // BS - 1]))
        for g in range(2)
        for t in range(BS, upto + 1, BS)
    ]
    assert holder.put_from(keys, [int(buf.ctypes.data)] * len(keys), [64] * len(keys)) == [0] * len(
        keys
    )


@pytest.mark.parametrize(
    "num_blocks", [40, 48]
)  # < twice the prompt's 25 blocks: vLLM's double reservation
def test_a_failed_read_of_a_prefix_the_store_holds_recomputes_without_stalling(
    model_dir, store, num_blocks
):
    prompt = random.Random(4000 + num_blocks).choices(range(3, 30000), k=PROMPT_TOKENS)
    params = prefill_leg(
        pd_scheduler(model_dir, "kv_producer", _geo(200), SECRET, max_num_seqs=16),
        pd_request(f"cmpl-pre-{num_blocks}", prompt, {"do_remote_decode": True}, BS),
    )
    sched = pd_scheduler(
        model_dir,
        "kv_consumer",
        _geo(num_blocks),
        SECRET,
        max_num_seqs=16,
        store_master=store[0],
        store_namespace=f"fr-{num_blocks}",
    )
    req = pd_request(
        f"cmpl-dec-{num_blocks}",
        prompt,
        params | {"do_remote_prefill": True, "do_remote_decode": False},
        BS,
    )
    _fill(sched, store, req.block_hashes, 288)
    sched.add_request(req)
    out = sched.schedule()
    assert req.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    pd_meta, store_meta = out.kv_connector_metadata.metadata
    assert [j.req_id for j in pd_meta.reads] == [
        req.request_id
    ] and not store_meta.loads  # P/D chosen
    # The prefill instance died: the READ failed; the workers released its target blocks.
    sched.update_from_output(
        out,
        worker_reply(
            out,
            finished_recving={req.request_id},
            failed_recving={req.request_id},
            kv_connector_worker_meta=MultiKVConnectorWorkerMetadata(
                metadata=(PDWorkerMetadata({req.request_id: 1}), None)
            ),
        ),
    )
    scheduled = []
    for _ in range(6):
        out = sched.schedule()
        scheduled.append(out.num_scheduled_tokens.get(req.request_id, 0))
        if scheduled[-1]:
            break
        sched.update_from_output(out, worker_reply(out))
    # One step skipped (the P/D connector's deferral after its own failed READ), then admitted.
    assert scheduled == [0, PROMPT_TOKENS], (
        f"engine stalled: the request was never admitted ({scheduled}); status {req.status.name}, "
        f"free {sched.kv_cache_manager.block_pool.get_num_free_blocks()} of {num_blocks}, "
        f"in-flight prefills {[r.request_id for r in sched._inflight_prefills]}"
    )
    # It recomputes its whole prompt: no store load was offered after the failed READ.
    assert not out.kv_connector_metadata.metadata[1].loads
