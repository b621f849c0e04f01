"""P/D with lookahead block hashes (vLLM 0.34) through REAL 0.34 Schedulers on both sides.

0.34 hashes each block together with the token after it (``num_hash_lookahead_tokens``, one
for EAGLE) when the engine runs an EAGLE drafter and the connector class supports them;
MultiConnector supports them only if every child does. HybridPDConnector beside an in-tree
sibling (MooncakeStoreConnector, which supports them) must keep them on, and a hand-over must
still be accepted: a prefill that computes its whole prompt samples a token, and the lookahead
hash of a prompt block ending within that many tokens of the prompt's end covers the sampled
token, which decode (holding only the prompt) cannot hash. The prefill side signs and hands
over only the blocks whose hashes decode computes identically (``prompt_hashed_tokens``); a
prefill that cut its prompt (sliding window, Mamba) hashed its blocks before the cut, over the
prompt's own tokens, so every hash it signs is one decode computes.

Both sides run the same EAGLE speculative config (target + 2 draft tokens) and the same
MultiConnector (HybridPDConnector, MooncakeStoreConnector without lookups). Prompts end on a
hash-block boundary, one token past it, and one token (the lookahead) short of it.
"""

from __future__ import annotations

import json
import random
import tempfile
from pathlib import Path

import pytest
import torch
from vllm.config import CacheConfig, KVTransferConfig
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1
from vllm.distributed.kv_transfer.kv_connector.v1.multi_connector import (
    MultiKVConnectorWorkerMetadata,
)
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import MambaSpec
from vllm.v1.outputs import KVConnectorOutput
from vllm.v1.request import Request, RequestStatus

from hybridkv.cli.harness.kv_manager import Geometry, fa, sw
from hybridkv.connector.pd_auth import write_secret_file
from hybridkv.connector.pd_connector import HybridPDConnector
from hybridkv.connector.pd_metadata import PDHandshakeMetadata, PDWorkerMetadata
from hybridkv.store import vllm_compat
from tests.unit.pd_real_scheduler import real_scheduler
from tests.unit.tiny_vllm_config import TINY_LLAMA

pytestmark = pytest.mark.skipif(
    not hasattr(KVConnectorBase_V1, "supports_lookahead_block_hashes"),
    reason="vLLM < 0.34 has no connector opt-in for lookahead block hashes",
)

UNIT = 16
SECRET = str(write_secret_file(Path(tempfile.mkdtemp(prefix="hkv-pd-lookahead-")) / "secret"))
GEOMETRIES = {
    # Full attention only: the prefill computes its whole prompt (nothing is cut).
    "attention": Geometry(
        specs=[fa(UNIT), fa(2 * UNIT)], hash_block_size=UNIT, eagle_group=1, num_blocks=600
    ),
    # A sliding window: the prefill cuts its prompt to the hand-over boundary (+ 1).
    "sliding": Geometry(
        specs=[fa(UNIT), sw(UNIT, 64), fa(2 * UNIT)],
        hash_block_size=UNIT,
        eagle_group=2,
        num_blocks=600,
    ),
    # Mamba state: the prefill cuts its prompt to exactly the hand-over boundary.
    "mamba": Geometry(
        specs=[
            fa(2 * UNIT),
            MambaSpec(
                block_size=2 * UNIT,
                shapes=((4,),),
                dtypes=(torch.float32,),
                mamba_cache_mode="align",
                num_speculative_blocks=2,
            ),
            fa(2 * UNIT),
        ],
        hash_block_size=2 * UNIT,
        eagle_group=2,
        num_blocks=600,
    ),
}


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """Tiny target and EAGLE draft model dirs (config.json only: no forward runs)."""
    init_none_hash(sha256)
    d = tmp_path_factory.mktemp("pd-lookahead")
    (d / "target").mkdir()
    (d / "target" / "config.json").write_text(json.dumps(TINY_LLAMA))
    draft = dict(TINY_LLAMA, architectures=["EagleLlamaForCausalLM"], num_hidden_layers=1)
    (d / "draft").mkdir()
    (d / "draft" / "config.json").write_text(json.dumps(draft))
    return d / "target", d / "draft"


def _transfer(role: str) -> KVTransferConfig:
    """HybridPDConnector beside vLLM's in-tree MooncakeStoreConnector (lookups off: its
    workers are not here), as a P/D deployment with an in-tree store runs them."""
    return KVTransferConfig(
        kv_connector="MultiConnector",
        kv_role=role,
        kv_load_failure_policy="recompute",
        kv_connector_extra_config={
            "connectors": [
                {
                    "kv_connector": "HybridPDConnector",
                    "kv_role": role,
                    "kv_connector_module_path": "hybridkv.connector",
                    "kv_connector_extra_config": {"auth_secret_file": SECRET},
                },
                {
                    "kv_connector": "MooncakeStoreConnector",
                    "kv_role": role,
                    "kv_connector_extra_config": {"enable_lookup": False},
                },
            ]
        },
    )


def _scheduler(models: tuple[Path, Path], geo: Geometry, role: str) -> Scheduler:
    """What ``EngineCore`` builds with ``--speculative-config '{"method": "eagle",
    "num_speculative_tokens": 2}'`` (no workers)."""
    sched = real_scheduler(
        models[0],
        geo,
        _transfer(role),
        CacheConfig(block_size=geo.hash_block_size, enable_prefix_caching=True),
        max_num_batched_tokens=4096,
        eagle_draft=(models[1], 2),
    )
    sched.connector.set_xfer_handshake_metadata({0: PDHandshakeMetadata("127.0.0.1", 45678, 0)})
    return sched


def _pd(sched: Scheduler) -> HybridPDConnector:
    (pd,) = [c for c in sched.connector._connectors if isinstance(c, HybridPDConnector)]
    return pd


def _request(sched: Scheduler, req_id: str, prompt: list[int], params: dict) -> Request:
    """A request hashed as ``EngineCore`` hashes it (the engine's lookahead count)."""
    req = Request(
        req_id,
        list(prompt),
        SamplingParams(max_tokens=1),
        None,
        block_hasher=get_request_block_hasher(
            sched.kv_cache_manager.block_pool.hash_block_size,
            sha256,
            sched.num_hash_lookahead_tokens,
        ),
    )
    req.kv_transfer_params = dict(params)
    return req


def _prefill_leg(sched: Scheduler, req: Request) -> dict:
    """One prefill step (one token sampled): the signed params its finished request hands on."""
    sched.add_request(req)
    out = sched.schedule()
    ids = list(out.num_scheduled_tokens)
    outputs = sched.update_from_output(
        out,
        vllm_compat.model_runner_output(
            ids,
            sampled_token_ids=[[7] for _ in ids],
            kv_connector_output=KVConnectorOutput(
                kv_connector_worker_meta=MultiKVConnectorWorkerMetadata(
                    metadata=(PDWorkerMetadata({}), None)
                )
            ),
        ),
    )
    done = [o for eo in outputs.values() for o in eo.outputs if o.request_id == req.request_id]
    assert len(done) == 1 and done[0].kv_transfer_params, done
    return done[0].kv_transfer_params


def test_lookahead_stays_on_beside_an_in_tree_sibling(models):
    """HybridPDConnector keeps the sibling's lookahead count (EAGLE: 1) on both roles."""
    for role in ("kv_producer", "kv_consumer"):
        sched = _scheduler(models, GEOMETRIES["attention"], role)
        assert sched.num_hash_lookahead_tokens == sched.vllm_config.num_prefill_lookahead_tokens
        assert sched.num_hash_lookahead_tokens == 1


@pytest.mark.parametrize("geometry", sorted(GEOMETRIES))
@pytest.mark.parametrize("where", ["on_boundary", "one_past", "lookahead_short"])
def test_decode_accepts_the_hand_over_and_reads_only_blocks_whose_hashes_match(
    models, geometry, where
):
    geo = GEOMETRIES[geometry]
    bs = geo.hash_block_size
    n = {"on_boundary": 16 * bs, "one_past": 16 * bs + 1, "lookahead_short": 16 * bs - 1}[where]
    prompt = random.Random(n).choices(range(3, 30000), k=n)
    prefill = _scheduler(models, geo, "kv_producer")
    decode = _scheduler(models, geo, "kv_consumer")
    lookahead = decode.num_hash_lookahead_tokens
    assert lookahead == prefill.num_hash_lookahead_tokens == 1
    preq = _request(prefill, "cmpl-prefill", prompt, {"do_remote_decode": True})
    params = _prefill_leg(prefill, preq)

    dreq = _request(
        decode,
        "cmpl-decode",
        prompt,
        params | {"do_remote_prefill": True, "do_remote_decode": False},
    )
    decode.add_request(dreq)
    out = decode.schedule()
    pd_meta = out.kv_connector_metadata.metadata[0]
    (job,) = pd_meta.reads
    align = _pd(decode)._scheduler._align
    handover = (n - 1) // align * align
    # Decode takes the whole hand-over (the last scheduler-block boundary before its final
    # token), as without lookahead hashes, asynchronously (READ posted).
    assert (job.refused, job.release_only) == (None, False)
    assert dreq.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    assert dreq.num_computed_tokens == handover
    # Every block it reads is covered by a hash the prefill signed, equal to decode's own.
    signed = params["remote_num_tokens"] // bs
    assert [bytes(h) for h in preq.block_hashes[:signed]] == [
        bytes(h) for h in dreq.block_hashes[:signed]
    ]
    read = len(job.remote_block_ids[0])
    assert read == handover // geo.specs[0].block_size
    assert read * geo.specs[0].block_size <= signed * bs
    if geometry == "attention":
        # The whole prompt was computed: a block ending on the prompt's end is not signed.
        assert (
            params["remote_num_tokens"]
            == {
                "on_boundary": n - 1,
                "one_past": n - 1,
                "lookahead_short": (n - 1) // bs * bs,
            }[where]
        )
