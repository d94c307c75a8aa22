"""The app factory. Its lifespan creates and closes every resource; handlers reach them through
`request.app.state.gate`. Nothing is created at import time, so tests can build many apps."""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import orjson
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect
from starlette.responses import Response

from .config import Settings
from .errors import ApiError
from .health import HealthMonitor
from .metrics import Endpoint, Metrics, code_class
from .policy import BACKENDS, PolicyConfig
from .relay import ProxyCall, RelayResponse
from .routing import Router
from .upstream import Upstream

log = logging.getLogger("specgate")

_JSON_TYPES = ("application/json",)


@dataclass
class Gate:
    settings: Settings
    metrics: Metrics
    upstream: Upstream
    health: HealthMonitor
    router: Router


def _json(obj: Any, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    return Response(orjson.dumps(obj), status_code=status, media_type="application/json", headers=headers)


def create_app(settings: Settings | None = None) -> FastAPI:
    settings = settings if settings is not None else Settings()

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        metrics = Metrics()
        upstream = Upstream(settings)
        await upstream.start()
        health = HealthMonitor(settings, upstream, metrics)
        cfg = PolicyConfig(
            settings.policy,
            settings.high_watermark,
            settings.low_watermark,
            settings.spillover_limit,
            settings.load_signal,
        )
        router = Router(cfg, health, metrics)
        health.on_change = router.refresh
        app.state.gate = Gate(settings, metrics, upstream, health, router)
        await health.poll_once()  # so /ready and routing are right from the first request
        poller = asyncio.get_running_loop().create_task(health.run(), name="specgate-health")
        log.info(
            "specgate ready: speculative=%s baseline=%s policy=%s signal=%s",
            settings.speculative_url,
            settings.baseline_url,
            settings.policy,
            settings.load_signal,
        )
        try:
            yield
        finally:
            poller.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await poller
            await upstream.aclose()

    app = FastAPI(title="specgate", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)

    @app.exception_handler(ApiError)
    async def api_error(request: Request, exc: ApiError) -> Response:
        gate: Gate = request.app.state.gate
        gate.metrics.requests.labels("none", _endpoint(request.url.path), code_class(exc.status)).inc()
        headers = {"x-request-id": _request_id(request)}
        if exc.status == 401:
            headers["www-authenticate"] = "Bearer"
        return Response(exc.body(), status_code=exc.status, media_type="application/json", headers=headers)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> Response:
        err = ApiError(
            exc.status_code,
            f"{request.method} {request.url.path}: {exc.detail}",
            "invalid_request_error",
            "not_found" if exc.status_code == 404 else None,
        )
        return Response(
            err.body(),
            status_code=exc.status_code,
            media_type="application/json",
            headers=getattr(exc, "headers", None),
        )

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError) -> Response:
        err = ApiError(400, "Invalid request.", "invalid_request_error")
        return Response(err.body(), status_code=400, media_type="application/json")

    @app.get("/health")
    async def health() -> Response:
        return _json({"status": "ok"})

    @app.get("/ready")
    async def ready(request: Request) -> Response:
        gate: Gate = request.app.state.gate
        up = [b for b in BACKENDS if gate.health.healthy(b)]
        return _json({"ready": bool(up), "healthy_backends": up}, 200 if up else 503)

    @app.get("/routing")
    async def routing(request: Request) -> Response:
        gate: Gate = request.app.state.gate
        r, s = gate.router, gate.settings
        backends = {}
        for b in BACKENDS:
            h = gate.health.backends[b]
            backends[b] = {
                "url": _redact(gate.upstream.url(b)),
                "healthy": h.healthy,
                "inflight": r.tracker.count(b),
                "engine_load": h.engine_load,
                "spec_accept_length": h.spec_accept_length,
                "last_error": h.last_error,
            }
        return _json(
            {
                "policy": s.policy,
                "mode": r.state.mode,
                "load_signal": s.load_signal,
                "load": r.load,
                "inflight": r.tracker.total,
                "watermarks": {"high": s.high_watermark, "low": s.low_watermark},
                "spillover_limit": s.spillover_limit,
                "backends": backends,
            }
        )

    @app.get("/metrics")
    async def metrics(request: Request) -> Response:
        gate: Gate = request.app.state.gate
        return Response(generate_latest(gate.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        gate: Gate = request.app.state.gate
        _authorize(gate.settings, request)
        healthy = [b for b in BACKENDS if gate.health.healthy(b)]
        if not healthy:
            raise ApiError(
                503, "No healthy backend: both SGLang servers are down.", "server_error", "no_healthy_backend"
            )
        probes = await asyncio.gather(
            *(gate.upstream.get(b, "/v1/models", gate.settings.health_timeout_s) for b in healthy)
        )
        seen: dict[str, Any] = {}
        for probe in probes:
            if probe.status != 200:
                continue
            with contextlib.suppress(orjson.JSONDecodeError, AttributeError, TypeError):
                for card in orjson.loads(probe.body).get("data", []):
                    if isinstance(card, dict) and isinstance(card.get("id"), str):
                        seen.setdefault(card["id"], card)
        if not seen:
            raise ApiError(502, "No backend listed its models.", "server_error", "upstream_unavailable")
        return _json({"object": "list", "data": list(seen.values())}, headers={"x-request-id": _request_id(request)})

    async def proxy(request: Request) -> Response:
        gate: Gate = request.app.state.gate
        started = asyncio.get_running_loop().time()
        _authorize(gate.settings, request)
        request_id = _request_id(request)
        body = await _read_body(request, gate.settings)
        ctype = request.headers.get("content-type", "")
        if ctype and ctype.split(";", 1)[0].strip().lower() not in _JSON_TYPES:
            raise ApiError(
                415, f"Content-Type must be application/json, got {ctype[:100]!r}.", code="unsupported_media_type"
            )
        try:
            payload = orjson.loads(body)
        except orjson.JSONDecodeError as exc:
            raise ApiError(400, f"The body is not valid JSON: {exc.msg}.", code="invalid_json") from None
        if not isinstance(payload, dict):
            raise ApiError(400, "The body must be a JSON object.", code="invalid_json")
        stream = payload.get("stream", False)
        if not isinstance(stream, bool) and stream is not None:
            raise ApiError(400, "'stream' must be a boolean.", param="stream", code="invalid_type")
        endpoint = _endpoint(request.url.path)
        strip_usage = False
        if stream and endpoint in ("chat", "completions"):
            body, strip_usage = _ask_for_usage(payload, body)
        path = request.url.path + (f"?{request.url.query}" if request.url.query else "")
        headers = gate.upstream.request_headers(request.headers.raw, request_id)
        call = ProxyCall(path, endpoint, body, headers, request_id, bool(stream), strip_usage, started)
        return RelayResponse(gate, call)

    for path in ("/v1/chat/completions", "/v1/completions", "/generate", "/v1/{rest:path}"):
        app.add_api_route(path, proxy, methods=["POST"], include_in_schema=False)
    return app


def _ask_for_usage(payload: dict[str, Any], body: bytes) -> tuple[bytes, bool]:
    """Make the server send a usage chunk; return the body to send and whether to drop the chunk."""
    options = payload.get("stream_options")
    if options is not None and not isinstance(options, dict):
        raise ApiError(400, "'stream_options' must be an object.", param="stream_options", code="invalid_type")
    if options and options.get("include_usage") is True:
        return body, False
    payload["stream_options"] = {**(options or {}), "include_usage": True}
    return orjson.dumps(payload), True


def _endpoint(path: str) -> Endpoint:
    if path == "/v1/chat/completions":
        return "chat"
    if path == "/v1/completions":
        return "completions"
    if path == "/generate":
        return "generate"
    return "other"


def _request_id(request: Request) -> str:
    rid = request.headers.get("x-request-id", "")
    # Only a sane id is echoed: it lands in headers and logs.
    if 0 < len(rid) <= 128 and rid.isascii() and rid.isprintable():
        return rid
    return uuid.uuid4().hex


def _authorize(settings: Settings, request: Request) -> None:
    if not settings.api_keys:
        return
    given = request.headers.get("authorization", "")
    scheme, _, token = given.partition(" ")
    token_bytes = token.strip().encode()
    ok = False
    for key in settings.api_keys:
        # Compare against every key, without early exit, in constant time per key.
        ok |= hmac.compare_digest(token_bytes, key.encode())
    if not (ok and scheme.lower() == "bearer"):
        raise ApiError(401, "Invalid or missing API key: send 'Authorization: Bearer <key>'.", code="invalid_api_key")


async def _read_body(request: Request, settings: Settings) -> bytes:
    limit = settings.max_body_bytes
    declared = request.headers.get("content-length")
    too_big = ApiError(413, f"The body is larger than {limit} bytes.", code="request_too_large")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise too_big
    parts: list[bytes] = []
    size = 0
    try:
        async with asyncio.timeout(settings.read_timeout_s):
            async for chunk in request.stream():
                size += len(chunk)
                if size > limit:
                    raise too_big
                parts.append(chunk)
    except TimeoutError:
        raise ApiError(408, "The request body did not arrive in time.", code="request_timeout") from None
    except ClientDisconnect:
        raise ApiError(400, "The client disconnected while sending the body.", code="client_disconnected") from None
    return b"".join(parts)


def _redact(url: str) -> str:
    scheme, _, rest = url.partition("://")
    return f"{scheme}://{rest.rsplit('@', 1)[-1]}"
