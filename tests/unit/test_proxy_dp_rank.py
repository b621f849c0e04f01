"""The P/D proxy carries a client's ``X-data-parallel-rank`` to the decode leg only.

vLLM's OpenAI server picks the DP rank of a ``--data-parallel-size`` instance from that header
(else the least loaded rank). A decode DP rank's prefix cache holds what that rank served, so a
router keeping a conversation on one decode rank needs the header to get through the proxy; the
prefill leg must not carry it (it names a decode rank, not one of the prefill's). The instances
are real HTTP servers recording each request's header (FAKE vLLM instances: no engine behind
them); the real proxy app runs behind a real HTTP server too.
"""

from __future__ import annotations

import httpx
import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from hybridkv.cli.proxy import build_app
from tests.unit.proxy_instances import Server

DP_RANK_HEADER = "X-data-parallel-rank"  # vLLM's (entrypoints/generate/base/serving.py)


class _Recorder(Server):
    """A FAKE vLLM instance: answers a completion (a prefill with transfer parameters) and
    records each request's ``X-data-parallel-rank`` (None when absent)."""

    def __init__(self, role: str) -> None:
        self.ranks: list[str | None] = []
        app = FastAPI()

        @app.post("/v1/completions")
        async def completions(request: Request):  # noqa: ANN202
            body = await request.json()
            self.ranks.append(request.headers.get(DP_RANK_HEADER))
            params = {"do_remote_prefill": True} if role == "prefill" else None
            out = {"choices": [{"index": 0, "text": role}], "kv_transfer_params": params}
            if body.get("stream"):

                async def chunks():  # noqa: ANN202
                    yield b'data: {"choices": [{"index": 0}]}\n\ndata: [DONE]\n\n'

                return StreamingResponse(chunks(), media_type="text/event-stream")
            return JSONResponse(out)

        super().__init__(app)


@pytest.mark.parametrize("stream", [False, True])
def test_the_decode_leg_carries_the_clients_dp_rank_and_the_prefill_leg_does_not(stream):
    prefill, decode = _Recorder("prefill"), _Recorder("decode")
    proxy = Server(build_app([prefill.url], [decode.url], timeout_s=10))
    try:
        body = {"model": "m", "prompt": [5, 6, 7], "max_tokens": 2, "stream": stream}
        for headers in ({DP_RANK_HEADER: "1"}, {"x-data-parallel-rank": "0"}, {}):
            r = httpx.post(proxy.url + "/v1/completions", json=body, headers=headers, timeout=20)
            assert r.status_code == 200, r.text
        assert decode.ranks == ["1", "0", None]
        assert prefill.ranks == [None, None, None]
    finally:
        proxy.close()
        prefill.close()
        decode.close()


def test_only_a_non_negative_integer_rank_is_carried():
    from hybridkv.cli.proxy import decode_headers

    assert decode_headers({DP_RANK_HEADER: "3"}) == {DP_RANK_HEADER: "3"}
    for bad in ("-1", "1.0", "x", "", "１", "1234567", " 1"):
        assert decode_headers({DP_RANK_HEADER: bad}) == {}, bad
    assert decode_headers({"authorization": "Bearer t"}) == {}
