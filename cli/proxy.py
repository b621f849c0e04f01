"""``hybridkv proxy``: an OpenAI-compatible front door for prefill/decode disaggregation.

Each request goes first to a prefill instance with ``max_tokens=1`` and
``kv_transfer_params={"do_remote_decode": true}``; the prefill instance computes the
prompt's KV, keeps the blocks under a lease and answers with the parameters a decode
instance needs to pull them. The proxy then sends the original request to a decode
instance with those ``kv_transfer_params`` and streams (or returns) its answer.
Both the completions and chat endpoints are served; instances are used round-robin.
Binds 127.0.0.1 by default: this is an internal hop, not an edge service.

When no prefill instance can serve a request (every one unreachable, answering 5xx, or
answering without transfer parameters), the decode instance gets the user's request alone
and computes the prompt itself: a dead prefill costs TTFT, not the request (the answer is
the same; logged, marked with the ``x-hybridkv-pd-fallback`` response header and counted
on the proxy's ``/metrics``). ``--no-fallback`` answers 502 instead.

Decode-only requests cost the decode instance a whole prefill each, so while every prefill
instance is down they can saturate it (and the host: on the 2-core CI box they starved the
restarting prefill). ``--max-decode-only N`` bounds how many run at once: one past the bound
waits up to ``--decode-only-wait-s`` for a slot, then is answered 503 with ``Retry-After``
(``--retry-after-s``), counted as ``hybridkv_proxy_decode_only_rejected_total``; the running
ones are the gauge ``hybridkv_proxy_decode_only_in_flight``. Requests that prefill serves
are never bounded by it.
"""

# No `from __future__ import annotations`: FastAPI resolves the handlers' `request: Request`
# annotations at runtime, and Request is imported lazily inside build_app.
import argparse
import asyncio
import copy
import math
import itertools
import json
import logging
from collections.abc import AsyncIterator, Sequence
from typing import Any

logger = logging.getLogger("hybridkv.proxy")

PREFILL_PARAMS = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}


def prefill_request(body: dict[str, Any]) -> dict[str, Any]:
    """The prefill leg: one token, no streaming, and the remote-decode marker."""
    req = copy.deepcopy(body)
    req["kv_transfer_params"] = dict(PREFILL_PARAMS)
    req["max_tokens"] = 1
    # One prefill per prompt, whatever n the client asked for: the decode leg samples n.
    # (The decode side reads a lease once; its other children recompute.)
    req["n"] = 1
    req.pop("best_of", None)
    if "max_completion_tokens" in req:
        req["max_completion_tokens"] = 1
    req["stream"] = False
    req.pop("stream_options", None)
    req.pop("min_tokens", None)
    return req


def decode_request(body: dict[str, Any], prefill_response: dict[str, Any]) -> dict[str, Any]:
    """The decode leg: the user's request plus the prefill side's transfer parameters."""
    params = prefill_response.get("kv_transfer_params")
    if not params:
        raise ValueError(
            "the prefill instance returned no kv_transfer_params: is it running with a P/D "
            "connector (HybridPDConnector) and kv_role kv_producer or kv_both?"
        )
    req = copy.deepcopy(body)
    req["kv_transfer_params"] = params
    return req


def decode_only_request(body: dict[str, Any]) -> dict[str, Any]:
    """The fallback leg: the user's request for decode to compute alone. A client's own
    ``kv_transfer_params`` are dropped: only a prefill instance's answer may name a peer."""
    req = copy.deepcopy(body)
    req.pop("kv_transfer_params", None)
    return req


class _PrefillFailed(Exception):
    """No prefill instance served the request; ``response``: what to answer without fallback."""

    def __init__(self, response: Any) -> None:
        super().__init__()
        self.response = response


class DecodeOnlySlots:
    """At most ``limit`` decode-only requests at once (0: no bound); see the module docstring.

    ``acquire`` waits up to ``wait_s`` for a slot; the caller releases the slot it got through
    the returned callable, which may be called more than once (a streamed answer releases on
    its last chunk and again from the response's background task, whichever comes first:
    the stream may never start if the client goes away)."""

    def __init__(self, limit: int, wait_s: float) -> None:
        if limit < 0 or wait_s < 0:
            raise ValueError(f"max_decode_only={limit}, decode_only_wait_s={wait_s}: expected >= 0")
        self.limit, self.wait_s = limit, wait_s
        self.in_flight = 0
        self._sem = asyncio.Semaphore(limit) if limit else None

    async def acquire(self) -> Any:
        """A release callable, or None when no slot came free within ``wait_s``."""
        if self._sem is not None:
            if self.wait_s <= 0:
                if self._sem.locked():
                    return None
                await self._sem.acquire()
            else:
                try:
                    await asyncio.wait_for(self._sem.acquire(), self.wait_s)
                except asyncio.TimeoutError:
                    return None
        self.in_flight += 1
        done = False

        def release() -> None:
            nonlocal done
            if not done:
                done = True
                self.in_flight -= 1
                if self._sem is not None:
                    self._sem.release()

        return release


KEEPALIVE_EXPIRY_S = 2.0  # below the instances' keep-alive timeout (vLLM: 5 s); see build_app
# How long the proxy's own server keeps a client's idle connection. uvicorn's default (5 s, as
# vLLM's) lost a client request in the P/D soak ("Remote end closed connection without
# response" 5.96 s after it was sent): uvloop runs expired timers before it reads sockets, so
# when the proxy's process gets no CPU for longer than the keep-alive (2 busy engines on 2
# cores), the keep-alive timer armed by the previous answer closes a connection whose next
# request already sits unread in its socket. A client cannot tell that from a server that died
# mid-request, so it must not retry a POST on it. 75 s (nginx's default) outlasts such stalls
# and the 60 s idle timeout of common load balancers, which must close first: an idle
# connection costs the proxy one socket (tests/unit/test_proxy.py).
CLIENT_KEEPALIVE_S = 75


def build_app(prefill_urls: Sequence[str], decode_urls: Sequence[str], timeout_s: float = 600.0,
              fallback: bool = True, max_decode_only: int = 0, decode_only_wait_s: float = 0.0,
              retry_after_s: float = 1.0):
    """A FastAPI app routing every request prefill -> decode (decode alone when no prefill
    instance can serve it and ``fallback`` is on; at most ``max_decode_only`` of those at once,
    0: no bound)."""
    import httpx
    from fastapi import FastAPI, Request
    from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
    from starlette.background import BackgroundTask

    app = FastAPI(title="hybridkv P/D proxy")
    prefill_list = [u.rstrip("/") for u in prefill_urls]
    prefill_start = itertools.cycle(range(len(prefill_list)))
    decodes = itertools.cycle([u.rstrip("/") for u in decode_urls])
    # Idle connections are dropped before the instances' servers drop them (vLLM's uvicorn:
    # VLLM_HTTP_TIMEOUT_KEEP_ALIVE, 5 s; httpx's default expiry is the same 5 s): a request
    # sent on a connection the server is closing at that moment fails with a ReadError
    # (P/D soak: 3 streamed answers cut at the prefill kill, all on reused decode connections).
    client = httpx.AsyncClient(timeout=httpx.Timeout(timeout_s),
                               limits=httpx.Limits(keepalive_expiry=KEEPALIVE_EXPIRY_S))
    counts = {"requests": 0, "decode_only_fallbacks": 0, "prefill_errors": 0, "decode_only_rejected": 0,
              "decode_retries": 0}
    # The decode leg is sent once more when the decode instance's connection fails before any
    # answer (read/write error, or the server closed it): the P/D soak of 2026-12-03 lost 2 of
    # 2882 requests to such a ReadError with both instances at a 75 s keep-alive. Safe to
    # repeat: a hand-over already read is refused as a replay and decode recomputes (same
    # greedy answer), and vLLM aborts a request whose client went away. A refused connection
    # (decode down) is not retried; a stream that has started is never re-sent.
    retry_errors = (httpx.ReadError, httpx.WriteError, httpx.RemoteProtocolError)

    async def send_decode(url: str, dreq: dict[str, Any], stream: bool) -> "httpx.Response":
        try:
            return await client.send(client.build_request("POST", url, json=dreq), stream=stream)
        except retry_errors as e:
            counts["decode_retries"] += 1
            logger.warning("hybridkv proxy: decode %s dropped the connection before answering (%s: %s); "
                           "sending the request once more", url, type(e).__name__, e)
            return await client.send(client.build_request("POST", url, json=dreq), stream=stream)
    slots = DecodeOnlySlots(max_decode_only, decode_only_wait_s)

    async def prefill_leg(path: str, body: dict[str, Any]) -> dict[str, Any]:
        """The decode leg's request from the first prefill instance that serves it (each
        tried once, round-robin start); raises _PrefillFailed with the last error."""
        first = next(prefill_start)
        failure = None
        for k in range(len(prefill_list)):
            prefill = prefill_list[(first + k) % len(prefill_list)]
            try:
                r = await client.post(prefill + path, json=prefill_request(body))
            except httpx.HTTPError as e:
                failure = _unreachable("prefill", prefill, e)
            else:
                if r.status_code == 200:
                    try:
                        return decode_request(body, r.json())
                    except ValueError as e:  # answered, but handed nothing over
                        failure = JSONResponse(status_code=502, content={"error": {"message": f"prefill {prefill}: {e}"}})
                elif r.status_code < 500:  # the request itself is wrong: decode would refuse it too
                    raise _PrefillFailed(JSONResponse(status_code=r.status_code, content=_error(r, f"prefill {prefill}")))
                else:
                    failure = JSONResponse(status_code=r.status_code, content=_error(r, f"prefill {prefill}"))
            counts["prefill_errors"] += 1
            logger.warning("hybridkv proxy: prefill %s could not serve a request: %s", prefill,
                           bytes(failure.body)[:300].decode(errors="replace"))
        raise _PrefillFailed(failure)

    async def route(path: str, request: Request):
        try:
            body = await request.json()
        except json.JSONDecodeError as e:
            return JSONResponse(status_code=400, content={"error": {"message": f"request body is not JSON: {e}"}})
        if not isinstance(body, dict):
            return JSONResponse(status_code=400, content={"error": {"message": "request body must be a JSON object"}})
        counts["requests"] += 1
        decode = next(decodes)
        headers = {}
        release = None
        try:
            dreq = await prefill_leg(path, body)
        except _PrefillFailed as failed:
            if not fallback or failed.response.status_code < 500:
                return failed.response
            release = await slots.acquire()
            if release is None:
                counts["decode_only_rejected"] += 1
                logger.warning("hybridkv proxy: no prefill instance served the request and %d decode-only requests "
                               "are running (--max-decode-only); answered 503", slots.limit)
                return JSONResponse(
                    status_code=503, headers={"Retry-After": str(max(1, math.ceil(retry_after_s)))},
                    content={"error": {"message": f"no prefill instance can serve the request and the decode "
                                                  f"instances already compute {slots.limit} requests alone "
                                                  f"(--max-decode-only); retry later",
                                       "detail": json.loads(bytes(failed.response.body) or b"{}")}})
            counts["decode_only_fallbacks"] += 1
            dreq, headers = decode_only_request(body), {"x-hybridkv-pd-fallback": "prefill-unavailable"}
            logger.warning("hybridkv proxy: no prefill instance served the request; decode %s computes the "
                           "prompt itself (--no-fallback answers 502 instead)", decode)
        if not body.get("stream"):
            try:
                d = await send_decode(decode + path, dreq, stream=False)
            except httpx.HTTPError as e:
                return _unreachable("decode", decode, e)
            finally:
                if release is not None:
                    release()
            return JSONResponse(status_code=d.status_code, content=d.json() if d.content else {}, headers=headers)

        # The decode answer's status and headers are awaited before the client's response
        # starts: a decode instance that fails before answering is a 502 naming it, not a
        # 200 whose stream ends early (which clients see as a truncated answer).
        try:
            d = await send_decode(decode + path, dreq, stream=True)
        except httpx.HTTPError as e:
            if release is not None:
                release()
            return _unreachable("decode", decode, e)

        async def done() -> None:
            """Release the decode-only slot and the decode connection, once the stream ends
            or, when it never starts (the client went away first), from the background task."""
            if release is not None:
                release()
            await d.aclose()

        async def relay() -> AsyncIterator[bytes]:
            try:
                async for chunk in d.aiter_bytes():
                    yield chunk
            finally:
                await done()

        return StreamingResponse(relay(), status_code=d.status_code,
                                 media_type=d.headers.get("content-type", "text/event-stream"),
                                 headers=headers, background=BackgroundTask(done))

    @app.get("/metrics")
    async def metrics():
        help_text = {"requests": "Requests the proxy routed",
                     "decode_only_fallbacks": "Requests decode computed alone: no prefill instance served them",
                     "prefill_errors": "Prefill instance attempts that failed (unreachable, 5xx, no transfer parameters)",
                     "decode_only_rejected": "Requests answered 503: no prefill instance served them and "
                                             "--max-decode-only decode-only requests were running",
                     "decode_retries": "Decode legs sent once more: the decode instance's connection failed "
                                       "before it answered"}
        lines = []
        for name, value in counts.items():
            lines += [f"# HELP hybridkv_proxy_{name}_total {help_text[name]}",
                      f"# TYPE hybridkv_proxy_{name}_total counter", f"hybridkv_proxy_{name}_total {value}"]
        lines += ["# HELP hybridkv_proxy_decode_only_in_flight Decode-only requests running now",
                  "# TYPE hybridkv_proxy_decode_only_in_flight gauge",
                  f"hybridkv_proxy_decode_only_in_flight {slots.in_flight}"]
        return PlainTextResponse("\n".join(lines) + "\n")

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await route("/v1/completions", request)

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        return await route("/v1/chat/completions", request)

    @app.get("/health")
    async def health():
        bad = []
        for url in list(prefill_urls) + list(decode_urls):
            try:
                if (await client.get(url.rstrip("/") + "/health")).status_code != 200:
                    bad.append(url)
            except httpx.HTTPError:
                bad.append(url)
        return JSONResponse(status_code=503 if bad else 200, content={"unhealthy": bad})

    return app


def _unreachable(role: str, url: str, e: Exception) -> Any:
    from fastapi.responses import JSONResponse

    return JSONResponse(status_code=502, content={"error": {
        "message": f"{role} instance {url} unreachable: {type(e).__name__}: {e}; check that it is running "
                   f"and that --{role} points at it"}})


def _error(r: Any, who: str) -> dict[str, Any]:
    try:
        detail = r.json()
    except (json.JSONDecodeError, ValueError):
        detail = r.text
    return {"error": {"message": f"{who} answered {r.status_code}", "detail": detail}}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="hybridkv proxy", description=__doc__.splitlines()[0])
    add_arguments(p)
    return run_from_args(p.parse_args(argv))


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--prefill", action="append", required=True, help="prefill instance URL (repeatable)")
    p.add_argument("--decode", action="append", required=True, help="decode instance URL (repeatable)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--timeout-s", type=float, default=600.0)
    p.add_argument("--timeout-keep-alive-s", type=_positive_int, default=CLIENT_KEEPALIVE_S, metavar="S",
                   help=f"close a client's idle connection after S seconds (default {CLIENT_KEEPALIVE_S}; keep it "
                        "above a load balancer's idle timeout and above any stall of the proxy's process)")
    p.add_argument("--no-fallback", dest="fallback", action="store_false",
                   help="answer 502 when no prefill instance serves a request (default: decode computes it alone)")
    p.add_argument("--max-decode-only", type=int, default=0, metavar="N",
                   help="at most N decode-only requests at once (0, the default: no bound); one past it waits "
                        "--decode-only-wait-s, then is answered 503 with Retry-After")
    p.add_argument("--decode-only-wait-s", type=float, default=0.0,
                   help="how long a decode-only request waits for a slot under --max-decode-only (default 0)")
    p.add_argument("--retry-after-s", type=float, default=1.0,
                   help="the Retry-After of those 503 answers (whole seconds, at least 1)")


def run_from_args(args: argparse.Namespace) -> int:
    import uvicorn

    app = build_app(args.prefill, args.decode, args.timeout_s, args.fallback, max_decode_only=args.max_decode_only,
                    decode_only_wait_s=args.decode_only_wait_s, retry_after_s=args.retry_after_s)
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning",
                timeout_keep_alive=args.timeout_keep_alive_s)
    return 0


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: a whole number of seconds, at least 1")
    return value


if __name__ == "__main__":
    raise SystemExit(main())
