"""Reading one server, for the doctor: /health, /metrics before and after a probe, /v1/models, the
engine's own description (SGLang's /server_info, llama-server's /props) and one short streamed
request. Only I/O: what the readings mean is judge.py's; which endpoints and fields exist,
engines.py's.

The probe asks for PROBE_TOKENS tokens of a count, which every draft accepts well, so that a
speculating server shows it; its text is read only for its token and event counts, never shown.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import aiohttp
import orjson

from ..config import redact_url
from ..fleet import promtext
from ..fleet.engines import (
    MODELS_PATH,
    PROPS_PATH,
    SERVER_INFO_PATHS,
    describe_health,
    detect,
    reported_steps,
    server_facts,
)
from ..fleet.topology import ServerSpec
from ..relay import sseframe
from ..transport.pool import url_credentials
from .judge import Observation, Probe

PROBE_TOKENS = 48
PROBE_PROMPT = "Count from 1 to 60 in digits, separated by commas, and nothing else."
# Bytes read of a JSON description or a /metrics page at most: a real one is well under.
MAX_BODY = 8 * 1024 * 1024


class Unreachable(Exception):
    pass


@dataclass(frozen=True)
class _Client:
    """The session, and the authorization one server's requests carry."""

    session: aiohttp.ClientSession
    headers: dict[str, str]


async def observe_all(servers: tuple[ServerSpec, ...], api_key: str | None, timeout_s: float) -> list[Observation]:
    """Every server read at once."""
    timeout = aiohttp.ClientTimeout(total=timeout_s)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        return list(await asyncio.gather(*(observe(session, s, api_key) for s in servers)))


def auth_header(url: str, api_key: str | None) -> dict[str, str]:
    """As the gateway sends it (transport/pool.py): the API key, else the URL's user and password."""
    if api_key:
        return {"Authorization": f"Bearer {api_key}"}
    basic = url_credentials(url)
    return {} if basic is None else {"Authorization": basic.decode("latin-1")}


async def observe(session: aiohttp.ClientSession, server: ServerSpec, api_key: str | None = None) -> Observation:
    """One server's observation; a server that cannot be reached is one with its `error` set."""
    url = redact_url(server.url)
    base = Observation(server.name, server.role, url)
    try:
        return await _observe(_Client(session, auth_header(server.url, api_key)), url, base)
    except Unreachable as exc:
        return Observation(base.name, base.role, base.url, error=str(exc))


async def _observe(session: _Client, url: str, base: Observation) -> Observation:
    status, body = await _get(session, url + "/health")
    health = None if status == 200 else describe_health(status, body)
    before, metrics_problem = await _metrics(session, url)
    status, body = await _get(session, url + MODELS_PATH)
    auth_refused = status == 401
    models = _json(body) if status == 200 else None
    info = None
    for path in SERVER_INFO_PATHS:
        status, body = await _get(session, url + path)
        if status == 200:
            info = _json(body)
            break
    props = None
    if info is None:
        status, body = await _get(session, url + PROPS_PATH)
        props = _json(body) if status == 200 else None
    facts = server_facts(models, info, props)
    probe = await _probe(session, url, facts.models[0]) if facts.models and health is None else None
    after = (await _metrics(session, url))[0] if before is not None else None
    return Observation(
        base.name,
        base.role,
        base.url,
        health=health,
        auth_refused=auth_refused,
        facts=facts,
        metrics_problem=metrics_problem,
        metrics_before=before,
        metrics_after=after,
        probe=probe,
    )


async def _get(session: _Client, url: str) -> tuple[int, bytes]:
    try:
        async with session.session.get(url, headers=session.headers) as resp:
            return resp.status, await _body(resp)
    except (aiohttp.ClientError, TimeoutError, OSError) as exc:
        raise Unreachable(_why(exc)) from None


async def _body(resp: aiohttp.ClientResponse) -> bytes:
    """The whole body, up to MAX_BODY bytes (`content.read(n)` returns what has arrived so far)."""
    out = bytearray()
    async for chunk in resp.content.iter_chunked(64 * 1024):
        out += chunk
        if len(out) >= MAX_BODY:
            break
    return bytes(out[:MAX_BODY])


def _why(exc: BaseException) -> str:
    if isinstance(exc, TimeoutError):
        return "no answer in time"
    if isinstance(exc, aiohttp.ClientConnectorError):
        return f"cannot connect: {exc.os_error.strerror or exc.os_error}"
    return str(exc) or type(exc).__name__


def _json(body: bytes) -> Any:
    try:
        return orjson.loads(body)
    except orjson.JSONDecodeError:
        return None


async def _metrics(session: _Client, url: str) -> tuple[Mapping[str, float] | None, str | None]:
    """Its /metrics' values summed by name, or None and why not."""
    status, body = await _get(session, url + "/metrics")
    if status == 404:
        return None, "no /metrics (404)"
    if status != 200:
        return None, f"/metrics answered {status}"
    try:
        values = promtext.totals(body.decode(errors="replace"))
    except ValueError:
        return None, "/metrics is not Prometheus text"
    if detect(values) is None:
        return None, "/metrics has no SGLang, vLLM or llama.cpp metrics"
    return values, None


async def _probe(session: _Client, url: str, model: str) -> Probe:
    """One short streamed chat request: its tokens, its content events, what it said of itself."""
    body = {
        "model": model,
        "messages": [{"role": "user", "content": PROBE_PROMPT}],
        "max_tokens": PROBE_TOKENS,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    try:
        async with session.session.post(url + "/v1/chat/completions", json=body, headers=session.headers) as resp:
            if resp.status != 200:
                text = (await resp.content.read(2048)).decode(errors="replace")
                return Probe(error=f"HTTP {resp.status}" + (f": {_message(text)}" if _message(text) else ""))
            data = await _body(resp)
    except (aiohttp.ClientError, TimeoutError, OSError) as exc:
        return Probe(error=_why(exc))
    return _read_stream(data)


def _message(text: str) -> str:
    obj = _json(text.encode())
    if isinstance(obj, dict):
        err = obj.get("error", obj)
        found = err.get("message") if isinstance(err, dict) else err
        if isinstance(found, str):
            return found[:160]
    return ""


def _read_stream(data: bytes) -> Probe:
    tokens, events, reported = None, 0, None
    for event in sseframe.split_events(data):
        payload = sseframe.data_of(event)
        obj = _json(payload) if payload and payload != b"[DONE]" else None
        if not isinstance(obj, dict):
            continue
        if isinstance(obj.get("error"), dict):
            return Probe(error=f"error in stream: {_message(payload.decode(errors='replace') if payload else '')}")
        choices = obj.get("choices")
        if isinstance(choices, list) and choices and isinstance(choices[0], dict):
            delta = choices[0].get("delta")
            if isinstance(delta, dict) and delta.get("content"):
                events += 1
        usage = obj.get("usage")
        if isinstance(usage, dict) and isinstance(usage.get("completion_tokens"), int):
            tokens = usage["completion_tokens"]
        reported = reported_steps(obj) or reported
    return Probe(tokens, events, reported)
