"""The step-time profiles: interpolation on known inputs, the EAGLE arithmetic, prefill, the KV pool a
GPU leaves, acceptance at another draft depth, and SGLang's adaptive choice of steps."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from loadtest.simulator.profile import ProfileError
from loadtest.simulator.steptimes import (
    H200_GPU_GIB,
    SHARED_SPECULATIVE_SHARE,
    AdaptiveSteps,
    accept_at_steps,
    generate,
    load_steptimes,
    parse_steptimes,
    steptime_names,
)

SHARED = Path(__file__).resolve().parents[3] / "shared" / "profiles" / "h200-step-times.json"
PROFILES = Path(__file__).resolve().parents[2] / "loadtest" / "simulator" / "profiles"
B8 = load_steptimes("h200-llama8b")
RAW = json.loads((PROFILES / "h200-llama8b.json").read_text())
T1K = RAW["tables"][0]["target_step_s"]
T4K = RAW["tables"][1]["target_step_s"]
D1K = RAW["tables"][0]["draft_step_s"]


def test_measured_points_are_returned_as_measured() -> None:
    assert RAW["tables"][0]["ctx"] == 1024 and RAW["tables"][1]["ctx"] == 4096
    for b in ("1", "48", "256"):
        for q in ("1", "4", "32"):
            assert B8.target_s(int(b), int(q), 1024) == pytest.approx(T1K[b][q])
            assert B8.target_s(int(b), int(q), 4096) == pytest.approx(T4K[b][q])
        assert B8.draft_s(int(b), 8, 1024) == pytest.approx(D1K[b]["8"])


def test_linear_between_points_in_batch_query_and_context() -> None:
    assert B8.target_s(40, 1, 1024) == pytest.approx((T1K["32"]["1"] + T1K["48"]["1"]) / 2)
    assert B8.target_s(16, 7, 1024) == pytest.approx((T1K["16"]["6"] + T1K["16"]["8"]) / 2)
    assert B8.target_s(64, 1, 2560) == pytest.approx((T1K["64"]["1"] + T4K["64"]["1"]) / 2)
    # Past 4096 tokens, the 1k-to-4k slope goes on.
    slope = (T4K["256"]["1"] - T1K["256"]["1"]) / 3072
    assert B8.target_s(256, 1, 8192) == pytest.approx(T4K["256"]["1"] + slope * 4096)
    # Past 256 streams, the last two batches' slope goes on; under one, the first batch.
    assert B8.target_s(320, 1, 1024) == pytest.approx(T1K["256"]["1"] + (T1K["256"]["1"] - T1K["192"]["1"]))
    assert B8.target_s(0.5, 1, 1024) == pytest.approx(T1K["1"]["1"])


def test_short_contexts_never_cost_under_half_the_shortest_measured() -> None:
    assert B8.target_s(256, 1, 0) >= 0.5 * T1K["256"]["1"]
    assert B8.target_s(256, 1, 512) < T1K["256"]["1"]


def test_an_eagle_iteration_is_drafts_a_verify_and_the_drafts_pass() -> None:
    b, ctx = 8, 1024
    expected = 3 * D1K["8"]["1"] + T1K["8"]["4"] + D1K["8"]["4"]
    assert B8.eagle_step_s(b, 3, ctx) == pytest.approx(expected)
    assert B8.eagle_step_s(b, 7, ctx) == pytest.approx(7 * D1K["8"]["1"] + T1K["8"]["8"] + D1K["8"]["8"])
    # No drafting: a plain step and the draft's catch-up.
    assert B8.eagle_step_s(b, 0, ctx) == pytest.approx(T1K["8"]["1"] + D1K["8"]["1"])
    assert B8.baseline_step_s(b, ctx) == pytest.approx(T1K["8"]["1"])


def test_the_issues_crossovers_follow_from_the_arithmetic() -> None:
    """Where EAGLE-3 with 3 steps stops paying on the 8B shape (shared/design.md)."""

    def crossover(accept: float, ctx: int) -> int | None:
        for b in range(1, 257):
            if b * accept / B8.eagle_step_s(b, 3, ctx) < b / B8.baseline_step_s(b, ctx):
                return b
        return None

    assert 48 <= (crossover(1.5, 1024) or 0) <= 64
    assert 64 <= (crossover(1.5, 4096) or 0) <= 96
    assert 128 <= (crossover(2.0, 1024) or 0) <= 192
    assert crossover(2.5, 1024) is None and crossover(2.0, 4096) is None


def test_a_prefill_chunk_costs_a_batch_of_as_many_query_tokens() -> None:
    assert B8.prefill_s(8192, 1024, draft=False) == pytest.approx(T1K["256"]["32"])
    assert B8.prefill_s(8192, 1024, draft=True) == pytest.approx(T1K["256"]["32"] + B8.draft_s(1024, 8, 1024))
    assert B8.prefill_s(16, 1024, draft=False) == pytest.approx(T1K["1"]["16"])
    assert B8.prefill_s(8192, 8192, draft=False) > B8.prefill_s(8192, 1024, draft=False)


def test_two_servers_on_one_gpu_keep_the_measured_shares() -> None:
    assert B8.contention(4) == pytest.approx(0.9659515343725055)
    assert B8.contention(32) == pytest.approx(0.9393558008718557)
    assert B8.contention(1) == pytest.approx(0.9659515343725055)  # flat outside the measurements
    assert 0.939 < B8.contention(16) < 0.966


def test_the_kv_pool_a_gpu_leaves() -> None:
    per_token = 131072
    alone = B8.pool_tokens(H200_GPU_GIB, "baseline", shared=False)
    assert alone == pytest.approx((H200_GPU_GIB - 1.0 - 14.96 - 13.58) * 2**30 / per_token, abs=16)
    assert alone % 16 == 0 and 900_000 < alone < 910_000
    adaptive = B8.pool_tokens(H200_GPU_GIB, "adaptive", shared=False)
    assert adaptive == pytest.approx((H200_GPU_GIB - 1.0 - 14.96 - 2.0 - 13.58) * 2**30 / (per_token + 4096), abs=16)
    spec = B8.pool_tokens(H200_GPU_GIB, "speculative", shared=True)
    base = B8.pool_tokens(H200_GPU_GIB, "baseline", shared=True)
    left = H200_GPU_GIB - 2 * (1.0 + 14.96 + 13.58) - 2.0
    assert spec * (per_token + 4096) / 2**30 == pytest.approx(left * SHARED_SPECULATIVE_SHARE, abs=0.01)
    assert base * per_token / 2**30 == pytest.approx(left * (1 - SHARED_SPECULATIVE_SHARE), abs=0.01)
    # The pair holds less than half the cache of one server alone: two copies of the weights.
    assert spec + base < 0.75 * alone
    assert pytest.approx(6.19 / (6.19 + 11.00), abs=0.002) == SHARED_SPECULATIVE_SHARE
    with pytest.raises(ProfileError, match="no memory"):
        B8.pool_tokens(40.0, "speculative", shared=True)


def test_acceptance_at_another_draft_depth_follows_chain_drafting() -> None:
    assert accept_at_steps(2.5, 3, 3) == pytest.approx(2.5)
    assert accept_at_steps(2.5, 3, 0) == 1.0
    assert accept_at_steps(4.0, 3, 7) == pytest.approx(8.0)  # every draft accepted
    assert accept_at_steps(1.0, 3, 7) == pytest.approx(1.0)
    # p = 0.5: 3 steps accept 1 + .5 + .25 + .125 = 1.875; 1 step 1.5; 7 steps 2 - 1/128.
    assert accept_at_steps(1.875, 3, 1) == pytest.approx(1.5)
    assert accept_at_steps(1.875, 3, 7) == pytest.approx(2 - 1 / 128)
    assert accept_at_steps(2.5, 3, 1) < 2.5 < accept_at_steps(2.5, 3, 7) < 4.0


def drive(rule: AdaptiveSteps, batch: int, accept_at: dict[int, float], iterations: int) -> list[int]:
    chosen = []
    for _ in range(iterations):
        steps = rule.choose(batch)
        chosen.append(steps)
        rule.observe(batch, steps, accept_at.get(steps, 1.0))
    return chosen


def test_the_adaptive_tiers_by_batch_size() -> None:
    high = {s: accept_at_steps(3.8, 3, s) for s in (0, 1, 3, 5, 7)}
    low = {s: 1.0 for s in (0, 1, 3, 5, 7)}
    # 64 and more (and 57-63, padded to a captured 64): never drafts.
    for batch in (58, 64, 200):
        assert set(drive(AdaptiveSteps(), batch, high, 100)) == {0}
    # 1-4 (padded to at most 4): always drafts, and deeper when drafts are accepted.
    steps = drive(AdaptiveSteps(), 2, high, 100)
    assert 0 not in steps and steps[-1] == 7
    assert drive(AdaptiveSteps(), 3, low, 100)[-1] == 1
    # 8-31: stops drafting when drafts are rejected, and probes one step again at each update
    # (every 5th iteration), so that half the time it drafts one token (as SGLang's rule does).
    rejected = drive(AdaptiveSteps(), 16, low, 200)
    assert rejected[:10] == [3] * 10  # warm-up at the configured depth
    assert rejected[-100:] == ([0] * 5 + [1] * 5) * 10 or rejected[-100:] == ([1] * 5 + [0] * 5) * 10
    assert drive(AdaptiveSteps(), 16, high, 100)[-1] == 3
    # 32-63: at most one step.
    assert set(drive(AdaptiveSteps(), 40, high, 100)) <= {0, 1}


def test_the_first_tier_climbs_through_5_steps_as_v0_5_23_does() -> None:
    # v0.5.23 put 5 between 3 and 7 in the first tier: from 3 steps it goes to 5 first, and only
    # then to 7 when the drafts keep being accepted.
    high = {s: accept_at_steps(3.8, 3, s) for s in (1, 3, 5, 7)}
    steps = drive(AdaptiveSteps(), 1, high, 100)
    assert steps[:10] == [3] * 10
    assert 5 in steps and steps.index(5) < steps.index(7)
    assert steps[-1] == 7


def test_the_first_tier_settles_at_5_steps_where_about_four_drafts_are_accepted() -> None:
    # Four drafts accepted whatever the depth (fewer when fewer are drafted): the smoothed count
    # goes to 4, above 3 steps' rise threshold (2.5) and below 5 steps' (4.5), so it stays at 5,
    # where v0.5.19's tiers (1, 3, 7) went on to 7.
    four = {s: 1.0 + min(s, 4) for s in (1, 3, 5, 7)}
    steps = drive(AdaptiveSteps(), 4, four, 200)
    assert steps[-100:] == [5] * 100


def test_the_first_tier_steps_down_from_7_to_5_before_3() -> None:
    rule = AdaptiveSteps()
    for _ in range(60):  # every draft accepted: it reaches 7 steps
        rule.observe(2, rule.choose(2), 1.0 + rule.choose(2))
    assert rule.choose(2) == 7
    # Two drafts accepted: the smoothed count falls below 4.25 (7 -> 5) at an update before it
    # reaches 2.25 (5 -> 3), so the way down passes through 5.
    chosen = drive(rule, 2, {s: 3.0 for s in (1, 3, 5, 7)}, 100)
    assert chosen.index(5) < chosen.index(3)
    assert chosen[-1] == 3


def test_the_adaptive_choice_waits_out_its_warm_up_and_has_hysteresis() -> None:
    rule = AdaptiveSteps()
    # In the first tier, dropping from 3 to 1 steps needs the smoothed accepted drafts at most 0.25.
    for _ in range(15):
        rule.observe(2, 3, 1.0 + 0.4)
    assert rule.choose(2) == 3
    for _ in range(40):
        rule.observe(2, rule.choose(2), 1.0 + 0.2)
    assert rule.choose(2) == 1


def test_bad_profiles_are_refused_with_their_name() -> None:
    with pytest.raises(ProfileError, match="broken"):
        parse_steptimes("{}", "broken")
    doc = json.loads((PROFILES / "h200-llama8b.json").read_text())
    doc["tables"][0]["target_step_s"]["1"]["1"] = -1
    with pytest.raises(ProfileError, match="positive"):
        parse_steptimes(json.dumps(doc), "negative")
    with pytest.raises(ProfileError, match="cannot read"):
        load_steptimes("/nonexistent/profile.json")
    assert steptime_names() == ["h200-llama8b", "h200-llama70b-tp4"]


def test_the_70b_shard_keeps_its_measured_table_and_marks_the_derived_one() -> None:
    raw = json.loads((PROFILES / "h200-llama70b-tp4.json").read_text())
    measured, derived = raw["tables"]
    assert "derived" not in measured and "not measured" in derived["derived"]
    assert "NOT an inference engine run" in raw["about"]
    b70 = load_steptimes("h200-llama70b-tp4")
    assert b70.target_s(256, 1, 4096) > b70.target_s(256, 1, 1024)


@pytest.mark.skipif(not SHARED.exists(), reason="the shared step-time table is not on this machine")
def test_the_shipped_profiles_are_what_the_shared_table_generates() -> None:
    for name, doc in generate(json.loads(SHARED.read_text())).items():
        assert json.loads((PROFILES / f"{name}.json").read_text()) == json.loads(json.dumps(doc)), name
