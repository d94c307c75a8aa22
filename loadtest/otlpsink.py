"""`python -m loadtest.otlpsink --port N`: a tiny OTLP/HTTP trace receiver on loopback, for the
tracing tests and for `loadtest overhead`'s traced specgate.

It takes `POST /v1/traces` (protobuf `ExportTraceServiceRequest`, plain or gzip, as the SDK's
OTLP/HTTP exporter sends it), counts the spans and keeps the first `--keep` of them, each reduced to
what a test asserts on. `GET /count` answers `{"spans": N, "exports": N}`; `GET /spans` the kept
spans; `--summary PATH` writes the counts and the spans per name when it stops (SIGTERM or SIGINT).
It needs the `otel` extra (opentelemetry-proto comes with the exporter).
"""

from __future__ import annotations

import argparse
import asyncio
import gzip
import json
import signal
import sys
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from aiohttp import web

try:
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
        ExportTraceServiceRequest,
        ExportTraceServiceResponse,
    )
    from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue
except ImportError:  # said by main(), so that importing this module never fails
    ExportTraceServiceRequest = ExportTraceServiceResponse = None  # type: ignore[assignment, misc]

# Span kinds by their OTLP number (opentelemetry/proto/trace/v1/trace.proto, SpanKind).
KINDS = {0: "unspecified", 1: "internal", 2: "server", 3: "client", 4: "producer", 5: "consumer"}
# Status codes by their OTLP number (Status.StatusCode).
STATUSES = {0: "unset", 1: "ok", 2: "error"}


def value(v: AnyValue) -> Any:
    """An OTLP attribute value as plain JSON."""
    kind = v.WhichOneof("value")
    if kind == "array_value":
        return [value(x) for x in v.array_value.values]
    if kind == "kvlist_value":
        return attributes(v.kvlist_value.values)
    if kind == "bytes_value":
        return v.bytes_value.hex()
    return getattr(v, kind) if kind else None


def attributes(kvs: Sequence[KeyValue]) -> dict[str, Any]:
    return {kv.key: value(kv.value) for kv in kvs}


class Sink:
    """What has arrived: every span counted, the first `keep` kept."""

    def __init__(self, keep: int) -> None:
        self.keep = keep
        self.spans = 0
        self.exports = 0
        self.names: Counter[str] = Counter()
        self.kept: list[dict[str, Any]] = []

    def take(self, request: ExportTraceServiceRequest) -> None:
        self.exports += 1
        for rs in request.resource_spans:
            resource: dict[str, Any] | None = None
            for ss in rs.scope_spans:
                for span in ss.spans:
                    self.spans += 1
                    self.names[span.name] += 1
                    if len(self.kept) >= self.keep:
                        continue
                    if resource is None:
                        resource = attributes(rs.resource.attributes)
                    self.kept.append(
                        {
                            "name": span.name,
                            "kind": KINDS.get(span.kind, str(span.kind)),
                            "trace_id": span.trace_id.hex(),
                            "span_id": span.span_id.hex(),
                            "parent_span_id": span.parent_span_id.hex(),
                            "start_ns": span.start_time_unix_nano,
                            "end_ns": span.end_time_unix_nano,
                            "attributes": attributes(span.attributes),
                            "events": [e.name for e in span.events],
                            "status": STATUSES.get(span.status.code, str(span.status.code)),
                            "status_message": span.status.message,
                            "resource": resource,
                            "scope": ss.scope.name,
                        }
                    )

    def summary(self) -> dict[str, Any]:
        return {"spans": self.spans, "exports": self.exports, "names": dict(self.names)}


def app(sink: Sink) -> web.Application:
    async def traces(request: web.Request) -> web.Response:
        body = await request.read()
        if request.headers.get("Content-Encoding", "").lower() == "gzip":
            body = gzip.decompress(body)
        message = ExportTraceServiceRequest()
        try:
            message.ParseFromString(body)
        except Exception as exc:  # protobuf's DecodeError: a client's bad body, answered as OTLP says
            return web.Response(status=400, text=f"not an ExportTraceServiceRequest: {exc}")
        sink.take(message)
        return web.Response(
            body=ExportTraceServiceResponse().SerializeToString(), content_type="application/x-protobuf"
        )

    async def count(request: web.Request) -> web.Response:
        return web.json_response({"spans": sink.spans, "exports": sink.exports})

    async def spans(request: web.Request) -> web.Response:
        return web.json_response({"spans": sink.kept})

    application = web.Application(client_max_size=64 * 1024 * 1024)
    application.router.add_post("/v1/traces", traces)
    application.router.add_get("/count", count)
    application.router.add_get("/spans", spans)
    return application


async def serve(host: str, port: int, sink: Sink) -> None:
    runner = web.AppRunner(app(sink), access_log=None)
    await runner.setup()
    await web.TCPSite(runner, host, port).start()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        await stop.wait()
    finally:
        await runner.cleanup()


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m loadtest.otlpsink", description=__doc__.split("\n\n")[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=4318)
    parser.add_argument("--keep", type=int, default=10_000, help="spans kept for GET /spans (default %(default)s)")
    parser.add_argument("--summary", type=Path, help="write the counts here as JSON when stopped")
    args = parser.parse_args(argv)
    if ExportTraceServiceRequest is None:
        print("loadtest.otlpsink needs the OTLP protobufs: pip install 'specgate[otel]'", file=sys.stderr)
        return 2
    sink = Sink(args.keep)
    asyncio.run(serve(args.host, args.port, sink))
    if args.summary is not None:
        args.summary.write_text(json.dumps(sink.summary(), indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
