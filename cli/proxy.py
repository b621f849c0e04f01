"""``hybridkv proxy``: an OpenAI-compatible front door for prefill/decode disaggregation.

Each request goes first to a prefill instance with ``max_tokens=1`` and
``kv_transfer_params={"do_remote_decode": true}``; the prefill instance computes the
prompt's KV, keeps the blocks under a lease and answers with the parameters a decode
instance needs to pull them. The proxy then sends the original request to a decode
instance with those ``kv_transfer_params`` and streams (or returns) its answer.
Both the completions and chat endpoints are served; instances are used round-robin.
Binds 127.0.0.1 by default: this is an internal hop, not an edge service.

One hand-over carries one prompt and one sample: a batch of prompts and ``n`` > 1 are split
into one hand-over each and their answers merged as vLLM answers them (cli/proxy_batch.py),
because vLLM hands over only the first prompt of a batch while it keeps a lease on every
prompt. A streamed batch is refused (400); a streamed ``n`` > 1 is one hand-over whose decode
children share the lease. The proxy names every request it sends (``request_id``): a client's
id never becomes the hand-over's id.

Requests that cannot use a hand-over go to decode alone, marked with the
``x-hybridkv-pd-decode-only`` header naming the field: ``prompt_logprobs`` and ``echo`` with
``logprobs`` (vLLM reads no cached or transferred KV for a request that wants its prompt's
logprobs: decode computes the prompt and those logprobs in one pass, and a prefill leg would
only leave its lease unread) and ``use_beam_search`` (vLLM's serving layer runs one engine
request per beam and step, each served by decode's own prefix cache).

When no prefill instance can serve a request (every one unreachable, silent past the prefill
read timeout, answering 5xx or anything but a completion with transfer parameters), the
decode instance gets the user's request alone and computes the prompt itself: a dead prefill
costs TTFT, not the request (the answer is the same; logged, marked with the
``x-hybridkv-pd-fallback`` response header and counted on the proxy's ``/metrics``).
``--no-fallback`` answers 502 naming the cause instead.

A client's ``X-data-parallel-rank`` header (vLLM's: which DP rank of a ``--data-parallel-size``
instance serves the request) goes with the decode leg, so a router that keeps a conversation on
one decode DP rank, where its earlier turns sit in that rank's prefix cache, can do so through
the proxy; the prefill leg does not carry it (it names a decode rank). Without it vLLM picks the
least loaded rank.

Decode-only fallbacks cost the decode instance a whole prefill each, so while every prefill
instance is down they can saturate it (and the host: on the 2-core CI box they starved the
restarting prefill). ``--max-decode-only N`` (default 8) bounds how many run at once: one past
the bound waits up to ``--decode-only-wait-s`` (default 30) for a slot, then is answered 503 with
``Retry-After`` (``--retry-after-s``), counted as ``hybridkv_proxy_decode_only_rejected_total``;
the running ones are the gauge ``hybridkv_proxy_decode_only_in_flight``. Requests that prefill
serves are never bounded by it.

Every other resource is bounded too (:class:`ProxyLimits`, one option each): the request body
(413 past it), requests in flight (503 with ``Retry-After`` past it), hand-overs per request
(400), connections to the instances, and the connect, read, write and pool timeouts of each
leg (the prefill leg's read timeout is its own, shorter one: a silent prefill instance costs
that long before the fallback, not the decode's).
"""

# No `from __future__ import annotations`: FastAPI resolves the handlers' `request: Request`
# annotations at runtime, and Request is imported lazily inside build_app.
import argparse
import asyncio
import copy
import itertools
import json
import math
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, fields
from typing import Any

from hybridkv.cli.proxy_batch import (
    MalformedAnswer,
    batch_prompts,
    merge_answers,
    samples,
    split_request,
)
from hybridkv.store.logs import get_logger

logger = get_logger(__name__, "proxy")

PREFILL_PARAMS = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}
# What the prefill leg does not need: output logprobs and echo are the decode leg's work (the
# requests that need the PROMPT's logprobs never take a prefill leg: decode_only_reason).
PREFILL_DROPS = (
    "best_of",
    "stream_options",
    "min_tokens",
    "echo",
    "logprobs",
    "top_logprobs",
    "prompt_logprobs",
)


@dataclass(frozen=True)
class ProxyLimits:
    """What one proxy may take and wait for; each field is the option of the same name."""

    max_body_bytes: int = 16 * 2**20
    """A request body past this many bytes is answered 413 before any leg."""
    max_concurrent: int = 256
    """Client requests in flight (streams until their end); one past it is answered 503."""
    max_connections: int = 256
    """Connections to all instances together (httpx's pool)."""
    max_hand_overs: int = 32
    """Hand-overs one request may split into (prompts x n); more is answered 400."""
    connect_timeout_s: float = 5.0
    """Seconds to open a connection to an instance (both legs)."""
    prefill_read_timeout_s: float = 120.0
    """Seconds the prefill leg waits for its answer before the fallback."""
    read_timeout_s: float = 600.0
    """Seconds the decode leg waits for its answer, or between two chunks of a stream."""
    write_timeout_s: float = 30.0
    """Seconds to send a request to an instance (both legs)."""
    pool_timeout_s: float = 30.0
    """Seconds a leg waits for a free connection under max_connections."""

    def __post_init__(self) -> None:
        bad = [
            f"{f.name}={getattr(self, f.name)!r}"
            for f in fields(self)
            if not getattr(self, f.name) > 0
        ]
        if bad:
            raise ValueError(f"proxy limits must be > 0: {', '.join(bad)}")


def _field_doc(name: str) -> str:
    """The docstring under ``name`` in :class:`ProxyLimits` (its --help text)."""
    import inspect

    lines = inspect.getsource(ProxyLimits).splitlines()
    for k, line in enumerate(lines):
        if line.strip().startswith(f"{name}:"):
            return lines[k + 1].strip().strip('"')
    return ""


DP_RANK_HEADER = "X-data-parallel-rank"


def decode_headers(client_headers: Any) -> dict[str, str]:
    """The client's headers the decode leg carries: ``X-data-parallel-rank`` when it is a
    non-negative integer (vLLM ignores any other value; it answers 400 past its DP size)."""
    rank = client_headers.get(DP_RANK_HEADER)
    if rank is None or not (rank.isascii() and rank.isdigit() and len(rank) <= 6):
        return {}
    return {DP_RANK_HEADER: rank}


def new_request_id() -> str:
    """An id the proxy owns, for both legs of one hand-over (vLLM prefixes and suffixes it)."""
    return f"hkv-{uuid.uuid4().hex}"


def prefill_request(body: dict[str, Any]) -> dict[str, Any]:
    """The prefill leg: one token, no streaming, and the remote-decode marker."""
    req = copy.deepcopy(body)
    req["kv_transfer_params"] = dict(PREFILL_PARAMS)
    req["max_tokens"] = 1
    # One prefill per prompt, whatever n the client asked for: the decode leg samples n.
    # (The decode side reads a lease once; its other children recompute.)
    req["n"] = 1
    if "max_completion_tokens" in req:
        req["max_completion_tokens"] = 1
    req["stream"] = False
    for name in PREFILL_DROPS:
        req.pop(name, None)
    return req


def decode_request(body: dict[str, Any], prefill_response: Any) -> dict[str, Any]:
    """The decode leg: the user's request plus the prefill side's transfer parameters."""
    if not isinstance(prefill_response, dict):
        raise ValueError(
            f"answered a JSON {type(prefill_response).__name__} where an object with "
            "kv_transfer_params was expected"
        )
    params = prefill_response.get("kv_transfer_params")
    if not params or not isinstance(params, dict):
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


def decode_only_reason(path: str, body: dict[str, Any]) -> str | None:
    """The field that makes a hand-over useless for this request (see the module docstring)."""
    if body.get("prompt_logprobs") is not None:
        return "prompt_logprobs"
    if path == "/v1/completions" and body.get("echo") and body.get("logprobs") is not None:
        return "echo"
    if body.get("use_beam_search"):
        return "use_beam_search"
    return None


class _PrefillFailed(Exception):
    """No prefill instance served the request; ``response``: what to answer without fallback."""

    def __init__(self, response: Any) -> None:
        super().__init__()
        self.response = response


class DecodeOnlySlots:
    """At most ``limit`` holders at once (0: no bound): decode-only requests, or requests in
    flight; see the module docstring.

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

    async def acquire(self) -> Callable[[], None] | None:
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
DEFAULT_MAX_DECODE_ONLY = 8
# One past the bound waits this long for a slot (the command's default; build_app's is 0): while
# every prefill instance is down, more clients than the bound queue for TTFT instead of failing.
DEFAULT_DECODE_ONLY_WAIT_S = 30.0

COUNTER_HELP = {
    "requests": "Requests the proxy routed",
    "hand_overs": "Prefill -> decode hand-overs attempted (one per prompt and sample of a request)",
    "decode_only_fallbacks": "Hand-overs decode computed alone: no prefill instance served them",
    "decode_only_by_request": "Requests sent to decode alone because they cannot use a hand-over "
    "(prompt_logprobs, echo with logprobs, use_beam_search)",
    "prefill_errors": "Prefill instance attempts that failed (unreachable, timed out, 5xx, malformed answer, "
    "no transfer parameters)",
    "decode_only_rejected": "Requests answered 503: no prefill instance served them and "
    "--max-decode-only decode-only requests were running",
    "rejected_busy": "Requests answered 503: --max-concurrent requests were in flight",
    "decode_retries": "Decode legs sent once more: the decode instance's connection failed before it answered",
}


def _error_response(
    status: int, message: str, headers: dict[str, str] | None = None, **extra: Any
) -> Any:
    from fastapi.responses import JSONResponse

    return JSONResponse(
        status_code=status, headers=headers, content={"error": {"message": message, **extra}}
    )


def build_app(
    prefill_urls: Sequence[str],
    decode_urls: Sequence[str],
    timeout_s: float | None = None,
    fallback: bool = True,
    max_decode_only: int = DEFAULT_MAX_DECODE_ONLY,
    decode_only_wait_s: float = 0.0,
    retry_after_s: float = 1.0,
    **limits: Any,
):
    """A FastAPI app routing every request prefill -> decode (decode alone when no prefill
    instance can serve it and ``fallback`` is on; at most ``max_decode_only`` of those at once,
    0: no bound). ``limits``: :class:`ProxyLimits` fields; ``timeout_s`` sets both legs' read
    timeouts."""
    import httpx
    from fastapi import FastAPI, Request
    from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
    from starlette.background import BackgroundTask

    if timeout_s is not None:
        limits = {"read_timeout_s": timeout_s, "prefill_read_timeout_s": timeout_s} | limits
    lim = ProxyLimits(**limits)
    app = FastAPI(title="hybridkv P/D proxy")
    prefill_list = [u.rstrip("/") for u in prefill_urls]
    prefill_start = itertools.cycle(range(len(prefill_list)))
    decodes = itertools.cycle([u.rstrip("/") for u in decode_urls])
    prefill_timeout = httpx.Timeout(
        connect=lim.connect_timeout_s,
        read=lim.prefill_read_timeout_s,
        write=lim.write_timeout_s,
        pool=lim.pool_timeout_s,
    )
    decode_timeout = httpx.Timeout(
        connect=lim.connect_timeout_s,
        read=lim.read_timeout_s,
        write=lim.write_timeout_s,
        pool=lim.pool_timeout_s,
    )
    # Idle connections are dropped before the instances' servers drop them (vLLM's uvicorn:
    # VLLM_HTTP_TIMEOUT_KEEP_ALIVE, 5 s; httpx's default expiry is the same 5 s): a request
    # sent on a connection the server is closing at that moment fails with a ReadError
    # (P/D soak: 3 streamed answers cut at the prefill kill, all on reused decode connections).
    client = httpx.AsyncClient(
        timeout=decode_timeout,
        limits=httpx.Limits(
            max_connections=lim.max_connections,
            max_keepalive_connections=lim.max_connections,
            keepalive_expiry=KEEPALIVE_EXPIRY_S,
        ),
    )
    counts = dict.fromkeys(COUNTER_HELP, 0)
    # The decode leg is sent once more when the decode instance's connection fails before any
    # answer (read/write error, or the server closed it): the P/D soak of 2026-12-03 lost 2 of
    # 2882 requests to such a ReadError with both instances at a 75 s keep-alive. Safe to
    # repeat: a hand-over already read is refused as a replay and decode recomputes (same
    # greedy answer), and vLLM aborts a request whose client went away. A refused connection
    # (decode down) is not retried; a stream that has started is never re-sent.
    retry_errors = (httpx.ReadError, httpx.WriteError, httpx.RemoteProtocolError)
    slots = DecodeOnlySlots(max_decode_only, decode_only_wait_s)
    in_flight = DecodeOnlySlots(lim.max_concurrent, 0.0)
    retry_after = {"Retry-After": str(max(1, math.ceil(retry_after_s)))}

    def unreachable(role: str, url: str, e: Exception) -> Any:
        if isinstance(e, httpx.PoolTimeout):
            e = type(e)(
                f"no free connection within --pool-timeout-s {lim.pool_timeout_s:g} "
                f"(--max-connections {lim.max_connections} in use)"
            )
        return _unreachable(role, url, e)

    async def send_decode(
        url: str, dreq: dict[str, Any], stream: bool, pin: dict[str, str]
    ) -> "httpx.Response":
        """``pin``: :func:`decode_headers` of the client's request."""
        try:
            return await client.send(
                client.build_request("POST", url, json=dreq, headers=pin, timeout=decode_timeout),
                stream=stream,
            )
        except retry_errors as e:
            counts["decode_retries"] += 1
            logger.warning(
                "decode %s dropped the connection before answering (%s: %s); "
                "sending the request once more",
                url,
                type(e).__name__,
                e,
            )
            return await client.send(
                client.build_request("POST", url, json=dreq, headers=pin, timeout=decode_timeout),
                stream=stream,
            )

    async def prefill_leg(path: str, body: dict[str, Any]) -> dict[str, Any]:
        """The decode leg's request from the first prefill instance that serves it (each
        tried once, round-robin start); raises _PrefillFailed with the last error."""
        first = next(prefill_start)
        failure = None
        for k in range(len(prefill_list)):
            prefill = prefill_list[(first + k) % len(prefill_list)]
            try:
                r = await client.post(
                    prefill + path, json=prefill_request(body), timeout=prefill_timeout
                )
            except httpx.HTTPError as e:
                failure = unreachable("prefill", prefill, e)
            else:
                if r.status_code == 200:
                    try:
                        return decode_request(body, r.json())
                    except ValueError as e:  # not JSON, or answered but handed nothing over
                        why = (
                            f"answered 200 with a body that is not JSON: {r.text[:200]!r}"
                            if isinstance(e, json.JSONDecodeError)
                            else str(e)
                        )
                        failure = _error_response(502, f"prefill {prefill}: {why}")
                elif r.status_code < 500:  # the request itself is wrong: decode would refuse it too
                    raise _PrefillFailed(
                        JSONResponse(
                            status_code=r.status_code, content=_error(r, f"prefill {prefill}")
                        )
                    )
                else:
                    failure = JSONResponse(status_code=502, content=_error(r, f"prefill {prefill}"))
            counts["prefill_errors"] += 1
            logger.warning(
                "prefill %s could not serve a request: %s",
                prefill,
                bytes(failure.body)[:300].decode(errors="replace"),
            )
        raise _PrefillFailed(failure)

    async def hand_over(path: str, leg: dict[str, Any]) -> Any:
        """(decode request, response headers, release or None) for one leg, or the response
        that answers it when neither a hand-over nor the fallback can serve it."""
        leg = {**leg, "request_id": new_request_id()}
        counts["hand_overs"] += 1
        try:
            return await prefill_leg(path, leg), {}, None
        except _PrefillFailed as failed:
            if not fallback or failed.response.status_code < 500:
                return failed.response
            release = await slots.acquire()
            if release is None:
                counts["decode_only_rejected"] += 1
                logger.warning(
                    "no prefill instance served the request and %d decode-only requests "
                    "are running (--max-decode-only); answered 503",
                    slots.limit,
                )
                return _error_response(
                    503,
                    f"no prefill instance can serve the request and the decode instances already compute "
                    f"{slots.limit} requests alone (--max-decode-only); retry later",
                    headers=retry_after,
                    detail=json.loads(bytes(failed.response.body) or b"{}"),
                )
            counts["decode_only_fallbacks"] += 1
            logger.warning(
                "no prefill instance served the request; decode computes the "
                "prompt itself (--no-fallback answers 502 instead)"
            )
            return (
                decode_only_request(leg),
                {"x-hybridkv-pd-fallback": "prefill-unavailable"},
                release,
            )

    async def whole_answer(path: str, leg: Any, pin: dict[str, str]) -> Any:
        """(decode URL, status, JSON answer, headers) of one non-streamed leg, or its error response."""
        if not isinstance(leg, tuple):
            leg = await hand_over(path, leg)
            if not isinstance(leg, tuple):
                return leg
        dreq, headers, release = leg
        decode = next(decodes)
        try:
            d = await send_decode(decode + path, dreq, False, pin)
        except httpx.HTTPError as e:
            return unreachable("decode", decode, e)
        finally:
            if release is not None:
                release()
        if not d.content:
            return decode, d.status_code, {}, headers
        try:
            return decode, d.status_code, d.json(), headers
        except ValueError:
            return _error_response(
                502,
                f"decode instance {decode} answered {d.status_code} with a body that is "
                f"not JSON: {d.text[:200]!r}",
            )

    async def answer_whole(
        path: str, body: dict[str, Any], direct: tuple | None, pin: dict[str, str]
    ) -> Any:
        legs = [direct] if direct is not None else split_request(path, body)
        if len(legs) > lim.max_hand_overs:
            prompts = batch_prompts(path, body)
            return _error_response(
                400,
                f"{len(prompts) if prompts else 1} prompt(s) x n={samples(body)} is {len(legs)} P/D hand-overs, "
                f"more than --max-hand-overs {lim.max_hand_overs} per request: send fewer prompts or "
                f"samples per request",
            )
        results = await asyncio.gather(*(whole_answer(path, leg, pin) for leg in legs))
        for res in results:
            if not isinstance(res, tuple):
                return res
            if res[1] != 200:
                return JSONResponse(status_code=res[1], content=res[2], headers=res[3])
        headers: dict[str, str] = {}
        for res in results:
            headers |= res[3]
        if len(results) == 1:
            return JSONResponse(status_code=200, content=results[0][2], headers=headers)
        try:
            merged = merge_answers(
                [res[2] for res in results],
                samples(body),
                [f"decode instance {res[0]}" for res in results],
            )
        except MalformedAnswer as e:
            return _error_response(502, str(e))
        return JSONResponse(status_code=200, content=merged, headers=headers)

    async def answer_stream(
        path: str,
        body: dict[str, Any],
        direct: tuple | None,
        leave: Callable[[], None],
        pin: dict[str, str],
    ) -> Any:
        prompts = batch_prompts(path, body)
        if direct is None and prompts is not None and len(prompts) > 1:
            return _error_response(
                400,
                f"prompt: a batch of {len(prompts)} prompts cannot be streamed through the P/D proxy (each "
                f"prompt is its own hand-over); send one prompt per request, or stream: false",
            )
        leg = direct if direct is not None else await hand_over(path, body)
        if not isinstance(leg, tuple):
            return leg
        dreq, headers, release = leg
        decode = next(decodes)
        # The decode answer's status and headers are awaited before the client's response
        # starts: a decode instance that fails before answering is a 502 naming it, not a
        # 200 whose stream ends early (which clients see as a truncated answer).
        try:
            d = await send_decode(decode + path, dreq, True, pin)
        except httpx.HTTPError as e:
            if release is not None:
                release()
            return unreachable("decode", decode, e)

        async def done() -> None:
            """Release the slots and the decode connection, once the stream ends or, when it
            never starts (the client went away first), from the background task."""
            if release is not None:
                release()
            leave()
            await d.aclose()

        async def relay() -> AsyncIterator[bytes]:
            try:
                async for chunk in d.aiter_bytes():
                    yield chunk
            finally:
                await done()

        return StreamingResponse(
            relay(),
            status_code=d.status_code,
            media_type=d.headers.get("content-type", "text/event-stream"),
            headers=headers,
            background=BackgroundTask(done),
        )

    async def read_body(request: Request) -> Any:
        """The request's JSON object, or the 4xx response that answers it."""
        too_large = _error_response(
            413, f"request body larger than --max-body-bytes {lim.max_body_bytes}"
        )
        length = request.headers.get("content-length", "")
        if length.isdigit() and int(length) > lim.max_body_bytes:
            return too_large
        data = bytearray()
        async for chunk in request.stream():
            data += chunk
            if len(data) > lim.max_body_bytes:
                return too_large
        try:
            body = json.loads(bytes(data))
        except ValueError as e:
            return _error_response(400, f"request body is not JSON: {e}")
        if not isinstance(body, dict):
            return _error_response(400, "request body must be a JSON object")
        return body

    async def route(path: str, request: Request):
        leave = await in_flight.acquire()
        if leave is None:
            counts["rejected_busy"] += 1
            return _error_response(
                503,
                f"--max-concurrent {lim.max_concurrent} requests are in flight; retry later",
                headers=retry_after,
            )
        streaming = False
        try:
            body = await read_body(request)
            if not isinstance(body, dict):
                return body
            counts["requests"] += 1
            direct = None
            reason = decode_only_reason(path, body)
            if reason is not None:
                counts["decode_only_by_request"] += 1
                dreq = decode_only_request(body) | {"request_id": new_request_id()}
                direct = (dreq, {"x-hybridkv-pd-decode-only": reason}, None)
            pin = decode_headers(request.headers)
            if not body.get("stream"):
                return await answer_whole(path, body, direct, pin)
            response = await answer_stream(path, body, direct, leave, pin)
            streaming = isinstance(response, StreamingResponse)
            return response
        finally:
            if not streaming:
                leave()

    @app.get("/metrics")
    async def metrics():
        lines = []
        for name, value in counts.items():
            lines += [
                f"# HELP hybridkv_proxy_{name}_total {COUNTER_HELP[name]}",
                f"# TYPE hybridkv_proxy_{name}_total counter",
                f"hybridkv_proxy_{name}_total {value}",
            ]
        lines += [
            "# HELP hybridkv_proxy_decode_only_in_flight Decode-only requests running now",
            "# TYPE hybridkv_proxy_decode_only_in_flight gauge",
            f"hybridkv_proxy_decode_only_in_flight {slots.in_flight}",
            "# HELP hybridkv_proxy_in_flight Client requests in flight now (streams until their end)",
            "# TYPE hybridkv_proxy_in_flight gauge",
            f"hybridkv_proxy_in_flight {in_flight.in_flight}",
        ]
        return PlainTextResponse("\n".join(lines) + "\n")

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await route("/v1/completions", request)

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        return await route("/v1/chat/completions", request)

    health_timeout = httpx.Timeout(5.0, connect=lim.connect_timeout_s)

    @app.get("/health")
    async def health():
        bad = []
        for url in list(prefill_urls) + list(decode_urls):
            try:
                if (
                    await client.get(url.rstrip("/") + "/health", timeout=health_timeout)
                ).status_code != 200:
                    bad.append(url)
            except httpx.HTTPError:
                bad.append(url)
        return JSONResponse(status_code=503 if bad else 200, content={"unhealthy": bad})

    return app


def _unreachable(role: str, url: str, e: Exception) -> Any:
    return _error_response(
        502,
        f"{role} instance {url} unreachable: {type(e).__name__}: {e}; check that it is "
        f"running and that --{role} points at it",
    )


def _error(r: Any, who: str) -> dict[str, Any]:
    try:
        detail = r.json()
    except (json.JSONDecodeError, ValueError):
        detail = r.text[:2000]
    return {"error": {"message": f"{who} answered {r.status_code}", "detail": detail}}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="hybridkv proxy", description=__doc__.splitlines()[0])
    add_arguments(p)
    return run_from_args(p.parse_args(argv))


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--prefill", action="append", required=True, help="prefill instance URL (repeatable)"
    )
    p.add_argument(
        "--decode", action="append", required=True, help="decode instance URL (repeatable)"
    )
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    defaults = ProxyLimits()
    for f in fields(ProxyLimits):
        kind = _positive_int if f.type in (int, "int") else _positive_float
        p.add_argument(
            "--" + f.name.replace("_", "-"),
            type=kind,
            default=getattr(defaults, f.name),
            help=f"{_field_doc(f.name)} (default {getattr(defaults, f.name):g})",
        )
    p.add_argument(
        "--timeout-s",
        type=_positive_float,
        default=None,
        help="sets both --read-timeout-s and --prefill-read-timeout-s",
    )
    p.add_argument(
        "--timeout-keep-alive-s",
        type=_positive_int,
        default=CLIENT_KEEPALIVE_S,
        metavar="S",
        help=f"close a client's idle connection after S seconds (default {CLIENT_KEEPALIVE_S}; keep it "
        "above a load balancer's idle timeout and above any stall of the proxy's process)",
    )
    p.add_argument(
        "--no-fallback",
        dest="fallback",
        action="store_false",
        help="answer 502 when no prefill instance serves a request (default: decode computes it alone)",
    )
    p.add_argument(
        "--max-decode-only",
        type=_non_negative_int,
        default=DEFAULT_MAX_DECODE_ONLY,
        metavar="N",
        help=f"at most N decode-only fallbacks at once (default {DEFAULT_MAX_DECODE_ONLY}; 0: no bound); one "
        "past it waits --decode-only-wait-s, then is answered 503 with Retry-After",
    )
    p.add_argument(
        "--decode-only-wait-s",
        type=float,
        default=DEFAULT_DECODE_ONLY_WAIT_S,
        help="how long a decode-only request waits for a slot under --max-decode-only "
        f"(default {DEFAULT_DECODE_ONLY_WAIT_S:g})",
    )
    p.add_argument(
        "--retry-after-s",
        type=float,
        default=1.0,
        help="the Retry-After of 503 answers (whole seconds, at least 1)",
    )


def run_from_args(args: argparse.Namespace) -> int:
    import uvicorn

    limits = {f.name: getattr(args, f.name) for f in fields(ProxyLimits)}
    app = build_app(
        args.prefill,
        args.decode,
        args.timeout_s,
        args.fallback,
        max_decode_only=args.max_decode_only,
        decode_only_wait_s=args.decode_only_wait_s,
        retry_after_s=args.retry_after_s,
        **limits,
    )
    uvicorn.run(
        app,
        host=args.host,
        port=args.port,
        log_level="warning",
        timeout_keep_alive=args.timeout_keep_alive_s,
    )
    return 0


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: a whole number, at least 1")
    return value


def _non_negative_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise argparse.ArgumentTypeError(f"{text!r}: a whole number, at least 0")
    return value


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = 0.0
    if not value > 0 or math.isinf(value):
        raise argparse.ArgumentTypeError(f"{text!r}: a number above 0")
    return value


if __name__ == "__main__":
    raise SystemExit(main())
