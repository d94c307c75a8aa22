"""egress: a response head and its first body bytes leave uvicorn in one write. Counting writes
needs the transport, so uvicorn's own protocol runs here on loopback with its transport wrapped."""

from __future__ import annotations

import asyncio
from typing import Any

import uvicorn
from starlette.types import Message, Receive, Scope, Send
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from proxy.egress import send_head_with_body

START: Message = {"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/plain")]}


class _Recorder:
    def __init__(self, real: Any, writes: list[bytes]) -> None:
        self._real = real
        self._writes = writes

    def write(self, data: bytes) -> None:
        self._writes.append(bytes(data))
        self._real.write(data)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)


async def exchange(app: Any, request: bytes) -> tuple[list[bytes], bytes]:
    """(the writes uvicorn made, what the client read until the server closed)."""
    writes: list[bytes] = []

    class Recording(HttpToolsProtocol):
        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(_Recorder(transport, writes))  # type: ignore[arg-type]

    # Kept-alive connections live on long past the test: only the close asked for ends one.
    config = uvicorn.Config(
        app, host="127.0.0.1", port=0, http=Recording, lifespan="off", log_config=None, timeout_keep_alive=60
    )
    server = uvicorn.Server(config)
    task = asyncio.create_task(server.serve())
    try:
        async with asyncio.timeout(10):
            while not server.started:  # noqa: ASYNC110 - uvicorn exposes a flag, not an event
                await asyncio.sleep(0.01)
            port = server.servers[0].sockets[0].getsockname()[1]
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(request)
            got = await reader.read()  # to EOF: every request here says "connection: close"
            writer.close()
    finally:
        server.should_exit = True
        await task
    return writes, got


GET = b"GET / HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n"


def test_head_and_first_body_bytes_are_one_write() -> None:
    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        await send_head_with_body(send, START, {"type": "http.response.body", "body": b"first", "more_body": True})
        await send({"type": "http.response.body", "body": b"last", "more_body": False})

    writes, got = asyncio.run(exchange(app, GET))
    assert writes[0].startswith(b"HTTP/1.1 200 OK\r\n") and writes[0].endswith(b"5\r\nfirst\r\n")
    assert writes[1:] == [b"4\r\nlast\r\n0\r\n\r\n"]
    assert got == b"".join(writes)


def test_a_whole_response_in_one_write_then_the_close() -> None:
    # A final body on a connection that is not kept alive: uvicorn closes right after writing it,
    # so the close must wait for the collected bytes.
    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        await send_head_with_body(send, START, {"type": "http.response.body", "body": b"all", "more_body": False})

    writes, got = asyncio.run(exchange(app, GET))
    assert len(writes) == 1
    assert got.startswith(b"HTTP/1.1 200 OK\r\n") and got.endswith(b"3\r\nall\r\n0\r\n\r\n")


def test_any_other_send_gets_the_two_messages() -> None:
    sent: list[Message] = []

    async def send(message: Message) -> None:
        sent.append(message)

    body: Message = {"type": "http.response.body", "body": b"x", "more_body": True}
    asyncio.run(send_head_with_body(send, START, body))
    assert sent == [START, body]
