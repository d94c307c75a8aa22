"""`python -m loadtest slowloris`: idle sockets and slowloris against specgate while a normal
client works (issue #18).

    python -m loadtest slowloris [--idle 5000] [--slow 200] [--concurrency 8] [--phase-s 20]
                                 [--time-scale 10] [--max-tokens 32] [--header-timeout-s 10]
                                 [--max-client-connections N] [--out FILE]

specgate (its defaults, except the settings named) in front of a simulated pair, and a normal
client: `--concurrency` closed-loop workers, each on one kept-alive connection, sending streamed
chat completions of `--max-tokens`. Three phases of `--phase-s`: quiet; attack; quiet again.

The attacker runs in a process of its own (so its work is not the client's): `--idle`
connections that never send a byte and `--slow` connections that send half a request head, then
one byte a second (slowloris). Whatever specgate closes, the attacker opens again at once, so the
attack holds for the whole phase. The attack phase is measured once the attacker has opened its
sockets (or after a ramp of at most --phase-s).

Reported per phase: the client's requests/s, p50 latency and TTFT, errors; specgate's CPU and
open descriptors; the attacker's sockets open, opened, closed by specgate, 408s and 503s; and
specgate's own count of rejections. It passes when under attack the client keeps >= 90% of its
quiet requests/s, its p50 latency within +10%, and has no errors.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import multiprocessing
import os
import resource
import time
from dataclasses import asdict, dataclass, field
from multiprocessing.sharedctypes import SynchronizedArray
from multiprocessing.synchronize import Event
from typing import Any

import orjson
import uvloop

from proxy.fleet import promtext

from .kit.command import add_command
from .kit.settings import specgate_env
from .measures import percentile
from .procs import Proc, free_port, simulator_args, start
from .rawclient import RawClient, post

PHASES = ("quiet", "attack", "recovery")
# The attacker's counters, in its shared array.
_OPEN, _MAX_OPEN, _OPENED, _CLOSED, _GOT_408, _GOT_503, _CONNECT_ERRORS, _DRIPPED = range(8)
# A slowloris head: a request line and the start of a header whose value never ends.
_SLOW_HEAD = b"POST /v1/chat/completions HTTP/1.1\r\nHost: specgate\r\nUser-Agent: slowloris\r\nX-a: "
# Connects in flight at once (the listen backlog is 4096).
_CONNECTS = 256
# The client passes when under attack it keeps these against the quiet phase.
MIN_RATE_RATIO = 0.9
MAX_P50_RATIO = 1.1


@dataclass
class PhaseReport:
    name: str
    seconds: float = 0.0
    requests: int = 0
    errors: int = 0
    req_s: float = 0.0
    p50_ms: float = 0.0
    p99_ms: float = 0.0
    ttft_p50_ms: float = 0.0
    specgate_cpu: float = 0.0  # share of one core
    specgate_fds_max: int = 0
    attacker_open_max: int = 0
    attacker_opened: int = 0
    attacker_closed_by_specgate: int = 0
    attacker_408: int = 0
    attacker_503: int = 0


@dataclass
class SlowlorisReport:
    idle: int
    slow: int
    concurrency: int
    header_timeout_s: float
    max_client_connections: int | None
    phases: list[PhaseReport] = field(default_factory=list)
    rejections: dict[str, float] = field(default_factory=dict)
    specgate_rss_mib: float = 0.0
    verdict: str = ""

    @property
    def rate_ratio(self) -> float:
        return self.phases[1].req_s / self.phases[0].req_s if self.phases[0].req_s else 0.0

    @property
    def p50_ratio(self) -> float:
        return self.phases[1].p50_ms / self.phases[0].p50_ms if self.phases[0].p50_ms else float("inf")

    @property
    def ok(self) -> bool:
        attack = self.phases[1]
        return self.rate_ratio >= MIN_RATE_RATIO and self.p50_ratio <= MAX_P50_RATIO and attack.errors == 0


# ----- the attacker (a process of its own) -----


class _Attacker:
    def __init__(self, port: int, counters: SynchronizedArray[int]) -> None:
        self.port = port
        self.c = counters
        self.stopping = False
        self.slow_open: set[_Sock] = set()
        self.gate = asyncio.Semaphore(_CONNECTS)

    async def connect(self, slow: bool) -> None:
        loop = asyncio.get_running_loop()
        while not self.stopping:
            async with self.gate:
                try:
                    await loop.create_connection(lambda: _Sock(self, slow), "127.0.0.1", self.port)
                    return
                except OSError:
                    self.c[_CONNECT_ERRORS] += 1
            await asyncio.sleep(0.1)

    def opened(self, sock: _Sock) -> None:
        c = self.c
        c[_OPEN] += 1
        c[_OPENED] += 1
        c[_MAX_OPEN] = max(c[_MAX_OPEN], c[_OPEN])
        if sock.slow:
            self.slow_open.add(sock)

    def closed(self, sock: _Sock) -> None:
        self.c[_OPEN] -= 1
        self.slow_open.discard(sock)
        if not self.stopping:
            self.c[_CLOSED] += 1
            asyncio.get_running_loop().create_task(self.connect(sock.slow))  # at once, again

    async def drip(self) -> None:
        while not self.stopping:
            await asyncio.sleep(1.0)
            for sock in list(self.slow_open):
                if sock.transport is not None and not sock.transport.is_closing():
                    sock.transport.write(b"a")
                    self.c[_DRIPPED] += 1


class _Sock(asyncio.Protocol):
    def __init__(self, owner: _Attacker, slow: bool) -> None:
        self.owner = owner
        self.slow = slow
        self.transport: asyncio.WriteTransport | None = None
        self.answered = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        if self.slow and self.transport is not None:
            self.transport.write(_SLOW_HEAD)
        self.owner.opened(self)

    def data_received(self, data: bytes) -> None:
        if not self.answered:
            self.answered = True
            if data.startswith(b"HTTP/1.1 408"):
                self.owner.c[_GOT_408] += 1
            elif data.startswith(b"HTTP/1.1 503"):
                self.owner.c[_GOT_503] += 1

    def connection_lost(self, exc: Exception | None) -> None:
        self.owner.closed(self)


async def _attack(port: int, idle: int, slow: int, counters: SynchronizedArray[int], stop: Event) -> None:
    attacker = _Attacker(port, counters)
    tasks = [asyncio.create_task(attacker.connect(False)) for _ in range(idle)]
    tasks += [asyncio.create_task(attacker.connect(True)) for _ in range(slow)]
    dripper = asyncio.create_task(attacker.drip())
    loop = asyncio.get_running_loop()
    await loop.run_in_executor(None, stop.wait)
    attacker.stopping = True
    dripper.cancel()
    for task in tasks:
        task.cancel()


def _attacker_main(port: int, idle: int, slow: int, counters: SynchronizedArray[int], stop: Event) -> None:
    _raise_file_limit()
    uvloop.run(_attack(port, idle, slow, counters, stop))
    os._exit(0)  # the sockets go with the process, all at once


def _raise_file_limit() -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


# ----- the normal client and the run -----


@dataclass
class _Samples:
    latencies: list[float] = field(default_factory=list)
    ttfts: list[float] = field(default_factory=list)
    errors: int = 0


async def _client(
    port: int, concurrency: int, max_tokens: int, phase: dict[str, _Samples], stop: asyncio.Event
) -> None:
    body = orjson.dumps(
        {
            "model": "m",
            "messages": [{"role": "user", "content": "Say something."}],
            "max_tokens": max_tokens,
            "stream": True,
            "ignore_eos": True,
        }
    )
    request = post("127.0.0.1", port, "/v1/chat/completions", body)

    async def worker() -> None:
        client = RawClient("127.0.0.1", port)
        try:
            while not stop.is_set():
                samples = phase["now"]
                t0 = time.perf_counter()
                try:
                    ex = await asyncio.wait_for(client.send(request), 60)
                except (OSError, TimeoutError):
                    samples.errors += 1
                    client.close()
                    await asyncio.sleep(0.1)
                    continue
                t1 = time.perf_counter()
                if ex.status != 200 or not ex.events:
                    samples.errors += 1
                    continue
                samples.latencies.append(t1 - t0)
                samples.ttfts.append(ex.events[0] - t0)
        finally:
            client.close()

    await asyncio.gather(*(worker() for _ in range(concurrency)))


def _fds(pid: int) -> int:
    try:
        return len(os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        return 0


async def _metrics(port: int) -> dict[str, float]:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(b"GET /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
    raw = await reader.read()
    writer.close()
    text = raw.partition(b"\r\n\r\n")[2].decode()
    return promtext.by_label(text, "specgate_client_rejections_total", "reason")


async def _measure(
    name: str, proxy: Proc, counters: SynchronizedArray[int], phase: dict[str, _Samples], phase_s: float
) -> PhaseReport:
    """One phase of the normal client's requests beside whatever the attacker does, and specgate's cost."""
    before = counters[:]
    samples = phase["now"] = _Samples()
    cpu0, t0 = proxy.cpu_seconds(), time.monotonic()
    fds_max = open_max = 0
    while time.monotonic() - t0 < phase_s:
        await asyncio.sleep(0.5)
        fds_max = max(fds_max, _fds(proxy.pid))
        open_max = max(open_max, counters[_OPEN] if name == "attack" else 0)
    seconds = time.monotonic() - t0
    after = counters[:]
    lat = samples.latencies
    return PhaseReport(
        name=name,
        seconds=seconds,
        requests=len(lat),
        errors=samples.errors,
        req_s=len(lat) / seconds,
        p50_ms=percentile(lat, 50) * 1000,
        p99_ms=percentile(lat, 99) * 1000,
        ttft_p50_ms=percentile(samples.ttfts, 50) * 1000,
        specgate_cpu=(proxy.cpu_seconds() - cpu0) / seconds,
        specgate_fds_max=fds_max,
        attacker_open_max=open_max,
        attacker_opened=after[_OPENED] - before[_OPENED],
        attacker_closed_by_specgate=after[_CLOSED] - before[_CLOSED],
        attacker_408=after[_GOT_408] - before[_GOT_408],
        attacker_503=after[_GOT_503] - before[_GOT_503],
    )


async def run_slowloris(
    idle: int = 5000,
    slow: int = 200,
    concurrency: int = 8,
    phase_s: float = 20.0,
    time_scale: float = 10.0,
    max_tokens: int = 32,
    header_timeout_s: float = 10.0,
    max_client_connections: int | None = None,
) -> SlowlorisReport:
    _raise_file_limit()
    report = SlowlorisReport(idle, slow, concurrency, header_timeout_s, max_client_connections)
    spec_port, base_port, port = free_port(), free_port(), free_port()
    flags = ("--time-scale", str(time_scale))
    procs: list[Proc] = []
    ctx = multiprocessing.get_context("spawn")
    counters: SynchronizedArray[int] = ctx.Array("q", 8)
    stop_attack = ctx.Event()
    attacker: multiprocessing.process.BaseProcess | None = None
    try:
        for role, p in (("speculative", spec_port), ("baseline", base_port)):
            args = simulator_args(role, p, *flags)
            procs.append(start(f"sim-{role}", args, ready_url=f"http://127.0.0.1:{p}/health"))
        cap = {} if max_client_connections is None else {"max_client_connections": max_client_connections}
        spec, base = f"http://127.0.0.1:{spec_port}", f"http://127.0.0.1:{base_port}"
        env = specgate_env(port, spec, base, log_level="error", header_timeout_s=header_timeout_s, **cap)
        proxy = start("specgate", ["-m", "proxy"], ready_url=f"http://127.0.0.1:{port}/ready", env=env)
        procs.append(proxy)

        phase = {"now": _Samples()}
        stop = asyncio.Event()
        client = asyncio.create_task(_client(port, concurrency, max_tokens, phase, stop))
        await asyncio.sleep(min(2.0, phase_s / 4))  # connections open, caches warm
        for name in PHASES:
            if name == "attack":
                attacker = ctx.Process(target=_attacker_main, args=(port, idle, slow, counters, stop_attack))
                attacker.start()
                ramp_until = time.monotonic() + phase_s
                while counters[_OPEN] < 0.95 * (idle + slow) and time.monotonic() < ramp_until:  # noqa: ASYNC110
                    await asyncio.sleep(0.2)  # another process's counter: nothing to await
            elif name == "recovery" and attacker is not None:
                stop_attack.set()
                attacker.join(30)
                await asyncio.sleep(1.0)
            report.phases.append(await _measure(name, proxy, counters, phase, phase_s))
        stop.set()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(client, 90)
        report.rejections = await _metrics(port)
        report.specgate_rss_mib = proxy.rss_mib()
    finally:
        stop_attack.set()
        if attacker is not None and attacker.is_alive():
            attacker.join(10)
            if attacker.is_alive():
                attacker.kill()
        for proc in reversed(procs):
            proc.stop()
    report.verdict = (
        f"under attack: {report.rate_ratio:.3f}x the quiet requests/s (>= {MIN_RATE_RATIO}), "
        f"p50 latency {report.p50_ratio:.3f}x (<= {MAX_P50_RATIO}), {report.phases[1].errors} errors: "
        + ("PASS" if report.ok else "FAIL")
    )
    return report


def format_report(r: SlowlorisReport) -> str:
    cap = r.max_client_connections if r.max_client_connections is not None else "default"
    lines = [
        f"slowloris: {r.idle} idle + {r.slow} slowloris sockets (1 byte/s), {r.concurrency} client streams; "
        f"header timeout {r.header_timeout_s:g} s, connection cap {cap}",
        f"{'phase':9} {'req/s':>7} {'p50 ms':>8} {'p99 ms':>8} {'TTFT p50':>9} {'errors':>6} {'cpu':>5} {'fds max':>7} "
        f"{'atk open':>8} {'opened':>7} {'closed':>7} {'408':>6} {'503':>6}",
    ]
    for p in r.phases:
        lines.append(
            f"{p.name:9} {p.req_s:7.1f} {p.p50_ms:8.1f} {p.p99_ms:8.1f} {p.ttft_p50_ms:9.1f} {p.errors:6d} "
            f"{p.specgate_cpu:5.0%} {p.specgate_fds_max:7d} {p.attacker_open_max:8d} {p.attacker_opened:7d} "
            f"{p.attacker_closed_by_specgate:7d} {p.attacker_408:6d} {p.attacker_503:6d}"
        )
    lines.append("specgate rejections: " + ", ".join(f"{k} {v:g}" for k, v in sorted(r.rejections.items())))
    lines.append(f"specgate RSS at the end {r.specgate_rss_mib:.1f} MiB")
    lines.append(r.verdict)
    return "\n".join(lines)


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = add_command(
        sub, "slowloris", "idle sockets and slowloris against specgate while a normal client works", __doc__
    )
    p.add_argument("--idle", type=int, default=5000, help="sockets that never send a byte (default 5000)")
    p.add_argument("--slow", type=int, default=200, help="sockets that send a head at 1 byte/s (default 200)")
    p.add_argument("--concurrency", type=int, default=8, help="the normal client's streams (default 8)")
    p.add_argument("--phase-s", type=float, default=20.0, help="seconds a phase (default 20)")
    p.add_argument("--time-scale", type=float, default=10.0, help="simulators' time scale (default 10)")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--header-timeout-s", type=float, default=10.0, help="SPECGATE_HEADER_TIMEOUT_S (default 10)")
    p.add_argument("--max-client-connections", type=int, default=None, help="SPECGATE_MAX_CLIENT_CONNECTIONS")
    p.add_argument("--out", default=None, help="write the report as JSON here")


def cmd_slowloris(args: argparse.Namespace) -> int:
    report = uvloop.run(
        run_slowloris(
            args.idle,
            args.slow,
            args.concurrency,
            args.phase_s,
            args.time_scale,
            args.max_tokens,
            args.header_timeout_s,
            args.max_client_connections,
        )
    )
    print(format_report(report))
    if args.out:
        data: dict[str, Any] = asdict(report)
        data.update(rate_ratio=report.rate_ratio, p50_ratio=report.p50_ratio, ok=report.ok)
        with open(args.out, "wb") as f:
            f.write(orjson.dumps(data, option=orjson.OPT_INDENT_2))
    return 0 if report.ok else 1
