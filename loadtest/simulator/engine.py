"""The simulated SGLang scheduler: admission, prefill, batched decode steps, aborts.

Speed model. With `c` sequences decoding, one decode step lasts

    step_s = A_p * c / T(c)

where T(c) is the profile's throughput and A_p the acceptance length it was measured at (1 on the
baseline role). In that step every sequence i advances by its own acceptance length a_i (1 on the
baseline role; a fractional a_i is carried over from step to step, at least one token a step), so
the server emits T(c) * mean(a_i) / A_p tokens/s: at a fixed number of draft steps a speculative
step costs the same whatever is accepted, and throughput follows the batch's mean acceptance.
With every a_i = A_p that is T(c), each stream advancing at T(c) / c, re-evaluated at every step
as sequences join and leave. Steps are scheduled against absolute deadlines, so timer jitter
shifts single steps but not the long-run rate. A `SharedGpu` serialises the steps of several
engines: while two engines both have work, each step of one waits for the other's.

Time-to-first-token = `ttft_base_s + prompt_tokens / prefill_tok_s`, plus the time spent queued
while `max_running` sequences are already admitted. Prefill does not hold up decode steps.

Gauges follow SGLang: they refresh on each prefill and every 40 decode steps, and keep their
last value when the server goes idle (unless `live_gauges`). `spec_accept_length` is the mean
acceptance of the sequence-steps since the last refresh (tokens a sequence accepted in a step,
bonus token included, before a step is cut short by max_tokens); `avg_accept_length()` (what
/get_server_info reports) is the same mean since start, as SGLang's cumulative one.
"""

from __future__ import annotations

import asyncio
import bisect
import contextlib
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import Enum

# Refresh period of SGLang's decode-side gauges (scheduler `decode_log_interval`).
DECODE_LOG_INTERVAL = 40
# After a CPU hiccup, catch up at most this much lost time in a burst instead of flooding.
MAX_LAG_S = 0.02

TTFT_BUCKETS = (0.05, 0.1, 0.25, 0.5, 0.75, 1.0, 2.0, 4.0, 6.0, 8.0, 10.0, 20.0, 40.0, 60.0, 120.0)
ITL_BUCKETS = (
    0.001,
    0.002,
    0.004,
    0.006,
    0.008,
    0.01,
    0.015,
    0.02,
    0.025,
    0.03,
    0.04,
    0.05,
    0.06,
    0.08,
    0.1,
    0.2,
    0.4,
    0.6,
    0.8,
    1.0,
    2.0,
)
E2E_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.0, 4.0, 8.0, 15.0, 30.0, 60.0, 120.0, 300.0, 600.0)


class SeqState(Enum):
    QUEUED = "queued"
    PREFILL = "prefill"
    RUNNING = "running"
    STALLED = "stalled"
    FINISHED = "finished"
    ABORTED = "aborted"


@dataclass
class Histogram:
    """Cumulative-free bucket counts; cheap enough to observe on every chunk."""

    buckets: tuple[float, ...]
    counts: list[int] = field(default_factory=list)
    total: float = 0.0
    count: int = 0

    def __post_init__(self) -> None:
        self.counts = [0] * (len(self.buckets) + 1)

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += 1
        self.total += value
        self.count += 1


class SharedGpu:
    """One compute budget for several engines: decode steps are booked back to back."""

    def __init__(self) -> None:
        self.free_at = 0.0

    def book(self, earliest: float, duration: float) -> float:
        start = max(earliest, self.free_at)
        self.free_at = start + duration
        return self.free_at


@dataclass(eq=False)
class Sequence:
    """One request inside the engine. The HTTP handler awaits `wait()` for new tokens."""

    rid: str
    prompt_tokens: int
    max_new_tokens: int
    # Tokens this sequence accepts per decode step (bonus included); None: the engine's default.
    accept_length: float | None = None
    # Stop producing (but hold the connection) once this many tokens were emitted; None = never.
    stall_at: int | None = None
    arrived: float = 0.0
    generated: int = 0
    state: SeqState = SeqState.QUEUED
    last_token_at: float = 0.0
    # Token counts of steps not yet taken by the handler: one chunk each.
    pending: list[int] = field(default_factory=list)
    # The fraction of a token accepted but not yet emitted, so a fractional rate averages out.
    accept_carry: float = 0.0
    _waiter: asyncio.Future[None] | None = None
    _timer: asyncio.TimerHandle | None = None

    @property
    def done(self) -> bool:
        return self.state in (SeqState.FINISHED, SeqState.ABORTED)

    @property
    def finished(self) -> bool:
        return self.state is SeqState.FINISHED

    async def wait(self) -> list[int]:
        """Token counts of the steps since the last call; [] once the sequence is done."""
        if not self.pending and not self.done:
            self._waiter = asyncio.get_running_loop().create_future()
            await self._waiter
        out, self.pending = self.pending, []
        return out

    def _wake(self) -> None:
        waiter, self._waiter = self._waiter, None
        if waiter is not None and not waiter.done():
            waiter.set_result(None)


@dataclass
class GaugeSnapshot:
    num_running_reqs: int = 0
    num_queue_reqs: int = 0
    token_usage: float = 0.0
    gen_throughput: float = 0.0
    spec_accept_length: float = 0.0


@dataclass
class EngineStats:
    """Counters and histograms in real seconds, read by the metrics collector at scrape time."""

    prompt_tokens_total: int = 0
    generation_tokens_total: int = 0
    num_requests_total: int = 0
    num_aborted_requests_total: int = 0
    # Decode steps, sequence-steps and the tokens accepted in them, for the measured accept length.
    decode_steps: int = 0
    decode_seq_steps: int = 0
    decode_accepted: int = 0
    ttft: Histogram = field(default_factory=lambda: Histogram(TTFT_BUCKETS))
    itl: Histogram = field(default_factory=lambda: Histogram(ITL_BUCKETS))
    e2e: Histogram = field(default_factory=lambda: Histogram(E2E_BUCKETS))
    queue_time: Histogram = field(default_factory=lambda: Histogram(TTFT_BUCKETS))


class Engine:
    def __init__(
        self,
        *,
        throughput: Callable[[int], float],
        step_accept_length: float,
        accept_length: float,
        max_running: int,
        ttft_base_s: float,
        prefill_tok_s: float,
        kv_capacity_tokens: int,
        speculative: bool,
        gpu: SharedGpu | None = None,
        live_gauges: bool = False,
    ) -> None:
        """`throughput(c)`: total tok/s at `c` sequences when each accepts `step_accept_length` tokens
        a step (the profile's acceptance; 1 without speculation). `accept_length`: what a sequence
        that sets none accepts, and what `avg_accept_length` reports before the first decode step."""
        self._throughput = throughput
        self._step_accept_length = step_accept_length
        self._accept_length = accept_length
        self._max_running = max_running
        self._ttft_base_s = ttft_base_s
        self._prefill_tok_s = prefill_tok_s
        self._kv_capacity = kv_capacity_tokens
        self._speculative = speculative
        self._gpu = gpu
        self._live_gauges = live_gauges
        self._queue: deque[Sequence] = deque()
        self._prefill: set[Sequence] = set()
        self._running: dict[Sequence, None] = {}
        self._stalled: set[Sequence] = set()
        self._wake_loop: asyncio.Future[None] | None = None
        self._task: asyncio.Task[None] | None = None
        self.stats = EngineStats()
        self._reported = GaugeSnapshot()
        self._log_at = 0.0
        self._log_tokens = 0
        self._log_seq_steps = 0
        self._log_accepted = 0

    # ----- lifecycle -----
    def start(self) -> None:
        self._log_at = asyncio.get_running_loop().time()
        self._task = asyncio.get_running_loop().create_task(self._decode_loop(), name="sim-decode")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        for seq in [*self._queue, *self._prefill, *self._running, *self._stalled]:
            self.abort(seq)

    # ----- requests -----
    def submit(self, seq: Sequence) -> None:
        seq.arrived = asyncio.get_running_loop().time()
        seq.state = SeqState.QUEUED
        self._queue.append(seq)
        self._admit()

    def abort(self, seq: Sequence) -> None:
        """The client went away: drop the sequence wherever it is and free its slot."""
        if seq.done:
            return
        if seq.state is SeqState.QUEUED:
            self._queue.remove(seq)
        elif seq.state is SeqState.PREFILL:
            self._prefill.discard(seq)
            if seq._timer is not None:
                seq._timer.cancel()
        elif seq.state is SeqState.RUNNING:
            self._running.pop(seq, None)
        else:
            self._stalled.discard(seq)
        seq.state = SeqState.ABORTED
        self.stats.num_aborted_requests_total += 1
        seq._wake()
        self._admit()

    # ----- load, as /get_load and the gauges report it -----
    @property
    def num_running(self) -> int:
        return len(self._prefill) + len(self._running) + len(self._stalled)

    @property
    def num_queued(self) -> int:
        return len(self._queue)

    @property
    def busy(self) -> bool:
        return bool(self._running)

    def gauges(self) -> GaugeSnapshot:
        if self._live_gauges:
            self._refresh_gauges(asyncio.get_running_loop().time())
        return self._reported

    def avg_accept_length(self) -> float:
        """Mean acceptance since start, as SGLang's /get_server_info reports it."""
        s = self.stats
        return s.decode_accepted / s.decode_seq_steps if s.decode_seq_steps else self._accept_length

    def kv_tokens(self) -> int:
        seqs = [*self._prefill, *self._running, *self._stalled]
        return sum(s.prompt_tokens + s.generated for s in seqs)

    # ----- internals -----
    def _admit(self) -> None:
        loop = asyncio.get_running_loop()
        while self._queue and self.num_running < self._max_running:
            seq = self._queue.popleft()
            now = loop.time()
            self.stats.queue_time.observe(now - seq.arrived)
            seq.state = SeqState.PREFILL
            self._prefill.add(seq)
            delay = self._ttft_base_s + seq.prompt_tokens / self._prefill_tok_s
            seq._timer = loop.call_at(now + delay, self._prefill_done, seq)

    def _prefill_done(self, seq: Sequence) -> None:
        if seq.state is not SeqState.PREFILL:
            return
        now = asyncio.get_running_loop().time()
        self._prefill.discard(seq)
        seq._timer = None
        self.stats.prompt_tokens_total += seq.prompt_tokens
        if seq.stall_at == 0:
            self._stall(seq)
        else:
            # Prefill yields the first token.
            self.stats.ttft.observe(now - seq.arrived)
            self._emit(seq, 1, now)
            if seq.generated >= seq.max_new_tokens:
                self._finish(seq, now)
            elif seq.stall_at == seq.generated:
                self._stall(seq)
            else:
                seq.state = SeqState.RUNNING
                self._running[seq] = None
                waker, self._wake_loop = self._wake_loop, None
                if waker is not None and not waker.done():
                    waker.set_result(None)
        self._refresh_gauges(now)

    def _emit(self, seq: Sequence, n: int, now: float) -> None:
        if seq.generated:
            self.stats.itl.observe((now - seq.last_token_at) / n)
        seq.generated += n
        seq.last_token_at = now
        self.stats.generation_tokens_total += n
        seq.pending.append(n)
        seq._wake()

    def _finish(self, seq: Sequence, now: float) -> None:
        self._running.pop(seq, None)
        seq.state = SeqState.FINISHED
        self.stats.num_requests_total += 1
        self.stats.e2e.observe(now - seq.arrived)
        seq._wake()
        self._admit()

    def _stall(self, seq: Sequence) -> None:
        self._running.pop(seq, None)
        seq.state = SeqState.STALLED
        self._stalled.add(seq)

    async def _decode_loop(self) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time()
        while True:
            if not self._running:
                self._wake_loop = loop.create_future()
                await self._wake_loop
                deadline = loop.time()
                continue
            batch = list(self._running)
            c = len(batch)
            duration = self._step_accept_length * c / self._throughput(c)
            earliest = max(deadline, loop.time() - MAX_LAG_S)
            deadline = self._gpu.book(earliest, duration) if self._gpu else earliest + duration
            # Always yield, even when late, so handlers get to write what the last step produced.
            await asyncio.sleep(max(0.0, deadline - loop.time()))
            now = loop.time()
            accepted = 0
            stepped = 0
            default_accept = self._accept_length
            for seq in batch:
                if seq.state is not SeqState.RUNNING:
                    continue
                # Its own acceptance this step, the fraction carried over; at least one token.
                carry = seq.accept_carry + (default_accept if seq.accept_length is None else seq.accept_length)
                k = max(1, int(carry))
                seq.accept_carry = max(0.0, carry - k)
                n = min(k, seq.max_new_tokens - seq.generated)
                if seq.stall_at is not None:
                    n = min(n, seq.stall_at - seq.generated)
                self._emit(seq, n, now)
                accepted += k
                stepped += 1
                if seq.generated >= seq.max_new_tokens:
                    self._finish(seq, now)
                elif seq.generated == seq.stall_at:
                    self._stall(seq)
            s = self.stats
            s.decode_steps += 1
            s.decode_seq_steps += stepped
            s.decode_accepted += accepted
            if s.decode_steps % DECODE_LOG_INTERVAL == 0:
                self._refresh_gauges(now, decode=True)

    def _refresh_gauges(self, now: float, decode: bool = False) -> None:
        """Prefill refreshes only the load gauges; decode logs also the rate-based ones."""
        prev = self._reported
        gen_throughput, accept = prev.gen_throughput, prev.spec_accept_length
        if decode or self._live_gauges:
            s = self.stats
            elapsed = now - self._log_at
            if elapsed > 0:
                gen_throughput = (s.generation_tokens_total - self._log_tokens) / elapsed
            seq_steps = s.decode_seq_steps - self._log_seq_steps
            if self._speculative and seq_steps:
                accept = (s.decode_accepted - self._log_accepted) / seq_steps
            self._log_at = now
            self._log_tokens = s.generation_tokens_total
            self._log_seq_steps = s.decode_seq_steps
            self._log_accepted = s.decode_accepted
        self._reported = GaugeSnapshot(
            num_running_reqs=self.num_running,
            num_queue_reqs=self.num_queued,
            token_usage=min(1.0, self.kv_tokens() / self._kv_capacity),
            gen_throughput=gen_throughput,
            spec_accept_length=accept,
        )
