"""A sliding-window group's hand-over through a REAL vLLM ``Scheduler`` on the prefill side.

The silent corruption this pins (bench/pd_concurrent_check.py, tiny gemma3, seed 1001,
turn 2: prompt 895 tokens, window 128, block 128): decode resumes at the hand-over
boundary T = (N-1)//128*128 = 768 and needs the window before token 768 (tokens
641..767: block 5). vLLM's ``Scheduler._connector_finished`` frees the blocks outside the
window of the prefill's LAST computed token before ``request_finished``
(remove_skipped_blocks(num_computed_tokens)): with 895 computed, blocks 0..5 became null,
so the positional list said "no block 5"; decode's pairing skipped it and block 5 kept
whatever it held (disjoint top-5 at the first output token; later turns inherited the bad
KV from decode's prefix cache). It happens iff N % 128 is 0 or 127.

Fix checked here: (1) the prefill cuts the prompt to T + 1 when a group has a sliding
window (T with recurrent state), so vLLM's trim at finish keeps the window decode needs;
(2) decode refuses (recomputes) a hand-over whose positional lists miss a block it needs.
"""

from __future__ import annotations

import dataclasses
import random
import tempfile
from pathlib import Path

import pytest
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.request import Request

from hybridkv.cli.harness.kv_manager import Geometry, fa, sw
from hybridkv.connector.pd_auth import write_secret_file
from hybridkv.connector.pd_params import RemotePrefill
from hybridkv.connector.pd_scheduler import PDScheduler
from tests.unit.pd_real_scheduler import model_dir, pd_request, pd_scheduler, prefill_leg  # noqa: F401 (fixture)

BS = WINDOW = 128  # tiny gemma3's block size and sliding window
GEO = Geometry([sw(BS, WINDOW), fa(BS)], hash_block_size=BS, num_blocks=200, max_model_len=4096)
SECRET = str(write_secret_file(Path(tempfile.mkdtemp(prefix="hkv-pd-sw-")) / "secret"))


def _scheduler(model_dir, role: str) -> Scheduler:
    return pd_scheduler(model_dir, role, GEO, SECRET, max_num_seqs=8)


def _request(req_id: str, prompt: list[int], params: dict) -> Request:
    return pd_request(req_id, prompt, params, BS)


def _prefill(model_dir, prompt: list[int]) -> dict:
    """The prefill leg through real schedule()/update_from_output: its kv_transfer_params."""
    return prefill_leg(
        _scheduler(model_dir, "kv_producer"),
        _request("cmpl-prefill", prompt, {"do_remote_decode": True}),
    )


def _prompt(n: int) -> list[int]:
    return random.Random(n).choices(range(3, 30000), k=n)


@pytest.mark.parametrize("n", [895, 896, 768 + 1, 601])
def test_prefill_hands_over_the_window_before_the_boundary(model_dir, n):
    """The SW group's list holds the block with the window before T (and T's own FA blocks)."""
    boundary = (n - 1) // BS * BS
    params = _prefill(model_dir, _prompt(n))
    sw_ids, fa_ids = params["remote_block_ids"]
    # The prompt is cut to T + 1 (T where it is shorter): signed tokens = what it hashed.
    assert params["remote_num_tokens"] == min(boundary + 1, n // BS * BS)
    needed = (boundary - WINDOW + 1) // BS
    # Blocks from the one holding the window before T through the one holding token T.
    assert [i for i, b in enumerate(sw_ids) if b] == list(range(needed, boundary // BS + 1)), sw_ids
    assert all(fa_ids) and len(fa_ids) == boundary // BS + 1


def _decode_offer(model_dir, prompt: list[int], params: dict) -> tuple[int, list]:
    """One decode schedule() step: (tokens the connector offered, its READ jobs)."""
    sched = _scheduler(model_dir, "kv_consumer")
    req = _request(
        "cmpl-decode", prompt, params | {"do_remote_prefill": True, "do_remote_decode": False}
    )
    sched.add_request(req)
    out = sched.schedule()
    return (
        req.num_computed_tokens if req.request_id not in out.num_scheduled_tokens else 0,
        out.kv_connector_metadata.reads,
    )


def test_decode_reads_the_window_block_it_resumes_from(model_dir):
    prompt = _prompt(895)
    params = _prefill(model_dir, prompt)
    offered, reads = _decode_offer(model_dir, prompt, params)
    assert offered == 768 and len(reads) == 1
    # SW: block 5 only (tokens 640..767 hold the window before 768); FA: blocks 0..5.
    assert reads[0].remote_block_ids == [
        [params["remote_block_ids"][0][5]],
        list(params["remote_block_ids"][1][:6]),
    ]
    assert [len(g) for g in reads[0].local_block_ids] == [1, 6]


def test_decode_recomputes_when_the_window_block_is_missing(model_dir):
    """A prefill that trimmed to its last token's window (the old behaviour, or another
    build) lists block 5 as null: decode must not read around the gap."""
    prompt = _prompt(895)
    sched = PDScheduler(
        "e", False, 60.0, (), BS, group_block_sizes=(BS, BS), group_windows=(WINDOW, 0)
    )
    assert sched.missing_blocks(((0,) * 6 + (19,), tuple(range(1, 8))), 640, 768) == [(0, 5)]
    assert sched.missing_blocks(((0,) * 5 + (18, 19), tuple(range(1, 8))), 640, 768) == []
    params = _prefill(model_dir, prompt)
    sw_ids = list(params["remote_block_ids"][0])
    sw_ids[5] = 0
    # Re-sign is not possible from here (the MAC covers the ids), so check the decode hook
    # on the parsed value: a forged gap must be refused, not read around.
    conn = _scheduler(model_dir, "kv_consumer").connector._scheduler
    req = _request(
        "cmpl-gap", prompt, params | {"do_remote_prefill": True, "do_remote_decode": False}
    )
    parsed = conn.params(req)
    assert isinstance(parsed, RemotePrefill) and parsed.block_ids[0][5]
    conn._params[req.request_id] = dataclasses.replace(
        parsed, block_ids=(tuple(sw_ids), parsed.block_ids[1])
    )
    assert conn.get_num_new_matched_tokens(req, 0) == (0, False)
