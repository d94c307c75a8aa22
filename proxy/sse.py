"""Reading and rewriting the server's response bodies as they pass: OpenAI-style SSE streams (event
boundaries, the usage chunk specgate asked for and drops again, content events, token counts), the
Responses API's typed event streams (their usage in `response.completed`, their delta events), and
the usage of a JSON body. Pure functions and small stateful readers over bytes: no I/O, so the relay
(relay.py) and the shadow prober (probe.py) both read streams through this module and not through
each other.

Every mark below is matched on compact JSON, as every engine writes it.
"""

from __future__ import annotations

from typing import Any, Protocol, TypeGuard

import orjson

from .engines import MAX_KV_TOKENS, USAGE_FIELDS, reported_steps
from .errors import sse_error
from .kinds import Endpoint

# The most tokens a usage may count of either kind: no request holds more than a KV pool.
MAX_USAGE_TOKENS = MAX_KV_TOKENS

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

    def steps(self) -> tuple[int, int] | None:
        """(output tokens, decode steps) the body reported of its own speculation, once it has
        ended (engines.reported_steps)."""
        ...

    def response_id(self) -> str | None:
        """A Responses API body's response id, once it has ended."""
        ...

    def broken(self, message: str, code: str) -> bytes:
        """What ends the client's copy of a body that broke off after its first bytes."""
        ...


def reader_for(content_type: str, status: int, strip_usage: bool, typed: bool = False) -> BodyReader:
    """The reader for a response: an event stream's events (`typed`: the Responses API's), a
    successful JSON body's usage, or neither."""
    if content_type.startswith("text/event-stream"):
        return ResponseEvents() if typed else SseRelay(strip_usage)
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

    def steps(self) -> tuple[int, int] | None:
        return None

    def response_id(self) -> str | None:
        return None

    def broken(self, message: str, code: str) -> bytes:
        return b""  # a JSON body cut short: the client's parser says so


class JsonUsage(Passthrough):
    """A JSON body, passed on as it comes and kept (up to USAGE_BODY_LIMIT) to read its usage."""

    __slots__ = ("_kept", "_obj", "_parts")

    def __init__(self) -> None:
        self._parts: list[bytes] = []
        self._kept = 0
        self._obj: Any = None

    def feed(self, chunk: bytes) -> bytes:
        if self._kept <= USAGE_BODY_LIMIT:
            self._kept += len(chunk)
            if self._kept <= USAGE_BODY_LIMIT:
                self._parts.append(chunk)
            else:
                self._parts.clear()
        return chunk

    def usage(self) -> tuple[int, int] | None:
        return usage_of(self._parsed())

    def steps(self) -> tuple[int, int] | None:
        return reported_steps(self._parsed())

    def response_id(self) -> str | None:
        return response_id_of(self._parsed())

    def _parsed(self) -> Any:
        if self._obj is None and self._parts:
            try:
                self._obj = orjson.loads(b"".join(self._parts))
            except (orjson.JSONDecodeError, RecursionError):
                self._obj = False
            self._parts.clear()
        return self._obj


class SseRelay:
    """Tracks SSE event boundaries in a relayed stream, to read token usage and, when asked, to
    drop the usage chunk that specgate itself asked for. Bytes pass through unchanged and unmerged;
    only when dropping is on is a partial trailing event held until its end arrives (a client
    cannot use half an event), and the finish event until the next bytes: a server may have moved
    fields into the usage chunk only because usage was asked for (llama-server's `timings`, see
    engines.py), and those go back onto the finish event, where the client would have found them."""

    __slots__ = ("_held", "_partial", "_strip", "_usage_event", "_usage_parsed")

    def __init__(self, strip_usage: bool) -> None:
        self._strip = strip_usage
        self._partial = b""
        self._held = b""
        self._usage_event: bytes | None = None
        self._usage_parsed: Any = None

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
        return usage_of(self._usage_obj())

    def steps(self) -> tuple[int, int] | None:
        return reported_steps(self._usage_obj())

    def _usage_obj(self) -> Any:
        """The last event with token counts, as JSON (None without one); parsed once, at the end."""
        event, self._usage_event = self._usage_event, None
        if event is not None:
            try:
                self._usage_parsed = orjson.loads(event.strip().removeprefix(b"data:").strip())
            except (orjson.JSONDecodeError, RecursionError):
                self._usage_parsed = None
        return self._usage_parsed

    def response_id(self) -> str | None:
        return None

    def broken(self, message: str, code: str) -> bytes:
        return sse_error(message, code)


# A Responses stream's last event: its whole response, with usage (whichever way it ended).
_TERMINAL = (b"response.completed", b"response.incomplete", b"response.failed")


class ResponseEvents:
    """A Responses API stream (`event: <type>` / `data: {...}` pairs, numbered by `sequence_number`,
    no `[DONE]`), passed through unchanged. Its events are told apart as they pass, to keep the last
    one that ends the response (`response.completed`, or `.incomplete` / `.failed`), whose response
    holds the usage and the id, read once, at the end."""

    __slots__ = ("_final", "_parts", "_size", "events")

    def __init__(self) -> None:
        self._parts: list[bytes] = []
        self._size = 0
        self._final: bytes | None = None
        # Complete events so far: the next one's sequence_number, as engines number them from 0.
        self.events = 0

    def feed(self, chunk: bytes) -> bytes:
        start = 0
        if self._parts and self._parts[-1].endswith(b"\n") and chunk.startswith(b"\n"):
            self._event_ended()  # the blank line was split between two reads
            start = 1
        while (at := chunk.find(b"\n\n", start)) >= 0:
            self._keep(chunk[start:at])
            self._event_ended()
            start = at + 2
        if start < len(chunk):
            self._keep(chunk[start:] if start else chunk)
        return chunk

    def _keep(self, part: bytes) -> None:
        self._size += len(part)
        if self._size <= USAGE_BODY_LIMIT:
            self._parts.append(part)

    def _event_ended(self) -> None:
        event = b"".join(self._parts) if self._size <= USAGE_BODY_LIMIT else b""
        self._parts.clear()
        self._size = 0
        if event.strip():
            self.events += 1
            if any(mark in event for mark in _TERMINAL):
                self._final = event

    def flush(self) -> bytes:
        if self._parts:
            self._event_ended()  # a last event without its blank line
        return b""

    def _response(self) -> Any:
        if self._final is None:
            return None
        obj = _event_data(self._final)
        return obj.get("response") if isinstance(obj, dict) else None

    def usage(self) -> tuple[int, int] | None:
        return usage_of(self._response())

    def steps(self) -> tuple[int, int] | None:
        return reported_steps(self._response())

    def response_id(self) -> str | None:
        return response_id_of(self._response())

    def broken(self, message: str, code: str) -> bytes:
        """The Responses API's own error event (it has no `[DONE]` to end with)."""
        error = {"type": "error", "code": code, "message": message, "param": None, "sequence_number": self.events}
        return b"event: error\ndata: " + orjson.dumps(error) + b"\n\n"


def _event_data(event: bytes) -> Any:
    """An SSE event's data (its `data:` lines joined) as JSON, or None."""
    lines = [line[5:].strip() for line in event.split(b"\n") if line.startswith(b"data:")]
    try:
        return orjson.loads(b"\n".join(lines)) if lines else None
    except (orjson.JSONDecodeError, RecursionError):
        return None


def usage_of(obj: Any) -> tuple[int, int] | None:
    """(prompt, completion) tokens from an OpenAI `usage` (chat and completions' names, or the
    Responses API's `input_tokens` / `output_tokens`) or SGLang's native `meta_info`."""
    if not isinstance(obj, dict):
        return None
    src = None
    for field in USAGE_FIELDS:
        src = obj.get(field)
        if src:
            break
    if isinstance(src, dict):
        p = src.get("prompt_tokens", src.get("input_tokens"))
        c = src.get("completion_tokens", src.get("output_tokens"))
        # Counts no server could report (negative, past any KV pool, booleans) are no usage: they
        # would reach counters, the prompt estimate's ratio and the affinity table.
        if _count(p) and _count(c):
            return p, c
    return None


def _count(value: object) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= MAX_USAGE_TOKENS


def response_id_of(obj: Any) -> str | None:
    """The id of a Responses API response object."""
    if isinstance(obj, dict) and obj.get("object") == "response":
        rid = obj.get("id")
        return rid if isinstance(rid, str) else None
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


# A Responses event whose `delta` is text a decode step made: output, reasoning or a tool call's
# arguments. Matched as `"delta":"` followed by anything but the closing quote (an empty delta).
DELTA_MARK = _DELTA = b'"delta":"'


def generated_mark(endpoint: Endpoint) -> bytes:
    """What marks one content event of a response of `endpoint`, counted as it passes (a mark found
    in empty content too: the role chunk counts one)."""
    if endpoint == "responses":
        return _DELTA
    return _OUTPUT[0] if endpoint == "chat" else _OUTPUT[1]


def response_deltas(body: bytes) -> int:
    """Events in a Responses API stream that carry a decode step's output (its `*.delta` events):
    what `content_events` is to a chat stream. Its `*.done` events and `response.completed` repeat
    the whole text, so the chat marks would count those too."""
    n = 0
    for event in body.split(b"\n\n"):
        at = event.find(_DELTA)
        if at >= 0 and event[at + len(_DELTA) : at + len(_DELTA) + 1] not in (b'"', b""):
            n += 1
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
