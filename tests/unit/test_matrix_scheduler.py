"""The Mamba-hybrid + drafter cells of the deployment matrix, through vLLM's REAL Scheduler.

vLLM 0.32's CPU engine cannot run a drafter on a Mamba hybrid (the align-mode pre-copy is a
Triton kernel: tests/e2e/test_matrix.py's strict xfail), so these cells are covered here,
on both sides of each deployment, with the qwen3-next + EAGLE geometry scaled down to hash
unit 16: a target full-attention group, a GDN state group with ``num_speculative_blocks=2``
(vLLM appends two scratch blocks after a request's state column) and the drafter's
full-attention group at another block size.

Target FA 32, GDN 32, drafter FA 16 (its layer has twice the target's per-token bytes, as
the e2e drafters do), hash unit 16; block + drafter: hits at whole GDN blocks; partial +
drafter: ``--prefix-match-unit 16``, vLLM's fine-grained hits inside a GDN block.

Per deployment: store (the store connector's load and save jobs touch only the state
column ``cdiv(N, block) - 1``, never a scratch block); P/D (decode READs the prefill's state
column into its own); P/D to a data-parallel decode (two decode ranks, each its own
Scheduler and block pool: a hand-over given to one rank is read by that rank only, into its
own blocks). The EAGLE last-block drop needs a draft model config in the Scheduler; the
hits with the drop are checked on the real KVCacheManager (tests/unit/test_k3_shape.py) and
end to end (tests/e2e/test_store_eagle.py, test_matrix.py).
"""

from __future__ import annotations

import random
import tempfile
from pathlib import Path

import pytest
import torch
from vllm.config import CacheConfig, KVTransferConfig
from vllm.utils.math_utils import cdiv
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import FullAttentionSpec, MambaSpec

from hybridkv.cli.harness.kv_manager import Geometry, fa
from hybridkv.connector.pd_auth import write_secret_file
from hybridkv.connector.pd_connector import HybridPDConnector
from hybridkv.connector.store_connector import HybridStoreConnector
from tests.unit.pd_real_scheduler import model_dir, pd_request, prefill_leg, real_scheduler  # noqa: F401 (fixture)
from tests.unit.test_real_scheduler import (  # noqa: F401 (store: a fixture)
    UNIT,
    _admit,
    _expected_job,
    _fill_store,
    _finish_load_and_resume,
    _request,
    _worker_reply,
    store,
)

NUM_SPEC = 2
SECRET = str(write_secret_file(Path(tempfile.mkdtemp(prefix="hkv-matrix-")) / "secret"))


def gdn(block_size: int) -> MambaSpec:
    """A GDN state group with two speculative scratch blocks per request."""
    from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum

    return MambaSpec(
        block_size=block_size,
        shapes=((3, 48), (2, 8, 8)),
        dtypes=(torch.bfloat16, torch.float32),
        mamba_type=MambaAttentionBackendEnum.GDN_ATTN,
        mamba_cache_mode="align",
        num_speculative_blocks=NUM_SPEC,
    )


def drafter(block_size: int) -> FullAttentionSpec:
    return FullAttentionSpec(
        block_size=block_size, num_kv_heads=2, head_size=16, dtype=torch.float16
    )


MODES = {  # the drafter's layer has twice the target's per-token bytes: half its block
    mode: Geometry(
        specs=[fa(32), gdn(32), drafter(16)],
        hash_block_size=UNIT,
        num_blocks=600,
        max_model_len=4096,
        label=f"fa32+gdn32+drafter16 {mode}",
    )
    for mode in ("block+drafter", "partial+drafter")
}
MAMBA = 1
# partial: hash keys every 16 tokens under the 32-token GDN block (--prefix-match-unit 16).
PREFIX_MATCH_UNIT = {"block+drafter": None, "partial+drafter": UNIT}


def _sched(model_dir, geo: Geometry, mode: str, transfer: KVTransferConfig) -> Scheduler:  # noqa: F811
    """What ``EngineCore`` builds in the scheduler process over ``geo`` in ``mode``."""
    sched = real_scheduler(
        model_dir,
        geo,
        transfer,
        CacheConfig(
            block_size=UNIT,
            enable_prefix_caching=True,
            mamba_cache_mode="align",
            prefix_match_unit=PREFIX_MATCH_UNIT[mode],
        ),
    )
    assert sched.kv_cache_config.hash_block_size == UNIT, (mode, sched.block_size)
    return sched


def _scheduler(
    geo: Geometry, master_address: str, model_dir, namespace: str, mode: str
) -> Scheduler:  # noqa: F811
    sched = _sched(
        model_dir,
        geo,
        mode,
        KVTransferConfig(
            kv_connector="HybridStoreConnector",
            kv_role="kv_both",
            kv_connector_module_path="hybridkv.connector.store_connector",
            kv_load_failure_policy="fail",
            kv_connector_extra_config={
                "master_address": master_address,
                "namespace": namespace,
                "lookup_cache_s": 0,
            },
        ),
    )
    assert isinstance(sched.connector, HybridStoreConnector)
    return sched


PROMPT = random.Random(17).choices(range(3, 30000), k=1000)


def _state_column(tokens: int, block_size: int) -> int:
    return cdiv(tokens, block_size) - 1


@pytest.mark.parametrize("mode", list(MODES))
def test_store_loads_into_the_state_column(store, mode):
    """The store holds every group's object up to 512 tokens: the load fills the target's
    and drafter's blocks up to 512 and the GDN group's state column only (the scratch
    blocks after it are never written by a load)."""
    geo = MODES[mode]
    sched = _scheduler(geo, store[0], store[3], f"matrix-{mode}", mode)
    _fill_store(sched, store, 512)
    req = _request(f"matrix-{mode}-cold")
    out, job, got = _admit(sched, req)
    assert req.num_computed_tokens == 512
    table = sched.kv_cache_manager.get_block_ids(req.request_id)
    mamba_bs = geo.specs[MAMBA].block_size
    col = _state_column(512, mamba_bs)
    assert len(table[MAMBA]) >= col + 1 + NUM_SPEC, "scratch blocks follow the state column"
    positions = [
        list(range(512 // geo.specs[0].block_size)),
        [col],
        list(range(512 // geo.specs[2].block_size)),
    ]
    assert got == _expected_job(sched, req, positions)
    _finish_load_and_resume(sched, req, out, job, 512)


@pytest.mark.parametrize("mode", list(MODES))
def test_store_saves_each_state_from_its_column(store, mode):
    """A cold prefill run to the end through the real Scheduler (workers ack every save):
    every GDN save names the block at the state column of the key's end token in the
    request's table as it was in that step, never a scratch block."""
    geo = MODES[mode]
    sched = _scheduler(geo, store[0], store[3], f"matrix-save-{mode}", mode)
    req = _request(f"matrix-save-{mode}", PROMPT[:600] + [11, 12])
    sched.add_request(req)
    mamba_bs = geo.specs[MAMBA].block_size
    checked = finished_steps = 0
    for _ in range(50):
        out = sched.schedule()
        table = sched.kv_cache_manager.get_block_ids(req.request_id)
        hash_at = {bytes(h): (i + 1) * UNIT for i, h in enumerate(req.block_hashes)}
        for job in out.kv_connector_metadata.saves:
            for g, h, b in zip(job.blocks.group_ids, job.blocks.hashes, job.blocks.block_ids):
                if g == MAMBA:
                    end = hash_at[bytes(h)]
                    col = _state_column(end, mamba_bs)
                    assert b == table[MAMBA][col], (end, col, b, table[MAMBA])
                    checked += 1
        done = req.num_computed_tokens >= req.num_tokens
        n = out.num_scheduled_tokens.get(req.request_id, 0)
        sched.update_from_output(
            out,
            _worker_reply(
                out,
                saves=out.kv_connector_metadata.saves,
                sampled={req.request_id: [5]} if done and n else None,
            ),
        )
        finished_steps += req.is_finished()
        if finished_steps > 2:  # saves planned at the finish go out in the next steps
            break
    assert checked >= 1, "no GDN state was saved"


def _pd(model_dir, geo: Geometry, role: str, mode: str):  # noqa: ANN001, ANN202, F811
    sched = _sched(
        model_dir,
        geo,
        mode,
        KVTransferConfig(
            kv_connector="HybridPDConnector",
            kv_role=role,
            kv_connector_module_path="hybridkv.connector",
            kv_load_failure_policy="recompute",
            kv_connector_extra_config={"auth_secret_file": SECRET},
        ),
    )
    assert isinstance(sched.connector, HybridPDConnector)
    return sched


def _decode_reads(sched, req_id: str, prompt: list[int], params: dict):  # noqa: ANN001, ANN202
    req = pd_request(
        req_id, prompt, params | {"do_remote_prefill": True, "do_remote_decode": False}, UNIT
    )
    sched.add_request(req)
    out = sched.schedule()
    return req, out.kv_connector_metadata.reads


@pytest.mark.parametrize("mode", list(MODES))
def test_pd_reads_the_state_column_on_both_sides(model_dir, mode):  # noqa: F811
    geo = MODES[mode]
    prompt = PROMPT[:777]
    params = prefill_leg(
        _pd(model_dir, geo, "kv_producer", mode),
        pd_request(f"p-{mode}", prompt, {"do_remote_decode": True}, UNIT),
    )
    handover = int(params["remote_num_tokens"])
    remote = params["remote_block_ids"]
    mamba_bs = geo.specs[MAMBA].block_size
    col = _state_column(handover, mamba_bs)
    decode = _pd(model_dir, geo, "kv_consumer", mode)
    req, reads = _decode_reads(decode, f"d-{mode}", prompt, params)
    local = decode.kv_cache_manager.get_block_ids(req.request_id)
    print(f"{mode}: hand-over {handover}, prefill GDN {remote[MAMBA]}, decode GDN {local[MAMBA]}")
    assert len(reads) == 1 and req.num_computed_tokens == handover
    assert len(local[MAMBA]) > col + NUM_SPEC - 1
    assert reads[0].remote_block_ids[MAMBA] == [remote[MAMBA][col]]
    assert reads[0].local_block_ids[MAMBA] == [local[MAMBA][col]]
    for g in (0, 2):
        n = cdiv(handover, geo.specs[g].block_size)
        assert reads[0].remote_block_ids[g] == list(remote[g][:n])
        assert reads[0].local_block_ids[g] == list(local[g][:n])


@pytest.mark.parametrize("mode", list(MODES))
def test_pd_to_a_data_parallel_decode_reads_on_the_chosen_rank_only(model_dir, mode):  # noqa: F811
    """Decode DP2: two ranks, each its own Scheduler, engine id and block pool (vLLM's DP
    engine cores share nothing). Two hand-overs from one prefill, one routed to each rank:
    each rank READs only its own request, from the prefill engine the params name, into
    blocks of its own table; the other rank's reads name neither its request nor its blocks."""
    geo = MODES[mode]
    prefill = _pd(model_dir, geo, "kv_producer", mode)
    prompts = [PROMPT[:700], PROMPT[100:900]]
    params = [
        prefill_leg(prefill, pd_request(f"p{r}-{mode}", p, {"do_remote_decode": True}, UNIT))
        for r, p in enumerate(prompts)
    ]
    assert params[0]["remote_engine_id"] == params[1]["remote_engine_id"]
    assert params[0]["remote_lease_id"] != params[1]["remote_lease_id"]
    ranks = [_pd(model_dir, geo, "kv_consumer", mode) for _ in range(2)]
    assert (
        ranks[0].vllm_config.kv_transfer_config.engine_id
        != ranks[1].vllm_config.kv_transfer_config.engine_id
    )
    got = [_decode_reads(ranks[r], f"d{r}-{mode}", prompts[r], params[r]) for r in range(2)]
    for r, (req, reads) in enumerate(got):
        assert [j.req_id for j in reads] == [req.request_id]
        assert reads[0].remote_engine_id == params[r]["remote_engine_id"]
        assert reads[0].lease_id == params[r]["remote_lease_id"]
        assert reads[0].remote_block_ids == [list(x) for x in reads[0].remote_block_ids]
        mine = {
            b for group in ranks[r].kv_cache_manager.get_block_ids(req.request_id) for b in group
        }
        assert {b for group in reads[0].local_block_ids for b in group} <= mine
        other_req = got[1 - r][0]
        assert (
            ranks[r].kv_cache_manager.get_block_ids(other_req.request_id) == ([], [], [])
            or other_req.request_id not in ranks[r].requests
        )
