"""The in-process tier's rig: the ASGI app from `create_app`, its lifespan run, driven by httpx in
the test's own event loop, in front of simulated SGLang servers listening on 127.0.0.1 in that same
loop. No child process, no uvicorn: what needs the client-side protocol (proxy/edge/protocol.py) or a real
process stays in the loopback tier.

httpx's own ASGITransport runs the app to its end before it returns a response, so a stream could
not be held open, nor a client leave mid-stream; `StreamingASGITransport` hands the response over
at `http.response.start` and tells the app `http.disconnect` when the response is closed.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import httpx
from aiohttp import web
from aiohttp.typedefs import Handler
from opentelemetry.trace import TracerProvider
from starlette.types import ASGIApp, Message

from loadtest.procs import free_port
from loadtest.simulator.profile import load_profile
from loadtest.simulator.server import ServerConfig, SimServer
from proxy.app import create_app
from proxy.config import Settings
from proxy.fleet import promtext

ASGI = {"version": "3.0", "spec_version": "2.4"}


@contextlib.asynccontextmanager
async def lifespan(app: ASGIApp) -> AsyncIterator[dict[str, Any]]:
    """Run the app's startup, yield its lifespan state, run its shutdown (the ASGI lifespan
    protocol, as uvicorn speaks it)."""
    state: dict[str, Any] = {}
    to_app: asyncio.Queue[Message] = asyncio.Queue()
    from_app: asyncio.Queue[Message] = asyncio.Queue()

    async def run() -> None:
        await app({"type": "lifespan", "asgi": ASGI, "state": state}, to_app.get, from_app.put)

    task = asyncio.create_task(run())

    async def step(event: str) -> None:
        await to_app.put({"type": f"lifespan.{event}"})
        reply = asyncio.create_task(from_app.get())
        await asyncio.wait({reply, task}, return_when=asyncio.FIRST_COMPLETED)
        if not reply.done():
            reply.cancel()
            task.result()  # the app's own exception, if it raised
            raise RuntimeError(f"the app ended during lifespan.{event}")
        message = reply.result()
        if message["type"] != f"lifespan.{event}.complete":
            raise RuntimeError(f"lifespan.{event} failed: {message.get('message', message)}")

    threshold = gc.get_threshold()
    await step("startup")
    try:
        yield state
    finally:
        await step("shutdown")
        await task
        # The startup freezes the collector's view of everything built so far, for a process that
        # runs one app; a test session builds many.
        gc.unfreeze()
        gc.set_threshold(*threshold)


class _Body(httpx.AsyncByteStream):
    def __init__(self, chunks: asyncio.Queue[bytes | BaseException | None], leave: Callable[[], Awaitable[None]]):
        self._chunks = chunks
        self._leave = leave

    async def __aiter__(self) -> AsyncIterator[bytes]:
        while (chunk := await self._chunks.get()) is not None:
            if isinstance(chunk, BaseException):
                raise chunk
            yield chunk

    async def aclose(self) -> None:
        await self._leave()


class StreamingASGITransport(httpx.AsyncBaseTransport):
    """An ASGI transport that streams: the response comes back at `http.response.start`, its body
    as the app sends it, and closing it early is the client's disconnect."""

    def __init__(self, app: ASGIApp, state: dict[str, Any], client: tuple[str, int] = ("127.0.0.1", 50000)):
        self.app = app
        self.state = state
        self.client = client
        self.tasks: set[asyncio.Task[None]] = set()

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        scope = {
            "type": "http",
            "asgi": ASGI,
            "http_version": "1.1",
            "method": request.method,
            "scheme": request.url.scheme,
            "path": request.url.path,
            "raw_path": request.url.raw_path.split(b"?")[0],
            "query_string": request.url.query,
            "root_path": "",
            "headers": [(k.lower(), v) for k, v in request.headers.raw],
            "client": self.client,
            "server": (request.url.host, request.url.port or 80),
            "state": dict(self.state),  # as uvicorn: a shallow copy per request
        }
        body = b"".join([part async for part in request.stream])  # type: ignore[union-attr]
        left = asyncio.Event()
        started: asyncio.Future[Message] = asyncio.get_running_loop().create_future()
        chunks: asyncio.Queue[bytes | BaseException | None] = asyncio.Queue()
        body_sent = False
        ended = asyncio.Event()

        async def receive() -> Message:
            nonlocal body_sent
            if not body_sent:
                body_sent = True
                return {"type": "http.request", "body": body, "more_body": False}
            await left.wait()
            return {"type": "http.disconnect"}

        async def send(message: Message) -> None:
            if left.is_set():
                return  # the client is gone: writes go nowhere, as under uvicorn
            if message["type"] == "http.response.start":
                started.set_result(message)
            elif message["type"] == "http.response.body":
                if message.get("body"):
                    chunks.put_nowait(message["body"])
                if not message.get("more_body", False):
                    ended.set()
                    chunks.put_nowait(None)

        async def run() -> None:
            try:
                await self.app(scope, receive, send)
            except Exception as exc:
                if not started.done():
                    started.set_exception(exc)
                chunks.put_nowait(httpx.RemoteProtocolError(f"the app raised mid-response: {exc!r}"))
            else:
                if not started.done():
                    started.set_exception(RuntimeError("the app returned without a response"))
                if not ended.is_set():
                    # As a server closes the connection under a response the app left unfinished.
                    chunks.put_nowait(httpx.RemoteProtocolError("the app returned mid-response"))

        task = asyncio.create_task(run())
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

        async def leave() -> None:
            left.set()
            # Bounded: the app must notice the disconnect and finish; a hang is the test's failure.
            await asyncio.wait_for(asyncio.shield(task), 10)

        try:
            either: list[asyncio.Future[Any]] = [started, task]
            await asyncio.wait(either, return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:
            left.set()  # a client that gives up before the answer starts is gone too
            raise
        start = await started
        return httpx.Response(start["status"], headers=start.get("headers", []), stream=_Body(chunks, leave))

    async def aclose(self) -> None:
        for task in list(self.tasks):
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)


class _CountingSimServer(SimServer):
    """The simulator, counting the requests it is asked by path (what a test waits on: so many
    health polls, so many scrapes)."""

    def __init__(self, config: ServerConfig, hits: Counter[str]) -> None:
        super().__init__(config)
        self.hits = hits

    def app(self) -> web.Application:
        app = super().app()

        @web.middleware
        async def count(request: web.Request, handler: Handler) -> web.StreamResponse:
            self.hits[request.path] += 1
            return await handler(request)

        app.middlewares.insert(0, count)
        return app


@dataclass
class Sim:
    """A simulated SGLang server in this process: `await sim.stop()` refuses connections from then
    on, `await sim.restart()` listens again on the same port; `hits` counts requests by path."""

    url: str
    config: ServerConfig
    server: SimServer
    hits: Counter[str]

    async def stop(self) -> None:
        await self.server.stop()
        await self.server.engine.stop()

    async def restart(self) -> None:
        self.server = _CountingSimServer(self.config, self.hits)
        await self.server.start()


async def start_sim(role: str, profile: str = "seed-parallel", **config: Any) -> Sim:
    """`config`: ServerConfig's fields (the simulator's flags), e.g. time_scale=20, stall_rate=1;
    `profile`: a shipped profile's name, as --profile takes it."""
    port = free_port()
    cfg = ServerConfig(role=role, profile=load_profile(profile), port=port, **config)  # type: ignore[arg-type]
    hits: Counter[str] = Counter()
    server = _CountingSimServer(cfg, hits)
    await server.start()
    return Sim(f"http://127.0.0.1:{port}", cfg, server, hits)


@dataclass
class Gateway:
    """The app in front of two in-process simulators. `client` speaks to the app (base URL
    http://specgate); `http` is a plain client for the simulators' own URLs."""

    client: httpx.AsyncClient
    http: httpx.AsyncClient
    spec: Sim
    base: Sim
    settings: Settings

    async def routing(self) -> dict[str, Any]:
        r = await self.client.get("/routing")
        assert r.status_code == 200, r.text
        found: dict[str, Any] = r.json()
        return found

    async def metrics(self, url: str | None = None) -> dict[str, float]:
        """The app's /metrics (or a simulator's at `url`), summed over labels, by sample name."""
        r = await (self.client.get("/metrics") if url is None else self.http.get(url + "/metrics"))
        return promtext.totals(r.text)

    async def metrics_text(self) -> str:
        return (await self.client.get("/metrics")).text

    @contextlib.asynccontextmanager
    async def stream(
        self, body: dict[str, Any], url: str | None = None, headers: dict[str, str] | None = None
    ) -> AsyncIterator[httpx.Response]:
        """A streaming completion held open, its first event read, until the block ends."""
        client, target = (self.client, "/v1/completions") if url is None else (self.http, url + "/v1/completions")
        async with client.stream("POST", target, json=body, headers=headers) as r:
            lines = r.aiter_lines()
            await anext(lines)
            yield r


StartGateway = Callable[..., Awaitable[Gateway]]


@contextlib.asynccontextmanager
async def gateways() -> AsyncIterator[StartGateway]:
    """`await start(sim={"time_scale": 1}, spec={...}, base={...}, high_watermark=4)` builds a
    gateway: `sim` holds both simulators' settings, `spec` and `base` one's, `tracer_provider` takes
    the app's traces (proxy/observability/tracing.py), the rest are the app's Settings (a `speculative_url` there
    puts another server in the simulator's place). Everything started is stopped when the block ends."""
    async with contextlib.AsyncExitStack() as stack:

        async def start(
            sim: dict[str, Any] | None = None,
            spec: dict[str, Any] | None = None,
            base: dict[str, Any] | None = None,
            tracer_provider: TracerProvider | None = None,
            **settings: Any,
        ) -> Gateway:
            common = {"time_scale": 20.0, **(sim or {})}
            sims: list[Sim] = []
            for role, own in (("speculative", spec), ("baseline", base)):
                s = await start_sim(role, **{**common, **(own or {})})
                stack.push_async_callback(s.stop)
                sims.append(s)
            defaults = {"speculative_url": sims[0].url, "baseline_url": sims[1].url, "health_interval_s": 0.2}
            cfg = Settings(_env_file=None, **{**defaults, **settings})
            app = create_app(cfg, tracer_provider=tracer_provider)
            state = await stack.enter_async_context(lifespan(app))
            transport = StreamingASGITransport(app, state)
            client = await stack.enter_async_context(
                httpx.AsyncClient(transport=transport, base_url="http://specgate", timeout=30)
            )
            http = await stack.enter_async_context(httpx.AsyncClient(timeout=30))
            return Gateway(client, http, sims[0], sims[1], cfg)

        yield start
