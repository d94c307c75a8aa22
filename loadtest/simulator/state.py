"""What the simulated scheduler keeps: a request's sequence and its states, the gauges and counters
the metrics collector reads, their histograms, and the compute budget engines on one GPU share
(engine.py schedules them)."""

from __future__ import annotations

import asyncio
import bisect
from dataclasses import dataclass, field
from enum import Enum

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
    """One compute budget for several engines: their steps are booked back to back, and a step
    that had to wait for another engine's pays the measured cost of switching between them."""

    def __init__(self) -> None:
        self.free_at = 0.0
        self._last: object = None

    def book(self, earliest: float, duration: float, owner: object = None, contention: float = 1.0) -> float:
        if self.free_at > earliest and owner is not self._last:
            duration /= contention
        start = max(earliest, self.free_at)
        self.free_at = start + duration
        self._last = owner
        return self.free_at


# What a prompt is keyed by in the prefix cache: its text's bytes (as rendered) or its token ids.
CacheData = bytes | tuple[int, ...]


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
    # The prompt as the prefix cache keys it; None: never cached, never looked up.
    cache_data: CacheData | None = None
    arrived: float = 0.0
    generated: int = 0
    # Decode steps that made its tokens, the prefill's first one not among them (SGLang's
    # spec_verify_ct on a speculative server).
    verify_steps: int = 0
    state: SeqState = SeqState.QUEUED
    last_token_at: float = 0.0
    # Token counts of steps not yet taken by the handler: one chunk each.
    pending: list[int] = field(default_factory=list)
    # The fraction of a token accepted but not yet emitted, so a fractional rate averages out.
    accept_carry: float = 0.0
    # Prompt tokens found in the prefix cache at admission, and prefilled so far of the rest.
    cached_tokens: int = 0
    prefilled: int = 0
    # KV tokens reserved for it at admission and not yet handed to the cache or released.
    reserved: int = 0
    # Cache pages it holds (locked against eviction) while admitted.
    locked: list[int] = field(default_factory=list)
    _keys: list[int] | None = None
    _waiter: asyncio.Future[None] | None = None
    _timer: asyncio.TimerHandle | None = None

    @property
    def done(self) -> bool:
        return self.state in (SeqState.FINISHED, SeqState.ABORTED)

    @property
    def finished(self) -> bool:
        return self.state is SeqState.FINISHED

    @property
    def uncached(self) -> int:
        return self.prompt_tokens - self.cached_tokens

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
    num_used_tokens: int = 0
    gen_throughput: float = 0.0
    spec_accept_length: float = 0.0
    cache_hit_rate: float = 0.0


@dataclass
class EngineStats:
    """Counters and histograms in real seconds, read by the metrics collector at scrape time."""

    prompt_tokens_total: int = 0
    cached_tokens_total: int = 0
    # Tokens decode steps made, bonus token included (SGLang's realtime_tokens_total{mode="decode"}).
    decode_tokens_total: int = 0
    generation_tokens_total: int = 0
    num_requests_total: int = 0
    num_aborted_requests_total: int = 0
    # Decode steps, sequence-steps and the tokens accepted in them, for the measured accept length.
    decode_steps: int = 0
    decode_seq_steps: int = 0
    decode_accepted: int = 0
    # Prompt chunks run in the step loop, and the draft steps of each iteration that decoded.
    prefill_chunks: int = 0
    draft_steps: dict[int, int] = field(default_factory=dict)
    ttft: Histogram = field(default_factory=lambda: Histogram(TTFT_BUCKETS))
    itl: Histogram = field(default_factory=lambda: Histogram(ITL_BUCKETS))
    e2e: Histogram = field(default_factory=lambda: Histogram(E2E_BUCKETS))
    queue_time: Histogram = field(default_factory=lambda: Histogram(TTFT_BUCKETS))
