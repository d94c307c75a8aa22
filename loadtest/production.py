"""Production traffic against one URL from code (a head-to-head benchmark's building block):
`run_workload` drives one level of a workload with the sweep's machinery (warm-up, window, drain)
and returns every request, tagged with its class, session, turn and cached tokens, and the window;
`classes.summarise_by_class` summarises them.

    spec = WorkloadSpec("multiturn", classes=(TrafficClass("chat", 0.7, "diverse"),
                                              TrafficClass("code", 0.3, "repetitive")))
    run = await run_workload(url, model, spec, concurrency=32, duration_s=60)
    by_class = run.by_class(Slo(ttft_ms=2000, tpot_ms=50))
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import aiohttp

from .classes import ClassSummary, Slo, summarise_by_class
from .client import RequestResult, Target
from .stats import DEFAULT_MIN_REQUESTS, LevelStats
from .sweep import LevelPlan, LevelRun, level_stats, make_session, measure_level
from .textbank import TextBank
from .workload import Workload, WorkloadSpec


@dataclass(frozen=True)
class WorkloadRun:
    """One level's requests (warm-up and drain included) and its measurement window [t0, t1]."""

    results: list[RequestResult]
    t0: float
    t1: float
    concurrency: int
    extended_s: float = 0.0
    # What streams of the load tester died of (sweep.LevelRun.died).
    died: tuple[str, ...] = ()

    def by_class(self, slo: Slo | None = None) -> dict[str, ClassSummary]:
        return summarise_by_class(self.results, self.t0, self.t1, slo)

    def stats(self, slo: Slo | None = None, min_requests: int = DEFAULT_MIN_REQUESTS) -> LevelStats:
        """The level's figures as a sweep reports them, with the classes'."""
        run = LevelRun(self.results, self.t0, self.t1, self.extended_s, self.died)
        return level_stats(self.concurrency, run, min_requests, slo)


async def run_workload(
    url: str,
    model: str,
    workload_spec: WorkloadSpec,
    concurrency: int,
    duration_s: float,
    *,
    max_tokens: int = 512,
    warmup_s: float = 0.0,
    chat: bool = True,
    api_key: str | None = None,
    ignore_eos: bool = True,
    extra_body: Mapping[str, Any] | None = None,
    session: aiohttp.ClientSession | None = None,
    bank: TextBank | None = None,
) -> WorkloadRun:
    """`concurrency` closed-loop streams of the workload against `url` for a window of `duration_s`
    (after a warm-up until every stream finished a request, and at least `warmup_s`), then the
    requests in flight drained. Think times are the spec's, in wall-clock seconds. Pass one `bank`
    to several runs to build the text pieces once; a `session` to share connections."""
    if concurrency < 1 or duration_s <= 0:
        raise ValueError("concurrency must be >= 1 and duration_s > 0")
    target = Target(url, model, chat=chat, api_key=api_key, max_tokens=max_tokens, ignore_eos=ignore_eos,
                    extra_body=extra_body or {})  # fmt: skip
    plan = LevelPlan(duration_s=duration_s, warmup_s=warmup_s)
    workload = Workload(workload_spec, bank)
    if session is not None:
        run = await measure_level(session, target, concurrency, plan, workload, min_requests=0)
    else:
        async with make_session() as own:
            run = await measure_level(own, target, concurrency, plan, workload, min_requests=0)
    return WorkloadRun(run.results, run.t0, run.t1, concurrency, run.extended_s, run.died)
