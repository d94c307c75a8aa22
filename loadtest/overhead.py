"""What one hop through specgate costs, beside the practical limit of a proxy hop (nginx) and the
peers users would deploy instead (LiteLLM's proxy, SGLang's Rust gateway smg, vLLM's Rust router
vllm-router) when they are installed (scripts/install-peers puts them in .venv-peers).

    python -m loadtest overhead [--reps 3] [--no-nginx] [--no-otel] [--peers-venv .venv-peers]

Starts two backend servers (a simulated pair in one process, delays off), then every proxy in front
of both: specgate (one as speculative, one as baseline), nginx as a plain reverse proxy (Debian's
nginx-light, configured here on loopback, one process, round robin), and each peer found (round
robin, or LiteLLM's default shuffle over two deployments). The direct path is the first server.
Load comes from this process (a bare HTTP/1.1 client, see rawclient.py); backend and proxies are
separate processes. Targets alternate within each repetition so machine drift hits all alike; each
figure is the median over repetitions. A target that does not start, or exits, is reported as not
measured, with the reason, and the others are measured without it.

Scenarios: non-streaming small responses at concurrency 1 and 50 (req/s, p50/p99 latency, added
latency = through a target minus direct); streaming 64-token responses at concurrency 1, 50 and
250 (TTFT and inter-chunk latency added, chunks/s relayed); CPU seconds of each proxy process per
1,000 requests. With a zero-delay backend the streams run as fast as the CPUs allow, so at 250
streams every process is saturated and inter-chunk gaps measure throughput, not latency. The
`paced` scenario is the one for latency: the backend decodes in batched steps of a fixed length,
as a GPU server does, and every chunk of every stream must cross the hop within its step.
The load generator's own CPU is printed: near 100% of a core its figures would measure the
generator, not the target.

`specgate+otel` is specgate with tracing on (docs/tracing.md): a span per request and two per
upstream attempt, exported over OTLP/HTTP with the SDK's default batching to `loadtest.otlpsink`
on loopback; its CPU includes the exporter's thread, not the receiver's. Needs the `otel` extra.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib.util
import itertools
import resource
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import orjson
import uvloop

from . import decisions
from .measures import percentile
from .peers import (
    MODEL,
    PEERS,
    Launch,
    answers_ready,
    free_ports,
    last_line,
    proxy_launches,
    start_launch,
)
from .procs import Proc, free_port, start
from .rawclient import Exchange, RawClient, post
from .report import write_json


@dataclass(frozen=True)
class Scenario:
    name: str
    concurrency: int
    stream: bool
    max_tokens: int
    requests: int
    # The backend's decode step in ms (every stream gets a token per step); 0: no delay at all.
    pace_ms: float = 0.0
    # Response lengths spread evenly over max_tokens +- spread. With one length for all, streams
    # that start together end together, and every request of a paced run arrives in one herd.
    spread: int = 0
    # Workers start no new request past this (seconds): a slow target gives fewer samples, not hours.
    max_s: float = 20.0

    def lengths(self) -> list[int]:
        if not self.spread:
            return [self.max_tokens]
        return list(range(self.max_tokens - self.spread, self.max_tokens + self.spread + 1, max(1, self.spread // 8)))


SCENARIOS = (
    Scenario("small c=1", 1, False, 1, 400),
    Scenario("small c=50", 50, False, 1, 3000),
    Scenario("stream64 c=1", 1, True, 64, 200),
    Scenario("stream64 c=50", 50, True, 64, 1500),
    Scenario("stream64 c=250", 250, True, 64, 2500),
    Scenario("paced64 c=250", 250, True, 64, 1500, pace_ms=20.0, spread=32),
)


@dataclass
class Sample:
    req_s: float
    p50_ms: float
    p99_ms: float
    ttft_p50_ms: float = float("nan")
    chunk_p50_ms: float = float("nan")
    chunk_p99_ms: float = float("nan")
    chunks_s: float = float("nan")
    target_cpu_per_1k_s: float = float("nan")
    client_cpu: float = 0.0
    errors: int = 0
    # Chunks lost on the way: fewer SSE data events than the backend sent.
    missing_chunks: int = 0


@dataclass
class Result:
    scenario: str
    target: str
    samples: list[Sample] = field(default_factory=list)

    def median(self, attr: str) -> float:
        return float(statistics.median(getattr(s, attr) for s in self.samples))


@dataclass
class Target:
    name: str
    port: int
    proc: Proc | None  # the process whose CPU is the hop's cost (None: the backend itself)
    headers: dict[str, str] = field(default_factory=dict)
    # The OTLP receiver this target's spans go to (specgate+otel), to count them at the end.
    sink: str | None = None


def _client_cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


async def _run(target: Target, sc: Scenario) -> Sample:
    requests = [
        (n, post("127.0.0.1", target.port, "/v1/completions", orjson.dumps(
            {"model": MODEL, "prompt": "p", "max_tokens": n, "stream": sc.stream, "ignore_eos": True}), target.headers))
        for n in sc.lengths()
    ]  # fmt: skip
    latencies: list[float] = []
    ttfts: list[float] = []
    gaps: list[float] = []
    chunks = errors = missing = 0
    per_worker = max(1, sc.requests // sc.concurrency)
    deadline = float("inf")
    clients = [RawClient("127.0.0.1", target.port) for _ in range(sc.concurrency)]

    async def one(client: RawClient, request: bytes) -> tuple[float, Exchange | None]:
        t0 = time.perf_counter()
        try:
            return t0, await client.send(request)
        except OSError:
            client.close()
            return t0, None

    async def worker(i: int, client: RawClient) -> None:
        nonlocal chunks, errors, missing
        for j in range(per_worker):
            if time.perf_counter() > deadline:
                break
            n, request = requests[(i + j) % len(requests)]
            t0, ex = await one(client, request)
            if ex is None or ex.status != 200:
                errors += 1
                continue
            latencies.append(time.perf_counter() - t0)
            if sc.stream:
                ev = ex.events
                # The backend sends one data event per token, then one with finish_reason.
                missing += max(0, n + 1 - len(ev))
                if ev:
                    ttfts.append(ev[0] - t0)
                    # The last event (finish_reason, no text) follows the last token at once: not a gap.
                    gaps.extend(b - a for a, b in itertools.pairwise(ev[:-1]))
                chunks += len(ev)

    try:
        # Open every connection and warm the target before timing.
        await asyncio.gather(*(one(c, requests[0][1]) for c in clients))
        cpu0 = target.proc.cpu_seconds() if target.proc else 0.0
        c0, t0 = _client_cpu(), time.perf_counter()
        deadline = t0 + sc.max_s
        await asyncio.gather(*(worker(i, c) for i, c in enumerate(clients)))
        wall = time.perf_counter() - t0
        client = (_client_cpu() - c0) / wall
        cpu = (target.proc.cpu_seconds() - cpu0) if target.proc else float("nan")
    finally:
        for c in clients:
            c.close()
    n = len(latencies)
    ms = [x * 1000 for x in latencies]
    gap_ms = [x * 1000 for x in gaps]
    return Sample(
        req_s=n / wall, p50_ms=percentile(ms, 50) if ms else float("nan"),
        p99_ms=percentile(ms, 99) if ms else float("nan"),
        ttft_p50_ms=percentile([x * 1000 for x in ttfts], 50) if ttfts else float("nan"),
        chunk_p50_ms=percentile(gap_ms, 50) if gaps else float("nan"),
        chunk_p99_ms=percentile(gap_ms, 99) if gaps else float("nan"),
        chunks_s=chunks / wall if sc.stream else float("nan"),
        target_cpu_per_1k_s=cpu / n * 1000 if n and target.proc else float("nan"), client_cpu=client,
        errors=errors, missing_chunks=missing,
    )  # fmt: skip


def _step_profile(step_ms: float, workdir: Path) -> Path:
    """Both servers alike: one token per stream per decode step of step_ms, whatever the batch."""
    # accept_length 1: the speculative server of the pair then sends one token per event, as the
    # baseline does, so every target relays the same events whichever server it picks.
    path = workdir / f"step-{step_ms:g}.csv"
    rows = [f"{c},{c * 1000 / step_ms:g},{c * 1000 / step_ms:g}" for c in (1, 10000)]
    path.write_text("# accept_length: 1\nconcurrency,speculative_tok_s,baseline_tok_s\n" + "\n".join(rows) + "\n")
    return path


def _start_traced(env: dict[str, str], procs: list[Proc], say: Callable[[str], None]) -> Target | None:
    """specgate as `env` starts it, but tracing every request to an otlpsink on loopback."""
    if importlib.util.find_spec("opentelemetry.sdk") is None:
        say("the OpenTelemetry SDK is not installed (pip install 'specgate[otel]'): measuring without specgate+otel")
        return None
    sink_port, port = free_port(), free_port()
    sink = f"http://127.0.0.1:{sink_port}"
    # --keep 0: the receiver only counts, so that its own CPU stays small beside the target's.
    procs.append(start("otlpsink", ["-m", "loadtest.otlpsink", "--port", str(sink_port), "--keep", "0"],
                       ready_url=sink + "/count"))  # fmt: skip
    traced = {**env, "SPECGATE_PORT": str(port), "OTEL_SDK_DISABLED": "false", "OTEL_EXPORTER_OTLP_ENDPOINT": sink}
    procs.append(start("specgate+otel", ["-m", "proxy"], ready_url=f"http://127.0.0.1:{port}/ready", env=traced))
    return Target("specgate+otel", port, procs[-1], sink=sink)


def _start_backend(pace_ms: float, workdir: Path, procs: list[Proc]) -> list[int]:
    """Start the backend (appended to procs), a decode step of `pace_ms` (0: no delay): its two ports."""
    backend_ports = free_ports(2)
    # Zero delay: a decode step of 1 us, far below what a hop costs.
    profile = _step_profile(pace_ms or 0.001, workdir)
    speed = ["--profile", str(profile), "--ttft-base-ms", "0", "--prefill-tok-s", "1e9"]
    # Two servers in one process, each with an engine of its own (no shared compute budget): every
    # proxy has two to route over, and the backend's CPU is one process's whichever gets the request.
    backend = start("backend", ["-m", "loadtest.simulator", "pair", "--speculative-port", str(backend_ports[0]),
                                "--baseline-port", str(backend_ports[1]), "--log-level", "warning", *speed,
                                "--served-model-name", MODEL, "--max-running-requests", "4096"],
                    ready_url=f"http://127.0.0.1:{backend_ports[0]}/health")  # fmt: skip
    procs.append(backend)
    if not answers_ready(backend, f"http://127.0.0.1:{backend_ports[1]}/health", 30):
        raise RuntimeError("the backend's second server did not start")
    return backend_ports


def _start_targets(
    pace_ms: float,
    workdir: Path,
    nginx: bool,
    peers_venv: Path | None,
    procs: list[Proc],
    say: Callable[[str], None],
    otel: bool = False,
) -> tuple[list[Target], dict[str, str]]:
    """Start the backend and every target, each process appended to procs as it starts (the caller
    stops them, also when this raises); the targets ready, and why each other is not measured.
    `otel`: specgate with tracing on too (specgate+otel), beside it."""
    backend_ports = _start_backend(pace_ms, workdir, procs)
    targets = [Target("direct", backend_ports[0], None)]
    port = free_port()
    # Watermarks no load reaches: every request goes to the first server, as the direct path does.
    env = {"SPECGATE_HOST": "127.0.0.1", "SPECGATE_PORT": str(port), "SPECGATE_LOG_LEVEL": "warning",
           "SPECGATE_SPECULATIVE_URL": f"http://127.0.0.1:{backend_ports[0]}",
           "SPECGATE_BASELINE_URL": f"http://127.0.0.1:{backend_ports[1]}",
           "SPECGATE_HIGH_WATERMARK": "100000", "SPECGATE_LOW_WATERMARK": "1"}  # fmt: skip
    env["OTEL_SDK_DISABLED"] = "true"  # untraced, whatever OTEL_* this shell has
    # Started like the others, so that a specgate that exits says why in its log's last line.
    proc, reason = start_launch(Launch("specgate", [sys.executable, "-m", "proxy"], port, "/ready", 30.0, env), workdir)
    procs.append(proc)
    if reason is not None:
        raise RuntimeError(f"specgate did not start: {reason}")
    targets.append(Target("specgate", port, proc))
    if otel and (traced := _start_traced(env, procs, say)) is not None:
        targets.append(traced)
    launches, not_measured = proxy_launches(nginx, peers_venv, backend_ports, workdir)
    for launch in launches:
        proc, reason = start_launch(launch, workdir)
        procs.append(proc)
        if reason is None:
            targets.append(Target(launch.name, launch.port, proc, launch.headers))
        else:
            # Stopped at once, so that a process still starting takes no CPU from the measurement.
            proc.stop()
            not_measured[launch.name] = reason
    for name, reason in not_measured.items():
        say(f"{name}: not measured ({reason})")
    return targets, not_measured


@dataclass
class Measured:
    results: list[Result]
    # Targets that were not measured, and why (not installed, did not start): never a slow figure.
    not_measured: dict[str, str] = field(default_factory=dict)


# How long a target whose sample had errors is given to finish exiting, if it is exiting.
EXIT_GRACE_S = 2.0


def run_overhead(
    reps: int = 3,
    nginx: bool = True,
    scenarios: tuple[Scenario, ...] = SCENARIOS,
    peers_venv: Path | None = None,
    say: Callable[[str], None] = print,
    otel: bool = False,
) -> Measured:
    results: dict[tuple[str, str], Result] = {}
    not_measured: dict[str, str] = {}
    for pace in sorted({sc.pace_ms for sc in scenarios}):
        group = [sc for sc in scenarios if sc.pace_ms == pace]
        backend = "paced" if pace else "zero-delay"
        procs: list[Proc] = []
        with tempfile.TemporaryDirectory() as tmp:
            try:
                targets, missing = _start_targets(pace, Path(tmp), nginx, peers_venv, procs, say, otel)
                for name, reason in missing.items():
                    not_measured.setdefault(name, f"{reason} (paced backend)" if pace else reason)
                gone: set[str] = set()
                for rep in range(reps):
                    for sc in group:
                        for t in targets if rep % 2 == 0 else targets[::-1]:
                            if t.name in gone:
                                continue
                            sample = uvloop.run(_run(t, sc))
                            if t.proc is not None and sample.errors and t.proc.alive():
                                # A target that died mid-sample may still be exiting when its
                                # client sees the broken connection: wait for it, bounded.
                                # Still alive after it: its errors are its own, and counted.
                                with contextlib.suppress(subprocess.TimeoutExpired):
                                    t.proc.popen.wait(timeout=EXIT_GRACE_S)
                            if t.proc is not None and not t.proc.alive():
                                # Its errors would read as a slow proxy: the sample is dropped, the
                                # target measured no further.
                                gone.add(t.name)
                                reason = f"exited with code {t.proc.popen.returncode} during {sc.name}, "
                                reason += f"repetition {rep + 1}: {last_line(Path(tmp) / f'{t.name}.log')}"
                                not_measured.setdefault(t.name, reason)
                                say(f"{t.name}: not measured from here on ({reason})")
                                continue
                            results.setdefault((sc.name, t.name), Result(sc.name, t.name)).samples.append(sample)
                    say(f"{backend} backend: repetition {rep + 1}/{reps} done")
                for t in targets:
                    if t.sink is not None and t.proc is not None and t.name not in gone:
                        t.proc.stop()  # its last batch goes out as it stops
                        count = orjson.loads(urllib.request.urlopen(t.sink + "/count", timeout=5).read())
                        say(f"{t.name}: otlpsink received {count['spans']} spans in {count['exports']} exports")
            finally:
                for proc in reversed(procs):
                    proc.stop()
    rank = {sc.name: i for i, sc in enumerate(scenarios)}
    return Measured(sorted(results.values(), key=lambda r: rank[r.scenario]), not_measured)


def format_results(measured: Measured) -> str:
    results = measured.results
    by = {(r.scenario, r.target): r for r in results}
    lines = []
    head = (f"{'scenario':15} {'target':13} {'req/s':>7} {'p50 ms':>7} {'p99 ms':>7} {'added p50':>9} "
            f"{'TTFT p50':>8} {'TTFT add':>8} {'chunk p99':>9} {'chunk add':>9} {'chunks/s':>8} "
            f"{'CPU s/1k':>8} {'vs nginx':>8} {'client':>6}")  # fmt: skip
    lines += [head, "-" * len(head)]
    for r in results:
        direct = by.get((r.scenario, "direct"))
        ng = by.get((r.scenario, "nginx"))
        added = r.median("p50_ms") - direct.median("p50_ms") if direct else float("nan")
        ttft_add = r.median("ttft_p50_ms") - direct.median("ttft_p50_ms") if direct else float("nan")
        chunk_add = r.median("chunk_p99_ms") - direct.median("chunk_p99_ms") if direct else float("nan")
        vs_ng = r.median("req_s") / ng.median("req_s") if ng else float("nan")
        flags = ""
        if sum(s.errors for s in r.samples):
            flags += f" errors={sum(s.errors for s in r.samples)}"
        if sum(s.missing_chunks for s in r.samples):
            flags += f" missing_chunks={sum(s.missing_chunks for s in r.samples)}"
        lines.append(
            f"{r.scenario:15} {r.target:13} {r.median('req_s'):>7.0f} {r.median('p50_ms'):>7.2f} "
            f"{r.median('p99_ms'):>7.2f} {added:>9.2f} {r.median('ttft_p50_ms'):>8.2f} {ttft_add:>8.2f} "
            f"{r.median('chunk_p99_ms'):>9.2f} {chunk_add:>9.2f} {r.median('chunks_s'):>8.0f} "
            f"{r.median('target_cpu_per_1k_s'):>8.2f} {vs_ng:>8.2f} {r.median('client_cpu'):>6.0%}{flags}"
        )
    lines += _tracing_cost(by)
    lines.append("(medians over repetitions; added = target minus direct; chunk = gap between SSE events of one")
    lines.append(" stream; client = the load generator's CPU, near 100% it measures itself, not the target)")
    lines += [f"not measured: {name}: {reason}" for name, reason in measured.not_measured.items()]
    return "\n".join(lines)


def _tracing_cost(by: dict[tuple[str, str], Result]) -> list[str]:
    """specgate with tracing on against off, per scenario: requests/s and CPU per 1,000 requests."""
    out = []
    for (scenario, target), on in by.items():
        off = by.get((scenario, "specgate"))
        if target != "specgate+otel" or off is None:
            continue
        req = on.median("req_s") / off.median("req_s")
        cpu = on.median("target_cpu_per_1k_s") / off.median("target_cpu_per_1k_s")
        out.append(f"tracing on/off, {scenario}: req/s x{req:.3f}, CPU s per 1k requests x{cpu:.3f}")
    return out


def default_peers_venv() -> Path | None:
    """`.venv-peers` beside the running venv (scripts/install-peers makes it), if there is one."""
    here = Path(sys.prefix).parent / ".venv-peers"
    return here if here.is_dir() else None


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    overhead = sub.add_parser("overhead", help="specgate's own cost per hop, beside nginx and direct")
    overhead.add_argument("--reps", type=int, default=3)
    overhead.add_argument("--no-nginx", action="store_true")
    overhead.add_argument("--peers-venv", default=None,
                          help="a venv with litellm[proxy], smg and vllm-router (scripts/install-peers); "
                               "default: .venv-peers beside this venv, when it exists")  # fmt: skip
    overhead.add_argument("--no-peers", action="store_true", help="measure none of LiteLLM, smg and vllm-router")
    overhead.add_argument("--no-decisions", action="store_true",
                          help="leave out the per-request decision's cost (loadtest/decisions.py)")  # fmt: skip
    overhead.add_argument("--no-otel", action="store_true",
                          help="leave out specgate+otel (specgate tracing to a receiver on loopback)")  # fmt: skip
    overhead.add_argument("--only", action="append", default=None, metavar="TEXT",
                          help="run only the scenarios whose name contains TEXT (repeatable)")  # fmt: skip
    overhead.add_argument("--out", default=None, help="write every sample as JSON here")


def cmd_overhead(args: argparse.Namespace) -> int:
    peers = None if args.no_peers else (Path(args.peers_venv) if args.peers_venv else default_peers_venv())
    scenarios = tuple(sc for sc in SCENARIOS if not args.only or any(t in sc.name for t in args.only))
    if not scenarios:
        print(f"loadtest: no scenario matches {args.only}; there are: {', '.join(sc.name for sc in SCENARIOS)}",
              file=sys.stderr)  # fmt: skip
        return 2
    if peers is None and not args.no_peers:
        print(f"no .venv-peers beside {sys.prefix}: {', '.join(PEERS)} not measured (scripts/install-peers)")
    measured = run_overhead(
        args.reps, nginx=not args.no_nginx, peers_venv=peers, scenarios=scenarios, otel=not args.no_otel
    )
    print(format_results(measured))
    if not args.no_decisions:
        print(decisions.report(decisions.run()))
    if args.out:
        write_json(args.out, {"settings": vars(args), "results": measured.results,
                              "not_measured": measured.not_measured})  # fmt: skip
    return 0
