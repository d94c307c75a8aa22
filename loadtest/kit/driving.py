"""Closed-loop load: streams that each send their next request when the last one ended, periodic
ticks beside them, and the requests in flight at the end let finish."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable, Iterable

import aiohttp

from ..client import RequestResult, Target, stream_request
from ..prompts import Prompt
from ..sweep import ERROR_BACKOFF_S, first_model

# At time scale 1: how long the requests in flight at the end may take.
DRAIN_S = 120.0


async def sleep_until(t: float) -> None:
    await asyncio.sleep(max(0.0, t - time.monotonic()))


async def ticks(t0: float, period: float, end: float) -> AsyncIterator[float]:
    """time.monotonic() at t0 + k * period until `end`; a late tick is not made up for."""
    k = 0
    while (now := time.monotonic()) < end:
        yield now
        k += 1
        await sleep_until(t0 + k * period)


async def stream(
    session: aiohttp.ClientSession,
    end: float,
    next_request: Callable[[], tuple[Target, Prompt]],
    results: list[RequestResult],
) -> None:
    """One closed-loop stream until `end`: `next_request()` picks each request's target and prompt."""
    while time.monotonic() < end:
        target, prompt = next_request()
        r = await stream_request(session, target, prompt)
        results.append(r)
        if not r.ok:
            await asyncio.sleep(ERROR_BACKOFF_S)


async def drain(streams: Iterable[asyncio.Task[None]], time_scale: float) -> None:
    """The requests in flight at the end finish, so each one's usage (its tokens) is known; those
    past DRAIN_S (time-scaled) are cancelled."""
    tasks = list(streams)
    if not tasks:
        return
    _, pending = await asyncio.wait(tasks, timeout=DRAIN_S / time_scale + 10.0)
    for task in pending:
        task.cancel()
    await asyncio.gather(*pending, return_exceptions=True)


async def chat_target(url: str, max_tokens: int) -> Target:
    """A chat target at `url` for the first model it serves."""
    return Target(url, await first_model(url, None), chat=True, max_tokens=max_tokens)
