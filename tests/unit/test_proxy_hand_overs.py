"""The P/D proxy hands over one prompt per lease and owns the request ids it sends.

vLLM answers a prefill request holding several prompts with the FIRST prompt's
``kv_transfer_params`` only, while it keeps a lease for each prompt: a batch forwarded whole
leaves every other lease unread until ``lease_s``, and enough of them fill the lease budget (P/D
then turns off for every user). The proxy therefore splits a batch (and ``n`` > 1) into one
hand-over per prompt and sample and merges the answers in the OpenAI shape. The real proxy app
runs behind a real HTTP server; the instances are FakeVllm servers (tests/unit/proxy_instances.py).
"""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

from hybridkv.cli.proxy import build_app
from tests.unit.proxy_instances import FakeVllm, Server


@pytest.fixture()
def pair() -> Iterator[tuple[FakeVllm, FakeVllm, str]]:
    prefill, decode = FakeVllm("prefill"), FakeVllm("decode")
    proxy = Server(build_app([prefill.url], [decode.url], timeout_s=10))
    try:
        yield prefill, decode, proxy.url
    finally:
        proxy.close()
        prefill.close()
        decode.close()


def _post(url: str, body: dict, path: str = "/v1/completions") -> httpx.Response:
    return httpx.post(url + path, json=body, timeout=20)


@pytest.mark.parametrize("prompts", [["a", "bb", "ccc"], [[5, 6], [7, 8, 9], [10]]])
def test_a_batch_of_prompts_with_n_2_is_one_read_hand_over_per_prompt_and_sample(pair, prompts):
    prefill, decode, url = pair
    r = _post(url, {"model": "m", "prompt": prompts, "n": 2, "seed": 7, "max_tokens": 4})
    assert r.status_code == 200, r.text
    # every lease the prefill issued was handed to decode, once
    assert len(prefill.leases) == 6 and sorted(decode.read) == sorted(prefill.leases)
    # (the legs run concurrently: in any order)
    assert sorted((b["prompt"] for b in prefill.bodies), key=repr) == sorted(
        (p for p in prompts for _ in range(2)), key=repr
    )
    assert [b["n"] for b in prefill.bodies + decode.bodies] == [1] * 12
    got = r.json()
    assert [c["index"] for c in got["choices"]] == list(range(6))
    assert [c["text"] for c in got["choices"]] == [f"{p}|seed={s}" for p in prompts for s in (7, 8)]
    tokens = sum(len(p) for p in prompts)
    assert got["usage"] == {
        "prompt_tokens": tokens,
        "completion_tokens": 6,
        "total_tokens": tokens + 6,
    }


def test_one_prompt_of_token_ids_is_not_split(pair):
    prefill, decode, url = pair
    r = _post(url, {"model": "m", "prompt": [5, 6, 7], "max_tokens": 4})
    assert r.status_code == 200, r.text
    assert [b["prompt"] for b in prefill.bodies] == [[5, 6, 7]]
    assert decode.read == prefill.leases == ["lease-0"]


def test_chat_with_n_3_is_three_hand_overs_seeded_as_vllm_seeds_its_children(pair):
    prefill, decode, url = pair
    r = _post(
        url,
        {"model": "m", "messages": [{"role": "user", "content": "hi"}], "n": 3, "seed": 1},
        path="/v1/chat/completions",
    )
    assert r.status_code == 200, r.text
    assert sorted(decode.read) == sorted(prefill.leases) and len(prefill.leases) == 3
    assert [(c["index"], c["message"]["content"]) for c in r.json()["choices"]] == [
        (0, "chat|seed=1"),
        (1, "chat|seed=2"),
        (2, "chat|seed=3"),
    ]


def test_a_streamed_batch_is_refused_with_400_naming_the_field_and_the_fix(pair):
    prefill, decode, url = pair
    r = _post(url, {"model": "m", "prompt": ["a", "b"], "stream": True})
    assert r.status_code == 400
    message = r.json()["error"]["message"]
    assert "prompt" in message and "stream" in message and "one prompt per request" in message
    assert prefill.bodies == [] and decode.bodies == []


def test_a_streamed_n_2_is_one_hand_over_read_by_decode(pair):
    prefill, decode, url = pair
    r = _post(url, {"model": "m", "prompt": "a", "n": 2, "stream": True})
    assert r.status_code == 200 and r.text.endswith("data: [DONE]\n\n")
    assert decode.read == prefill.leases == ["lease-0"] and decode.bodies[0]["n"] == 2


def test_more_hand_overs_than_the_bound_are_refused_with_400(pair):
    prefill, decode, url = pair
    r = _post(url, {"model": "m", "prompt": ["a"] * 40, "n": 1})
    assert r.status_code == 400
    assert "--max-hand-overs" in r.json()["error"]["message"]
    assert prefill.bodies == [] and decode.bodies == []


def test_a_client_request_id_never_reaches_the_engines(pair):
    """A client's ``request_id`` of 1009 characters (prefill then signs a ``remote_request_id``
    longer than decode accepts: a prefill plus a recompute and a lease held for lease_s)."""
    prefill, decode, url = pair
    client_id = "x" * 1009
    r = _post(url, {"model": "m", "prompt": ["a", "b"], "request_id": client_id})
    assert r.status_code == 200, r.text
    sent = [b.get("request_id") for b in prefill.bodies + decode.bodies]
    assert client_id not in sent and all(isinstance(i, str) and 0 < len(i) <= 64 for i in sent), (
        sent
    )
    # the same id on both legs of one hand-over, another for the next
    assert sorted(b["request_id"] for b in prefill.bodies) == sorted(
        b["request_id"] for b in decode.bodies
    )
    assert len(set(b["request_id"] for b in prefill.bodies)) == 2
    assert all(
        b["kv_transfer_params"]["remote_request_id"] == b["request_id"] for b in decode.bodies
    )


def test_a_client_request_id_is_replaced_on_the_decode_only_path_too():
    from tests.unit.proxy_instances import dead_url

    decode = FakeVllm("decode")
    proxy = Server(build_app([dead_url()], [decode.url], timeout_s=10))
    try:
        r = _post(proxy.url, {"model": "m", "prompt": "a", "request_id": "y" * 2000})
        assert r.status_code == 200 and r.headers["x-hybridkv-pd-fallback"] == "prefill-unavailable"
        assert len(decode.bodies[0]["request_id"]) <= 64
    finally:
        proxy.close()
        decode.close()
