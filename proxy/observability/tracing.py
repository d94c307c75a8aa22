"""Tracing: one OpenTelemetry span per proxied request, carrying the routing decision, with child
spans for each upstream attempt (its connect and send, then the wait for the first body byte).

Configured only by the standard `OTEL_*` variables and off unless an OTLP endpoint is set
(`OTEL_EXPORTER_OTLP_TRACES_ENDPOINT` or `OTEL_EXPORTER_OTLP_ENDPOINT`); `OTEL_SDK_DISABLED=true`
and `OTEL_TRACES_EXPORTER=none` turn it off again. The SDK reads the rest itself: the sampler
(`OTEL_TRACES_SAMPLER`, `_ARG`), the resource (`OTEL_SERVICE_NAME`, `OTEL_RESOURCE_ATTRIBUTES`),
the exporter's headers, timeout and compression, the batch processor's sizes.

No global state: the provider is the app's (its lifespan builds it and flushes it at exit), never
`trace.set_tracer_provider`, so tests build apps with providers of their own. The flush at exit
waits at most `OTEL_BSP_EXPORT_TIMEOUT` (milliseconds; FLUSH_TIMEOUT_S when unset), then gives up
with one warning and lets the process exit: the SDK's own shutdown waits up to 30 s for a collector
that does not answer, which after SPECGATE_SHUTDOWN_GRACE_S would pass a pod's grace period
(deploy/kubernetes/deployment.yaml). The SDK's worker and the thread that shuts it down are daemon
threads, so neither holds up the exit.

The SDK is an optional extra (`specgate[otel]`) and imported only when tracing is on. With an
endpoint set and the SDK missing, specgate says so once and serves untraced: telemetry must not be
what stops a gateway (OpenTelemetry's own rule for misconfiguration), and `OTEL_*` variables are
often set for every workload of a cluster at once.

The client's W3C `traceparent`/`tracestate` are continued; the server's request carries specgate's
own instead (its attempt span as the parent), never the client's. When tracing is off, both pass
through untouched and the hot path pays one `is None` test per step.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import os
import threading
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

from opentelemetry.trace import Span, SpanKind, Status, StatusCode, TracerProvider, set_span_in_context
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from ..config import redact_url
from ..transport.forwarding import traced

if TYPE_CHECKING:
    from opentelemetry.context import Context
    from opentelemetry.sdk.trace import TracerProvider as SdkTracerProvider

    from ..fleet.topology import Topology
    from ..policy.base import Decision

log = logging.getLogger("specgate.tracing")

# The signal's own endpoint first: the SDK's exporter prefers it too.
ENDPOINT_VARS = ("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_EXPORTER_OTLP_ENDPOINT")
PROTOCOL_VARS = ("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "OTEL_EXPORTER_OTLP_PROTOCOL")
# The one exporter shipped with the extra.
PROTOCOL = "http/protobuf"
SERVICE_NAME = "specgate"
# A model name is the client's to choose: kept short on the span.
_MODEL_CHARS = 256
# The bound on the last spans' export at shutdown, in milliseconds (the standard variable; the SDK
# stores it but its batch processor does not use it).
FLUSH_VAR = "OTEL_BSP_EXPORT_TIMEOUT"
# Its default here: the SDK's 30 s plus SPECGATE_SHUTDOWN_GRACE_S would pass a pod's grace period.
FLUSH_TIMEOUT_S = 5.0


def wanted(environ: Mapping[str, str]) -> str | None:
    """The OTLP endpoint when the environment turns tracing on, else None; says why it stays off
    where a variable asked for it and another contradicts it."""
    endpoint = next((v for name in ENDPOINT_VARS if (v := environ.get(name, "").strip())), None)
    if endpoint is None:
        return None
    if environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        log.info("tracing off: OTEL_SDK_DISABLED=true")
        return None
    exporters = {e.strip().lower() for e in environ.get("OTEL_TRACES_EXPORTER", "").split(",") if e.strip()}
    if "none" in exporters:
        log.info("tracing off: OTEL_TRACES_EXPORTER=none")
        return None
    if exporters - {"otlp"}:
        log.warning(
            "OTEL_TRACES_EXPORTER=%s: specgate exports traces over OTLP only%s",
            ",".join(sorted(exporters)),
            "" if "otlp" in exporters else "; tracing off",
        )
        if "otlp" not in exporters:
            return None
    protocol = next((v for name in PROTOCOL_VARS if (v := environ.get(name, "").strip())), PROTOCOL)
    if protocol != PROTOCOL:
        log.warning("OTLP protocol %s: specgate exports traces over %s only; tracing off", protocol, PROTOCOL)
        return None
    return endpoint


def flush_timeout_s(environ: Mapping[str, str]) -> float:
    """How long shutdown waits for the last spans to export: `OTEL_BSP_EXPORT_TIMEOUT` when set,
    else FLUSH_TIMEOUT_S (also when it is not a number of milliseconds >= 0: said once)."""
    raw = environ.get(FLUSH_VAR, "").strip()
    if not raw:
        return FLUSH_TIMEOUT_S
    try:
        millis = float(raw)
    except ValueError:
        millis = math.nan
    if not (0 <= millis < math.inf):
        log.warning("%s=%r is not a number of milliseconds >= 0: using %g s", FLUSH_VAR, raw[:40], FLUSH_TIMEOUT_S)
        return FLUSH_TIMEOUT_S
    return millis / 1000


@dataclass(frozen=True)
class Exporting:
    """What `provider_from_env` makes: the provider, where it exports, and how long its shutdown
    may wait for the last spans."""

    provider: SdkTracerProvider
    endpoint: str
    flush_s: float


def provider_from_env(environ: Mapping[str, str] = os.environ) -> Exporting | None:
    """A provider exporting over OTLP/HTTP in batches, as the environment says; None when tracing
    is off or the SDK is not installed (said once)."""
    endpoint = wanted(environ)
    if endpoint is None:
        return None
    try:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.resources import SERVICE_NAME as SERVICE_NAME_KEY
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider as SdkTracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
    except ImportError as exc:
        log.warning(
            "an OTLP endpoint is set (%s) but the OpenTelemetry SDK is not installed (%s): serving without "
            "traces; install it with pip install 'specgate[otel]'",
            redact_url(endpoint),
            exc.name,
        )
        return None
    resource = Resource.create({})
    if str(resource.attributes.get(SERVICE_NAME_KEY, "")).startswith("unknown_service"):
        # Neither OTEL_SERVICE_NAME nor OTEL_RESOURCE_ATTRIBUTES named it: the SDK's default says
        # only "python".
        resource = resource.merge(Resource({SERVICE_NAME_KEY: SERVICE_NAME}))
    flush_s = flush_timeout_s(environ)
    # shutdown_on_exit=False: the lifespan flushes it; an atexit hook would be process-wide state.
    provider = SdkTracerProvider(resource=resource, shutdown_on_exit=False)
    # The bound given to the processor too, where the SDK would read the variable again itself.
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(), export_timeout_millis=flush_s * 1000))
    log.info(
        "tracing on: OTLP/HTTP to %s as service %s", redact_url(endpoint), resource.attributes.get(SERVICE_NAME_KEY)
    )
    return Exporting(provider, endpoint, flush_s)


class Tracing:
    """The gateway's tracer over a provider: the lifespan's (`owned`, shut down at exit) or one a
    test hands in. Starts a `RequestTrace` per proxied request."""

    def __init__(
        self,
        provider: TracerProvider,
        topology: Topology,
        allowed_paths: Iterable[str] = (),
        *,
        owned: Exporting | None = None,
    ) -> None:
        self.provider = provider
        # The provider when the lifespan made it (and so shuts it down).
        self._owned = owned
        self.tracer = provider.get_tracer("specgate")
        self.propagator = TraceContextTextMapPropagator()
        # Span names take the route, not the path: a prefix on the allow-list (`/v1/*`) matches
        # any number of paths, and a span name must stay a small set.
        self._exact = frozenset(p for p in allowed_paths if not p.endswith("/*"))
        self._prefixes = tuple(p[:-1] for p in allowed_paths if p.endswith("/*"))
        # Each server's address and port, for the attempt spans; its URL's userinfo never.
        self.addresses: dict[str, dict[str, Any]] = {}
        for s in topology.servers:
            parts = urlsplit(s.url)
            port = parts.port or (443 if parts.scheme == "https" else 80)
            self.addresses[s.name] = {"server.address": parts.hostname or "", "server.port": port}

    @classmethod
    def of(
        cls, topology: Topology, allowed_paths: Iterable[str], provider: TracerProvider | None = None
    ) -> Tracing | None:
        """The tracing the app runs with: over `provider` when one is handed in, else as the
        environment says (None: off)."""
        if provider is not None:
            return cls(provider, topology, allowed_paths)
        made = provider_from_env()
        return None if made is None else cls(made.provider, topology, allowed_paths, owned=made)

    def route(self, path: str) -> str:
        if path in self._exact:
            return path
        return next((p + "*" for p in self._prefixes if path.startswith(p)), path)

    def request(self, method: str, path: str, headers: Mapping[bytes, bytes], request_id: str) -> RequestTrace:
        """The server span of a request just in, continuing the client's trace context if it sent one."""
        carrier: dict[str, str] = {}
        parent = headers.get(b"traceparent")
        if parent is not None:
            carrier["traceparent"] = parent.decode("latin-1")
            state = headers.get(b"tracestate")
            if state is not None:
                carrier["tracestate"] = state.decode("latin-1")
        context = self.propagator.extract(carrier) if carrier else None
        route = self.route(path)
        span = self.tracer.start_span(
            f"{method} {route}",
            context,
            SpanKind.SERVER,
            {
                "http.request.method": method,
                "url.path": path,
                "http.route": route,
                "specgate.request_id": request_id,
            },
        )
        return RequestTrace(self, span)

    async def aclose(self) -> None:
        """Flush and stop the provider the lifespan made, waiting at most its flush bound; past it,
        say so and return, so that the process can exit with spans still unsent."""
        owned = self._owned
        if owned is None:
            return
        loop = asyncio.get_running_loop()
        done: asyncio.Future[None] = loop.create_future()

        def settle() -> None:
            if not done.done():
                done.set_result(None)

        def shut_down() -> None:
            # The exporter's last batches are blocking HTTP requests: off the event loop.
            try:
                owned.provider.shutdown()
            except Exception:
                log.exception("tracing: the provider's shutdown failed")
            # Past the bound the loop may be closed already (RuntimeError): nobody waits any more.
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(settle)

        # A daemon thread, not asyncio.to_thread: the interpreter joins an executor's threads at
        # exit, so one still in the SDK's shutdown would hold the exit up for as long as it waits.
        threading.Thread(target=shut_down, name="specgate-trace-flush", daemon=True).start()
        await asyncio.wait((done,), timeout=owned.flush_s)
        if not done.done():
            log.warning(
                "tracing: the last spans did not reach %s within %g s (%s): exiting without waiting "
                "further, spans may be lost",
                redact_url(owned.endpoint),
                owned.flush_s,
                FLUSH_VAR,
            )


class RequestTrace:
    """One proxied request's spans. The relay tells it what happens; `end` runs once, on every path
    (the relay's `finish`, or ingress when it answers itself)."""

    __slots__ = ("_attempt", "_child", "_context", "_error", "_errored", "_recording", "_span", "_tracing")

    def __init__(self, tracing: Tracing, span: Span) -> None:
        self._tracing = tracing
        self._span = span
        # The request span as its children's parent.
        self._context = set_span_in_context(span)
        # False: the sampler left this request out. Then it gets no children (measured: unsampled
        # requests cost most of what sampled ones did before), only the trace context upstream.
        self._recording = span.is_recording()
        # The open child span (an attempt's connect, or its wait for the first byte), if any.
        self._child: Span | None = None
        self._attempt = 0
        # How the request failed, if it did (error.type): an upstream error's kind, or a status.
        self._error: str | None = None
        # The span's status is ERROR already, with its description.
        self._errored = False

    def model(self, name: object) -> None:
        if isinstance(name, str):
            self._span.set_attribute("gen_ai.request.model", name[:_MODEL_CHARS])

    def decided(
        self,
        decision: Decision,
        group: str,
        continues: bool = False,
        held: str | None = None,
        cache_affinity: str | None = None,
    ) -> None:
        """The routing decision: where it went, why, in which mode, at what load (as the policy read
        it). `continues`: the request continues a stored response, held on server `held` if known.
        `cache_affinity`: how its conversation's turn went (affinity.Outcome), if it has a key."""
        backend = decision.backend
        attrs: dict[str, Any] = {
            # str(): a Role is a StrEnum, and the exporter wants plain strings.
            "specgate.backend": str(backend) if backend is not None else "none",
            "specgate.reason": decision.reason,
            "specgate.mode": str(decision.state.mode),
            "specgate.load": decision.load,
            "specgate.group": group,
        }
        # Flags only when set, as specgate.failover: every attribute costs its encoding, per request.
        if decision.reason == "probe":
            attrs["specgate.probe"] = True
        if decision.shadow:
            attrs["specgate.shadow"] = True
        if continues:
            # Affinity: sent to the server that stores the response, or not, because no server is
            # known to (another replica's, or forgotten) or because that server is down.
            pinned = decision.reason == "stored_response"
            attrs["specgate.affinity"] = "held" if pinned else "unknown" if held is None else "down"
        if cache_affinity is not None:
            attrs["specgate.cache_affinity"] = cache_affinity
        self._span.set_attributes(attrs)

    def attempt(self, headers: bytes, server: str, backend: str) -> bytes:
        """An upstream attempt begins: its span, and the request's head lines naming it as the
        server's parent. A second attempt is a failover."""
        if not self._recording:
            return self._traced(headers, self._context)
        t = self._tracing
        attrs: dict[str, Any] = {
            "http.request.method": "POST",
            "specgate.server": server,
            "specgate.backend": str(backend),
            "specgate.attempt": self._attempt,
            **t.addresses.get(server, {}),
        }
        if self._attempt:
            self._span.set_attributes(
                {
                    "specgate.failover": True,
                    "specgate.reason": "failover",
                    "specgate.backend": str(backend),
                    "specgate.server": server,
                }
            )
        else:
            self._span.set_attribute("specgate.server", server)
        self._attempt += 1
        child = t.tracer.start_span("upstream connect", self._context, SpanKind.CLIENT, attrs)
        self._child = child
        return self._traced(headers, set_span_in_context(child))

    def _traced(self, headers: bytes, context: Context) -> bytes:
        carrier: dict[str, str] = {}
        self._tracing.propagator.inject(carrier, context)
        return traced(headers, carrier["traceparent"], carrier.get("tracestate"))

    def answered(self, status: int) -> None:
        """The server's response head arrived: the connect span ends, the wait for the first byte begins."""
        t = self._tracing
        child = self._child
        if child is None:
            return
        child.set_attribute("http.response.status_code", status)
        if status >= 400:
            child.set_status(Status(StatusCode.ERROR))
            child.set_attribute("error.type", str(status))
        child.end()
        self._child = t.tracer.start_span(
            "first byte", self._context, SpanKind.CLIENT, {"specgate.attempt": self._attempt - 1}
        )

    def first_byte(self) -> None:
        if self._child is not None:
            self._child.end()
            self._child = None

    def failed(self, kind: str, message: str) -> None:
        """The attempt failed before the first byte (`kind`: how, upstream.UpstreamError's)."""
        self._error = kind
        child, self._child = self._child, None
        if child is not None:
            child.set_attribute("error.type", kind)
            child.set_status(Status(StatusCode.ERROR, message))
            child.end()

    def broke(self, kind: str, message: str) -> None:
        """The server's stream broke after its first byte."""
        self._error = kind
        self._span.add_event("upstream stream broke")
        self._span.set_attribute("error.type", kind)
        self._span.set_status(Status(StatusCode.ERROR, message))
        self._errored = True

    def shadow(self, headers: bytes, server: str) -> tuple[bytes, Span]:
        """A shadow probe's span (a child of this request's) and its head lines naming it."""
        if not self._recording:
            return self._traced(headers, self._context), self._span  # ending it is a no-op
        t = self._tracing
        attrs = {"specgate.server": server, "specgate.backend": "speculative", **t.addresses.get(server, {})}
        span = t.tracer.start_span("shadow probe", self._context, SpanKind.CLIENT, attrs)
        return self._traced(headers, set_span_in_context(span)), span

    def shadow_end(self, span: Span, outcome: str, status: int | None) -> None:
        span.set_attribute("specgate.outcome", outcome)
        if status is not None:
            span.set_attribute("http.response.status_code", status)
        if outcome == "error":
            span.set_status(Status(StatusCode.ERROR))
        span.end()

    def end(self, status: int, *, gone: bool = False, code: str | None = None) -> None:
        """The request is over: `status` as counted (499: the client left first); `code`: the error
        code of an answer specgate made itself."""
        span = self._span
        child, self._child = self._child, None
        if child is not None:  # the client left during an attempt
            child.end()
        attrs: dict[str, Any] = {"http.response.status_code": status}
        if code is not None:
            attrs["specgate.error_code"] = code
        if gone:
            span.add_event("client disconnected")
        # A server span fails on 5xx only (HTTP semantic conventions): a 4xx is the client's.
        if status >= 500 and not self._errored:
            error = self._error or str(status)
            attrs["error.type"] = error
            span.set_status(Status(StatusCode.ERROR, error))
        span.set_attributes(attrs)
        span.end()
