"""One streaming request against an OpenAI-compatible server, timed as SGLang's bench_serving does.

TTFT is the time to the first chunk with text; ITL the gaps between chunks with text; output
tokens come from `usage` (the request asks for it), falling back to the count of text chunks.

A failure is the server's when the server answered: an HTTP error status, an error event in the
stream, a body cut short or never ending in [DONE], a read timeout. A failure before any status
line (the connection refused, reset or closed while the request was being sent or its answer
awaited) is the client's: it is retried on a new connection, and when the retries fail too it is
recorded as a client error, never as the server's. That is what happens when a server closes
each connection after its response (llama.cpp's llama-server does, despite keep-alive) and the
pool hands the closed connection to the next request.
"""

from __future__ import annotations

import dataclasses
import itertools
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import orjson

from .prompts import Prompt


@dataclass
class RequestResult:
    started: float
    finished: float = 0.0
    ok: bool = False
    error: str | None = None
    ttft: float | None = None
    # Arrival times of the chunks that carried text (absolute, time.monotonic()).
    chunk_times: list[float] = field(default_factory=list)
    prompt_tokens: int = 0
    output_tokens: int = 0
    backend: str | None = None
    # Why specgate sent it there (x-specgate-reason), when it went through specgate.
    reason: str | None = None
    # The failure happened before the server answered (see the module docstring).
    client_error: bool = False
    # Tries this result took; a value above 1 means it needed a new connection.
    attempts: int = 1
    # Prompt tokens the server found in its prefix cache (usage.prompt_tokens_details.cached_tokens,
    # as SGLang reports it with --enable-cache-report); None when the usage carried no such field.
    cached_tokens: int | None = None
    # What the request was part of (workload.py): its traffic class, its session (a conversation;
    # each single-turn request is a session of its own) and its turn in that session, from 1.
    traffic_class: str = "all"
    session: str = ""
    turn: int = 1

    @property
    def latency(self) -> float:
        return self.finished - self.started

    @property
    def itls(self) -> list[float]:
        t = self.chunk_times
        return [b - a for a, b in itertools.pairwise(t)]

    @property
    def tpot(self) -> float | None:
        if self.ttft is None or self.output_tokens < 2:
            return None
        return (self.latency - self.ttft) / (self.output_tokens - 1)


@dataclass(frozen=True)
class Target:
    url: str
    model: str
    chat: bool = True
    api_key: str | None = None
    max_tokens: int = 512
    ignore_eos: bool = True
    # Fields added to every request body (engine-specific ones such as llama-server's cache_prompt).
    extra_body: Mapping[str, Any] = field(default_factory=dict)
    # Send each request's traffic class and session as `x-specgate-class` and `x-session-id`
    # (specgate's classes and cache affinity; other servers ignore them).
    tag_requests: bool = False
    # A class's requests go to its own URL here (a static split by class); others to `url`.
    class_urls: Mapping[str, str] = field(default_factory=dict)
    # Stream i's requests go to stream_urls[i % len] (every session of a stream stays on one server,
    # the streams dealt to the servers in turn); none: `url`.
    stream_urls: tuple[str, ...] = ()

    def for_class(self, traffic_class: str | None) -> Target:
        """The target a request of this class is sent to."""
        url = self.class_urls.get(traffic_class) if traffic_class else None
        return self if url is None else dataclasses.replace(self, url=url)

    def for_stream(self, stream: int) -> Target:
        """The target stream `stream`'s requests are sent to."""
        if not self.stream_urls:
            return self
        return dataclasses.replace(self, url=self.stream_urls[stream % len(self.stream_urls)], stream_urls=())

    def endpoint(self) -> str:
        return self.url.rstrip("/") + ("/v1/chat/completions" if self.chat else "/v1/completions")

    def headers(self, traffic_class: str | None = None, session: str | None = None) -> dict[str, str]:
        """The request's headers; with tag_requests, its class and session where given."""
        out = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        if self.tag_requests and traffic_class:
            out["x-specgate-class"] = traffic_class
        if self.tag_requests and session:
            out["x-session-id"] = session
        return out

    def body(self, prompt: Prompt) -> dict[str, Any]:
        body: dict[str, Any] = {
            "model": self.model,
            **prompt.body(self.chat),
            "max_tokens": self.max_tokens,
            "temperature": 0,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        if self.ignore_eos:
            body["ignore_eos"] = True
        body.update(self.extra_body)
        return body


# Retries of a request that failed before the server answered, each on a new connection. Two: the
# first retry already gets a connection nobody used, so a second failure is no stale-pool accident.
CLIENT_RETRIES = 2


async def stream_request(
    session: aiohttp.ClientSession,
    target: Target,
    prompt: Prompt,
    retries: int = CLIENT_RETRIES,
    text_sink: list[str] | None = None,
    headers: Mapping[str, str] | None = None,
) -> RequestResult:
    """One request; a client-side failure is retried `retries` times, each on a connection of its own.
    With `text_sink`, the text the server streamed is appended to it, piece by piece (a multi-turn
    session sends the reply back as received); it holds the pieces of the answered try only.
    `headers`: sent instead of the target's own (Target.headers with a class and session).

    Timing is that of the attempt that produced the result: a failed attempt's time is spent on a
    connection the server had already given up (or never took), not on the server's work, so
    counting it would charge the client's pool to the server's TTFT and latency.
    """
    sent = dict(headers) if headers is not None else target.headers()
    result = await _attempt(session, target, prompt, text_sink, sent)
    attempts = 1
    while result.client_error and attempts <= retries:
        # A session that pools nothing: the pool is what handed out the dead connection. The POST
        # is resent even though the server may have read it: a load test only loses some work.
        fresh = aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True), timeout=session.timeout)
        async with fresh:
            result = await _attempt(fresh, target, prompt, text_sink, sent)
        attempts += 1
    result.attempts = attempts
    if result.client_error and attempts > 1:
        result.error = f"{result.error} ({attempts} tries)"
    return result


async def _attempt(
    session: aiohttp.ClientSession,
    target: Target,
    prompt: Prompt,
    text_sink: list[str] | None,
    headers: Mapping[str, str],
) -> RequestResult:
    result = RequestResult(started=time.monotonic())
    if text_sink is not None:
        text_sink.clear()
    text_chunks = 0
    done = False
    answered = False
    try:
        async with session.post(target.endpoint(), json=target.body(prompt), headers=headers) as resp:
            answered = True
            result.backend = resp.headers.get("x-specgate-backend")
            result.reason = resp.headers.get("x-specgate-reason")
            if resp.status != 200:
                body = (await resp.read())[:300].decode("utf-8", "replace")
                result.error = f"HTTP {resp.status}: {body}"
                return result
            async for raw in resp.content:
                line = raw.strip()
                if not line.startswith(b"data:"):
                    continue
                payload = line[5:].strip()
                if payload == b"[DONE]":
                    done = True
                    break
                event = orjson.loads(payload)
                if not isinstance(event, dict):
                    # The server's bad answer, counted as its error (not the client's crash).
                    result.error = f"malformed event: {payload[:200].decode('utf-8', 'replace')}"
                    return result
                if "error" in event:
                    result.error = f"stream error: {str(event['error'])[:200]}"
                    return result
                text = _content(event)
                if text:
                    if text_sink is not None and isinstance(text, str):
                        text_sink.append(text)
                    now = time.monotonic()
                    if result.ttft is None:
                        result.ttft = now - result.started
                    result.chunk_times.append(now)
                    text_chunks += 1
                usage = event.get("usage")
                if isinstance(usage, dict):
                    read_usage(result, usage)
    except (aiohttp.ClientError, TimeoutError, orjson.JSONDecodeError, ValueError) as exc:
        result.error = f"{type(exc).__name__}: {exc}"[:300]
        # A timeout is the server being slow with a request it had; a malformed status line is an
        # answer, if a bad one (ClientResponseError, not a connection error).
        result.client_error = (
            not answered and isinstance(exc, aiohttp.ClientConnectionError) and not isinstance(exc, TimeoutError)
        )
        return result
    finally:
        result.finished = time.monotonic()
    if not done:
        result.error = "stream ended without [DONE]"
        return result
    if not result.output_tokens:
        result.output_tokens = text_chunks
    result.ok = True
    return result


def read_usage(result: RequestResult, usage: Mapping[str, Any]) -> None:
    """A usage object's counts into `result`: prompt and output tokens, and the cached prompt tokens
    when the server reports them (SGLang only with --enable-cache-report: without it there is no
    `prompt_tokens_details`, and the hit rate is unknown rather than 0)."""
    result.prompt_tokens = int(usage.get("prompt_tokens") or 0)
    result.output_tokens = int(usage.get("completion_tokens") or 0)
    details = usage.get("prompt_tokens_details")
    cached = details.get("cached_tokens") if isinstance(details, Mapping) else None
    if isinstance(cached, int) and not isinstance(cached, bool):
        result.cached_tokens = cached


def _content(event: dict[str, Any]) -> Any:
    """The event's text (a chat delta's content or a completion's text); falsy when it has none."""
    choices = event.get("choices")
    if not choices or not isinstance(choices, list) or not isinstance(choices[0], dict):
        return None
    choice = choices[0]
    delta = choice.get("delta")
    return delta.get("content") if isinstance(delta, dict) else choice.get("text")
