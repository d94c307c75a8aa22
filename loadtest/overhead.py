"""What one hop through specgate costs, beside the practical limit of a proxy hop (nginx).

    python -m loadtest overhead [--reps 3] [--no-nginx]

Starts a zero-delay backend (the simulator with its delays off), specgate in front of it (both
backend URLs point at it), and nginx as a plain reverse proxy (Debian's nginx-light, configured
here on loopback). Load comes from this process; backend and proxies are separate processes.
Targets alternate within each repetition so machine drift hits all alike; each figure is the
median over repetitions.

Scenarios: non-streaming small responses at concurrency 1 and 50 (req/s, p50/p99 latency,
added latency = through a target minus direct); streaming 64-token responses at concurrency 1,
50 and 250 (TTFT and inter-chunk latency added, chunks/s relayed); CPU seconds of the proxy
process per 1,000 requests. The load generator's own CPU is printed: at 100% of a core its
figures would measure the generator, not the target.
"""

from __future__ import annotations

import asyncio
import resource
import shutil
import statistics
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp

from .procs import Proc, free_port, simulator_args, start
from .stats import percentile


@dataclass(frozen=True)
class Scenario:
    name: str
    concurrency: int
    stream: bool
    max_tokens: int
    requests: int


SCENARIOS = (
    Scenario("small c=1", 1, False, 1, 400),
    Scenario("small c=50", 50, False, 1, 3000),
    Scenario("stream64 c=1", 1, True, 64, 200),
    Scenario("stream64 c=50", 50, True, 64, 1500),
    Scenario("stream64 c=250", 250, True, 64, 2500),
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


@dataclass
class Result:
    scenario: str
    target: str
    samples: list[Sample] = field(default_factory=list)

    def median(self, attr: str) -> float:
        return float(statistics.median(getattr(s, attr) for s in self.samples))


def _client_cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


async def _run(url: str, sc: Scenario, proc: Proc | None) -> Sample:
    body = {"prompt": "p", "max_tokens": sc.max_tokens, "stream": sc.stream}
    latencies: list[float] = []
    ttfts: list[float] = []
    gaps: list[float] = []
    chunks = 0
    errors = 0
    per_worker = max(1, sc.requests // sc.concurrency)
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector) as session:

        async def worker() -> None:
            nonlocal chunks, errors
            for _ in range(per_worker):
                t0 = time.perf_counter()
                try:
                    async with session.post(url + "/v1/completions", json=body) as r:
                        if r.status != 200:
                            errors += 1
                            await r.read()
                            continue
                        if not sc.stream:
                            await r.read()
                        else:
                            last = None
                            async for line in r.content:
                                if not line.startswith(b"data: {"):
                                    continue
                                now = time.perf_counter()
                                if last is None:
                                    ttfts.append(now - t0)
                                else:
                                    gaps.append(now - last)
                                last = now
                                chunks += 1
                except aiohttp.ClientError:
                    errors += 1
                    continue
                latencies.append(time.perf_counter() - t0)

        # Warm the keep-alive pools before timing.
        await asyncio.gather(
            *(session.post(url + "/v1/completions", json=body) for _ in range(min(sc.concurrency, 20)))
        )
        cpu0 = proc.cpu_seconds() if proc else 0.0
        c0, t0 = _client_cpu(), time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(sc.concurrency)))
        wall = time.perf_counter() - t0
        client = (_client_cpu() - c0) / wall
        cpu = (proc.cpu_seconds() - cpu0) if proc else float("nan")
    n = len(latencies)
    ms = [x * 1000 for x in latencies]
    return Sample(
        req_s=n / wall, p50_ms=percentile(ms, 50), p99_ms=percentile(ms, 99),
        ttft_p50_ms=percentile([x * 1000 for x in ttfts], 50) if ttfts else float("nan"),
        chunk_p50_ms=percentile([x * 1000 for x in gaps], 50) if gaps else float("nan"),
        chunk_p99_ms=percentile([x * 1000 for x in gaps], 99) if gaps else float("nan"),
        chunks_s=chunks / wall if sc.stream else float("nan"),
        target_cpu_per_1k_s=cpu / n * 1000 if n and proc else float("nan"), client_cpu=client, errors=errors,
    )  # fmt: skip


def _nginx_conf(port: int, backend_port: int, workdir: Path) -> Path:
    conf = workdir / "nginx.conf"
    conf.write_text(f"""
worker_processes 1;
pid {workdir}/nginx.pid;
error_log {workdir}/error.log warn;
daemon off;
events {{ worker_connections 4096; }}
http {{
  access_log off;
  client_body_temp_path {workdir}/body;
  proxy_temp_path {workdir}/proxy;
  upstream backend {{ server 127.0.0.1:{backend_port}; keepalive 512; }}
  server {{
    listen 127.0.0.1:{port} backlog=4096;
    location / {{
      proxy_pass http://backend;
      proxy_http_version 1.1;
      proxy_set_header Connection "";
      proxy_buffering off;
      proxy_request_buffering off;
    }}
  }}
}}
""")
    return conf


def run_overhead(reps: int = 3, nginx: bool = True, scenarios: tuple[Scenario, ...] = SCENARIOS) -> list[Result]:
    backend_port, proxy_port, nginx_port = free_port(), free_port(), free_port()
    procs: list[Proc] = []
    targets: dict[str, tuple[str, Proc | None]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        try:
            backend = start("backend", simulator_args("baseline", backend_port, "--ttft-base-ms", "0",
                                                      "--time-scale", "1000", "--max-running-requests", "4096"),
                            ready_url=f"http://127.0.0.1:{backend_port}/health")  # fmt: skip
            procs.append(backend)
            targets["direct"] = (f"http://127.0.0.1:{backend_port}", backend)
            env = {"SPECGATE_HOST": "127.0.0.1", "SPECGATE_PORT": str(proxy_port), "SPECGATE_LOG_LEVEL": "warning",
                   "SPECGATE_SPECULATIVE_URL": f"http://127.0.0.1:{backend_port}",
                   "SPECGATE_BASELINE_URL": f"http://127.0.0.1:{backend_port}",
                   "SPECGATE_HIGH_WATERMARK": "100000", "SPECGATE_LOW_WATERMARK": "1"}  # fmt: skip
            gate = start("specgate", ["-m", "proxy"], ready_url=f"http://127.0.0.1:{proxy_port}/ready", env=env)
            procs.append(gate)
            targets["specgate"] = (f"http://127.0.0.1:{proxy_port}", gate)
            binary = shutil.which("nginx") or ("/usr/sbin/nginx" if Path("/usr/sbin/nginx").exists() else None)
            if nginx and binary:
                conf = _nginx_conf(nginx_port, backend_port, Path(tmp))
                popen = subprocess.Popen([binary, "-c", str(conf), "-e", f"{tmp}/error.log"],
                                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
                ng = Proc("nginx", popen)
                procs.append(ng)
                deadline = time.monotonic() + 10
                while time.monotonic() < deadline:
                    try:
                        import urllib.request

                        urllib.request.urlopen(f"http://127.0.0.1:{nginx_port}/health", timeout=1)
                        break
                    except OSError:
                        time.sleep(0.05)
                # nginx's master forks the worker that does the work; its CPU is not measured here.
                targets["nginx"] = (f"http://127.0.0.1:{nginx_port}", None)
            elif nginx:
                print("nginx not found (Debian: apt-get install nginx-light); measuring without it")
            results = {(sc.name, t): Result(sc.name, t) for sc in scenarios for t in targets}
            for rep in range(reps):
                for sc in scenarios:
                    order = list(targets) if rep % 2 == 0 else list(reversed(targets))
                    for name in order:
                        url, proc = targets[name]
                        results[(sc.name, name)].samples.append(asyncio.run(_run(url, sc, proc)))
                print(f"repetition {rep + 1}/{reps} done", flush=True)
            return list(results.values())
        finally:
            for proc in reversed(procs):
                proc.stop()


def format_results(results: list[Result]) -> str:
    by = {(r.scenario, r.target): r for r in results}
    lines = []
    head = (f"{'scenario':15} {'target':9} {'req/s':>8} {'p50 ms':>7} {'p99 ms':>7} {'added p50':>9} "
            f"{'TTFT p50':>8} {'TTFT add':>8} {'chunk p99':>9} {'chunk add':>9} {'chunks/s':>9} "
            f"{'CPU s/1k':>8} {'vs nginx':>8} {'client':>6}")  # fmt: skip
    lines += [head, "-" * len(head)]
    for r in results:
        direct = by.get((r.scenario, "direct"))
        ng = by.get((r.scenario, "nginx"))
        added = r.median("p50_ms") - direct.median("p50_ms") if direct else float("nan")
        ttft_add = r.median("ttft_p50_ms") - direct.median("ttft_p50_ms") if direct else float("nan")
        chunk_add = r.median("chunk_p99_ms") - direct.median("chunk_p99_ms") if direct else float("nan")
        vs_ng = r.median("req_s") / ng.median("req_s") if ng else float("nan")
        lines.append(
            f"{r.scenario:15} {r.target:9} {r.median('req_s'):>8.0f} {r.median('p50_ms'):>7.2f} "
            f"{r.median('p99_ms'):>7.2f} {added:>9.2f} {r.median('ttft_p50_ms'):>8.2f} {ttft_add:>8.2f} "
            f"{r.median('chunk_p99_ms'):>9.2f} {chunk_add:>9.2f} {r.median('chunks_s'):>9.0f} "
            f"{r.median('target_cpu_per_1k_s'):>8.2f} {vs_ng:>8.2f} {r.median('client_cpu'):>6.0%}"
        )
    lines.append("(medians over repetitions; added = target minus direct; client = the load generator's CPU)")
    return "\n".join(lines)
