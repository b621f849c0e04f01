"""The README's first command: `hybridkv demo` on a real vLLM OpenAI server."""

from __future__ import annotations

import json

import pytest

from hybridkv.cli.agentic_demo import TurnResult, table_header, table_row
from hybridkv.cli.harness.engine_start import ENV as ENGINE_START_ENV
from hybridkv.cli.main import main


@pytest.fixture
def vllms_own_spawn(monkeypatch):  # noqa: ANN001, ANN201
    """The README's command as a user runs it: the server's engine processes start the way
    vLLM's CPU platform starts them (spawn), while the other e2e tests start theirs by fork
    (the suite's default: tests/e2e/conftest.py, cli/harness/engine_start.py). The store demo
    keeps vLLM's spawn path covered; the P/D demo takes the suite's default (its two servers'
    engine cores and workers would each import vLLM again, 8-13 s of a core apiece)."""
    monkeypatch.setenv(ENGINE_START_ENV, "spawn")


@pytest.mark.usefixtures("vllms_own_spawn")
def test_demo_serves_store_hits_that_match_recompute(tmp_path, capsys):
    out = tmp_path / "demo.json"
    assert (
        main(
            ["demo", "--turns", "3", "--cache-dir", str(tmp_path / "cache"), "--json-out", str(out)]
        )
        == 0
    )
    doc = json.loads(out.read_text())
    turns = doc["turns"]
    assert all(t["matches_recompute"] for t in turns)
    assert turns[0]["cached_tokens"] == 0
    for t in turns[1:]:
        assert t["hit_source"] == "store" and t["cached_tokens"] >= 1024, t
    # The table a log captures: the header and one whole line per turn, exactly the JSON's rows,
    # then the summary; no progress bar (stderr is not a terminal here).
    printed = capsys.readouterr()
    lines = printed.out.splitlines()
    rows = [table_row(TurnResult(**t)) for t in turns]
    assert lines[:4] == [table_header(), *rows]
    assert lines[4].startswith("hit rate (turns 2..3): ")
    assert "\r" not in printed.out + printed.err and "turns:" not in printed.err


def test_demo_pd_through_the_proxy_matches_recompute(tmp_path):
    """`hybridkv demo --pd`: two real vLLM servers with HybridPDConnector and the real
    `hybridkv proxy` subprocess in front; every turn is streamed through the proxy and must
    equal a recompute on the decode instance under a fresh cache_salt, and its KV must have
    come over NIXL: the decode side pulled the whole hand-over and neither side logged a
    lease expiry or a refused/failed READ.

    The lease is long (60 s) on purpose: before the two engines got disjoint cores
    (PDStack.split_cpus), decode legs on this machine stalled until the lease expired and
    then recomputed; with a short lease that failure hid behind matching output.
    """
    out = tmp_path / "demo-pd.json"
    rc = main(
        [
            "demo",
            "--pd",
            "--pd-lease-s",
            "60",
            "--turns",
            "3",
            "--cache-dir",
            str(tmp_path / "cache"),
            "--json-out",
            str(out),
        ]
    )
    doc = json.loads(out.read_text())
    turns = doc["turns"]
    print(
        "\n"
        + "\n".join(
            f"turn {t['turn']}: prompt {t['prompt_tokens']} cached {t['cached_tokens']} "
            f"pulled {t['store_hit_tokens']} source {t['hit_source']} ttft {t['ttft_ms']:.0f} ms "
            f"(recompute {t['recompute_ttft_ms']:.0f}) matches {t['matches_recompute']}"
            for t in turns
        )
    )
    assert rc == 0 and len(turns) == 3
    assert all(t["matches_recompute"] for t in turns)
    for t in turns:
        # The hand-over: every full 128-token block before the last prompt token.
        assert (
            t["hit_source"] == "prefill"
            and t["store_hit_tokens"] == (t["prompt_tokens"] - 1) // 128 * 128
        ), t
    logs = list((tmp_path / "cache" / "logs").glob("pd-*/*.log"))
    assert {p.name for p in logs} >= {"prefill.log", "decode.log"}
    for log in logs:
        text = log.read_text(errors="replace")
        for sign in (
            "pd_lease_expired",
            "pd_read_outlived_lease",
            "[pd_read:",
            "[pd_refused]",
            "[pd_release:",
            "P/D handshake with",
        ):
            assert sign not in text, f"{log.name}: {sign}"
