"""A prefill with an EAGLE drafter frees its hand-over's blocks once decode ends the lease.

Through vLLM's REAL ``Scheduler`` built with a real ``SpeculativeConfig`` (method eagle, two
speculative tokens: ``num_lookahead_tokens`` 2, EAGLE block drop on) over the gemma4 + EAGLE
geometry of tests/e2e/test_matrix.py: a sliding-window group (block 256, window 64), the
target's two full-attention groups (blocks 128 and 256) and the drafter's own full-attention
group (block 512). The prefill instance runs HybridPDConnector alone and inside vLLM's
MultiConnector with HybridStoreConnector (a real mooncake_master), as the P/D and the
P/D + store deployments do.

What must hold: at the finish the connector holds the hand-over's blocks (vLLM refuses a
prefix-cache reset), the engine has nothing to run, and the first step whose worker output
carries the lease's end (``leases_ended``) gives every block back: the pool is as full as
before the request and the reset succeeds. Until such a step runs the blocks stay held (the
connector holds them itself so that an idle prefill does not step: pd_lease_pins).
"""

from __future__ import annotations

import json
import random
import tempfile
from collections import Counter
from pathlib import Path

import pytest
from vllm.config import (
    CacheConfig,
    KVTransferConfig,
)
from vllm.distributed.kv_transfer.kv_connector.v1.multi_connector import (
    MultiKVConnectorWorkerMetadata,
)
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import (
    init_none_hash,
)
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.outputs import KVConnectorOutput

from hybridkv.cli.harness.kv_manager import Geometry, fa, sw
from hybridkv.cli.harness.tiny_models import _BUILDERS, _DRAFTERS
from hybridkv.connector.pd_auth import write_secret_file
from hybridkv.connector.pd_lease_pins import PDLeaseWorkerMetadata
from hybridkv.connector.pd_metadata import PDHandshakeMetadata
from hybridkv.connector.store_metadata import StoreWorkerMetadata
from hybridkv.store import vllm_compat
from hybridkv.store.embedded_master import EmbeddedMaster
from tests.unit.pd_real_scheduler import pd_request, real_scheduler

NUM_SPEC = 2
SECRET = str(write_secret_file(Path(tempfile.mkdtemp(prefix="hkv-pd-drafter-")) / "secret"))
# gemma4 + eagle-gemma4 as the CPU engine builds them: sliding 256 (window 64), target full
# attention 128 and 256, the drafter's full attention 512 (its own group, EAGLE's).
GEO = Geometry(
    specs=[sw(256, 64), fa(128), fa(256), fa(512)],
    hash_block_size=128,
    eagle_group=3,
    use_eagle=True,
    num_blocks=300,
    max_model_len=4096,
)
PROMPT = random.Random(41).choices(range(3, 30000), k=1600)


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """The tiny gemma4 target's and its EAGLE head's config.json (no weights: no forward)."""
    init_none_hash(sha256)
    root = tmp_path_factory.mktemp("gemma4-eagle")
    dirs = []
    for kind, builders in (("gemma4", _BUILDERS), ("eagle-gemma4", _DRAFTERS)):
        d = root / kind
        d.mkdir()
        (d / "config.json").write_text(json.dumps(builders[kind][0]()))
        dirs.append(d)
    return dirs[0], dirs[1]


@pytest.fixture(scope="module")
def master():
    with EmbeddedMaster() as m:
        yield m.address


def _transfer(deployment: str, master_address: str) -> KVTransferConfig:
    pd = {
        "kv_connector": "HybridPDConnector",
        "kv_role": "kv_producer",
        "kv_connector_module_path": "hybridkv.connector",
        "kv_connector_extra_config": {"auth_secret_file": SECRET},
    }
    if deployment == "pd":
        return KVTransferConfig(**pd, kv_load_failure_policy="recompute")
    store = {
        "kv_connector": "HybridStoreConnector",
        "kv_role": "kv_producer",
        "kv_connector_module_path": "hybridkv.connector",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {
            "master_address": master_address,
            "namespace": "pd-drafter-lease",
        },
    }
    return KVTransferConfig(
        kv_connector="MultiConnector",
        kv_role="kv_producer",
        kv_load_failure_policy="recompute",
        kv_connector_extra_config={"connectors": [pd, store]},
    )


def _prefill_scheduler(models: tuple[Path, Path], transfer: KVTransferConfig) -> Scheduler:
    """What ``EngineCore`` builds in a prefill's scheduler process with ``--speculative-config
    '{"method": "eagle", "num_speculative_tokens": 2}'`` (no workers)."""
    target, draft = models
    sched = real_scheduler(
        target,
        GEO,
        transfer,
        CacheConfig(block_size=128, enable_prefix_caching=True),
        max_num_batched_tokens=4096,
        eagle_draft=(draft, NUM_SPEC),
    )
    # With lookahead hashes (vLLM 0.34, both connectors opting in) vLLM takes no EAGLE drop.
    assert (sched.num_lookahead_tokens, sched.use_eagle_block_drop) == (
        NUM_SPEC,
        vllm_compat.hash_lookahead_tokens(sched) == 0,
    )
    sched.connector.set_xfer_handshake_metadata({0: PDHandshakeMetadata("127.0.0.1", 45678, 0)})
    return sched


def _worker_meta(deployment: str, pd_meta, store_meta):  # noqa: ANN001, ANN202
    if deployment == "pd":
        return pd_meta
    return MultiKVConnectorWorkerMetadata(metadata=(pd_meta, store_meta))


def _step(sched: Scheduler, deployment: str, sampled=None, leases_ended=None):  # noqa: ANN001, ANN202
    """One engine step: schedule(), then the workers' output (sampled tokens, every store save
    job of this step acknowledged, the given leases ended on this rank). Returns the save jobs
    and vLLM's outputs."""
    out = sched.schedule()
    store_plan = getattr(out.kv_connector_metadata, "metadata", (None, None))[-1]
    saves = list(getattr(store_plan, "saves", ()))
    store_meta = StoreWorkerMetadata(finished_saves=Counter({s.job_id: 1 for s in saves}))
    pd_meta = PDLeaseWorkerMetadata({}, dict(leases_ended or {}))
    ids = list(out.num_scheduled_tokens)
    return saves, sched.update_from_output(
        out,
        vllm_compat.model_runner_output(
            ids,
            sampled_token_ids=[list((sampled or {}).get(r, [])) for r in ids],
            kv_connector_output=KVConnectorOutput(
                kv_connector_worker_meta=_worker_meta(deployment, pd_meta, store_meta)
            ),
        ),
    )


@pytest.mark.parametrize("deployment", ["pd", "pd+store"])
def test_prefill_with_a_drafter_frees_every_block_at_the_step_that_reports_the_lease_end(
    models, master, deployment
):
    sched = _prefill_scheduler(models, _transfer(deployment, master))
    pool = sched.kv_cache_manager.block_pool
    free_before = pool.get_num_free_blocks()
    req = pd_request("cmpl-prefill-0", PROMPT, {"do_remote_decode": True}, 128)
    sched.add_request(req)
    saves, outputs = _step(sched, deployment, sampled={req.request_id: [7]})
    done = [o for eo in outputs.values() for o in eo.outputs if o.request_id == req.request_id]
    assert len(done) == 1 and done[0].kv_transfer_params["do_remote_prefill"], done
    remote = done[0].kv_transfer_params["remote_block_ids"]
    held = {b for group in remote for b in group if b}
    # The hand-over: the scheduler block (512) boundary before the last token (the prefill
    # computes one token more for the sliding window; what it signs ends at a hashed block).
    assert done[0].kv_transfer_params["remote_num_tokens"] == 1536
    assert req.request_id not in sched.requests, "vLLM freed the request (delay_free False)"
    # Store saves acknowledged in the finishing step's next steps; the lease still holds.
    for _ in range(3):
        saves += _step(sched, deployment)[0]
    # The store child saved the prompt's blocks in one job (its pins are gone with the ack).
    assert len(saves) == (1 if deployment == "pd+store" else 0)
    assert sched.has_requests() is False, "an idle engine: nothing steps it"
    assert sched.reset_prefix_cache() is False
    assert pool.get_num_free_blocks() == free_before - len(held)

    # Decode read the hand-over: the worker reports the lease ended at the next step.
    _step(sched, deployment, leases_ended={req.request_id: 1})
    assert pool.get_num_free_blocks() == free_before
    assert sched.reset_prefix_cache() is True
