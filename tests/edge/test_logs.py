"""Log lines quote what servers and clients sent: their control characters are escaped."""

from __future__ import annotations

import logging
from collections.abc import Iterator

import orjson
import pytest

from proxy.config import Settings
from proxy.observability.logs import configure


@pytest.fixture
def restore_logging() -> Iterator[None]:
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    yield
    root.handlers[:] = handlers
    root.setLevel(level)


@pytest.mark.parametrize("fmt", ["text", "json"])
def test_control_characters_in_a_message_are_escaped(
    fmt: str, restore_logging: None, capsys: pytest.CaptureFixture[str]
) -> None:
    configure(Settings(_env_file=None, log_format=fmt))
    # A /health body as a hostile server might send it: a forged second line and a screen clear.
    body = "loading\n2026-12-04 00:00:00 INFO specgate: all good\x1b[2J\r\x7f"
    logging.getLogger("specgate.health").warning("backend %s is down: %s", "speculative", body)
    try:
        raise ValueError("boom")
    except ValueError:
        logging.getLogger("specgate").exception("a failure with %s", "a\nnewline")
    err = capsys.readouterr().err
    lines = err.splitlines()
    down = next(line for line in lines if "is down" in line)
    assert "\x1b" not in err and "\r" not in err and "\x7f" not in err
    if fmt == "json":
        entries = [orjson.loads(line) for line in lines]
        assert entries[0]["msg"] == "backend speculative is down: " + body.translate(
            {10: "\\n", 27: "\\x1b", 13: "\\r", 127: "\\x7f"}
        )
        assert entries[1]["msg"] == "a failure with a\\nnewline" and "ValueError: boom" in entries[1]["exc"]
    else:
        assert down.endswith("down: loading\\n2026-12-04 00:00:00 INFO specgate: all good\\x1b[2J\\r\\x7f")
        assert not any(line.startswith("2026-12-04 00:00:00 INFO") for line in lines)
        # The traceback, specgate's own, keeps its lines.
        assert "a failure with a\\nnewline" in err and "Traceback (most recent call last):" in lines
