"""The hot path out: a response head and the body bytes sent with it leave in one write.

uvicorn writes a response head the moment the app sends `http.response.start`, and each body
message in a write of its own. When the relay has both in hand (a JSON answer, an error), two
writes wake the client twice, and on a small machine, where the client often runs on the proxy's
own CPU, the first write lets it preempt the proxy before the body is written. One write wakes it
once, with everything in it.

uvicorn has no API for this, so for those two messages the cycle's transport is swapped for one
that collects the writes; anything that is not uvicorn's own cycle (a test client, a middleware's
wrapper) simply gets the two messages as usual.
"""

from __future__ import annotations

from typing import Any

from starlette.types import Message, Send


class _Collect:
    """Stands in for the transport for two messages: collects writes and holds back a close (uvicorn
    closes after a final body when the connection is not kept alive); the rest goes to the real one."""

    __slots__ = ("closing", "parts", "real")

    def __init__(self, real: Any) -> None:
        self.real = real
        self.parts: list[bytes] = []
        self.closing = False

    def write(self, data: bytes) -> None:
        self.parts.append(data)

    def close(self) -> None:
        self.closing = True

    def __getattr__(self, name: str) -> Any:
        return getattr(self.real, name)


async def send_head_with_body(send: Send, start: Message, body: Message) -> None:
    """Send `http.response.start` and an `http.response.body` as one write when the server is
    uvicorn; as two messages otherwise."""
    cycle = getattr(send, "__self__", None)
    real = getattr(cycle, "transport", None)
    if real is None or not callable(getattr(real, "write", None)):
        await send(start)
        await send(body)
        return
    collect = _Collect(real)
    cycle.transport = collect  # type: ignore[union-attr]
    try:
        await send(start)
        await send(body)
    finally:
        cycle.transport = real  # type: ignore[union-attr]
    if collect.parts and not real.is_closing():
        real.write(b"".join(collect.parts))
    if collect.closing:
        real.close()
