"""Lookahead block hashes (vLLM 0.34) through a REAL 0.34 ``Scheduler`` and MultiConnector.

0.34 hashes each block together with the tokens after it (``num_hash_lookahead_tokens``, one
for EAGLE) when the engine runs an EAGLE drafter and the connector class says it supports
them; MultiConnector says so only if every child does. The hash then proves the drafter's KV
at the block's last position, so vLLM drops no EAGLE block on a hit. A hybridkv child that
declines turns them off for an in-tree sibling (MooncakeStoreConnector supports them): every
EAGLE hit, local or from either store, is one scheduler block shorter.

The store keys objects by vLLM's block hashes, so with lookahead its keys are lookahead hashes
(never equal to legacy ones: the lookahead token is part of what is hashed) and its mirror's
lookup runs vLLM's coordinator as the scheduler built it (no EAGLE drop).
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np
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
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import (
    get_request_block_hasher,
    init_none_hash,
    resolve_cache_hit_alignment_tokens,
    resolve_kv_cache_block_sizes,
)
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.request import Request
from vllm.v1.structured_output import StructuredOutputManager

from hybridkv.cli.harness.kv_manager import Geometry, fa, sw
from hybridkv.connector.store_connector import HybridStoreConnector
from hybridkv.connector.store_metadata import StoreConnectorMetadata
from hybridkv.store import vllm_compat
from hybridkv.store.embedded_master import EmbeddedMaster
from hybridkv.store.geometry import GroupGeometry
from hybridkv.store.mooncake_backend import MooncakeBackend
from tests.unit.tiny_vllm_config import TINY_LLAMA

pytestmark = pytest.mark.skipif(
    not hasattr(KVConnectorBase_V1, "supports_lookahead_block_hashes"),
    reason="vLLM < 0.34 has no connector opt-in for lookahead block hashes",
)

UNIT = 16
# Target full attention and sliding window at 16, the EAGLE drafter's full attention at 32
# (another head size: vLLM gives it another block size), flagged is_eagle_group.
GEO = Geometry(
    specs=[fa(16), sw(16, 64), fa(32)],
    hash_block_size=UNIT,
    eagle_group=2,
    num_blocks=600,
    max_model_len=4096,
)
PROMPT = random.Random(11).choices(range(3, 30000), k=1000)


@pytest.fixture(scope="module")
def rig(tmp_path_factory):
    """A real master, a client holding a segment (the store's memory), tiny target and
    EAGLE draft model dirs (config.json only)."""
    init_none_hash(sha256)
    d = tmp_path_factory.mktemp("lookahead")
    (d / "target").mkdir()
    (d / "target" / "config.json").write_text(json.dumps(TINY_LLAMA))
    draft = dict(TINY_LLAMA, architectures=["EagleLlamaForCausalLM"], num_hidden_layers=1)
    (d / "draft").mkdir()
    (d / "draft" / "config.json").write_text(json.dumps(draft))
    with (
        EmbeddedMaster() as master,
        MooncakeBackend(master.address, global_segment_size=64 << 20) as holder,
    ):
        buf = np.zeros(64, dtype=np.uint8)
        holder.register(int(buf.ctypes.data), buf.nbytes)
        yield master.address, holder, buf, d


def _vllm_config(d: Path, transfer: KVTransferConfig) -> VllmConfig:
    """An EAGLE engine's config (target + 2 draft tokens) as ``EngineArgs`` resolves it."""
    model = ModelConfig(
        model=str(d / "target"),
        skip_tokenizer_init=True,
        dtype="bfloat16",
        enforce_eager=True,
        max_model_len=GEO.max_model_len,
    )
    spec = SpeculativeConfig(
        method="eagle",
        model=str(d / "draft"),
        num_speculative_tokens=2,
        target_model_config=model,
        target_parallel_config=ParallelConfig(),
    )
    return VllmConfig(
        model_config=model,
        cache_config=CacheConfig(block_size=16, enable_prefix_caching=True),
        scheduler_config=SchedulerConfig(
            max_num_batched_tokens=2048,
            max_num_seqs=8,
            max_model_len=GEO.max_model_len,
            is_encoder_decoder=False,
        ),
        speculative_config=spec,
        kv_transfer_config=transfer,
    )


def _multi(master: str, namespace: str) -> KVTransferConfig:
    """hybridkv's store beside vLLM's in-tree MooncakeStoreConnector (save side only here:
    its lookups go to its workers, which a scheduler-only test has not)."""
    return KVTransferConfig(
        kv_connector="MultiConnector",
        kv_role="kv_both",
        kv_connector_extra_config={
            "connectors": [
                {
                    "kv_connector": "HybridStoreConnector",
                    "kv_role": "kv_both",
                    "kv_connector_module_path": "hybridkv.connector",
                    "kv_connector_extra_config": {
                        "master_address": master,
                        "namespace": namespace,
                        "lookup_cache_s": 0,
                    },
                },
                {
                    "kv_connector": "MooncakeStoreConnector",
                    "kv_role": "kv_both",
                    "kv_connector_extra_config": {"enable_lookup": False},
                },
            ]
        },
    )


def _scheduler(vllm_config: VllmConfig) -> Scheduler:
    """What ``EngineCore`` builds in the scheduler process over ``GEO`` (no workers)."""
    kv_cache_config = GEO.kv_cache_config()
    vllm_config.cache_config.num_gpu_blocks = kv_cache_config.num_blocks
    block_size, hash_block_size = resolve_kv_cache_block_sizes(kv_cache_config, vllm_config)
    kv_cache_config.hash_block_size = hash_block_size
    kv_cache_config.cache_hit_alignment_tokens = resolve_cache_hit_alignment_tokens(
        kv_cache_config, vllm_config, block_size, hash_block_size
    )
    assert (block_size, hash_block_size) == (32, UNIT)
    return Scheduler(
        vllm_config=vllm_config,
        kv_cache_config=kv_cache_config,
        structured_output_manager=StructuredOutputManager(vllm_config),
        block_size=block_size,
        hash_block_size=hash_block_size,
    )


def _request(req_id: str, lookahead: int, prompt: list[int] = PROMPT) -> Request:
    """A request hashed as ``EngineCore`` hashes it (``num_hash_lookahead_tokens`` included)."""
    return Request(
        req_id,
        list(prompt),
        SamplingParams(max_tokens=1),
        None,
        block_hasher=get_request_block_hasher(UNIT, sha256, lookahead),
    )


def _store_connector(sched: Scheduler) -> HybridStoreConnector:
    children = [c for c in sched.connector.sub_connectors if isinstance(c, HybridStoreConnector)]
    assert len(children) == 1
    return children[0]


def test_a_hybridkv_store_child_keeps_lookahead_hashes_on_for_its_sibling(rig):
    """The in-tree sibling alone gets lookahead hashes; beside hybridkv's store it keeps them."""
    d = rig[3]
    alone = KVTransferConfig(
        kv_connector="MultiConnector",
        kv_role="kv_both",
        kv_connector_extra_config={
            "connectors": [_multi("x", "x").kv_connector_extra_config["connectors"][1]]
        },
    )
    assert _vllm_config(d, alone).num_hash_lookahead_tokens == 1
    assert _vllm_config(d, _multi(rig[0], "la-flag")).num_hash_lookahead_tokens == 1


def test_store_hit_with_lookahead_hashes_is_not_cut_by_the_eagle_drop(rig):
    """Empty local cache; the store holds every group's objects up to token 512, keyed by
    the lookahead hashes. vLLM's scheduler, with lookahead, takes no EAGLE drop: the hit is
    512, and the load job names exactly those objects (keys of the lookahead hashes)."""
    master, holder, buf, d = rig
    cfg = _vllm_config(d, _multi(master, "la-hit"))
    lookahead = cfg.num_hash_lookahead_tokens
    assert lookahead == 1
    sched = _scheduler(cfg)
    assert sched.kv_cache_manager.use_eagle is False  # lookahead hashes replace the drop
    store = _store_connector(sched)
    geometry = store._scheduler.geometry
    assert isinstance(geometry, GroupGeometry)
    assert geometry.params.num_hash_lookahead_tokens == 1
    assert not any(g.is_eagle for g in geometry.groups)

    probe = _request("probe", lookahead)
    legacy = _request("legacy", 0)
    assert len(probe.block_hashes) == (len(PROMPT) - 1) // UNIT
    # A lookahead engine's keys and a legacy engine's keys of one prompt share nothing.
    assert not set(map(bytes, probe.block_hashes)) & set(map(bytes, legacy.block_hashes))
    schema = store._scheduler._schema
    keys = [
        schema.key(g, bytes(probe.block_hashes[t // UNIT - 1]))
        for g in range(3)
        for t in range(GEO.specs[g].block_size, 513, GEO.specs[g].block_size)
    ]
    assert holder.put_from(keys, [int(buf.ctypes.data)] * len(keys), [64] * len(keys)) == [0] * len(
        keys
    )

    req = _request("cold", lookahead)
    sched.add_request(req)
    out = sched.schedule()
    assert req.num_computed_tokens == 512
    meta = out.kv_connector_metadata
    store_meta = [m for m in meta.metadata if isinstance(m, StoreConnectorMetadata)]
    assert len(store_meta) == 1
    jobs = [j for j in store_meta[0].loads if j.req_id == "cold"]
    assert len(jobs) == 1 and jobs[0].refused is None
    table = sched.kv_cache_manager.get_blocks("cold").get_block_ids()
    got = sorted(
        zip(
            jobs[0].blocks.group_ids,
            (bytes(h) for h in jobs[0].blocks.hashes),
            jobs[0].blocks.block_ids,
        )
    )
    # FA16: blocks 0..31; SW16/64: the window tail 28..31; drafter FA32: blocks 0..15.
    want = sorted(
        (g, bytes(req.block_hashes[(i + 1) * GEO.specs[g].block_size // UNIT - 1]), table[g][i])
        for g, idxs in ((0, range(32)), (1, range(28, 32)), (2, range(16)))
        for i in idxs
    )
    assert got == want


@pytest.mark.parametrize("lookahead, want", [(0, 256), (1, 255)])
def test_prompt_hashed_tokens_leave_out_a_hash_that_covers_a_sampled_token(lookahead, want):
    """A 256-token prompt (16 full blocks) after prefill sampled one token: with lookahead the
    16th hash exists now but covers the sampled token, which decode (prompt only) cannot hash;
    a hand-over then covers 255 tokens, whose 15 full blocks decode hashes identically."""
    init_none_hash(sha256)
    prompt = PROMPT[:256]
    req = _request(f"sampled-{lookahead}", lookahead, prompt)
    assert len(req.block_hashes) == (256 - lookahead) // UNIT
    req.append_output_token_ids(7)
    assert len(req.block_hashes) == 16
    bound = vllm_compat.prompt_hashed_tokens(req, UNIT, lookahead)
    assert bound == want
    decode = _request(f"decode-{lookahead}", lookahead, prompt)
    n = bound // UNIT
    assert len(decode.block_hashes) >= n
    assert [bytes(h) for h in decode.block_hashes[:n]] == [bytes(h) for h in req.block_hashes[:n]]
    if lookahead:  # the 16th hash (the sampled token in it) is not one decode computes
        assert bytes(req.block_hashes[15]) not in {bytes(h) for h in decode.block_hashes}
