"""HybridStoreConnector end to end with EAGLE speculative decoding (a drafter KV group).

Real vLLM CPU engine, real mooncake_master: the tiny gemma3-text target (sliding +
full attention, head_dim 64) plus a tiny EAGLE head (``EagleLlamaForCausalLM``, one
layer, head_dim 128; ``hybridkv.cli.harness.tiny_models`` kind ``eagle-gemma3``) loaded with
``speculative_config={"method": "eagle", ...}``. The drafter layer's per-token KV bytes
are twice the target's, so vLLM equalises page sizes by giving it half the block size:
a second full-attention block size next to the target's, in its own KV cache group.

Three agentic turns (each prompt = previous prompt + answer + a new chunk), local prefix
cache emptied before every turn, so every hit comes back from the store. Per turn:
cached >= the previous prompt's last reachable EAGLE checkpoint, cached <= prompt - 1,
and greedy tokens/logprobs equal a recompute under a fresh ``cache_salt``.

The expected hit is vLLM 0.32's own rule, not a guess:

* no group is flagged ``is_eagle_group`` for a plain EAGLE head (vLLM's trailing-layer
  rule is for MTP only), so ``KVCacheCoordinator.__init__`` falls back to flagging
  EVERY group, and every group's finder applies the EAGLE drop;
* hits are aligned to ``_cache_hit_alignment_tokens``, the scheduler block (no Mamba
  group, so no fine-grained hash hits); a full-attention finder drops
  ``min(alignment, block_size)`` and rounds down to the alignment, the drafter group
  (block half the scheduler block) matches one extra block and drops it, the sliding
  finder needs one extra contiguous block and pops it. Net effect: the hit an extension
  of a prompt of ``P`` tokens can reach is ``P // S * S - S`` (S = scheduler block),
  i.e. vLLM's ``get_mamba_prefill_checkpoint_position(P, S, drop_eagle_block=True)``
  and the larger of ``replay_boundaries(P, S, use_eagle=True)``. That is one whole
  scheduler block (two hash units here) below the non-EAGLE checkpoint, not one hash
  unit.

Controls (``llm_engine.plausible_fault_runs``): the wrong-but-plausible object
must belong to a TARGET full-attention group. With greedy verification the output never
depends on the drafter (a draft only changes how many tokens are accepted), so a wrong
drafter block is invisible to the output comparison.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

from vllm.v1.core.kv_cache_coordinator import replay_boundaries
from vllm.v1.kv_cache_interface import get_mamba_prefill_checkpoint_position

from hybridkv.cli.harness.llm_engine import (
    MODEL_CACHE,
    kv_cache_layout,
    make_llm,
    plausible_fault_runs,
    run_turns,
    store_transfer_config,
    tiny_model,
)
from hybridkv.cli.harness.tiny_models import write_tiny_model
from tests.e2e.test_store_connector import _record, assert_controls_fail, observe_store_turns

NUM_SPECULATIVE_TOKENS = 2


def _layer_index(layer_name: str) -> int:
    return int(re.search(r"layers\.(\d+)\.", layer_name).group(1))


def test_eagle_drafter_three_turns_hit_the_store_and_match_recompute(master, tmp_path, monkeypatch):
    target_dir = tiny_model("gemma3")
    draft_dir = str(write_tiny_model("eagle-gemma3", MODEL_CACHE / "eagle-gemma3-s0"))
    num_target_layers = json.loads((Path(target_dir) / "config.json").read_text())[
        "num_hidden_layers"
    ]
    key_log = tmp_path / "keys.log"
    # Lets collective_rpc ship kv_cache_layout to the worker (read by the engine's
    # processes at startup; monkeypatch removes it after the test).
    monkeypatch.setenv("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
    llm = make_llm(
        target_dir,
        store_transfer_config(
            {
                "master_address": master.address,
                "key_log_path": str(key_log),
                "namespace": "gemma3-eagle",
            }
        ),
        speculative_config={
            "method": "eagle",
            "model": draft_dir,
            "num_speculative_tokens": NUM_SPECULATIVE_TOKENS,
        },
        disable_log_stats=False,
    )
    try:
        layout = llm.collective_rpc(kv_cache_layout)[0]
        groups = layout["groups"]
        print(
            f"\nKV cache groups (scheduler block {layout['scheduler_block_size']}, "
            f"hash block {layout['hash_block_size']}):"
        )
        for g in groups:
            print(
                f"  g{g['group']}: {g['spec']:<18} block {g['block_size']:<4} head {g['head_size']:<4} "
                f"window {g['sliding_window']} eagle_flag {g['is_eagle_group']} layers {g['layers']}"
            )

        # The geometry this test is about: a drafter full-attention group at a block size
        # other than the target's full-attention groups.
        drafter = [
            g for g in groups if any(_layer_index(n) >= num_target_layers for n in g["layers"])
        ]
        target_full = [g for g in groups if g["spec"] == "FullAttentionSpec" and g not in drafter]
        assert [g["spec"] for g in drafter] == ["FullAttentionSpec"], groups
        assert target_full and any(g["spec"] == "SlidingWindowSpec" for g in groups), groups
        assert {g["block_size"] for g in target_full} == {256}, groups
        assert drafter[0]["block_size"] == 128 and drafter[0]["head_size"] == 128, groups
        assert layout["eagle_block_drop"] and not layout["fine_grained"]
        scheduler_block = layout["scheduler_block_size"]
        assert scheduler_block == math.lcm(*(g["block_size"] for g in groups)) == 256

        def expected(prev_len: int, _cur_len: int) -> int:
            """Last hit an extension of the previous prompt can reach (vLLM 0.32's rule)."""
            hit = get_mamba_prefill_checkpoint_position(prev_len, scheduler_block, True)
            assert hit == max(replay_boundaries(prev_len, scheduler_block, use_eagle=True))
            return hit

        rows, session = run_turns(llm, 3, expected)
        _record(
            "gemma3-eagle-drafter (SW 256 + FA 256 + drafter FA 128), block "
            "(local cache reset before every turn)",
            rows,
        )
        for r in rows:
            assert r.cached == r.expected, (
                f"turn {r.turn}: cached {r.cached} != EAGLE checkpoint {r.expected}"
            )
            assert r.cached % scheduler_block == 0, (
                f"turn {r.turn}: hit {r.cached} not scheduler-block aligned"
            )
            assert r.matches_recompute, f"turn {r.turn} differs from recompute"
            assert r.recompute_cached == 0, "the recompute under a fresh cache_salt must not hit"
        assert rows[0].expected == 0 and 0 < rows[1].cached < rows[2].cached

        # Every group, the drafter's included, wrote objects to the store.
        entries = [line.split() for line in key_log.read_text().splitlines()]
        assert {int(gid) for _, gid, _ in entries} == {g["group"] for g in groups}

        # Controls: plausible wrong blocks under one TARGET full-attention key (a
        # drafter block could not change the output: see the module docstring). The
        # prompt shares turn 3's prompt up to its last full scheduler block, so the
        # EAGLE drop leaves exactly the turn-4 checkpoint; block 1 ([256, 512)) is inside.
        last = session.prompt[: rows[2].prompt]
        hit = expected(len(last), 0)
        runs = plausible_fault_runs(
            llm,
            master.address,
            key_log,
            group=target_full[0]["group"],
            block_size=target_full[0]["block_size"],
            position=1,
            first_prompt=session.prompt[: rows[0].prompt],
            prefix=last[: hit + scheduler_block],
        )
        assert_controls_fail(runs, hit)
        observe_store_turns("gemma3-eagle", rows)
    finally:
        del llm
