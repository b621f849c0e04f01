"""HybridStoreConnector end to end: real vLLM CPU engine, real mooncake_master.

Each case runs an agentic session of 3 turns (each prompt = previous prompt +
answer + a new chunk) with the engine's local prefix cache emptied before every
turn, so every hit must come back from the store. Per turn: cached tokens must
reach the previous prompt's last reachable checkpoint, and greedy tokens and
logprobs must equal a recompute under a fresh ``cache_salt``. A 4th turn plants
a fault (one stored dense block overwritten with noise) and the same check must
FAIL, which shows it can see one wrong block.
"""

from __future__ import annotations

import os
import random
from pathlib import Path

import pytest
from vllm.v1.kv_cache_interface import get_mamba_prefill_checkpoint_position

from hybridkv.store.mooncake_backend import MooncakeBackend
from hybridkv.store.object_trailer import seal
from tests.e2e.engine_harness import (
    TurnRow,
    format_table,
    generate,
    make_llm,
    matches,
    reset_local_cache,
    run_turns,
    store_transfer_config,
    tiny_model,
)

TABLES = Path(os.environ.get("HYBRIDKV_E2E_TABLES", "/tmp/hybridkv-e2e-tables.txt"))

# (model kind, prefix_match_unit, hit alignment in tokens, extra engine args, extra connector config)
# qwen3next-partial also runs the staged data path (the one a GPU KV cache takes).
CASES = {
    "gemma3-block": ("gemma3", None, 128, {}, {}),
    # No Mamba group: vLLM 0.32 enables sub-block hits only for Mamba align groups, so a
    # finer prefix-match unit keeps gemma3's hits on its 128-token blocks.
    "gemma3-partial": ("gemma3", 64, 128, {}, {}),
    "qwen3next-block": ("qwen3next", None, 256, {"block_size": 256}, {}),
    "qwen3next-partial-staged": ("qwen3next", 64, 64, {"block_size": 256}, {"staging": "always"}),
    "gemma4-two-dense-block": ("gemma4", None, 256, {}, {}),
}


def checkpoint(prev_len: int, align: int) -> int:
    """The previous prompt's last reachable checkpoint (vLLM's own definition)."""
    return get_mamba_prefill_checkpoint_position(prev_len, align, False)


def _record(title: str, rows: list[TurnRow]) -> None:
    table = format_table(title, rows)
    print("\n" + table)
    with TABLES.open("a") as f:
        f.write(table + "\n")


def _plant_fault(key_log: Path, master_address: str) -> str:
    """Overwrite the 2nd stored object of the group with the most objects (a dense group).

    The noise is sealed with a valid trailer (``seal``), so the connector's own
    checksum cannot catch it: only the output comparison can.
    """
    entries = [line.split() for line in key_log.read_text().splitlines()]
    by_group: dict[str, list[tuple[str, int]]] = {}
    for key, gid, nbytes in entries:
        by_group.setdefault(gid, []).append((key, int(nbytes)))
    dense = max(by_group.values(), key=len)
    key, nbytes = dense[1]
    with MooncakeBackend(master_address, global_segment_size=0) as client:
        noise = seal(key, random.Random(7).randbytes(nbytes))
        assert client.replace_bytes(key, noise) == 0
        assert client.get_bytes(key) == noise
    return key


@pytest.mark.parametrize("case", list(CASES))
def test_three_turns_hit_the_store_and_match_recompute(case, master, tmp_path):
    kind, unit, align, engine_kw, extra = CASES[case]
    key_log = tmp_path / "keys.log"
    llm = make_llm(
        tiny_model(kind),
        store_transfer_config({"master_address": master.address, "key_log_path": str(key_log),
                               "namespace": case, **extra}),
        prefix_match_unit=unit,
        **engine_kw,
    )
    try:
        rows, session = run_turns(llm, 3, lambda prev, cur: checkpoint(prev, align))
        _record(f"{case} (local cache reset before every turn)", rows)
        for r in rows:
            assert r.cached >= r.expected, f"turn {r.turn}: cached {r.cached} < checkpoint {r.expected}"
            assert r.cached <= r.prompt - 1
            assert r.matches_recompute, f"turn {r.turn} differs from recompute"
            assert r.recompute_cached == 0, "the recompute under a fresh cache_salt must not hit"
        assert rows[1].cached > 0 and rows[2].cached > rows[1].cached

        # Negative control: one corrupted dense block must make the check fail.
        prompt = session.prompt
        _plant_fault(key_log, master.address)
        reset_local_cache(llm)
        got = generate(llm, prompt)
        ref = generate(llm, prompt, cache_salt="planted-fault-recompute")
        assert got.num_cached_tokens > 0
        assert not matches(got, ref), "a corrupted block went unnoticed: the check has no power"
    finally:
        del llm



def test_local_sub_block_hits_of_a_hybrid_model_match_recompute(master):
    """The local cache is KEPT between turns, so qwen3-next with --prefix-match-unit 64
    resumes from its own sub-block hits (e.g. 960 = 3 x 256 + 192). vLLM 0.32 gives the
    request a copy of the hit's last block but copies only the first of the layer views
    that share that page (connector/block_copies.py); the connector's worker redoes the
    copy. Without it 5 of the 6 sub-block-hit turns here differed from recompute."""
    llm = make_llm(
        tiny_model("qwen3next"),
        store_transfer_config({"master_address": master.address, "namespace": "local-sub-block"}),
        prefix_match_unit=64,
        block_size=256,
    )
    try:
        rows = []
        for seed in (31, 32):
            got, _ = run_turns(llm, 4, lambda prev, cur: checkpoint(prev, 64), reset=False, seed=seed)
            rows += got
        _record("qwen3next partial 64, local cache kept (local sub-block hits)", rows)
        assert any(r.cached % 256 for r in rows), "no turn resumed from a sub-block hit"
        differ = [r.turn for r in rows if not r.matches_recompute]
        assert not differ, f"turns {differ} (of 2 sessions x 4) differ from recompute"
    finally:
        del llm
