"""The simulator's GPU physics in its scheduler: prompt chunks that decoding waits behind, a KV pool
requests queue for, the prefix cache's hits and evictions, and the adaptive role's draft depths.

Checked in simulated time, against a speed model that records what it was asked to price (or the
step-time table itself), so nothing here depends on the machine's speed.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any

import pytest

from loadtest.simulator.cli import configs_from_args
from loadtest.simulator.engine import DECODE_LOG_INTERVAL, Engine
from loadtest.simulator.radix import PrefixCache, page_keys
from loadtest.simulator.speed import TableSpeed
from loadtest.simulator.state import Sequence, SharedGpu
from loadtest.simulator.steptimes import AdaptiveSteps, load_steptimes
from loadtest.simulator.wire import count_tokens, token_text

STEP_S = 1e-4
PREFILL_S = 1e-3


@dataclass
class FakeSpeed:
    """Chunked prefill with fixed costs; records every iteration it priced."""

    chunked: bool = True
    prefills: list[int] = field(default_factory=list)
    decodes: list[int] = field(default_factory=list)
    iterations: list[tuple[int, int]] = field(default_factory=list)  # (prompt tokens, batch) per iteration
    _pending_prefill: int = 0

    def steps(self, batch: int) -> int:
        return 0

    def observe(self, batch: int, steps: int, accept_length: float) -> None:
        return None

    def decode_s(self, batch: int, ctx: float, steps: int) -> float:
        self.decodes.append(batch)
        return STEP_S

    def prefill_s(self, tokens: int, ctx: float) -> float:
        self.prefills.append(tokens)
        return PREFILL_S

    def accept(self, accept_length: float, steps: int) -> float:
        return accept_length

    def contention(self, batch: int) -> float:
        return 1.0


class RecordingGpu(SharedGpu):
    def __init__(self) -> None:
        super().__init__()
        self.durations: list[float] = []
        # When each booked iteration ends on the GPU's timeline.
        self.ends: list[float] = []

    def book(self, earliest: float, duration: float, owner: object = None, contention: float = 1.0) -> float:
        self.durations.append(duration)
        self.ends.append(super().book(earliest, duration, owner, contention))
        return self.ends[-1]


def engine(speed: object, capacity: int = 10**9, cache: PrefixCache | None = None, **kw: object) -> Engine:
    return Engine(
        speed=speed,  # type: ignore[arg-type]
        accept_length=1.0,
        max_running=kw.pop("max_running", 256),  # type: ignore[arg-type]
        kv_capacity_tokens=capacity,
        speculative=False,
        cache=cache,
        **kw,  # type: ignore[arg-type]
    )


async def until(condition: Callable[[], bool], within_s: float = 20.0) -> None:
    """Poll the engine's state: it changes inside the loop's own callbacks, with no event to await."""
    async with asyncio.timeout(within_s):
        while not condition():  # noqa: ASYNC110
            await asyncio.sleep(0.001)


def run(main: Callable[[], Coroutine[Any, Any, None]]) -> None:
    asyncio.run(main())


def test_a_prompt_is_prefilled_in_chunks_and_decoding_waits_behind_them() -> None:
    speed, gpu = FakeSpeed(), RecordingGpu()

    async def main() -> None:
        e = engine(speed, chunk_tokens=8192, gpu=gpu)
        e.start()
        early = Sequence("early", prompt_tokens=100, max_new_tokens=10**6)
        e.submit(early)
        await until(lambda: early.generated >= 5)
        speed.prefills.clear()
        before = len(gpu.durations)
        long = Sequence("long", prompt_tokens=20_000, max_new_tokens=4)
        e.submit(long)
        await until(lambda: long.generated >= 1)
        # 20,000 tokens in chunks of at most 8192, one chunk an iteration, oldest first.
        assert speed.prefills == [8192, 8192, 3616]
        chunked = gpu.durations[before : before + 3]
        # Each of those iterations also decoded the running request: it waited behind the chunk.
        assert chunked == pytest.approx([PREFILL_S + STEP_S] * 3)
        assert early.generated >= 5 + 3
        # The first token came from the last chunk's iteration, not before. Read on the GPU's own
        # timeline, not the wall clock: a loop that runs late lets the engine catch up (MAX_LAG_S),
        # so three iterations may pass in less wall time than they are booked for.
        assert long.last_token_at >= gpu.ends[before + 2]
        assert gpu.ends[before + 2] - gpu.ends[before] == pytest.approx(2 * (PREFILL_S + STEP_S))
        await until(lambda: long.done)
        assert e.stats.prompt_tokens_total == 20_100
        await e.stop()

    run(main)


def test_several_short_prompts_share_one_chunk() -> None:
    speed = FakeSpeed()

    async def main() -> None:
        e = engine(speed, chunk_tokens=1000)
        e.start()
        seqs = [Sequence(f"s{i}", prompt_tokens=300, max_new_tokens=2) for i in range(5)]
        for seq in seqs:
            e.submit(seq)
        await until(lambda: all(s.done for s in seqs))
        assert speed.prefills == [1000, 500]  # 3 + 1/3 prompts, then the rest
        await e.stop()

    run(main)


def test_requests_wait_in_the_queue_while_the_pool_cannot_hold_them() -> None:
    speed = FakeSpeed()

    async def main() -> None:
        e = engine(speed, capacity=1000)
        e.start()
        first = Sequence("first", prompt_tokens=500, max_new_tokens=400)
        second = Sequence("second", prompt_tokens=200, max_new_tokens=200)
        e.submit(first)
        e.submit(second)
        # 500 + 400 reserved of 1000: the second's 400 do not fit beside it.
        assert (e.num_running, e.num_queued) == (1, 1)
        await until(lambda: second.generated >= 1)
        assert first.finished  # admitted only once the first one's tokens were freed
        assert second.last_token_at > first.last_token_at
        await until(lambda: second.done)
        assert (e.num_running, e.num_queued) == (0, 0)
        assert e.kv_tokens() == 0
        await e.stop()

    run(main)


def test_the_pool_gauges_follow_what_running_requests_hold() -> None:
    async def main() -> None:
        e = engine(FakeSpeed(), capacity=10_000, live_gauges=True)
        e.start()
        held = Sequence("held", prompt_tokens=1000, max_new_tokens=10**3, stall_at=10)
        e.submit(held)
        await until(lambda: held.generated == 10)
        g = e.gauges()
        assert g.num_used_tokens == 1010 and g.token_usage == pytest.approx(0.101)
        e.abort(held)
        assert e.gauges().num_used_tokens == 0
        await e.stop()

    run(main)


def test_a_later_turn_finds_the_earlier_one_cached_and_skips_its_prefill() -> None:
    speed = FakeSpeed()
    cache = PrefixCache(16)

    async def main() -> None:
        e = engine(speed, cache=cache)
        e.start()
        system = b"You are a helpful assistant. " * 40  # 1,160 bytes: 290 tokens, 18 full pages
        turn1 = system + b"<|user|>first question<|assistant|>"
        first = Sequence("t1", prompt_tokens=len(turn1) // 4, max_new_tokens=64, cache_data=turn1)
        e.submit(first)
        await until(lambda: first.done)
        assert first.cached_tokens == 0
        # The next turn resends the conversation: the earlier prompt, its reply, a new message.
        turn2 = turn1 + token_text(0, 64).encode() + b"<|user|>and a second one<|assistant|>"
        second = Sequence("t2", prompt_tokens=len(turn2) // 4, max_new_tokens=8, cache_data=turn2)
        speed.prefills.clear()
        e.submit(second)
        await until(lambda: second.done)
        reply_end = len(turn1) + len(token_text(0, 64).encode())
        assert second.cached_tokens == (reply_end // 64) * 16  # every full page up to the reply's end
        assert speed.prefills == [second.prompt_tokens - second.cached_tokens]
        # A conversation sharing only the system prompt: a partial hit.
        other = system + b"<|user|>something else entirely<|assistant|>"
        third = Sequence("t3", prompt_tokens=len(other) // 4, max_new_tokens=2, cache_data=other)
        e.submit(third)
        await until(lambda: third.done)
        assert third.cached_tokens == (len(system) // 64) * 16
        assert e.stats.cached_tokens_total == second.cached_tokens + third.cached_tokens
        assert cache.locked_tokens == 0
        await e.stop()

    run(main)


def test_cached_pages_are_evicted_to_admit_a_request_and_never_while_in_use() -> None:
    cache = PrefixCache(16)

    async def main() -> None:
        e = engine(FakeSpeed(), capacity=2000, cache=cache)
        e.start()
        old = b"x" * 4000  # 1000 tokens
        first = Sequence("old", prompt_tokens=1000, max_new_tokens=16, cache_data=old)
        e.submit(first)
        await until(lambda: first.done)
        assert cache.size_tokens >= 992
        # Needs 1500 + 16: only room once the old pages go.
        new = Sequence("new", prompt_tokens=1500, max_new_tokens=16, cache_data=b"y" * 6000)
        e.submit(new)
        assert e.num_queued == 0
        assert cache.match(page_keys(old, 16)) < 62
        await until(lambda: new.done)
        assert cache.size_tokens + e.kv_tokens() <= 2000
        await e.stop()

    run(main)


H200 = load_steptimes("h200-llama8b")


def test_the_adaptive_role_drafts_at_low_batch_and_stops_at_64() -> None:
    async def main(batch: int) -> dict[int, int]:
        speed = TableSpeed(H200, "adaptive", 3, time_scale=1000.0, adaptive=AdaptiveSteps())
        e = Engine(speed=speed, accept_length=2.5, max_running=batch, kv_capacity_tokens=10**9, speculative=True)
        e.start()
        seqs = [Sequence(f"s{i}", prompt_tokens=100, max_new_tokens=10**6) for i in range(batch)]
        for seq in seqs:
            e.submit(seq)
        await until(lambda: e.stats.decode_steps >= 200)
        await e.stop()
        return e.stats.draft_steps

    low = asyncio.run(main(4))
    assert 0 not in low and set(low) <= {1, 3, 5, 7}
    high = asyncio.run(main(70))
    assert set(high) == {0}


def test_a_table_step_costs_what_the_table_gives() -> None:
    """The engine's step at a fixed batch and context is the table's arithmetic, per role."""
    gpu = RecordingGpu()

    async def main() -> None:
        speed = TableSpeed(H200, "speculative", 3, time_scale=1.0)
        e = Engine(speed=speed, accept_length=1.0, max_running=8, kv_capacity_tokens=10**9, speculative=True, gpu=gpu)
        e.start()
        # Prompts of 1023 tokens, one token a step (acceptance 1): the batch's context is 1024 at the first step.
        seqs = [Sequence(f"s{i}", prompt_tokens=1023, max_new_tokens=10**6) for i in range(8)]
        for seq in seqs:
            e.submit(seq)
        await until(lambda: e.stats.decode_steps >= 1)
        await e.stop()

    asyncio.run(main())
    decode_only = gpu.durations[1:2]
    expected = 3 * H200.draft_s(8, 1, 1024) + H200.target_s(8, 4, 1024) + H200.draft_s(8, 4, 1024)
    assert decode_only == [pytest.approx(expected, rel=1e-6)]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--role", "adaptive", "--profile", "crossover"], "needs a step-time profile"),
        (["--role", "speculative", "--profile", "h200-llama8b", "--accept-length", "5"], "more than 3 draft steps"),
        (["--role", "speculative", "--profile", "h200-llama8b", "--spec-steps", "8"], "1-7"),
        (["pair", "--profile", "h200-llama8b", "--shared-gpu", "--gpu-memory-gb", "40"], "no memory"),
    ],
)
def test_flags_the_physics_cannot_honour_are_refused(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exc:
        configs_from_args(argv)
    assert exc.value.code == 2 and message in capsys.readouterr().err


def test_the_pair_on_one_gpu_splits_its_memory_and_the_adaptive_server_has_it_all() -> None:
    (spec, base), shared = configs_from_args(["pair", "--profile", "h200-llama8b", "--shared-gpu"])
    assert shared and spec.shared_gpu and base.shared_gpu
    (adaptive,), _ = configs_from_args(["--role", "adaptive", "--profile", "h200-llama8b"])
    (alone,), _ = configs_from_args(["--role", "baseline", "--profile", "h200-llama8b"])
    assert spec.kv_capacity_tokens + base.kv_capacity_tokens < 0.75 * adaptive.kv_capacity_tokens
    assert alone.kv_capacity_tokens > adaptive.kv_capacity_tokens  # no draft weights, no draft KV
    (fixed,), _ = configs_from_args(["--role", "baseline", "--profile", "h200-llama8b", "--max-total-tokens", "5000"])
    assert fixed.kv_capacity_tokens == 5000
    assert spec.default_accept_length == 2.5 and spec.max_accept == 4.0


def test_a_reply_resent_in_the_next_turn_counts_the_tokens_it_had() -> None:
    for n in (1, 33, 128, 1000):
        assert count_tokens(token_text(7, n)) == n


def test_the_hit_rate_gauge_is_the_last_prefills_and_a_decode_log_zeroes_it() -> None:
    # SGLang's gauge: set by each prefill batch, 0 at each decode log (every DECODE_LOG_INTERVAL steps).
    cache = PrefixCache(16)

    async def main() -> None:
        e = engine(FakeSpeed(), cache=cache)
        e.start()
        text = b"You are a helpful assistant. " * 40

        def ask(name: str, max_new_tokens: int) -> Sequence:
            return Sequence(name, prompt_tokens=len(text) // 4, max_new_tokens=max_new_tokens, cache_data=text)

        first = ask("first", 2)
        e.submit(first)
        await until(lambda: first.done)
        assert e.gauges().cache_hit_rate == 0.0
        again = ask("again", 2)
        e.submit(again)
        await until(lambda: again.done)
        assert again.cached_tokens > 0
        assert e.gauges().cache_hit_rate == pytest.approx(again.cached_tokens / again.prompt_tokens)
        # A hit again at its prefill, then a decode log before it ends.
        long = ask("long", DECODE_LOG_INTERVAL + 1)
        e.submit(long)
        await until(lambda: long.generated >= 1)
        assert e.gauges().cache_hit_rate > 0
        await until(lambda: long.done)
        assert e.gauges().cache_hit_rate == 0.0
        await e.stop()

    run(main)
