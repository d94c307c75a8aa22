"""Shared test helpers: scraping Prometheus text, reading SSE streams."""

from __future__ import annotations

import httpx
import orjson

from proxy import promtext


def scrape(url: str) -> dict[str, float]:
    """Every sample of a /metrics page, summed over labels, by sample name."""
    return promtext.totals(httpx.get(url + "/metrics", timeout=5).text)


def sse_events(raw: bytes) -> list[bytes]:
    """The `data:` payloads of an SSE body, in order."""
    events = []
    for block in raw.split(b"\n\n"):
        if block.strip():
            assert block.startswith(b"data: "), block
            events.append(block[len(b"data: ") :])
    return events


def sse_json(raw: bytes) -> list[dict[str, object]]:
    events = sse_events(raw)
    assert events[-1] == b"[DONE]"
    return [orjson.loads(e) for e in events[:-1]]
