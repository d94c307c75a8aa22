"""A chat server in the test's own event loop that records what each request carried: the load
tester's tests send to it (tests/loadtest)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import orjson
from aiohttp import web


class Recorder:
    """A chat server in the test's loop: streams a reply naming the request's number and length, a
    usage chunk with cached_tokens, and records every request body and its class and session headers."""

    def __init__(self, cached: bool = True, piece_s: float = 0.0, malformed: int = 0) -> None:
        self.bodies: list[dict[str, Any]] = []
        self.sessions: list[str | None] = []  # each request's x-session-id
        self.classes: list[str | None] = []  # each request's x-specgate-class
        self.raw: list[bytes] = []  # each request's body as it came
        self.header_names: list[set[str]] = []  # each request's header names, lower-cased
        self.cached = cached
        # Seconds between the reply's pieces; the request of this number (from 1) answers a first
        # event that is valid JSON but no object (0: none does).
        self.piece_s = piece_s
        self.malformed = malformed

    @property
    def seen(self) -> list[tuple[str | None, str | None, int]]:
        """Each request's class and session headers and its number of messages."""
        return [(c, s, len(b["messages"])) for c, s, b in zip(self.classes, self.sessions, self.bodies, strict=True)]

    async def chat(self, request: web.Request) -> web.StreamResponse:
        self.raw.append(await request.read())
        self.header_names.append({k.lower() for k in request.headers})
        body = await request.json()
        self.bodies.append(body)
        self.sessions.append(request.headers.get("x-session-id"))
        self.classes.append(request.headers.get("x-specgate-class"))
        n = len(self.bodies)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        if n == self.malformed:
            await resp.write(b"data: [1]\n\n")
        for piece in (f"reply {n}", f" to {len(body['messages'])} messages", "\n"):
            await resp.write(
                b"data: " + orjson.dumps({"choices": [{"index": 0, "delta": {"content": piece}}]}) + b"\n\n"
            )
            if self.piece_s:
                await asyncio.sleep(self.piece_s)
        usage: dict[str, Any] = {"prompt_tokens": 40 * len(body["messages"]), "completion_tokens": 3}
        if self.cached:
            usage["prompt_tokens_details"] = {"cached_tokens": 40 * (len(body["messages"]) - 1)}
        await resp.write(b"data: " + orjson.dumps({"choices": [], "usage": usage}) + b"\n\n")
        await resp.write(b"data: [DONE]\n\n")
        return resp


async def _healthy(request: web.Request) -> web.Response:
    return web.Response()


@contextlib.asynccontextmanager
async def serving(rec: Recorder) -> AsyncIterator[str]:
    app = web.Application()
    app.router.add_post("/v1/chat/completions", rec.chat)
    app.router.add_get("/health", _healthy)  # a gateway in front of it counts it up
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        yield f"http://127.0.0.1:{runner.addresses[0][1]}"
    finally:
        await runner.cleanup()
