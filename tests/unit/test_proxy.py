"""The P/D proxy's request rewriting (the HTTP hop itself is exercised by the demo/e2e)."""

from __future__ import annotations

import pytest

from hybridkv.cli.proxy import decode_request, prefill_request


def test_prefill_leg_is_one_token_without_streaming_and_marks_remote_decode():
    body = {"model": "m", "prompt": "hi", "max_tokens": 50, "stream": True,
            "stream_options": {"include_usage": True}, "min_tokens": 3}
    p = prefill_request(body)
    assert p["max_tokens"] == 1 and p["stream"] is False
    assert "stream_options" not in p and "min_tokens" not in p
    assert p["kv_transfer_params"]["do_remote_decode"] is True
    assert body["max_tokens"] == 50 and "kv_transfer_params" not in body  # the user's request is untouched


def test_decode_leg_carries_the_prefill_answer_and_refuses_a_missing_one():
    body = {"model": "m", "prompt": "hi", "max_tokens": 50, "stream": True}
    params = {"do_remote_prefill": True, "remote_block_ids": [[1, 2]], "remote_host": "127.0.0.1"}
    d = decode_request(body, {"kv_transfer_params": params})
    assert d["kv_transfer_params"] == params and d["max_tokens"] == 50 and d["stream"] is True
    with pytest.raises(ValueError, match="returned no kv_transfer_params"):
        decode_request(body, {"choices": []})


def test_the_http_front_door_parses_requests_and_names_a_dead_instance():
    """Through the real ASGI app: a request reaches the route (FastAPI resolves the handler's
    Request parameter) and an unreachable prefill instance is a 502 naming it, not a crash."""
    import socket

    from fastapi.testclient import TestClient

    from hybridkv.cli.proxy import build_app

    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{s.getsockname()[1]}"
    client = TestClient(build_app([dead], [dead], timeout_s=5))
    r = client.post("/v1/completions", json={"model": "m", "prompt": "hi"})
    assert r.status_code == 502
    assert f"prefill instance {dead} unreachable" in r.json()["error"]["message"]
    assert client.post("/v1/completions", content=b"{not json").status_code == 400
