"""Chaos soak: specgate and two simulators under mixed load while servers die, stall and fail.

    python -m loadtest chaos [--phase-s 20] [--concurrency 12] [--time-scale 20]

Phases, each --phase-s long, under a mixed workload (streaming and not, chat and completions,
varied lengths, load crossing the watermarks, a share of clients leaving mid-stream):
steady; speculative killed then restarted; baseline killed then restarted; faults (the
speculative server restarted with --stall-rate and --fail-rate); both down briefly; recovery.

Every request must end well-formed or with a clear error; errors are allowed only where the
phase explains them. At the end nothing may be left in flight (proxy and servers), the routing
mode must be back to speculative, every client disconnect must have aborted its generation, and
the proxy's memory after 10 N requests must match that after N. Bounded in time and count.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import orjson

from proxy.fleet import promtext

from .kit.settings import specgate_env
from .procs import Proc, free_port, simulator_args, start
from .report import write_json

PHASES = ("steady", "kill_speculative", "kill_baseline", "faults", "both_down", "recovery")
# Outcomes that are fine in any phase.
ALWAYS_OK = {"ok", "disconnected", "server_error", "stream_error", "timeout"}
# Outcomes a phase explains: no server at all, or both failing before the first byte.
EXPLAINED = {"both_down": {"no_backend", "upstream_failed"}}


@dataclass
class ChaosReport:
    requests: int = 0
    outcomes: Counter[str] = field(default_factory=Counter)
    by_phase: dict[str, Counter[str]] = field(default_factory=dict)
    violations: list[str] = field(default_factory=list)
    kills: int = 0
    failovers: float = 0.0
    proxy_client_disconnects: float = 0.0
    disconnects_steady: int = 0
    aborted_steady: float = 0.0
    leaks: dict[str, float] = field(default_factory=dict)
    rss_after_n_mib: float = 0.0
    rss_after_10n_mib: float = 0.0
    memory_requests: int = 0

    @property
    def ok(self) -> bool:
        return not self.violations

    def to_dict(self) -> dict[str, Any]:
        # By hand: dataclasses.asdict would rebuild each Counter from its (key, count) pairs.
        out = {k: v for k, v in vars(self).items() if k not in ("outcomes", "by_phase")}
        out["outcomes"] = dict(self.outcomes)
        out["by_phase"] = {name: dict(counts) for name, counts in self.by_phase.items()}
        out["violations"] = sorted(set(self.violations))
        return out


async def _metric(session: aiohttp.ClientSession, url: str, name: str) -> float:
    async with session.get(url + "/metrics") as r:
        text = await r.text()
    return promtext.totals(text, (name,)).get(name, 0.0)


async def one_request(session: aiohttp.ClientSession, url: str, rng: random.Random, timeout_s: float) -> str:
    """Send one random request; return its outcome class."""
    stream = rng.random() < 0.7
    chat = rng.random() < 0.5
    max_tokens = rng.choice([1, 4, 16, 48, 96])
    leave_after = 2 if stream and max_tokens >= 48 and rng.random() < 0.15 else None
    body: dict[str, Any] = {"model": "m", "max_tokens": max_tokens, "stream": stream}
    body.update({"messages": [{"role": "user", "content": "x" * rng.randint(1, 400)}]} if chat else
                {"prompt": "y" * rng.randint(1, 400)})  # fmt: skip
    if stream and rng.random() < 0.5:
        body["stream_options"] = {"include_usage": True}
    path = "/v1/chat/completions" if chat else "/v1/completions"
    try:
        async with asyncio.timeout(timeout_s), session.post(url + path, json=body) as resp:
            if resp.status != 200:
                payload = await resp.read()
                return _classify_error(resp.status, payload)
            if not stream:
                data = orjson.loads(await resp.read())
                return "ok" if data.get("choices") else "malformed"
            events = 0
            async for raw in resp.content:
                line = raw.strip()
                if not line:
                    continue
                if not line.startswith(b"data: "):
                    return "malformed"
                events += 1
                if line == b"data: [DONE]":
                    return "ok"
                if b'"error"' in line:
                    rest = [x.strip() async for x in resp.content if x.strip()]
                    return "stream_error" if rest == [b"data: [DONE]"] else "malformed"
                if leave_after is not None and events >= leave_after:
                    return "disconnected"  # leaving the block closes the connection
            return "malformed"  # ended without [DONE]
    except TimeoutError:
        return "hung"
    except (aiohttp.ClientError, orjson.JSONDecodeError, ValueError):
        return "broken"


def _classify_error(status: int, payload: bytes) -> str:
    try:
        body = orjson.loads(payload)
    except orjson.JSONDecodeError:
        return "malformed"
    if isinstance(body, dict) and isinstance(body.get("error"), dict):
        code = body["error"].get("code")
        return {503: "no_backend", 502: "upstream_failed", 504: "timeout"}.get(status, f"proxy_{status}_{code}")
    if isinstance(body, dict) and body.get("object") == "error":
        return "server_error"  # the server's own answer, passed through
    return "malformed"


@dataclass
class _Cluster:
    spec_port: int
    base_port: int
    sim_flags: tuple[str, ...]
    procs: dict[str, Proc] = field(default_factory=dict)

    def start_sim(self, role: str, *extra: str) -> None:
        port = self.spec_port if role == "speculative" else self.base_port
        args = simulator_args(role, port, *self.sim_flags, *extra)
        self.procs[role] = start(f"sim-{role}", args, ready_url=f"http://127.0.0.1:{port}/health")

    def kill(self, role: str) -> None:
        self.procs[role].stop(timeout_s=5)


@dataclass
class _Soak:
    """One chaos run: its servers, specgate, the client session and the report it fills."""

    cluster: _Cluster
    session: aiohttp.ClientSession
    url: str
    report: ChaosReport
    seed: int
    read_timeout: float
    phase: str = PHASES[0]
    stop: asyncio.Event = field(default_factory=asyncio.Event)

    async def worker(self, wid: int) -> None:
        wrng = random.Random(self.seed * 1000 + wid)
        report = self.report
        while not self.stop.is_set():
            name = self.phase
            outcome = await one_request(self.session, self.url, wrng, timeout_s=self.read_timeout * 4 + 5)
            report.requests += 1
            report.outcomes[outcome] += 1
            report.by_phase.setdefault(name, Counter())[outcome] += 1
            if name == "steady" and outcome == "disconnected":
                report.disconnects_steady += 1
            if outcome not in ALWAYS_OK and outcome not in EXPLAINED.get(name, set()):
                report.violations.append(f"{name}: {outcome}")
            # Vary the load so it crosses the watermarks both ways.
            await asyncio.sleep(wrng.choice([0, 0, 0.01, 0.05, 0.2]))

    async def sims_aborted(self) -> float:
        total = 0.0
        for port in (self.cluster.spec_port, self.cluster.base_port):
            total += await _metric(self.session, f"http://127.0.0.1:{port}", "sglang:num_aborted_requests_total")
        return total

    async def phases(self, phase_s: float) -> None:
        """Steady, each server killed and restarted, a faulty speculative server, both down, recovery."""
        cluster, report = self.cluster, self.report
        loop = asyncio.get_running_loop()
        aborted0 = await self.sims_aborted()
        await asyncio.sleep(phase_s)
        # Let the steady phase's streams end before reading the abort counters.
        self.phase = "settle"
        await asyncio.sleep(0.5)
        report.aborted_steady = await self.sims_aborted() - aborted0
        for role in ("speculative", "baseline"):
            self.phase = f"kill_{role}"
            await loop.run_in_executor(None, cluster.kill, role)
            report.kills += 1
            await asyncio.sleep(phase_s / 2)
            await loop.run_in_executor(None, cluster.start_sim, role)
            await asyncio.sleep(phase_s / 2)
        self.phase = "faults"
        await loop.run_in_executor(None, cluster.kill, "speculative")
        report.kills += 1
        faulty = ("--stall-rate", "0.1", "--fail-rate", "0.1", "--seed", str(self.seed))
        await loop.run_in_executor(None, lambda: cluster.start_sim("speculative", *faulty))  # fmt: skip
        await asyncio.sleep(phase_s)
        self.phase = "both_down"
        for role in ("speculative", "baseline"):
            await loop.run_in_executor(None, cluster.kill, role)
            report.kills += 1
        await asyncio.sleep(min(1.0, phase_s / 2))
        for role in ("speculative", "baseline"):
            await loop.run_in_executor(None, cluster.start_sim, role)
        self.phase = "recovery"
        await asyncio.sleep(phase_s)

    async def leaks(self) -> dict[str, float]:
        """Nothing left behind: proxy counts, servers' running requests, routing mode (5 s to drain)."""
        deadline = time.monotonic() + 5
        while True:
            async with self.session.get(self.url + "/routing") as r:
                routing = await r.json()
            loads = []
            for port in (self.cluster.spec_port, self.cluster.base_port):
                async with self.session.get(f"http://127.0.0.1:{port}/get_load") as r:
                    loads.append((await r.json())[0]["num_reqs"])
            leaks = {"proxy_inflight": routing["inflight"], "server_running": sum(loads),
                     "mode_not_speculative": 0 if routing["mode"] == "speculative" else 1}  # fmt: skip
            if not any(leaks.values()) or time.monotonic() > deadline:
                return leaks
            await asyncio.sleep(0.1)

    async def burst(self, n: int) -> None:
        async def w(k: int) -> None:
            for _ in range(k):
                async with self.session.post(self.url + "/v1/completions", json={"prompt": "p", "max_tokens": 2}) as r:
                    await r.read()

        await asyncio.gather(*(w(n // 10) for _ in range(10)))


async def run_chaos(phase_s: float = 3.0, concurrency: int = 12, time_scale: float = 20.0, seed: int = 0,
                    memory_requests: int = 200) -> ChaosReport:  # fmt: skip
    report = ChaosReport()
    cluster = _Cluster(free_port(), free_port(), ("--time-scale", str(time_scale), "--live-gauges"))
    proxy_port = free_port()
    url = f"http://127.0.0.1:{proxy_port}"
    read_timeout = 1.0
    env = specgate_env(
        proxy_port,
        f"http://127.0.0.1:{cluster.spec_port}",
        f"http://127.0.0.1:{cluster.base_port}",
        log_level="error",
        high_watermark=max(2, concurrency // 2),
        low_watermark=max(1, concurrency // 4),
        read_timeout_s=read_timeout,
        health_interval_s=0.2,
        connect_timeout_s=1,
    )
    proxy: Proc | None = None
    try:
        cluster.start_sim("speculative")
        cluster.start_sim("baseline")
        proxy = start("specgate", ["-m", "proxy"], ready_url=url + "/ready", env=env)
        connector = aiohttp.TCPConnector(limit=0)
        async with aiohttp.ClientSession(connector=connector) as session:
            soak = _Soak(cluster, session, url, report, seed, read_timeout)
            workers = [asyncio.create_task(soak.worker(i)) for i in range(concurrency)]
            await soak.phases(phase_s)
            soak.stop.set()
            await asyncio.wait(workers, timeout=read_timeout * 4 + 10)
            report.leaks = await soak.leaks()
            report.failovers = await _metric(session, url, "specgate_failovers_total")
            report.proxy_client_disconnects = await _metric(session, url, "specgate_client_disconnects_total")
            # Memory: flat between N and 10 N further requests.
            await soak.burst(memory_requests)
            report.rss_after_n_mib = proxy.rss_mib()
            await soak.burst(memory_requests * 9)
            report.rss_after_10n_mib = proxy.rss_mib()
            report.memory_requests = memory_requests * 10
    finally:
        if proxy is not None:
            proxy.stop()
        for proc in cluster.procs.values():
            proc.stop()
    _judge(report)
    return report


def _judge(report: ChaosReport) -> None:
    """The violations the run's end shows: leaks, unaborted disconnects, memory growth, no success."""
    for name, value in report.leaks.items():
        if value:
            report.violations.append(f"leak: {name} = {value}")
    if report.aborted_steady < report.disconnects_steady:
        report.violations.append(f"{report.disconnects_steady} disconnects but {report.aborted_steady:.0f} aborts")
    if report.rss_after_10n_mib - report.rss_after_n_mib > 20:
        report.violations.append(f"memory grew {report.rss_after_10n_mib - report.rss_after_n_mib:.1f} MiB")
    if report.outcomes["ok"] == 0:
        report.violations.append("no request succeeded")


def format_report(r: ChaosReport) -> str:
    lines = [f"requests {r.requests}, kills {r.kills}, failovers (retries) {r.failovers:.0f}, "
             f"client disconnects {r.proxy_client_disconnects:.0f}"]  # fmt: skip
    lines.append("outcomes: " + ", ".join(f"{k} {v}" for k, v in sorted(r.outcomes.items())))
    for name, counts in r.by_phase.items():
        lines.append(f"  {name:17} " + ", ".join(f"{k} {v}" for k, v in sorted(counts.items())))
    lines.append(f"steady phase: {r.disconnects_steady} client disconnects, {r.aborted_steady:.0f} generations aborted")
    lines.append("leaks: " + ", ".join(f"{k} {v:g}" for k, v in r.leaks.items()))
    growth = r.rss_after_10n_mib - r.rss_after_n_mib
    lines.append(f"proxy RSS {r.rss_after_n_mib:.1f} MiB after N, {r.rss_after_10n_mib:.1f} MiB after 10 N "
                 f"({growth:+.1f} MiB over {r.memory_requests * 9 // 10} requests)")  # fmt: skip
    lines.append("PASS" if r.ok else "FAIL:\n  " + "\n  ".join(sorted(set(r.violations))))
    return "\n".join(lines)


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    chaos = sub.add_parser("chaos", help="soak specgate and simulators while servers die, stall and fail")
    chaos.add_argument("--phase-s", type=float, default=20.0, help="length of each of the six phases")
    chaos.add_argument("--concurrency", type=int, default=12)
    chaos.add_argument("--time-scale", type=float, default=20.0)
    chaos.add_argument("--seed", type=int, default=0)
    chaos.add_argument("--memory-requests", type=int, default=500, help="N of the N vs 10 N memory check")
    chaos.add_argument("--out", default=None, help="write the report as JSON here")


def cmd_chaos(args: argparse.Namespace) -> int:
    report = asyncio.run(run_chaos(args.phase_s, args.concurrency, args.time_scale, args.seed, args.memory_requests))
    print(format_report(report))
    if args.out:
        write_json(args.out, {"settings": vars(args), "report": report.to_dict(), "ok": report.ok})
    return 0 if report.ok else 1
