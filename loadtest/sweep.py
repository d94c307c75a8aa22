"""Closed-loop load at fixed concurrency levels (like bench_serving --max-concurrency).

Each level: `concurrency` workers each send a request as soon as their last one ended. Warm-up
lasts until every worker has finished one request (so ramp-up and any routing transient are
over) and at least `warmup_s`. Then the measurement window runs for `duration_s`, or until
`requests` requests started inside it have finished. A window of `duration_s` runs on, up to
`max_duration_s` in all, until the level has enough good requests to be conclusive (`enough`):
a short window then extends at the low levels, whose requests take longest to finish, instead
of leaving them inconclusive. Then no new requests are sent and the ones
in flight finish (drain), so every request that overlapped the window has its `usage`. Output
throughput counts the tokens produced inside the window (see stats.tokens_in_window).
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
import time
from collections.abc import Callable, Coroutine, Iterator
from dataclasses import dataclass
from typing import Any

import aiohttp

from .client import RequestResult, Target, stream_request
from .prompts import Prompt
from .stats import DEFAULT_MIN_REQUESTS, LevelStats, min_ok_requests, summarize

# A worker whose request failed waits this long before the next, so a dead target is no busy loop.
ERROR_BACKOFF_S = 0.05


class TargetUnreachable(Exception):
    pass


@dataclass(frozen=True)
class LevelPlan:
    duration_s: float | None = 30.0
    requests: int | None = None
    warmup_s: float = 0.0
    # Upper bounds, so a level always ends: warm-up and drain each stop waiting after this.
    max_wait_s: float = 600.0
    # With duration_s: the window may run on past it, up to this long in all, until the level has
    # enough good requests (None: it never does).
    max_duration_s: float | None = None

    @property
    def extends(self) -> bool:
        """Whether a window may run on past duration_s."""
        return self.duration_s is not None and (self.max_duration_s or 0.0) > self.duration_s


def enough(concurrency: int, min_requests: int, good: int, streams: int, failed: int) -> bool:
    """Whether a window holds enough to end: the good requests a conclusive level needs
    (stats.min_ok_requests) from at least half the streams, or as many failures as that (more time
    would only measure a failing server). Counts are of requests started inside the window."""
    need = min_ok_requests(concurrency, min_requests)
    if need == 0:  # --min-requests 0: no check, so nothing to wait for
        return True
    return (good >= need and streams >= math.ceil(concurrency / 2)) or failed >= need


Progress = Callable[[str, int, int, int], None]  # (phase, completed, errors, client_errors)
# Runs beside the load from the window's start; the event is set at the window's end, and the level
# waits for it to return after the drain (e.g. a sampler of the server's /metrics).
DuringWindow = Callable[[asyncio.Event], Coroutine[Any, Any, None]]


def make_session() -> aiohttp.ClientSession:
    connector = aiohttp.TCPConnector(limit=0, force_close=False)
    return aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=None, sock_read=600))


async def first_model(url: str, api_key: str | None) -> str:
    """The first model the target lists; raises TargetUnreachable with a clear message."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        async with (
            aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as s,
            s.get(url.rstrip("/") + "/v1/models", headers=headers) as resp,
        ):
            if resp.status != 200:
                raise TargetUnreachable(f"{url}/v1/models answered HTTP {resp.status}")
            data = await resp.json(content_type=None)
            return str(data["data"][0]["id"])
    except (aiohttp.ClientError, TimeoutError, OSError) as exc:
        raise TargetUnreachable(f"cannot reach {url}: {exc}") from None
    except (KeyError, IndexError, TypeError, ValueError):
        raise TargetUnreachable(f"{url}/v1/models did not list a model") from None


async def run_level(
    session: aiohttp.ClientSession,
    target: Target,
    concurrency: int,
    plan: LevelPlan,
    prompts: Iterator[Prompt],
    progress: Progress | None = None,
    min_requests: int = DEFAULT_MIN_REQUESTS,
    during_window: DuringWindow | None = None,
) -> tuple[LevelStats, list[RequestResult]]:
    results: list[RequestResult] = []
    # Requests started inside the window, as they finish: good ones, the streams they came from, failures.
    good, failed = 0, 0
    good_streams: set[int] = set()
    extending: list[float] = []  # [time the window passed duration_s] while it runs on
    first_done = 0
    errors = 0
    client_errors = 0
    stop = asyncio.Event()
    beside: list[asyncio.Task[None]] = []
    window: list[float] = []  # [t0] once measuring, [t0, t1] once done
    start = time.monotonic()

    def report(phase: str) -> None:
        if progress is not None:
            progress(phase, len(results), errors, client_errors)

    def phase() -> str:
        if stop.is_set():
            return "drain"
        if extending:
            return f"extended +{time.monotonic() - extending[0]:.0f} s"
        return "measure" if window else "warm-up"

    async def worker(stream: int) -> None:
        nonlocal first_done, errors, client_errors, good, failed
        counted_first = False
        while not stop.is_set():
            r = await stream_request(session, target, next(prompts))
            results.append(r)
            if window and r.started >= window[0]:
                if r.ok:
                    good += 1
                    good_streams.add(stream)
                else:
                    failed += 1
            if not counted_first:
                counted_first = True
                first_done += 1
            if not r.ok:
                if r.client_error:
                    client_errors += 1
                else:
                    errors += 1
                await asyncio.sleep(ERROR_BACKOFF_S)
            report(phase())

    def has_enough() -> bool:
        return enough(concurrency, min_requests, good, len(good_streams), failed)

    async def controller() -> None:
        deadline = start + plan.max_wait_s
        # Polling counters every 10 ms, bounded by the deadline, is simpler than an event per result.
        while (first_done < concurrency or time.monotonic() - start < plan.warmup_s) and time.monotonic() < deadline:  # noqa: ASYNC110
            await asyncio.sleep(0.01)
        t0 = time.monotonic()
        window.append(t0)
        if during_window is not None:
            beside.append(asyncio.create_task(during_window(stop)))
        if plan.requests is not None:
            while time.monotonic() < t0 + plan.max_wait_s:
                done = sum(1 for r in results if r.started >= t0)
                if done >= plan.requests:
                    break
                await asyncio.sleep(0.01)
        else:
            await asyncio.sleep(plan.duration_s or 0.0)
            if plan.extends and not has_enough():
                extending.append(time.monotonic())
                report(phase())
                while not has_enough() and time.monotonic() < t0 + (plan.max_duration_s or 0.0):  # noqa: ASYNC110
                    await asyncio.sleep(0.01)
        window.append(time.monotonic())
        stop.set()

    workers = [asyncio.create_task(worker(i)) for i in range(concurrency)]
    await controller()
    _, pending = await asyncio.wait(workers, timeout=plan.max_wait_s)
    for task in pending:
        task.cancel()
    await asyncio.gather(*pending, return_exceptions=True)
    for task in beside:
        await task
    report("done")
    stats = summarize(concurrency, results, window[0], window[1], min_requests)
    if extending:
        stats = dataclasses.replace(stats, extended_s=window[1] - extending[0])
    return stats, results
