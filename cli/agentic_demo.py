"""Replay a deterministic multi-turn agentic session against a vLLM OpenAI server.

Why this shape: an agent resends its whole transcript every turn (previous prompt + the
model's answer + a new tool result / user message), so turn N's prompt is a long prefix of
turn N+1's. That is the traffic a KV store connector exists for. With the local prefix
cache dropped before each turn (``POST /reset_prefix_cache``), every cached token of turn
N+1 must come from the connector's store; the server's Prometheus counters tell which tier
served it.

Every turn is checked against a recompute: the same prompt is resent with a fresh
``cache_salt`` (accepted by ``/v1/completions`` in vLLM 0.32; the salt enters the first
block's hash, so no local or stored block can match) and the greedy token ids and their
logprobs must agree within a tolerance. The recompute itself must report 0 cached tokens.
bf16 prefill over a different split (cached prefix + new tokens vs all at once) moves
logits by an ulp or two, which can flip a greedy near-tie, as vLLM's own local prefix
cache does (about 1 turn in 16 on the tiny models). So the top-5 logprobs are requested and a first
divergence where each run's token is the other's runner-up within the tolerance counts as a
near-tie, not a mismatch (the tokens after it are not compared: their contexts differ).

Usage (also ``hybridkv demo``)::

    python -m hybridkv.cli.agentic_demo --kv-transfer-config none --kind qwen3next
    python -m hybridkv.cli.agentic_demo --url http://127.0.0.1:8000 --turns 6

Without ``--url`` a server is launched (:class:`hybridkv.cli.server.VllmServer`) on the
tiny model of ``--kind`` (written with its tokenizer into a cache folder) or on
``--model``. Exit status: 0 when every turn matches its recompute, 1 on a mismatch, 2 on a
usage or server error.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import pathlib
import random
import shlex
import sys
import time
import uuid
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field

__all__ = [
    "Progress",
    "Trajectory",
    "TurnResult",
    "add_arguments",
    "main",
    "run_from_args",
]

DEFAULT_TURNS = 4
DEFAULT_MAX_TOKENS = 16
DEFAULT_FIRST_PROMPT_TOKENS = 1500
DEFAULT_TURN_GROWTH_TOKENS = 600
DEFAULT_MAX_MODEL_LEN = 4096
# The tolerance sits above bf16 noise between a correct cache hit and its recompute (p99.9
# 0.047, max 0.092 on the tiny gemma3; a bf16 ulp at logits O(3) is 0.016); a one-token change
# of the prompt still fails it in most cases.
DEFAULT_LOGPROB_TOL = 0.1
# Top-k logprobs per output position, so a greedy flip can be told apart from a near-tie.
# 5, not 2: bf16 logits of the tiny models tie exactly (gap 0.0000) often enough that three-way
# ties occur: the recompute's token can be third in the served run, outside a top-2, where the
# tie could not be told from a flip.
_TOP_LOGPROBS = 5
# Re-tokenising a sampled answer can take more tokens than were sampled (a byte-level token
# decodes to U+FFFD, which encodes to 3 bytes); the length budget assumes at most this many.
_ANSWER_RETOKENIZE_FACTOR = 4

# vLLM 0.32 Prometheus counters (exported with a "_total" suffix), in tokens.
METRIC_LOCAL_QUERIES = "vllm:prefix_cache_queries"
METRIC_LOCAL_HITS = "vllm:prefix_cache_hits"
METRIC_STORE_QUERIES = "vllm:external_prefix_cache_queries"
METRIC_STORE_HITS = "vllm:external_prefix_cache_hits"

# ------------------------------------------------------------------------ trajectory


@dataclass(frozen=True)
class Trajectory:
    """The seeded agentic session: what each turn appends to the transcript.

    Turn 0's prompt is :meth:`chunk` (0). Turn k's prompt is turn k-1's prompt + the model's
    answer to it + :meth:`chunk` (k), so every prompt extends the previous one. Chunks are
    made of :data:`hybridkv.cli.harness.tiny_tokenizer.WORDS` (each `` word`` and each ``"\\n"`` is
    one token of the tiny tokenizer), so with the tiny model a chunk is exactly
    ``first_prompt_tokens`` / ``turn_growth_tokens`` tokens (plus the BOS token once); with
    another tokenizer the lengths are approximate.
    """

    seed: int = 0
    first_prompt_tokens: int = DEFAULT_FIRST_PROMPT_TOKENS
    turn_growth_tokens: int = DEFAULT_TURN_GROWTH_TOKENS

    _MIN_CHUNK = 8

    def __post_init__(self) -> None:
        for name in ("first_prompt_tokens", "turn_growth_tokens"):
            if getattr(self, name) < self._MIN_CHUNK:
                raise ValueError(f"{name} must be at least {self._MIN_CHUNK} tokens")

    def chunk_tokens(self, turn: int) -> int:
        return self.first_prompt_tokens if turn == 0 else self.turn_growth_tokens

    def chunk_pieces(self, turn: int) -> list[str]:
        """Turn ``turn``'s new text as one-token pieces (`` word`` or ``"\\n"``).

        Lines of tool output (turn 0: the system prompt), then a user line, then
        ``"\\n assistant"`` for the model to answer after. Exactly ``chunk_tokens(turn)``
        pieces; seeded by (seed, turn) only, so a chunk never depends on earlier answers.
        """
        from hybridkv.cli.harness.tiny_tokenizer import WORDS

        n = self.chunk_tokens(turn)
        rng = random.Random(f"hybridkv-agentic:{self.seed}:{turn}")

        def words(k: int) -> list[str]:
            return [" " + rng.choice(WORDS) for _ in range(k)]

        header = [" system"] if turn == 0 else [" tool", " result"]
        user = ["\n", " user", *words(8)]
        tail = ["\n", " assistant"]
        body_n = n - len(user) - len(tail)
        body: list[str] = []
        while len(body) < body_n:
            newline = [] if turn == 0 and not body else ["\n"]
            body += newline + header + words(rng.randint(6, 18))
        body = body[: max(body_n, 0)]
        if body and body[-1] == "\n":
            # Two newlines in a row pre-tokenise as one piece; keep one token per piece.
            body[-1] = words(1)[0]
        return (body + user + tail)[-n:]

    def chunk(self, turn: int) -> str:
        return "".join(self.chunk_pieces(turn))

    def prompt(self, turn: int, previous_prompt: str = "", previous_answer: str = "") -> str:
        """Turn ``turn``'s prompt: the previous transcript extended by this turn's chunk."""
        if turn == 0:
            return self.chunk(0)
        return previous_prompt + previous_answer + self.chunk(turn)

    def prompt_budget(self, turns: int, max_tokens: int) -> int:
        """Upper estimate of the last turn's prompt + answer length, in tiny-tokenizer tokens."""
        chunks = sum(self.chunk_tokens(t) for t in range(turns))
        answers = (turns - 1) * max_tokens * _ANSWER_RETOKENIZE_FACTOR
        return 1 + chunks + answers + max_tokens


# ------------------------------------------------------------------------ HTTP client


class DemoError(RuntimeError):
    """A usage or server problem: reported without a traceback, exit status 2."""


@dataclass
class Completion:
    """One streamed ``/v1/completions`` call, as needed for the table and the comparison."""

    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    prompt_token_ids: list[int] = field(default_factory=list)
    token_logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[dict[int, float]] = field(default_factory=list)  # token id -> logprob
    prompt_tokens: int = 0
    cached_tokens: int | None = None
    ttft_s: float = math.nan


class Client:
    """The few endpoints the demo needs, over ``requests``."""

    def __init__(self, url: str, timeout_s: float = 600.0) -> None:
        import requests

        self.url = url.rstrip("/")
        self.timeout_s = timeout_s
        self.http = requests.Session()

    def model_card(self) -> tuple[str, int | None]:
        """(model id to send, the server's max_model_len) from ``GET /v1/models``."""
        r = self.http.get(self.url + "/v1/models", timeout=30)
        r.raise_for_status()
        card = r.json()["data"][0]
        return card["id"], card.get("max_model_len")

    def metrics(self) -> dict[str, float]:
        """``GET /metrics`` summed over label sets: ``{"vllm:prefix_cache_hits_total": ..}``."""
        r = self.http.get(self.url + "/metrics", timeout=30)
        r.raise_for_status()
        return parse_prometheus(r.text)

    def reset_prefix_cache(self, attempts: int = 50) -> None:
        """Drop the local prefix cache (not the connector's store); retry while blocks are held."""
        for _ in range(attempts):
            r = self.http.post(self.url + "/reset_prefix_cache", timeout=30)
            if r.status_code == 404:
                raise DemoError(
                    "POST /reset_prefix_cache -> 404: start the server with "
                    "VLLM_SERVER_DEV_MODE=1, or pass --no-reset-local-cache"
                )
            r.raise_for_status()
            if r.json().get("success", True):
                return
            time.sleep(0.1)
        raise DemoError("POST /reset_prefix_cache kept answering success=false (blocks held)")

    def complete(
        self, model: str, prompt: str, max_tokens: int, cache_salt: str | None = None
    ) -> Completion:
        """Greedy streamed completion with top-5 logprobs, token ids and usage."""
        body: dict = {
            "model": model,
            "prompt": prompt,
            "max_tokens": max_tokens,
            "temperature": 0.0,
            "logprobs": _TOP_LOGPROBS,
            "return_tokens_as_token_ids": True,  # logprob keys "token_id:N", unambiguous
            "stream": True,
            "stream_options": {"include_usage": True},
            "return_token_ids": True,
        }
        if cache_salt is not None:
            body["cache_salt"] = cache_salt
        out = Completion()
        t0 = time.perf_counter()
        with self.http.post(
            self.url + "/v1/completions", json=body, stream=True, timeout=self.timeout_s
        ) as r:
            if r.status_code != 200:
                raise DemoError(f"/v1/completions -> {r.status_code}: {r.text[:2000]}")
            for line in r.iter_lines():
                if not line.startswith(b"data: ") or line == b"data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    raise DemoError(f"/v1/completions stream error: {chunk['error']}")
                for choice in chunk.get("choices") or []:
                    got_token = choice.get("token_ids") or choice.get("text")
                    if got_token and math.isnan(out.ttft_s):
                        out.ttft_s = time.perf_counter() - t0
                    _absorb_choice(out, choice)
                if chunk.get("usage"):
                    usage = chunk["usage"]
                    out.prompt_tokens = usage["prompt_tokens"]
                    details = usage.get("prompt_tokens_details") or {}
                    out.cached_tokens = details.get("cached_tokens")
        return out


def _absorb_choice(out: Completion, choice: dict) -> None:
    out.text += choice.get("text") or ""
    out.token_ids += choice.get("token_ids") or []
    if choice.get("prompt_token_ids"):
        out.prompt_token_ids = list(choice["prompt_token_ids"])
    lp = choice.get("logprobs") or {}
    out.token_logprobs += [x if x is not None else math.nan for x in lp.get("token_logprobs") or []]
    for top in lp.get("top_logprobs") or []:
        out.top_logprobs.append(
            {int(k.rsplit(":", 1)[1]): v for k, v in (top or {}).items() if v is not None}
        )


def parse_prometheus(text: str) -> dict[str, float]:
    """Prometheus text format -> {metric name: value summed over its label sets}."""
    totals: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        name_part, _, value = line.rpartition(" ")
        name = name_part.split("{", 1)[0].strip()
        try:
            totals[name] = totals.get(name, 0.0) + float(value)
        except ValueError:
            continue
    return totals


def counter(metrics: dict[str, float], name: str) -> float | None:
    """A counter's value under its exported name (``NAME_total``, or ``NAME``); None if absent."""
    for key in (name + "_total", name):
        if key in metrics:
            return metrics[key]
    return None


# ------------------------------------------------------------------------ one turn


@dataclass
class TurnResult:
    """One row of the table (and of ``--json-out``)."""

    turn: int
    prompt_tokens: int
    cached_tokens: int
    hit_source: str
    local_hit_tokens: int
    store_hit_tokens: int
    reusable_tokens: int
    ttft_ms: float
    recompute_ttft_ms: float
    recompute_cached_tokens: int
    max_logprob_diff: float
    tokens_match: bool
    near_tie_at: int | None
    matches_recompute: bool
    note: str = ""
    output_token_ids: list[int] = field(default_factory=list)


@dataclass
class _Deltas:
    local_queries: float = 0.0
    local_hits: float = 0.0
    store_queries: float = 0.0
    store_hits: float = 0.0


def _deltas(before: dict[str, float], after: dict[str, float]) -> _Deltas:
    def d(name: str) -> float:
        return (counter(after, name) or 0.0) - (counter(before, name) or 0.0)

    return _Deltas(
        d(METRIC_LOCAL_QUERIES), d(METRIC_LOCAL_HITS), d(METRIC_STORE_QUERIES), d(METRIC_STORE_HITS)
    )


def _metrics_after(client: Client, before: dict[str, float]) -> dict[str, float]:
    """Metrics once the request's prefill is counted (stats land a moment after the output)."""
    deadline = time.monotonic() + 3.0
    while True:
        after = client.metrics()
        if _deltas(before, after).local_queries > 0 or time.monotonic() > deadline:
            return after
        time.sleep(0.05)


def hit_source(local_hits: float, store_hits: float, remote: str = "store") -> str:
    """Where the cached tokens came from; ``remote`` names the connector's tier
    (``store``, or ``prefill`` for a P/D decode instance)."""
    if local_hits > 0 and store_hits > 0:
        return f"local+{remote}"
    if store_hits > 0:
        return remote
    return "local" if local_hits > 0 else "none"


@dataclass(frozen=True)
class Comparison:
    """How a turn's output compares with its recompute."""

    matches: bool
    max_logprob_diff: float  # over positions both runs share; inf on a real divergence
    tie_at: int | None = None  # output position of an excused greedy near-tie
    why: str = ""


def compare(a: Completion, b: Completion, tol: float) -> Comparison:
    """Compare greedy outputs ``a`` (served, maybe from cache) and ``b`` (recomputed).

    Up to the first differing token, the chosen tokens' logprobs and every top-k entry both
    runs list must agree within ``tol``. A first difference passes only as a near-tie: each
    run lists the other's token within ``tol`` of its own choice.
    """
    n = common_prefix(a.token_ids, b.token_ids)
    worst = 0.0

    def worse(current: float, diff: float) -> float:
        # max() would drop a NaN (nan > x is False): a NaN logprob must fail the check.
        return diff if math.isnan(diff) or math.isnan(current) or diff > current else current

    for i in range(n):
        worst = worse(worst, abs(a.token_logprobs[i] - b.token_logprobs[i]))
        ta, tb = a.top_logprobs[i], b.top_logprobs[i]
        for tok in ta.keys() & tb.keys():
            worst = worse(worst, abs(ta[tok] - tb[tok]))
    if math.isnan(worst) or worst > tol:
        return Comparison(False, worst, why=f"logprobs differ by {worst:.4f} > {tol}")
    if len(a.token_ids) == len(b.token_ids) == n:
        return Comparison(True, worst)
    if n == len(a.token_ids) or n == len(b.token_ids):
        return Comparison(False, math.inf, why="outputs have different lengths")
    x, y = a.token_ids[n], b.token_ids[n]
    gap_a = a.token_logprobs[n] - a.top_logprobs[n].get(y, -math.inf)
    gap_b = b.token_logprobs[n] - b.top_logprobs[n].get(x, -math.inf)
    if max(gap_a, gap_b) <= tol:
        return Comparison(
            True, worst, tie_at=n,
            why=f"near-tie at output position {n} (gaps {gap_a:.4f}/{gap_b:.4f}); "
            "later tokens not compared",
        )  # fmt: skip
    return Comparison(
        False, math.inf,
        why=f"token ids differ at output position {n} (gaps {gap_a:.4f}/{gap_b:.4f} > {tol})",
    )  # fmt: skip


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def run_turn(
    client: Client,
    model: str,
    turn: int,
    prompt: str,
    previous_ids: Sequence[int],
    *,
    max_tokens: int,
    reset_local_cache: bool,
    tol: float,
    reference: Client | None = None,
    remote: str = "store",
) -> tuple[TurnResult, Completion]:
    """Send one turn, then its salted recompute, and compare them.

    ``reference``: the instance that serves metrics, cache resets and the recompute
    when ``client`` is a front door (the P/D proxy); default ``client`` itself.
    """
    server = reference or client
    if reset_local_cache:
        server.reset_prefix_cache()
    before = server.metrics()
    main = client.complete(model, prompt, max_tokens)
    after = _metrics_after(server, before)
    d = _deltas(before, after)
    # A fresh salt per call: the recompute can hit neither the local cache nor the store.
    salt = f"hybridkv-recompute-{uuid.uuid4().hex}"
    ref = server.complete(model, prompt, max_tokens, cache_salt=salt)
    if not main.token_ids or not main.prompt_token_ids:
        raise DemoError(
            "the server returned no token ids; it must accept return_token_ids (vLLM >= 0.11)"
        )
    cmp = compare(main, ref, tol)
    ref_cached = ref.cached_tokens or 0
    notes = [cmp.why] if cmp.why else []
    if main.cached_tokens is None:
        notes.append(
            "no prompt_tokens_details: start the server with --enable-prompt-tokens-details"
        )
    if ref_cached:
        notes.append(f"recompute was not a miss ({ref_cached} cached tokens)")
    row = TurnResult(
        turn=turn + 1,
        prompt_tokens=main.prompt_tokens,
        cached_tokens=main.cached_tokens or 0,
        hit_source=hit_source(d.local_hits, d.store_hits, remote),
        local_hit_tokens=int(d.local_hits),
        store_hit_tokens=int(d.store_hits),
        reusable_tokens=common_prefix(main.prompt_token_ids, previous_ids),
        ttft_ms=main.ttft_s * 1e3,
        recompute_ttft_ms=ref.ttft_s * 1e3,
        recompute_cached_tokens=ref_cached,
        max_logprob_diff=cmp.max_logprob_diff,
        tokens_match=main.token_ids == ref.token_ids,
        near_tie_at=cmp.tie_at,
        matches_recompute=cmp.matches and ref_cached == 0,
        note="; ".join(notes),
        output_token_ids=list(main.token_ids),
    )
    return row, main


# ------------------------------------------------------------------------ table, summary

_COLUMNS = (  # (TurnResult field, title, width, format spec)
    ("turn", "turn", 4, "d"),
    ("prompt_tokens", "prompt", 6, "d"),
    ("cached_tokens", "cached", 6, "d"),
    ("reusable_tokens", "reusable", 8, "d"),
    ("hit_source", "source", 11, "s"),
    ("local_hit_tokens", "local", 6, "d"),
    ("store_hit_tokens", "store", 6, "d"),
    ("ttft_ms", "ttft_ms", 8, ".1f"),
    ("recompute_ttft_ms", "recomp_ms", 9, ".1f"),
    ("max_logprob_diff", "max_dlp", 8, ".4f"),
    ("matches_recompute", "matches", 7, "s"),
)


def table_header() -> str:
    return "  ".join(f"{title:>{width}}" for _, title, width, _ in _COLUMNS)


def table_row(row: TurnResult) -> str:
    cells = []
    for key, _, width, spec in _COLUMNS:
        value = getattr(row, key)
        cells.append(format(str(value) if spec == "s" else value, f">{width}{spec}"))
    return "  ".join(cells) + (f"  # {row.note}" if row.note else "")


def summarize(rows: Sequence[TurnResult]) -> dict:
    """Hit rate over turns 2..N, mean TTFT of hit turns vs their recomputes, mismatches."""
    later = rows[1:]
    prompt = sum(r.prompt_tokens for r in later)
    cached = sum(r.cached_tokens for r in later)
    hits = [r for r in rows if r.cached_tokens > 0]

    def mean(xs: Iterable[float]) -> float | None:
        xs = list(xs)
        return sum(xs) / len(xs) if xs else None

    return {
        "turns": len(rows),
        "hit_rate": cached / prompt if prompt else None,
        "cached_tokens": cached,
        "prompt_tokens": prompt,
        "hit_turns": len(hits),
        "mean_ttft_ms_hit_turns": mean(r.ttft_ms for r in hits),
        "mean_ttft_ms_recompute_of_hit_turns": mean(r.recompute_ttft_ms for r in hits),
        "mean_ttft_ms_recompute_all": mean(r.recompute_ttft_ms for r in rows),
        "mismatches": sum(not r.matches_recompute for r in rows),
        "near_ties": sum(r.near_tie_at is not None for r in rows),
    }


def format_summary(s: dict) -> str:
    def ms(x: float | None) -> str:
        return "n/a" if x is None else f"{x:.1f} ms"

    rate = "n/a" if s["hit_rate"] is None else f"{100 * s['hit_rate']:.1f} %"
    return "\n".join(
        [
            f"hit rate (turns 2..{s['turns']}): {rate} "
            f"({s['cached_tokens']} of {s['prompt_tokens']} prompt tokens cached)",
            f"mean TTFT: hit turns {ms(s['mean_ttft_ms_hit_turns'])} ({s['hit_turns']} turns) vs "
            f"their recompute {ms(s['mean_ttft_ms_recompute_of_hit_turns'])}; "
            f"recompute over all turns {ms(s['mean_ttft_ms_recompute_all'])}",
            f"mismatches vs recompute: {s['mismatches']} of {s['turns']} "
            f"(greedy near-ties excused: {s['near_ties']})",
        ]
    )


class Progress:
    """A progress bar that never shares a line with the output.

    Why: the table rows go to stdout and the bar to stderr; on a terminal both land on
    the same screen line, so a row printed while the bar is drawn comes out as
    ``turns:  25%|██▌ ...row``. Each :meth:`write` clears the bar, writes and FLUSHES
    the line, then redraws the bar below it, so the rows read as a clean table above
    the bar; the bar is removed when done (``leave=False``), so the table and the summary
    after it are contiguous.

    ``enabled``: None (default) shows the bar only when ``err`` is a terminal -- in a log
    file or a pipe every redraw would be a line of ``\r``-separated bar fragments; False
    (``--no-progress``) never. Without tqdm there is no bar, only the lines.
    """

    def __init__(
        self,
        total: int,
        desc: str = "turns",
        unit: str = "turn",
        enabled: bool | None = None,
        out=None,
        err=None,
    ) -> None:  # noqa: ANN001 - text streams
        self.out = out if out is not None else sys.stdout
        self.err = err if err is not None else sys.stderr
        if enabled is None:
            enabled = _isatty(self.err)
        self._bar = None
        if enabled:
            try:
                from tqdm import tqdm
            except ImportError:
                tqdm = None
            if tqdm is not None:
                self._bar = tqdm(
                    total=total,
                    desc=desc,
                    unit=unit,
                    file=self.err,
                    leave=False,
                    dynamic_ncols=True,
                )

    @property
    def shows_bar(self) -> bool:
        return self._bar is not None

    def write(self, line: str, file=None) -> None:  # noqa: ANN001 - a text stream
        """``line`` on ``file`` (default: ``out``), above the bar."""
        f = file if file is not None else self.out
        if self._bar is None:
            print(line, file=f, flush=True)
            return
        with self._bar.get_lock():
            self._bar.clear(nolock=True)
            self.err.flush()
            print(line, file=f, flush=True)
            self._bar.refresh(nolock=True)

    def update(self) -> None:
        if self._bar is not None:
            self._bar.update(1)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None


def _isatty(stream) -> bool:  # noqa: ANN001
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):
        return False


# ------------------------------------------------------------------------ session


def run_session(
    client: Client,
    trajectory: Trajectory,
    *,
    turns: int,
    max_tokens: int,
    reset_local_cache: bool,
    tol: float,
    reference: Client | None = None,
    remote: str = "store",
    progress: bool | None = None,
) -> list[TurnResult]:
    """Replay ``turns`` turns of ``trajectory`` and return one checked row per turn.

    ``progress``: the turn bar (see :class:`Progress`): None = only on a terminal."""
    server = reference or client
    model, max_model_len = server.model_card()
    budget = trajectory.prompt_budget(turns, max_tokens)
    if max_model_len is not None and budget > max_model_len:
        raise DemoError(
            f"{turns} turns need up to ~{budget} tokens but the server's max_model_len is "
            f"{max_model_len}: lower --turns, --first-prompt-tokens or --turn-growth-tokens"
        )
    exported = server.metrics()
    missing = [m for m in (METRIC_LOCAL_HITS, METRIC_STORE_HITS) if counter(exported, m) is None]
    if missing:
        print(
            f"agent-demo: server exports no {', '.join(missing)}; hit sources will read "
            "'none' for those tiers",
            file=sys.stderr,
        )
    # Warm up (first request pays one-off costs), salted so it can seed no cache hit.
    client.complete(model, trajectory.chunk(0)[:200], 1, cache_salt=f"warmup-{uuid.uuid4().hex}")
    rows: list[TurnResult] = []
    prompt, answer, previous_ids = "", "", []
    bar = Progress(turns, enabled=progress)
    bar.write(table_header())
    try:
        for turn in range(turns):
            prompt = trajectory.prompt(turn, prompt, answer)
            row, main = run_turn(
                client, model, turn, prompt, previous_ids,
                max_tokens=max_tokens, reset_local_cache=reset_local_cache, tol=tol,
                reference=reference, remote=remote,
            )  # fmt: skip
            rows.append(row)
            bar.write(table_row(row))
            bar.update()
            answer, previous_ids = main.text, main.prompt_token_ids + main.token_ids
    finally:
        bar.close()
    return rows


def _default_cache_dir() -> pathlib.Path:
    base = os.environ.get("XDG_CACHE_HOME") or pathlib.Path.home() / ".cache"
    return pathlib.Path(base) / "hybridkv"


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The demo's options (shared by ``hybridkv agent-demo`` and ``python -m``)."""
    src = p.add_argument_group("what to talk to")
    src.add_argument("--url", help="an already running server (nothing is launched)")
    src.add_argument("--model", help="model folder/name to serve instead of the tiny model")
    # Not choices=KINDS: that would import torch (via tiny_models) for every `hybridkv` call;
    # write_tiny_model rejects an unknown kind with the list.
    src.add_argument(
        "--kind", default="gemma3", help="tiny model: gemma3 (default), qwen3next, gemma4"
    )
    src.add_argument("--model-seed", type=int, default=0, help="tiny model weights seed")
    src.add_argument(
        "--kv-transfer-config",
        default="default",
        help="'default' (HybridStoreConnector), 'none' (no connector), a JSON object or @FILE",
    )
    src.add_argument(
        "--pd",
        action="store_true",
        help="prefill/decode disaggregation: launch a prefill and a decode instance with "
        "HybridPDConnector and talk to them through `hybridkv proxy` (hits then come from "
        "the prefill instance; the recompute runs on the decode instance)",
    )
    src.add_argument(
        "--pd-lease-s",
        type=float,
        default=60.0,
        help="with --pd: seconds the prefill instance keeps a request's blocks for decode",
    )
    src.add_argument("--max-model-len", type=int, default=DEFAULT_MAX_MODEL_LEN)
    src.add_argument("--port", type=int, default=0, help="server port (default: a free one)")
    src.add_argument(
        "--cache-dir",
        type=pathlib.Path,
        default=None,
        help="tiny models and server logs (default ~/.cache/hybridkv)",
    )
    src.add_argument("--server-log", type=pathlib.Path, default=None)
    src.add_argument("--server-args", default="", help="extra server arguments (one string)")
    src.add_argument("--startup-timeout", type=float, default=300.0)

    run = p.add_argument_group("the session")
    run.add_argument("--turns", type=int, default=DEFAULT_TURNS)
    run.add_argument("--seed", type=int, default=0, help="trajectory seed")
    run.add_argument("--max-tokens", type=int, default=DEFAULT_MAX_TOKENS)
    run.add_argument("--first-prompt-tokens", type=int, default=DEFAULT_FIRST_PROMPT_TOKENS)
    run.add_argument(
        "--turn-growth-tokens",
        type=int,
        default=DEFAULT_TURN_GROWTH_TOKENS,
        help="tokens of tool result / user text appended each turn (plus the answer)",
    )
    run.add_argument(
        "--reset-local-cache",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="drop the local prefix cache before each turn, so hits must come from the "
        "connector (default: on for a launched server, off with --url)",
    )
    run.add_argument("--logprob-tolerance", type=float, default=DEFAULT_LOGPROB_TOL)
    run.add_argument(
        "--progress",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="a turn progress bar on stderr, kept below the table (default: only when "
        "stderr is a terminal; --no-progress for logs)",
    )
    run.add_argument("--json-out", type=pathlib.Path, help="write config, rows and summary here")


def run_from_args(args: argparse.Namespace) -> int:
    """Launch (or attach to) a server, replay the session, print and save the results."""
    from hybridkv.cli.server import (
        ServerStartError,
        VllmServer,
        check_kv_connector_importable,
        parse_kv_transfer_config,
    )

    try:
        if args.turns < 1 or args.max_tokens < 1:
            raise DemoError("--turns and --max-tokens must be at least 1")
        trajectory = Trajectory(args.seed, args.first_prompt_tokens, args.turn_growth_tokens)
        reset = args.reset_local_cache if args.reset_local_cache is not None else not args.url
        session = dict(
            turns=args.turns, max_tokens=args.max_tokens, reset_local_cache=reset,
            tol=args.logprob_tolerance, progress=args.progress,
        )  # fmt: skip
        info: dict = {
            "reset_local_cache": reset,
            **asdict(trajectory),
            **{k: v for k, v in session.items() if k != "progress"},
        }
        if args.pd and (args.url or args.kv_transfer_config != "default"):
            raise DemoError(
                "--pd launches its own two instances with HybridPDConnector: "
                "drop --url / --kv-transfer-config"
            )
        if args.url:
            info.update(url=args.url, kv_transfer_config="(external server)")
            rows = run_session(Client(args.url), trajectory, **session)
        else:
            kv = parse_kv_transfer_config(args.kv_transfer_config)
            check_kv_connector_importable(kv)
            budget = trajectory.prompt_budget(args.turns, args.max_tokens)
            if budget > args.max_model_len:
                raise DemoError(
                    f"{args.turns} turns need up to ~{budget} tokens > --max-model-len "
                    f"{args.max_model_len}: lower --turns, --first-prompt-tokens or "
                    "--turn-growth-tokens"
                )
            cache = args.cache_dir or _default_cache_dir()
            model = args.model or str(_tiny_model(args.kind, args.model_seed, cache))
            log = args.server_log or cache / "logs" / f"vllm-{os.getpid()}.log"
            extra = shlex.split(args.server_args)
            if not args.model and args.kind == "qwen3next" and "--block-size" not in extra:
                # vLLM 0.32 aligns prefill chunks to --block-size; the tiny model's Mamba
                # states live every 256 tokens (see HybridStoreConnector's startup warning).
                extra += ["--block-size", "256"]
            if args.pd:
                from hybridkv.cli.pd_stack import PDStack, pd_transfer_config

                prefill_cfg = pd_transfer_config("kv_producer")
                prefill_cfg["kv_connector_extra_config"] = {"lease_s": args.pd_lease_s}
                stack = PDStack(
                    model,
                    max_model_len=args.max_model_len,
                    extra_args=extra,
                    log_dir=cache / "logs" / f"pd-{os.getpid()}",
                    startup_timeout_s=args.startup_timeout,
                    prefill_config=prefill_cfg,
                )
                info.update(
                    model=model,
                    mode="pd",
                    prefill_command=stack.prefill.command(),
                    decode_command=stack.decode.command(),
                    proxy_command=stack.proxy_command(),
                )
                print(
                    f"starting prefill + decode instances and hybridkv proxy (logs: {stack.proxy_log.parent}) ...",
                    file=sys.stderr,
                )
                with stack:
                    print(
                        f"P/D ready: proxy {stack.url}, decode {stack.decode.url}", file=sys.stderr
                    )
                    rows = run_session(
                        Client(stack.url),
                        trajectory,
                        **session,
                        reference=Client(stack.decode.url),
                        remote="prefill",
                    )
                    info["url"] = stack.url
                return _finish(args, info, rows)
            server = VllmServer(
                model, port=args.port or None, max_model_len=args.max_model_len,
                kv_transfer_config=kv, extra_args=extra,
                log_path=log, startup_timeout_s=args.startup_timeout,
            )  # fmt: skip
            info.update(
                model=model,
                kv_transfer_config=kv,
                server_command=server.command(),
                server_log=str(log),
            )
            print(f"starting vLLM server on {server.url} (log: {log}) ...", file=sys.stderr)
            with server:
                print(f"server ready; model {model}", file=sys.stderr)
                rows = run_session(Client(server.url), trajectory, **session)
                info["url"] = server.url
    except (DemoError, ServerStartError, ValueError, OSError) as e:  # OSError: HTTP too
        print(f"agent-demo: {e}", file=sys.stderr)
        return 2
    return _finish(args, info, rows)


def _finish(args: argparse.Namespace, info: dict, rows: list[TurnResult]) -> int:
    """Print the summary, write ``--json-out``; exit status 1 on any mismatch."""
    summary = summarize(rows)
    print(format_summary(summary))
    if args.json_out:
        info["metrics"] = [
            METRIC_LOCAL_QUERIES,
            METRIC_LOCAL_HITS,
            METRIC_STORE_QUERIES,
            METRIC_STORE_HITS,
        ]
        doc = {"config": info, "turns": [asdict(r) for r in rows], "summary": summary}
        args.json_out.parent.mkdir(parents=True, exist_ok=True)
        args.json_out.write_text(json.dumps(_strict_json(doc), indent=2, default=str) + "\n")
    return 1 if summary["mismatches"] else 0


def _strict_json(obj):
    """inf/nan (a diverged comparison, a missing TTFT) -> null: plain JSON for any reader."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if isinstance(obj, dict):
        return {k: _strict_json(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_strict_json(v) for v in obj]
    return obj


def _tiny_model(kind: str, seed: int, cache: pathlib.Path) -> pathlib.Path:
    from hybridkv.cli.harness.tiny_models import write_tiny_model

    # Written once per kind/seed/format version (write_tiny_model is idempotent).
    path = write_tiny_model(kind, cache / "tiny-models" / f"{kind}-seed{seed}", seed=seed)
    print(f"tiny {kind} model (seed {seed}, with tokenizer): {path}", file=sys.stderr)
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m hybridkv.cli.agentic_demo", description=__doc__.splitlines()[0]
    )
    add_arguments(parser)
    return run_from_args(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
