"""One client request as P/D hand-overs: one prompt and one sample per hand-over.

vLLM answers a prefill request that holds several prompts with the first prompt's
``kv_transfer_params`` only, while it keeps a lease on every prompt's blocks; the others would
stay unread until ``lease_s``. So :func:`split_request` turns a batch of prompts (``prompt``: a
list of strings or of token-id lists) and ``n`` > 1 into one request per prompt and sample
(``n`` = 1, and with a ``seed`` the sample's own ``seed + i``, as vLLM seeds its ``n``
children), and :func:`merge_answers` joins their answers as vLLM would have answered the whole
request: choices prompt by prompt, ``index`` counting up, the prompt's tokens counted once per
prompt in ``usage``.
"""

from __future__ import annotations

from typing import Any

COMPLETIONS = "/v1/completions"


class MalformedAnswer(ValueError):
    """An instance's 200 answer that is not an OpenAI completion (the message names what)."""


def batch_prompts(path: str, body: dict[str, Any]) -> list[Any] | None:
    """The prompts of a completions batch; None when ``prompt`` is one prompt (a string or one
    list of token ids) or the route has no batches (chat)."""
    prompt = body.get("prompt")
    if path != COMPLETIONS or not isinstance(prompt, list) or not prompt:
        return None
    if all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return None
    return list(prompt)


def samples(body: dict[str, Any]) -> int:
    """``n`` when it is a whole number above 1, else 1 (vLLM judges a bad ``n`` itself)."""
    n = body.get("n")
    return n if isinstance(n, int) and not isinstance(n, bool) and n > 1 else 1


def split_request(path: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    """One request per prompt and sample, prompt-major (the order of vLLM's choices)."""
    prompts, n = batch_prompts(path, body), samples(body)
    if prompts is None and n == 1:
        return [body]
    seed = body.get("seed")
    seeded = isinstance(seed, int) and not isinstance(seed, bool)
    legs = []
    for prompt in prompts if prompts is not None else [None]:
        for i in range(n):
            # Shallow: no leg is changed in place (each leg's requests are copies), so a large
            # body is not copied once per leg.
            leg = dict(body)
            if prompts is not None:
                leg["prompt"] = prompt
            leg["n"] = 1
            if seeded:
                leg["seed"] = seed + i
            legs.append(leg)
    return legs


def answer_choices(answer: Any, who: str) -> list[dict[str, Any]]:
    """``answer``'s choices, checked to be an object with a list of objects."""
    if not isinstance(answer, dict):
        raise MalformedAnswer(
            f"{who} answered a JSON {type(answer).__name__} where a completion object was expected"
        )
    choices = answer.get("choices")
    if not isinstance(choices, list) or not all(isinstance(c, dict) for c in choices):
        raise MalformedAnswer(f"{who} answered a completion without a list of choices")
    return choices


def merge_answers(answers: list[dict[str, Any]], n: int, who: list[str]) -> dict[str, Any]:
    """The answer to the whole request from its legs' answers (in :func:`split_request`'s order;
    ``who[k]`` names leg k's instance in errors). The first leg's answer gives the other fields."""
    merged = dict(answers[0])
    choices: list[dict[str, Any]] = []
    prompt_tokens = completion_tokens = 0
    have_usage = True
    for k, answer in enumerate(answers):
        for choice in answer_choices(answer, who[k]):
            choices.append({**choice, "index": len(choices)})
        usage = answer.get("usage")
        if (
            isinstance(usage, dict)
            and isinstance(usage.get("prompt_tokens"), int)
            and isinstance(usage.get("completion_tokens"), int)
        ):
            if k % n == 0:  # the n samples of one prompt share its prompt tokens
                prompt_tokens += usage["prompt_tokens"]
            completion_tokens += usage["completion_tokens"]
        else:
            have_usage = False
    merged["choices"] = choices
    if have_usage:
        merged["usage"] = {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
        }
    return merged
