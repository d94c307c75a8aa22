"""Reading and rewriting the server's response bodies as they pass: OpenAI-style SSE streams (event
boundaries, the usage chunk specgate asked for and drops again, content events, token counts) and
the usage of a JSON body. Pure functions and small stateful readers over bytes: no I/O, so the relay
(relay.py) and the shadow prober (probe.py) both read streams through this module and not through
each other.

Every mark below is matched on compact JSON, as every engine writes it.
"""

from __future__ import annotations

from typing import Any, Protocol

import orjson

from .engines import USAGE_FIELDS

# Bytes of a non-streamed JSON body kept to read its `usage`; larger bodies are relayed unread.
USAGE_BODY_LIMIT = 4 * 1024 * 1024
# A partial SSE event held back (only when a usage chunk must be dropped) is released past this.
PARTIAL_EVENT_LIMIT = 256 * 1024
_USAGE_MARK = b'"completion_tokens"'
# A finish event: its `finish_reason` is a string, not null.
_FINISH_MARK = b'"finish_reason":"'
# The fields of a usage chunk that are the chunk's own; anything else the server moved there.
_ENVELOPE = frozenset({"id", "object", "created", "model", "system_fingerprint", "service_tier", "choices", "usage"})
# An OpenAI stream's last event.
DONE = b"data: [DONE]\n\n"
# Where a decode step's output sits in a chat or completion event; `content":"` also finds
# `"reasoning_content":"`, a reasoning model's steps.
_OUTPUT = (b'content":"', b'"text":"')


class BodyReader(Protocol):
    """What the relay passes a response body through: bytes in, bytes for the client out, and the
    body's token usage once it has ended."""

    def feed(self, chunk: bytes) -> bytes: ...

    def flush(self) -> bytes: ...

    def usage(self) -> tuple[int, int] | None: ...


def reader_for(content_type: str, status: int, strip_usage: bool) -> BodyReader:
    """The reader for a response: an event stream's events, a successful JSON body's usage, or neither."""
    if content_type.startswith("text/event-stream"):
        return SseRelay(strip_usage)
    if status == 200 and "json" in content_type:
        return JsonUsage()
    return Passthrough()


class Passthrough:
    """A body specgate reads nothing of."""

    __slots__ = ()

    def feed(self, chunk: bytes) -> bytes:
        return chunk

    def flush(self) -> bytes:
        return b""

    def usage(self) -> tuple[int, int] | None:
        return None


class JsonUsage(Passthrough):
    """A JSON body, passed on as it comes and kept (up to USAGE_BODY_LIMIT) to read its usage."""

    __slots__ = ("_kept", "_parts")

    def __init__(self) -> None:
        self._parts: list[bytes] = []
        self._kept = 0

    def feed(self, chunk: bytes) -> bytes:
        if self._kept <= USAGE_BODY_LIMIT:
            self._kept += len(chunk)
            if self._kept <= USAGE_BODY_LIMIT:
                self._parts.append(chunk)
            else:
                self._parts.clear()
        return chunk

    def usage(self) -> tuple[int, int] | None:
        if not self._parts:
            return None
        try:
            return usage_of(orjson.loads(b"".join(self._parts)))
        except orjson.JSONDecodeError:
            return None


class SseRelay:
    """Tracks SSE event boundaries in a relayed stream, to read token usage and, when asked, to
    drop the usage chunk that specgate itself asked for. Bytes pass through unchanged and unmerged;
    only when dropping is on is a partial trailing event held until its end arrives (a client
    cannot use half an event), and the finish event until the next bytes: a server may have moved
    fields into the usage chunk only because usage was asked for (llama-server's `timings`, see
    engines.py), and those go back onto the finish event, where the client would have found them."""

    __slots__ = ("_held", "_partial", "_strip", "_usage_event")

    def __init__(self, strip_usage: bool) -> None:
        self._strip = strip_usage
        self._partial = b""
        self._held = b""
        self._usage_event: bytes | None = None

    def feed(self, chunk: bytes) -> bytes:
        """Bytes to send to the client for this piece of upstream body."""
        data = self._partial + chunk if self._partial else chunk
        end = data.rfind(b"\n\n")
        cut = end + 2 if end >= 0 else 0
        complete, self._partial = data[:cut], data[cut:]
        if self._held:
            complete, self._held = self._held + complete, b""
        if _USAGE_MARK in complete:
            complete = self._scan(complete)
        if self._strip and complete and _FINISH_MARK in complete:
            # The usage chunk follows the finish event: hold that event until the next bytes come.
            last = complete.rfind(b"\n\n", 0, len(complete) - 2)
            tail = complete[last + 2 :] if last >= 0 else complete
            if _FINISH_MARK in tail:
                complete, self._held = complete[: len(complete) - len(tail)], tail
        if len(self._partial) > PARTIAL_EVENT_LIMIT:
            # Not SSE as servers write it (no blank line for this long): stop holding anything back.
            held, self._partial = self._held + self._partial, b""
            self._held = b""
            if self._strip:
                self._strip = False
                return complete + held
        return complete if self._strip else chunk

    def flush(self) -> bytes:
        rest, self._partial, self._held = self._held + self._partial, b"", b""
        return rest if self._strip else b""

    def _scan(self, complete: bytes) -> bytes:
        kept: list[bytes] = []
        for event in complete.split(b"\n\n"):
            if _USAGE_MARK in event:
                self._usage_event = event
                if self._strip and (b'"choices":[]' in event or b'"choices": []' in event):
                    self._drop_usage(event, kept)
                    continue
            kept.append(event)
        return b"\n\n".join(kept)

    def _drop_usage(self, event: bytes, kept: list[bytes]) -> None:
        """Drop the usage chunk, keeping what else the server put in it (see the class)."""
        try:
            obj = orjson.loads(event.strip().removeprefix(b"data:"))
        except orjson.JSONDecodeError:
            return
        if not isinstance(obj, dict):
            return
        extra = {k: v for k, v in obj.items() if k not in _ENVELOPE and v is not None}
        if not extra:
            return
        for i in range(len(kept) - 1, -1, -1):
            if kept[i].startswith(b"data:") and _FINISH_MARK in kept[i]:
                try:
                    prev = orjson.loads(kept[i].removeprefix(b"data:"))
                except orjson.JSONDecodeError:
                    break
                if isinstance(prev, dict):
                    prev.update({k: v for k, v in extra.items() if k not in prev})
                    kept[i] = b"data: " + orjson.dumps(prev)
                    return
                break
        # The finish event is gone already: the rest of the chunk goes on without the usage.
        kept.append(b"data: " + orjson.dumps({k: v for k, v in obj.items() if k != "usage"}))

    def usage(self) -> tuple[int, int] | None:
        if self._usage_event is None:
            return None
        payload = self._usage_event.strip().removeprefix(b"data:").strip()
        try:
            return usage_of(orjson.loads(payload))
        except orjson.JSONDecodeError:
            return None


def usage_of(obj: Any) -> tuple[int, int] | None:
    """(prompt, completion) tokens from an OpenAI `usage` or SGLang's native `meta_info`."""
    if not isinstance(obj, dict):
        return None
    src = None
    for field in USAGE_FIELDS:
        src = obj.get(field)
        if src:
            break
    if isinstance(src, dict):
        p, c = src.get("prompt_tokens"), src.get("completion_tokens")
        if isinstance(p, int) and isinstance(c, int):
            return p, c
    return None


def content_events(body: bytes) -> int:
    """Events in an SSE body that carry a decode step's output: for engines with stream_steps, the
    stream's decode steps. The role chunk and finish chunk (empty content), the usage chunk and
    `[DONE]` carry none."""
    n = 0
    for event in body.split(b"\n\n"):
        for mark in _OUTPUT:
            at = event.find(mark)
            if at >= 0 and event[at + len(mark) : at + len(mark) + 1] not in (b'"', b""):
                n += 1
                break
    return n


def completion_tokens(data: bytes) -> int | None:
    """completion_tokens of a stream's usage chunk (its last event that has one)."""
    for event in reversed(data.split(b"\n\n")):
        if b'"completion_tokens"' not in event:
            continue
        try:
            obj = orjson.loads(event.strip().removeprefix(b"data:").strip())
        except orjson.JSONDecodeError:
            return None
        usage = obj.get("usage") if isinstance(obj, dict) else None
        value = usage.get("completion_tokens") if isinstance(usage, dict) else None
        return value if isinstance(value, int) and not isinstance(value, bool) else None
    return None
