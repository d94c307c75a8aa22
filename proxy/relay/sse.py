"""Reading and rewriting the server's response bodies as they pass: OpenAI-style SSE streams (event
boundaries, the usage chunk specgate asked for and drops again, content events, token counts), the
Responses API's typed event streams (their usage in `response.completed`, their delta events), and
the usage of a JSON body. Pure functions and small stateful readers over bytes: no I/O, so the relay
(relay.py) and the shadow prober (shadow.py) both read streams through this module and not through
each other.

Every mark below is matched on compact JSON, as every engine writes it.
"""

from __future__ import annotations

from typing import Any, Protocol, TypeGuard

import orjson

from ..errors import sse_error
from ..fleet.adapter import MAX_KV_TOKENS
from ..fleet.engines import USAGE_FIELDS, reported_steps
from ..kinds import Endpoint
from .sseframe import data_of, first_end, has_data, last_end, split_events

# The most tokens a usage may count of either kind: no request holds more than a KV pool.
MAX_USAGE_TOKENS = MAX_KV_TOKENS

# Bytes of a non-streamed JSON body kept to read its `usage`; larger bodies are relayed unread.
USAGE_BODY_LIMIT = 4 * 1024 * 1024
# A partial SSE event is held back until its end arrives, up to this size (EventCuts).
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

    def broken(self, message: str, code: str) -> bytes | None:
        """What ends the client's copy of a body that broke off after its first bytes; None when
        nothing can end it honestly (a JSON body cut short): the client's connection is cut."""
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

    def broken(self, message: str, code: str) -> bytes | None:
        return None  # a body cut short cannot be ended as if complete


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


class EventCuts:
    """Cuts a relayed event stream at event ends, so that the client only ever holds whole events:
    a partial trailing event waits for its end, and a stream that breaks drops it rather than
    leave half an event for the client's decoder to read as one (the error event after it would
    be lost with it). An event longer than `limit` goes on as it is: a stream with no blank line
    for that long is not SSE as servers write it, and holding it would hold the stream. A held
    event's pieces are kept apart and only each new piece is searched, so a large event costs
    its size once, not once a read."""

    __slots__ = ("_limit", "_look", "_parts", "_size", "_tail", "continued", "open", "unended")

    def __init__(self, limit: int) -> None:
        self._limit = limit
        self._parts: list[bytes] = []
        self._size = 0
        # The held bytes' last 3 (a blank line is at most 4 bytes: these and the next piece tell).
        self._look = b""
        # The client holds an event passed on unended (past `limit`), which ended with `_tail`.
        self.open = False
        self._tail = b""
        # Of what `cut` returned last: the bytes at its start that end an event passed on unended
        # before, and those at its end of an event now passed on unended (a reader counting events
        # counts each once).
        self.continued = 0
        self.unended = 0

    def cut(self, chunk: bytes) -> bytes:
        """The whole events this piece completes (a partial one held back, or passed past the limit)."""
        self.continued = self.unended = 0
        if self._parts:
            look = self._look
            found = last_end(look + chunk)
            if not found:
                self._hold(chunk)
                return self._overflow(b"")
            data, end = b"".join(self._parts) + chunk, self._size - len(look) + found
            self._parts, self._size, self._look = [], 0, b""
        elif self.open:
            found = last_end(self._tail + chunk)
            if not found:
                # More of the event passed on unended: holding it helps no one.
                self._tail = (self._tail + chunk)[-3:]
                self.continued = len(chunk)
                return chunk
            data, end = chunk, found - len(self._tail)
            self.continued = max(first_end(self._tail + chunk) - len(self._tail), 0)
            self.open, self._tail = False, b""
        elif chunk.endswith((b"\n\n", b"\n\r\n")):
            # The usual read: whole events (an LF ends a line whatever came before, and a line end
            # after it ends the event).
            return chunk
        else:
            data, end = chunk, last_end(chunk)
        if end == len(data):
            return data
        complete, rest = data[: max(end, 0)], data[max(end, 0) :]
        self._hold(rest)
        return self._overflow(complete)

    def _hold(self, part: bytes) -> None:
        self._parts.append(part)
        self._size += len(part)
        self._look = (self._look + part)[-3:]

    def _overflow(self, complete: bytes) -> bytes:
        """`complete`, and the held event too once it passed the limit."""
        if self._size <= self._limit:
            return complete
        rest = b"".join(self._parts)
        self._parts, self._size, self._look = [], 0, b""
        self.open, self._tail = True, rest[-3:]
        self.unended = len(rest)
        return complete + rest

    def rest(self) -> bytes:
        """What is held at the body's end: a last event without its blank line, passed on."""
        out = b"".join(self._parts)
        self._parts, self._size, self._look = [], 0, b""
        return out

    def cut_short(self) -> bytes:
        """What ends the client's copy before an error event when the stream broke: the held
        partial event is dropped, and an event passed on unended is closed."""
        self._parts, self._size, self._look = [], 0, b""
        if not self.open:
            return b""
        self.open = False
        return b"\n\n"


class SseRelay:
    """Tracks SSE event boundaries in a relayed stream (EventCuts: only whole events pass), to read
    token usage and, when asked, to drop the usage chunk that specgate itself asked for. Event bytes
    pass through unchanged; when dropping, the finish event waits for the next bytes: a server may
    have moved fields into the usage chunk only because usage was asked for (llama-server's
    `timings`, see engines.py), and those go back onto the finish event, where the client would
    have found them."""

    __slots__ = ("_cuts", "_held", "_strip", "_usage_event", "_usage_parsed")

    def __init__(self, strip_usage: bool) -> None:
        self._strip = strip_usage
        self._cuts = EventCuts(PARTIAL_EVENT_LIMIT)
        self._held = b""
        self._usage_event: bytes | None = None
        self._usage_parsed: Any = None

    def feed(self, chunk: bytes) -> bytes:
        """Bytes to send to the client for this piece of upstream body."""
        complete = self._cuts.cut(chunk)
        if self._held:
            complete, self._held = self._held + complete, b""
        if _USAGE_MARK in complete:
            complete = self._scan(complete)
        if self._strip and complete and _FINISH_MARK in complete and not self._cuts.open:
            # The usage chunk follows the finish event: hold that event until the next bytes come.
            tail = split_events(complete)[-1]
            if _FINISH_MARK in tail:
                complete, self._held = complete[: len(complete) - len(tail)], tail
        return complete

    def flush(self) -> bytes:
        rest, self._held = self._held + self._cuts.rest(), b""
        if _USAGE_MARK in rest:  # a usage chunk last, without its blank line (or [DONE] after it)
            rest = self._scan(rest)
        return rest

    def _scan(self, complete: bytes) -> bytes:
        kept: list[bytes] = []
        changed = False
        for event in split_events(complete):
            if _USAGE_MARK in event:
                self._usage_event = event
                if self._strip and (b'"choices":[]' in event or b'"choices": []' in event):
                    self._drop_usage(event, kept)
                    changed = True
                    continue
            kept.append(event)
        return b"".join(kept) if changed else complete

    def _drop_usage(self, event: bytes, kept: list[bytes]) -> None:
        """Drop the usage chunk, keeping what else the server put in it (see the class)."""
        obj = _json(data_of(event))
        if not isinstance(obj, dict):
            return
        extra = {k: v for k, v in obj.items() if k not in _ENVELOPE and v is not None}
        if not extra:
            return
        try:
            for i in range(len(kept) - 1, -1, -1):
                if kept[i].startswith(b"data:") and _FINISH_MARK in kept[i]:
                    prev = _json(data_of(kept[i]))
                    if isinstance(prev, dict):
                        prev.update({k: v for k, v in extra.items() if k not in prev})
                        kept[i] = b"data: " + orjson.dumps(prev) + _blank_line(kept[i])
                        return
                    break
            # The finish event is gone already: the rest of the chunk goes on without the usage.
            rest = orjson.dumps({k: v for k, v in obj.items() if k != "usage"})
            kept.append(b"data: " + rest + _blank_line(event))
        except orjson.JSONEncodeError:
            pass  # nested past what orjson writes (it reads deeper): the chunk is dropped whole

    def usage(self) -> tuple[int, int] | None:
        return usage_of(self._usage_obj())

    def steps(self) -> tuple[int, int] | None:
        return reported_steps(self._usage_obj())

    def _usage_obj(self) -> Any:
        """The last event with token counts, as JSON (None without one); parsed once, at the end."""
        event, self._usage_event = self._usage_event, None
        if event is not None:
            self._usage_parsed = _json(data_of(event))
        return self._usage_parsed

    def response_id(self) -> str | None:
        return None

    def broken(self, message: str, code: str) -> bytes:
        held, self._held = self._held, b""
        return held + self._cuts.cut_short() + sse_error(message, code)


def _json(data: bytes | None) -> Any:
    if data is None:
        return None
    try:
        return orjson.loads(data)
    except (orjson.JSONDecodeError, RecursionError):
        return None


def _blank_line(event: bytes) -> bytes:
    """The line ends that close `event`, as the server wrote them."""
    return event[len(event.rstrip(b"\r\n")) :] or b"\n\n"


class ResponseEvents:
    """A Responses API stream (`event: <type>` / `data: {...}` pairs, numbered by `sequence_number`,
    no `[DONE]`), passed through whole event by whole event (EventCuts). Its events are told apart as
    they pass, to keep the last one that ends the response (`response.completed`, or `.incomplete` /
    `.failed`), whose response holds the usage and the id, read once, at the end."""

    __slots__ = ("_cuts", "_final", "events")

    def __init__(self) -> None:
        # The terminal event carries the whole response: held whole up to the size read for usage.
        self._cuts = EventCuts(USAGE_BODY_LIMIT)
        self._final: bytes | None = None
        # Events so far (a block with a data field; comments such as `: ping` are none): the next
        # one's sequence_number, as engines number them from 0.
        self.events = 0

    def feed(self, chunk: bytes) -> bytes:
        cuts = self._cuts
        out = cuts.cut(chunk)
        if out:
            # An event passed on unended counts as one as it goes on (none but a server's output is
            # that long; its data line may not have come yet), and not again as it ends.
            start, end = cuts.continued, len(out) - cuts.unended
            if end > start:
                self._count(split_events(out[start:end]))
            if cuts.unended:
                self.events += 1
        return out

    def _count(self, events: list[bytes]) -> None:
        for event in events:
            if has_data(event):
                self.events += 1
                # The last event, its whole response with usage (whichever way it ended).
                if b"response.completed" in event or b"response.incomplete" in event or b"response.failed" in event:
                    self._final = event

    def flush(self) -> bytes:
        rest = self._cuts.rest()
        if rest:
            self._count([rest])  # a last event without its blank line
        return rest

    def _response(self) -> Any:
        if self._final is None:
            return None
        obj = _json(data_of(self._final))
        return obj.get("response") if isinstance(obj, dict) else None

    def usage(self) -> tuple[int, int] | None:
        return usage_of(self._response())

    def steps(self) -> tuple[int, int] | None:
        return reported_steps(self._response())

    def response_id(self) -> str | None:
        return response_id_of(self._response())

    def broken(self, message: str, code: str) -> bytes:
        """The Responses API's own error event (it has no `[DONE]` to end with)."""
        cut = self._cuts.cut_short()
        error = {"type": "error", "code": code, "message": message, "param": None, "sequence_number": self.events}
        return cut + b"event: error\ndata: " + orjson.dumps(error) + b"\n\n"


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
    for event in split_events(body):
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
    for event in split_events(body):
        at = event.find(_DELTA)
        if at >= 0 and event[at + len(_DELTA) : at + len(_DELTA) + 1] not in (b'"', b""):
            n += 1
    return n


def completion_tokens(data: bytes) -> int | None:
    """completion_tokens of a stream's usage chunk (its last event that has one)."""
    for event in reversed(split_events(data)):
        if b'"completion_tokens"' not in event:
            continue
        obj = _json(data_of(event))
        usage = obj.get("usage") if isinstance(obj, dict) else None
        value = usage.get("completion_tokens") if isinstance(usage, dict) else None
        return value if isinstance(value, int) and not isinstance(value, bool) else None
    return None
