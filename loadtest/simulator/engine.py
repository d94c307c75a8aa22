"""The simulated SGLang scheduler: admission against the KV pool, prefill, batched decode steps, aborts.

Speed (`speed.py`). With the CSV profiles, with `c` sequences decoding one decode step lasts

    step_s = A_p * c / T(c)

where T(c) is the profile's throughput and A_p the acceptance length it was measured at (1 on the
baseline role), and a prompt's prefill is a timer of `ttft_base_s + uncached_tokens / prefill_tok_s`
beside decoding. With a step-time table (the H200 profiles), an iteration costs what the table
gives for the running batch at its mean context and draft depth, plus, when prompts wait, one chunk
of at most `chunk_tokens` uncached prompt tokens (SGLang's chunked prefill): decode steps wait
behind the chunk, so time to first token grows with load and prompt length.

In a step every sequence i advances by its own acceptance length a_i (1 on the baseline role; at
the iteration's draft depth, see `Speed.accept`; a fractional a_i is carried over from step to
step, at least one token a step): at a fixed number of draft steps a speculative step costs the
same whatever is accepted, and throughput follows the batch's mean acceptance. Steps are scheduled
against absolute deadlines, so timer jitter shifts single steps but not the long-run rate. A
`SharedGpu` serialises the steps of several engines: while two engines both have work, each step of
one waits for the other's, and pays the measured cost of switching between them.

KV pool (`kv_capacity_tokens`, SGLang's max_total_num_tokens): a request is admitted only when its
uncached prompt plus its max_new_tokens fit beside what admitted requests reserved and what the
prefix cache holds, after evicting unused cached pages; until then it waits in the queue, first
come first served. The prefix cache (`radix.py`) holds prompts once prefilled and whole sequences
once finished; a request's longest cached prefix skips prefill (at least one token is computed).

Gauges follow SGLang: they refresh on each prefill and every 40 decode steps, and keep their
last value when the server goes idle (unless `live_gauges`). `spec_accept_length` is the mean
acceptance of the sequence-steps since the last refresh (tokens a sequence accepted in a step,
bonus token included, before a step is cut short by max_tokens); `avg_accept_length()` (what
/get_server_info reports) is the same mean since start, as SGLang's cumulative one.
`cache_hit_rate` is the share of prompt tokens found cached among those prefilled since the last
refresh, and a decode refresh sets it to 0, as SGLang's decode log does (its decode stats carry no
prefill); with `live_gauges`, the share since the last refresh that prefilled any.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque

from .radix import PrefixCache, page_keys
from .speed import Speed
from .state import EngineStats, GaugeSnapshot, SeqState, Sequence, SharedGpu
from .wire import token_text

# Refresh period of SGLang's decode-side gauges (scheduler `decode_log_interval`).
DECODE_LOG_INTERVAL = 40
# After a CPU hiccup, catch up at most this much lost time in a burst instead of flooding.
MAX_LAG_S = 0.02


class Engine:
    def __init__(
        self,
        *,
        speed: Speed,
        accept_length: float,
        max_running: int,
        kv_capacity_tokens: int,
        speculative: bool,
        cache: PrefixCache | None = None,
        chunk_tokens: int = 8192,
        gpu: SharedGpu | None = None,
        live_gauges: bool = False,
    ) -> None:
        """`accept_length`: what a sequence that sets none accepts (at the server's draft depth), and
        what `avg_accept_length` reports before the first decode step."""
        self._speed = speed
        self._accept_length = accept_length
        self._max_running = max_running
        self.kv_capacity = kv_capacity_tokens
        self._speculative = speculative
        self.cache = cache
        self._chunk_tokens = chunk_tokens
        self._gpu = gpu
        self._live_gauges = live_gauges
        self._queue: deque[Sequence] = deque()
        # Admitted, their prompts not all prefilled; in admission order (chunks are taken in it).
        self._prefill: dict[Sequence, None] = {}
        self._running: dict[Sequence, None] = {}
        self._stalled: set[Sequence] = set()
        self._reserved = 0
        self._wake_loop: asyncio.Future[None] | None = None
        self._task: asyncio.Task[None] | None = None
        self.stats = EngineStats()
        self._reported = GaugeSnapshot()
        self._log_at = 0.0
        self._log_tokens = 0
        self._log_seq_steps = 0
        self._log_accepted = 0
        self._log_prompt = 0
        self._log_cached = 0

    # ----- lifecycle -----
    def start(self) -> None:
        self._log_at = asyncio.get_running_loop().time()
        self._task = asyncio.get_running_loop().create_task(self._step_loop(), name="sim-steps")

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
        if self.cache is not None and seq.cache_data is not None:
            seq._keys = page_keys(seq.cache_data, self.cache.page_tokens)
        self._queue.append(seq)
        self._admit()

    def abort(self, seq: Sequence) -> None:
        """The client went away: drop the sequence wherever it is and free its slot."""
        if seq.done:
            return
        if seq.state is SeqState.QUEUED:
            self._queue.remove(seq)
        elif seq.state is SeqState.PREFILL:
            self._prefill.pop(seq, None)
            if seq._timer is not None:
                seq._timer.cancel()
        elif seq.state is SeqState.RUNNING:
            self._running.pop(seq, None)
        else:
            self._stalled.discard(seq)
        self._release(seq)
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
        """KV tokens the admitted requests hold: their prompts (cached pages counted once) and output."""
        seqs = [*self._prefill, *self._running, *self._stalled]
        own = sum(s.uncached + s.generated for s in seqs)
        if self.cache is None:
            return own
        # A prompt handed to the cache after its prefill is counted among the locked pages.
        handed = sum(s.uncached for s in seqs if s.state is not SeqState.PREFILL and s.locked)
        return own - handed + self.cache.locked_tokens

    # ----- internals -----
    def _free(self) -> int:
        return self.kv_capacity - self._reserved - (self.cache.size_tokens if self.cache is not None else 0)

    def _admit(self) -> None:
        loop = asyncio.get_running_loop()
        while self._queue and self.num_running < self._max_running:
            seq = self._queue[0]
            if not self._reserve(seq):
                break  # first come, first served: the head waits for room, and so do the rest
            self._queue.popleft()
            now = loop.time()
            self.stats.queue_time.observe(now - seq.arrived)
            seq.state = SeqState.PREFILL
            self._prefill[seq] = None
            if self._speed.chunked:
                self._wake()
            else:
                delay = self._speed.prefill_s(seq.uncached, seq.cached_tokens)
                seq._timer = loop.call_at(now + delay, self._prefill_done, seq)

    def _reserve(self, seq: Sequence) -> bool:
        """Find the prompt's cached prefix and room for the rest plus max_new_tokens, or change nothing."""
        cache, keys = self.cache, seq._keys
        found: list[int] = []
        cached = 0
        if cache is not None and keys:
            found = keys[: cache.match(keys)]
            cache.acquire(found)  # before evicting: the prefix found must stay
            # At least the last prompt token is computed: it yields the first output token.
            cached = min(len(found) * cache.page_tokens, seq.prompt_tokens - 1)
        need = seq.prompt_tokens - cached + seq.max_new_tokens
        if need > self._free() and cache is not None:
            cache.evict(need - self._free())
        if need > self._free():
            if cache is not None:
                cache.release(found)
            return False
        seq.cached_tokens = cached
        seq.locked = found
        seq.reserved = need
        self._reserved += need
        return True

    def _release(self, seq: Sequence) -> None:
        self._reserved -= seq.reserved
        seq.reserved = 0
        if self.cache is not None and seq.locked:
            self.cache.release(seq.locked)
        seq.locked = []

    def _cache_prompt(self, seq: Sequence) -> None:
        """Its prompt prefilled, the sequence's pages join the cache (as SGLang caches an unfinished
        request), so a request arriving now with the same prefix finds them."""
        cache, keys = self.cache, seq._keys
        if cache is None or not keys:
            return
        added = cache.insert(keys)
        cache.acquire(keys[len(seq.locked) :])
        seq.locked = list(keys)
        # The pages just added were reserved for this sequence: now the cache counts them.
        moved = min(added, seq.reserved)
        seq.reserved -= moved
        self._reserved -= moved

    def _cache_finished(self, seq: Sequence) -> None:
        """A finished sequence's prompt and output stay cached for the next turn of its conversation."""
        cache, data = self.cache, seq.cache_data
        self._release(seq)
        if cache is None or not isinstance(data, bytes):
            return  # token ids: the prompt's pages were cached after its prefill; the output has no ids
        cache.insert(page_keys(data + token_text(0, seq.generated).encode(), cache.page_tokens))
        # What was just released covers the output's pages but for the page the prompt's tail shares
        # with it: make room for that one from the least recently used (these pages included).
        if self._free() < 0:
            cache.evict(-self._free())

    def _wake(self) -> None:
        waker, self._wake_loop = self._wake_loop, None
        if waker is not None and not waker.done():
            waker.set_result(None)

    def _prefill_done(self, seq: Sequence) -> None:
        if seq.state is not SeqState.PREFILL:
            return
        now = asyncio.get_running_loop().time()
        self._prefill.pop(seq, None)
        seq._timer = None
        self.stats.prompt_tokens_total += seq.prompt_tokens
        self.stats.cached_tokens_total += seq.cached_tokens
        self._cache_prompt(seq)
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
                self._wake()
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
        self._cache_finished(seq)
        seq._wake()
        self._admit()

    def _stall(self, seq: Sequence) -> None:
        self._running.pop(seq, None)
        seq.state = SeqState.STALLED
        self._stalled.add(seq)

    def _take_chunk(self) -> tuple[list[tuple[Sequence, int]], float]:
        """The next prompt chunk: up to `chunk_tokens` uncached prompt tokens, oldest admission first,
        and the mean context its tokens attend to (weighted by tokens)."""
        budget = self._chunk_tokens
        chunk: list[tuple[Sequence, int]] = []
        weighted = 0.0
        for seq in self._prefill:
            if budget <= 0:
                break
            n = min(seq.uncached - seq.prefilled, budget)
            if n <= 0:
                continue
            chunk.append((seq, n))
            weighted += n * (seq.cached_tokens + seq.prefilled + n)
            budget -= n
        taken = self._chunk_tokens - budget
        return chunk, weighted / taken if taken else 0.0

    async def _step_loop(self) -> None:
        loop = asyncio.get_running_loop()
        speed = self._speed
        deadline = loop.time()
        while True:
            chunk, chunk_ctx = self._take_chunk() if speed.chunked and self._prefill else ([], 0.0)
            if not self._running and not chunk:
                self._wake_loop = loop.create_future()
                await self._wake_loop
                deadline = loop.time()
                continue
            batch = list(self._running)
            c = len(batch)
            steps = speed.steps(c) if c else 0
            duration = 0.0
            if chunk:
                duration += speed.prefill_s(sum(n for _, n in chunk), chunk_ctx)
            if c:
                ctx = sum(seq.prompt_tokens + seq.generated for seq in batch) / c
                duration += speed.decode_s(c, ctx, steps)
            earliest = max(deadline, loop.time() - MAX_LAG_S)
            if self._gpu is not None:
                deadline = self._gpu.book(earliest, duration, self, speed.contention(c or 1))
            else:
                deadline = earliest + duration
            # Always yield, even when late, so handlers get to write what the last step produced.
            await asyncio.sleep(max(0.0, deadline - loop.time()))
            now = loop.time()
            if c:
                self._decoded(batch, steps, now)
            for seq, n in chunk:
                if seq.state is SeqState.PREFILL:
                    seq.prefilled += n
                    if seq.prefilled >= seq.uncached:
                        self._prefill_done(seq)
            if chunk:
                self.stats.prefill_chunks += 1

    def _decoded(self, batch: list[Sequence], steps: int, now: float) -> None:
        accepted = 0
        stepped = 0
        default_accept = self._accept_length
        accept = self._speed.accept
        for seq in batch:
            if seq.state is not SeqState.RUNNING:
                continue
            # Its own acceptance this step, the fraction carried over; at least one token.
            own = default_accept if seq.accept_length is None else seq.accept_length
            carry = seq.accept_carry + accept(own, steps)
            k = max(1, int(carry))
            seq.accept_carry = max(0.0, carry - k)
            n = min(k, seq.max_new_tokens - seq.generated)
            if seq.stall_at is not None:
                n = min(n, seq.stall_at - seq.generated)
            seq.verify_steps += 1
            self._emit(seq, n, now)
            accepted += k
            stepped += 1
            if seq.generated >= seq.max_new_tokens:
                self._finish(seq, now)
            elif seq.generated == seq.stall_at:
                self._stall(seq)
        s = self.stats
        s.decode_tokens_total += accepted
        s.decode_steps += 1
        s.decode_seq_steps += stepped
        s.decode_accepted += accepted
        s.draft_steps[steps] = s.draft_steps.get(steps, 0) + 1
        if stepped:
            self._speed.observe(len(batch), steps, accepted / stepped)
        if s.decode_steps % DECODE_LOG_INTERVAL == 0:
            self._refresh_gauges(now, decode=True)

    def _refresh_gauges(self, now: float, decode: bool = False) -> None:
        """Prefill refreshes only the load gauges; decode logs also the rate-based ones."""
        prev = self._reported
        gen_throughput, accept = prev.gen_throughput, prev.spec_accept_length
        s = self.stats
        if decode or self._live_gauges:
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
        hit_rate = prev.cache_hit_rate
        prompt = s.prompt_tokens_total - self._log_prompt
        if decode and not self._live_gauges:
            hit_rate = 0.0
        elif prompt:
            hit_rate = (s.cached_tokens_total - self._log_cached) / prompt
        self._log_prompt = s.prompt_tokens_total
        self._log_cached = s.cached_tokens_total
        used = self.kv_tokens()
        self._reported = GaugeSnapshot(
            num_running_reqs=self.num_running,
            num_queue_reqs=self.num_queued,
            token_usage=min(1.0, used / self.kv_capacity),
            num_used_tokens=used,
            gen_throughput=gen_throughput,
            spec_accept_length=accept,
            cache_hit_rate=hit_rate,
        )
