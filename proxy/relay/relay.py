"""Relaying one request: route, send upstream, pass the response through (its bytes unchanged, an
event stream in whole events), release.

The relay is a raw ASGI response so that every exit path is in one place: the lease is taken and
released inside `RelayResponse.__call__`, and a watcher on `receive()` cancels the relay the moment
the client disconnects (uvicorn silently drops writes to a gone client, so without the watcher a
relay would read a stalled or long generation to its end). Closing the upstream connection on that
path is what makes the server (SGLang, vLLM, llama-server) abort the generation.

Nothing is sent to the client until the server's first body byte arrives. Until then a failure can
still be retried on the other server or answered with a clean status; after it, a broken stream
ends with an in-stream error event and `data: [DONE]`. (Passing an event stream's head on at once,
as SGLang sends it before the first token, took ~0.1 ms off the time to first token at one stream
here: not worth losing the retry for a server that dies during a long prefill.)
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from starlette.types import Message, Receive, Scope, Send

from ..edge.call import ProxyCall
from ..edge.protocol import ABORT
from ..errors import ApiError
from ..fleet.engines import DONE_GRACE_S
from ..gate import Gate
from ..kinds import CLASSED, GENERATIONS
from ..observability.metrics import code_class
from ..policy.base import Reason, Role, other
from ..routing.affinity import Outcome
from ..routing.leases import Lease
from ..routing.router import Router
from ..transport.upstream import UpstreamError, UpstreamResponse
from .observe import ClassLearning, Generated, Learning, Liveness, StreamObserver, StreamTiming, TokenCounts
from .sse import BodyReader, generated_mark, reader_for
from .sseframe import ends_with_done

log = logging.getLogger("specgate.relay")


class RelayResponse:
    """The ASGI response of one proxied request (a plain class: a Starlette Response would build
    headers of its own on every request, to be thrown away)."""

    __slots__ = ("call", "gate")

    def __init__(self, gate: Gate, call: ProxyCall) -> None:
        self.gate = gate
        self.call = call

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        task = asyncio.current_task()
        assert task is not None
        loop = asyncio.get_running_loop()
        relay = _Relay(self.gate, self.call, send, scope.get("extensions", {}).get(ABORT))
        timeout = self.gate.settings.read_timeout_s

        async def watch() -> None:
            while True:
                message = await receive()
                if message["type"] == "http.disconnect":
                    if not relay.complete:
                        relay.gone = True
                        task.cancel()
                    return

        def check_reader() -> None:
            # Every half timeout: a client that took no bytes for read_timeout_s is dropped like a
            # gone one, so its generation does not hold a GPU slot forever. A timer, not a timeout
            # around receive(): that would cost a task per request.
            since = relay.sending_since
            if since is not None and loop.time() - since >= timeout and not relay.complete:
                log.warning("request %s: client took no data for %.0f s", self.call.request_id, timeout)
                relay.gone = True
                task.cancel()
                return
            timers[0] = loop.call_later(timeout / 2, check_reader)

        timers = [loop.call_later(timeout / 2, check_reader)]
        watcher = loop.create_task(watch())
        try:
            await relay.run()
        except asyncio.CancelledError:
            if not (relay.gone and task.uncancel() == 0):
                raise
            relay.client_gone()
        finally:
            watcher.cancel()
            timers[0].cancel()
            relay.finish()


class _Relay:
    """One request's journey. `finish()` runs exactly once, on every path."""

    def __init__(self, gate: Gate, call: ProxyCall, send: Send, abort: Callable[[], None] | None = None) -> None:
        self.gate = gate
        self.call = call
        self._send = send
        # Cuts the client's connection (the edge's, edge.ABORT); None where the server offers none.
        self._abort = abort
        # The response could not be completed and its connection was cut (counted as the server's 502).
        self._cut = False
        # The client left (or took no bytes for too long): the relay was cancelled for it.
        self.gone = False
        # The server's slot, taken once a server is chosen; a failover moves it to another server.
        self.lease: Lease | None = None
        self.router: Router | None = None
        self.upstream: UpstreamResponse | None = None
        self.status = 0
        # The last bytes are on their way: a disconnect now changes nothing.
        self.complete = False
        # When the send in progress began (None between sends): the watcher's slow-client check.
        self.sending_since: float | None = None
        self._head: Message | None = None
        self._finished = False
        # The server's usage (prompt, completion tokens), once its response ended.
        self._usage: tuple[int, int] | None = None
        # The upstream stream broke after its first bytes: the turn was cut short.
        self._broken = False
        # The class the request counts under (classes.ClassBook.tracked), if it has one.
        self.traffic_class: str | None = None

    @property
    def role(self) -> Role | None:
        """The role of the server the request is on now (None before one is chosen)."""
        return self.lease.role if self.lease is not None else None

    async def run(self) -> None:
        gate = self.gate
        call = self.call
        stored = gate.stored.server_of(call.previous) if call.previous is not None else None
        held = gate.affinity.get(call.affinity) if call.affinity is not None else None
        klass = None
        if call.batch:
            # Batch work never runs on speculation: it neither weighs in the classes' mix of
            # acceptance nor in their ranking, which share speculation's room among interactive ones.
            if call.traffic_class is not None:
                self.traffic_class = gate.classes.named(call.traffic_class)
        elif call.traffic_class is not None:
            now = asyncio.get_running_loop().time()
            self.traffic_class = name = gate.classes.tracked(call.traffic_class, now)
            for gone in gate.classes.take_forgotten():
                gate.metrics.forget_class(gone)
            klass = (gate.classes.gains_most(name, now), gate.classes.accept(name))
        elif gate.classes.stats and call.endpoint in CLASSED:
            gate.classes.unclassed(asyncio.get_running_loop().time())
        placed = gate.fleet.decide(
            can_probe=call.endpoint in GENERATIONS and not call.batch,
            server=stored,
            batch=call.batch,
            held=held,
            klass=klass,
            prompt_tokens=call.prompt_tokens,
            speculation=call.speculation,
        )
        outcome: Outcome | None = None
        if call.affinity is not None and placed.decision.reason != "stored_response":
            outcome = placed.affinity or "miss"
            self._count_affinity(outcome)
        decision, self.router = placed.decision, placed.router
        if call.speculation is not None:
            honoured = decision.reason in ("client_on", "client_off")
            gate.metrics.speculation_switch.inc(call.speculation, call.speculation_source or "", str(honoured).lower())
        if call.trace is not None:
            call.trace.decided(decision, placed.router.group.name, call.previous is not None, stored, outcome)
        if decision.shadow and gate.prober is not None and not gate.prober.start(call, placed.router):
            # No copy was sent (this request cannot be copied, or its client counts fully): the
            # next request may be the probe, as if this one had not been due.
            placed.router.shadow_not_sent()
        if decision.backend is None:
            raise_error = ApiError(
                503, "No healthy backend: every server is down.", "server_error", "no_healthy_backend"
            )
            await self._error(raise_error, decision.reason)
            return
        self.lease = placed.router.admit(decision.backend, placed.server, call.prompt_tokens, call.batch, held)
        gate.metrics.child(gate.metrics.server_requests, self.lease.server).inc()
        reason: Reason = decision.reason
        first = await self._connect(reason)
        if first is None:
            return
        # Its first body byte: streamed, its first output, its prompt prefilled; not streamed, all of it.
        self.lease.prefilled()
        reason = first[1]
        await self._relay(first[0], reason)

    async def _connect(self, reason: Reason) -> tuple[bytes, Reason] | None:
        """Send upstream and wait for the first body byte, retrying once on the other server."""
        gate, call = self.gate, self.call
        trace = call.trace
        for attempt in (0, 1):
            assert self.lease is not None and self.router is not None
            backend, server = self.lease.role, self.lease.server
            headers = call.headers if trace is None else trace.attempt(call.headers, server, backend)
            try:
                self.upstream = await gate.upstream.send(server, call.target, call.body, headers)
                if trace is not None:
                    trace.answered(self.upstream.status)
                first = await self.upstream.read_chunk()
                if trace is not None:
                    trace.first_byte()
                if self.upstream.status < 500:  # a server that fails everything it gets is no proof of life
                    gate.health.note_alive(server)
                return first, reason
            except UpstreamError as err:
                if trace is not None:
                    trace.failed(err.kind, str(err))
                gate.metrics.upstream_errors.labels(backend, err.kind).inc()
                gate.metrics.server_upstream_errors.labels(server, err.kind).inc()
                if err.kind == "connect":
                    gate.health.mark_down(server, str(err))
                self._drop_upstream()
                alt = other(backend)
                up = self.router.loads.healthy_map()
                if attempt == 0 and err.retryable and self.router.can_fail_over(self.lease):
                    log.warning("request %s: %s; retrying on %s", call.request_id, err, alt)
                    self.lease = self.router.failover(self.lease, alt)
                    gate.metrics.child(gate.metrics.server_requests, self.lease.server).inc()
                    reason = "failover"
                    continue
                if err.kind == "connect" and not (up[backend] or up[alt]):
                    api = ApiError(503, f"No healthy backend: {err}", "server_error", "no_healthy_backend")
                elif err.kind == "timeout":
                    api = ApiError(504, f"Upstream timed out: {err}", "server_error", "upstream_timeout")
                else:
                    api = ApiError(502, f"Upstream failed: {err}", "server_error", "upstream_unavailable")
                await self._error(api, reason)
                return None
        return None

    async def _relay(self, first: bytes, reason: Reason) -> None:
        """Pump the body to the client; the subscribers (observe.py) see it pass."""
        gate, call = self.gate, self.call
        up, lease = self.upstream, self.lease
        assert up is not None and lease is not None
        backend = lease.role
        self.status = up.status
        is_sse = up.content_type.startswith("text/event-stream")
        typed = call.endpoint == "responses"
        reader = reader_for(up.content_type, up.status, call.strip_usage, typed)
        headers = up.headers()
        if is_sse:
            # The relayed stream may differ in length: a usage chunk dropped, an error event added.
            headers = [(k, v) for k, v in headers if k != b"content-length"]
        headers += self._own_headers(backend, reason)
        # Sent just before the first body bytes: until then a failure can still be answered cleanly.
        self._head = {"type": "http.response.start", "status": up.status, "headers": headers}
        observers = self._observers(is_sse and reason == "probe", typed, reader)
        loop = asyncio.get_running_loop()
        now = loop.time()
        for o in observers:
            o.first(first, now)
        chunk = first
        out = reader.feed(chunk)
        try:
            # Each piece goes on as it came, except that the last one goes with the body's end, in
            # one write: a client that stops reading at `[DONE]` then finds the response complete
            # and can reuse its connection, and it is not woken twice. `[DONE]` waits a moment for
            # the end of body (engines.DONE_GRACE_S).
            while True:
                if is_sse and ends_with_done(chunk) and not up.ended:
                    await up.wait_end(DONE_GRACE_S)
                if not chunk or up.ended:
                    break
                if out:
                    self.sending_since = now
                    await self._body(out, more=True)
                    self.sending_since = None
                chunk = await up.read_chunk()
                if not chunk:
                    out = b""
                    break
                now = loop.time()
                for o in observers:
                    o.chunk(chunk, now)
                out = reader.feed(chunk)
        except UpstreamError as err:
            gate.metrics.upstream_errors.labels(backend, err.kind).inc()
            if call.trace is not None:
                call.trace.broke(err.kind, str(err))
            # The turn did not end: its server is not where its conversation's next turn should go.
            self._broken = True
            end = reader.broken(f"Upstream stream broke: {err}", "upstream_" + err.kind)
            if end is None:
                log.warning("request %s: body from %s broke: %s; client connection cut", call.request_id, backend, err)
                await self._cut_short(err, reason)
                return
            log.warning("request %s: stream from %s broke: %s", call.request_id, backend, err)
            await self._last(end)
            return
        tail = reader.flush()
        usage = self._usage = reader.usage()
        for o in observers:
            o.end(usage, now)
        if usage is not None and call.previous is None:
            # A continuation's estimate is of its new input alone, its usage of the whole stored
            # conversation: it would teach every estimate the conversation's length.
            gate.token_ratio.learn(call.prompt_estimate, usage[0], call.ratio_client)
        if call.stores and up.status == 200 and (made := reader.response_id()) is not None:
            gate.stored.remember(made, lease.server)
        await self._last(out + tail if tail else out)

    def _observers(self, probe: bool, typed: bool, reader: BodyReader) -> tuple[StreamObserver, ...]:
        """This response's subscribers, each only where it has work."""
        gate, call, up, lease = self.gate, self.call, self.upstream, self.lease
        assert up is not None and lease is not None and self.router is not None
        backend = lease.role
        timed = call.stream and up.status == 200
        out: list[StreamObserver] = []
        if timed:
            out.append(StreamTiming(gate.metrics, backend, call.started, typed))
        if up.status < 500:  # a server that fails everything it gets is no proof of life
            out.append(Liveness(gate.health, lease.server))
        out.append(TokenCounts(gate.metrics, backend))
        cls = self.traffic_class
        if up.status == 200:
            # An adaptive engine drafts less as its batch grows: its streams show a class's
            # acceptance only where no speculative server does (adaptive servers alone).
            drafts = backend is Role.SPECULATIVE or (
                backend is Role.ADAPTIVE and gate.fleet.topology.kind == "adaptive"
            )
            per_event = (self.router.engine_accept_of(lease.server) if drafts else None) or 1.0
            mark = generated_mark(call.endpoint)
            if cls is not None and drafts:
                # A stream of one event a decode step shows its steps; else the body may report them.
                in_stream = call.stream and self.router.learning.counts_steps()
                learn = ClassLearning(
                    lease,
                    mark,
                    per_event,
                    gate.classes,
                    cls,
                    gate.metrics,
                    steps_in_stream=in_stream,
                    reported=reader.steps,
                )
                out.append(learn)
            else:
                out.append(Generated(lease, mark, per_event))
        # A stream's speed is read at its own class's acceptance where that is known.
        accept = gate.classes.accept(cls) if cls is not None and backend == Role.SPECULATIVE else None
        out.append(Learning(self.router, backend, call.client, probe=probe, timed=timed, typed=typed, accept=accept))
        return tuple(out)

    async def _last(self, data: bytes) -> None:
        """The response's last bytes. Everything the request held is released and counted first:
        the client, woken by them, may send its next request at once, and on a small machine it
        runs on this CPU until it does, so work left for after this write delays that request."""
        self.complete = True
        self.finish()
        await self._body(data, more=False)

    async def _cut_short(self, err: UpstreamError, reason: Reason) -> None:
        """A body that broke off and cannot be ended as if complete (a JSON body): nothing sent
        yet gets a clean 502; else the client's connection is cut, so its parser sees the body cut
        short. Without the edge's abort (another ASGI server), returning unended does the same."""
        if self._head is not None:  # not a byte went out: still time for an honest answer
            api = ApiError(502, f"Upstream failed: {err}", "server_error", "upstream_unavailable")
            await self._error(api, reason)
            return
        self.status = 502
        self._cut = True
        self.finish()
        if self._abort is not None:
            self._abort()

    async def _body(self, data: bytes, *, more: bool) -> None:
        body: Message = {"type": "http.response.body", "body": data, "more_body": more}
        head, self._head = self._head, None
        if head is not None:
            await self._send(head)
        await self._send(body)

    def _own_headers(self, backend: Role | None, reason: Reason) -> list[tuple[bytes, bytes]]:
        out = [(b"x-request-id", self.call.request_id.encode("latin-1")), (b"x-specgate-reason", reason.encode())]
        if backend is not None:
            out.append((b"x-specgate-backend", backend.encode()))
        return out

    async def _error(self, err: ApiError, reason: Reason) -> None:
        body = err.body()
        self.status = err.status
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
        backend = self.role if reason != "no_healthy_backend" else None
        self._head = {
            "type": "http.response.start",
            "status": err.status,
            "headers": headers + self._own_headers(backend, reason),
        }
        await self._last(body)

    def _count_affinity(self, outcome: Outcome) -> None:
        m = self.gate.metrics
        if outcome == "hit":
            m.affinity_hits.inc()
        elif outcome == "miss":
            m.affinity_misses.inc()
        else:
            m.child(m.affinity_breaks, outcome.removeprefix("break_")).inc()

    def client_gone(self) -> None:
        if self.role is not None:
            self.gate.metrics.client_disconnects.labels(self.role).inc()
        log.info("request %s: client disconnected", self.call.request_id)

    def _drop_upstream(self) -> None:
        if self.upstream is not None:
            self.upstream.close()
            self.upstream = None

    def finish(self) -> None:
        """Release everything this request held and count the request; the first call does it,
        whatever happened."""
        if self._finished:
            return
        self._finished = True
        if self.upstream is not None:
            if self.complete:
                self.upstream.release()
            else:
                self.upstream.close()  # the server sees the disconnect and aborts the generation
            self.upstream = None
        if self.lease is not None:
            self.lease.release()
            if self.call.affinity is not None and self.complete and self.status == 200 and not self._broken:
                # The turn's prompt and reply are cached where it ran: the next turn's place. The
                # server's usage counts them exactly (a body not streamed passes as one event).
                usage = self._usage
                cached = usage[0] + usage[1] if usage is not None else self.lease.tokens
                self.gate.affinity.remember(self.call.affinity, self.lease.server, cached)
        m = self.gate.metrics
        role = self.role
        status = self.status if self.complete or self._cut else 499
        m.child(m.requests, role or "none", self.call.endpoint, code_class(status)).inc()
        if self.traffic_class is not None:
            # A class forgotten while this request ran has had its series removed: not made again.
            name = self.gate.classes.named(self.traffic_class)
            m.child(m.class_requests, name, role or "none").inc()
        if role is not None:
            loop_time = asyncio.get_running_loop().time()
            m.child(m.duration, role, self.call.endpoint).observe(loop_time - self.call.started)
        if self.call.trace is not None:
            self.call.trace.end(status, gone=self.gone)
