"""A misbehaving 'SGLang' for tests: `python -m tests.hostile_server PORT`, or `serving(port)` in
the test's own loop. The request body's `mode` picks the misbehaviour; /health answers 200 so the
proxy routes to it."""

from __future__ import annotations

import asyncio
import contextlib
import json
import sys
from collections.abc import AsyncIterator

from aiohttp import web

SSE = {"Content-Type": "text/event-stream"}
RELEASE = web.AppKey("release", asyncio.Event)
_DELTA = (
    b'{"type":"response.output_text.delta","sequence_number":1,"item_id":"m","output_index":0,'
    b'"content_index":0,"delta":"a"}'
)
# Streams that break inside an event: the bytes written before the connection drops.
CUTS = {
    "chat_cut_mid_event": (
        b": ping\n\n",
        b'data: {"choices":[{"index":0,"delta":{"content":" a"}}]}\n\n',
        b'data: {"choices":[{"index":0,"delta":{"content":" b',
    ),
    "responses_cut_mid_event": (
        b'event: response.created\ndata: {"type":"response.created","sequence_number":0}\n\n',
        b": ping\n\n: ping\n\n: ping\n\n",
        b"event: response.output_text.delta\ndata: " + _DELTA + b"\n\n",
        b'event: response.output_text.delta\ndata: {"type": "response.output_text.delta", "seq',
    ),
}
_COMPLETED = (
    b'{"type":"response.completed","sequence_number":2,"response":{"id":"resp_crlf","object":"response",'
    b'"status":"completed","output":[],"usage":{"input_tokens":11,"output_tokens":4,"total_tokens":15}}}'
)
# A whole Responses stream framed with CRLF, as sse-starlette writes it.
RESPONSES_CRLF = (
    b'event: response.created\r\ndata: {"type":"response.created","sequence_number":0}\r\n\r\n'
    + b"event: response.output_text.delta\r\ndata: "
    + _DELTA
    + b"\r\n\r\n: ping\r\n\r\nevent: response.completed\r\ndata: "
    + _COMPLETED
    + b"\r\n\r\n"
)
SEEN = web.AppKey("seen", list[str])


async def generate(request: web.Request) -> web.StreamResponse:
    body = await request.json()
    mode = body.get("mode")
    if mode == "garbage_200":
        return web.Response(body=b"\x00\xffnot json at all", content_type="application/json")
    if mode == "huge":
        return web.Response(body=b'{"pad":"' + b"x" * (48 * 1024 * 1024) + b'"}', content_type="application/json")
    if mode == "huge_head":
        return web.Response(body=b"{}", content_type="application/json", headers={"X-Pad": "h" * 200_000})
    if mode == "json_cut":
        # A body shorter than its Content-Length: the connection drops after its first bytes.
        short = web.StreamResponse(headers={"Content-Type": "application/json", "Content-Length": "400"})
        await short.prepare(request)
        await short.write(b'{"id":"1","choices":[{"index":0,"message":{"role":"assistant","content":"a')
        await asyncio.sleep(0.05)
        assert request.transport is not None
        request.transport.abort()
        return short
    resp = web.StreamResponse(headers=SSE)
    await resp.prepare(request)
    if mode == "echo_raw":
        # What reached the server, byte for byte, as one event: the body and the headers.
        raw = (await request.read()).decode("utf-8")
        headers = [[k.decode("latin-1"), v.decode("latin-1")] for k, v in request.raw_headers]
        echoed = json.dumps({"raw": raw, "headers": headers})
        await resp.write(b"data: " + echoed.encode() + b"\n\ndata: [DONE]\n\n")
    elif mode == "malformed_sse":
        await resp.write(b"data: {not json\n\ndata: \xff\xfe\n\nevent: weird\nretry: x\n\ndata: [DONE]\n\n")
    elif mode == "no_blank_lines":
        for _ in range(64):
            await resp.write(b"data: " + b"y" * 8192 + b"\n")  # never a blank line: one endless event
    elif mode == "never_ends":
        while True:  # ends when the client goes (the handler is cancelled)
            await resp.write(b'data: {"choices":[{"index":0,"delta":{"content":" x"}}]}\n\n')
            await asyncio.sleep(0.01)
    elif mode == "firehose":
        event = b"data: " + b"z" * 65536 + b"\n\n"
        while True:  # as fast as the reader takes it
            await resp.write(event)
    elif mode == "done_then_end":
        # `[DONE]`, then the end of the chunked body in a write of its own (as SGLang's uvicorn
        # writes it), a moment later: the proxy reads `[DONE]` alone.
        await resp.write(b'data: {"choices":[{"index":0,"delta":{"content":" a"}}]}\n\n')
        await resp.write(b"data: [DONE]\n\n")
        await asyncio.sleep(0.001)
    elif mode == "done_then_hold":
        # `[DONE]`, then the body stays open until someone POSTs /release.
        await resp.write(b"data: [DONE]\n\n")
        release = request.app[RELEASE]
        await release.wait()
        release.clear()
    elif mode in CUTS:
        # The connection drops in the middle of an event, after a comment and a whole event.
        for part in CUTS[mode]:
            await resp.write(part)
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.05)
        assert request.transport is not None
        request.transport.abort()
        return resp
    elif mode == "responses_crlf":
        await resp.write(RESPONSES_CRLF)
    elif mode == "reset_mid_stream":
        await resp.write(b'data: {"choices":[{"index":0,"delta":{"content":" a"}}]}\n\n')
        await asyncio.sleep(0.05)
        assert request.transport is not None
        request.transport.abort()
        return resp
    await resp.write_eof()
    return resp


async def echo(request: web.Request) -> web.Response:
    """What reached the server: the request target and headers, as they came on the wire."""
    headers = [[k.decode("latin-1"), v.decode("latin-1")] for k, v in request.raw_headers]
    return web.json_response({"target": request.raw_path, "headers": headers, "body": await request.text()})


async def record(request: web.Request) -> web.Response:
    """Any other request: noted (method and target as they came), then 404."""
    request.app[SEEN].append(f"{request.method} {request.raw_path}")
    return web.Response(status=404, text="not here")


async def seen(request: web.Request) -> web.Response:
    return web.json_response(request.app[SEEN])


async def release(request: web.Request) -> web.Response:
    request.app[RELEASE].set()
    return web.Response(text="")


async def health(request: web.Request) -> web.Response:
    return web.Response(text="")


def make_app() -> web.Application:
    app = web.Application(client_max_size=1024**2)
    app.router.add_get("/health", health)
    app.router.add_post("/v1/chat/completions", generate)
    app.router.add_post("/v1/responses", generate)
    app.router.add_post("/v1/echo/{tail:.*}", echo)
    app.router.add_post("/release", release)
    app.router.add_get("/seen", seen)
    app.router.add_route("*", "/{tail:.*}", record)  # last: whatever matched nothing above
    app[RELEASE] = asyncio.Event()
    app[SEEN] = []
    return app


@contextlib.asynccontextmanager
async def serving(port: int) -> AsyncIterator[str]:
    """The server on 127.0.0.1:`port` in the running loop (in-process tests use it directly)."""
    runner = web.AppRunner(make_app(), handler_cancellation=True, access_log=None)
    await runner.setup()
    try:
        await web.TCPSite(runner, "127.0.0.1", port).start()
        yield f"http://127.0.0.1:{port}"
    finally:
        await runner.cleanup()


async def main(port: int) -> None:
    async with serving(port):
        await asyncio.Event().wait()


if __name__ == "__main__":
    asyncio.run(main(int(sys.argv[1])))
