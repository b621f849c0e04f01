"""The agentic demo's offline parts: trajectory, tiny tokenizer, comparison, metrics parsing.

No engine here (the end-to-end run lives in tests/e2e). The tokenizer is trained once per
module (about a second).
"""

from __future__ import annotations

import json
import math

import pytest

from hybridkv.cli.agentic_demo import (
    Completion,
    Progress,
    Trajectory,
    TurnResult,
    compare,
    counter,
    hit_source,
    parse_prometheus,
    summarize,
    table_header,
    table_row,
)
from hybridkv.cli.harness import tiny_models
from hybridkv.cli.harness.tiny_tokenizer import SPECIAL_IDS, WORDS, write_tiny_tokenizer
from hybridkv.cli.server import (
    DEFAULT_KV_TRANSFER_CONFIG,
    VllmServer,
    check_kv_connector_importable,
    parse_kv_transfer_config,
)

MODEL_VOCAB = tiny_models._VOCAB


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    return write_tiny_tokenizer(tmp_path_factory.mktemp("tok"), MODEL_VOCAB)


@pytest.fixture(scope="module")
def hf_tokenizer(tokenizer_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tokenizer_dir))


# ---------------------------------------------------------------- tokenizer


def test_tokenizer_special_ids_match_every_tiny_model_config(hf_tokenizer):
    assert hf_tokenizer.pad_token_id == SPECIAL_IDS["<pad>"] == 0
    assert hf_tokenizer.eos_token_id == SPECIAL_IDS["</s>"] == 1
    assert hf_tokenizer.bos_token_id == SPECIAL_IDS["<s>"] == 2
    for kind, (make_config, _) in tiny_models._BUILDERS.items():
        cfg = make_config()
        assert (cfg["pad_token_id"], cfg["eos_token_id"], cfg["bos_token_id"]) == (0, 1, 2), kind
        assert len(hf_tokenizer) <= cfg["vocab_size"], kind


def test_tokenizer_vocab_fills_the_model_vocab_and_every_id_decodes(hf_tokenizer):
    assert len(hf_tokenizer) == MODEL_VOCAB
    # The model samples any id; each must decode (no None/unknown ids).
    ids = list(range(3, MODEL_VOCAB))
    assert all(tok is not None for tok in hf_tokenizer.convert_ids_to_tokens(ids))
    assert isinstance(hf_tokenizer.decode(ids), str)


def test_tokenizer_round_trip_and_bos(hf_tokenizer):
    text = " user asks\n tool result: cache hit 42 (ok) — ünïcode"
    ids = hf_tokenizer(text)["input_ids"]
    assert ids[0] == 2 and 2 not in ids[1:]
    assert hf_tokenizer.decode(ids, skip_special_tokens=True) == text
    assert hf_tokenizer.decode(hf_tokenizer(text, add_special_tokens=False)["input_ids"]) == text


def test_every_word_is_one_token(hf_tokenizer):
    for piece in [" " + w for w in WORDS] + ["\n"]:
        assert len(hf_tokenizer(piece, add_special_tokens=False)["input_ids"]) == 1, piece


def test_tokenizer_writer_is_deterministic_and_idempotent(tmp_path, tokenizer_dir):
    out = write_tiny_tokenizer(tmp_path / "a", MODEL_VOCAB)
    assert (out / "tokenizer.json").read_bytes() == (tokenizer_dir / "tokenizer.json").read_bytes()
    stamp = out / ".hybridkv_tiny_tokenizer.json"
    mtime = (out / "tokenizer.json").stat().st_mtime_ns
    write_tiny_tokenizer(out, MODEL_VOCAB)  # current: nothing rewritten
    assert (out / "tokenizer.json").stat().st_mtime_ns == mtime
    stamp.unlink()  # interrupted write: redone
    write_tiny_tokenizer(out, MODEL_VOCAB)
    assert json.loads(stamp.read_text())["vocab_size"] == MODEL_VOCAB


def test_tokenizer_too_small_vocab_is_named(tmp_path):
    with pytest.raises(RuntimeError, match="too small"):
        write_tiny_tokenizer(tmp_path, 400)


# ---------------------------------------------------------------- trajectory


@pytest.mark.parametrize("first,growth", [(1500, 600), (64, 32), (8, 9)])
def test_chunks_have_the_configured_token_counts(hf_tokenizer, first, growth):
    tr = Trajectory(seed=3, first_prompt_tokens=first, turn_growth_tokens=growth)
    for turn in range(4):
        want = first if turn == 0 else growth
        pieces = tr.chunk_pieces(turn)
        assert len(pieces) == want
        ids = hf_tokenizer(tr.chunk(turn), add_special_tokens=False)["input_ids"]
        assert len(ids) == want, turn
    # One BOS plus the first chunk.
    assert len(hf_tokenizer(tr.prompt(0))["input_ids"]) == first + 1


def test_trajectory_is_deterministic_and_seeded():
    a, b = Trajectory(seed=7), Trajectory(seed=7)
    assert [a.chunk(t) for t in range(5)] == [b.chunk(t) for t in range(5)]
    assert Trajectory(seed=8).chunk(0) != a.chunk(0)
    assert a.chunk(1) != a.chunk(2)


def test_each_prompt_extends_the_previous_prompt_and_answer(hf_tokenizer):
    tr = Trajectory(seed=1, first_prompt_tokens=100, turn_growth_tokens=50)
    prompt, answer = "", ""
    prev_ids: list[int] = []
    for turn in range(5):
        new = tr.prompt(turn, prompt, answer)
        assert new.startswith(prompt + answer)
        assert new.endswith("\n assistant")  # the model answers as the assistant
        ids = hf_tokenizer(new)["input_ids"]
        assert ids[: len(prev_ids)] == prev_ids  # a prefix in tokens too: cacheable
        prompt, answer = new, f" answer {turn} cache hit"
        prev_ids = hf_tokenizer(prompt + answer)["input_ids"]


def test_prompt_budget_and_minimum_chunk():
    tr = Trajectory(first_prompt_tokens=1500, turn_growth_tokens=600)
    assert tr.prompt_budget(1, 16) == 1 + 1500 + 16
    assert tr.prompt_budget(4, 16) <= 4096  # the demo's defaults fit the tiny models
    with pytest.raises(ValueError):
        Trajectory(first_prompt_tokens=3)


# ---------------------------------------------------------------- comparison


def _completion(ids, lps, runner_up=None):
    """A completion whose top-2 lists (id, lp) and runner-up id+1 at lp - gap."""
    runner_up = runner_up or [1.0] * len(ids)
    tops = [{i: lp, i + 1: lp - gap} for i, lp, gap in zip(ids, lps, runner_up)]
    return Completion(token_ids=list(ids), token_logprobs=list(lps), top_logprobs=tops)


def test_compare_equal_within_tolerance():
    a = _completion([5, 6, 7], [-1.0, -2.0, -3.0])
    b = _completion([5, 6, 7], [-1.02, -2.0, -3.0])
    c = compare(a, b, tol=0.05)
    assert c.matches and c.tie_at is None and c.max_logprob_diff == pytest.approx(0.02)
    assert not compare(a, b, tol=0.01).matches


def test_compare_excuses_only_a_real_near_tie():
    a = _completion([5, 6, 7], [-1.0, -2.0, -3.0], runner_up=[1.0, 0.01, 1.0])
    # b picks a's runner-up (id 7) at position 1, and lists a's token 6 just below it.
    b = Completion(
        token_ids=[5, 7, 9],
        token_logprobs=[-1.0, -2.0, -3.0],
        top_logprobs=[{5: -1.0}, {7: -2.0, 6: -2.01}, {9: -3.0}],
    )
    tie = compare(a, b, tol=0.05)
    assert tie.matches and tie.tie_at == 1
    wide = _completion([5, 6, 7], [-1.0, -2.0, -3.0], runner_up=[1.0, 0.5, 1.0])
    flip = compare(wide, b, tol=0.05)
    assert not flip.matches and math.isinf(flip.max_logprob_diff)


def test_compare_excuses_a_three_way_tie_only_when_the_other_token_is_listed_close():
    """Served run: x, then z, then the recompute's y one bf16 ulp down (third); recompute:
    y and x tied exactly. A near-tie, visible only when the top-k reaches the third entry."""
    served = Completion(
        token_ids=[5, 6],
        token_logprobs=[-1.0, -2.0],
        top_logprobs=[{5: -1.0}, {6: -2.0, 8: -2.0, 7: -2.0156}],
    )
    recompute = Completion(
        token_ids=[5, 7],
        token_logprobs=[-1.0, -2.0],
        top_logprobs=[{5: -1.0}, {7: -2.0, 6: -2.0, 8: -2.0156}],
    )
    tie = compare(served, recompute, tol=0.1)
    assert tie.matches and tie.tie_at == 1
    top2 = Completion(
        token_ids=[5, 6], token_logprobs=[-1.0, -2.0], top_logprobs=[{5: -1.0}, {6: -2.0, 8: -2.0}]
    )
    assert not compare(top2, recompute, tol=0.1).matches  # what a top-2 request saw


def test_compare_length_mismatch_fails():
    a = _completion([5, 6], [-1.0, -2.0])
    b = _completion([5], [-1.0])
    assert not compare(a, b, tol=0.1).matches


# ---------------------------------------------------------------- metrics, table, config

_METRICS = """\
# HELP vllm:prefix_cache_hits Prefix cache hits
# TYPE vllm:prefix_cache_hits counter
vllm:prefix_cache_hits_total{engine="0",model_name="m"} 1408.0
vllm:prefix_cache_hits_created{engine="0",model_name="m"} 1.7e+09
vllm:external_prefix_cache_hits_total{engine="0",model_name="m"} 128.0
vllm:external_prefix_cache_hits_total{engine="1",model_name="m"} 128.0
"""


def test_prometheus_parse_sums_label_sets():
    m = parse_prometheus(_METRICS)
    assert counter(m, "vllm:prefix_cache_hits") == 1408.0
    assert counter(m, "vllm:external_prefix_cache_hits") == 256.0
    assert counter(m, "vllm:external_prefix_cache_queries") is None


def test_hit_source():
    assert hit_source(0, 0) == "none"
    assert hit_source(128, 0) == "local"
    assert hit_source(0, 128) == "store"
    assert hit_source(1, 1) == "local+store"


def _row(turn, prompt, cached, ok=True):
    return TurnResult(
        turn=turn, prompt_tokens=prompt, cached_tokens=cached, hit_source="store",
        local_hit_tokens=0, store_hit_tokens=cached, reusable_tokens=cached, ttft_ms=10.0,
        recompute_ttft_ms=30.0, recompute_cached_tokens=0, max_logprob_diff=0.0,
        tokens_match=ok, near_tie_at=None, matches_recompute=ok,
    )  # fmt: skip


def test_summary_counts_turns_two_to_n_and_mismatches():
    s = summarize([_row(1, 1000, 0), _row(2, 1600, 1024), _row(3, 2200, 1536, ok=False)])
    assert s["hit_rate"] == pytest.approx((1024 + 1536) / (1600 + 2200))
    assert s["hit_turns"] == 2 and s["mismatches"] == 1
    assert s["mean_ttft_ms_hit_turns"] == 10.0
    assert len(table_row(_row(1, 1, 0)).split()) == len(table_header().split())


def test_kv_transfer_config_values(tmp_path):
    assert parse_kv_transfer_config("none") is None
    assert parse_kv_transfer_config("default") == DEFAULT_KV_TRANSFER_CONFIG
    raw = '{"kv_connector":"ExampleConnector","kv_role":"kv_both"}'
    assert parse_kv_transfer_config(raw)["kv_connector"] == "ExampleConnector"
    f = tmp_path / "kv.json"
    f.write_text(raw)
    assert parse_kv_transfer_config(f"@{f}") == json.loads(raw)
    with pytest.raises(ValueError, match="kv-transfer-config"):
        parse_kv_transfer_config("{not json")
    with pytest.raises(ValueError, match="not found"):
        check_kv_connector_importable({"kv_connector": "Nope", "kv_connector_module_path": "json"})


def test_server_command_line():
    srv = VllmServer("/m", port=1234, kv_transfer_config={"kv_connector": "X"}, extra_args=["-a"])
    cmd = srv.command()
    assert cmd[1:3] == ["-m", "vllm.entrypoints.openai.api_server"]
    assert cmd[cmd.index("--host") + 1] == "127.0.0.1" and srv.url == "http://127.0.0.1:1234"
    assert json.loads(cmd[cmd.index("--kv-transfer-config") + 1]) == {"kv_connector": "X"}
    assert {"--enable-prefix-caching", "--enable-prompt-tokens-details"} <= set(cmd)
    assert cmd[-1] == "-a"
    assert "--kv-transfer-config" not in VllmServer("/m", port=1).command()
    env = srv.environment()
    assert env["VLLM_HOST_IP"] == "127.0.0.1" and env["VLLM_SERVER_DEV_MODE"] == "1"


# ---------------------------------------------------------------- table output vs the progress bar

_TABLE_SCRIPT = """
import sys
from hybridkv.cli.agentic_demo import Progress, TurnResult, table_header, table_row
rows = [TurnResult(turn=t, prompt_tokens=1500 + 600 * t, cached_tokens=128 * t, hit_source="store",
                   local_hit_tokens=0, store_hit_tokens=128 * t, reusable_tokens=128 * t, ttft_ms=70.5,
                   recompute_ttft_ms=120.25, recompute_cached_tokens=0, max_logprob_diff=0.0163,
                   tokens_match=True, near_tie_at=None, matches_recompute=True) for t in range(1, 5)]
bar = Progress(len(rows), enabled={enabled})
bar.write(f"bar: {{bar.shows_bar}}", file=sys.stderr)  # a log line while the bar is up
bar.write(table_header())
for r in rows:
    bar.update()  # the bar is drawn before each row, as while a turn runs
    bar.write(table_row(r))
bar.close()
print("summary line", flush=True)
"""


def _render(raw: str, width: int) -> list[str]:
    """What a terminal shows for ``raw``: CR, LF, wrapping, ESC[K / ESC[A; one string per line."""
    import re

    screen: list[list[str]] = [[]]
    row = col = 0
    i = 0
    while i < len(raw):
        ch = raw[i]
        if ch == "\x1b":
            m = re.match(r"\x1b\[(\d*)([A-Za-z])", raw[i:])
            if m:
                n = int(m.group(1) or 1)
                if m.group(2) == "A":
                    row = max(0, row - n)
                elif m.group(2) == "K":
                    del screen[row][col:]
                i += m.end()
                continue
        if ch == "\r":
            col = 0
        elif ch == "\n":
            row += 1
        else:
            if col >= width:
                row, col = row + 1, 0
            while len(screen) <= row:
                screen.append([])
            line = screen[row]
            line.extend(" " * (col + 1 - len(line)))
            line[col] = ch
            col += 1
        while len(screen) <= row:
            screen.append([])
        i += 1
    return ["".join(x).rstrip() for x in screen]


def _run_on_a_terminal(tmp_path, enabled: str, width: int = 160) -> str:
    """Run the table script with stdout and stderr on one real pty of ``width`` columns."""
    import fcntl
    import os
    import pty
    import struct
    import subprocess
    import sys
    import termios

    script = tmp_path / "table.py"
    script.write_text(_TABLE_SCRIPT.format(enabled=enabled))
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 50, width, 0, 0))
    proc = subprocess.Popen(
        [sys.executable, str(script)], stdout=slave, stderr=slave, close_fds=True
    )
    os.close(slave)
    raw = b""
    while True:
        try:
            chunk = os.read(master, 65536)
        except OSError:  # EIO: the child closed the pty
            break
        if not chunk:
            break
        raw += chunk
    os.close(master)
    assert proc.wait(timeout=60) == 0, raw.decode(errors="replace")
    return raw.decode()


def _expected_lines() -> list[str]:
    rows = [
        TurnResult(
            turn=t,
            prompt_tokens=1500 + 600 * t,
            cached_tokens=128 * t,
            hit_source="store",
            local_hit_tokens=0,
            store_hit_tokens=128 * t,
            reusable_tokens=128 * t,
            ttft_ms=70.5,
            recompute_ttft_ms=120.25,
            recompute_cached_tokens=0,
            max_logprob_diff=0.0163,
            tokens_match=True,
            near_tie_at=None,
            matches_recompute=True,
        )
        for t in range(1, 5)
    ]
    return [table_header(), *(table_row(r) for r in rows), "summary line"]


def test_table_rows_are_intact_above_the_bar_on_a_terminal(tmp_path):
    raw = _run_on_a_terminal(tmp_path, "None")  # auto: stderr is a terminal -> a bar
    assert "bar: True" in raw and "turns:" in raw and "█" in raw  # the bar was really drawn
    screen = [ln for ln in _render(raw, 160) if ln]
    assert screen == ["bar: True", *_expected_lines()]  # every row whole; the bar gone at the end


def test_no_progress_draws_no_bar_even_on_a_terminal(tmp_path):
    raw = _run_on_a_terminal(tmp_path, "False")
    assert "turns:" not in raw and "\r\r" not in raw
    assert [ln for ln in _render(raw, 160) if ln] == ["bar: False", *_expected_lines()]


def test_no_bar_in_logs_and_pipes():
    import io

    out, err = io.StringIO(), io.StringIO()  # not terminals: auto mode draws nothing
    bar = Progress(2, out=out, err=err)
    assert not bar.shows_bar
    bar.write("a row")
    bar.update()
    bar.write("a log line", file=err)
    bar.close()
    assert out.getvalue() == "a row\n" and err.getvalue() == "a log line\n"


def test_demo_progress_flag():
    import argparse

    from hybridkv.cli.agentic_demo import add_arguments

    p = argparse.ArgumentParser()
    add_arguments(p)
    assert p.parse_args([]).progress is None
    assert p.parse_args(["--no-progress"]).progress is False
    assert p.parse_args(["--progress"]).progress is True


def test_compare_fails_on_a_nan_logprob():
    """A NaN logprob (e.g. NaN KV loaded from a corrupt block) must fail the check;
    ``max(worst, nan)`` kept the old worst and passed it."""
    good = Completion(
        token_ids=[5, 6], token_logprobs=[-0.1, -0.2], top_logprobs=[{5: -0.1}, {6: -0.2}]
    )
    bad = Completion(
        token_ids=[5, 6], token_logprobs=[-0.1, math.nan], top_logprobs=[{5: -0.1}, {6: math.nan}]
    )
    assert compare(good, good, 0.1).matches
    assert not compare(bad, good, 0.1).matches
    assert not compare(good, bad, 0.1).matches
