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
