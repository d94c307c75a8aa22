"""The upstream leg alone: what each HTTP client costs specgate per request, measured head to head.

    python -m loadtest.bench_upstream [--reps 3]

The proxy's cost is mostly its upstream client (shared/design.md), so the choice is made here by
measurement: the same requests, from one process on uvloop, against the zero-delay simulator, by

- `specgate`: proxy/transport/upstream.py itself, the httptools connection pool specgate uses;
- `aiohttp`: aiohttp.ClientSession set up as specgate had it (no cookie jar, no decompression,
  pool sized to the concurrency), reading with `content.readany()`;
- `httpx`: httpx.AsyncClient on its own transport (httpcore), pool sized to the concurrency;
- `httpx+aiohttp`: httpx.AsyncClient on httpx-aiohttp's transport, httpx's API on aiohttp's pool;
- `httpx2`: the maintained fork of httpx (same API, its own transport), pool sized the same;
- `bare`: the overhead benchmark's httptools client (loadtest/rawclient.py), no pool, no timeouts,
  no error mapping: the floor, not a candidate.

Each reads bodies as they arrive, as the relay does. Figures: CPU of this process per request
(the client's whole cost, as the backend runs elsewhere) and requests/s; medians over repetitions,
clients alternating so that machine drift hits all alike.
"""

from __future__ import annotations

import argparse
import asyncio
import resource
import statistics
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import aiohttp
import httpx
import httpx2
import orjson
import uvloop
from httpx_aiohttp import AiohttpTransport

from proxy.config import Settings
from proxy.fleet.engines import POOL_KEEPALIVE_S
from proxy.transport.upstream import Upstream

from .procs import free_port, simulator_args, start
from .rawclient import RawClient, post


@dataclass(frozen=True)
class Case:
    name: str
    concurrency: int
    max_tokens: int
    stream: bool
    requests: int


CASES = (
    Case("small c=1", 1, 1, False, 1000),
    Case("small c=50", 50, 1, False, 4000),
    Case("stream64 c=50", 50, 64, True, 1000),
)
CLIENTS = ("specgate", "aiohttp", "httpx", "httpx+aiohttp", "httpx2", "bare")

Send = Callable[[], Awaitable[None]]


def _cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


async def _measure(client: str, port: int, case: Case) -> tuple[float, float]:
    """(CPU ms per request, requests/s) of one client on one case."""
    url = f"http://127.0.0.1:{port}"
    body = orjson.dumps({"model": "sim", "prompt": "p", "max_tokens": case.max_tokens, "stream": case.stream})
    headers = [("Content-Type", "application/json")]
    closers: list[Callable[[], Awaitable[None]]] = []
    make: Callable[[], Send]
    if client == "specgate":
        settings = Settings(speculative_url=url, baseline_url=url, max_connections_per_backend=1024)
        upstream = Upstream.of(settings.routing_topology(), settings, keepalive_s=POOL_KEEPALIVE_S)
        closers.append(upstream.aclose)
        up_headers = upstream.request_headers([], "bench")

        def make() -> Send:
            async def send() -> None:
                resp = await upstream.send("baseline", b"/v1/completions", body, up_headers)
                while await resp.read_chunk():
                    pass
                resp.release()

            return send
    elif client == "aiohttp":
        session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=1024, limit_per_host=0, keepalive_timeout=30),
            auto_decompress=False,
            skip_auto_headers=("User-Agent", "Accept-Encoding"),
            cookie_jar=aiohttp.DummyCookieJar(),
        )
        closers.append(session.close)

        def make() -> Send:
            async def send() -> None:
                async with session.post(url + "/v1/completions", data=body, headers=headers) as resp:
                    while await resp.content.readany():
                        pass

            return send
    elif client in ("httpx", "httpx+aiohttp", "httpx2"):
        hx = _httpx_client(client, url)
        closers.append(hx.aclose)

        def make() -> Send:
            async def send() -> None:
                async with hx.stream("POST", "/v1/completions", content=body, headers=headers) as resp:
                    async for _ in resp.aiter_raw():
                        pass

            return send
    else:
        request = post("127.0.0.1", port, "/v1/completions", body)

        def make() -> Send:
            raw = RawClient("127.0.0.1", port)

            async def send() -> None:
                await raw.send(request)

            return send

    try:
        senders = [make() for _ in range(case.concurrency)]
        await asyncio.gather(*(s() for s in senders))  # connect and warm up
        per = max(1, case.requests // case.concurrency)

        async def worker(send: Send) -> None:
            for _ in range(per):
                await send()

        c0, t0 = _cpu(), time.perf_counter()
        await asyncio.gather(*(worker(s) for s in senders))
        wall, cpu = time.perf_counter() - t0, _cpu() - c0
    finally:
        for close in closers:
            await close()
    n = per * case.concurrency
    return cpu / n * 1000, n / wall


# case -> client -> one (CPU ms per request, requests/s) per repetition
Results = dict[str, dict[str, list[tuple[float, float]]]]


def _httpx_client(client: str, url: str) -> httpx.AsyncClient | httpx2.AsyncClient:
    """httpx on its own transport or on httpx-aiohttp's, or its fork httpx2; pools sized alike."""
    if client == "httpx2":
        return httpx2.AsyncClient(
            base_url=url, limits=httpx2.Limits(max_connections=1024, max_keepalive_connections=1024), timeout=30
        )
    limits = httpx.Limits(max_connections=1024, max_keepalive_connections=1024)
    transport = AiohttpTransport() if client == "httpx+aiohttp" else httpx.AsyncHTTPTransport(limits=limits)
    return httpx.AsyncClient(base_url=url, transport=transport, limits=limits, timeout=30)


def run(reps: int, cases: tuple[Case, ...] = CASES, clients: tuple[str, ...] = CLIENTS) -> Results:
    port = free_port()
    backend = start("backend", simulator_args("baseline", port, "--ttft-base-ms", "0", "--time-scale", "1000",
                                              "--served-model-name", "sim", "--max-running-requests", "4096"),
                    ready_url=f"http://127.0.0.1:{port}/health")  # fmt: skip
    out: Results = {c.name: {k: [] for k in clients} for c in cases}
    try:
        for rep in range(reps):
            for case in cases:
                for client in clients if rep % 2 == 0 else clients[::-1]:
                    out[case.name][client].append(uvloop.run(_measure(client, port, case)))
            print(f"repetition {rep + 1}/{reps} done", flush=True)
    finally:
        backend.stop()
    return out


def format_table(results: Results) -> str:
    lines = [f"{'case':15} {'client':14} {'CPU ms/req':>10} {'req/s':>8} {'CPU vs specgate':>15}", "-" * 66]
    for case, by_client in results.items():
        base = statistics.median(x[0] for x in by_client["specgate"]) if by_client.get("specgate") else float("nan")
        for client, samples in by_client.items():
            cpu = statistics.median(x[0] for x in samples)
            rps = statistics.median(x[1] for x in samples)
            lines.append(f"{case:15} {client:14} {cpu:>10.3f} {rps:>8.0f} {cpu / base:>14.2f}x")
    lines.append("(medians over repetitions; CPU of the client process per request, the backend runs elsewhere)")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m loadtest.bench_upstream", description=__doc__.split("\n")[0])
    parser.add_argument("--reps", type=int, default=3)
    args = parser.parse_args(argv)
    print(format_table(run(args.reps)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
