"""P/D on a Mamba hybrid with speculative decoding: the READ pairs the state columns.

With ``num_speculative_tokens > 0`` vLLM appends ``num_speculative_blocks`` scratch blocks
after a request's Mamba state block (align mode); the kernels read the state at column
``cdiv(num_computed_tokens, block_size) - 1``. The hand-over must READ the prefill side's
state column into decode's state column: a scratch block on either side is garbage, and
decode's state block, skipped by zeroing because the group is loaded, would keep stale bytes.
Both schedulers here are vLLM's real ones (prefill and decode), with the real managers.
"""

from __future__ import annotations

import dataclasses
import random
import tempfile
from pathlib import Path

import pytest
import torch
from vllm.utils.math_utils import cdiv
from vllm.v1.kv_cache_interface import MambaSpec

from hybridkv.cli.harness.kv_manager import Geometry, fa
from hybridkv.connector.pd_auth import write_secret_file
from tests.unit.pd_real_scheduler import model_dir, pd_request, pd_scheduler, prefill_leg  # noqa: F401 (fixture)

BS = 64
SECRET = str(write_secret_file(Path(tempfile.mkdtemp(prefix="hkv-pd-spec-")) / "secret"))


def _geometry(num_speculative_blocks: int) -> Geometry:
    state = MambaSpec(
        block_size=BS,
        shapes=((4,),),
        dtypes=(torch.float32,),
        mamba_cache_mode="align",
        num_speculative_blocks=num_speculative_blocks,
    )
    return Geometry([fa(BS), state], hash_block_size=BS, num_blocks=200, max_model_len=4096)


def _prompt(n: int) -> list[int]:
    return random.Random(n).choices(range(3, 30000), k=n)


def _decode_read(
    model_dir, geo: Geometry, prompt: list[int], params: dict, remote_state: list[int] | None = None
):
    """One decode schedule() step through the real scheduler: (its READ job, decode's Mamba table).
    ``remote_state`` replaces the parsed Mamba list (the MAC covers the ids, so a list from
    another prefill build is planted on the parsed value, as the validator would pass it)."""
    decode = pd_scheduler(model_dir, "kv_consumer", geo, SECRET, max_num_seqs=8)
    req = pd_request(
        "cmpl-decode", prompt, params | {"do_remote_prefill": True, "do_remote_decode": False}, BS
    )
    if remote_state is not None:
        conn = decode.connector._scheduler
        parsed = conn.params(req)
        conn._params[req.request_id] = dataclasses.replace(
            parsed, block_ids=(parsed.block_ids[0], tuple(remote_state))
        )
    decode.add_request(req)
    out = decode.schedule()
    (job,) = out.kv_connector_metadata.reads
    local_state = [b.block_id for b in decode.kv_cache_manager.get_blocks(req.request_id).blocks[1]]
    return job, local_state


@pytest.mark.parametrize("spec_blocks", [0, 1, 2])
@pytest.mark.parametrize("n", [1000, 961, 1024])
def test_read_pairs_the_state_column_on_both_sides(model_dir, spec_blocks, n):
    geo = _geometry(spec_blocks)
    prompt = _prompt(n)
    prefill = pd_scheduler(model_dir, "kv_producer", geo, SECRET, max_num_seqs=8)
    params = prefill_leg(
        prefill, pd_request("cmpl-prefill", prompt, {"do_remote_decode": True}, BS)
    )
    handover = (n - 1) // BS * BS
    assert params["remote_num_tokens"] == handover
    column = cdiv(handover, BS) - 1
    remote_state = params["remote_block_ids"][1]
    # The prefill side hands its table over up to the state column: no scratch block.
    assert [i for i, b in enumerate(remote_state) if b] == [column] and len(
        remote_state
    ) == column + 1

    job, local_state = _decode_read(model_dir, geo, prompt, params)
    # Decode's table: nulls, the state column, then its own scratch blocks.
    assert len(local_state) == column + 1 + spec_blocks
    assert job.refused is None
    assert job.remote_block_ids[1] == [remote_state[column]]
    assert job.local_block_ids[1] == [local_state[column]]
    # The attention group reads every block up to the hand-over, by position.
    assert job.remote_block_ids[0] == list(params["remote_block_ids"][0][: handover // BS])


def test_decode_never_reads_a_listed_scratch_block(model_dir):
    """A prefill that lists its scratch block after the state column (within the validator's
    bound): decode still reads the state column, not the list's last block."""
    geo = _geometry(1)
    prompt = _prompt(1000)
    prefill = pd_scheduler(model_dir, "kv_producer", geo, SECRET, max_num_seqs=8)
    params = prefill_leg(
        prefill, pd_request("cmpl-prefill", prompt, {"do_remote_decode": True}, BS)
    )
    column = cdiv(960, BS) - 1
    state = params["remote_block_ids"][1][column]
    scratch = max(params["remote_block_ids"][0]) + 50  # another block of the prefill's pool
    job, local_state = _decode_read(model_dir, geo, prompt, params, [0] * column + [state, scratch])
    assert job.refused is None
    assert job.remote_block_ids[1] == [state] and job.local_block_ids[1] == [local_state[column]]


def test_decode_refuses_a_state_of_another_position(model_dir):
    """The state column holds nothing on the prefill side (its state is of another token count):
    the READ is refused and decode recomputes, instead of reading some other block."""
    geo = _geometry(1)
    prompt = _prompt(1000)
    prefill = pd_scheduler(model_dir, "kv_producer", geo, SECRET, max_num_seqs=8)
    params = prefill_leg(
        prefill, pd_request("cmpl-prefill", prompt, {"do_remote_decode": True}, BS)
    )
    column = cdiv(960, BS) - 1
    state = params["remote_block_ids"][1][column]
    job, _ = _decode_read(model_dir, geo, prompt, params, [0] * (column - 1) + [state, 0])
    assert job.refused == f"Mamba group 1: the prefill side lists no state block at column {column}"
