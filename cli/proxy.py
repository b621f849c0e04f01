"""``hybridkv proxy``: an OpenAI-compatible front door for prefill/decode disaggregation.

Each request goes first to a prefill instance with ``max_tokens=1`` and
``kv_transfer_params={"do_remote_decode": true}``; the prefill instance computes the
prompt's KV, keeps the blocks under a lease and answers with the parameters a decode
instance needs to pull them. The proxy then sends the original request to a decode
instance with those ``kv_transfer_params`` and streams (or returns) its answer.
Both the completions and chat endpoints are served; instances are used round-robin.
Binds 127.0.0.1 by default: this is an internal hop, not an edge service.
"""

# No `from __future__ import annotations`: FastAPI resolves the handlers' `request: Request`
# annotations at runtime, and Request is imported lazily inside build_app.
import argparse
import copy
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


def build_app(prefill_urls: Sequence[str], decode_urls: Sequence[str], timeout_s: float = 600.0):
    """A FastAPI app routing every request prefill -> decode."""
    import httpx
    from fastapi import FastAPI, Request
    from fastapi.responses import JSONResponse, StreamingResponse

    app = FastAPI(title="hybridkv P/D proxy")
    prefills = itertools.cycle([u.rstrip("/") for u in prefill_urls])
    decodes = itertools.cycle([u.rstrip("/") for u in decode_urls])
    client = httpx.AsyncClient(timeout=httpx.Timeout(timeout_s))

    async def route(path: str, request: Request):
        try:
            body = await request.json()
        except json.JSONDecodeError as e:
            return JSONResponse(status_code=400, content={"error": {"message": f"request body is not JSON: {e}"}})
        prefill, decode = next(prefills), next(decodes)
        try:
            r = await client.post(prefill + path, json=prefill_request(body))
        except httpx.HTTPError as e:
            return _unreachable("prefill", prefill, e)
        if r.status_code != 200:
            return JSONResponse(status_code=r.status_code, content=_error(r, f"prefill {prefill}"))
        try:
            dreq = decode_request(body, r.json())
        except ValueError as e:
            return JSONResponse(status_code=502, content={"error": {"message": str(e)}})
        if not body.get("stream"):
            try:
                d = await client.post(decode + path, json=dreq)
            except httpx.HTTPError as e:
                return _unreachable("decode", decode, e)
            return JSONResponse(status_code=d.status_code, content=d.json() if d.content else {})

        async def relay() -> AsyncIterator[bytes]:
            async with client.stream("POST", decode + path, json=dreq) as d:
                async for chunk in d.aiter_bytes():
                    yield chunk

        return StreamingResponse(relay(), media_type="text/event-stream")

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


def run_from_args(args: argparse.Namespace) -> int:
    import uvicorn

    uvicorn.run(build_app(args.prefill, args.decode, args.timeout_s), host=args.host, port=args.port,
                log_level="warning")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
