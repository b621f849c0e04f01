"""A REAL vLLM ``Scheduler`` with HybridPDConnector loaded, built as ``EngineCore`` builds it.

Shared by the P/D tests that drive vLLM's own schedule()/update_from_output (no workers,
no engine): a dead prefill instance's READs failing together, the sliding-window
hand-over. One builder, so both exercise the same resolution of block sizes and cache-hit
alignment that vLLM's engine core does; a copy could drift from it and from each other.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from vllm.config import (
    CacheConfig,
    KVTransferConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
    SpeculativeConfig,
    VllmConfig,
)
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import (
    get_request_block_hasher,
    init_none_hash,
    resolve_cache_hit_alignment_tokens,
    resolve_kv_cache_block_sizes,
)
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
from vllm.v1.request import Request
from vllm.v1.structured_output import StructuredOutputManager

from hybridkv.cli.harness.kv_manager import Geometry
from hybridkv.connector.pd_connector import HybridPDConnector
from hybridkv.connector.pd_metadata import PDHandshakeMetadata, PDWorkerMetadata
from hybridkv.store import vllm_compat
from tests.unit.tiny_vllm_config import TINY_LLAMA


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny Llama checkpoint (config.json only) the schedulers' ``ModelConfig`` reads.

    Import it into a test module (``# noqa: F401``) to use it there."""
    init_none_hash(sha256)
    d = tmp_path_factory.mktemp("tiny-llama")
    (d / "config.json").write_text(json.dumps(TINY_LLAMA))
    return d


def pd_scheduler(
    model_dir: Path,
    role: str,
    geo: Geometry,
    secret_file: str,
    *,
    max_num_seqs: int,
    store_master: str | None = None,
    store_namespace: str = "pd",
) -> Scheduler:
    """What ``EngineCore`` builds in the scheduler process for a P/D instance of ``role``
    (``kv_producer`` / ``kv_consumer``) over ``geo``, block size ``geo.hash_block_size``,
    ``kv_load_failure_policy=recompute``. With ``store_master`` (a mooncake_master address)
    the instance runs vLLM's ``MultiConnector(HybridPDConnector, HybridStoreConnector)``, in
    that order, as the P/D + store deployment (docs/config.md) does."""
    block = geo.hash_block_size
    pd_extra = {"auth_secret_file": secret_file}
    if store_master is None:
        transfer = KVTransferConfig(
            kv_connector="HybridPDConnector",
            kv_role=role,
            kv_connector_module_path="hybridkv.connector",
            kv_load_failure_policy="recompute",
            kv_connector_extra_config=pd_extra,
        )
    else:
        transfer = KVTransferConfig(
            kv_connector="MultiConnector",
            kv_role=role,
            kv_load_failure_policy="recompute",
            kv_connector_extra_config={
                "connectors": [
                    {
                        "kv_connector": "HybridPDConnector",
                        "kv_role": role,
                        "kv_connector_module_path": "hybridkv.connector",
                        "kv_connector_extra_config": pd_extra,
                    },
                    {
                        "kv_connector": "HybridStoreConnector",
                        "kv_role": role,
                        "kv_connector_module_path": "hybridkv.connector",
                        "kv_load_failure_policy": "recompute",
                        "kv_connector_extra_config": {
                            "master_address": store_master,
                            "namespace": store_namespace,
                        },
                    },
                ]
            },
        )
    sched = real_scheduler(
        model_dir,
        geo,
        transfer,
        CacheConfig(block_size=block, enable_prefix_caching=True),
        max_num_seqs=max_num_seqs,
    )
    if store_master is None:
        assert isinstance(sched.connector, HybridPDConnector)
    return sched


def real_scheduler(
    model_dir: Path,
    geo: Geometry,
    transfer: KVTransferConfig,
    cache_config: CacheConfig,
    *,
    max_num_seqs: int = 8,
    max_num_batched_tokens: int = 2048,
    eagle_draft: tuple[Path, int] | None = None,
) -> Scheduler:
    """What ``EngineCore`` builds in the scheduler process over ``geo`` (no workers): block
    sizes and cache-hit alignment resolved by vLLM's own functions, the connector built by
    vLLM from ``transfer``. ``eagle_draft`` (draft model dir, speculative tokens): what
    ``--speculative-config '{"method": "eagle", ...}'`` adds."""
    model_config = ModelConfig(
        model=str(model_dir),
        skip_tokenizer_init=True,
        dtype="bfloat16",
        enforce_eager=True,
        max_model_len=geo.max_model_len,
    )
    parallel = ParallelConfig()
    speculative = None
    if eagle_draft is not None:
        speculative = SpeculativeConfig(
            method="eagle",
            model=str(eagle_draft[0]),
            num_speculative_tokens=eagle_draft[1],
            target_model_config=model_config,
            target_parallel_config=parallel,
        )
    vllm_config = VllmConfig(
        model_config=model_config,
        parallel_config=parallel,
        speculative_config=speculative,
        cache_config=cache_config,
        scheduler_config=SchedulerConfig(
            max_num_batched_tokens=max_num_batched_tokens,
            max_num_seqs=max_num_seqs,
            max_model_len=geo.max_model_len,
            is_encoder_decoder=False,
        ),
        kv_transfer_config=transfer,
    )
    kv_cache_config = geo.kv_cache_config()
    vllm_config.cache_config.num_gpu_blocks = kv_cache_config.num_blocks
    block_size, hash_block_size = resolve_kv_cache_block_sizes(kv_cache_config, vllm_config)
    kv_cache_config.hash_block_size = hash_block_size
    kv_cache_config.cache_hit_alignment_tokens = resolve_cache_hit_alignment_tokens(
        kv_cache_config, vllm_config, block_size, hash_block_size
    )
    return Scheduler(
        vllm_config=vllm_config,
        kv_cache_config=kv_cache_config,
        structured_output_manager=StructuredOutputManager(vllm_config),
        block_size=block_size,
        hash_block_size=hash_block_size,
    )


def pd_request(req_id: str, prompt: list[int], params: dict, block_size: int) -> Request:
    """A one-token request carrying ``params`` as its ``kv_transfer_params``."""
    req = Request(
        req_id,
        list(prompt),
        SamplingParams(max_tokens=1),
        None,
        block_hasher=get_request_block_hasher(block_size, sha256),
    )
    req.kv_transfer_params = dict(params)
    return req


def worker_reply(
    out: SchedulerOutput, sampled: dict[str, list[int]] | None = None, **connector: object
) -> ModelRunnerOutput:
    """What the workers report for this step (no forward: ``sampled`` tokens and the
    connector's results, ``KVConnectorOutput(**connector)``, only)."""
    ids = list(out.num_scheduled_tokens)
    return vllm_compat.model_runner_output(
        ids,
        sampled_token_ids=[list((sampled or {}).get(r, [])) for r in ids],
        kv_connector_output=KVConnectorOutput(**connector),
    )


def prefill_leg(sched: Scheduler, req: Request) -> dict:
    """One prefill leg through a real prefill ``sched`` (handshake known, one step, one
    token sampled): the signed ``kv_transfer_params`` its finished request hands decode."""
    sched.connector.set_xfer_handshake_metadata({0: PDHandshakeMetadata("127.0.0.1", 45678, 0)})
    sched.add_request(req)
    out = sched.schedule()
    outputs = sched.update_from_output(
        out,
        worker_reply(
            out,
            {r: [7] for r in out.num_scheduled_tokens},
            kv_connector_worker_meta=PDWorkerMetadata({}),
        ),
    )
    done = [o for eo in outputs.values() for o in eo.outputs if o.request_id == req.request_id]
    assert len(done) == 1 and done[0].kv_transfer_params, done
    return done[0].kv_transfer_params
