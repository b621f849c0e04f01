"""Per-request prefix-cache hit limits through a REAL vLLM Scheduler driving the store connector.

vLLM 0.34 bounds a request's hit by ``Request.prefix_cache_hit_limit`` (prompt
logprobs: ``prompt_logprob_start``, or 0 when the request skips cache reads) and
discards external hits of such a request (``skip_reading_external_kv``). On 0.32
and 0.33 requests have no such limit and these tests are skipped.
"""

from __future__ import annotations

import pytest
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import get_request_block_hasher
from vllm.v1.request import Request, RequestStatus

from hybridkv.cli.harness.kv_manager import Geometry, fa, sw
from hybridkv.store import vllm_compat
from tests.unit.test_real_scheduler import (  # noqa: F401  (store: a fixture)
    PROMPT,
    UNIT,
    WINDOW,
    _fill_store,
    _run_to_completion,
    _scheduler,
    store,
)

# Full attention + a sliding window: hybridkv's dense-reference lookup replaces vLLM's, and every
# block boundary is a hit vLLM itself can serve (no Mamba checkpoints to line up with).
FA_SW = Geometry(
    specs=[fa(16), sw(16, 64)], hash_block_size=UNIT, num_blocks=600, max_model_len=4096
)

pytestmark = pytest.mark.skipif(
    not hasattr(Request, "get_max_cache_hit_length"),
    reason="vLLM < 0.34 has no per-request hit limit",
)


def _scored(req_id: str, start: int | None, skip_reading: bool | None) -> Request:
    params = SamplingParams(
        max_tokens=1,
        prompt_logprobs=1,
        prompt_logprob_start=start,
        skip_reading_prefix_cache=skip_reading,
    )
    return Request(
        req_id, list(PROMPT), params, None, block_hasher=get_request_block_hasher(UNIT, sha256)
    )


def _admitted_at(sched, req: Request) -> int:
    sched.add_request(req)
    out = sched.schedule()
    new = [r for r in out.scheduled_new_reqs if r.req_id == req.request_id]
    assert len(new) == 1
    return new[0].num_computed_tokens


def test_local_hit_stops_at_the_first_scored_prompt_row(store):
    """The prompt is in the local cache; prompt logprobs from row 300 on, cache reads allowed
    before it. The connector's local lookup (hybridkv's dense-reference replacement of
    ``get_computed_blocks_for_connector``) must stop where vLLM's own lookup stops under the
    request's limit: the last 16-token boundary at or below 300."""
    sched = _scheduler(FA_SW, store[0], store[3], "limit-local")
    _run_to_completion(
        sched,
        Request(
            "warm",
            list(PROMPT),
            SamplingParams(max_tokens=1),
            None,
            block_hasher=get_request_block_hasher(UNIT, sha256),
        ),
    )
    req = _scored("scored-300", 300, skip_reading=False)
    assert req.prefix_cache_hit_limit == 300
    assert vllm_compat.max_cache_hit_length(req) == 300
    vllm_hit = sched.kv_cache_manager.coordinator.find_longest_cache_hit(req.block_hashes, 300)[1]
    assert vllm_hit == 288
    assert _admitted_at(sched, req) == 288
    # Unbounded, the same prompt hits every full block (the local cache holds the whole prompt).
    assert (
        _admitted_at(
            sched,
            Request(
                "plain",
                list(PROMPT),
                SamplingParams(max_tokens=1),
                None,
                block_hasher=get_request_block_hasher(UNIT, sha256),
            ),
        )
        == 992
    )


def test_prompt_logprobs_read_no_cache_by_default(store):
    """Prompt logprobs without a start: vLLM skips cache reads (limit 0), local and external."""
    sched = _scheduler(WINDOW, store[0], store[3], "limit-zero")
    _fill_store(sched, store, 512)
    req = _scored("scored-all", None, skip_reading=None)
    assert req.prefix_cache_hit_limit == 0 and vllm_compat.skips_external_kv(req)
    assert _admitted_at(sched, req) == 0
    assert req.status == RequestStatus.RUNNING  # no external load was started either


def test_the_store_is_not_asked_for_a_request_whose_external_hit_vllm_discards(store):
    """The store holds the prompt up to 512; a bounded request's external hit is discarded by
    vLLM's scheduler, so the connector must answer 0 without a store round trip."""
    sched = _scheduler(WINDOW, store[0], store[3], "limit-no-query")
    _fill_store(sched, store, 512)
    asked = []
    inner = sched.connector._scheduler._exists
    sched.connector._scheduler._exists = lambda *a, **k: asked.append(a) or inner(*a, **k)
    req = _scored("scored-store", 300, skip_reading=False)
    assert _admitted_at(sched, req) == 0
    assert asked == []
