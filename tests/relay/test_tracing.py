"""OpenTelemetry traces (proxy/observability/tracing.py): a span per proxied request with the routing decision on
it, child spans per upstream attempt, the client's trace context continued and the server's request
made a child of specgate's. In-process, the SDK's in-memory exporter is handed to the app; once over
OTLP/HTTP, specgate runs as a process and exports to `loadtest.otlpsink` on loopback."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import sys
import threading
import time
from collections.abc import AsyncIterator, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest
from opentelemetry.sdk.resources import SERVICE_NAME
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.sdk.trace.sampling import ALWAYS_OFF, TraceIdRatioBased
from opentelemetry.trace import SpanKind, StatusCode

from loadtest.overhead import Scenario, format_results, run_overhead
from loadtest.procs import Proc, free_port, start
from proxy.fleet.topology import build
from proxy.observability.tracing import FLUSH_TIMEOUT_S, Tracing, flush_timeout_s, provider_from_env

from ..conftest import StartStack
from ..helpers import sse_json, wait_for, wait_until
from ..inprocess import StartGateway

CHAT = [{"role": "user", "content": "a secret prompt that must never reach a span"}]
LONG = {"prompt": "p", "max_tokens": 120_000, "stream": True}
TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT_ID = "00f067aa0ba902b7"
CLIENT_CONTEXT = {"traceparent": f"00-{TRACE_ID}-{PARENT_ID}-01", "tracestate": "vendor=abc,other=1"}
OTEL_VARS = (
    "OTEL_EXPORTER_OTLP_ENDPOINT",
    "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
    "OTEL_SDK_DISABLED",
    "OTEL_TRACES_EXPORTER",
    "OTEL_EXPORTER_OTLP_PROTOCOL",
    "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL",
    "OTEL_SERVICE_NAME",
    "OTEL_RESOURCE_ATTRIBUTES",
    "OTEL_TRACES_SAMPLER",
    "OTEL_TRACES_SAMPLER_ARG",
    "OTEL_BSP_EXPORT_TIMEOUT",
    "OTEL_BSP_MAX_EXPORT_BATCH_SIZE",
    "OTEL_EXPORTER_OTLP_TIMEOUT",
    "OTEL_EXPORTER_OTLP_TRACES_TIMEOUT",
)


@pytest.fixture(autouse=True)
def _no_otel_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """Only what a test sets: an OTEL_* variable of the machine's must not turn tracing on here."""
    for name in OTEL_VARS:
        monkeypatch.delenv(name, raising=False)


@dataclass
class Spans:
    provider: TracerProvider
    exporter: InMemorySpanExporter = field(default_factory=InMemorySpanExporter)

    def all(self) -> Sequence[ReadableSpan]:
        return self.exporter.get_finished_spans()

    def named(self, name: str) -> list[ReadableSpan]:
        return [s for s in self.all() if s.name == name]

    def one(self, name: str) -> ReadableSpan:
        found = self.named(name)
        assert len(found) == 1, [s.name for s in self.all()]
        return found[0]


@pytest.fixture
def spans() -> Iterator[Spans]:
    """A provider exporting each span as it ends into memory (no batching: nothing to wait for)."""
    provider = TracerProvider(shutdown_on_exit=False)
    out = Spans(provider)
    provider.add_span_processor(SimpleSpanProcessor(out.exporter))
    yield out
    provider.shutdown()


def attrs(span: ReadableSpan) -> dict[str, Any]:
    return dict(span.attributes or {})


def parent_id(span: ReadableSpan) -> int | None:
    return span.parent.span_id if span.parent is not None else None


@dataclass
class Recorded:
    """What a recording server was sent: each POST's header lines, as (name, value), in order."""

    url: str
    heads: list[list[tuple[str, str]]] = field(default_factory=list)

    def values(self, i: int, name: str) -> list[str]:
        return [v for k, v in self.heads[i] if k == name]


@contextlib.asynccontextmanager
async def recording_server(mode: str = "ok") -> AsyncIterator[Recorded]:
    """A server on loopback that records each POST's headers. mode `ok`: a small JSON answer;
    `cut`: an event stream's head and one event, then the connection closes mid-body."""
    rec = Recorded("")

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(ConnectionError, asyncio.IncompleteReadError):
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                lines = head.decode("latin-1").split("\r\n")
                pairs = [(k.strip().lower(), v.strip()) for k, _, v in (ln.partition(":") for ln in lines[1:] if ln)]
                length = next((int(v) for k, v in pairs if k == "content-length"), 0)
                await reader.readexactly(length)
                if not lines[0].startswith("POST "):  # /health, /metrics
                    writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n")
                    await writer.drain()
                    continue
                rec.heads.append(pairs)
                if mode == "cut":
                    event = b'data: {"choices":[]}\n\n'
                    writer.write(
                        b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
                        + b"%x\r\n%s\r\n" % (len(event), event)
                    )
                    await writer.drain()
                    break
                body = b'{"choices":[{"index":0,"text":"ok"}]}'
                writer.write(
                    b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(body)
                    + body
                )
                await writer.drain()
        writer.close()

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    rec.url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
    try:
        yield rec
    finally:
        server.close()
        await server.wait_closed()


# ----- in-process: the app with the in-memory exporter -----


@pytest.mark.anyio
@pytest.mark.parametrize("stream", [False, True])
async def test_a_span_per_request_with_the_decision_and_its_children(
    gateway: StartGateway, spans: Spans, stream: bool
) -> None:
    gw = await gateway(tracer_provider=spans.provider)
    body = {"model": "default", "messages": CHAT, "max_tokens": 4, "stream": stream}
    r = await gw.client.post("/v1/chat/completions", json=body)
    assert r.status_code == 200
    if stream:
        assert len(sse_json(r.content)) >= 4
    server = spans.one("POST /v1/chat/completions")
    assert server.kind == SpanKind.SERVER and server.parent is None
    a = attrs(server)
    assert a["http.request.method"] == "POST" and a["url.path"] == "/v1/chat/completions"
    assert a["http.route"] == "/v1/chat/completions" and a["http.response.status_code"] == 200
    assert a["specgate.request_id"] == r.headers["x-request-id"]
    decision = (a["specgate.backend"], a["specgate.reason"], a["specgate.mode"])
    assert decision == ("speculative", "light_load", "speculative")
    assert (a["specgate.server"], a["specgate.group"], a["specgate.load"]) == ("speculative", "group-0", 0)
    assert not {"specgate.probe", "specgate.shadow", "specgate.failover", "specgate.affinity"} & set(a)
    assert a["gen_ai.request.model"] == "default"
    assert server.status.status_code == StatusCode.UNSET and "error.type" not in a
    connect, first = spans.one("upstream connect"), spans.one("first byte")
    for child in (connect, first):
        assert child.kind == SpanKind.CLIENT
        assert child.context.trace_id == server.context.trace_id and parent_id(child) == server.context.span_id
    c = attrs(connect)
    port = int(gw.spec.url.rsplit(":", 1)[1])
    assert (c["specgate.server"], c["specgate.attempt"], c["http.response.status_code"]) == ("speculative", 0, 200)
    assert (c["server.address"], c["server.port"]) == ("127.0.0.1", port)
    assert connect.end_time is not None and first.start_time is not None and connect.end_time <= first.start_time
    assert first.end_time is not None and server.end_time is not None and first.end_time <= server.end_time
    # Neither the prompt nor anything of the body but the model's name is on any span.
    for span in spans.all():
        assert not any("secret prompt" in str(v) for v in attrs(span).values())


@pytest.mark.anyio
async def test_the_clients_trace_context_is_continued_and_the_server_gets_specgates(
    gateway: StartGateway, spans: Spans
) -> None:
    async with recording_server() as rec:
        gw = await gateway(speculative_url=rec.url, tracer_provider=spans.provider)
        r = await gw.client.post("/v1/completions", json={"prompt": "p", "max_tokens": 2}, headers=CLIENT_CONTEXT)
        assert r.status_code == 200
    server = spans.one("POST /v1/completions")
    assert f"{server.context.trace_id:032x}" == TRACE_ID
    assert server.parent is not None and server.parent.is_remote and f"{server.parent.span_id:016x}" == PARENT_ID
    connect = spans.one("upstream connect")
    # One traceparent, naming the attempt's span in the client's trace; the client's tracestate kept.
    assert rec.values(0, "traceparent") == [f"00-{TRACE_ID}-{connect.context.span_id:016x}-01"]
    assert rec.values(0, "tracestate") == ["vendor=abc,other=1"]


@pytest.mark.anyio
async def test_without_a_client_context_a_new_trace_reaches_the_server(gateway: StartGateway, spans: Spans) -> None:
    async with recording_server() as rec:
        gw = await gateway(speculative_url=rec.url, tracer_provider=spans.provider)
        assert (await gw.client.post("/v1/completions", json={"prompt": "p"})).status_code == 200
    server, connect = spans.one("POST /v1/completions"), spans.one("upstream connect")
    assert server.parent is None
    ids = f"{server.context.trace_id:032x}-{connect.context.span_id:016x}"
    # Flags 03: sampled, and a random trace id (W3C Trace Context level 2), as the SDK makes them.
    assert rec.values(0, "traceparent") == [f"00-{ids}-03"] and rec.values(0, "tracestate") == []


@pytest.mark.anyio
async def test_a_request_the_sampler_leaves_out_makes_no_span_but_tells_the_server(gateway: StartGateway) -> None:
    exporter = InMemorySpanExporter()
    provider = TracerProvider(sampler=ALWAYS_OFF, shutdown_on_exit=False)
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    async with recording_server() as rec:
        gw = await gateway(speculative_url=rec.url, tracer_provider=provider)
        r = await gw.client.post("/v1/completions", json={"prompt": "p"}, headers=CLIENT_CONTEXT)
        assert r.status_code == 200
    assert exporter.get_finished_spans() == ()
    # The client's trace, not sampled (flags 00), under a span id of specgate's.
    (parent,) = rec.values(0, "traceparent")
    version, trace_id, span_id, flags = parent.split("-")
    assert (version, trace_id, flags) == ("00", TRACE_ID, "00") and span_id != PARENT_ID
    assert rec.values(0, "tracestate") == [CLIENT_CONTEXT["tracestate"]]
    provider.shutdown()


@pytest.mark.anyio
async def test_tracing_off_passes_the_clients_context_through_untouched(
    gateway: StartGateway, monkeypatch: pytest.MonkeyPatch
) -> None:
    made: list[object] = []
    monkeypatch.setattr(Tracing, "__init__", lambda *a, **k: made.append(a))
    async with recording_server() as rec:
        gw = await gateway(speculative_url=rec.url)
        r = await gw.client.post("/v1/completions", json={"prompt": "p"}, headers=CLIENT_CONTEXT)
        assert r.status_code == 200
    assert rec.values(0, "traceparent") == [CLIENT_CONTEXT["traceparent"]]
    assert rec.values(0, "tracestate") == [CLIENT_CONTEXT["tracestate"]]
    assert made == []  # no provider, no tracer: nothing was built


@pytest.mark.anyio
async def test_a_failover_gives_a_second_attempt(gateway: StartGateway, spans: Spans) -> None:
    gw = await gateway(health_interval_s=60, tracer_provider=spans.provider)  # no poll notices the stop
    await gw.spec.stop()
    r = await gw.client.post("/v1/completions", json={"prompt": "p", "max_tokens": 3})
    assert (r.status_code, r.headers["x-specgate-reason"]) == (200, "failover")
    server = spans.one("POST /v1/completions")
    a = attrs(server)
    assert (a["specgate.backend"], a["specgate.server"], a["specgate.reason"]) == ("baseline", "baseline", "failover")
    assert a["specgate.failover"] is True and server.status.status_code == StatusCode.UNSET
    first, second = sorted(spans.named("upstream connect"), key=lambda s: attrs(s)["specgate.attempt"])
    assert (attrs(first)["specgate.server"], attrs(first)["error.type"]) == ("speculative", "connect")
    assert first.status.status_code == StatusCode.ERROR
    assert (attrs(second)["specgate.server"], attrs(second)["specgate.attempt"]) == ("baseline", 1)
    assert second.status.status_code == StatusCode.UNSET
    assert {parent_id(first), parent_id(second)} == {server.context.span_id}
    assert len(spans.named("first byte")) == 1


@pytest.mark.anyio
async def test_an_upstream_failure_is_an_error_with_its_kind(gateway: StartGateway, spans: Spans) -> None:
    gw = await gateway(health_interval_s=60, tracer_provider=spans.provider)
    await gw.spec.stop()
    await gw.base.stop()
    r = await gw.client.post("/v1/completions", json={"prompt": "p", "max_tokens": 3})
    assert r.status_code == 503
    server = spans.one("POST /v1/completions")
    assert server.status.status_code == StatusCode.ERROR
    assert attrs(server)["error.type"] == "connect" and attrs(server)["http.response.status_code"] == 503
    assert [s.status.status_code for s in spans.named("upstream connect")] == [StatusCode.ERROR] * 2


@pytest.mark.anyio
async def test_a_stream_broken_by_the_server_is_an_error(gateway: StartGateway, spans: Spans) -> None:
    async with recording_server("cut") as rec:
        gw = await gateway(speculative_url=rec.url, tracer_provider=spans.provider)
        r = await gw.client.post("/v1/completions", json={"prompt": "p", "stream": True})
        assert r.status_code == 200 and b"upstream_disconnect" in r.content
    server = spans.one("POST /v1/completions")
    assert server.status.status_code == StatusCode.ERROR and attrs(server)["error.type"] == "disconnect"
    assert [e.name for e in server.events] == ["upstream stream broke"]


@pytest.mark.anyio
async def test_a_client_that_leaves_is_a_499_with_an_event(gateway: StartGateway, spans: Spans) -> None:
    gw = await gateway(tracer_provider=spans.provider)
    async with gw.stream(LONG) as r:
        assert r.status_code == 200
        assert spans.named("POST /v1/completions") == []  # still running
    await wait_until(lambda: spans.named("POST /v1/completions"))
    server = spans.one("POST /v1/completions")
    assert attrs(server)["http.response.status_code"] == 499
    assert [e.name for e in server.events] == ["client disconnected"]
    assert server.status.status_code == StatusCode.UNSET  # the client's doing, not the server's


@pytest.mark.anyio
async def test_a_request_refused_at_the_door_has_its_span(gateway: StartGateway, spans: Spans) -> None:
    gw = await gateway(api_keys="right", tracer_provider=spans.provider)
    r = await gw.client.post("/v1/completions", json={"prompt": "p"}, headers={"authorization": "Bearer wrong"})
    assert r.status_code == 401
    server = spans.one("POST /v1/completions")
    a = attrs(server)
    assert a["http.response.status_code"] == 401 and a["specgate.error_code"] == "invalid_api_key"
    assert server.status.status_code == StatusCode.UNSET and "specgate.backend" not in a
    assert spans.named("upstream connect") == []


@pytest.mark.anyio
async def test_a_shadow_probe_is_a_child_of_the_request_it_copies(gateway: StartGateway, spans: Spans) -> None:
    # Everything goes to the baseline (watermark 0), and a shadow copy is due as soon as the
    # speculative server has been idle 0.05 s.
    gw = await gateway(
        tracer_provider=spans.provider,
        policy="adaptive",
        high_watermark=0,
        low_watermark=0,
        adaptive_min_dwell_s=0,
        adaptive_probe_s=0.05,
        adaptive_probe_max_s=0.05,
    )
    body = {"model": "m", "messages": CHAT, "max_tokens": 40}

    async def shadowed() -> bool:
        assert (await gw.client.post("/v1/chat/completions", json=body)).headers["x-specgate-backend"] == "baseline"
        return bool(spans.named("shadow probe"))

    await wait_until(shadowed, timeout_s=10, interval_s=0.05)
    probe = spans.named("shadow probe")[0]
    parent = next(s for s in spans.named("POST /v1/chat/completions") if s.context.span_id == parent_id(probe))
    assert attrs(parent)["specgate.shadow"] is True and attrs(parent)["specgate.backend"] == "baseline"
    assert probe.kind == SpanKind.CLIENT and attrs(probe)["specgate.server"] == "speculative"
    assert attrs(probe)["specgate.outcome"] == "ok" and attrs(probe)["http.response.status_code"] == 200


@pytest.mark.anyio
async def test_a_responses_continuation_says_whether_it_reached_its_server(gateway: StartGateway, spans: Spans) -> None:
    gw = await gateway(tracer_provider=spans.provider, health_interval_s=0.1)
    first = await gw.client.post("/v1/responses", json={"model": "m", "input": "hi", "max_output_tokens": 2})
    assert first.headers["x-specgate-backend"] == "speculative"
    after = {"input": "again", "previous_response_id": first.json()["id"], "max_output_tokens": 2}
    assert (await gw.client.post("/v1/responses", json=after)).headers["x-specgate-reason"] == "stored_response"
    await gw.client.post("/v1/responses", json={**after, "previous_response_id": "resp_nobody"})
    await gw.spec.stop()

    async def spec_down() -> bool:
        return (await gw.routing())["backends"]["speculative"]["healthy"] is False

    await wait_until(spec_down)
    await gw.client.post("/v1/responses", json=after)
    plain, held, unknown, down = spans.named("POST /v1/responses")
    assert "specgate.affinity" not in attrs(plain) and attrs(plain)["gen_ai.request.model"] == "m"
    assert [attrs(s)["specgate.affinity"] for s in (held, unknown, down)] == ["held", "unknown", "down"]
    assert attrs(held)["specgate.reason"] == "stored_response"


# ----- the OTEL_* variables -----

TOPOLOGY = build("http://127.0.0.1:1", "http://127.0.0.1:2", None)


@contextlib.contextmanager
def made(monkeypatch: pytest.MonkeyPatch, **env: str) -> Iterator[TracerProvider | None]:
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    got = provider_from_env()
    try:
        yield None if got is None else got.provider
    finally:
        if got is not None:
            got.provider.shutdown()


def test_off_unless_an_endpoint_is_set(monkeypatch: pytest.MonkeyPatch) -> None:
    assert Tracing.of(TOPOLOGY, ()) is None
    with made(monkeypatch, OTEL_SERVICE_NAME="x", OTEL_TRACES_SAMPLER="always_on") as p:
        assert p is None
    for var in ("OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"):
        with monkeypatch.context() as m, made(m, **{var: "http://127.0.0.1:9"}) as p:
            assert isinstance(p, TracerProvider)


def test_the_sdk_reads_the_service_resource_and_sampler(monkeypatch: pytest.MonkeyPatch) -> None:
    with made(monkeypatch, OTEL_EXPORTER_OTLP_ENDPOINT="http://127.0.0.1:9") as p:
        assert p is not None and p.resource.attributes[SERVICE_NAME] == "specgate"
    with made(
        monkeypatch,
        OTEL_SERVICE_NAME="gw-a",
        OTEL_RESOURCE_ATTRIBUTES="deployment.environment=test",
        OTEL_TRACES_SAMPLER="traceidratio",
        OTEL_TRACES_SAMPLER_ARG="0.25",
    ) as p:
        assert p is not None
        assert p.resource.attributes[SERVICE_NAME] == "gw-a"
        assert p.resource.attributes["deployment.environment"] == "test"
        assert isinstance(p.sampler, TraceIdRatioBased) and p.sampler.rate == 0.25
    monkeypatch.delenv("OTEL_SERVICE_NAME")
    with made(monkeypatch, OTEL_RESOURCE_ATTRIBUTES="service.name=from-attrs") as p:
        assert p is not None and p.resource.attributes[SERVICE_NAME] == "from-attrs"


@pytest.mark.parametrize(
    ("env", "says"),
    [
        ({"OTEL_SDK_DISABLED": "true"}, "OTEL_SDK_DISABLED"),
        ({"OTEL_TRACES_EXPORTER": "none"}, "OTEL_TRACES_EXPORTER=none"),
        ({"OTEL_TRACES_EXPORTER": "zipkin"}, "over OTLP only; tracing off"),
        ({"OTEL_EXPORTER_OTLP_PROTOCOL": "grpc"}, "grpc"),
        ({"OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "http/json"}, "http/json"),
    ],
)
def test_variables_that_turn_it_off(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, env: dict[str, str], says: str
) -> None:
    caplog.set_level(logging.INFO, "specgate.tracing")
    with made(monkeypatch, OTEL_EXPORTER_OTLP_ENDPOINT="http://127.0.0.1:9", **env) as p:
        assert p is None
    assert says in caplog.text


def test_without_the_sdk_it_says_so_once_and_serves_untraced(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    # None in sys.modules makes the import fail, as in an install without the `otel` extra.
    monkeypatch.setitem(sys.modules, "opentelemetry.sdk.trace", None)
    with made(monkeypatch, OTEL_EXPORTER_OTLP_ENDPOINT="http://user:pw@127.0.0.1:9") as p:
        assert p is None
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "pip install 'specgate[otel]'" in warnings[0].getMessage()
    assert "pw" not in caplog.text


def test_the_flush_bound_at_exit_is_otel_bsp_export_timeout(caplog: pytest.LogCaptureFixture) -> None:
    assert flush_timeout_s({}) == FLUSH_TIMEOUT_S == 5
    assert flush_timeout_s({"OTEL_BSP_EXPORT_TIMEOUT": "2500"}) == 2.5
    assert flush_timeout_s({"OTEL_BSP_EXPORT_TIMEOUT": "0"}) == 0
    assert not caplog.records
    for junk in ("soon", "-1", "nan", "inf"):
        caplog.clear()
        assert flush_timeout_s({"OTEL_BSP_EXPORT_TIMEOUT": junk}) == FLUSH_TIMEOUT_S
        (warning,) = caplog.records
        assert warning.levelno == logging.WARNING and "OTEL_BSP_EXPORT_TIMEOUT" in warning.getMessage()
    # The mapping given, not the process's environment.
    made = provider_from_env({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:9", "OTEL_BSP_EXPORT_TIMEOUT": "700"})
    assert made is not None and made.flush_s == 0.7
    made.provider.shutdown()


@contextlib.contextmanager
def black_hole() -> Iterator[str]:
    """A collector that takes connections (the kernel's backlog) but never reads or answers them."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen(100)
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"


@pytest.mark.anyio
async def test_a_collector_that_never_answers_delays_the_exit_by_the_flush_bound_only(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Issue 53: the SDK's shutdown waited 30 s for a black-holed collector, past a pod's grace period."""
    caplog.set_level(logging.WARNING)
    before = set(threading.enumerate())
    with black_hole() as url:
        # The exporter reads its own variables from the process's environment: a batch a span, each
        # given up after 0.5 s (too soon for a retry), so the SDK alone would wait its whole 30 s
        # on 80 spans.
        for name, value in (("OTEL_EXPORTER_OTLP_ENDPOINT", url), ("OTEL_BSP_MAX_EXPORT_BATCH_SIZE", "1"),
                            ("OTEL_EXPORTER_OTLP_TRACES_TIMEOUT", "0.5")):  # fmt: skip
            monkeypatch.setenv(name, value)
        made = provider_from_env({"OTEL_EXPORTER_OTLP_ENDPOINT": url, "OTEL_BSP_EXPORT_TIMEOUT": "300"})
        assert made is not None
        tracing = Tracing(made.provider, TOPOLOGY, owned=made)
        for _ in range(80):
            tracing.tracer.start_span("POST /v1/completions").end()
        t0 = time.monotonic()
        await tracing.aclose()
        took = time.monotonic() - t0
        # A bound on a hang, not a benchmark: the SDK's own is 30 s.
        assert took < 10, took
        ours = [r for r in caplog.records if r.name == "specgate.tracing" and r.levelno >= logging.WARNING]
        assert len(ours) == 1, [r.getMessage() for r in ours]
        assert url in ours[0].getMessage() and "spans may be lost" in ours[0].getMessage()
        # Nothing the tracing started holds up the interpreter's exit.
        started = [t for t in threading.enumerate() if t not in before and not t.name.startswith("asyncio_")]
        assert started and all(t.daemon for t in started), [(t.name, t.daemon) for t in started]
    # The collector gone, each batch fails at once and the threads end (within this test, so
    # that the exporter's complaints land in its logs, not in another test's).
    await wait_until(lambda: not any(t.is_alive() for t in started), timeout_s=10)


def test_span_names_take_the_route_not_the_path(spans: Spans) -> None:
    tracing = Tracing(spans.provider, TOPOLOGY, ("/v1/completions", "/v1/*"))
    assert tracing.route("/v1/completions") == "/v1/completions"
    assert tracing.route("/v1/anything/at/all") == "/v1/*"


# ----- over OTLP/HTTP to a receiver on loopback -----


def sink_spans(url: str) -> list[dict[str, Any]]:
    found: list[dict[str, Any]] = httpx.get(url + "/spans", timeout=5).json()["spans"]
    return found


@pytest.fixture
def otlp_sink() -> Iterator[tuple[str, Proc]]:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = start("otlpsink", ["-m", "loadtest.otlpsink", "--port", str(port)], ready_url=url + "/count")
    yield url, proc
    proc.stop()


def test_spans_reach_an_otlp_receiver_and_the_last_at_exit(stack: StartStack, otlp_sink: tuple[str, Proc]) -> None:
    sink, _ = otlp_sink
    s = stack(
        OTEL_EXPORTER_OTLP_ENDPOINT=sink,
        OTEL_SERVICE_NAME="specgate-test",
        OTEL_RESOURCE_ATTRIBUTES="deployment.environment=loopback",
        OTEL_BSP_SCHEDULE_DELAY="100",
    )
    body = {"model": "default", "messages": CHAT, "max_tokens": 4, "stream": True}
    with httpx.Client(base_url=s.url, timeout=30) as client:
        for _ in range(3):
            assert client.post("/v1/chat/completions", json=body, headers=CLIENT_CONTEXT).status_code == 200
    wait_for(lambda: len([x for x in sink_spans(sink) if x["kind"] == "server"]) >= 3, timeout_s=15)
    got = sink_spans(sink)
    servers = [x for x in got if x["name"] == "POST /v1/chat/completions"]
    assert len(servers) == 3
    for server in servers:
        assert (server["trace_id"], server["parent_span_id"]) == (TRACE_ID, PARENT_ID)
        assert server["resource"]["service.name"] == "specgate-test"
        assert server["resource"]["deployment.environment"] == "loopback"
        a = server["attributes"]
        assert a["specgate.backend"] == "speculative" and a["http.response.status_code"] == 200
        children = {x["name"] for x in got if x["parent_span_id"] == server["span_id"]}
        assert children == {"upstream connect", "first byte"}
    # The batch processor's last spans go out when specgate stops: a delay longer than the test
    # would otherwise keep them.
    s2 = stack(OTEL_EXPORTER_OTLP_ENDPOINT=sink, OTEL_BSP_SCHEDULE_DELAY="600000")
    with httpx.Client(base_url=s2.url, timeout=30) as client:
        assert client.post("/v1/completions", json={"prompt": "p", "max_tokens": 2}).status_code == 200
    before = httpx.get(sink + "/count", timeout=5).json()["spans"]
    assert s2.proxy.stop() == 0
    wait_for(lambda: httpx.get(sink + "/count", timeout=5).json()["spans"] >= before + 3, timeout_s=10)
    last = [x for x in sink_spans(sink) if x["name"] == "POST /v1/completions"]
    assert len(last) == 1 and last[0]["resource"]["service.name"] == "specgate"


def test_the_overhead_benchmark_measures_specgate_traced_beside_untraced() -> None:
    said: list[str] = []
    scenarios = (Scenario("tiny", 2, False, 1, 200),)
    measured = run_overhead(reps=1, nginx=False, scenarios=scenarios, say=said.append, otel=True, peers_venv=None)
    assert {r.target for r in measured.results} == {"direct", "specgate", "specgate+otel"}
    for r in measured.results:
        assert r.samples[0].errors == 0 and r.samples[0].req_s > 0
    # Three spans a request (the request, its connect, its first byte), the warm-up's included.
    (count,) = [int(line.split()[3]) for line in said if "otlpsink received" in line]
    assert count >= 3 * 200
    assert "tracing on/off, tiny: req/s x" in format_results(measured)
