"""Production traffic in the load tester: workloads (multi-turn sessions, long contexts), traffic
classes, the text they send, the per-class summary, the client's cached tokens, and the flags.

In-process: pure parts, and the load driven against an aiohttp server in the test's own loop; one
loopback test against the simulator (TEST_TIERS)."""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
import random
import statistics
import subprocess
import sys
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any, ClassVar

import aiohttp
import pytest

from loadtest.__main__ import build_parser, main
from loadtest.classes import Slo, summarise_by_class
from loadtest.client import RequestResult, Target, read_usage, stream_request
from loadtest.production import WorkloadRun, run_workload
from loadtest.prompts import Prompt, repetitiveness, source
from loadtest.report import class_table
from loadtest.stats import LevelStats, summarize
from loadtest.sweep import LevelPlan, make_session, measure_level, measure_together
from loadtest.textbank import TextBank
from loadtest.workload import (
    THINK_MAX_FACTOR,
    TrafficClass,
    Turn,
    Workload,
    WorkloadSpec,
    draw_think,
    draw_tokens,
)

from ..conftest import StartSim
from ..recorder import Recorder, serving

CHAT = TrafficClass("chat", 0.7, "diverse")
CODE = TrafficClass("code", 0.3, "repetitive")


@pytest.fixture(scope="module")
def bank() -> TextBank:
    return TextBank(0)


def multiturn(bank: TextBank, **fields: Any) -> Workload:
    return Workload(WorkloadSpec("multiturn", **{"think_time_s": 1.0, **fields}), bank)


# --- multi-turn sessions -------------------------------------------------------------------------


def test_each_turn_resends_the_whole_conversation_with_the_replies_as_received(bank: TextBank) -> None:
    w = multiturn(bank, turns=3, system_tokens=50, user_tokens=40)
    script = w.stream(0)
    first = next(script)
    assert (first.turn, first.think_s, first.keep_reply) == (1, 0.0, True)
    assert [m["role"] for m in first.prompt.messages] == ["system", "user"]
    assert first.prompt.messages[0]["content"] == w.system_prompt
    replies = [" the quick brown fox\n", "  a reply with trailing space "]
    second = script.send(replies[0])
    third = script.send(replies[1])
    assert (second.turn, third.turn) == (2, 3)
    assert first.session == second.session == third.session
    m = third.prompt.messages
    assert [x["role"] for x in m] == ["system", "user", "assistant", "user", "assistant", "user"]
    # Every earlier message as it was sent, every reply byte for byte.
    assert m[:2] == first.prompt.messages and m[:4] == second.prompt.messages
    assert [m[2]["content"], m[4]["content"]] == replies
    assert len({m[1]["content"], m[3]["content"], m[5]["content"]}) == 3
    # After the last turn a new session starts from the system prompt alone.
    fourth = script.send("last reply")
    assert fourth.turn == 1 and fourth.session != first.session
    assert [x["role"] for x in fourth.prompt.messages] == ["system", "user"]


def test_a_failed_turn_ends_its_session(bank: TextBank) -> None:
    script = multiturn(bank, turns=5).stream(0)
    first = next(script)
    assert script.send("ok").turn == 2
    after_failure = script.send(None)
    assert after_failure.turn == 1 and after_failure.session != first.session


def test_the_system_prompt_is_one_text_for_every_session_stream_and_class(bank: TextBank) -> None:
    w = multiturn(bank, system_tokens=1000, classes=(CHAT, CODE))
    systems = set()
    for stream in range(5):
        script = w.stream(stream)
        turn = next(script)
        for _ in range(12):  # three sessions of four turns per stream
            systems.add(turn.prompt.messages[0]["content"])
            turn = script.send("r")
    assert systems == {w.system_prompt}
    assert abs(len(w.system_prompt) - 4000) < 40  # ~4 bytes a token
    # The same for every level and target (a Workload per level), and another seed another text.
    assert multiturn(bank, system_tokens=1000).system_prompt == w.system_prompt
    assert multiturn(TextBank(1), system_tokens=1000, seed=1).system_prompt != w.system_prompt
    assert all(m["role"] != "system" for m in next(multiturn(bank, system_tokens=0).stream(0)).prompt.messages)


def test_a_stream_sends_the_same_sessions_whatever_the_replies_and_seed_decides(bank: TextBank) -> None:
    def user_texts(seed: int) -> list[str]:
        script = multiturn(bank, seed=seed).stream(3)
        turn = next(script)
        out = []
        for i in range(8):
            out.append(turn.prompt.messages[-1]["content"])
            turn = script.send(f"reply {i} of some length " * (i + 1))
        return out

    assert user_texts(0) == user_texts(0)
    assert user_texts(0) != user_texts(1)


def test_think_times_are_drawn_around_the_mean_and_bounded() -> None:
    rng = random.Random(7)
    draws = [draw_think(rng, 2.0) for _ in range(20_000)]
    assert min(draws) >= 0 and max(draws) <= THINK_MAX_FACTOR * 2.0
    assert max(draws) == THINK_MAX_FACTOR * 2.0  # the cut is reached, so it is what bounds them
    assert statistics.fmean(draws) == pytest.approx(2.0 * (1 - math.exp(-THINK_MAX_FACTOR)), rel=0.03)
    assert len(set(draws)) > 1000  # spread, not a constant
    again = random.Random(7)
    assert [draw_think(again, 2.0) for _ in range(10)] == draws[:10]  # seeded
    assert draw_think(rng, 0.0) == 0.0


def test_turns_after_the_first_wait_a_think_time(bank: TextBank) -> None:
    script = multiturn(bank, turns=4, think_time_s=0.5).stream(0)
    turn = next(script)
    thinks = []
    for _ in range(40):
        thinks.append((turn.turn, turn.think_s))
        turn = script.send("r")
    assert all(t == 0.0 for k, t in thinks if k == 1)
    later = [t for k, t in thinks if k > 1]
    assert all(0 <= t <= THINK_MAX_FACTOR * 0.5 for t in later) and len(set(later)) == len(later)


def test_think_time_is_divided_by_the_commands_time_scale() -> None:
    from loadtest.kit.sweeps import workload_spec

    demo = build_parser().parse_args(["demo", "--time-scale", "4", "--think-time-s", "2", "--workload", "multiturn",
                                      "--stagger-s", "8"])  # fmt: skip
    assert (workload_spec(demo).think_time_s, workload_spec(demo).stagger_s) == (0.5, 2.0)
    sweep = build_parser().parse_args(["sweep", "--url", "http://x", "--think-time-s", "2"])
    assert (workload_spec(sweep).think_time_s, workload_spec(sweep).stagger_s) == (2.0, 0.0)


def first_requests(w: Workload, streams: int, sessions: int) -> list[list[Turn]]:
    """Each stream's turns over its first `sessions` sessions."""
    out = []
    for i in range(streams):
        script, turns = w.stream(i), []
        turn = next(script)
        while int(turn.session.split(".")[1]) <= sessions:
            turns.append(turn)
            turn = script.send("r")
        out.append(turns)
    return out


@pytest.mark.parametrize("kind", ["multiturn", "longctx"])
def test_a_stagger_spreads_each_streams_first_request_and_nothing_else(bank: TextBank, kind: str) -> None:
    fields = {"turns": 3, "think_time_s": 0.5, "user_tokens": 32, "prompt_tokens_mean": 64}
    plain = first_requests(Workload(WorkloadSpec(kind, **fields), bank), 64, 3)  # type: ignore[arg-type]
    spread = first_requests(Workload(WorkloadSpec(kind, stagger_s=6.0, **fields), bank), 64, 3)  # type: ignore[arg-type]
    firsts = [turns[0].think_s for turns in spread]
    assert all(0 <= t < 6.0 for t in firsts) and len(set(firsts)) == 64
    assert statistics.fmean(firsts) == pytest.approx(3.0, abs=0.6)  # uniform over [0, 6), not bunched
    assert all(turns[0].think_s == 0.0 for turns in plain)
    for a, b in zip(plain, spread, strict=True):
        # Every later request waits as it did, and every prompt is the one it was.
        assert [t.think_s for t in a[1:]] == [t.think_s for t in b[1:]]
        assert [t.prompt for t in a] == [t.prompt for t in b]
    again = first_requests(Workload(WorkloadSpec(kind, stagger_s=6.0, **fields), bank), 64, 1)  # type: ignore[arg-type]
    assert [turns[0].think_s for turns in again] == firsts  # seeded
    with pytest.raises(ValueError, match="--stagger-s"):
        WorkloadSpec(kind, stagger_s=-1.0)  # type: ignore[arg-type]


# --- long contexts ---------------------------------------------------------------------------------


def test_longctx_lengths_have_the_asked_mean_and_spread() -> None:
    rng = random.Random(11)
    lengths = [draw_tokens(rng, 8000, 0.5, 16, 100_000) for _ in range(20_000)]
    assert statistics.fmean(lengths) == pytest.approx(8000, rel=0.03)
    assert statistics.pstdev(lengths) / statistics.fmean(lengths) == pytest.approx(0.5, rel=0.08)
    clamped = [draw_tokens(rng, 1000, 3.0, 16, 5000) for _ in range(5000)]
    assert min(clamped) == 16 and max(clamped) == 5000
    assert {draw_tokens(rng, 300, 0.0, 16, 1000) for _ in range(10)} == {300}


def test_longctx_prompts_are_as_long_as_drawn(bank: TextBank) -> None:
    w = Workload(WorkloadSpec("longctx", prompt_tokens_mean=3000, prompt_tokens_spread=0.4), bank)
    script = w.stream(0)
    turns = [next(script) for _ in range(300)]
    chars = [len(t.prompt.messages[0]["content"]) for t in turns]
    assert statistics.fmean(chars) / 4 == pytest.approx(3000, rel=0.08)
    assert statistics.pstdev(chars) / statistics.fmean(chars) == pytest.approx(0.4, rel=0.2)
    assert all(t.turn == 1 and t.traffic_class == "all" and not t.keep_reply for t in turns)
    assert len({t.session for t in turns}) == 300


# --- traffic classes ---------------------------------------------------------------------------------


def test_sessions_and_requests_are_drawn_into_classes_by_share(bank: TextBank) -> None:
    for kind in ("single", "longctx", "multiturn"):
        spec = WorkloadSpec(kind, classes=(CHAT, CODE), turns=2, prompt_tokens_mean=16, user_tokens=16)
        w = Workload(spec, bank)
        sessions: dict[str, str] = {}
        for stream in range(4):
            script = w.stream(stream)
            turn = next(script)
            for _ in range(1000):
                # A session stays in its class for all its turns.
                assert sessions.setdefault(turn.session, turn.traffic_class) == turn.traffic_class
                turn = script.send("r")
        share = sum(1 for c in sessions.values() if c == "code") / len(sessions)
        assert share == pytest.approx(0.3, abs=0.03), kind


def test_without_classes_everything_is_in_class_all(bank: TextBank) -> None:
    for kind in ("single", "longctx", "multiturn"):
        script = Workload(WorkloadSpec(kind, prompt_tokens_mean=100), bank).stream(0)
        assert next(script).traffic_class == "all"


def test_single_without_classes_sends_todays_prompts_in_todays_order() -> None:
    w = Workload(WorkloadSpec("single", prompts="diverse", seed=3))
    a, b = w.stream(0), w.stream(1)
    # One sequence shared by the streams, drawn in the order they send.
    turns = [next(a), next(b), a.send(""), b.send(""), a.send(None), a.send("")]
    assert [t.prompt for t in turns] == list(itertools.islice(source("diverse", 3), 6))
    assert len({t.session for t in turns}) == 6 and {t.turn for t in turns} == {1}


@pytest.mark.parametrize("tokens", [16, 40, 200, 2000, 30_000])
def test_generated_text_keeps_the_repetitiveness_contract_at_any_length(bank: TextBank, tokens: int) -> None:
    rng = random.Random(tokens)
    for _ in range(5):
        assert repetitiveness(bank.diverse(rng, tokens * 4)) < 0.2
        assert repetitiveness(bank.repetitive(rng, tokens * 4)) > 0.8


@pytest.mark.parametrize("user_tokens", [16, 200, 3000])
def test_a_classes_messages_score_as_its_kind(bank: TextBank, user_tokens: int) -> None:
    w = multiturn(bank, classes=(CHAT, CODE), user_tokens=user_tokens)
    by_class: dict[str, list[float]] = {"chat": [], "code": []}
    script = w.stream(0)
    turn = next(script)
    for _ in range(60):
        by_class[turn.traffic_class].append(repetitiveness(turn.prompt.messages[-1]["content"]))
        turn = script.send("r")
    assert by_class["chat"] and by_class["code"]
    assert max(by_class["chat"]) < 0.2 and min(by_class["code"]) > 0.8
    # longctx prompts too.
    spec = WorkloadSpec("longctx", classes=(CHAT, CODE), prompt_tokens_mean=max(16, user_tokens))
    for t in (next(s) for s in (Workload(spec, bank).stream(i) for i in range(20))):
        score = repetitiveness(t.prompt.messages[0]["content"])
        assert score > 0.8 if t.traffic_class == "code" else score < 0.2


def test_a_30k_token_conversation_is_cheap_to_build(bank: TextBank) -> None:
    import time

    w = multiturn(bank, system_tokens=2000, user_tokens=1000, turns=30)
    script = w.stream(0)
    turn = next(script)
    t0 = time.process_time()
    for _ in range(29):
        turn = script.send("x" * 2000)
    spent = time.process_time() - t0
    assert sum(len(m["content"]) for m in turn.prompt.messages) > 30_000 * 4
    assert spent < 0.25, f"{spent:.3f} s of CPU for one 30-turn session"


# --- per-class summary ---------------------------------------------------------------------------------


def result(
    cls: str,
    started: float,
    ttft: float = 0.1,
    tpot: float = 0.01,
    out: int = 11,
    prompt: int = 100,
    cached: int | None = None,
    ok: bool = True,
    session: str = "",
) -> RequestResult:
    chunks = [started + ttft + i * tpot for i in range(out)]
    return RequestResult(started=started, finished=chunks[-1], ok=ok, error=None if ok else "HTTP 500",
                         ttft=ttft if ok else None, chunk_times=chunks if ok else [], prompt_tokens=prompt,
                         output_tokens=out if ok else 0, cached_tokens=cached, traffic_class=cls,
                         session=session or f"{cls}-{started}")  # fmt: skip


def test_goodput_counts_the_requests_within_every_slo_given() -> None:
    rs = [
        result("chat", 1.0, ttft=0.1, tpot=0.01),  # meets both
        result("chat", 2.0, ttft=0.5, tpot=0.01),  # TTFT too slow
        result("chat", 3.0, ttft=0.1, tpot=0.05),  # TPOT too slow
        result("chat", 4.0, ok=False),  # failed: never good
        result("chat", 5.0, ttft=0.25, tpot=2**-6),  # exactly at both limits (binary fractions: no rounding)
    ]
    by = summarise_by_class(rs, 0.0, 10.0, Slo(ttft_ms=250, tpot_ms=1000 * 2**-6))
    c = by["chat"]
    assert (c.completed, c.errors) == (4, 1)
    assert c.goodput_share == pytest.approx(2 / 5)
    assert c.goodput_req_s == pytest.approx(2 / 10)
    only_ttft = summarise_by_class(rs, 0.0, 10.0, Slo(ttft_ms=250))["chat"]
    assert only_ttft.goodput_share == pytest.approx(3 / 5)
    # A request finished after the window counts in the share (it started inside), not the rate.
    late = summarise_by_class([result("chat", 9.95)], 0.0, 10.0, Slo(ttft_ms=200))["chat"]
    assert (late.goodput_share, late.goodput_req_s) == (1.0, 0.0)


def test_without_slo_goodput_is_not_invented() -> None:
    c = summarise_by_class([result("chat", 1.0)], 0.0, 10.0)["chat"]
    assert c.goodput_req_s is None and c.goodput_share is None
    stats = LevelStats(**{**vars(summarize(1, [], 0, 1)), "classes": {"chat": c}})
    table = class_table("t", [stats], Slo())
    assert "no SLO given (--slo-ttft-ms, --slo-tpot-ms)" in table
    assert "n/a" in table.splitlines()[3]
    assert "within TTFT <= 100 ms" in class_table("t", [stats], Slo(ttft_ms=100))


def test_hit_rate_is_cached_over_prompt_tokens_and_na_without_reports() -> None:
    rs = [
        result("chat", 1.0, prompt=1000, cached=900),
        result("chat", 2.0, prompt=3000, cached=1500),
        result("code", 1.0, prompt=500),
        result("code", 2.0, prompt=700),
        result("code", 3.0, prompt=999, cached=999, ok=False),  # failed: its usage is not counted
    ]
    by = summarise_by_class(rs, 0.0, 10.0)
    assert list(by) == ["chat", "code"]
    assert by["chat"].prefix_cache_hit_rate == pytest.approx(2400 / 4000)
    assert by["chat"].cache_reported == 2
    assert by["chat"].mean_prompt_tokens == 2000
    assert by["code"].prefix_cache_hit_rate is None and by["code"].cache_reported == 0
    assert by["code"].mean_prompt_tokens == 600
    stats = LevelStats(**{**vars(summarize(1, [], 0, 1)), "classes": by})
    table = class_table("t", [stats], Slo())
    assert "60.0%" in table and "--enable-cache-report" in table


def test_latency_percentiles_throughput_and_sessions_per_class() -> None:
    rs = [result("chat", float(i), ttft=0.01 * (i + 1), session=f"s{i // 2}") for i in range(10)]
    rs += [result("code", 0.5, out=21)]
    by = summarise_by_class(rs, 0.0, 10.0)
    chat = by["chat"]
    assert chat.p50_ttft_ms == pytest.approx(55.0) and chat.p99_ttft_ms == pytest.approx(99.1)
    assert chat.p50_tpot_ms == pytest.approx(10.0) and chat.p99_tpot_ms == pytest.approx(10.0)
    assert chat.sessions == 5
    assert chat.output_tok_s == pytest.approx(10 * 11 / 10, rel=0.02)
    assert by["code"].output_tok_s == pytest.approx(21 / 10)
    outside = summarise_by_class([result("chat", 20.0)], 0.0, 10.0)["chat"]
    assert outside.completed == 0 and math.isnan(outside.p50_ttft_ms)


# --- the client -------------------------------------------------------------------------------------------


def test_usage_cached_tokens_are_read_when_reported() -> None:
    r = RequestResult(started=0.0)
    read_usage(r, {"prompt_tokens": 1200, "completion_tokens": 8, "prompt_tokens_details": {"cached_tokens": 1024}})
    assert (r.prompt_tokens, r.output_tokens, r.cached_tokens) == (1200, 8, 1024)
    for usage in (
        {"prompt_tokens": 5, "completion_tokens": 1},
        {"prompt_tokens": 5, "completion_tokens": 1, "prompt_tokens_details": None},
        {"prompt_tokens": 5, "completion_tokens": 1, "prompt_tokens_details": {"cached_tokens": None}},
    ):
        fresh = RequestResult(started=0.0)
        read_usage(fresh, usage)
        assert fresh.cached_tokens is None and fresh.prompt_tokens == 5


@pytest.fixture
async def recorder() -> AsyncIterator[tuple[str, Recorder]]:
    rec = Recorder()
    async with serving(rec) as url:
        yield url, rec


@pytest.mark.anyio
async def test_the_client_reads_cached_tokens_and_keeps_the_text(recorder: tuple[str, Recorder]) -> None:
    url, _ = recorder
    text: list[str] = []
    prompt = Prompt(({"role": "user", "content": "hi"},), "hi")
    async with aiohttp.ClientSession() as session:
        r = await stream_request(session, Target(url, "m"), prompt, text_sink=text)
    assert r.ok and r.cached_tokens == 0 and r.prompt_tokens == 40 and r.output_tokens == 3
    assert "".join(text) == "reply 1 to 1 messages\n"


@pytest.mark.anyio
async def test_run_workload_sends_each_reply_back_as_received(recorder: tuple[str, Recorder]) -> None:
    url, rec = recorder
    spec = WorkloadSpec("multiturn", classes=(CHAT, CODE), turns=3, system_tokens=20, user_tokens=20,
                        think_time_s=0.01)  # fmt: skip
    run = await run_workload(url, "m", spec, concurrency=3, duration_s=0.3, max_tokens=8)
    assert run.t0 < run.t1 and run.results
    # Every later turn carries the replies this server streamed, exactly.
    sent_replies = {f"reply {i + 1} to {len(b['messages'])} messages\n" for i, b in enumerate(rec.bodies)}
    for body in rec.bodies:
        assert body["messages"][0]["role"] == "system"
        for m in body["messages"]:
            if m["role"] == "assistant":
                assert m["content"] in sent_replies
    by_turn = {r.turn for r in run.results}
    assert by_turn == {1, 2, 3}
    assert all(r.ok and r.session and r.traffic_class in ("chat", "code") for r in run.results)
    for r in run.results:
        assert r.cached_tokens == r.prompt_tokens - 40  # what the recorder reported for its length
    by_class = run.by_class(Slo(ttft_ms=10_000))
    assert set(by_class) <= {"chat", "code"}
    total = sum(c.completed for c in by_class.values())
    assert total > 0 and all(c.goodput_share == 1.0 for c in by_class.values() if c.completed)
    stats = run.stats()
    assert stats.classes.keys() == by_class.keys() and stats.completed == total


@pytest.mark.anyio
async def test_a_class_with_a_url_of_its_own_is_sent_there_and_only_there(recorder: tuple[str, Recorder]) -> None:
    """headtohead-classes' static split: one class to one server, the rest to the target's URL."""
    url, rest = recorder
    code = Recorder()
    spec = WorkloadSpec("multiturn", classes=(CHAT, CODE), classes_by_stream=True, turns=2, system_tokens=20,
                        user_tokens=20, think_time_s=0.0)  # fmt: skip
    async with serving(code) as code_url, make_session() as session:
        target = Target(url, "m", max_tokens=8, class_urls={"code": code_url})
        run = await measure_level(session, target, 4, LevelPlan(duration_s=0.3), Workload(spec), min_requests=0)
    sent = run.results
    assert all(r.ok for r in sent) and {r.traffic_class for r in sent} == {"chat", "code"}
    assert len(code.bodies) == sum(r.traffic_class == "code" for r in sent) > 0
    assert len(rest.bodies) == sum(r.traffic_class == "chat" for r in sent) > 0
    assert Target(url, "m").for_class("code").url == url


@pytest.mark.anyio
async def test_a_target_with_a_url_per_stream_keeps_every_session_on_its_streams_server(
    recorder: tuple[str, Recorder],
) -> None:
    """headtohead-classes' oracle: stream i's sessions all on stream_urls[i % 2], every turn."""
    first, one = recorder
    two = Recorder()
    spec = WorkloadSpec("multiturn", turns=3, system_tokens=20, user_tokens=20, think_time_s=0.0)
    async with serving(two) as second, make_session() as session:
        target = Target(first, "m", max_tokens=8, tag_requests=True, stream_urls=(first, second))
        run = await measure_level(session, target, 4, LevelPlan(duration_s=0.3), Workload(spec), min_requests=0)
    assert all(r.ok for r in run.results) and len(one.bodies) + len(two.bodies) == len(run.results)
    on_one, on_two = set(one.sessions), set(two.sessions)
    assert on_one and on_two and not on_one & on_two and None not in on_one | on_two
    # Sessions are named stream.session: streams 0 and 2 on the first server, 1 and 3 on the second.
    assert {str(s).split(".")[0] for s in on_one} == {"0", "2"}
    assert {str(s).split(".")[0] for s in on_two} == {"1", "3"}


@pytest.mark.anyio
async def test_targets_side_by_side_are_measured_in_one_window_until_each_has_enough() -> None:
    # A target ten times slower than the other needs the window extended: both stay loaded and
    # measured until it has enough, from the same start to the same end.
    spec = WorkloadSpec("multiturn", turns=2, system_tokens=20, user_tokens=20, think_time_s=0.0)
    plan = LevelPlan(duration_s=0.2, max_duration_s=5.0)
    async with serving(Recorder()) as fast, serving(Recorder(piece_s=0.03)) as slow, make_session() as session:
        targets = {"fast": Target(fast, "m", max_tokens=8), "slow": Target(slow, "m", max_tokens=8)}
        workloads = {name: Workload(spec) for name in targets}
        runs = await measure_together(session, targets, 2, plan, workloads, min_requests=12)
    assert runs["fast"].t0 == runs["slow"].t0 and runs["fast"].t1 == runs["slow"].t1
    t0, t1 = runs["fast"].t0, runs["fast"].t1
    assert t1 - t0 > 0.2 and runs["fast"].extended_s == runs["slow"].extended_s > 0
    assert any(r.started > t0 + 0.2 for r in runs["fast"].results)  # loaded through the extension
    assert sum(1 for r in runs["slow"].results if r.ok and t0 <= r.started < t1) >= 12
    assert runs["fast"].died == runs["slow"].died == ()
    with pytest.raises(ValueError, match="duration_s"):
        await measure_together(session, targets, 1, LevelPlan(requests=3), workloads)


class _Breaking(Target):
    """A target whose third request body cannot be built: the load tester's own failure."""

    calls: ClassVar[list[int]] = []

    def body(self, prompt: Prompt) -> dict[str, Any]:
        self.calls.append(1)
        if len(self.calls) == 3:
            raise RuntimeError("the tester broke")
        return super().body(prompt)


@pytest.mark.anyio
async def test_a_malformed_event_is_the_servers_error_and_a_stream_the_tester_lost_concludes_nothing() -> None:
    spec = WorkloadSpec("multiturn", turns=2, system_tokens=20, user_tokens=20, think_time_s=0.0)
    async with serving(Recorder(malformed=2)) as url, make_session() as session:
        run = await measure_level(session, Target(url, "m", max_tokens=8), 2, LevelPlan(duration_s=0.2), Workload(spec))
        bad = [r for r in run.results if not r.ok]
        assert len(bad) == 1 and bad[0].error == "malformed event: [1]" and not bad[0].client_error
        assert run.died == ()
        _Breaking.calls.clear()
        lost = await measure_level(session, _Breaking(url, "m", max_tokens=8), 2, LevelPlan(duration_s=0.2),
                                   Workload(spec), min_requests=0)  # fmt: skip
    assert lost.died == ("RuntimeError: the tester broke",)
    stats = WorkloadRun(lost.results, lost.t0, lost.t1, 2, lost.extended_s, lost.died).stats(min_requests=0)
    assert not stats.conclusive and "RuntimeError: the tester broke" in stats.client_error_samples


# --- flags ------------------------------------------------------------------------------------------------


def test_workload_flags_are_parsed() -> None:
    args = build_parser().parse_args(["sweep", "--url", "http://x", "--workload", "multiturn", "--turns", "6",
                                      "--system-tokens", "0", "--user-tokens", "300", "--think-time-s", "0",
                                      "--class", "chat:0.7:diverse", "--class", "code:0.3:repetitive",
                                      "--slo-ttft-ms", "500", "--slo-tpot-ms", "40"])  # fmt: skip
    assert (args.workload, args.turns, args.system_tokens, args.user_tokens, args.think_time_s) == (
        "multiturn", 6, 0, 300, 0.0)  # fmt: skip
    assert args.classes == [CHAT, CODE]
    assert (args.slo_ttft_ms, args.slo_tpot_ms) == (500.0, 40.0)
    plain = build_parser().parse_args(["sweep", "--url", "http://x"])
    assert (plain.workload, plain.classes, plain.slo_ttft_ms, plain.slo_tpot_ms) == ("single", [], None, None)


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--class", "chat:0.7"], "NAME:SHARE:KIND"),
        (["--class", "chat:seven:diverse"], "is not a number"),
        (["--class", "chat:1.5:diverse"], "SHARE must be in (0, 1]"),
        (["--class", "chat:0:diverse"], "SHARE must be in (0, 1]"),
        (["--class", "chat:0.5:poetry"], "KIND must be one of diverse, repetitive"),
        (["--class", "c h:0.5:diverse"], "NAME must be"),
        (["--workload", "batch"], "invalid choice"),
        (["--turns", "0"], "must be at least 1"),
        (["--system-tokens", "-1"], "must be at least 0"),
        (["--think-time-s", "-2"], "must be >= 0"),
        (["--stagger-s", "-1"], "must be >= 0"),
        (["--prompt-tokens-spread", "-0.1"], "must be >= 0"),
        (["--slo-ttft-ms", "0"], "must be > 0"),
    ],
)
def test_bad_flag_values_are_refused_naming_them(
    flags: Sequence[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exc:
        build_parser().parse_args(["sweep", "--url", "http://x", *flags])
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--class", "a:0.5:diverse", "--class", "b:0.4:diverse"], "the shares sum to 0.9, not 1"),
        (["--class", "a:0.5:diverse", "--class", "a:0.5:repetitive"], "a name is given twice"),
        (["--workload", "multiturn", "--prompts", "fixed"], "--prompts applies to --workload single"),
        (["--stagger-s", "5"], "--stagger-s applies to --workload multiturn and longctx"),
        (["--class", "a:1:diverse", "--prompts", "short"], "--prompts applies to --workload single"),
        (["--workload", "longctx", "--prompt-tokens-mean", "9", "--prompt-tokens-max", "100"], "must be in [16,"),
        (["--workload", "longctx", "--prompt-tokens-mean", "200", "--prompt-tokens-max", "100"], "must be in [16,"),
    ],
)
def test_bad_combinations_exit_2_before_any_request(
    flags: Sequence[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    # A closed port: had the command got as far as asking the target, it would say "cannot reach".
    assert main(["sweep", "--url", "http://127.0.0.1:9", "--quiet", *flags]) == 2
    err = capsys.readouterr().err
    assert message in err and "cannot reach" not in err


# --- against the simulator (loopback) ---------------------------------------------------------------------


@pytest.mark.anyio
async def test_multiturn_classes_against_the_simulator(simulator: StartSim) -> None:
    sim = simulator("speculative", "--time-scale", "20", "--accept-from-prompt")
    spec = WorkloadSpec("multiturn", classes=(CHAT, CODE), turns=3, system_tokens=300, user_tokens=100,
                        think_time_s=0.02)  # fmt: skip
    run = await run_workload(sim.url, "simulated", spec, concurrency=6, duration_s=1.5, max_tokens=16)
    ok = [r for r in run.results if r.ok]
    assert ok and len(ok) == len(run.results)
    # The conversation grows: a later turn of a session sends more prompt tokens than the one before.
    by_session: dict[str, list[RequestResult]] = {}
    for r in ok:
        by_session.setdefault(r.session, []).append(r)
    grown = [s for s in by_session.values() if len(s) > 1]
    assert grown
    for turns in grown:
        turns.sort(key=lambda r: r.turn)
        assert [r.turn for r in turns] == list(range(1, len(turns) + 1))
        assert all(a.prompt_tokens < b.prompt_tokens for a, b in itertools.pairwise(turns))
    by_class = run.by_class()
    assert set(by_class) == {"chat", "code"}
    for c in by_class.values():
        assert c.completed > 0 and c.mean_prompt_tokens > 300
        assert c.prefix_cache_hit_rate is None or 0 <= c.prefix_cache_hit_rate <= 1


def test_sweep_reports_each_class_in_the_table_and_the_json(simulator: StartSim, tmp_path: Path) -> None:
    sim = simulator("speculative", "--time-scale", "20", "--accept-from-prompt")
    out = tmp_path / "r.json"
    proc = subprocess.run(
        [sys.executable, "-m", "loadtest", "sweep", "--url", sim.url, "--concurrency", "3", "--duration-s", "1",
         "--max-tokens", "8", "--quiet", "--workload", "multiturn", "--think-time-s", "0.05",
         "--class", "chat:0.5:diverse", "--class", "code:0.5:repetitive", "--slo-ttft-ms", "5000", "--out", str(out)],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert "by traffic class" in proc.stdout and "TTFT <= 5000 ms" in proc.stdout
    assert "--enable-cache-report" in proc.stdout  # the simulator reports no cached tokens
    data = json.loads(out.read_text())
    (level,) = data["levels"]
    assert set(level["classes"]) == {"chat", "code"}
    for c in level["classes"].values():
        assert c["completed"] > 0 and c["goodput_share"] == 1.0 and c["goodput_req_s"] > 0
        assert c["prefix_cache_hit_rate"] is None and c["cache_reported"] == 0
    assert level["completed"] == sum(c["completed"] for c in level["classes"].values())
    settings = data["settings"]
    assert (settings["workload"], settings["prompts"]) == ("multiturn", None)
    assert settings["classes"] == [{"name": "chat", "share": 0.5, "kind": "diverse"},
                                   {"name": "code", "share": 0.5, "kind": "repetitive"}]  # fmt: skip


@pytest.mark.anyio
async def test_later_turns_of_a_conversation_report_cached_tokens(simulator: StartSim) -> None:
    sim = simulator("speculative", "--time-scale", "20", "--profile", "h200-llama8b", "--enable-cache-report",
                    "--accept-from-prompt")  # fmt: skip
    spec = WorkloadSpec("multiturn", classes=(CHAT, CODE), turns=3, system_tokens=400, user_tokens=80,
                        think_time_s=0.02)  # fmt: skip
    run = await run_workload(sim.url, "simulated", spec, concurrency=4, duration_s=2.0, max_tokens=24)
    ok = [r for r in run.results if r.ok]
    assert ok and all(r.cached_tokens is not None for r in ok)
    later = [r for r in ok if r.turn > 1]
    assert later
    # A later turn resends the conversation so far: its earlier turns (and the system prompt) are cached.
    for r in later:
        assert r.cached_tokens is not None and r.cached_tokens >= 400 - 16, (r.turn, r.cached_tokens)
    hit = run.by_class()
    assert all(c.prefix_cache_hit_rate is not None and c.prefix_cache_hit_rate > 0.3 for c in hit.values())
    # The code class's edits repeat themselves: the simulator accepts more of its drafts.
    speeds = {name: c.p50_tpot_ms for name, c in hit.items()}
    assert speeds["code"] is not None and speeds["chat"] is not None and speeds["code"] < speeds["chat"]


def test_a_classs_decode_tokens_and_events_set_each_requests_first_event_aside() -> None:
    # 11 tokens in 11 events (one a token), then 31 tokens in 11 events (3 a step after the first).
    one_each = result("chat", 1.0, out=11)
    three = dataclasses.replace(result("code", 1.0, out=11), output_tokens=31)
    failed = result("code", 2.0, ok=False)
    by = summarise_by_class([one_each, three, failed], 0.0, 10.0)
    assert (by["chat"].decode_tokens, by["chat"].decode_events) == (10, 10)
    assert (by["code"].decode_tokens, by["code"].decode_events) == (30, 10)


@pytest.mark.anyio
async def test_side_by_side_a_stream_the_tester_lost_is_its_own_targets() -> None:
    spec = WorkloadSpec("multiturn", turns=2, system_tokens=20, user_tokens=20, think_time_s=0.0)
    async with serving(Recorder()) as url, make_session() as session:
        _Breaking.calls.clear()
        targets = {"sound": Target(url, "m", max_tokens=8), "broken": _Breaking(url, "m", max_tokens=8)}
        workloads = {name: Workload(spec) for name in targets}
        runs = await measure_together(session, targets, 2, LevelPlan(duration_s=0.2), workloads, min_requests=0)
    assert runs["broken"].died == ("RuntimeError: the tester broke",) and runs["sound"].died == ()
