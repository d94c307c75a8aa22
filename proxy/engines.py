"""What each inference engine reports about itself: one small adapter per engine.

specgate relays the OpenAI API, which SGLang, vLLM and llama.cpp's llama-server all serve alike.
They differ in what specgate reads beside it: the names of the metrics that count running and
queued requests, how speculative acceptance is reported, and what `/health` means. Everything
engine-specific lives in an `Engine` value here; the rest of the proxy asks these, never a name.

- SGLang: `sglang:num_running_reqs` + `sglang:num_queue_reqs`; acceptance: the gauge
  `sglang:spec_accept_length`.
- vLLM: `vllm:num_requests_running` + `vllm:num_requests_waiting`; acceptance: a rate of the
  counters `vllm:spec_decode_num_accepted_tokens_total` and `vllm:spec_decode_num_drafts_total`.
- llama.cpp: `llamacpp:requests_processing` + `llamacpp:requests_deferred`; acceptance: the same
  counters with the `llamacpp:` prefix.

Streams: SGLang (with its default `--stream-interval 1`) and vLLM send one SSE content event per
decode step, so a single stream's tokens over its content events is its acceptance length, with no
wait for a gauge's refresh (`stream_steps`); llama-server sends one event per token.

SGLang's own names use `sglang:`; `sglang_` is what SGLang's router re-exports them as, so both are
read. Acceptance length counts the bonus token: 1 + accepted / drafts (>= 1); none without drafts.

`/health`: 200 means serving for all three. SGLang answers 503 while warming up (and runs a
one-token generation for every check, so it is slow under load); vLLM refuses connections until
its engine is up and answers 503 once it died; llama-server answers 503 "Loading model".
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

import orjson
from prometheus_client.parser import text_string_to_metric_families

EngineName = Literal["sglang", "vllm", "llamacpp"]
EngineSetting = Literal["auto", "sglang", "vllm", "llamacpp"]


@dataclass(frozen=True)
class Engine:
    name: EngineName
    # Metric name prefixes this engine's own /metrics uses (any of them identifies it).
    prefixes: tuple[str, ...]
    running: str
    queued: str
    # A gauge of mean acceptance length (SGLang), or a pair of counters to take a rate of.
    accept_gauge: str | None = None
    accepted_counter: str | None = None
    drafts_counter: str | None = None
    # SGLang refreshes its gauges every 40 decode steps and keeps them when idle: values that stop
    # moving mean an idle server. vLLM's and llama.cpp's gauges are live, so a standing value is real.
    freezes_when_idle: bool = False
    # One SSE content event per decode step (speculative: per verify step, however many tokens it
    # accepted): tokens / content events measures a stream's acceptance length.
    stream_steps: bool = False
    # Values that move while the server works (only read when `freezes_when_idle`).
    activity: tuple[str, ...] = ()

    def load(self, values: Mapping[str, float]) -> int | None:
        """Running plus queued requests, or None when the metrics lack either."""
        running, queued = self._get(values, self.running), self._get(values, self.queued)
        if running is None or queued is None:
            return None
        return int(running + queued)

    def activity_of(self, values: Mapping[str, float]) -> tuple[float, ...]:
        return tuple(self._get(values, k) or 0.0 for k in self.activity)

    def accept_gauge_value(self, values: Mapping[str, float]) -> float | None:
        if self.accept_gauge is None:
            return None
        value = self._get(values, self.accept_gauge)
        # SGLang reports 0 without speculation and keeps its last value when idle.
        return value if value is not None and value >= 1.0 else None

    def accept_counters(self, values: Mapping[str, float]) -> tuple[float, float] | None:
        """(accepted draft tokens, drafts) so far, or None when the server does not export them."""
        if self.accepted_counter is None or self.drafts_counter is None:
            return None
        accepted, drafts = self._get(values, self.accepted_counter), self._get(values, self.drafts_counter)
        if accepted is None or drafts is None:
            return None
        return accepted, drafts

    def missing(self, values: Mapping[str, float]) -> list[str]:
        """The load metrics this engine should export that are absent (for the operator)."""
        return [self.prefixes[0] + k for k in (self.running, self.queued) if self._get(values, k) is None]

    def owns(self, values: Mapping[str, float]) -> bool:
        return any(name.startswith(self.prefixes) for name in values)

    def _get(self, values: Mapping[str, float], name: str) -> float | None:
        for prefix in self.prefixes:
            value = values.get(prefix + name)
            if value is not None:
                return value
        return None


SGLANG = Engine(
    "sglang",
    ("sglang:", "sglang_"),
    running="num_running_reqs",
    queued="num_queue_reqs",
    accept_gauge="spec_accept_length",
    freezes_when_idle=True,
    stream_steps=True,
    activity=(
        "num_running_reqs",
        "num_queue_reqs",
        "gen_throughput",
        "generation_tokens_total",
        "prompt_tokens_total",
        "num_requests_total",
    ),
)
VLLM = Engine(
    "vllm",
    ("vllm:",),
    running="num_requests_running",
    queued="num_requests_waiting",
    accepted_counter="spec_decode_num_accepted_tokens_total",
    drafts_counter="spec_decode_num_drafts_total",
    stream_steps=True,
)
LLAMACPP = Engine(
    "llamacpp",
    ("llamacpp:",),
    running="requests_processing",
    queued="requests_deferred",
    accepted_counter="spec_decode_num_accepted_tokens_total",
    drafts_counter="spec_decode_num_drafts_total",
)
ENGINES: dict[EngineName, Engine] = {e.name: e for e in (SGLANG, VLLM, LLAMACPP)}


def parse_metrics(text: str) -> dict[str, float]:
    """Every sample's value by full name, summed over label sets (tensor/data-parallel ranks,
    vLLM's engine index). Raises ValueError on text that is not the Prometheus format."""
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if not math.isnan(sample.value):
                out[sample.name] = out.get(sample.name, 0.0) + sample.value
    return out


def detect(values: Mapping[str, float]) -> Engine | None:
    """The engine whose metric names these are, or None."""
    for engine in ENGINES.values():
        if engine.owns(values):
            return engine
    return None


def describe_health(status: int, body: bytes) -> str:
    """Why a server's `/health` is not 200, in the operator's words."""
    message = ""
    try:
        obj = orjson.loads(body) if body else None
    except orjson.JSONDecodeError:
        obj = None
    if isinstance(obj, dict):
        err = obj.get("error")
        found = err.get("message") if isinstance(err, dict) else obj.get("message", err)
        if isinstance(found, str):
            message = found[:120]
    return f"/health answered {status}" + (f": {message}" if message else "")


class AcceptanceRate:
    """Mean acceptance length from cumulative counters, over a sliding window of scrapes:
    1 + accepted / drafts counted inside the window. Between bursts of traffic the last value
    stands (as SGLang's gauge does); a counter that went backwards (a restart) starts afresh."""

    def __init__(self, window_s: float) -> None:
        self._window_s = window_s
        self._points: deque[tuple[float, float, float]] = deque()
        self.value: float | None = None

    def update(self, now: float, accepted: float, drafts: float) -> float | None:
        if self._points and (accepted < self._points[-1][1] or drafts < self._points[-1][2]):
            self._points.clear()
            self.value = None
        if not self._points and drafts > 0:
            self.value = 1.0 + accepted / drafts  # the lifetime mean, until the window has traffic
        self._points.append((now, accepted, drafts))
        # Keep one point at or before the window's start, so the window spans it fully.
        while len(self._points) > 2 and self._points[1][0] <= now - self._window_s:
            self._points.popleft()
        first = self._points[0]
        d_drafts = drafts - first[2]
        if d_drafts > 0:
            self.value = 1.0 + (accepted - first[1]) / d_drafts
        return self.value
