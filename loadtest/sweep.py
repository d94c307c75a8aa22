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

What a stream sends is its workload's script (workload.py): the next prompt, or the next turn of a
conversation after a think time, with the reply sent back to it as received.
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
import time
from collections.abc import Callable, Coroutine, Mapping
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from .classes import Slo, summarise_by_class
from .client import RequestResult, Target, stream_request
from .stats import DEFAULT_MIN_REQUESTS, LevelStats, min_ok_requests, summarize
from .workload import Workload

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
    # With duration_s: the window may also run on up to this many times the longest request of the
    # warm-up, where that is longer than max_duration_s (0: never). At long contexts and many streams
    # a request (queued for the KV pool) can take longer than any fixed bound made for short ones.
    max_duration_per_request: float = 0.0

    @property
    def extends(self) -> bool:
        """Whether a window may run on past duration_s."""
        longer = (self.max_duration_s or 0.0) > (self.duration_s or 0.0) or self.max_duration_per_request > 0
        return self.duration_s is not None and longer

    def window_bound(self, warmup_request_s: float) -> float:
        """The longest a window may run, given the warm-up's longest request."""
        return max(self.max_duration_s or 0.0, self.duration_s or 0.0, self.max_duration_per_request * warmup_request_s)


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


@dataclass
class _Level:
    """One level's run: its streams, the window they are measured in and what they recorded."""

    session: aiohttp.ClientSession
    target: Target
    concurrency: int
    plan: LevelPlan
    workload: Workload
    progress: Progress | None
    min_requests: int
    results: list[RequestResult] = field(default_factory=list)
    # Requests started inside the window, as they finish: good ones, the streams they came from, failures.
    good: int = 0
    failed: int = 0
    good_streams: set[int] = field(default_factory=set)
    extending: list[float] = field(default_factory=list)  # [time the window passed duration_s] while it runs on
    first_done: int = 0
    errors: int = 0
    client_errors: int = 0
    stop: asyncio.Event = field(default_factory=asyncio.Event)
    window: list[float] = field(default_factory=list)  # [t0] once measuring, [t0, t1] once done
    start: float = field(default_factory=time.monotonic)

    def report(self, phase: str) -> None:
        if self.progress is not None:
            self.progress(phase, len(self.results), self.errors, self.client_errors)

    def phase(self) -> str:
        if self.stop.is_set():
            return "drain"
        if self.extending:
            return f"extended +{time.monotonic() - self.extending[0]:.0f} s"
        return "measure" if self.window else "warm-up"

    async def worker(self, stream: int) -> None:
        counted_first = False
        mine = self.target.for_stream(stream)
        script = self.workload.stream(stream)
        reply: str | None = None  # the first send starts the script, which receives nothing
        while not self.stop.is_set():
            # Drawn when it is sent, as the prompts of a sweep always were.
            turn = script.send(reply)
            if turn.think_s > 0 and await self.stopped_within(turn.think_s):
                break
            text: list[str] | None = [] if turn.keep_reply else None
            headers = mine.headers(turn.traffic_class, turn.session) if mine.tag_requests else None
            target = mine.for_class(turn.traffic_class)
            r = await stream_request(self.session, target, turn.prompt, text_sink=text, headers=headers)
            r.traffic_class, r.session, r.turn = turn.traffic_class, turn.session, turn.turn
            self.results.append(r)
            reply = ("".join(text) if text is not None else "") if r.ok else None
            if self.window and r.started >= self.window[0]:
                if r.ok:
                    self.good += 1
                    self.good_streams.add(stream)
                else:
                    self.failed += 1
            if not counted_first:
                counted_first = True
                self.first_done += 1
            if not r.ok:
                if r.client_error:
                    self.client_errors += 1
                else:
                    self.errors += 1
                await asyncio.sleep(ERROR_BACKOFF_S)
            self.report(self.phase())

    async def stopped_within(self, seconds: float) -> bool:
        """Waits `seconds` (a user thinking), or less if the level stops meanwhile; whether it did."""
        try:
            await asyncio.wait_for(self.stop.wait(), seconds)
        except TimeoutError:
            return False
        return True

    def has_enough(self) -> bool:
        return enough(self.concurrency, self.min_requests, self.good, len(self.good_streams), self.failed)

    async def warm_up(self) -> None:
        """Until every stream finished one request and the least warm-up passed (or the wait ran out)."""
        deadline = self.start + self.plan.max_wait_s

        def warming() -> bool:
            return self.first_done < self.concurrency or time.monotonic() - self.start < self.plan.warmup_s

        # Polling counters every 10 ms, bounded by the deadline, is simpler than an event per result.
        while warming() and time.monotonic() < deadline:  # noqa: ASYNC110
            await asyncio.sleep(0.01)

    async def measure(self, t0: float) -> None:
        """The window from t0: --requests of them, or --duration-s run on until the level has enough."""
        plan = self.plan
        if plan.requests is not None:
            while time.monotonic() < t0 + plan.max_wait_s:
                done = sum(1 for r in self.results if r.started >= t0)
                if done >= plan.requests:
                    break
                await asyncio.sleep(0.01)
            return
        bound = plan.window_bound(max((r.latency for r in self.results if r.ok and r.finished <= t0), default=0.0))
        await asyncio.sleep(plan.duration_s or 0.0)
        if plan.extends and not self.has_enough():
            self.extending.append(time.monotonic())
            self.report(self.phase())
            while not self.has_enough() and time.monotonic() < t0 + bound:  # noqa: ASYNC110
                await asyncio.sleep(0.01)


@dataclass(frozen=True)
class LevelRun:
    """What one level recorded: every request, and the measurement window [t0, t1]."""

    results: list[RequestResult]
    t0: float
    t1: float
    # How long the window ran past its planned length (0: it did not).
    extended_s: float = 0.0
    # Streams the load tester itself lost to an exception (its failure, not the server's): a level
    # that ran at fewer streams than it says is inconclusive.
    died: tuple[str, ...] = ()


async def measure_level(
    session: aiohttp.ClientSession,
    target: Target,
    concurrency: int,
    plan: LevelPlan,
    workload: Workload,
    progress: Progress | None = None,
    min_requests: int = DEFAULT_MIN_REQUESTS,
    during_window: DuringWindow | None = None,
) -> LevelRun:
    """One level: `concurrency` streams of `workload` warmed up, measured and drained."""
    level = _Level(session, target, concurrency, plan, workload, progress, min_requests)
    workers = [asyncio.create_task(level.worker(i)) for i in range(concurrency)]
    beside: asyncio.Task[None] | None = None
    try:
        await level.warm_up()
        t0 = time.monotonic()
        level.window.append(t0)
        beside = None if during_window is None else asyncio.create_task(during_window(level.stop))
        await level.measure(t0)
        level.window.append(time.monotonic())
        level.stop.set()
        died = await _drain(workers, plan.max_wait_s)
        if beside is not None:
            await beside
    finally:
        # Interrupted (Ctrl-C): the streams and the sampler stop now, their requests cut, rather than
        # when the event loop closes; after a normal end every one of them is done already.
        for task in (*workers, *([beside] if beside is not None else [])):
            task.cancel()
    level.report("done")
    extended = level.window[1] - level.extending[0] if level.extending else 0.0
    return LevelRun(level.results, level.window[0], level.window[1], extended, died)


async def measure_together(
    session: aiohttp.ClientSession,
    targets: Mapping[str, Target],
    concurrency: int,
    plan: LevelPlan,
    workloads: Mapping[str, Workload],
    min_requests: int = DEFAULT_MIN_REQUESTS,
) -> dict[str, LevelRun]:
    """One level of several targets side by side, `concurrency` streams each, in one window: it
    opens once every target has warmed up, runs duration_s and on (max_duration_s at most) until
    every target has enough, and closes for all at once; every target stays loaded until then, so
    none is measured alone on a quieter machine, nor over another stretch of the run."""
    if plan.requests is not None:
        raise ValueError("measure_together measures windows of duration_s, not of --requests")
    levels = {
        name: _Level(session, target, concurrency, plan, workloads[name], None, min_requests)
        for name, target in targets.items()
    }
    workers = {
        name: [asyncio.create_task(level.worker(i)) for i in range(concurrency)] for name, level in levels.items()
    }
    await asyncio.gather(*(level.warm_up() for level in levels.values()))
    t0 = time.monotonic()
    for level in levels.values():
        level.window.append(t0)
    await asyncio.sleep(plan.duration_s or 0.0)
    extended_at = None
    if plan.extends and not all(level.has_enough() for level in levels.values()):
        extended_at = time.monotonic()
        end = t0 + (plan.max_duration_s or 0.0)
        while not all(level.has_enough() for level in levels.values()) and time.monotonic() < end:  # noqa: ASYNC110
            await asyncio.sleep(0.01)
    t1 = time.monotonic()
    for level in levels.values():
        level.window.append(t1)
        level.stop.set()
    await _drain([task for tasks in workers.values() for task in tasks], plan.max_wait_s)
    extended = 0.0 if extended_at is None else t1 - extended_at
    # A lost stream is the load tester's, and its target's level ran short: that one is told.
    return {name: LevelRun(level.results, t0, t1, extended, _died(workers[name])) for name, level in levels.items()}


async def _drain(workers: list[asyncio.Task[None]], max_wait_s: float) -> tuple[str, ...]:
    """Wait for the streams to finish their requests in flight (at most `max_wait_s`); what any
    stream died of (_died)."""
    _, pending = await asyncio.wait(workers, timeout=max_wait_s)
    for task in pending:
        task.cancel()
    await asyncio.gather(*pending, return_exceptions=True)
    return _died(workers)


def _died(workers: list[asyncio.Task[None]]) -> tuple[str, ...]:
    """What each of these finished streams died of, as `Type: message`."""
    died = []
    for task in workers:
        if task.done() and not task.cancelled() and (exc := task.exception()) is not None:
            died.append(f"{type(exc).__name__}: {exc}"[:300])
    return tuple(died)


async def run_level(
    session: aiohttp.ClientSession,
    target: Target,
    concurrency: int,
    plan: LevelPlan,
    workload: Workload,
    progress: Progress | None = None,
    min_requests: int = DEFAULT_MIN_REQUESTS,
    during_window: DuringWindow | None = None,
    slo: Slo | None = None,
) -> tuple[LevelStats, list[RequestResult]]:
    run = await measure_level(session, target, concurrency, plan, workload, progress, min_requests, during_window)
    return level_stats(concurrency, run, min_requests, slo), run.results


def level_stats(concurrency: int, run: LevelRun, min_requests: int, slo: Slo | None = None) -> LevelStats:
    """The level's summary, with one per traffic class."""
    stats = summarize(concurrency, run.results, run.t0, run.t1, min_requests)
    classes = summarise_by_class(run.results, run.t0, run.t1, slo)
    stats = dataclasses.replace(stats, extended_s=run.extended_s, classes=classes)
    if run.died:
        # The load tester's own failure: said as a client error, and the level judged by no one.
        samples = (*stats.client_error_samples, *run.died)[:5]
        stats = dataclasses.replace(stats, conclusive=False, client_error_samples=samples)
    return stats
