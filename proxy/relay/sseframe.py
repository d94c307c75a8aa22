"""Server-sent events' framing: where an event ends and what its data is, whichever line ends the
server writes. The SSE standard allows CRLF, CR and LF, and servers use each (sse-starlette writes
CRLF by default); an event ends at a blank line. Pure functions over bytes, shared by specgate's
readers of an event stream (sse.py, and through it the shadow prober).

Most engines write LF alone: each function takes the plain `bytes` path unless a CR is present, a
single memchr, so the relay's hot path pays nothing for the other framings.
"""

from __future__ import annotations

import re

# A line end, then another: a blank line ends the event. A CR last in the bytes read so far ends
# nothing yet: it may be the first half of a CRLF whose LF comes in the next read (so a stream
# framed with CR alone has each event go on with the next read, or at the body's end).
_BLANK_LINE = re.compile(rb"(?:\r\n|\r(?!\n)|\n)(?:\r\n|\r(?=[^\n])|\n)")
_LINE_END = re.compile(rb"\r\n|\r|\n")
_LF_BLANK = b"\n\n"


def last_end(data: bytes) -> int:
    """Where the last complete event in `data` ends (just past its blank line), or 0 if none does."""
    if b"\r" not in data:
        at = data.rfind(_LF_BLANK)
        return at + 2 if at >= 0 else 0
    end = 0
    for m in _BLANK_LINE.finditer(data):
        end = m.end()
    return end


def first_end(data: bytes) -> int:
    """Where the first complete event in `data` ends, or 0 if none does."""
    if b"\r" not in data:
        at = data.find(_LF_BLANK)
        return at + 2 if at >= 0 else 0
    m = _BLANK_LINE.search(data)
    return m.end() if m is not None else 0


def split_events(data: bytes) -> list[bytes]:
    """The events in `data`, each with its own blank line, as the bytes came (joined again they are
    `data`); a last event without its blank line is the last item."""
    if b"\r" not in data:
        parts = data.split(_LF_BLANK)
        out = [p + _LF_BLANK for p in parts[:-1]]
    else:
        out, start = [], 0
        for m in _BLANK_LINE.finditer(data):
            out.append(data[start : m.end()])
            start = m.end()
        parts = [data[start:]]
    if parts[-1]:
        out.append(parts[-1])
    return out


def lines(event: bytes) -> list[bytes]:
    """An event's lines, without their line ends."""
    return _LINE_END.split(event) if b"\r" in event else event.split(b"\n")


def data_of(event: bytes) -> bytes | None:
    """An event's data (its `data` fields' values joined by LF, as a browser's EventSource reads
    them), or None when it has no data field: a comment such as `: ping`, or a blank block, which
    dispatches no event."""
    found: list[bytes] | None = None
    for line in lines(event):
        if line.startswith(b"data"):
            rest = line[4:]
            if rest.startswith(b":"):
                rest = rest[2:] if rest.startswith(b": ") else rest[1:]
            elif rest:
                continue  # another field whose name starts with "data"
            found = [rest] if found is None else [*found, rest]
    return None if found is None else b"\n".join(found)


def has_data(event: bytes) -> bool:
    """Whether an event has a data field (data_of is not None), without reading it."""
    if b"\ndata:" in event or event.startswith(b"data:"):  # how every server writes it
        return True
    return b"data" in event and data_of(event) is not None


def ends_with_done(chunk: bytes) -> bool:
    """Whether `chunk` ends with an OpenAI stream's last event, `data: [DONE]`, framed any way."""
    if chunk.endswith(b"data: [DONE]\n\n"):
        return True
    return chunk.endswith((b"\r\n\r\n", b"\r\r")) and chunk[-32:].rstrip(b"\r\n").endswith(b"data: [DONE]")
