"""Logging set-up: plain text or one JSON object per line. Nothing logs prompts or keys.

Every message has its control characters escaped (`\\n`, `\\x1b`): messages quote what servers and
clients sent (a `/health` body, a header), and a raw newline or terminal escape in one would forge
log lines or repaint an operator's terminal. Tracebacks, which are specgate's own, keep their lines.
"""

from __future__ import annotations

import logging
import sys
import time

import orjson

from ..config import Settings

# C0 controls, DEL and C1 controls, each to a visible escape.
_ESCAPES = {c: repr(chr(c))[1:-1] for c in (*range(0x20), *range(0x7F, 0xA0))}


def escape_controls(text: str) -> str:
    return text.translate(_ESCAPES)


class EscapeControls(logging.Filter):
    """Formats each record's message once, with its control characters escaped."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        escaped = escape_controls(message)
        if escaped != message or record.args:
            record.msg, record.args = escaped, None
        return True


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        entry = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        if record.exc_info:
            entry["exc"] = self.formatException(record.exc_info)
        return orjson.dumps(entry).decode()


def configure(settings: Settings) -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.addFilter(EscapeControls())
    if settings.log_format == "json":
        handler.setFormatter(JsonFormatter())
    else:
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(settings.log_level.upper())
    # uvicorn's own loggers go through the same handler; its access log stays off (hot path).
    for name in ("uvicorn", "uvicorn.error"):
        logging.getLogger(name).handlers[:] = []
        logging.getLogger(name).propagate = True
