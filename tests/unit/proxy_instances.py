"""Real HTTP servers (uvicorn in a thread) for the proxy's unit tests.

``FakeVllm`` is a FAKE vLLM instance, named as such: no engine runs behind it. It answers the
OpenAI completions and chat routes the way a vLLM prefill or decode instance shapes its answers
(a batch of prompts: one choice per prompt and sample, ``index`` counting up, the prompt tokens
summed once per prompt; a prefill instance hands over the FIRST prompt's ``kv_transfer_params``
only, as vLLM does, while it keeps a lease for every prompt) and keeps the books the tests check:
every lease the prefill role issued, every lease the decode role was handed, and every body.
An engine is not needed for what the proxy decides; the P/D e2e runs real engines behind it.
"""

from __future__ import annotations

import asyncio
import itertools
import socket
import threading
import time
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse


def _prompts(body: dict[str, Any]) -> list[Any]:
    p = body.get("prompt")
    if isinstance(p, list) and p and not all(isinstance(t, int) for t in p):
        return p
    return [p if "messages" not in body else "chat"]


class Server:
    """``app`` served on 127.0.0.1 on a free port, in a daemon thread."""

    def __init__(self, app: Any) -> None:
        import uvicorn

        self.server = uvicorn.Server(
            uvicorn.Config(app, host="127.0.0.1", port=0, log_level="error")
        )
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 10
        while not self.server.started:
            assert time.monotonic() < deadline, "test server did not start"
            time.sleep(0.01)
        self.url = f"http://127.0.0.1:{self.server.servers[0].sockets[0].getsockname()[1]}"

    def close(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)


class FakeVllm(Server):
    """A FAKE vLLM instance (see the module docstring). ``role``: "prefill" or "decode".
    ``raw``: (status, body bytes, content type) answered to every POST instead (a broken
    instance). ``gate``: answers wait until it is set."""

    def __init__(
        self,
        role: str,
        raw: tuple[int, bytes, str] | None = None,
        gate: threading.Event | None = None,
    ) -> None:
        self.role = role
        self.bodies: list[dict[str, Any]] = []
        self.leases: list[str] = []  # prefill: every lease issued (one per prompt)
        self.read: list[str] = []  # decode: every lease handed to it
        lease_ids = itertools.count()
        app = FastAPI()

        async def answer(request: Request, chat: bool) -> Response:
            body = await request.json()
            self.bodies.append(body)
            while gate is not None and not gate.is_set():
                await asyncio.sleep(0.01)
            if raw is not None:
                return Response(status_code=raw[0], content=raw[1], media_type=raw[2])
            prompts = _prompts(body)
            n = body.get("n") or 1
            seed = body.get("seed")
            choices, params = [], None
            for p in prompts:
                if role == "prefill" and (body.get("kv_transfer_params") or {}).get(
                    "do_remote_decode"
                ):
                    lease = f"lease-{next(lease_ids)}"
                    self.leases.append(lease)
                    if params is None:  # vLLM hands over the first prompt's parameters only
                        params = {
                            "do_remote_prefill": True,
                            "remote_request_id": body.get("request_id", "?"),
                            "lease": lease,
                        }
                for i in range(n):
                    text = f"{p}|seed={None if seed is None else seed + i}"
                    choice = (
                        {"index": len(choices), "message": {"role": "assistant", "content": text}}
                        if chat
                        else {"index": len(choices), "text": text}
                    )
                    choices.append(choice)
            given = body.get("kv_transfer_params") or {}
            if role == "decode" and "lease" in given:
                self.read.append(given["lease"])
            prompt_tokens = sum(len(p) if isinstance(p, (str, list)) else 1 for p in prompts)
            out = {
                "id": f"cmpl-{body.get('request_id', '?')}",
                "object": "text_completion",
                "model": "m",
                "choices": choices,
                "kv_transfer_params": params,
                "usage": {
                    "prompt_tokens": prompt_tokens,
                    "completion_tokens": len(choices),
                    "total_tokens": prompt_tokens + len(choices),
                },
            }
            if body.get("stream"):

                async def chunks():  # noqa: ANN202
                    for c in choices:
                        yield f'data: {{"choices": [{{"index": {c["index"]}}}]}}\n\n'.encode()
                    yield b"data: [DONE]\n\n"

                return StreamingResponse(chunks(), media_type="text/event-stream")
            return JSONResponse(out)

        @app.post("/v1/completions")
        async def completions(request: Request):  # noqa: ANN202
            return await answer(request, chat=False)

        @app.post("/v1/chat/completions")
        async def chat(request: Request):  # noqa: ANN202
            return await answer(request, chat=True)

        @app.get("/health")
        async def health():  # noqa: ANN202
            return {}

        super().__init__(app)


class Silent:
    """A TCP listener that accepts connections and never answers (a hung instance)."""

    def __init__(self) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(64)
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.conns: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.conns.append(conn)

    def close(self) -> None:
        self.sock.close()
        for c in self.conns:
            c.close()


def dead_url() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}"
