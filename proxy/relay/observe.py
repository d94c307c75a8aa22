"""Who watches a relayed response: the relay (relay.py) pumps its bytes and tells each subscriber of
its first body bytes, each later chunk, and its end; what is counted, timed and learnt from a stream
is here, one subscriber a job. Each keeps its own state, so the pump knows none of them.

The pump calls these for every chunk of every stream: a subscriber does a few comparisons and at
most one metric update per call, and is subscribed only to responses it has work on.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from ..policy.base import Role, other
from ..policy.evidence import MIN_STREAM_EVENTS
from .sse import DELTA_MARK, content_events, response_deltas

if TYPE_CHECKING:
    from ..observability.metrics import Metrics
    from ..routing.classes import ClassBook
    from ..routing.leases import Lease
    from ..routing.router import Router
    from ..transport.health import HealthMonitor

# How often a running stream tells the health monitor that its server is answering.
ALIVE_EVERY_S = 1.0
# Streams shorter than this say too little of a server's decode speed to learn from.
MIN_LEARN_TOKENS = 8
# A probe stream longer than this is not counted (its acceptance then comes from the engine).
PROBE_BODY_LIMIT = 1024 * 1024


class StreamObserver:
    """A subscriber to one response body; each event does nothing unless a subscriber says what.
    Times are the event loop's, when the bytes were read from the server."""

    __slots__ = ()

    def first(self, data: bytes, at: float) -> None:
        """The first body bytes arrived (b"": the body is empty)."""

    def chunk(self, data: bytes, at: float) -> None:
        """More body bytes arrived."""

    def end(self, usage: tuple[int, int] | None, last_at: float) -> None:
        """The whole body was relayed (not called when it broke off): its (prompt, completion)
        tokens when the body said, and when its last bytes arrived."""


class StreamTiming(StreamObserver):
    """Time to first token and the gaps between chunks, of a successful stream. A Responses API
    stream (`typed`) opens with `response.created` before its prompt is even read: its first
    token is its first delta event."""

    __slots__ = ("_backend", "_inter_chunk", "_last", "_metrics", "_started", "_waiting")

    def __init__(self, metrics: Metrics, backend: Role, started: float, typed: bool = False) -> None:
        self._metrics = metrics
        self._backend = backend
        self._started = started
        self._inter_chunk = metrics.child(metrics.inter_chunk, backend)
        self._last = 0.0
        self._waiting = typed

    def first(self, data: bytes, at: float) -> None:
        self._last = at
        if data and (not self._waiting or DELTA_MARK in data):
            self._waiting = False
            self._metrics.child(self._metrics.ttft, self._backend).observe(at - self._started)

    def chunk(self, data: bytes, at: float) -> None:
        self._inter_chunk.observe(at - self._last)
        self._last = at
        if self._waiting and DELTA_MARK in data:
            self._waiting = False
            self._metrics.child(self._metrics.ttft, self._backend).observe(at - self._started)


class TokenCounts(StreamObserver):
    """Prompt and output tokens, as the body's usage reported them."""

    __slots__ = ("_backend", "_metrics")

    def __init__(self, metrics: Metrics, backend: Role) -> None:
        self._metrics = metrics
        self._backend = backend

    def end(self, usage: tuple[int, int] | None, last_at: float) -> None:
        if usage is not None:
            self._metrics.child(self._metrics.prompt_tokens, self._backend).inc(usage[0])
            self._metrics.child(self._metrics.output_tokens, self._backend).inc(usage[1])


class Generated(StreamObserver):
    """The tokens a response generated so far, added to its lease as they pass (so its server's
    tokens in flight grow with it): its content events, each `per_event` tokens (one a decode step;
    a speculative server's steps accept its acceptance length)."""

    __slots__ = ("_carry", "_lease", "_mark", "_per_event", "events")

    def __init__(self, lease: Lease, mark: bytes, per_event: float) -> None:
        self._lease = lease
        self._mark = mark
        self._per_event = per_event
        self._carry = 0.0
        # Content events so far (the role chunk's empty content among them).
        self.events = 0

    def first(self, data: bytes, at: float) -> None:
        self.chunk(data, at)

    def chunk(self, data: bytes, at: float) -> None:
        events = data.count(self._mark)
        if events:
            self.events += events
            self._carry += events * self._per_event
            whole = int(self._carry)
            self._carry -= whole
            self._lease.add(whole)


class ClassLearning(Generated):
    """Generated, and a traffic class's acceptance from the same response on a speculative server:
    where the server sends one content event a decode step (`steps_in_stream`), a stream's output
    tokens over its non-empty content events; else what the body reported of its speculation
    (`reported`, engines.reported_steps: llama-server's timings, SGLang's native meta_info). The
    first token, from prefill, is set aside either way, as evidence.stream_accept does. One
    subscriber, so a chunk's content events are counted once for both."""

    __slots__ = ("_book", "_empties", "_metrics", "_name", "_reported", "_steps_in_stream")

    def __init__(
        self,
        lease: Lease,
        mark: bytes,
        per_event: float,
        book: ClassBook,
        name: str,
        metrics: Metrics,
        *,
        steps_in_stream: bool,
        reported: Callable[[], tuple[int, int] | None],
    ) -> None:
        super().__init__(lease, mark, per_event)
        self._book = book
        self._name = name
        self._metrics = metrics
        self._empties = 0
        self._steps_in_stream = steps_in_stream
        self._reported = reported

    def chunk(self, data: bytes, at: float) -> None:
        super().chunk(data, at)
        if self._steps_in_stream:
            self._empties += data.count(self._mark + b'"')

    def end(self, usage: tuple[int, int] | None, last_at: float) -> None:
        if self._steps_in_stream:
            events = self.events - self._empties
            if usage is None or events < MIN_STREAM_EVENTS or usage[1] < events:
                return
            tokens, steps = usage[1], events
        else:
            found = self._reported()
            if found is None or found[1] < MIN_STREAM_EVENTS:
                return
            tokens, steps = found
        self._book.measured(self._name, tokens - 1, steps - 1, last_at)
        accept = self._book.accept(self._name)
        if accept is not None:
            self._metrics.child(self._metrics.class_accept_length, self._name).set(accept)


class Liveness(StreamObserver):
    """A running stream is proof that its server answers: said to the health monitor at most once
    every ALIVE_EVERY_S (only for answers that are no server error)."""

    __slots__ = ("_alive_at", "_health", "_server")

    def __init__(self, health: HealthMonitor, server: str) -> None:
        self._health = health
        self._server = server
        self._alive_at = 0.0

    def first(self, data: bytes, at: float) -> None:
        self._alive_at = at  # the relay said so when the first bytes came

    def chunk(self, data: bytes, at: float) -> None:
        if at - self._alive_at >= ALIVE_EVERY_S:
            self._health.note_alive(self._server)
            self._alive_at = at


class Learning(StreamObserver):
    """What the router learns from a response: its output tokens; a shadow probe's content events,
    read from its own stream (tokens over events, counted at the end: an event may be split between
    reads); and, for the adaptive and model policies, the server's per-stream speed at the load (and
    the tokens of context) the stream ran at, at `accept` where its traffic class's acceptance is known,
    from streams that ran while the other server had
    nothing from this gateway: the curves are of one server alone, and on a shared GPU each slows
    the other (a switch's drain would read as the new server being slow)."""

    __slots__ = (
        "_accept", "_backend", "_body", "_client", "_count", "_first_at", "_learn", "_router", "_size",
        "_start_load", "_start_tokens", "_typed",
    )  # fmt: skip

    def __init__(
        self,
        router: Router,
        backend: Role,
        client: str,
        *,
        probe: bool,
        timed: bool,
        typed: bool = False,
        accept: float | None = None,
    ) -> None:
        self._router = router
        self._accept = accept
        self._typed = typed
        self._backend = backend
        self._client = client
        self._count = probe
        self._body: list[bytes] = []
        self._size = 0
        self._learn = timed and router.adaptive is not None and router.backend_load(other(backend)) == 0
        self._start_load = router.backend_load(backend) if self._learn else 0
        self._start_tokens = router.loads.role_tokens(backend) if self._learn else 0
        self._first_at = 0.0

    def first(self, data: bytes, at: float) -> None:
        self._first_at = at
        if self._count:
            self._body.append(data)
            self._size = len(data)

    def chunk(self, data: bytes, at: float) -> None:
        if self._count:
            self._size += len(data)
            if self._size <= PROBE_BODY_LIMIT:
                self._body.append(data)
            else:
                self._count, self._body = False, []

    def end(self, usage: tuple[int, int] | None, last_at: float) -> None:
        if usage is None:
            return
        router, backend, tokens = self._router, self._backend, usage[1]
        events = None
        if self._count:
            body = b"".join(self._body)
            events = response_deltas(body) if self._typed else content_events(body)
        router.note_output(backend, tokens, events, self._client)
        elapsed = last_at - self._first_at
        if self._learn and tokens >= MIN_LEARN_TOKENS and elapsed > 0 and not router.backend_load(other(backend)):
            load = (self._start_load + router.backend_load(backend)) / 2
            # The context its server held, as the load: the mean of its start and its end.
            held = (self._start_tokens + router.loads.role_tokens(backend)) / 2
            router.observe(backend, load, (tokens - 1) / elapsed, held, self._accept)
