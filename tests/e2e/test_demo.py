"""The README's first command: `hybridkv demo` on a real vLLM OpenAI server."""

from __future__ import annotations

import json

from hybridkv.cli.main import main


def test_demo_serves_store_hits_that_match_recompute(tmp_path):
    out = tmp_path / "demo.json"
    assert main(["demo", "--turns", "3", "--cache-dir", str(tmp_path / "cache"), "--json-out", str(out)]) == 0
    doc = json.loads(out.read_text())
    turns = doc["turns"]
    assert all(t["matches_recompute"] for t in turns)
    assert turns[0]["cached_tokens"] == 0
    for t in turns[1:]:
        assert t["hit_source"] == "store" and t["cached_tokens"] >= 1024, t


def test_demo_pd_through_the_proxy_matches_recompute(tmp_path):
    """`hybridkv demo --pd`: two real vLLM servers with HybridPDConnector and the real
    `hybridkv proxy` subprocess in front; every turn is streamed through the proxy, the
    decode instance pulls the prompt's KV from the prefill instance over NIXL, and the
    answer must equal a recompute on the decode instance under a fresh cache_salt."""
    out = tmp_path / "demo-pd.json"
    assert main(["demo", "--pd", "--turns", "3", "--cache-dir", str(tmp_path / "cache"),
                 "--json-out", str(out)]) == 0
    doc = json.loads(out.read_text())
    turns = doc["turns"]
    print("\n" + "\n".join(f"turn {t['turn']}: prompt {t['prompt_tokens']} cached {t['cached_tokens']} "
                           f"source {t['hit_source']} ttft {t['ttft_ms']:.0f} ms (recompute "
                           f"{t['recompute_ttft_ms']:.0f}) matches {t['matches_recompute']}" for t in turns))
    assert all(t["matches_recompute"] for t in turns)
    for t in turns:
        # The hand-over ends on the last 128-token boundary before the final prompt token;
        # decode counts those tokens as external hits ("prefill" source). The usage's
        # cached_tokens is the PREFILL side's own prefix hit (vLLM reports it for P/D).
        handover = (t["prompt_tokens"] - 1) // 128 * 128
        assert t["hit_source"].endswith("prefill"), t
        assert t["local_hit_tokens"] + t["store_hit_tokens"] >= handover, t
    assert turns[1]["cached_tokens"] > 0, "the prefill instance's own prefix cache must hit on turn 2"
