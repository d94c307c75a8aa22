"""What one hop through specgate costs, beside the practical limit of a proxy hop (nginx) and the
peers users would deploy instead (LiteLLM's proxy, SGLang's Rust router) when they are installed.

    python -m loadtest overhead [--reps 3] [--no-nginx] [--no-otel] [--peers-venv .venv-peers]

Starts a backend (the simulator with its delays off), specgate in front of it (both backend URLs
point at it), nginx as a plain reverse proxy (Debian's nginx-light, configured here on loopback,
one process), and each peer found. Load comes from this process (a bare HTTP/1.1 client, see
rawclient.py); backend and proxies are separate processes. Targets alternate within each
repetition so machine drift hits all alike; each figure is the median over repetitions.

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
import importlib.util
import itertools
import os
import resource
import shutil
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

from .procs import Proc, free_port, http_status, simulator_args, start
from .rawclient import Exchange, RawClient, post
from .report import write_json
from .stats import percentile

MODEL = "sim"
# LiteLLM's proxy refuses to start without a master key; clients then send it.
_LITELLM_KEY = "sk-overhead-benchmark"
# A one-word tokenizer in Hugging Face's format, for sglang-router.
_TOKENIZER: dict[str, object] = {
    "version": "1.0",
    "truncation": None,
    "padding": None,
    "added_tokens": [],
    "normalizer": None,
    "pre_tokenizer": {"type": "Whitespace"},
    "post_processor": None,
    "decoder": None,
    "model": {"type": "WordLevel", "vocab": {"[UNK]": 0, "p": 1}, "unk_token": "[UNK]"},
}


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


def _nginx_conf(port: int, backend_port: int, workdir: Path) -> Path:
    # One process (no master) so that its CPU can be read like the others'.
    conf = workdir / "nginx.conf"
    conf.write_text(f"""
master_process off;
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


def _litellm_conf(backend_port: int, workdir: Path) -> Path:
    conf = workdir / "litellm.yaml"
    conf.write_text(f"""
model_list:
  - model_name: {MODEL}
    litellm_params:
      model: openai/{MODEL}
      api_base: http://127.0.0.1:{backend_port}/v1
      api_key: none
litellm_settings:
  telemetry: false
  drop_params: true
""")
    return conf


def _wait_ready(proc: Proc, url: str, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not proc.alive():
            return False
        if http_status(url, timeout_s=1.0) == 200:
            return True
        time.sleep(0.1)
    return False


def _spawn(name: str, argv: list[str], env: dict[str, str] | None = None) -> Proc:
    popen = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                             env={**os.environ, **(env or {})})  # fmt: skip
    return Proc(name, popen)


def _find(binary: str, peers_venv: Path | None) -> str | None:
    if peers_venv is not None and (peers_venv / "bin" / binary).exists():
        return str(peers_venv / "bin" / binary)
    return shutil.which(binary)


def _pace_profile(pace_ms: float, workdir: Path) -> Path:
    # Total tok/s proportional to streams: every decode step lasts pace_ms whatever the batch.
    path = workdir / f"paced-{pace_ms:g}.csv"
    rows = [f"{c},{c * 1000 / pace_ms:g},{c * 1000 / pace_ms:g}" for c in (1, 10000)]
    path.write_text("concurrency,speculative_tok_s,baseline_tok_s\n" + "\n".join(rows) + "\n")
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


def _start_targets(
    pace_ms: float,
    workdir: Path,
    nginx: bool,
    peers_venv: Path | None,
    say: Callable[[str], None],
    otel: bool = False,
) -> tuple[list[Proc], list[Target]]:
    procs: list[Proc] = []
    targets: list[Target] = []
    backend_port = free_port()
    if pace_ms:
        speed = ["--profile", str(_pace_profile(pace_ms, workdir)), "--ttft-base-ms", "0", "--prefill-tok-s", "1e9"]
    else:
        speed = ["--ttft-base-ms", "0", "--time-scale", "1000"]
    # sglang-router loads the tokenizer of the model_path the backend reports: a local one here,
    # or it would reach for a model hub.
    tokenizer = workdir / "tokenizer"
    tokenizer.mkdir(exist_ok=True)
    (tokenizer / "tokenizer.json").write_bytes(orjson.dumps(_TOKENIZER))
    backend = start("backend", simulator_args("baseline", backend_port, *speed, "--served-model-name", MODEL,
                                              "--model-path", str(tokenizer), "--max-running-requests", "4096"),
                    ready_url=f"http://127.0.0.1:{backend_port}/health")  # fmt: skip
    procs.append(backend)
    targets.append(Target("direct", backend_port, None))
    port = free_port()
    env = {"SPECGATE_HOST": "127.0.0.1", "SPECGATE_PORT": str(port), "SPECGATE_LOG_LEVEL": "warning",
           "SPECGATE_SPECULATIVE_URL": f"http://127.0.0.1:{backend_port}",
           "SPECGATE_BASELINE_URL": f"http://127.0.0.1:{backend_port}",
           "SPECGATE_HIGH_WATERMARK": "100000", "SPECGATE_LOW_WATERMARK": "1"}  # fmt: skip
    env["OTEL_SDK_DISABLED"] = "true"  # untraced, whatever OTEL_* this shell has
    procs.append(start("specgate", ["-m", "proxy"], ready_url=f"http://127.0.0.1:{port}/ready", env=env))
    targets.append(Target("specgate", port, procs[-1]))
    if otel and (traced := _start_traced(env, procs, say)) is not None:
        targets.append(traced)
    binary = _find("nginx", None) or ("/usr/sbin/nginx" if Path("/usr/sbin/nginx").exists() else None)
    if nginx and binary:
        port = free_port()
        conf = _nginx_conf(port, backend_port, workdir)
        proc = _spawn("nginx", [binary, "-c", str(conf), "-e", f"{workdir}/error.log"])
        procs.append(proc)
        if _wait_ready(proc, f"http://127.0.0.1:{port}/health", 10):
            targets.append(Target("nginx", port, proc))
        else:
            say(f"nginx did not start (see {workdir}/error.log); measuring without it")
    elif nginx:
        say("nginx not found (Debian: apt-get install nginx-light); measuring without it")
    if peers_venv is None:
        return procs, targets
    litellm = _find("litellm", peers_venv)
    if litellm:
        port = free_port()
        # LOCAL_MODEL_COST_MAP: LiteLLM would otherwise fetch its price list from the internet.
        proc = _spawn("litellm", [litellm, "--config", str(_litellm_conf(backend_port, workdir)), "--host",
                                  "127.0.0.1", "--port", str(port), "--num_workers", "1"],
                      env={"LITELLM_LOCAL_MODEL_COST_MAP": "True", "LITELLM_LOG": "ERROR",
                           "LITELLM_MASTER_KEY": _LITELLM_KEY,
                           "DISABLE_SCHEMA_UPDATE": "true"})  # fmt: skip
        procs.append(proc)
        if _wait_ready(proc, f"http://127.0.0.1:{port}/health/liveliness", 120):
            targets.append(Target("litellm", port, proc, {"Authorization": f"Bearer {_LITELLM_KEY}"}))
        else:
            say("LiteLLM's proxy did not start; measuring without it")
    router = _find("python", peers_venv) if (peers_venv / "bin" / "sglang-router").exists() else None
    if router:
        port = free_port()
        proc = _spawn("sglang-router", [router, "-m", "sglang_router.launch_router", "--host", "127.0.0.1",
                                        "--port", str(port), "--worker-urls", f"http://127.0.0.1:{backend_port}",
                                        "--log-level", "warn"])  # fmt: skip
        procs.append(proc)
        if _wait_ready(proc, f"http://127.0.0.1:{port}/health", 60):
            targets.append(Target("sglang-router", port, proc))
        else:
            say("sglang-router did not start; measuring without it")
    return procs, targets


def run_overhead(
    reps: int = 3,
    nginx: bool = True,
    scenarios: tuple[Scenario, ...] = SCENARIOS,
    peers_venv: Path | None = None,
    say: Callable[[str], None] = print,
    otel: bool = False,
) -> list[Result]:
    results: dict[tuple[str, str], Result] = {}
    for pace in sorted({sc.pace_ms for sc in scenarios}):
        group = [sc for sc in scenarios if sc.pace_ms == pace]
        procs: list[Proc] = []
        with tempfile.TemporaryDirectory() as tmp:
            try:
                procs, targets = _start_targets(pace, Path(tmp), nginx, peers_venv, say, otel)
                for rep in range(reps):
                    for sc in group:
                        for t in targets if rep % 2 == 0 else targets[::-1]:
                            sample = uvloop.run(_run(t, sc))
                            results.setdefault((sc.name, t.name), Result(sc.name, t.name)).samples.append(sample)
                    say(f"{'paced' if pace else 'zero-delay'} backend: repetition {rep + 1}/{reps} done")
                for t in targets:
                    if t.sink is not None and t.proc is not None:
                        t.proc.stop()  # its last batch goes out as it stops
                        count = orjson.loads(urllib.request.urlopen(t.sink + "/count", timeout=5).read())
                        say(f"{t.name}: otlpsink received {count['spans']} spans in {count['exports']} exports")
            finally:
                for proc in reversed(procs):
                    proc.stop()
    rank = {sc.name: i for i, sc in enumerate(scenarios)}
    return sorted(results.values(), key=lambda r: rank[r.scenario])


def format_results(results: list[Result]) -> str:
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
                          help="a venv with litellm[proxy] and sglang-router (scripts/install-peers); "
                               "default: .venv-peers beside this venv, when it exists")  # fmt: skip
    overhead.add_argument("--no-peers", action="store_true", help="measure neither LiteLLM nor sglang-router")
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
    results = run_overhead(
        args.reps, nginx=not args.no_nginx, peers_venv=peers, scenarios=scenarios, otel=not args.no_otel
    )
    print(format_results(results))
    if args.out:
        write_json(args.out, {"settings": vars(args), "results": results})
    return 0
