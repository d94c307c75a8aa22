"""An OpenAI-compatible streaming server on raw asyncio that closes every connection after its
response, as llama.cpp's llama-server does even when the client asks for keep-alive:
`python -m tests.scripted_server PORT MODE [options]`.

Raw asyncio rather than aiohttp's server, because these misbehaviours live in the transport, where
a framework would tidy them away. MODE is one of:

- close_after_stream: answers, then closes the connection --close-delay-s later without saying so
  (no `Connection: close`). A client that pooled the connection and sent its next request on it
  meanwhile gets no answer: the server reads nothing more and closes.
- connection_close: the same, but the response says `Connection: close`.
- reset_before_answer: a completion request is read and the connection reset (RST) before any
  status line; /health and /v1/models answer normally.
- cut_mid_stream: a completion's status and first chunk go out, then the connection closes with
  the body unfinished.

Pacing: tokens go out one per chunk at --tok-s each, but all streams together share
--capacity-tok-s, so a stream's rate falls as more run at once (one GPU's budget).

--fail-alone K: a completion request that arrives while no other is streaming is answered HTTP 500,
except every K-th such request. A single stream then gets a good request now and then, among many
failures: a level whose few good requests would mislead (the case that --min-requests is for).
"""

from __future__ import annotations

import argparse
import asyncio
import socket
import struct

import orjson

MODES = ("close_after_stream", "connection_close", "reset_before_answer", "cut_mid_stream")


class Server:
    def __init__(
        self, mode: str, tok_s: float, capacity_tok_s: float, ttft_s: float, close_delay_s: float, fail_alone: int
    ) -> None:
        self.mode = mode
        self.fail_alone = fail_alone
        self.alone = 0
        self.tok_s = tok_s
        self.capacity_tok_s = capacity_tok_s
        self.ttft_s = ttft_s
        self.close_delay_s = close_delay_s
        self.streaming = 0

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = await reader.readuntil(b"\r\n\r\n")
            lines = head.decode("latin-1").split("\r\n")
            method, path, _ = lines[0].split(" ", 2)
            headers = {k.strip().lower(): v.strip() for k, _, v in (ln.partition(":") for ln in lines[1:] if ln)}
            body = await reader.readexactly(int(headers.get("content-length", "0")))
        except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, ConnectionError):
            writer.close()
            return
        close_header = b"Connection: close\r\n" if self.mode == "connection_close" else b""
        try:
            if method == "POST" and path.endswith("/completions"):
                if self.mode == "reset_before_answer":
                    # SO_LINGER with a zero timeout makes close() send RST instead of FIN.
                    sock = writer.get_extra_info("socket")
                    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                    writer.transport.abort()
                    return
                if self.fail_alone and self.streaming == 0:
                    self.alone += 1
                    if self.alone % self.fail_alone:
                        # Failing takes as long as a short stream, and counts as one meanwhile, so
                        # that failures leave no gaps that would leave the next request alone too.
                        self.streaming += 1
                        try:
                            await asyncio.sleep(self.ttft_s + 8 / self.tok_s)
                        finally:
                            self.streaming -= 1
                        error = b'{"error":{"message":"alone","code":500}}'
                        writer.write(plain(b"500 Internal Server Error", error, close_header))
                        await self.finish(writer)
                        return
                await self.stream(writer, orjson.loads(body), close_header)
                if self.mode == "cut_mid_stream":
                    writer.transport.abort()
                    return
            else:
                models = orjson.dumps({"object": "list", "data": [{"id": "scripted", "object": "model"}]})
                writer.write(plain(b"200 OK", models, close_header))
            await self.finish(writer)
        except ConnectionError:
            writer.close()

    async def finish(self, writer: asyncio.StreamWriter) -> None:
        await writer.drain()
        # The response is complete; like llama-server, the server is done with the connection,
        # whatever the client meant to send next on it.
        await asyncio.sleep(self.close_delay_s)
        writer.close()

    async def stream(self, writer: asyncio.StreamWriter, body: dict[str, object], close_header: bytes) -> None:
        chat = "messages" in body
        max_tokens = body.get("max_tokens")
        tokens = max_tokens if isinstance(max_tokens, int) else 16
        writer.write(
            b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n"
            + close_header + b"\r\n"
        )  # fmt: skip
        self.streaming += 1
        try:
            await asyncio.sleep(self.ttft_s)
            for i in range(tokens):
                text = {"delta": {"content": f" t{i}"}} if chat else {"text": f" t{i}"}
                writer.write(chunk(b"data: " + orjson.dumps({"choices": [{"index": 0, **text}]}) + b"\n\n"))
                await writer.drain()
                if self.mode == "cut_mid_stream":
                    return
                rate = min(self.tok_s, self.capacity_tok_s / max(self.streaming, 1))
                await asyncio.sleep(1 / rate)
        finally:
            self.streaming -= 1
        usage = {"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": tokens}}
        # The last event, [DONE] and the body's end in one write, as a well-behaved server sends
        # them: the client has the whole response, so it may pool the connection.
        writer.write(
            chunk(b"data: " + orjson.dumps(usage) + b"\n\n") + chunk(b"data: [DONE]\n\n") + b"0\r\n\r\n"
        )  # fmt: skip


def plain(status: bytes, payload: bytes, close_header: bytes) -> bytes:
    return (
        b"HTTP/1.1 " + status + b"\r\nContent-Type: application/json\r\n" + close_header
        + b"Content-Length: " + str(len(payload)).encode() + b"\r\n\r\n" + payload
    )  # fmt: skip


def chunk(data: bytes) -> bytes:
    return f"{len(data):x}\r\n".encode() + data + b"\r\n"


async def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("port", type=int)
    p.add_argument("mode", choices=MODES)
    p.add_argument("--tok-s", type=float, default=1000.0)
    p.add_argument("--capacity-tok-s", type=float, default=1e9)
    p.add_argument("--ttft-ms", type=float, default=2.0)
    p.add_argument("--close-delay-s", type=float, default=0.02)
    p.add_argument("--fail-alone", type=int, default=0)
    args = p.parse_args()
    server = Server(
        args.mode, args.tok_s, args.capacity_tok_s, args.ttft_ms / 1000, args.close_delay_s, args.fail_alone
    )
    srv = await asyncio.start_server(server.handle, "127.0.0.1", args.port, backlog=1024)
    async with srv:
        await srv.serve_forever()


if __name__ == "__main__":
    asyncio.run(main())
