"""A loss on ONE tensor-parallel rank: the block is lost for the scheduler (TP2).

At ``--tensor-parallel-size 2`` each rank stores its own shard of every block under its own
object name, and the scheduler counts a block present only when every rank's object is
(``AllRankKeys``): a hit rank 1 cannot load fails rank 1's load and the request recomputes.
Objects live in whichever segment the master placed them, so a dropped segment or an
eviction can take rank 1's object of a block and leave rank 0's. The scheduler must then
see the block as absent (not offer a hit over it that rank 1's load fails), forget it from
``_recent`` although rank 0's object is there, and offer it for saving again when the
recompute passes it, while the keys before it (both ranks' objects stored) stay.

The loss here is deterministic: a real mooncake_master, the workers' puts written as they
would be (both ranks' objects of every block the first prefill offered), then rank 1's
object of one block removed through the backend's ``remove`` verb (``force``: no lease
wait). Engine-free: vLLM's real ``Scheduler`` built at ``tensor_parallel_size=2`` (its
connector gets ``world_size`` 2 and the TP2 key schema), each worker's acknowledgement of a
step summed over two workers as vLLM's output aggregator does.

Planted: the scheduler takes rank 0's answer for the block (``AllRankKeys.all_present``
keeping each block's first answer): the block reads present (and, without that assert, the
lookup offers 992 tokens over it, a load rank 1 would fail); ``_forget_missing`` not
forgetting: the lost block stays in ``_recent``; the old rule (the whole prompt forgotten):
the 62 keys before the loss, recomputed and still stored, leave ``_recent`` too.
"""

from __future__ import annotations

from functools import partial

import numpy as np
import pytest
from vllm.config import ParallelConfig, VllmConfig

import tests.unit.test_real_scheduler as real_scheduler
from hybridkv.store.embedded_master import EmbeddedMaster
from hybridkv.store.mooncake_backend import MooncakeBackend
from hybridkv.store.session import release_all
from tests.unit.test_real_scheduler import UNIT, WINDOW, _request, _run_to_completion, _scheduler
from tests.unit.test_store_segment_loss import tiny_model  # noqa: F401 - fixture

LOST_END = 512  # the lost block: full attention (group 0) tokens 496..511


@pytest.fixture
def tp2(monkeypatch):
    """test_real_scheduler's helpers at tensor_parallel_size 2: its VllmConfig gets the
    parallel config, and every worker reply is two workers' (each report counted twice:
    a save job or a load is done only when both ranks say so)."""
    monkeypatch.setattr(
        real_scheduler,
        "VllmConfig",
        partial(VllmConfig, parallel_config=ParallelConfig(tensor_parallel_size=2)),
    )
    one_worker = real_scheduler._worker_reply

    def two_workers(*args, **kwargs):
        reply = one_worker(*args, **kwargs)
        meta = reply.kv_connector_output.kv_connector_worker_meta
        reply.kv_connector_output.kv_connector_worker_meta = meta.aggregate(meta)
        return reply

    monkeypatch.setattr(real_scheduler, "_worker_reply", two_workers)


def test_a_block_only_rank_1_lost_is_absent_forgotten_and_saved_again(tp2, tiny_model):  # noqa: F811
    with (
        EmbeddedMaster() as master,
        MooncakeBackend(master.address, global_segment_size=64 << 20) as holder,
    ):
        try:
            sched = _scheduler(WINDOW, master.address, tiny_model, "tp2-loss", policy="recompute")
            conn = sched.connector._scheduler
            assert (conn._world_size, conn._rank_keys.num_ranks) == (2, 2)
            first = _run_to_completion(sched, _request("tp2-loss-a"))
            assert not conn._save_keys, "both workers' acks must end every save job"
            buf = np.zeros(64, dtype=np.uint8)
            holder.register(int(buf.ctypes.data), buf.nbytes)
            names = conn._rank_keys.names(sorted(first))  # what the two workers' saves wrote
            assert holder.put_from(
                names, [int(buf.ctypes.data)] * len(names), [64] * len(names)
            ) == [0] * len(names)

            req = _request("tp2-loss-b")
            unit_of = {bytes(h): i for i, h in enumerate(req.block_hashes)}
            lost = (0, bytes(req.block_hashes[LOST_END // UNIT - 1]))
            assert lost in first and lost in conn._recent
            rank0, rank1 = conn._rank_keys.names([lost])
            assert holder.remove(rank1, force=True) == 0
            assert holder.exists([rank0, rank1]) == [True, False]
            assert conn._exists([lost]) == [False], (
                "a block with one rank's object lost must read absent"
            )

            assert sched.kv_cache_manager.reset_prefix_cache()
            hit, _ = conn.get_num_new_matched_tokens(req, 0)
            assert hit < LOST_END - WINDOW.scheduler_block_size, (
                hit
            )  # the hit ends before the lost block
            before = {k for k in first if unit_of[k[1]] < LOST_END // UNIT - 1}
            assert lost not in conn._recent, "the lookup must forget the block rank 1 lost"
            assert before <= set(conn._recent), "keys before the loss were found present: kept"
            again = _run_to_completion(sched, req)
            # The recompute offers the lost block again, and every key from it on (not asked
            # that far: sparse tails and states), none before it (still stored, both ranks).
            assert lost in again
            assert again == first - before, (len(again), len(first - before))
            assert {k for k in before if unit_of[k[1]] * UNIT >= hit}, (
                "nothing recomputed before the loss"
            )
        finally:
            release_all()
