"""A server whose /metrics lies: values no server could report (infinite, negative, past any real
batch or float counter), sums that overflow, bodies too big to parse quickly. Each such reading is
unreadable for that server, said as any unreadable signal is, and the loops that read go on."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Callable, Collection, Iterator, Mapping
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

from proxy.config import Settings
from proxy.fleet import engines, readings
from proxy.fleet.adapter import BadReading, Engine
from proxy.fleet.engines import POOL_KEEPALIVE_S
from proxy.fleet.servers import servers_of
from proxy.observability.metrics import Metrics
from proxy.transport.health import HealthMonitor
from proxy.transport.upstream import Upstream

from ..helpers import wait_until
from ..inprocess import Gateway, StartGateway

Answer = tuple[int, str]


def sglang(running: str, queued: str = "0", accept: str | None = None, tokens: int = 0) -> str:
    """An SGLang /metrics body, labelled per rank as SGLang writes it; `tokens` moves its counters,
    so the server reads as working, not as one whose gauges froze when it went idle."""
    text = (
        "# HELP sglang:num_running_reqs The number of running requests.\n"
        "# TYPE sglang:num_running_reqs gauge\n"
        f'sglang:num_running_reqs{{model_name="m",tp_rank="0"}} {running}\n'
        "# TYPE sglang:num_queue_reqs gauge\n"
        f'sglang:num_queue_reqs{{model_name="m",tp_rank="0"}} {queued}\n'
        "# TYPE sglang:generation_tokens_total counter\n"
        f'sglang:generation_tokens_total{{model_name="m",tp_rank="0"}} {tokens}\n'
    )
    if accept is not None:
        text += f'# TYPE sglang:spec_accept_length gauge\nsglang:spec_accept_length{{model_name="m"}} {accept}\n'
    return text


def vllm(running: str = "1", waiting: str = "0", accepted: str = "0", drafts: str = "0") -> str:
    return (
        "# TYPE vllm:num_requests_running gauge\n"
        f'vllm:num_requests_running{{engine="0",model_name="m"}} {running}\n'
        "# TYPE vllm:num_requests_waiting gauge\n"
        f'vllm:num_requests_waiting{{engine="0",model_name="m"}} {waiting}\n'
        "# TYPE vllm:spec_decode_num_accepted_tokens counter\n"
        f'vllm:spec_decode_num_accepted_tokens_total{{engine="0",model_name="m"}} {accepted}\n'
        "# TYPE vllm:spec_decode_num_drafts counter\n"
        f'vllm:spec_decode_num_drafts_total{{engine="0",model_name="m"}} {drafts}\n'
    )


def big_sglang(size: int) -> str:
    """A valid SGLang /metrics of about `size` bytes: the load gauges, then histograms (most of a
    real body is buckets)."""
    parts = [sglang("3", "1")]
    total, i = len(parts[0]), 0
    while total < size:
        buckets = "".join(
            f'sglang:lat_{i}_bucket{{model_name="m",tp_rank="0",le="{b}"}} {b * 7}.0\n' for b in range(40)
        )
        block = f'# TYPE sglang:lat_{i} histogram\n{buckets}sglang:lat_{i}_count{{model_name="m",tp_rank="0"}} 40.0\n'
        parts.append(block)
        total, i = total + len(block), i + 1
    return "".join(parts)


@dataclass
class Script:
    """What a server's /metrics answers: queued answers one each, then `steady` (a function of how
    many scrapes came, so counters move) for ever."""

    steady: Callable[[int], Answer]
    queue: deque[Answer] = field(default_factory=deque)
    served: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)

    def next(self) -> Answer:
        with self.lock:
            self.served += 1
            return self.queue.popleft() if self.queue else self.steady(self.served)

    def once(self, *answers: Answer) -> None:
        with self.lock:
            self.queue.extend(answers)

    def pending(self) -> int:
        with self.lock:
            return len(self.queue)


def steady(body: Callable[[int], str] | str, status: int = 200) -> Callable[[int], Answer]:
    return lambda n: (status, body(n) if callable(body) else body)


@contextlib.contextmanager
def scripted(script: Script) -> Iterator[str]:
    """A server on loopback: /health 200, /metrics as scripted, completions answered at once."""

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"  # kept alive, as the servers specgate fronts do

        def do_GET(self) -> None:
            if self.path == "/metrics":
                status, text = script.next()
                self.answer(status, text.encode(), "text/plain; version=0.0.4")
            elif self.path == "/health":
                self.answer(200, b"", "text/plain")
            else:
                self.answer(404, b"not here", "text/plain")

        def do_POST(self) -> None:
            self.rfile.read(int(self.headers.get("content-length", "0")))
            body = b'{"choices":[{"index":0,"message":{"role":"assistant","content":"x"}}]}'
            self.answer(200, body, "application/json")

        def answer(self, status: int, body: bytes, content_type: str) -> None:
            self.send_response(status)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    # A short poll: shutdown() waits for the loop's next look, 0.5 s by default, twice a test.
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


@contextlib.asynccontextmanager
async def monitor(
    spec: Script, base: Script, sinks: Mapping[str, Any] | None = None, **settings: Any
) -> AsyncIterator[HealthMonitor]:
    """A HealthMonitor in this process reading two scripted servers through the real upstream,
    telling `sinks` (HealthMonitor's keyword arguments) what it finds."""
    with scripted(spec) as spec_url, scripted(base) as base_url:
        s = Settings(_env_file=None, speculative_url=spec_url, baseline_url=base_url, **settings)
        upstream = Upstream.of(s.routing_topology(), s, keepalive_s=POOL_KEEPALIVE_S)
        try:
            t = s.routing_topology()
            metrics = Metrics(t.names(), [g.name for g in t.groups])
            yield HealthMonitor(s, upstream, servers_of(t), metrics, **(sinks or {}))
        finally:
            await upstream.aclose()


SGLANG_OK = sglang("2", tokens=5)


def read_once(spec_body: str, base_body: str | None = None, **settings: Any) -> HealthMonitor:
    """One poll and scrape of both servers; the monitor as it then stands."""

    async def go() -> HealthMonitor:
        spec, base = Script(steady(spec_body)), Script(steady(base_body or sglang("1", tokens=1)))
        async with monitor(spec, base, **settings) as m:
            await m.poll_once()
            return m

    return asyncio.run(go())


def gauge(m: HealthMonitor, name: str, **labels: str) -> float | None:
    return m._metrics.registry.get_sample_value(name, labels)


def assert_unreadable(m: HealthMonitor, *why: str) -> None:
    """The speculative server's reading was refused as any unreadable signal is, and none of it
    reached the exported metrics."""
    h = m.servers["speculative"].health
    assert h.engine_signal_up is False and h.engine_load is None and h.spec_accept_length is None, h
    assert h.engine_signal_error is not None and all(w in h.engine_signal_error for w in why), h.engine_signal_error
    assert gauge(m, "specgate_engine_signal_up", backend="speculative") == 0
    assert gauge(m, "specgate_server_engine_load", server="speculative") == -1
    if m._settings.load_signal != "local":
        assert m.signal_in_effect()[0] == "mixed"
    # The healthy peer is read as before.
    assert m.servers["baseline"].health.engine_signal_up is True


# --- Values no server could report: unreadable, never passed on -------------------------------


@pytest.mark.parametrize(
    ("body", "why"),
    [
        (sglang("+Inf"), ("sglang:num_running_reqs", "inf")),
        (sglang("-1000000"), ("sglang:num_running_reqs", "-1e+06")),
        (sglang("3", queued="1e300"), ("sglang:num_queue_reqs", "1e+300")),
        (sglang("3", queued="1000001"), ("sglang:num_queue_reqs",)),
        (vllm(running="NaN"), ("vllm:num_requests_running",)),  # NaN is skipped: the metric is missing
    ],
)
def test_an_impossible_load_is_unreadable(body: str, why: tuple[str, ...]) -> None:
    m = read_once(body, SGLANG_OK, load_signal="engine")
    assert_unreadable(m, *why)


def test_two_series_whose_sum_overflows_are_unreadable() -> None:
    # Each 1.7e308 is a float; their sum is not (inf): specgate must not take it for a load. (Two
    # data-parallel ranks: their series are summed; a second tensor-parallel rank's would be a copy.)
    body = sglang("1.7e308") + 'sglang:num_running_reqs{dp_rank="1",model_name="m",tp_rank="0"} 1.7e308\n'
    assert_unreadable(read_once(body, SGLANG_OK, load_signal="engine"), "sglang:num_running_reqs", "inf")


@pytest.mark.parametrize(
    ("body", "why"),
    [
        (sglang("1", accept="-99"), ("sglang:spec_accept_length", "-99")),
        (sglang("1", accept="+Inf"), ("sglang:spec_accept_length", "inf")),
        (sglang("1", accept="0.5"), ("sglang:spec_accept_length",)),
        (sglang("1", accept="65"), ("sglang:spec_accept_length",)),
        (sglang("1", tokens=1) + "sglang:gen_throughput +Inf\n", ("sglang:gen_throughput", "inf")),
        # Counters: 1 + (-100) / 1 = -99; one past what a float counts exactly; a rate of 100.
        (vllm(accepted="-100", drafts="1"), ("vllm:spec_decode_num_accepted_tokens_total",)),
        (vllm(accepted="1e300", drafts="10"), ("vllm:spec_decode_num_accepted_tokens_total", "1e+300")),
        (vllm(accepted="10", drafts="+Inf"), ("vllm:spec_decode_num_drafts_total", "inf")),
        (vllm(accepted="990", drafts="10"), ("acceptance", "100")),
    ],
)
def test_an_impossible_acceptance_or_activity_is_unreadable(body: str, why: tuple[str, ...]) -> None:
    m = read_once(body, SGLANG_OK, load_signal="engine")
    assert_unreadable(m, *why)
    exported = gauge(m, "specgate_accept_length", backend="speculative")
    assert exported is not None and math.isnan(exported)  # no acceptance exported


def test_real_readings_still_read() -> None:
    m = read_once(sglang("3", queued="1", accept="0", tokens=9), vllm("2", "1", accepted="150", drafts="100"))
    spec, base = m.servers["speculative"].health, m.servers["baseline"].health
    assert (spec.engine_load, spec.spec_accept_length, spec.engine_signal_up) == (4, None, True)  # 0: no speculation
    assert (base.engine, base.engine_load, base.spec_accept_length) == ("vllm", 3, 2.5)
    m = read_once(sglang("1", accept="2.75", tokens=9))
    assert m.servers["speculative"].health.spec_accept_length == 2.75


def test_an_oversized_metrics_body_is_unreadable_and_says_why() -> None:
    m = read_once(big_sglang(5 * 1024 * 1024), SGLANG_OK, load_signal="engine")
    assert_unreadable(m, "MiB")


def test_parsing_a_big_valid_body_reads_only_what_the_adapters_use() -> None:
    text = big_sglang(8 * 1024 * 1024)
    began = time.perf_counter()
    engine, values = readings.read_metrics(text)
    took_s = time.perf_counter() - began
    assert engine is engines.SGLANG and engine.read(values).load == 4
    # Every one of 135,000 lines parsed took 1.6 s here; the few the adapters read, ~10 ms.
    assert took_s < 0.4, took_s


def test_engines_are_detected_from_names_the_adapters_do_not_read_too() -> None:
    # A llama-server without the load metrics: it is named, and what it lacks is said.
    engine, values = readings.read_metrics(
        "# TYPE llamacpp:prompt_tokens_total counter\nllamacpp:prompt_tokens_total 3\n"
    )
    assert engine is engines.LLAMACPP and engine.read(values).load is None
    assert readings.read_metrics("# TYPE up gauge\nup 1\n") == (None, {})
    engine, values = readings.read_metrics(vllm("2", "1"), engines.VLLM)
    assert engine is engines.VLLM and values["vllm:num_requests_running"] == 2
    with pytest.raises(BadReading, match="series"):  # a flood of one read name is refused, not parsed
        readings.read_metrics("".join(f'sglang:num_running_reqs{{r="{i}"}} 1\n' for i in range(10_000)))


# --- Background loops: a failing round is said once, and the next one runs ---------------------


def run_loops(
    caplog: pytest.LogCaptureFixture,
    arrange: Callable[[HealthMonitor], Callable[[], bool]],
    what: str,
    sinks: Mapping[str, Any] | None = None,
) -> None:
    """Run the monitor's loops, telling `sinks`, with `arrange`'s fault in place until its
    condition holds; the failure was logged once, with its type, and the recovery after it."""

    async def go() -> None:
        spec = Script(steady(lambda n: sglang("2", tokens=n)))
        base = Script(steady(lambda n: sglang("1", tokens=n)))
        async with monitor(spec, base, sinks, health_interval_s=0.05, scrape_interval_s=0.1) as m:
            done = arrange(m)
            task = asyncio.get_running_loop().create_task(m.run())
            try:
                await wait_until(lambda: done() and any("works again" in r.getMessage() for r in caplog.records), 10)
            finally:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
            assert task.cancelled()  # cancelling still stops the loops

    with caplog.at_level(logging.INFO, logger="specgate.health"):
        asyncio.run(go())
    failed = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(failed) == 1 and what in failed[0].getMessage() and "RuntimeError: boom" in failed[0].getMessage()
    assert failed[0].exc_info is not None  # with its traceback
    recovered = [r for r in caplog.records if "works again" in r.getMessage()]
    assert len(recovered) == 1 and recovered[0].levelno == logging.INFO and what in recovered[0].getMessage()


def fail(times: int) -> Callable[..., None]:
    """A callback that raises its first `times` calls."""
    calls = [0]

    def call(*args: object) -> None:
        calls[0] += 1
        if calls[0] <= times:
            raise RuntimeError("boom")

    return call


def test_the_scrape_loop_survives_a_failing_on_reading(caplog: pytest.LogCaptureFixture) -> None:
    def arrange(m: HealthMonitor) -> Callable[[], bool]:
        return lambda: m.servers["speculative"].health.engine_signal_up is True

    run_loops(caplog, arrange, "scrape", {"on_reading": fail(3)})


def test_the_scrape_loop_survives_a_parse_that_raises(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    real = readings.parse_metrics
    calls = [0]

    def flaky(text: str, wanted: Collection[str] | None = None, engine: Engine | None = None) -> dict[str, float]:
        calls[0] += 1
        if calls[0] == 1:
            raise RuntimeError("boom")
        return real(text, wanted, engine)

    monkeypatch.setattr(readings, "parse_metrics", flaky)

    def arrange(m: HealthMonitor) -> Callable[[], bool]:
        return lambda: calls[0] > 4 and all(s.health.engine_signal_up for s in m.servers.values())

    run_loops(caplog, arrange, "scrape")


def test_the_poll_loop_survives_a_failing_on_change(caplog: pytest.LogCaptureFixture) -> None:
    def arrange(m: HealthMonitor) -> Callable[[], bool]:
        return lambda: all(s.healthy for s in m.servers.values())

    run_loops(caplog, arrange, "poll", {"on_change": fail(2)})


def test_the_poll_loop_survives_a_failing_probe(caplog: pytest.LogCaptureFixture) -> None:
    def arrange(m: HealthMonitor) -> Callable[[], bool]:
        get, calls = m._upstream.get, [0]

        async def flaky(server: str, path: str, timeout_s: float) -> Any:
            if path == "/health":
                calls[0] += 1
                if calls[0] <= 2:
                    raise RuntimeError("boom")
            return await get(server, path, timeout_s)

        m._upstream.get = flaky  # type: ignore[method-assign]
        return lambda: calls[0] > 4 and all(s.healthy for s in m.servers.values())

    run_loops(caplog, arrange, "poll")


# --- End to end: the app in front of lying servers ----------------------------------------------


@contextlib.asynccontextmanager
async def proxied(gateway: StartGateway, spec: Script, base: Script) -> AsyncIterator[Gateway]:
    with scripted(spec) as spec_url, scripted(base) as base_url:
        yield await gateway(
            speculative_url=spec_url, baseline_url=base_url, health_interval_s=0.1, load_signal="engine"
        )


async def server(gw: Gateway, name: str) -> dict[str, Any]:
    found: dict[str, Any] = (await gw.routing())["servers"][name]
    return found


async def signal_gauge(gw: Gateway, backend: str) -> str:
    text = await gw.metrics_text()
    return next(ln for ln in text.splitlines() if ln.startswith(f'specgate_engine_signal_up{{backend="{backend}"}}'))


@pytest.mark.anyio
async def test_one_infinite_reading_then_normal_ones_are_read_and_a_later_500_noticed(gateway: StartGateway) -> None:
    spec = Script(steady(lambda n: sglang("3", tokens=n)))
    base = Script(steady(lambda n: sglang("3", tokens=n)))
    async with proxied(gateway, spec, base) as gw:

        async def loads() -> tuple[object, object]:
            return (await server(gw, "speculative"))["engine_load"], (await server(gw, "baseline"))["engine_load"]

        async def loads_are(want: tuple[int, int]) -> bool:
            return await loads() == want

        await wait_until(lambda: loads_are((3, 3)))
        spec.once((200, sglang("+Inf", tokens=10**6)))
        await wait_until(lambda: spec.pending() == 0)
        spec.steady = steady(lambda n: sglang("7", tokens=n))
        base.steady = steady(lambda n: sglang("9", tokens=n))
        await wait_until(lambda: loads_are((7, 9)))
        spec.steady = steady("oops", status=500)

        async def spec_signal_down() -> bool:
            return not (await server(gw, "speculative"))["engine_signal_up"]

        await wait_until(spec_signal_down)
        assert "500" in (await server(gw, "speculative"))["engine_signal_error"]
        assert (await signal_gauge(gw, "speculative")).endswith(" 0.0")


@pytest.mark.anyio
async def test_a_huge_reading_is_unreadable_not_a_routing_error_or_a_heavy_load(gateway: StartGateway) -> None:
    spec = Script(steady(lambda n: sglang("1e300", tokens=n)))
    base = Script(steady(lambda n: sglang("0", tokens=n)))
    async with proxied(gateway, spec, base) as gw:

        async def scraped() -> bool:
            return (await server(gw, "speculative"))["engine_signal_error"] not in (None, "not scraped yet")

        await wait_until(scraped)
        s = await server(gw, "speculative")
        assert s["engine_load"] is None and "1e+300" in s["engine_signal_error"]
        chat = {"messages": [{"role": "user", "content": "x"}]}
        r = await gw.client.post("/v1/chat/completions", json=chat)
        assert r.status_code == 200 and r.headers["x-specgate-reason"] == "light_load"
        spec.steady = steady(lambda n: sglang("2", tokens=n))

        async def reads_2() -> bool:
            return bool((await server(gw, "speculative"))["engine_load"] == 2)

        await wait_until(reads_2)
        r = await gw.client.post("/v1/chat/completions", json=chat)
        assert r.headers["x-specgate-reason"] == "light_load"


@pytest.mark.anyio
async def test_specgate_starts_with_an_impossible_reading_present(gateway: StartGateway) -> None:
    spec = Script(steady(lambda n: sglang("+Inf", tokens=n)))
    base = Script(steady(lambda n: sglang("1", tokens=n)))
    async with proxied(gateway, spec, base) as gw:  # before: the first scrape's OverflowError ended the start
        s = await server(gw, "speculative")
        assert not s["engine_signal_up"] and "inf" in s["engine_signal_error"]
        assert (await server(gw, "baseline"))["engine_load"] == 1
        assert (await signal_gauge(gw, "speculative")).endswith(" 0.0")
