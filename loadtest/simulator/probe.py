"""Closed-loop streaming load against a simulator, counting output tokens in a time window.

Made for the simulator's own output (its tokens are single words, each with one leading space,
and its JSON is compact), which lets the count be exact without parsing JSON: the client stays
cheap, so the simulator, not the client, is what a measurement measures.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

import aiohttp


@dataclass(frozen=True)
class ProbeResult:
    concurrency: int
    tokens: int
    window_s: float
    requests_started: int
    errors: int

    @property
    def tok_s(self) -> float:
        return self.tokens / self.window_s


async def closed_loop(
    base_url: str,
    concurrency: int,
    *,
    warmup_s: float,
    measure_s: float,
    max_tokens: int = 512,
    prompt: str = "Tell me about speculative decoding.",
) -> ProbeResult:
    """`concurrency` streams, each sending a new request as soon as its last one ends."""
    start = time.monotonic()
    t0, t1 = start + warmup_s, start + warmup_s + measure_s
    tokens = 0
    started = 0
    errors = 0
    body = {"prompt": prompt, "max_tokens": max_tokens, "stream": True}
    url = base_url.rstrip("/") + "/v1/completions"

    async def worker(session: aiohttp.ClientSession) -> None:
        nonlocal tokens, started, errors
        while time.monotonic() < t1:
            started += 1
            try:
                async with session.post(url, json=body) as resp:
                    if resp.status != 200:
                        errors += 1
                        await resp.read()
                        continue
                    async for line in resp.content:
                        if not line.startswith(b"data: {"):
                            continue
                        now = time.monotonic()
                        if now >= t1:
                            return  # leaving closes the stream, which aborts it upstream
                        if now >= t0:
                            tokens += line.count(b" ") - 1
            except aiohttp.ClientError:
                errors += 1
                await asyncio.sleep(0.05)

    connector = aiohttp.TCPConnector(limit=0, force_close=False)
    timeout = aiohttp.ClientTimeout(total=None, sock_read=30)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        await asyncio.gather(*(worker(session) for _ in range(concurrency)))
    return ProbeResult(concurrency, tokens, measure_s, started, errors)
