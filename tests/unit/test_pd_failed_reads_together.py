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

import json
import random
import tempfile
from pathlib import Path

import pytest
from vllm.config import CacheConfig, KVTransferConfig, ModelConfig, SchedulerConfig, VllmConfig
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import (
    get_request_block_hasher,
    init_none_hash,
    resolve_cache_hit_alignment_tokens,
    resolve_kv_cache_block_sizes,
)
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
from vllm.v1.request import Request, RequestStatus
from vllm.v1.structured_output import StructuredOutputManager

from hybridkv.connector.pd_auth import write_secret_file
from hybridkv.connector.pd_connector import HybridPDConnector
from hybridkv.connector.pd_metadata import PDHandshakeMetadata, PDWorkerMetadata
from tests.unit.harness import Geometry, fa, sw
from tests.unit.tiny_vllm_config import TINY_LLAMA

BS = 16
PROMPT_TOKENS = 300  # hand-over 288 tokens: 18 full-attention blocks + the window's
SECRET = str(write_secret_file(Path(tempfile.mkdtemp(prefix="hkv-pd-fail-")) / "secret"))


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    init_none_hash(sha256)
    d = tmp_path_factory.mktemp("tiny-llama")
    (d / "config.json").write_text(json.dumps(TINY_LLAMA))
    return d


def _scheduler(model_dir, role: str, num_blocks: int) -> Scheduler:
    """What ``EngineCore`` builds in the scheduler process (no workers)."""
    geo = Geometry([fa(BS), sw(BS, 64)], hash_block_size=BS, num_blocks=num_blocks, max_model_len=4096)
    vllm_config = VllmConfig(
        model_config=ModelConfig(model=str(model_dir), skip_tokenizer_init=True, dtype="bfloat16",
                                 enforce_eager=True, max_model_len=geo.max_model_len),
        cache_config=CacheConfig(block_size=BS, enable_prefix_caching=True),
        scheduler_config=SchedulerConfig(max_num_batched_tokens=2048, max_num_seqs=16,
                                         max_model_len=geo.max_model_len, is_encoder_decoder=False),
        kv_transfer_config=KVTransferConfig(
            kv_connector="HybridPDConnector", kv_role=role, kv_connector_module_path="hybridkv.connector",
            kv_load_failure_policy="recompute", kv_connector_extra_config={"auth_secret_file": SECRET}),
    )
    kv_cache_config = geo.kv_cache_config()
    vllm_config.cache_config.num_gpu_blocks = kv_cache_config.num_blocks
    block_size, hash_block_size = resolve_kv_cache_block_sizes(kv_cache_config, vllm_config)
    kv_cache_config.hash_block_size = hash_block_size
    kv_cache_config.cache_hit_alignment_tokens = resolve_cache_hit_alignment_tokens(
        kv_cache_config, vllm_config, block_size, hash_block_size)
    sched = Scheduler(vllm_config=vllm_config, kv_cache_config=kv_cache_config,
                      structured_output_manager=StructuredOutputManager(vllm_config),
                      block_size=block_size, hash_block_size=hash_block_size)
    assert isinstance(sched.connector, HybridPDConnector)
    return sched


def _request(req_id: str, prompt: list[int], params: dict) -> Request:
    req = Request(req_id, list(prompt), SamplingParams(max_tokens=1), None,
                  block_hasher=get_request_block_hasher(BS, sha256))
    req.kv_transfer_params = dict(params)
    return req


def _reply(out, sampled: dict[str, list[int]] | None = None, **connector: object) -> ModelRunnerOutput:
    """What the workers report for this step (no forward: connector results only)."""
    ids = list(out.num_scheduled_tokens)
    return ModelRunnerOutput(req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)},
                             sampled_token_ids=[list((sampled or {}).get(r, [])) for r in ids],
                             kv_connector_output=KVConnectorOutput(**connector))


def _prefill(model_dir, req_id: str, prompt: list[int], num_blocks: int) -> dict:
    """One prefill leg through a real prefill scheduler: its signed kv_transfer_params."""
    sched = _scheduler(model_dir, "kv_producer", num_blocks)
    sched.connector.set_xfer_handshake_metadata({0: PDHandshakeMetadata("127.0.0.1", 45678, 0)})
    sched.add_request(_request(req_id, prompt, {"do_remote_decode": True}))
    out = sched.schedule()
    outputs = sched.update_from_output(out, _reply(out, {r: [7] for r in out.num_scheduled_tokens},
                                                   kv_connector_worker_meta=PDWorkerMetadata({})))
    done = [o for eo in outputs.values() for o in eo.outputs if o.request_id == req_id]
    assert len(done) == 1 and done[0].kv_transfer_params, done
    return done[0].kv_transfer_params


@pytest.mark.parametrize("num_blocks", [48, 56, 72, 80])  # each stalls without the deferral
def test_reads_failing_together_do_not_stall_the_engine(model_dir, num_blocks):
    prompts = [random.Random(2000 + i).choices(range(3, 30000), k=PROMPT_TOKENS) for i in range(6)]
    params = [_prefill(model_dir, f"cmpl-p{i}", p, num_blocks) for i, p in enumerate(prompts)]
    sched = _scheduler(model_dir, "kv_consumer", num_blocks)
    pd = sched.connector._scheduler
    reqs = [_request(f"cmpl-d{num_blocks}-{i}", p, kv | {"do_remote_prefill": True, "do_remote_decode": False})
            for i, (p, kv) in enumerate(zip(prompts, params))]
    for r in reqs:
        sched.add_request(r)
    out = sched.schedule()
    loading = [r for r in reqs if r.status == RequestStatus.WAITING_FOR_REMOTE_KVS]
    assert len(loading) >= 2, "the test needs several READs in flight at once"
    assert {j.req_id for j in out.kv_connector_metadata.reads} == {r.request_id for r in loading}
    assert all(r.num_computed_tokens == 288 for r in loading)
    ids = {r.request_id for r in loading}
    # The prefill instance died: every READ failed; the workers release their target blocks.
    sched.update_from_output(out, _reply(out, finished_recving=set(ids), failed_recving=set(ids),
                                         kv_connector_worker_meta=PDWorkerMetadata({r: 1 for r in ids})))
    out = sched.schedule()
    statuses = [r.status for r in loading]
    holding = [r.request_id for r in loading if any(any(g) for g in sched.kv_cache_manager.get_block_ids(r.request_id))]
    deferred, pinned = pd.failed_read_deferrals, pd.has_pins()
    for _ in range(40):
        if out.num_scheduled_tokens:
            break
        reads = out.kv_connector_metadata.reads  # later admissions' READs: these land
        done = {j.req_id for j in reads if not j.release_only}
        sched.update_from_output(out, _reply(out, finished_recving=done,
                                             kv_connector_worker_meta=PDWorkerMetadata({r: 1 for r in done})))
        out = sched.schedule()
    assert out.num_scheduled_tokens, (
        f"engine stalled: free {sched.kv_cache_manager.block_pool.get_num_free_blocks()} of {num_blocks}, "
        f"{[(r.request_id, r.status.name, r.num_computed_tokens) for r in reqs]}")
    # The step right after the failure: every failed READ had given its blocks back (each
    # stepped aside once), and the READ targets were unpinned.
    assert statuses == [RequestStatus.WAITING] * len(loading) and holding == []
    assert deferred == len(loading) and not pinned
    # A failed READ recomputes its whole prompt: its second admission offers nothing (one
    # transfer per request).
    recomputing = {r.request_id: PROMPT_TOKENS for r in loading if r.request_id in out.num_scheduled_tokens}
    assert recomputing and {r: out.num_scheduled_tokens[r] for r in recomputing} == recomputing
    assert pd.failed_read_deferrals == len(loading)  # once each, never again


def test_a_read_that_lands_is_not_deferred(model_dir):
    """Only a failed READ steps aside, and only one this connector posted."""
    prompts = [random.Random(3000 + i).choices(range(3, 30000), k=PROMPT_TOKENS) for i in range(2)]
    params = [_prefill(model_dir, f"cmpl-q{i}", p, 200) for i, p in enumerate(prompts)]
    sched = _scheduler(model_dir, "kv_consumer", 200)
    pd = sched.connector._scheduler
    ok, other = (_request(f"cmpl-ok-{i}", p, kv | {"do_remote_prefill": True, "do_remote_decode": False})
                 for i, (p, kv) in enumerate(zip(prompts, params)))
    local = _request("cmpl-local", prompts[0][:200], {})  # no P/D: computed here
    for r in (ok, other, local):
        sched.add_request(r)
    out = sched.schedule()
    assert ok.status == other.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    # ok's READ lands; a failure reported for a request this connector never read (another
    # MultiConnector child's load) is not this connector's to defer.
    sched.update_from_output(out, _reply(out, finished_recving={ok.request_id}, failed_recving={local.request_id},
                                         kv_connector_worker_meta=PDWorkerMetadata({ok.request_id: 1})))
    out = sched.schedule()
    assert out.num_scheduled_tokens.get(ok.request_id) == PROMPT_TOKENS - 288
    assert pd.failed_read_deferrals == 0
