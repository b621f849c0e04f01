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
