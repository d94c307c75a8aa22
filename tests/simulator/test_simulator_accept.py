"""The simulator's acceptance model: repetitiveness of prompts, per-request acceptance, throughput
that follows the batch's mean acceptance, and a gauge that reports the live mean.

Speeds are checked in simulated time (the durations the engine books for its steps), not on the
wall clock, so the checks hold on a loaded machine.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import re
import statistics
from collections.abc import Iterator

import httpx
import pytest

from loadtest.prompts import REPETITION_NGRAM, Prompt, diverse, repetitive, repetitiveness, source
from loadtest.simulator.cli import configs_from_args
from loadtest.simulator.engine import DECODE_LOG_INTERVAL, Engine
from loadtest.simulator.profile import ROLES, ProfileError, load_profile, parse_profile
from loadtest.simulator.server import ServerConfig
from loadtest.simulator.state import Sequence, SharedGpu
from loadtest.simulator.wire import count_tokens, parse_request

from ..conftest import StartSim
from ..helpers import scrape, sse_json

CSV = "concurrency,speculative_tok_s,baseline_tok_s\n1,100,50\n10,500,400\n"


def first(prompts: Iterator[Prompt], n: int) -> list[Prompt]:
    return list(itertools.islice(prompts, n))


# ----- repetitiveness -----


@pytest.mark.parametrize(
    ("text", "r"),
    [
        ("", 0.0),
        ("one two three", 0.0),  # fewer n-grams than it takes to repeat one
        ("the cat sat on the mat", 0.0),
        # 8 words, 5 four-grams, the last one seen before.
        ("a b c d a b c d", 0.2),
        ("A B C D a b c d", 0.2),  # case does not matter
        ("w " * 23, 0.95),  # 20 four-grams, all the same
    ],
)
def test_repetitiveness_on_known_inputs(text: str, r: float) -> None:
    assert REPETITION_NGRAM == 4
    assert repetitiveness(text) == pytest.approx(r)


def test_repetitiveness_of_a_text_quoted_k_times_is_about_k_minus_one_over_k() -> None:
    block = "def f(x):\n    # add one to the value, then double it\n    y = x + 1\n    return 2 * y\n"
    assert repetitiveness(block) == 0.0
    for k in (2, 4, 10):
        # Less a little: the n-grams across the first boundary are new.
        assert repetitiveness(block * k) == pytest.approx((k - 1) / k, abs=0.05)
    # Punctuation counts: the same words with different operators are different code.
    assert repetitiveness("x = a + b ; y = a - b ; z = a * b ;") == 0.0


def test_repetitiveness_reads_a_bounded_prefix_of_huge_texts() -> None:
    assert repetitiveness("spam eggs " * 1_000_000) == pytest.approx(1.0, abs=1e-3)


# ----- prompt sources -----


@pytest.mark.parametrize(("name", "long"), [("diverse", True), ("short", False)])
def test_diverse_prompts_score_low(name: str, long: bool) -> None:
    prompts = first(source(name, seed=3), 200)
    assert prompts == first(diverse(3, long=long), 200)
    assert statistics.mean(repetitiveness(p.text) for p in prompts) <= 0.2


def test_repetitive_prompts_score_high_and_are_seeded() -> None:
    prompts = first(source("repetitive", seed=3), 200)
    assert prompts == first(repetitive(3), 200)
    assert prompts != first(repetitive(4), 200)
    assert len({p.text for p in prompts}) > 150
    assert statistics.mean(repetitiveness(p.text) for p in prompts) >= 0.8
    assert all(p.messages == ({"role": "user", "content": p.text},) for p in prompts)


def test_diverse_padding_is_varied_and_keeps_the_length_spread() -> None:
    prompts = first(diverse(0), 500)
    assert first(diverse(0), 500) == prompts
    for p in prompts:
        sentences = re.findall(r"[^.?!]+[.?!]", p.text)
        assert len(sentences) == len(set(sentences)), p.text
    tokens = [count_tokens(p.text) for p in prompts]
    assert min(tokens) < 25 and max(tokens) > 1000
    assert 250 < statistics.mean(tokens) < 450


# ----- profile and flags -----


def test_profile_max_accept_length() -> None:
    p = parse_profile(CSV, "t")
    assert (p.accept_length, p.max_accept_length) == (None, None)
    assert (p.speculative_accept_length, p.speculative_max_accept_length) == (3.0, 4.0)
    p = parse_profile("# accept_length: 2.5\n# max_accept_length: 6\n" + CSV, "t")
    assert (p.speculative_accept_length, p.speculative_max_accept_length) == (2.5, 6.0)
    assert parse_profile("# accept_length: 2\n" + CSV, "t").speculative_max_accept_length == 3.0
    with pytest.raises(ProfileError, match="max_accept_length"):
        parse_profile("# max_accept_length: 0.5\n" + CSV, "t")
    for name in ("crossover", "seed-parallel"):
        assert load_profile(name).speculative_max_accept_length == 4.0


def test_accept_flags() -> None:
    (cfg,), _ = configs_from_args(["--role", "speculative", "--profile", "crossover"])
    assert not cfg.accept_from_prompt
    assert (cfg.step_accept_length, cfg.default_accept_length, cfg.max_accept) == (3.0, 3.0, 4.0)
    assert cfg.accept_for("anything at all, repeated: anything at all, repeated") is None
    (cfg,), _ = configs_from_args(["--role", "speculative", "--accept-length", "1.5"])
    assert (cfg.step_accept_length, cfg.default_accept_length) == (3.0, 1.5)
    spec, base = configs_from_args(["pair", "--accept-from-prompt", "--max-accept-length", "5"])[0]
    assert spec.accept_from_prompt and base.accept_from_prompt and spec.max_accept == 5.0
    assert spec.accept_for("varied words make a prompt nobody drafts well") == 1.0
    assert spec.accept_for("a b c d " * 50) == pytest.approx(1 + 4 * repetitiveness("a b c d " * 50))
    assert base.accept_for("a b c d " * 50) is None  # the baseline does not speculate
    assert (base.step_accept_length, base.default_accept_length) == (1.0, 1.0)


@pytest.mark.parametrize(
    "argv",
    [
        ["--accept-length", "2", "--accept-from-prompt"],
        ["--accept-length", "0.5"],
        ["--max-accept-length", "0"],
        ["--max-accept-length", "inf"],
    ],
)
def test_bad_accept_flags_exit_2(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        configs_from_args(["--role", "speculative", *argv])
    assert exc.value.code == 2
    assert "accept" in capsys.readouterr().err


def test_prompt_text_of_each_request_kind() -> None:
    def text(kind: str, body: dict[str, object]) -> str:
        return parse_request(kind, body, "m", 16).prompt_text  # type: ignore[arg-type]

    messages = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": [{"type": "text", "text": "hello"}, {"type": "image_url"}]},
        {"role": "assistant", "content": None},
    ]
    # A chat is judged by its last user message, not the system prompt or earlier replies.
    assert text("chat", {"messages": messages}) == "hello"
    later = [*messages, {"role": "assistant", "content": "hi"}, {"role": "user", "content": "again"}]
    assert text("chat", {"messages": later}) == "again"
    assert text("chat", {"messages": [{"role": "system", "content": "only"}]}) == "only"
    assert text("completion", {"prompt": "abc"}) == "abc"
    assert text("completion", {"prompt": ["abc"]}) == "abc"
    assert text("completion", {"prompt": [1, 2, 3]}) == ""
    assert text("generate", {"text": "xyz"}) == "xyz"
    assert text("generate", {"input_ids": [1, 2]}) == ""


# ----- the engine's speed model, in simulated time -----


class RecordingGpu(SharedGpu):
    """A GPU of its own that remembers every step's booked duration (simulated time), and says
    when `steps` steps were taken."""

    def __init__(self, steps: int) -> None:
        super().__init__()
        self.durations: list[float] = []
        self.done = asyncio.Event()
        self._steps = steps

    def book(self, earliest: float, duration: float, owner: object = None, contention: float = 1.0) -> float:
        self.durations.append(duration)
        if len(self.durations) > self._steps:  # the previous step was taken
            self.done.set()
        return super().book(earliest, duration, owner, contention)


def run_engine(cfg: ServerConfig, accepts: list[float | None], steps: int) -> tuple[Engine, RecordingGpu]:
    """`len(accepts)` sequences that never finish, decoded for `steps` steps at a fixed batch size."""
    scale = 1000.0
    gpu = RecordingGpu(steps)

    async def go() -> Engine:
        cfg_fast = dataclasses.replace(cfg, time_scale=scale, ttft_base_ms=0.0, prefill_tok_s=1e12 / scale)
        engine = Engine(
            speed=cfg_fast.speed(),
            accept_length=cfg.default_accept_length,
            max_running=len(accepts),
            kv_capacity_tokens=10**12,
            speculative=cfg.role == "speculative",
            gpu=gpu,
        )
        engine.start()
        seqs = [Sequence(f"r{i}", 1, 10**9, accept_length=a) for i, a in enumerate(accepts)]
        for seq in seqs:
            engine.submit(seq)
        await asyncio.wait_for(gpu.done.wait(), timeout=30)
        await engine.stop()
        return engine

    engine = asyncio.run(go())
    # Every step was taken with the whole batch running: the decode rate is exact in simulated time.
    assert engine.stats.decode_seq_steps == engine.stats.decode_steps * len(accepts)
    del gpu.durations[engine.stats.decode_steps :]  # a step booked but never taken (stopped)
    return engine, gpu


def decode_tok_s(engine: Engine, gpu: RecordingGpu) -> float:
    return engine.stats.decode_accepted / sum(gpu.durations) / 1000.0


def test_throughput_follows_the_batch_mean_acceptance() -> None:
    curve = load_profile("crossover")
    cfg = ServerConfig(role="speculative", profile=curve, accept_from_prompt=True)
    batch = 8
    rates = {}
    for name in ("repetitive", "diverse"):
        accepts = [cfg.accept_for(p.text) for p in first(source(name, seed=1), batch)]
        engine, gpu = run_engine(cfg, accepts, steps=200)
        mean_accept = statistics.mean(a for a in accepts if a is not None)
        rates[name] = (decode_tok_s(engine, gpu), mean_accept)
        # T(c) tokens/s at the profile's acceptance, scaled by the batch's mean over it.
        expected = curve.throughput("speculative", batch) * mean_accept / cfg.step_accept_length
        assert rates[name][0] == pytest.approx(expected, rel=0.02), name
        assert gpu.durations[0] == pytest.approx(3.0 * batch / (curve.throughput("speculative", batch) * 1000))
    (rep, rep_accept), (div, div_accept) = rates["repetitive"], rates["diverse"]
    assert rep_accept > 3.4 and div_accept < 1.1
    assert rep / div == pytest.approx(rep_accept / div_accept, rel=0.03)


def test_a_mixed_batch_advances_each_request_by_its_own_acceptance() -> None:
    curve = load_profile("crossover")
    cfg = ServerConfig(role="speculative", profile=curve)
    engine, gpu = run_engine(cfg, [1.0, 2.5, 4.0, None], steps=100)  # None: the default, the profile's 3
    steps = engine.stats.decode_steps
    assert engine.stats.decode_accepted == pytest.approx(steps * (1.0 + 2.5 + 4.0 + 3.0), abs=4)
    assert decode_tok_s(engine, gpu) == pytest.approx(curve.throughput("speculative", 4) * 2.625 / 3, rel=0.02)


def test_the_profile_speed_holds_at_the_profile_acceptance_and_on_the_baseline() -> None:
    profile = load_profile("crossover")
    for role in ROLES:
        cfg = ServerConfig(role=role, profile=profile)
        engine, gpu = run_engine(cfg, [None] * 5, steps=100)
        assert decode_tok_s(engine, gpu) == pytest.approx(profile.throughput(role, 5), rel=0.01), role


# ----- over HTTP: chunks and the gauge -----

FAST = ("--time-scale", "20", "--profile", "crossover", "--accept-from-prompt")


def test_chunks_and_live_gauge_follow_the_prompt_mix(simulator: StartSim) -> None:
    sim = simulator("speculative", *FAST)
    echo = next(repetitive(0)).text
    varied = next(diverse(0, long=False)).text
    echo_accept = 1 + 3 * repetitiveness(echo)
    assert echo_accept > 3.4 and repetitiveness(varied) == 0.0

    def stream(prompt: str, max_tokens: int) -> list[int]:
        body = {"prompt": prompt, "max_tokens": max_tokens, "stream": True}
        events = sse_json(httpx.post(sim.url + "/v1/completions", json=body, timeout=30).content)
        texts = [e["choices"][0]["text"] for e in events if e["choices"][0]["finish_reason"] is None]
        return [t.count(" ") for t in texts]

    def gauge() -> float:
        return scrape(sim.url)["sglang:spec_accept_length"]

    # Repetitive prompts: several tokens a chunk, and the gauge near their acceptance.
    sizes: list[int] = []
    for _ in range(3):
        sizes += stream(echo, 400)[1:-1]  # after the prefill's token, before the last (cut) step
    assert statistics.mean(sizes) == pytest.approx(echo_accept, abs=0.05)
    assert gauge() == pytest.approx(echo_accept, abs=0.1)
    # The mix changes: varied prompts accept one token a step. Two streams of them cover more than
    # two refresh windows, so the last window holds nothing else.
    for _ in range(2):
        assert set(stream(varied, 2 * DECODE_LOG_INTERVAL + 1)) == {1}
    assert gauge() == 1.0
    # /get_server_info reports the mean since start, as SGLang's does: in between.
    avg = httpx.get(sim.url + "/get_server_info").json()["internal_states"][0]["avg_spec_accept_length"]
    assert 1.0 < avg < echo_accept
