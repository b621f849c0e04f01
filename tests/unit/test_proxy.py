"""The P/D proxy: its request rewriting, and its HTTP hops against real HTTP servers.

The instances here are small real HTTP servers (uvicorn in a thread) that record what they
receive and answer as a vLLM prefill / decode instance would; the vLLM engines themselves
run behind the proxy in the demo, the P/D e2e and the P/D soak (bench/soak.py --pd, which
SIGKILLs the prefill instance mid-READ).
"""

from __future__ import annotations

import pytest
from fastapi import (
    Request,
)  # module level: FastAPI resolves the test servers' string annotations here

from hybridkv.cli.proxy import decode_request, prefill_request
from tests.freeze import freeze


def test_prefill_leg_is_one_token_without_streaming_and_marks_remote_decode():
    body = {
        "model": "m",
        "prompt": "hi",
        "max_tokens": 50,
        "stream": True,
        "stream_options": {"include_usage": True},
        "min_tokens": 3,
    }
    p = prefill_request(body)
    assert p["max_tokens"] == 1 and p["stream"] is False
    assert "stream_options" not in p and "min_tokens" not in p
    assert p["kv_transfer_params"]["do_remote_decode"] is True
    assert (
        body["max_tokens"] == 50 and "kv_transfer_params" not in body
    )  # the user's request is untouched


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
    client = TestClient(build_app([dead], [dead], timeout_s=5, fallback=False))
    r = client.post("/v1/completions", json={"model": "m", "prompt": "hi"})
    assert r.status_code == 502
    assert f"prefill instance {dead} unreachable" in r.json()["error"]["message"]
    assert client.post("/v1/completions", content=b"{not json").status_code == 400


class _Instance:
    """A real HTTP server on 127.0.0.1 answering POSTs like a vLLM instance; records bodies.
    ``gate``: each answer waits until it is set (a decode instance busy computing)."""

    def __init__(self, status: int = 200, params: dict | None = None, gate=None, app=None) -> None:  # noqa: ANN001
        import asyncio
        import threading

        import uvicorn
        from fastapi import FastAPI
        from fastapi.responses import JSONResponse, StreamingResponse

        self.bodies: list[dict] = []
        if app is None:
            app = FastAPI()

            @app.post("/v1/completions")
            async def completions(request: Request):
                body = await request.json()
                self.bodies.append(body)
                while gate is not None and not gate.is_set():
                    await asyncio.sleep(0.01)
                answer = {"choices": [{"text": "ok"}]}
                if params is not None and body.get("kv_transfer_params", {}).get(
                    "do_remote_decode"
                ):
                    answer["kv_transfer_params"] = params
                if body.get("stream"):

                    async def chunks():
                        yield b"data: {}\n\n"
                        yield b"data: [DONE]\n\n"

                    return StreamingResponse(chunks(), media_type="text/event-stream")
                return JSONResponse(status_code=status, content=answer)

        self.server = uvicorn.Server(
            uvicorn.Config(app, host="127.0.0.1", port=0, log_level="error")
        )
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        for _ in range(500):
            if self.server.started:
                break
            import time

            time.sleep(0.01)
        sock = self.server.servers[0].sockets[0]
        self.url = f"http://127.0.0.1:{sock.getsockname()[1]}"

    def close(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)


def _dead_url() -> str:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}"


PARAMS = {"do_remote_prefill": True, "remote_block_ids": [[1]], "remote_host": "127.0.0.1"}
USER = {
    "model": "m",
    "prompt": "hi",
    "max_tokens": 7,
    "kv_transfer_params": {"remote_host": "10.9.9.9"},
}


@pytest.mark.parametrize(
    "prefill_fault", ["unreachable", "answers 500", "answers without kv_transfer_params"]
)
def test_no_prefill_instance_serves_the_request_so_decode_computes_it_alone(prefill_fault):
    """A dead or broken prefill instance costs TTFT, not the request: decode gets the user's
    request alone (max_tokens kept, a client's own kv_transfer_params dropped), the answer
    is marked and counted. Planted (fallback off): 502 -- what clients of the P/D soak saw
    while the prefill was SIGKILLed."""
    from fastapi.testclient import TestClient

    from hybridkv.cli.proxy import build_app

    decode = _Instance()
    prefill = (
        None
        if prefill_fault == "unreachable"
        else _Instance(status=500 if prefill_fault == "answers 500" else 200, params=None)
    )
    try:
        client = TestClient(
            build_app([prefill.url if prefill else _dead_url()], [decode.url], timeout_s=5)
        )
        r = client.post("/v1/completions", json=USER)
        assert r.status_code == 200 and r.json() == {"choices": [{"text": "ok"}]}
        assert r.headers["x-hybridkv-pd-fallback"] == "prefill-unavailable"
        assert decode.bodies == [
            {
                "model": "m",
                "prompt": "hi",
                "max_tokens": 7,
                "request_id": decode.bodies[0]["request_id"],
            }
        ]  # the proxy's own id
        assert "hybridkv_proxy_decode_only_fallbacks_total 1" in client.get("/metrics").text
        assert "hybridkv_proxy_prefill_errors_total 1" in client.get("/metrics").text
    finally:
        decode.close()
        if prefill:
            prefill.close()


def test_a_dead_prefill_instance_is_skipped_for_the_next_one():
    """Two prefill instances, the first dead: the second serves (P/D hand-over, no fallback)."""
    from fastapi.testclient import TestClient

    from hybridkv.cli.proxy import build_app

    decode, prefill = _Instance(), _Instance(params=PARAMS)
    try:
        with TestClient(
            build_app([_dead_url(), prefill.url], [decode.url], timeout_s=5)
        ) as client:  # one event loop
            for _ in range(2):  # whichever the round-robin starts with
                r = client.post("/v1/completions", json=USER)
                assert r.status_code == 200 and "x-hybridkv-pd-fallback" not in r.headers
            assert [b["kv_transfer_params"] for b in decode.bodies] == [PARAMS, PARAMS]
            assert [b["max_tokens"] for b in prefill.bodies] == [1, 1]
            assert "hybridkv_proxy_decode_only_fallbacks_total 0" in client.get("/metrics").text
    finally:
        decode.close()
        prefill.close()


def test_a_request_the_prefill_refuses_as_malformed_is_not_retried_on_decode():
    """A 4xx from prefill is the client's error: answered as is, decode never sees it."""
    from fastapi.testclient import TestClient

    from hybridkv.cli.proxy import build_app

    decode, prefill = _Instance(), _Instance(status=400)
    try:
        client = TestClient(build_app([prefill.url], [decode.url], timeout_s=5))
        r = client.post("/v1/completions", json=USER)
        assert r.status_code == 400 and decode.bodies == []
        assert client.post("/v1/completions", json=[1, 2]).status_code == 400
    finally:
        decode.close()
        prefill.close()


def _metric(url: str, name: str) -> float:
    import httpx

    for line in httpx.get(url + "/metrics", timeout=5).text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise AssertionError(f"{name} not on {url}/metrics")


def _until(cond, timeout_s: float = 10.0) -> None:  # noqa: ANN001
    import time

    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.01)


@pytest.mark.parametrize("stream", [False, True])
def test_decode_only_requests_past_the_bound_are_answered_503_with_retry_after(stream):
    """Every prefill instance down, --max-decode-only 1: one decode-only request runs; the next
    is answered 503 at once with Retry-After and counted; once the first has finished (its
    stream too) a slot is free again. Real servers: the proxy and a decode instance busy until
    released (uvicorn). Planted (the bound not applied): the second request reaches decode."""
    import threading

    import httpx

    from hybridkv.cli.proxy import build_app

    gate = threading.Event()
    decode = _Instance(gate=gate)
    proxy = _Instance(
        app=build_app(
            [_dead_url()], [decode.url], timeout_s=10, max_decode_only=1, retry_after_s=2.5
        )
    )
    try:
        first: dict = {}

        def send_first() -> None:
            with httpx.Client(timeout=10) as c:
                r = c.post(proxy.url + "/v1/completions", json=USER | {"stream": stream})
                first.update(
                    status=r.status_code,
                    text=r.text,
                    fallback=r.headers.get("x-hybridkv-pd-fallback"),
                )

        t = threading.Thread(target=send_first)
        t.start()
        _until(lambda: len(decode.bodies) == 1)
        assert _metric(proxy.url, "hybridkv_proxy_decode_only_in_flight") == 1
        r = httpx.post(proxy.url + "/v1/completions", json=USER | {"stream": stream}, timeout=10)
        assert r.status_code == 503 and r.headers["retry-after"] == "3"
        assert (
            "already compute 1 requests alone (--max-decode-only)" in r.json()["error"]["message"]
        )
        assert len(decode.bodies) == 1  # the rejected one never reached decode
        assert _metric(proxy.url, "hybridkv_proxy_decode_only_rejected_total") == 1
        gate.set()
        t.join(timeout=10)
        assert first["status"] == 200 and first["fallback"] == "prefill-unavailable"
        assert (
            ("[DONE]" in first["text"])
            if stream
            else (first["text"] == '{"choices":[{"text":"ok"}]}')
        )
        _until(lambda: _metric(proxy.url, "hybridkv_proxy_decode_only_in_flight") == 0)
        r = httpx.post(proxy.url + "/v1/completions", json=USER | {"stream": stream}, timeout=10)
        assert r.status_code == 200 and len(decode.bodies) == 2
        assert _metric(proxy.url, "hybridkv_proxy_decode_only_fallbacks_total") == 2
        assert _metric(proxy.url, "hybridkv_proxy_decode_only_rejected_total") == 1
    finally:
        gate.set()
        proxy.close()
        decode.close()


def test_a_decode_only_request_past_the_bound_waits_for_a_slot():
    """--decode-only-wait-s: one past the bound waits, and is served when the running one ends
    (nothing rejected); a slot that does not come free in time is a 503."""
    import threading
    import time

    import httpx

    from hybridkv.cli.proxy import build_app

    gate = threading.Event()
    decode = _Instance(gate=gate)
    proxy = _Instance(
        app=build_app(
            [_dead_url()], [decode.url], timeout_s=10, max_decode_only=1, decode_only_wait_s=5.0
        )
    )
    try:
        answers: list[int] = []
        threads = [
            threading.Thread(
                target=lambda: answers.append(
                    httpx.post(proxy.url + "/v1/completions", json=USER, timeout=10).status_code
                )
            )
            for _ in range(2)
        ]
        threads[0].start()
        _until(lambda: len(decode.bodies) == 1)
        threads[1].start()
        time.sleep(0.5)
        assert len(decode.bodies) == 1  # the second waits in the proxy, not at decode
        gate.set()
        for t in threads:
            t.join(timeout=10)
        assert answers == [200, 200] and len(decode.bodies) == 2
        assert _metric(proxy.url, "hybridkv_proxy_decode_only_rejected_total") == 0
    finally:
        gate.set()
        proxy.close()
        decode.close()
    gate.clear()
    decode = _Instance(gate=gate)
    proxy = _Instance(
        app=build_app(
            [_dead_url()], [decode.url], timeout_s=10, max_decode_only=1, decode_only_wait_s=0.3
        )
    )
    try:
        t = threading.Thread(
            target=lambda: httpx.post(proxy.url + "/v1/completions", json=USER, timeout=10)
        )
        t.start()
        _until(lambda: len(decode.bodies) == 1)
        start = time.monotonic()
        r = httpx.post(proxy.url + "/v1/completions", json=USER, timeout=10)
        assert r.status_code == 503 and 0.3 <= time.monotonic() - start < 5
        assert _metric(proxy.url, "hybridkv_proxy_decode_only_rejected_total") == 1
    finally:
        gate.set()
        t.join(timeout=10)
        proxy.close()
        decode.close()


def test_requests_prefill_serves_are_not_bounded_by_the_decode_only_limit():
    """The bound is on decode-only requests alone: P/D hand-overs run past it."""
    import threading

    import httpx

    from hybridkv.cli.proxy import build_app

    gate = threading.Event()
    decode, prefill = _Instance(gate=gate), _Instance(params=PARAMS)
    proxy = _Instance(app=build_app([prefill.url], [decode.url], timeout_s=10, max_decode_only=1))
    try:
        answers: list[int] = []
        threads = [
            threading.Thread(
                target=lambda: answers.append(
                    httpx.post(proxy.url + "/v1/completions", json=USER, timeout=10).status_code
                )
            )
            for _ in range(3)
        ]
        for t in threads:
            t.start()
        _until(lambda: len(decode.bodies) == 3)
        gate.set()
        for t in threads:
            t.join(timeout=10)
        assert answers == [200, 200, 200]
        assert _metric(proxy.url, "hybridkv_proxy_decode_only_in_flight") == 0
        assert _metric(proxy.url, "hybridkv_proxy_decode_only_fallbacks_total") == 0
    finally:
        gate.set()
        proxy.close()
        decode.close()
        prefill.close()


class _HangUp:
    """A real TCP listener that reads a request and closes the connection without a byte of
    answer: a decode instance whose server drops the connection (dying, or closing an idle
    keep-alive connection the proxy reused at that moment)."""

    def __init__(self, hang_ups: int | None = None, answer: bytes = b"") -> None:
        """``hang_ups``: how many requests are dropped (None: all); later ones get ``answer``
        (raw HTTP/1.1 bytes) and the connection is closed."""
        import socket
        import threading

        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(8)
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.requests = 0
        self.hang_ups, self.answer = hang_ups, answer
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            with conn:
                if conn.recv(65536):
                    self.requests += 1
                    if self.hang_ups is not None and self.requests > self.hang_ups:
                        conn.sendall(self.answer)

    def close(self) -> None:
        self.sock.close()


@pytest.mark.parametrize("stream", [True, False])
def test_a_decode_instance_that_hangs_up_is_a_502_naming_it_not_a_truncated_answer(stream):
    """The P/D soak's 3 failed requests: streamed answers the client saw end early
    ("Response ended prematurely") because the proxy started its 200 before the decode
    instance had answered, and the decode connection then failed. Now the decode's status is
    awaited first: a 502 naming the decode instance. Planted (the stream opened inside the
    response, as before): the streamed case answers 200 with no body and fails here."""
    from fastapi.testclient import TestClient

    from hybridkv.cli.proxy import build_app

    prefill, decode = _Instance(params=PARAMS), _HangUp()
    try:
        client = TestClient(build_app([prefill.url], [decode.url], timeout_s=5))
        r = client.post("/v1/completions", json={**USER, "stream": stream})
        assert decode.requests == 2  # the leg and its one retry (test below), both dropped
        assert r.status_code == 502, (r.status_code, r.content[:200])
        assert f"decode instance {decode.url} unreachable" in r.json()["error"]["message"]
    finally:
        prefill.close()
        decode.close()


@pytest.mark.parametrize("stream", [True, False])
def test_a_decode_connection_dropped_before_the_answer_is_sent_once_more(stream):
    """A pooled connection can drop with a ReadError even when both instances keep idle
    connections 75 s, which would fail the request with the proxy's 502 "decode instance ...
    unreachable: ReadError". The decode leg is sent once more when its connection fails before
    any answer (a replayed hand-over is refused by decode and recomputed;
    tests/e2e/test_pd_hostile_client.py): the client gets the decode's answer, and the retry
    is counted. Without the retry: 502, fails."""
    import json as _json

    from fastapi.testclient import TestClient

    from hybridkv.cli.proxy import build_app

    body = (
        b'data: {"choices":[{"text":"ok"}]}\n\n'
        if stream
        else _json.dumps({"choices": [{"text": "ok"}]}).encode()
    )
    ctype = b"text/event-stream" if stream else b"application/json"
    answer = (
        b"HTTP/1.1 200 OK\r\ncontent-type: "
        + ctype
        + b"\r\ncontent-length: "
        + str(len(body)).encode()
        + b"\r\nconnection: close\r\n\r\n"
        + body
    )
    prefill, decode = _Instance(params=PARAMS), _HangUp(hang_ups=1, answer=answer)
    try:
        app = build_app([prefill.url], [decode.url], timeout_s=5)
        client = TestClient(app)
        r = client.post("/v1/completions", json={**USER, "stream": stream})
        assert r.status_code == 200
        assert (r.content == body) if stream else (r.json() == _json.loads(body))
        assert decode.requests == 2
        metrics = client.get("/metrics").text
        assert "hybridkv_proxy_decode_retries_total 1" in metrics, metrics
    finally:
        prefill.close()
        decode.close()


def test_idle_connections_expire_before_a_vllm_server_closes_them():
    """httpx keeps idle connections 5 s by default, exactly vLLM's keep-alive timeout, so a
    request could be written on a connection the server was closing (ReadError). The proxy
    expires them first."""
    import vllm.envs as envs

    from hybridkv.cli.proxy import KEEPALIVE_EXPIRY_S

    assert 0 < KEEPALIVE_EXPIRY_S < envs.VLLM_HTTP_TIMEOUT_KEEP_ALIVE


UVICORN_DEFAULT_KEEPALIVE_S = 5  # uvicorn's timeout_keep_alive default, and vLLM's


def stalled_proxy_answers(connections: int = 8, proxy_args: tuple[str, ...] = ()) -> list:
    """Each of ``connections`` keep-alive connections to a real ``hybridkv proxy`` process gets
    one answer; then the proxy is SIGSTOPped, each connection sends its next request, and the
    proxy resumes ``UVICORN_DEFAULT_KEEPALIVE_S`` + 1.5 s later. Returns each second request's
    status (or the exception's name)."""
    import http.client
    import json
    import os
    import signal
    import subprocess
    import sys
    import time

    from hybridkv.cli.server import free_port
    from hybridkv.store.embedded_master import _port_open

    prefill, decode = _Instance(params=PARAMS), _Instance()
    port = free_port()
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "hybridkv.cli.main",
            "proxy",
            "--prefill",
            prefill.url,
            "--decode",
            decode.url,
            "--port",
            str(port),
            *proxy_args,
        ],
        stdin=subprocess.DEVNULL,
        start_new_session=True,
    )
    body, headers = json.dumps(USER).encode(), {"content-type": "application/json"}
    conns = []
    try:
        _until(lambda: _port_open(port), timeout_s=60)
        conns = [
            http.client.HTTPConnection("127.0.0.1", port, timeout=30) for _ in range(connections)
        ]
        for c in conns:
            c.request("POST", "/v1/completions", body=body, headers=headers)
            first = c.getresponse()
            assert first.status == 200 and first.read()
        freeze(proc.pid)
        try:
            for c in conns:  # into the stopped proxy's socket buffers
                c.request("POST", "/v1/completions", body=body, headers=headers)
            time.sleep(UVICORN_DEFAULT_KEEPALIVE_S + 1.5)
        finally:
            os.kill(proc.pid, signal.SIGCONT)
        answers = []
        for c in conns:
            try:
                second = c.getresponse()
                second.read()
                answers.append(second.status)
            except (ConnectionError, http.client.HTTPException) as e:
                answers.append(type(e).__name__)
        return answers
    finally:
        for c in conns:
            c.close()
        proc.kill()
        proc.wait(timeout=10)
        prefill.close()
        decode.close()


def test_requests_sent_while_the_proxy_gets_no_cpu_past_uvicorns_keep_alive_are_answered():
    """The P/D soak's one failed client request ("Remote end closed connection without
    response", 5.96 s after it was sent): with uvicorn's 5 s keep-alive, a proxy process that
    gets no CPU for longer (here SIGSTOP, in the soak 2 busy engines on 2 cores) runs the expired
    keep-alive timer before it reads the request waiting in the socket, and closes that
    connection. The proxy keeps idle client connections 75 s (--timeout-keep-alive-s).
    Planted (``stalled_proxy_answers(proxy_args=("--timeout-keep-alive-s", "5"))``, by hand):
    some of the 8 connections are closed unanswered (ConnectionResetError / RemoteDisconnected)."""
    from hybridkv.cli.proxy import CLIENT_KEEPALIVE_S

    assert CLIENT_KEEPALIVE_S > UVICORN_DEFAULT_KEEPALIVE_S + 1.5
    assert stalled_proxy_answers() == [200] * 8


def test_the_keep_alive_option_refuses_what_is_not_a_whole_number_of_seconds():
    import argparse

    from hybridkv.cli.proxy import add_arguments

    p = argparse.ArgumentParser()
    add_arguments(p)
    base = ["--prefill", "http://127.0.0.1:1", "--decode", "http://127.0.0.1:2"]
    assert p.parse_args(base).timeout_keep_alive_s == 75
    assert p.parse_args([*base, "--timeout-keep-alive-s", "30"]).timeout_keep_alive_s == 30
    for bad in ("0", "-3", "1.5", "x"):
        with pytest.raises(SystemExit):
            p.parse_args([*base, "--timeout-keep-alive-s", bad])
