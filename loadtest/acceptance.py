"""The speculative server's acceptance length during a sweep, read from its `/metrics`.

The engine is told by its metric names (proxy/fleet/engines.py, the adapters specgate itself uses):

- SGLang exports a gauge, refreshed every 40 decode steps and frozen while idle: it is read every
  `poll_s` inside the level's measurement window and at the window's end, and the level's value is
  the mean of those readings (the window's start is not read: the gauge may still show the load
  before). A level shorter than 40 decode steps reads what the steps before it left.
- vLLM and llama.cpp export counters of accepted draft tokens and of drafts: the level's value is
  1 + d(accepted) / d(drafts) between the window's start and end.

None where the server reports no acceptance (no /metrics, an engine it cannot tell, a gauge of 0
as a server without speculation shows, no drafts in the window); `reason` says why, for the user.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
from collections.abc import Mapping

import aiohttp

from proxy.fleet import promtext
from proxy.fleet.adapter import Engine
from proxy.fleet.engines import detect

POLL_S = 1.0
SCRAPE_TIMEOUT_S = 5.0


class MetricsUnavailable(Exception):
    pass


def redact(url: str) -> str:
    """The URL without credentials in it."""
    scheme, sep, rest = url.partition("://")
    return f"{scheme}{sep}{rest.rsplit('@', 1)[-1]}" if sep else url


class AcceptanceMeter:
    """Acceptance length per level, from one server's /metrics. `open()` first, then pass
    `during_window` to the sweep for each of that server's levels; `close()` at the end."""

    def __init__(self, url: str, api_key: str | None = None, poll_s: float = POLL_S) -> None:
        self.metrics_url = url.rstrip("/") + "/metrics"
        self._headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._poll_s = poll_s
        self._session: aiohttp.ClientSession | None = None
        self.engine: Engine | None = None
        # Why nothing is (or was) measured; None while it may be.
        self.reason: str | None = None
        self.by_level: dict[int, float | None] = {}

    async def open(self) -> None:
        """Scrape once to tell the engine; on failure `reason` says why and nothing is measured."""
        self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=SCRAPE_TIMEOUT_S))
        try:
            values = await self._scrape()
        except MetricsUnavailable as exc:
            self.reason = str(exc)
            return
        engine = detect(values)
        if engine is None:
            self.reason = f"{redact(self.metrics_url)} has no metrics of SGLang, vLLM or llama.cpp"
        elif engine.accept_gauge is None and engine.accepted_counter is None:
            self.reason = f"{engine.name} reports no acceptance"
        else:
            self.engine = engine

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()

    @property
    def source(self) -> str:
        """How acceptance was measured, or why not."""
        e = self.engine
        if e is None or self.reason is not None:
            return f"not measured: {self.reason}"
        if e.accepted_counter is not None:
            return f"1 + d({e.prefixes[0]}{e.accepted_counter}) / d({e.prefixes[0]}{e.drafts_counter}) over each window"
        return f"{e.prefixes[0]}{e.accept_gauge}: mean of readings every {self._poll_s:g} s in each window"

    def finish(self) -> None:
        """After the sweep: say why when no level reported any acceptance."""
        if self.reason is None and not any(v is not None for v in self.by_level.values()):
            name = self.engine.name if self.engine else "the server"
            self.reason = (
                f"{redact(self.metrics_url)} ({name}) reported no acceptance during the sweep "
                "(is speculative decoding on?)"
            )

    async def during_window(self, concurrency: int, window_end: asyncio.Event) -> None:
        """Runs from a level's window start until `window_end` is set; records `by_level[concurrency]`."""
        engine = self.engine
        if engine is None:
            return
        first = await self._read()
        readings: list[float] = []
        last: Mapping[str, float] | None = None
        ended = False
        while not ended:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(window_end.wait(), self._poll_s)
                ended = True
            values = await self._read()
            if values is None:
                continue
            last = values
            gauge = engine.accept_gauge_value(values)
            if gauge is not None:
                readings.append(gauge)
        self.by_level[concurrency] = level_acceptance(engine, first, last, readings)

    async def _read(self) -> Mapping[str, float] | None:
        try:
            return await self._scrape()
        except MetricsUnavailable:
            return None  # one missed reading; the others stand

    async def _scrape(self) -> dict[str, float]:
        assert self._session is not None, "open() first"
        where = redact(self.metrics_url)
        try:
            async with self._session.get(self.metrics_url, headers=self._headers) as resp:
                if resp.status == 404:
                    raise MetricsUnavailable(f"{where} answered 404 (SGLang serves it with --enable-metrics)")
                if resp.status != 200:
                    raise MetricsUnavailable(f"{where} answered HTTP {resp.status}")
                text = await resp.text()
        except (aiohttp.ClientError, TimeoutError, OSError) as exc:
            raise MetricsUnavailable(f"cannot reach {where}: {exc or type(exc).__name__}") from None
        try:
            return promtext.totals(text)
        except ValueError:
            raise MetricsUnavailable(f"{where} is not Prometheus text") from None


def level_acceptance(
    engine: Engine,
    first: Mapping[str, float] | None,
    last: Mapping[str, float] | None,
    gauge_readings: list[float],
) -> float | None:
    """One level's acceptance: the counters' rate over the window where the engine has them, else the
    mean of the gauge's readings; None when neither says anything."""
    start = engine.accept_counters(first) if first is not None else None
    end = engine.accept_counters(last) if last is not None else None
    if start is not None and end is not None:
        accepted, drafts = end[0] - start[0], end[1] - start[1]
        # No drafts in the window, or counters that went back (a restart): nothing measured.
        if drafts > 0 and accepted >= 0:
            return 1.0 + accepted / drafts
        return None
    if gauge_readings:
        return math.fsum(gauge_readings) / len(gauge_readings)
    return None
