"""The P/D proxy's bounds and its answers to broken instances and unusual requests.

Body size, requests in flight, connections, connect/read/write/pool timeouts per leg and the
decode-only bound all have finite defaults; a prefill instance's malformed answer is the
decode-only fallback (or, with ``--no-fallback``, a 502 naming the cause), a decode instance's
is a 502 naming it, never a bare 500; requests whose answer needs the prompt's logprobs, and beam
search, go to decode alone on purpose. Real proxy app behind a real HTTP server; the instances
are FakeVllm servers or raw sockets (tests/unit/proxy_instances.py).
"""

from __future__ import annotations

import argparse
import threading
import time

import httpx
import pytest

from hybridkv.cli.proxy import add_arguments, build_app
from tests.unit.proxy_instances import FakeVllm, Server, Silent

BASE = ["--prefill", "http://127.0.0.1:1", "--decode", "http://127.0.0.1:2"]
USER = {"model": "m", "prompt": "hi", "max_tokens": 3}


def _metric(url: str, name: str) -> float:
    for line in httpx.get(url + "/metrics", timeout=5).text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise AssertionError(f"{name} not on {url}/metrics")


def test_every_limit_has_a_finite_default():
    p = argparse.ArgumentParser()
    add_arguments(p)
    a = p.parse_args(BASE)
    assert a.max_body_bytes == 16 * 2**20 and a.max_concurrent == 256 and a.max_connections == 256
    assert a.max_hand_overs == 32
    assert (
        a.connect_timeout_s == 5.0
        and a.prefill_read_timeout_s == 120.0
        and a.read_timeout_s == 600.0
    )
    assert a.write_timeout_s == 30.0 and a.pool_timeout_s == 30.0
    assert a.max_decode_only == 8 and a.decode_only_wait_s == 30.0
    for bad in (
        ["--max-body-bytes", "0"],
        ["--connect-timeout-s", "0"],
        ["--max-concurrent", "-1"],
    ):
        with pytest.raises(SystemExit):
            p.parse_args([*BASE, *bad])


@pytest.mark.parametrize(
    "raw,cause",
    [
        ((200, b"<html>oops</html>", "text/html"), "not JSON"),
        ((200, b"[1, 2]", "application/json"), "a JSON list"),
        ((200, b'{"choices": []}', "application/json"), "no kv_transfer_params"),
        ((200, b'{"kv_transfer_params": "abc"}', "application/json"), "no kv_transfer_params"),
        ((500, b"not json at all", "text/plain"), "answered 500"),
    ],
)
@pytest.mark.parametrize("fallback", [True, False])
def test_a_malformed_prefill_answer_is_the_fallback_or_a_502_naming_the_cause(raw, cause, fallback):
    prefill, decode = FakeVllm("prefill", raw=raw), FakeVllm("decode")
    proxy = Server(build_app([prefill.url], [decode.url], timeout_s=10, fallback=fallback))
    try:
        r = httpx.post(proxy.url + "/v1/completions", json=USER, timeout=20)
        if fallback:
            assert r.status_code == 200, r.text
            assert r.headers["x-hybridkv-pd-fallback"] == "prefill-unavailable"
            assert len(decode.bodies) == 1 and "kv_transfer_params" not in decode.bodies[0]
        else:
            assert r.status_code == 502, r.text
            assert (
                cause in r.json()["error"]["message"]
                and prefill.url in r.json()["error"]["message"]
            )
            assert decode.bodies == []
    finally:
        proxy.close()
        prefill.close()
        decode.close()


@pytest.mark.parametrize("stream", [False, True])
def test_a_decode_answer_that_is_not_json_is_a_502_naming_decode(stream):
    prefill, decode = FakeVllm("prefill"), FakeVllm("decode", raw=(200, b"<html>", "text/html"))
    proxy = Server(build_app([prefill.url], [decode.url], timeout_s=10))
    try:
        r = httpx.post(proxy.url + "/v1/completions", json=USER | {"stream": stream}, timeout=20)
        if stream:  # a stream is relayed as it comes
            assert r.status_code == 200 and r.text == "<html>"
        else:
            assert r.status_code == 502, r.text
            assert (
                f"decode instance {decode.url} answered 200 with a body that is not JSON"
                in r.json()["error"]["message"]
            )
    finally:
        proxy.close()
        prefill.close()
        decode.close()


def test_a_body_over_the_bound_is_refused_with_413_before_any_leg():
    prefill, decode = FakeVllm("prefill"), FakeVllm("decode")
    proxy = Server(build_app([prefill.url], [decode.url], max_body_bytes=1000))
    try:
        big = USER | {"prompt": "x" * 2000}
        r = httpx.post(proxy.url + "/v1/completions", json=big, timeout=20)
        assert r.status_code == 413 and "--max-body-bytes 1000" in r.json()["error"]["message"]
        chunks = (b'{"model": "m", "prompt": "' + b"x" * 500 for _ in range(4))  # no content-length
        r = httpx.post(proxy.url + "/v1/completions", content=chunks, timeout=20)
        assert r.status_code == 413
        assert prefill.bodies == [] and decode.bodies == []
        assert httpx.post(proxy.url + "/v1/completions", json=USER, timeout=20).status_code == 200
    finally:
        proxy.close()
        prefill.close()
        decode.close()


def test_requests_past_the_concurrency_bound_are_answered_503_with_retry_after():
    gate = threading.Event()
    prefill, decode = FakeVllm("prefill"), FakeVllm("decode", gate=gate)
    proxy = Server(build_app([prefill.url], [decode.url], max_concurrent=2, retry_after_s=2))
    try:
        threads = [
            threading.Thread(
                target=httpx.post,
                args=(proxy.url + "/v1/completions",),
                kwargs={"json": USER, "timeout": 20},
            )
            for _ in range(2)
        ]
        for t in threads:
            t.start()
        deadline = time.monotonic() + 10
        while len(decode.bodies) < 2:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        r = httpx.post(proxy.url + "/v1/completions", json=USER, timeout=20)
        assert r.status_code == 503 and r.headers["retry-after"] == "2"
        assert "--max-concurrent 2" in r.json()["error"]["message"]
        assert _metric(proxy.url, "hybridkv_proxy_rejected_busy_total") == 1
        gate.set()
        for t in threads:
            t.join(10)
        assert httpx.post(proxy.url + "/v1/completions", json=USER, timeout=20).status_code == 200
    finally:
        gate.set()
        proxy.close()
        prefill.close()
        decode.close()


def test_a_silent_prefill_falls_back_after_the_prefill_read_timeout_not_the_decode_one():
    silent, decode = Silent(), FakeVllm("decode")
    proxy = Server(
        build_app([silent.url], [decode.url], prefill_read_timeout_s=0.5, read_timeout_s=600)
    )
    try:
        start = time.monotonic()
        r = httpx.post(proxy.url + "/v1/completions", json=USER, timeout=30)
        assert r.status_code == 200 and r.headers["x-hybridkv-pd-fallback"] == "prefill-unavailable"
        assert time.monotonic() - start < 5
    finally:
        proxy.close()
        silent.close()
        decode.close()


def test_a_full_connection_pool_is_a_502_after_the_pool_timeout():
    gate = threading.Event()
    prefill, decode = FakeVllm("prefill"), FakeVllm("decode", gate=gate)
    proxy = Server(build_app([prefill.url], [decode.url], max_connections=1, pool_timeout_s=0.5))
    try:
        t = threading.Thread(
            target=httpx.post,
            args=(proxy.url + "/v1/completions",),
            kwargs={"json": USER, "timeout": 20},
        )
        t.start()
        deadline = time.monotonic() + 10
        while not decode.bodies:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        r = httpx.post(proxy.url + "/v1/completions", json=USER | {"prompt": [1, 2]}, timeout=20)
        # the prefill leg of the second request finds no connection: decode-only, whose leg
        # finds none either
        assert r.status_code == 502, r.text
        assert "--max-connections 1" in r.json()["error"]["message"]
        gate.set()
        t.join(10)
    finally:
        gate.set()
        proxy.close()
        prefill.close()
        decode.close()


@pytest.mark.parametrize(
    "extra",
    [{"prompt_logprobs": 1}, {"echo": True, "logprobs": 2}, {"use_beam_search": True, "n": 2}],
)
def test_requests_that_cannot_use_a_hand_over_go_to_decode_alone(extra):
    """vLLM reads no cached or transferred KV for a request that wants its prompt's logprobs
    (``prompt_logprobs``, or ``echo`` with ``logprobs``): decode computes the prompt and its
    logprobs itself, and a prefill leg would only leave a lease unread. Beam search runs one
    engine request per beam and step in vLLM's serving layer, each answered by decode's own
    prefix cache. None of them is bounded by --max-decode-only (that bound is for fallbacks)."""
    prefill, decode = FakeVllm("prefill"), FakeVllm("decode")
    proxy = Server(build_app([prefill.url], [decode.url], max_decode_only=1))
    try:
        r = httpx.post(proxy.url + "/v1/completions", json=USER | extra, timeout=20)
        assert r.status_code == 200, r.text
        assert r.headers["x-hybridkv-pd-decode-only"] == next(iter(extra))
        assert prefill.bodies == [] and len(decode.bodies) == 1
        assert all(decode.bodies[0][k] == v for k, v in extra.items())
        assert _metric(proxy.url, "hybridkv_proxy_decode_only_by_request_total") == 1
        assert _metric(proxy.url, "hybridkv_proxy_decode_only_fallbacks_total") == 0
    finally:
        proxy.close()
        prefill.close()
        decode.close()


def test_echo_without_logprobs_is_handed_over_and_the_prefill_leg_computes_no_logprobs():
    prefill, decode = FakeVllm("prefill"), FakeVllm("decode")
    proxy = Server(build_app([prefill.url], [decode.url]))
    try:
        r = httpx.post(
            proxy.url + "/v1/completions", json=USER | {"echo": True, "top_logprobs": 3}, timeout=20
        )
        assert r.status_code == 200 and decode.read == prefill.leases == ["lease-0"]
        assert not {"echo", "logprobs", "top_logprobs", "prompt_logprobs"} & set(prefill.bodies[0])
        assert decode.bodies[0]["echo"] is True
    finally:
        proxy.close()
        prefill.close()
        decode.close()
