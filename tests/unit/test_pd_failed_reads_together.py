"""Several P/D READs failing in ONE step, in a KV cache they fill, through a REAL vLLM ``Scheduler``.

What a dead prefill instance does to a decode instance: every READ it had in flight fails
together (tests/unit/test_real_scheduler.py's store twin: a store node dies). vLLM 0.32 and
0.33 free a failed load's blocks only when schedule() reaches the request in
``kv_holding_waiting``, and stop at the first request there that cannot allocate. The first
failed request, reset to recompute its whole prompt, cannot fit while the failed READs
behind it still hold their blocks: nothing runs and nothing frees (the engine stalls until
clients give up). HybridPDConnector answers ``None`` ("not known yet") once after a READ it
posted failed, so that request steps aside holding nothing and the same step frees the
others (``PDScheduler.failed_read_deferrals``).

Both sides are real vLLM schedulers (no workers): the prefill legs run through a prefill
``Scheduler`` and return real signed ``kv_transfer_params``; the decode ``Scheduler`` admits
their READs; the workers' "READ failed" comes back through ``update_from_output`` exactly as
``PDWorker.get_transfer_results`` reports it (finished + failed, target blocks released).
"""

from __future__ import annotations

import random
import tempfile
from pathlib import Path

import pytest
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.request import Request, RequestStatus

from hybridkv.cli.harness.kv_manager import Geometry, fa, sw
from hybridkv.connector.pd_auth import write_secret_file
from hybridkv.connector.pd_metadata import PDWorkerMetadata
from tests.unit.pd_real_scheduler import (  # noqa: F401 (model_dir: fixture)
    model_dir,
    pd_request,
    pd_scheduler,
    prefill_leg,
    worker_reply,
)

BS = 16
PROMPT_TOKENS = 300  # hand-over 288 tokens: 18 full-attention blocks + the window's
SECRET = str(write_secret_file(Path(tempfile.mkdtemp(prefix="hkv-pd-fail-")) / "secret"))


def _scheduler(model_dir, role: str, num_blocks: int) -> Scheduler:
    geo = Geometry(
        [fa(BS), sw(BS, 64)], hash_block_size=BS, num_blocks=num_blocks, max_model_len=4096
    )
    return pd_scheduler(model_dir, role, geo, SECRET, max_num_seqs=16)


def _request(req_id: str, prompt: list[int], params: dict) -> Request:
    return pd_request(req_id, prompt, params, BS)


def _prefill(model_dir, req_id: str, prompt: list[int], num_blocks: int) -> dict:
    """One prefill leg through a real prefill scheduler: its signed kv_transfer_params."""
    return prefill_leg(
        _scheduler(model_dir, "kv_producer", num_blocks),
        _request(req_id, prompt, {"do_remote_decode": True}),
    )


@pytest.mark.parametrize("num_blocks", [48, 56, 72, 80])  # each stalls without the deferral
def test_reads_failing_together_do_not_stall_the_engine(model_dir, num_blocks):
    prompts = [random.Random(2000 + i).choices(range(3, 30000), k=PROMPT_TOKENS) for i in range(6)]
    params = [_prefill(model_dir, f"cmpl-p{i}", p, num_blocks) for i, p in enumerate(prompts)]
    sched = _scheduler(model_dir, "kv_consumer", num_blocks)
    pd = sched.connector._scheduler
    reqs = [
        _request(
            f"cmpl-d{num_blocks}-{i}",
            p,
            kv | {"do_remote_prefill": True, "do_remote_decode": False},
        )
        for i, (p, kv) in enumerate(zip(prompts, params))
    ]
    for r in reqs:
        sched.add_request(r)
    out = sched.schedule()
    loading = [r for r in reqs if r.status == RequestStatus.WAITING_FOR_REMOTE_KVS]
    assert len(loading) >= 2, "the test needs several READs in flight at once"
    assert {j.req_id for j in out.kv_connector_metadata.reads} == {r.request_id for r in loading}
    assert all(r.num_computed_tokens == 288 for r in loading)
    ids = {r.request_id for r in loading}
    # The prefill instance died: every READ failed; the workers release their target blocks.
    sched.update_from_output(
        out,
        worker_reply(
            out,
            finished_recving=set(ids),
            failed_recving=set(ids),
            kv_connector_worker_meta=PDWorkerMetadata({r: 1 for r in ids}),
        ),
    )
    out = sched.schedule()
    statuses = [r.status for r in loading]
    holding = [
        r.request_id
        for r in loading
        if any(any(g) for g in sched.kv_cache_manager.get_block_ids(r.request_id))
    ]
    deferred, pinned = pd.failed_read_deferrals, pd.has_pins()
    for _ in range(40):
        if out.num_scheduled_tokens:
            break
        reads = out.kv_connector_metadata.reads  # later admissions' READs: these land
        done = {j.req_id for j in reads if not j.release_only}
        sched.update_from_output(
            out,
            worker_reply(
                out,
                finished_recving=done,
                kv_connector_worker_meta=PDWorkerMetadata({r: 1 for r in done}),
            ),
        )
        out = sched.schedule()
    assert out.num_scheduled_tokens, (
        f"engine stalled: free {sched.kv_cache_manager.block_pool.get_num_free_blocks()} of {num_blocks}, "
        f"{[(r.request_id, r.status.name, r.num_computed_tokens) for r in reqs]}"
    )
    # The step right after the failure: every failed READ had given its blocks back (each
    # stepped aside once), and the READ targets were unpinned.
    assert statuses == [RequestStatus.WAITING] * len(loading) and holding == []
    assert deferred == len(loading) and not pinned
    # A failed READ recomputes its whole prompt: its second admission offers nothing (one
    # transfer per request).
    recomputing = {
        r.request_id: PROMPT_TOKENS for r in loading if r.request_id in out.num_scheduled_tokens
    }
    assert recomputing and {r: out.num_scheduled_tokens[r] for r in recomputing} == recomputing
    assert pd.failed_read_deferrals == len(loading)  # once each, never again


def test_a_read_that_lands_is_not_deferred(model_dir):
    """Only a failed READ steps aside, and only one this connector posted."""
    prompts = [random.Random(3000 + i).choices(range(3, 30000), k=PROMPT_TOKENS) for i in range(2)]
    params = [_prefill(model_dir, f"cmpl-q{i}", p, 200) for i, p in enumerate(prompts)]
    sched = _scheduler(model_dir, "kv_consumer", 200)
    pd = sched.connector._scheduler
    ok, other = (
        _request(f"cmpl-ok-{i}", p, kv | {"do_remote_prefill": True, "do_remote_decode": False})
        for i, (p, kv) in enumerate(zip(prompts, params))
    )
    local = _request("cmpl-local", prompts[0][:200], {})  # no P/D: computed here
    for r in (ok, other, local):
        sched.add_request(r)
    out = sched.schedule()
    assert ok.status == other.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    # ok's READ lands; a failure reported for a request this connector never read (another
    # MultiConnector child's load) is not this connector's to defer.
    sched.update_from_output(
        out,
        worker_reply(
            out,
            finished_recving={ok.request_id},
            failed_recving={local.request_id},
            kv_connector_worker_meta=PDWorkerMetadata({ok.request_id: 1}),
        ),
    )
    out = sched.schedule()
    assert out.num_scheduled_tokens.get(ok.request_id) == PROMPT_TOKENS - 288
    assert pd.failed_read_deferrals == 0
    # Under MultiConnector every child is asked about that request at its next admission
    # (here it runs already, so ask directly): an answer, not a deferral.
    assert pd.get_num_new_matched_tokens(local, 0) == (0, False) and pd.failed_read_deferrals == 0
