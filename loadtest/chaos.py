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

from proxy import promtext

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


async def run_chaos(phase_s: float = 3.0, concurrency: int = 12, time_scale: float = 20.0, seed: int = 0,
                    memory_requests: int = 200) -> ChaosReport:  # fmt: skip
    report = ChaosReport()
    cluster = _Cluster(free_port(), free_port(), ("--time-scale", str(time_scale), "--live-gauges"))
    proxy_port = free_port()
    url = f"http://127.0.0.1:{proxy_port}"
    read_timeout = 1.0
    env = {"SPECGATE_HOST": "127.0.0.1", "SPECGATE_PORT": str(proxy_port), "SPECGATE_LOG_LEVEL": "error",
           "SPECGATE_SPECULATIVE_URL": f"http://127.0.0.1:{cluster.spec_port}",
           "SPECGATE_BASELINE_URL": f"http://127.0.0.1:{cluster.base_port}",
           "SPECGATE_HIGH_WATERMARK": str(max(2, concurrency // 2)),
           "SPECGATE_LOW_WATERMARK": str(max(1, concurrency // 4)),
           "SPECGATE_READ_TIMEOUT_S": str(read_timeout), "SPECGATE_HEALTH_INTERVAL_S": "0.2",
           "SPECGATE_CONNECT_TIMEOUT_S": "1"}  # fmt: skip
    proxy: Proc | None = None
    try:
        cluster.start_sim("speculative")
        cluster.start_sim("baseline")
        proxy = start("specgate", ["-m", "proxy"], ready_url=url + "/ready", env=env)
        connector = aiohttp.TCPConnector(limit=0)
        async with aiohttp.ClientSession(connector=connector) as session:
            phase = {"name": PHASES[0]}
            stop = asyncio.Event()

            async def worker(wid: int) -> None:
                wrng = random.Random(seed * 1000 + wid)
                while not stop.is_set():
                    name = phase["name"]
                    outcome = await one_request(session, url, wrng, timeout_s=read_timeout * 4 + 5)
                    report.requests += 1
                    report.outcomes[outcome] += 1
                    report.by_phase.setdefault(name, Counter())[outcome] += 1
                    if name == "steady" and outcome == "disconnected":
                        report.disconnects_steady += 1
                    if outcome not in ALWAYS_OK and outcome not in EXPLAINED.get(name, set()):
                        report.violations.append(f"{name}: {outcome}")
                    # Vary the load so it crosses the watermarks both ways.
                    await asyncio.sleep(wrng.choice([0, 0, 0.01, 0.05, 0.2]))

            async def sims_aborted() -> float:
                total = 0.0
                for port in (cluster.spec_port, cluster.base_port):
                    total += await _metric(session, f"http://127.0.0.1:{port}", "sglang:num_aborted_requests_total")
                return total

            aborted0 = await sims_aborted()
            workers = [asyncio.create_task(worker(i)) for i in range(concurrency)]
            loop = asyncio.get_running_loop()
            await asyncio.sleep(phase_s)
            # Let the steady phase's streams end before reading the abort counters.
            phase["name"] = "settle"
            await asyncio.sleep(0.5)
            report.aborted_steady = await sims_aborted() - aborted0
            for role in ("speculative", "baseline"):
                phase["name"] = f"kill_{role}"
                await loop.run_in_executor(None, cluster.kill, role)
                report.kills += 1
                await asyncio.sleep(phase_s / 2)
                await loop.run_in_executor(None, cluster.start_sim, role)
                await asyncio.sleep(phase_s / 2)
            phase["name"] = "faults"
            await loop.run_in_executor(None, cluster.kill, "speculative")
            report.kills += 1
            faulty = ("--stall-rate", "0.1", "--fail-rate", "0.1", "--seed", str(seed))
            await loop.run_in_executor(None, lambda: cluster.start_sim("speculative", *faulty))  # fmt: skip
            await asyncio.sleep(phase_s)
            phase["name"] = "both_down"
            for role in ("speculative", "baseline"):
                await loop.run_in_executor(None, cluster.kill, role)
                report.kills += 1
            await asyncio.sleep(min(1.0, phase_s / 2))
            for role in ("speculative", "baseline"):
                await loop.run_in_executor(None, cluster.start_sim, role)
            phase["name"] = "recovery"
            await asyncio.sleep(phase_s)
            stop.set()
            await asyncio.wait(workers, timeout=read_timeout * 4 + 10)

            # Nothing left behind: proxy counts, servers' running requests, routing mode.
            deadline = time.monotonic() + 5
            while True:
                async with session.get(url + "/routing") as r:
                    routing = await r.json()
                loads = []
                for port in (cluster.spec_port, cluster.base_port):
                    async with session.get(f"http://127.0.0.1:{port}/get_load") as r:
                        loads.append((await r.json())[0]["num_reqs"])
                leaks = {"proxy_inflight": routing["inflight"], "server_running": sum(loads),
                         "mode_not_speculative": 0 if routing["mode"] == "speculative" else 1}  # fmt: skip
                if not any(leaks.values()) or time.monotonic() > deadline:
                    break
                await asyncio.sleep(0.1)
            report.leaks = leaks
            report.failovers = await _metric(session, url, "specgate_failovers_total")
            report.proxy_client_disconnects = await _metric(session, url, "specgate_client_disconnects_total")

            # Memory: flat between N and 10 N further requests.
            async def burst(n: int) -> None:
                async def w(k: int) -> None:
                    for _ in range(k):
                        async with session.post(url + "/v1/completions", json={"prompt": "p", "max_tokens": 2}) as r:
                            await r.read()

                await asyncio.gather(*(w(n // 10) for _ in range(10)))

            await burst(memory_requests)
            report.rss_after_n_mib = proxy.rss_mib()
            await burst(memory_requests * 9)
            report.rss_after_10n_mib = proxy.rss_mib()
            report.memory_requests = memory_requests * 10
    finally:
        if proxy is not None:
            proxy.stop()
        for proc in cluster.procs.values():
            proc.stop()
    for name, value in report.leaks.items():
        if value:
            report.violations.append(f"leak: {name} = {value}")
    if report.aborted_steady < report.disconnects_steady:
        report.violations.append(f"{report.disconnects_steady} disconnects but {report.aborted_steady:.0f} aborts")
    if report.rss_after_10n_mib - report.rss_after_n_mib > 20:
        report.violations.append(f"memory grew {report.rss_after_10n_mib - report.rss_after_n_mib:.1f} MiB")
    if report.outcomes["ok"] == 0:
        report.violations.append("no request succeeded")
    return report


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
