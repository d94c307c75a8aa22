"""The hot path in: a client's POST to an allowed path (proxy/edge/paths.py), checked and handed to the relay.

Plain ASGI, not a FastAPI route: on every proxied request it saves FastAPI's routing, Request
objects and middleware stack (measured: a large share of the hop's added latency at one stream).
Everything it rejects gets OpenAI's error shape; nothing here can leave an in-flight count behind,
because the lease is taken later, inside the relay.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import orjson
from starlette.types import Receive, Scope, Send

from ..config import Settings
from ..errors import ApiError
from ..fleet.engines import GENERATE_PATH
from ..gate import Gate
from ..kinds import CLASSED, Endpoint
from ..observability.metrics import code_class
from ..observability.tracing import RequestTrace
from ..policy.base import LEARNING
from ..relay.relay import RelayResponse
from ..routing import switch
from ..routing.affinity import conversation_key
from ..routing.classes import class_of
from ..routing.tokens import prompt_estimate
from .access import authorize, client_key, request_id_of
from .call import ProxyCall

_EXACT: dict[str, Endpoint] = {
    "/v1/chat/completions": "chat",
    "/v1/completions": "completions",
    "/v1/responses": "responses",
    GENERATE_PATH: "generate",
}
_JSON_TYPES = (b"application/json",)
# The request headers specgate decides by: each must come once (a repeated one is refused, 400).
OWN_HEADERS = frozenset({b"x-specgate-priority", b"x-specgate-class", b"x-session-id", switch.HEADER})
_TRACE_CONTEXT = (b"traceparent", b"tracestate")


class _ClientGone(Exception):
    pass


def endpoint_of(path: str) -> Endpoint:
    return _EXACT.get(path, "other")


async def handle(gate: Gate, scope: Scope, receive: Receive, send: Send) -> None:
    started = asyncio.get_running_loop().time()
    headers: dict[bytes, bytes] = {}
    repeated: set[bytes] | None = None
    for k, v in scope["headers"]:
        k = k.lower()
        if k in headers:
            repeated = {k} if repeated is None else repeated | {k}
        else:
            headers[k] = v
    if repeated is not None and b"traceparent" in repeated:
        # Two trace contexts are none (W3C Trace Context): neither is continued nor forwarded.
        del headers[b"traceparent"]
        headers.pop(b"tracestate", None)
    request_id = request_id_of(headers.get(b"x-request-id"))
    path: str = scope["path"]
    endpoint = endpoint_of(path)
    trace = None if gate.tracing is None else gate.tracing.request(scope["method"], path, headers, request_id)
    try:
        call = await _accept(gate, scope, receive, headers, request_id, endpoint, started, trace, repeated)
    except ApiError as err:
        if trace is not None:
            trace.end(err.status, code=err.code)
        await send_error(gate, send, err, endpoint, request_id)
        return
    except _ClientGone:
        if trace is not None:
            trace.end(499, gone=True)
        gate.metrics.requests.labels("none", endpoint, "4xx").inc()
        return
    await RelayResponse(gate, call)(scope, receive, send)


async def _accept(
    gate: Gate,
    scope: Scope,
    receive: Receive,
    headers: dict[bytes, bytes],
    request_id: str,
    endpoint: Endpoint,
    started: float,
    trace: RequestTrace | None = None,
    repeated: set[bytes] | None = None,
) -> ProxyCall:
    settings = gate.settings
    authorize(settings, headers.get(b"authorization", b""))
    if repeated is not None and (twice := repeated & OWN_HEADERS):
        # specgate would read one copy and the server perhaps the other.
        shown = ", ".join(sorted(h.decode("latin-1") for h in twice))
        raise ApiError(400, f"Send each of specgate's headers once; repeated: {shown}.", code="repeated_header")
    by_header = switch.from_header(headers.get(switch.HEADER))
    body = await read_body(receive, headers.get(b"content-length"), settings)
    payload = _json_object(body, headers)
    body, by_body = _switch_in_body(payload, body)
    if trace is not None:
        trace.model(payload.get("model"))
    # Fields specgate need not understand go on as sent, for the server to judge: a `stream` that is
    # not a boolean is the server's to accept or refuse, and specgate then asks for no usage.
    stream = payload.get("stream") is True
    strip_usage = False
    if stream and endpoint in ("chat", "completions"):
        body, strip_usage = ask_for_usage(payload, body)
    query: bytes = scope.get("query_string", b"")
    # The path as the client sent it (still percent-encoded): the decoded one may hold spaces.
    raw_path: bytes = scope.get("raw_path") or scope["path"].encode("utf-8")
    target = raw_path + b"?" + query if query else raw_path
    client = scope.get("client")
    sent = scope["headers"]
    if repeated is not None and b"traceparent" in repeated:
        sent = [(k, v) for k, v in sent if k.lower() not in _TRACE_CONTEXT]
    peer = client[0] if client else None
    up_headers = gate.upstream.request_headers(sent, request_id, peer, scope["scheme"])
    # Who sent it: the key its acceptance evidence is pooled under (only the adaptive policies pool
    # it: no hash on every request otherwise), and its prompt ratio's. The ratio's votes count
    # clients, so a bearer token counts only where specgate checked it: else one client could be
    # as many as the tokens it makes up.
    keyed = settings.api_keys or settings.policy in LEARNING
    client_id = client_key(headers.get(b"authorization", b""), peer) if keyed else ""
    ratio_client = client_id if settings.api_keys else client_key(b"", peer)
    previous: str | None = None
    stores = False
    if endpoint == "responses":
        # No `stream_options` here: a streamed response's usage comes in its `response.completed` event.
        after = payload.get("previous_response_id")
        previous = after if isinstance(after, str) else None
        stores = payload.get("store") is not False
    estimate = prompt_estimate(payload, endpoint)
    traffic_class = _class(settings, headers, payload, endpoint)
    asked, source = switch.asked(by_header, by_body, traffic_class, settings.class_switches)
    return ProxyCall(
        target,
        endpoint,
        body,
        up_headers,
        request_id,
        stream,
        strip_usage,
        started,
        client_id,
        previous,
        stores,
        trace,
        prompt_estimate=estimate,
        prompt_tokens=gate.token_ratio.scaled(estimate, ratio_client),
        ratio_client=ratio_client,
        batch=_batch(headers.get(b"x-specgate-priority")),
        affinity=(
            conversation_key(headers.get(b"x-session-id"), payload, endpoint) if settings.affinity_entries else None
        ),
        traffic_class=traffic_class,
        speculation=asked,
        speculation_source=source,
    )


def _switch_in_body(payload: dict[str, Any], body: bytes) -> tuple[bytes, tuple[bool, switch.Switch | None]]:
    """(the body to send on, (whether it held the speculation switch, what it asked)): the switch
    is specgate's to answer, never a server's (no engine reads it), so it is removed from both."""
    if switch.FIELD not in payload:
        return body, (False, None)
    asked = switch.from_body(payload.pop(switch.FIELD))
    return without_field(body, switch.FIELD), (True, asked)


def _class(settings: Settings, headers: dict[bytes, bytes], payload: dict[str, Any], endpoint: Endpoint) -> str | None:
    if endpoint not in CLASSED:
        return None
    return class_of(settings.class_key, headers.get(b"x-specgate-class"), payload, headers.get(b"authorization", b""))


def _json_object(body: bytes, headers: dict[bytes, bytes]) -> dict[str, Any]:
    """The request body as a JSON object, or the error that says why it is not one."""
    ctype = headers.get(b"content-type", b"")
    if ctype and ctype.split(b";", 1)[0].strip().lower() not in _JSON_TYPES:
        shown = ctype[:100].decode("latin-1")
        raise ApiError(415, f"Content-Type must be application/json, got {shown!r}.", code="unsupported_media_type")
    encoding = headers.get(b"content-encoding", b"").strip().lower()
    if encoding and encoding != b"identity":
        # specgate reads the body (JSON) and the server would decode it again: an encoded body
        # fails here, and a plain one labelled encoded fails there. Neither is forwarded.
        shown = encoding[:50].decode("latin-1")
        raise ApiError(
            415, f"Request bodies must not be encoded (Content-Encoding: {shown!r}).", code="unsupported_media_type"
        )
    try:
        payload = orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        raise ApiError(400, f"The body is not valid JSON: {exc.msg}.", code="invalid_json") from None
    if not isinstance(payload, dict):
        raise ApiError(400, "The body must be a JSON object.", code="invalid_json")
    return payload


def _batch(priority: bytes | None) -> bool:
    """Whether `x-specgate-priority` says batch (absent: interactive)."""
    if priority is None:
        return False
    value = priority.strip().lower()
    if value in (b"batch", b"interactive"):
        return value == b"batch"
    shown = priority[:50].decode("latin-1")
    raise ApiError(400, f"x-specgate-priority must be interactive or batch, got {shown!r}.", code="invalid_priority")


def ask_for_usage(payload: dict[str, Any], body: bytes) -> tuple[bytes, bool]:
    """Make the server send a usage chunk; return the body to send and whether to drop the chunk.
    `stream_options` that are not an object, or whose `include_usage` is not a boolean, are the
    server's to judge: sent unchanged, and no usage is counted for that request.

    The body is never re-encoded from `payload`: orjson reads integers past 64 bits as floats and
    refuses to write nesting past 255 levels, so a re-encoded body could lose a client's `seed` or
    fail. Without `stream_options` (the usual case) the field is spliced in after the opening brace;
    with options to change, the body is re-encoded by the standard library, which keeps integers of
    any size (and floats to the bit), or, where even that cannot, sent unchanged without usage."""
    options = payload.get("stream_options")
    if options is not None and not isinstance(options, dict):
        return body, False
    include = (options or {}).get("include_usage")
    if include is not None and include is not False:
        return body, False
    if "stream_options" not in payload:
        at = body.index(b"{") + 1  # a JSON object: its first brace opens it
        return body[:at] + _INCLUDE_USAGE + (b"," if payload else b"") + body[at:], True
    try:
        exact = json.loads(body)
        # `null` options are no options (as OpenAI's SDK and the engines read them).
        exact["stream_options"] = {**(exact["stream_options"] or {}), "include_usage": True}
        return json.dumps(exact, separators=(",", ":"), ensure_ascii=False).encode(), True
    except (ValueError, RecursionError):
        return body, False


_INCLUDE_USAGE = b'"stream_options":{"include_usage":true}'


def without_field(body: bytes, name: str) -> bytes:
    """The body without its top-level field `name`, re-encoded by the standard library (which keeps
    integers of any size and floats to the bit, as ask_for_usage says); ApiError 400 where even
    that cannot (nesting past its recursion limit), since the field must not go on."""
    try:
        exact = json.loads(body)
        exact.pop(name, None)
        return json.dumps(exact, separators=(",", ":"), ensure_ascii=False).encode()
    except (ValueError, RecursionError):
        raise ApiError(
            400, f"The body is nested too deeply to remove its {name!r} field.", param=name, code="invalid_json"
        ) from None


async def read_body(receive: Receive, declared: bytes | None, settings: Settings) -> bytes:
    limit = settings.max_body_bytes
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise _too_big(limit)
    parts: list[bytes] = []
    size = 0
    try:
        async with asyncio.timeout(settings.read_timeout_s):
            while True:
                message = await receive()
                if message["type"] == "http.disconnect":
                    raise _ClientGone
                chunk = message.get("body", b"")
                size += len(chunk)
                if size > limit:
                    raise _too_big(limit)
                parts.append(chunk)
                if not message.get("more_body", False):
                    break
    except TimeoutError:
        raise ApiError(408, "The request body did not arrive in time.", code="request_timeout") from None
    return parts[0] if len(parts) == 1 else b"".join(parts)


def _too_big(limit: int) -> ApiError:
    return ApiError(413, f"The body is larger than {limit} bytes.", code="request_too_large")


async def send_error(gate: Gate, send: Send, err: ApiError, endpoint: Endpoint, request_id: str) -> None:
    gate.metrics.requests.labels("none", endpoint, code_class(err.status)).inc()
    body = err.body()
    headers = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(body)).encode()),
        (b"x-request-id", request_id.encode("latin-1")),
    ]
    headers.extend(err.headers)
    await send({"type": "http.response.start", "status": err.status, "headers": headers})
    await send({"type": "http.response.body", "body": body, "more_body": False})
