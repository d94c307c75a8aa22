"""`python -m loadtest headtohead-classes`'s pure parts: the two-class workload (classes by stream, the
mixed kind's acceptance under the simulator's rule), the request tags, the oracle hit rate, and the
ratios and verdicts against issue 28's targets."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Any

import pytest

from loadtest.__main__ import build_parser
from loadtest.client import RequestResult, Target
from loadtest.experiments.twoclass.plan import (
    CLASSES,
    CONTROL,
    DIRECT,
    ORACLE,
    SCALE_FILE,
    ClassPlan,
    gate_settings,
    pinned_settings,
    smg_argv,
)
from loadtest.experiments.twoclass.pooled import (
    CONFIDENCE,
    POOLED_MIN_RUNS,
    cell_verdict,
    pooled_interval,
    pooled_ratio,
    pooled_split,
    pooled_verdict,
    runs_verdict,
)
from loadtest.experiments.twoclass.report import summary_lines, table
from loadtest.experiments.twoclass.run import (
    calibration_scale_of,
    misrouted,
    oracle_urls,
    pinned_backends,
    through_gates,
)
from loadtest.experiments.twoclass.score import (
    ClassCell,
    goodput_verdict,
    hit_verdict,
    measured_oracle_gap,
    oracle_gap,
    oracle_hit_rate,
    returned_share,
)
from loadtest.kit.multiturn import MAX_STAGGER_S
from loadtest.kit.processes import at_time_scale
from loadtest.kit.settings import DURATIONS, specgate_env
from loadtest.prompts import repetitiveness
from loadtest.textbank import TextBank
from loadtest.workload import TrafficClass, Workload, WorkloadSpec
from proxy.config import ENGINE_SCRAPE_INTERVAL_S, Settings
from proxy.policy.base import LoadSnapshot, PolicyState, Role
from proxy.policy.calibration import Calibration, Curve, ModelFit, StepFit, load, to_json
from proxy.routing.steps.pipeline import decide

from .test_headtohead import tc

MAX_ACCEPT = ClassPlan().max_accept_length


def accept(text: str) -> float:
    """The simulator's --accept-from-prompt rule (server.accept_for) at the plan's max."""
    return 1.0 + (MAX_ACCEPT - 1.0) * repetitiveness(text)


@pytest.mark.parametrize("context", [1000, 8000])
def test_classes_split_by_stream_with_the_accept_lengths_the_issue_names(context: int) -> None:
    spec = ClassPlan().workload(context, 8)
    w = Workload(spec, TextBank(spec.seed))
    seen: dict[str, list[float]] = {"A": [], "B": []}
    for i in range(8):
        script = w.stream(i)
        turn = next(script)
        for _ in range(3):
            assert turn.traffic_class == ("A" if i % 2 == 0 else "B")
            seen[turn.traffic_class].append(accept(turn.prompt.messages[-1]["content"]))
            turn = script.send("a reply")
    assert len(seen["A"]) == len(seen["B"]) == 12
    assert all(1.15 <= a <= 1.45 for a in seen["A"]), seen["A"]
    assert all(2.8 <= b <= 3.2 for b in seen["B"]), seen["B"]


def test_a_mixed_class_is_refused_for_single_requests() -> None:
    with pytest.raises(ValueError, match="mixed"):
        WorkloadSpec("single", classes=(TrafficClass("A", 1.0, "mixed"),))


def test_drawn_classes_are_unchanged_without_classes_by_stream() -> None:
    spec = WorkloadSpec("multiturn", classes=CLASSES, seed=3, system_tokens=50, user_tokens=64, think_time_s=0)
    names = [next(Workload(spec, TextBank(3)).stream(i)).traffic_class for i in range(40)]
    assert {"A", "B"} == set(names)
    assert names[0::2] != ["A"] * 20  # drawn, not by stream


def test_tagged_targets_send_class_and_session_headers() -> None:
    plain = Target("http://x", "m", api_key="k")
    assert plain.headers("A", "1.1") == {"Authorization": "Bearer k"}
    tagged = Target("http://x", "m", tag_requests=True)
    assert tagged.headers("B", "3.2") == {"x-specgate-class": "B", "x-session-id": "3.2"}


def test_gate_settings_turn_the_new_features_off_for_todays_policies() -> None:
    assert gate_settings("threshold") == {"policy": "threshold", "class_key": "none", "affinity_entries": 0}
    assert gate_settings("adaptive")["affinity_entries"] == 0
    assert gate_settings("features") == {"policy": "adaptive", "class_key": "header"}
    with pytest.raises(ValueError):
        gate_settings("all-spec")


def test_specgate_keeps_its_time_settings_meaning_on_the_simulators_clock() -> None:
    """At time scale 0.25 the simulated GPU takes 4 wall seconds for one of its own: every default
    duration is 4 times longer in wall seconds, a rate 4 times slower; what a caller sets is kept."""
    env = specgate_env(8000, "S", "B", 0.25, adaptive_probe_s=3)
    for name in DURATIONS:
        if name != "adaptive_probe_s":
            assert float(env[f"SPECGATE_{name.upper()}"]) == Settings.model_fields[name].default * 4, name
    assert env["SPECGATE_ADAPTIVE_PROBE_S"] == "3"
    step = Settings.model_fields["adaptive_max_step_per_s"].default
    assert float(env["SPECGATE_ADAPTIVE_MAX_STEP_PER_S"]) == step / 4
    assert "SPECGATE_SCRAPE_INTERVAL_S" not in env  # the local signal reads /metrics with the health poll
    engine = specgate_env(8000, "S", "B", 0.25, load_signal="engine")
    assert float(engine["SPECGATE_SCRAPE_INTERVAL_S"]) == ENGINE_SCRAPE_INTERVAL_S * 4
    # Without a time scale, specgate's own defaults.
    assert not any(k.endswith(("_S", "_PER_S")) for k in specgate_env(8000, "S", "B"))


def req(session: str, turn: int, prompt: int, out: int, cached: int | None, started: float = 1.0) -> RequestResult:
    r = RequestResult(started=started, finished=started + 1, ttft=0.1, output_tokens=out, prompt_tokens=prompt)
    r.ok, r.session, r.turn, r.cached_tokens = True, session, turn, cached
    return r


def test_the_oracle_finds_the_system_prompt_and_the_last_turn_cached_in_whole_pages() -> None:
    results = [
        req("s", 1, 200, 100, 96),  # turn 1: the 100-token system prompt -> 96 (6 pages)
        req("s", 2, 500, 100, 288),  # turn 2: 200 + 100 held -> 288 (18 pages)
        req("t", 2, 400, 100, 0),  # its first turn failed or predates the run: nothing held
        req("s", 3, 900, 100, None),  # no cache report: not counted
        req("s", 4, 900, 100, 0, started=50.0),  # outside the window
    ]
    assert oracle_hit_rate(results, 0.0, 10.0, system_tokens=100) == pytest.approx((96 + 288) / 1100)
    assert oracle_hit_rate([], 0.0, 10.0, 100) is None


def cell(
    spec: float, base: float, gates: float, split: bool, conclusive: bool = True, measured: float | None = None
) -> ClassCell:
    """A cell whose classes gain on different servers (`split`); `measured`: the static split's goodput."""
    targets = {
        "all-spec": tc("all-spec", spec, conclusive),
        "all-base": tc("all-base", base),
        **{n: tc(n, gates) for n in ("threshold", "adaptive", "features")},
        **({"split": tc("split", measured)} if measured is not None else {}),
    }
    per_class = {
        "all-spec": {"A": 1.0 if split else 3.0, "B": 3.0},
        "all-base": {"A": 2.0, "B": 1.0},
    }
    return ClassCell(1000, 32, 1.0, targets, per_class, {n: 0.6 for n in targets})


def test_goodput_verdicts_against_the_better_fixed_target() -> None:
    assert cell(10, 8, 11, split=True).ratio("features") == pytest.approx(1.1)
    assert goodput_verdict(cell(10, 8, 11, split=True), "features") == "met"
    assert goodput_verdict(cell(10, 8, 10.5, split=True), "features") == "missed"  # needs 1.10x
    assert goodput_verdict(cell(10, 8, 9.8, split=False), "features") == "met"  # 0.98 >= 0.97
    assert goodput_verdict(cell(10, 8, 9.6, split=False), "features") == "missed"
    assert goodput_verdict(cell(10, 8, 20, split=True, conclusive=False), "features") == "unknown"
    assert cell(10, 8, 11, split=True, conclusive=False).split() is None
    # A split that cost nothing: A's 2.0 on all-base plus B's 3.0 on all-spec, over all-spec's 10.
    assert cell(10, 8, 11, split=True).split_bound() == pytest.approx(0.5)
    assert cell(10, 8, 11, split=True, conclusive=False).split_bound() is None


def test_the_classes_should_split_only_where_the_measured_split_pays() -> None:
    # Each class gains on its own server, but a split measured no better than all-spec (10): on a
    # shared GPU the two servers time-slice it. The cell then only needs 0.97x.
    assert cell(10, 8, 9.8, split=True, measured=8.0).split() is False
    assert goodput_verdict(cell(10, 8, 9.8, split=True, measured=10.4), "features") == "met"  # within 5%
    # A split that pays beyond 5% makes it a split cell: 1.10x needed.
    assert cell(10, 8, 11, split=True, measured=10.6).split() is True
    assert goodput_verdict(cell(10, 8, 10.5, split=True, measured=12.0), "features") == "missed"
    # A split that pays only because both servers are used, not by class, is no split cell.
    assert cell(10, 8, 9.8, split=False, measured=14.0).split() is False
    unmeasured = cell(10, 8, 11, split=True, measured=12.0)
    unmeasured.targets["split"] = dataclasses.replace(unmeasured.targets["split"], conclusive=False)
    assert unmeasured.split() is None and goodput_verdict(unmeasured, "features") == "unknown"
    assert "| yes | 0.50x | 1.20x |" in table(ClassPlan(), [cell(10, 8, 11, split=True, measured=12.0)])
    assert "| 0.50x | - |" in table(ClassPlan(), [cell(10, 8, 11, split=True)])  # from before it was measured


def test_repeated_runs_of_a_cell_agree_or_are_unknown() -> None:
    runs = [dataclasses.replace(cell(10, 8, g, split=False), seed=i) for i, g in enumerate((9.8, 10.2, 9.0))]
    assert [goodput_verdict(c, "features") for c in runs] == ["met", "met", "missed"]
    assert runs_verdict(runs[:2], "features", goodput_verdict) == "met"
    assert runs_verdict(runs, "features", goodput_verdict) == "unknown"  # met on two draws, missed on one
    assert runs_verdict(runs[2:], "features", goodput_verdict) == "missed"
    assert pooled_ratio(runs, "features") == pytest.approx(29.0 / 30.0)
    other = dataclasses.replace(cell(10, 8, 11, split=False), sessions=8)
    lines = summary_lines([*runs, other])
    assert lines[2].startswith("features: goodput target met in 1, missed in 0, unknown in 1 of 2 cells")
    assert "features at 1k/32 over 3 runs (seeds 0, 1, 2): 0.98x, 1.02x, 0.90x; pooled 0.97x: unknown" in lines
    assert "features at 1k/8 over 1 run (seeds 0): 1.10x; pooled 1.10x: met" in lines
    # One run per cell: the summary is as it was.
    assert not any(line.startswith("features at") for line in summary_lines(runs[:1]))
    assert "| 1k | 32 | 2 | 1 |" in table(ClassPlan(), runs)
    assert build_parser().parse_args(["headtohead-classes", "--repeats", "4"]).repeats == 4
    with pytest.raises(ValueError, match="--repeats"):
        ClassPlan(repeats=0)


def draws(goodputs: list[float], split: bool = False) -> list[ClassCell]:
    """Runs of one cell, all-spec 10 the better fixed target, features' goodput as given."""
    return [dataclasses.replace(cell(10, 8, g, split=split), seed=i) for i, g in enumerate(goodputs)]


def test_many_runs_that_disagree_are_judged_by_their_pooled_ratios_interval() -> None:
    # Twelve runs about 1.01x, one missed (0.90x): their pooled interval clears 0.97x.
    steady = draws([10.4, 9.9, 10.3, 10.1, 9.0, 10.5, 10.2, 10.3, 10.0, 10.6, 10.4, 10.1])
    assert runs_verdict(steady, "features", goodput_verdict) == "unknown"
    low, high = pooled_interval(steady, "features") or (0.0, 0.0)
    assert 0.97 < low < (pooled_ratio(steady, "features") or 0.0) < high < 1.05
    assert pooled_interval(steady, "features") == (low, high)  # a fixed seed: the same runs, the same interval
    assert pooled_verdict(steady, "features") == cell_verdict(steady, "features") == "met"
    # Runs that scatter about the floor: the interval straddles it.
    scattered = draws([6.5, 13.0, 9.0, 11.0, 7.0, 12.5, 8.0, 10.5, 9.5, 10.0, 8.5, 11.5])
    assert cell_verdict(scattered, "features") == "unknown"
    # Well short of it on every run but one: missed.
    short = draws([9.0, 9.2, 8.8, 9.1, 9.0, 9.3, 8.9, 9.8, 9.1, 9.0])
    assert cell_verdict(short, "features") == "missed"
    # The goal is 1.10x where the classes should split on the runs pooled: here each gains on its
    # own server (the split itself unmeasured, as before it was).
    split = draws([11.6, 11.2, 11.9, 11.5, 12.0, 10.5, 11.4, 11.7, 11.8, 11.3], split=True)
    assert pooled_split(split) is True and cell_verdict(split, "features") == "met"
    assert cell_verdict(draws([10.6] * 9 + [11.5], split=True), "features") == "missed"
    # Half of them split, half not: class A pooled gains nothing on the baseline, so 0.97x it is.
    mixed = [*split[:5], *steady[:5]]
    assert pooled_split(mixed) is False and pooled_verdict(mixed, "features") == "met"
    # A split measured at 1.03-1.07x, the interval across 1.05x: whether to split is unknown, and
    # 1.05x clears 0.97x but not 1.10x.
    near = [dataclasses.replace(cell(10, 8, 10.5, split=True, measured=m), seed=i)
            for i, m in enumerate([10.3, 10.7, 10.4, 10.6, 10.5, 10.3, 10.7, 10.5, 10.4, 10.6])]  # fmt: skip
    assert pooled_split(near) is None and cell_verdict(near, "features") == "unknown"
    clear = [dataclasses.replace(c, targets={**c.targets, "split": tc("split", 10.2)}) for c in near]
    assert pooled_split(clear) is False and cell_verdict(clear, "features") == "met"
    assert pooled_split(near[: POOLED_MIN_RUNS - 1]) is None
    # With a control, the same policy in the same run: pooled as a second sample of features.
    copied = [with_control(c, 1.2) for c in steady]
    assert pooled_ratio(copied, "features") == pytest.approx((pooled_ratio(steady, "features") or 0.0) * 1.1)
    assert pooled_ratio(copied, "adaptive") == pooled_ratio(steady, "adaptive")
    # Fewer than POOLED_MIN_RUNS: the runs must agree, as before.
    assert pooled_interval(steady[: POOLED_MIN_RUNS - 1], "features") is None
    assert cell_verdict(steady[: POOLED_MIN_RUNS - 1], "features") == "unknown"
    line = next(x for x in summary_lines(steady) if x.startswith("features at 1k/32 over 12 runs"))
    assert line.endswith(f"pooled 1.01x ({CONFIDENCE:.0%} interval {low:.2f}x-{high:.2f}x): met")
    assert summary_lines(steady)[2].startswith("features: goodput target met in 1, missed in 0, unknown in 0")
    # Runs in which features was inconclusive (too slow to finish enough requests: the likeliest to
    # have missed) are not pooled away: past POOLED_MAX_UNKNOWN of them, the pooled verdict is unknown.
    slow = []
    for i in range(2):
        c = dataclasses.replace(cell(10, 8, 1.0, split=False), seed=20 + i)
        slow.append(dataclasses.replace(c, targets={**c.targets, "features": tc("features", 1.0, False)}))
    assert cell_verdict([*steady, slow[0]], "features") == "met"  # 1 of 13
    assert pooled_interval([*steady, *slow], "features") is None  # 2 of 14
    assert cell_verdict([*steady, *slow], "features") == "unknown"
    line = next(x for x in summary_lines([*steady, *slow]) if x.startswith("features at 1k/32 over 14 runs"))
    assert line.endswith("pooled 1.01x, 2 of 14 runs inconclusive: unknown")


def test_a_run_of_features_alone_among_the_gates() -> None:
    light = ClassPlan(gates=("features",))
    assert light.targets == ("all-spec", "all-base", "features", "split")
    assert light.time_scale(32, 8000) == pytest.approx(ClassPlan().time_scale(32, 8000) * 6 / 4, rel=1e-3)
    assert ClassPlan(gates=("features", "threshold")).targets[2:4] == ("threshold", "features")
    with pytest.raises(ValueError, match="--gates"):
        ClassPlan(gates=("adaptive",))
    c = cell(10, 8, 9.8, split=False)
    for gone in ("threshold", "adaptive"):
        c.targets.pop(gone)
    text = table(light, [c])
    assert "features / best" in text and "adaptive / best" not in text and "0.98x (met) | - |" in text
    assert summary_lines([c])[0].startswith("features: goodput target met in 1")
    assert build_parser().parse_args(["headtohead-classes", "--gates", "features"]).gates == ("features",)
    with pytest.raises(SystemExit):
        build_parser().parse_args(["headtohead-classes", "--gates", "adaptive"])


def with_control(c: ClassCell, factor: float, conclusive: bool = True) -> ClassCell:
    """`c` with a control (a second features) of `factor` times features' goodput."""
    control = tc(CONTROL, c.targets["features"].goodput_req_s * factor, conclusive)
    return dataclasses.replace(c, targets={**c.targets, CONTROL: control})


def test_a_control_makes_a_ratio_within_the_runs_noise_unknown() -> None:
    # all-spec 10 is the better fixed target; features and its copy (the control) 10% apart.
    noisy = with_control(cell(10, 8, 9.8, split=False), 1.1)
    assert noisy.noise() == pytest.approx(0.1)
    assert goodput_verdict(noisy, "features") == "unknown"  # 0.98x: within 0.1 of 0.97x either way
    assert goodput_verdict(with_control(cell(10, 8, 10.8, split=False), 0.9), "features") == "met"  # 1.08 - 0.1
    assert goodput_verdict(with_control(cell(10, 8, 8.6, split=False), 1.1), "features") == "missed"  # 0.86 + 0.1
    assert goodput_verdict(with_control(cell(10, 8, 12.1, split=True), 1.1), "features") == "met"  # 1.21 - 0.1
    assert goodput_verdict(with_control(cell(10, 8, 11.5, split=True), 1.1), "features") == "unknown"
    # A copy that matched: judged as without one; an inconclusive one: nothing is known.
    assert goodput_verdict(with_control(cell(10, 8, 9.8, split=False), 1.0), "features") == "met"
    assert goodput_verdict(with_control(cell(10, 8, 9.8, split=False), 1.0, False), "features") == "unknown"
    assert cell(10, 8, 9.8, split=False).noise() == 0.0
    plan = ClassPlan(control=True)
    assert CONTROL in plan.targets and CONTROL not in ClassPlan().targets
    assert gate_settings(CONTROL) == gate_settings("features")
    text = table(plan, [noisy])
    assert "| control / features |" in text and "| 1.10x |" in text and "0.98x (unknown)" in text
    runs = [dataclasses.replace(noisy, seed=i) for i in range(2)]
    assert "control / features at 1k/32 (the noise): 1.10x, 1.10x" in summary_lines(runs)
    assert build_parser().parse_args(["headtohead-classes", "--control"]).control is True


def test_a_specgate_that_served_where_neither_fixed_target_did_met_its_target() -> None:
    c = cell(0.0, 0.0, 1.5, split=False)  # every pool overflowed: the fixed targets met no SLO
    assert c.ratio("features") is None and c.served_alone("features")
    assert goodput_verdict(c, "features") == "met"
    assert "served, fixed 0 (met)" in table(ClassPlan(), [c])
    # Its copy served none: luck, not the policy; judged on throughput as where neither served any.
    assert goodput_verdict(with_control(c, 0.0), "features") == "met on tok/s"
    assert goodput_verdict(with_control(c, 0.5), "features") == "met"
    # It served none, its copy some: on throughput too (until 2026-12-07, late: unknown).
    none = dataclasses.replace(c, targets={**c.targets, "features": tc("features", 0.0)})
    assert goodput_verdict(with_control(none, 0.0), "features") == "met on tok/s"
    copy = tc(CONTROL, 0.5)
    assert goodput_verdict(dataclasses.replace(none, targets={**none.targets, CONTROL: copy}), "features") == (
        "met on tok/s"
    )
    # Runs met one way and the other agree, tagged as judged on throughput.
    runs = [dataclasses.replace(c, seed=0), dataclasses.replace(with_control(none, 0.0), seed=1)]
    assert cell_verdict(runs, "features") == "met on tok/s"
    # Unknown on throughput in every run: said so, not pooled into a plain unknown.
    noisy = dataclasses.replace(
        with_control(none, 0.0),
        targets={**none.targets, CONTROL: dataclasses.replace(tc(CONTROL, 0.0), output_tok_s=1e9)},
    )
    assert goodput_verdict(noisy, "features") == "unknown on tok/s"
    assert cell_verdict([noisy, dataclasses.replace(noisy, seed=1)], "features") == "unknown on tok/s"
    # A fixed figure inconclusive: nothing known.
    assert goodput_verdict(cell(0.0, 0.0, 1.5, split=False, conclusive=False), "features") == "unknown"
    runs = [dataclasses.replace(c, seed=i) for i in range(2)]
    assert "features at 1k/32 over 2 runs (seeds 0, 1): served, fixed 0, served, fixed 0; pooled unknown: met" in (
        summary_lines(runs)
    )


def test_hit_verdict_within_five_points_of_the_oracle() -> None:
    c = cell(10, 8, 11, split=True)  # every measured hit rate 0.5 (tc), oracle 0.6
    assert hit_verdict(c, "features") == "missed"
    c.oracle_hit["features"] = 0.54
    assert hit_verdict(c, "features") == "met"
    c.oracle_hit["features"] = None
    assert hit_verdict(c, "features") == "unknown"
    # Where nobody met the SLOs every pool overflowed: no one can near an oracle that evicts nothing.
    c.oracle_hit["features"] = 0.9
    assert hit_verdict(c, "features") == "missed"
    for name in c.targets:
        c.targets[name] = dataclasses.replace(c.targets[name], goodput_req_s=0.0)
    assert hit_verdict(c, "features") == "unknown"
    # Every later turn back on its session's server is shown, not counted: an oracle that placed
    # the first turns better could have found more cached.
    assert hit_verdict(dataclasses.replace(c, returned={"features": 1.0}), "features") == "unknown"
    # There the best oracle routing measured beside it is the measure: the oracle target, all-spec
    # and all-base (each returns every turn to its server), each short of its own estimate by what
    # its pools evicted. features is 0.9 - 0.5 short of its own.
    for name in ("all-spec", "all-base", ORACLE):
        c.oracle_hit[name] = 0.9
    for oracle_rate, verdict in ((0.5, "met"), (0.56, "missed"), (0.54, "met"), (0.3, "met")):
        c.targets[ORACLE] = dataclasses.replace(tc(ORACLE, 0.0), prefix_cache_hit_rate=oracle_rate)
        assert hit_verdict(c, "features") == verdict
        assert measured_oracle_gap(c, "features") == pytest.approx(max(oracle_rate - 0.5, 0.0))
    c.oracle_hit["all-base"] = 0.6  # all-base lost 0.1 only, features 0.4
    assert hit_verdict(c, "features") == "missed" and measured_oracle_gap(c, "features") == pytest.approx(0.3)
    c.targets[ORACLE] = tc(ORACLE, 0.0, conclusive=False)
    assert hit_verdict(c, "features") == "unknown" and measured_oracle_gap(c, "features") is None
    del c.targets[ORACLE]
    assert hit_verdict(c, "features") == "unknown"  # no oracle run
    # ...and only there: where a fixed target served some, the oracle that evicts nothing still is.
    c.targets["all-base"] = tc("all-base", 8.0)
    c.targets[ORACLE] = tc(ORACLE, 0.0)
    assert hit_verdict(c, "features") == "missed"  # 0.9 - 0.5, the measured routings not asked


def test_where_nobody_met_the_slos_throughput_decides() -> None:
    # 128 conversations of 8k on one GPU: no routing meets the SLOs for any request.
    def overloaded(spec_tok_s: float, base_tok_s: float, gate_tok_s: float, conclusive: bool = True) -> ClassCell:
        c = cell(0.0, 0.0, 0.0, split=False)
        tok = {"all-spec": spec_tok_s, "all-base": base_tok_s}
        targets = {n: dataclasses.replace(t, output_tok_s=tok.get(n, gate_tok_s)) for n, t in c.targets.items()}
        targets["all-base"] = dataclasses.replace(targets["all-base"], conclusive=conclusive)
        return dataclasses.replace(c, targets=targets)

    assert overloaded(500, 1000, 990).throughput_ratio("features") == pytest.approx(0.99)
    assert goodput_verdict(overloaded(500, 1000, 990), "features") == "met on tok/s"
    assert goodput_verdict(overloaded(500, 1000, 900), "features") == "missed on tok/s"
    # A fixed figure inconclusive: nothing known of either.
    assert goodput_verdict(overloaded(500, 1000, 990, conclusive=False), "features") == "unknown"
    # With a control, by more than the copies' distance in throughput.
    c = overloaded(500, 1000, 1000)
    copy = dataclasses.replace(c.targets["features"], target=CONTROL, output_tok_s=1050.0)
    noisy = dataclasses.replace(c, targets={**c.targets, CONTROL: copy})
    assert noisy.throughput_noise() == pytest.approx(0.05)
    assert goodput_verdict(noisy, "features") == "unknown on tok/s"  # 1.00 - 0.05 < 0.97
    low = dataclasses.replace(
        noisy,
        targets={
            **noisy.targets,
            "features": dataclasses.replace(noisy.targets["features"], output_tok_s=935.0),
            CONTROL: dataclasses.replace(copy, output_tok_s=950.0),
        },
    )
    assert goodput_verdict(low, "features") == "missed on tok/s"  # 0.935 + 0.016 < 0.97
    copy_far = dataclasses.replace(copy, output_tok_s=1000.0)  # 0.935 + 0.07 >= 0.97
    assert goodput_verdict(dataclasses.replace(low, targets={**low.targets, CONTROL: copy_far}), "features") == (
        "unknown on tok/s"
    )
    assert "fixed served none, tok/s 0.99x (met on tok/s)" in table(ClassPlan(), [overloaded(500, 1000, 990)])
    # Counted apart from the goodput target's own verdicts.
    line = next(x for x in summary_lines([overloaded(500, 1000, 990)]) if x.startswith("features:"))
    assert line.startswith("features: goodput target met in 0, missed in 0, unknown in 1 of 1 cells (where neither")
    assert "on output tokens a second: met in 1, missed in 0, unknown in 0)" in line
    # Anyone who served some: goodput decides, as before.
    assert (
        goodput_verdict(
            dataclasses.replace(
                overloaded(500, 1000, 2000),
                targets={**overloaded(500, 1000, 2000).targets, "all-base": tc("all-base", 1.0)},
            ),
            "features",
        )
        == "missed"
    )


def test_a_turn_back_on_its_sessions_role_is_counted_over_the_window() -> None:
    def turn(session: str, n: int, backend: str | None, started: float = 1.0, ok: bool = True) -> RequestResult:
        return RequestResult(started=started, ok=ok, backend=backend, session=session, turn=n)

    results = [
        turn("z", 1, "baseline"),
        turn("z", 2, "speculative", started=11.0),  # after the window: not counted
        turn("y", 1, "baseline", ok=False),
        turn("y", 2, "speculative"),  # its turn before failed: unknown, not counted
        turn("a", 1, "speculative", started=-1.0),  # before the window: a turn before, not counted
        turn("a", 2, "speculative"),
        turn("a", 3, "baseline"),  # moved
        turn("b", 1, "baseline"),
        turn("b", 2, "baseline"),
        turn("c", 2, "baseline"),  # its turn before is unknown
        turn("d", 1, None),
        turn("d", 2, "baseline"),  # its turn before named no role
        turn("e", 1, "baseline"),
        turn("e", 2, "speculative", ok=False),  # failed: not counted
    ]
    assert returned_share(results, 0.0, 10.0) == pytest.approx(2 / 3)
    assert returned_share([turn("b", 1, "baseline"), turn("b", 2, "baseline")], 0.0, 10.0) == 1.0
    assert returned_share([turn("x", 1, None), turn("x", 2, None)], 0.0, 10.0) is None


def test_features_hit_rate_against_smgs_each_against_its_own_oracle() -> None:
    c = cell(10, 8, 11, split=True)
    c.targets["features"] = dataclasses.replace(c.targets["features"], prefix_cache_hit_rate=0.70)
    c.targets["smg"] = dataclasses.replace(tc("smg", 9), prefix_cache_hit_rate=0.71)
    c.oracle_hit.update(features=0.72, smg=0.74)
    assert oracle_gap(c, "features") == pytest.approx(0.02) and oracle_gap(c, "smg") == pytest.approx(0.03)
    # Below smg's hit rate, yet nearer its own oracle: smg's requests were easier to hit.
    assert summary_lines([c])[-1] == (
        "features against smg: hit rate at least smg's in 0 of 1 cells where both are known; "
        "no further from its own oracle than smg from its own in 1"
    )
    assert "| +2.0 / +3.0 |" in table(ClassPlan(smg="/x/smg"), [c])
    # Without smg, or with either unknown, nothing is said.
    c.oracle_hit["smg"] = None
    assert oracle_gap(c, "smg") is None and not summary_lines([c])[-1].startswith("features against smg")
    assert "short of own oracle" not in table(ClassPlan(), [cell(10, 8, 11, split=True)])


def test_table_and_parser() -> None:
    text = table(ClassPlan(), [cell(10, 8, 11, split=True)])
    assert "1.10x (met)" in text and "| yes | 0.50x |" in text
    args = build_parser().parse_args(["headtohead-classes", "--contexts", "1k", "--sessions", "8,32"])
    assert args.contexts == (1000,) and args.sessions == (8, 32)


def test_the_streams_first_sessions_are_staggered_on_the_simulators_clock() -> None:
    plan = ClassPlan(stagger_s=12.0)
    assert plan.workload(8000, 32).stagger_s == pytest.approx(12.0 / plan.time_scale(32, 8000))
    assert ClassPlan().stagger_s > 0  # by default: the conversations do not open at once
    assert ClassPlan(stagger_s=0.0).workload(1000, 8).stagger_s == 0.0
    with pytest.raises(ValueError, match="--stagger-s"):
        ClassPlan(stagger_s=MAX_STAGGER_S + 1)
    args = build_parser().parse_args(["headtohead-classes", "--stagger-s", "0"])
    assert args.stagger_s == 0.0


def test_calibration_brackets_the_top_sessions_and_smg_is_a_sixth_target() -> None:
    assert ClassPlan(sessions=(8, 32, 128)).calibration_levels() == (4, 16, 64, 256)
    assert ClassPlan(sessions=(8, 16)).calibration_levels() == (4, 16)
    assert ClassPlan(sessions=(1000,)).calibration_levels() == (4, 16, 64, 256)
    plain, peer = ClassPlan(), ClassPlan(smg="/x/smg")
    assert "smg" not in plain.targets and peer.targets[-1] == "smg"
    assert plain.targets[-1] == "split" and len(plain.targets) == 6
    assert peer.time_scale(32, 1000) == pytest.approx(plain.time_scale(32, 1000) * 6 / 7, rel=1e-3)
    argv = smg_argv("/x/smg", 1, 2, ["http://a", "http://b"])
    assert argv[argv.index("--policy") + 1] == "cache_aware" and argv[argv.index("--worker-urls") + 1 :][:2] == [
        "http://a",
        "http://b",
    ]


def test_the_oracle_keeps_each_stream_on_one_of_its_pairs_servers() -> None:
    plan = ClassPlan(oracle=True)
    assert plan.targets[-1] == ORACLE and ORACLE not in ClassPlan().targets
    # Stream i is of class i mod 2: each server gets as many streams of each class.
    urls = oracle_urls(plan, "http://s", "http://b")
    spec = plan.workload(1000, 8)
    classes = [Workload(spec, TextBank(0)).stream(i).send(None).traffic_class for i in range(4)]
    dealt = [Target("http://s", "m", stream_urls=urls).for_stream(i).url for i in range(4)]
    assert sorted(zip(dealt, classes, strict=True)) == [
        ("http://b", "A"), ("http://b", "B"), ("http://s", "A"), ("http://s", "B")
    ]  # fmt: skip
    assert oracle_urls(ClassPlan(classes="B"), "http://s", "http://b") == ("http://s", "http://b")
    # Any count: each class within one of even over the two, and the two within one in all.
    for streams in (2, 6, 7, 9, 10):
        dealt = [Target("x", "m", stream_urls=urls).for_stream(i).url for i in range(streams)]
        classes = [Workload(spec, TextBank(0)).stream(i).send(None).traffic_class for i in range(streams)]
        for k in ("A", "B", None):
            on = [u for u, c in zip(dealt, classes, strict=True) if k is None or c == k]
            assert abs(on.count("http://s") - on.count("http://b")) <= 1, (streams, k)
    assert plan.time_scale(32, 1000) == pytest.approx(ClassPlan().time_scale(32, 1000) * 6 / 7, rel=1e-3)
    oracle = Target("http://s", "m", tag_requests=True, stream_urls=("http://s", "http://b"))
    assert [oracle.for_stream(i).url for i in range(4)] == ["http://s", "http://b", "http://s", "http://b"]
    assert oracle.for_stream(1).for_stream(0).url == "http://b"  # a stream's target stays its own
    assert Target("http://x", "m").for_stream(3).url == "http://x"
    assert build_parser().parse_args(["headtohead-classes", "--oracle"]).oracle is True
    c = cell(10, 8, 11, split=True)  # each 0.1 short of its own estimate
    c.targets[ORACLE] = dataclasses.replace(tc(ORACLE, 0.0), prefix_cache_hit_rate=0.58)
    c.oracle_hit[ORACLE] = 0.6  # 0.02 short: features 0.08 more
    text = table(plan, [c])
    assert "features short of oracle |" in text and "| +8.0 |" in text
    assert any(line.startswith("features against the best oracle routing measured beside it") and
               "within 5% of it or above in 0 of 1 cells" in line for line in summary_lines([c]))  # fmt: skip


def test_single_class_and_pooled_runs() -> None:
    one = ClassPlan(classes="B")
    assert [(c.name, c.share, c.kind) for c in one.traffic()] == [("B", 1.0, "repetitive")]
    assert [c.name for c in ClassPlan().traffic()] == ["A", "B"]
    c = cell(10, 8, 9.8, split=False)
    c.class_goodput["all-spec"].pop("A")
    c.class_goodput["all-base"].pop("A")
    assert c.split() is False and goodput_verdict(c, "features") == "met"  # one class: nothing to split
    assert c.versus("features", "adaptive") == pytest.approx(1.0)
    assert "| -/3.00 |" in table(one, [c]) and "| 1.00x |" in table(one, [c])
    # Pooled: a simulator pair on a GPU each, specgate told so.
    assert "--shared-gpu" in ClassPlan().pair(1.0, 1, 2)
    assert "--shared-gpu" not in ClassPlan(topology="pooled").pair(1.0, 1, 2)
    args = build_parser().parse_args(["headtohead-classes", "--topology", "pooled", "--classes", "B"])
    assert (args.topology, args.classes) == ("pooled", "B")


def test_the_gates_read_the_calibration_in_their_cells_wall_seconds(tmp_path: Path) -> None:
    """Calibrated at time scale 0.5, read at 0.15: every throughput 0.3 times, every time 1/0.3
    times; acceptance, classes and watermarks as they were. Before, a cell's gates read a file made
    at another scale, and saw each server they had measured at 0.3-0.5 of its calibration."""
    nan = float("nan")
    cal = Calibration(
        levels=(4, 64),
        speculative=Curve((400.0, 3100.0), (10.0, nan), (1.8, 2.2)),
        baseline=Curve((290.0, 2600.0), (13.0, 20.0)),
        accept_length=2.0,
        high_watermark=93,
        low_watermark=69,
        verdict="crosses",
        classes={"A": 1.25, "B": 3.0},
        model=ModelFit(StepFit(0.006, 1e-4, 3e-8), StepFit(0.005, 8e-5, 3e-8), (1000, 4000), 128, 2.0),
    )
    src = tmp_path / "calibration.json"
    src.write_text(json.dumps(to_json(cal)))
    out = load(str(at_time_scale(src, 0.5, 0.15, tmp_path / "at.json")))
    assert out.speculative.output_tok_s == pytest.approx((120.0, 930.0))
    assert out.baseline.mean_tpot_ms == pytest.approx((13 / 0.3, 20 / 0.3))
    assert out.speculative.mean_tpot_ms[0] == pytest.approx(10 / 0.3) and math.isnan(out.speculative.mean_tpot_ms[1])
    assert out.speculative.accept_length == (1.8, 2.2) and out.classes == cal.classes
    assert (out.high_watermark, out.low_watermark, out.levels) == (93, 69, (4, 64))
    assert out.model is not None and out.model.speculative.a == pytest.approx(0.02)
    assert out.model.baseline.b == pytest.approx(8e-5 / 0.3) and out.model.prompt_tokens == (1000, 4000)
    # The scale a calibration ran at is kept beside it; a file from before, the plan's.
    plan = ClassPlan()
    assert calibration_scale_of(plan, src, 1000) == plan.calibration_scale(1000)
    (tmp_path / SCALE_FILE).write_text(json.dumps({"time_scale": 0.7}))
    assert calibration_scale_of(plan, src, 1000) == 0.7


@pytest.mark.parametrize(
    ("role", "load"), [("speculative", 0), ("speculative", 5_000), ("baseline", 0), ("baseline", 1)]
)
def test_a_pinned_gate_sends_every_request_to_its_role(role: str, load: int) -> None:
    pinned: dict[str, Any] = pinned_settings(role)
    settings = Settings(_env_file=None, speculative_url="http://127.0.0.1:1", **pinned)
    cfg = settings.policy_config(None)
    up = {Role.SPECULATIVE: True, Role.BASELINE: True}
    state = PolicyState()
    for n in (load, load + 1, 0):  # up, then down again: the mode never leaves the role
        d = decide(LoadSnapshot({Role.SPECULATIVE: n, Role.BASELINE: 0}, {}, up), state, cfg)
        assert d.backend == Role(role)
        state = d.state
    assert settings.class_key == "none" and settings.affinity_entries == 0 and settings.policy == "threshold"
    with pytest.raises(ValueError, match="role"):
        pinned_settings("features")


def test_fixed_targets_through_a_gate_run_the_baseline_straight_beside_them() -> None:
    plan = ClassPlan(gates=("features",), control=True, fixed_through="specgate")
    assert plan.targets == ("all-spec", "all-base", "features", "split", CONTROL, DIRECT)
    assert DIRECT not in ClassPlan().targets and not ClassPlan().gated_fixed
    with pytest.raises(ValueError, match="--fixed-through"):
        ClassPlan(fixed_through="nginx")
    args = build_parser().parse_args(["headtohead-classes", "--fixed-through", "specgate"])
    assert args.fixed_through == "specgate"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["headtohead-classes", "--fixed-through", "nginx"])


def test_the_hop_is_all_base_through_its_gate_over_the_baseline_straight() -> None:
    plan = ClassPlan(gates=("features",), fixed_through="specgate")
    runs = []
    for i in range(POOLED_MIN_RUNS):
        c = cell(10, 8, 9.8, split=False)
        for gone in ("threshold", "adaptive"):
            c.targets.pop(gone)
        base = c.targets["all-base"].goodput_req_s
        runs.append(dataclasses.replace(c, seed=i, targets={**c.targets, DIRECT: tc(DIRECT, base / 0.95, True)}))
    assert "| all-base / base-direct |" in table(plan, runs[:1]) and "| 0.95x |" in table(plan, runs[:1])
    direct = next(x for x in summary_lines(runs) if x.startswith(f"features at 1k/32 over {DIRECT}"))
    assert direct.endswith(
        f"over {DIRECT}: pooled 1.16x (90% interval 1.16x-1.16x) over 8 of 8 runs"
    )  # 9.8 / (8 / 0.95)
    hop = next(x for x in summary_lines(runs) if x.startswith("the hop at 1k/32"))
    assert hop.startswith(f"the hop at 1k/32: all-base / {DIRECT} pooled 0.95x") and "interval 0.95x-0.95x" in hop
    # One run: no interval; an inconclusive baseline: unknown; no DIRECT: no line.
    assert "interval" not in next(x for x in summary_lines(runs[:1]) if x.startswith("the hop"))
    dark = dataclasses.replace(runs[0], targets={**runs[0].targets, DIRECT: tc(DIRECT, 1.0, False)})
    assert f"the hop at 1k/32: all-base / {DIRECT} unknown" in summary_lines([dark])
    assert not any(x.startswith("the hop") for x in summary_lines([cell(10, 8, 9.8, split=False)]))


def test_pinned_gates_front_their_targets_pair_with_the_other_role_closed() -> None:
    plan = ClassPlan(gates=("features",), fixed_through="specgate")
    pairs = {t: {"speculative": f"http://s-{t}", "baseline": f"http://b-{t}"} for t in plan.targets}
    gates = pinned_backends(plan, pairs, "http://closed")
    assert gates == {
        ("all-spec", "speculative"): {"speculative": "http://s-all-spec", "baseline": "http://closed"},
        ("all-base", "baseline"): {"speculative": "http://closed", "baseline": "http://b-all-base"},
        ("split", "baseline"): {"speculative": "http://closed", "baseline": "http://b-split"},
        ("split", "speculative"): {"speculative": "http://s-split", "baseline": "http://closed"},
    }
    urls, class_urls = through_gates({k: f"http://gate-{k[0]}-{k[1]}" for k in gates})
    assert urls == {
        "all-spec": "http://gate-all-spec-speculative",
        "all-base": "http://gate-all-base-baseline",
        "split": "http://gate-split-speculative",
    }
    assert class_urls == {"split": {"A": "http://gate-split-baseline", "B": "http://gate-split-speculative"}}
    one = ClassPlan(gates=("features",), fixed_through="specgate", classes="A")
    assert set(pinned_backends(one, pairs, "http://closed")) == {("all-spec", "speculative"), ("all-base", "baseline")}
    assert through_gates({("all-base", "baseline"): "http://g"}) == ({"all-base": "http://g"}, {})


def test_a_request_a_pinned_gate_sent_to_the_other_role_is_counted() -> None:
    def result(backend: str | None, traffic_class: str = "A") -> RequestResult:
        return RequestResult(started=0.0, ok=backend is not None, backend=backend, traffic_class=traffic_class)

    assert misrouted("all-base", [result("baseline"), result(None), result("speculative")]) == 1
    assert misrouted("all-spec", [result("speculative"), result("baseline"), result("baseline")]) == 2
    split = [result("baseline", "A"), result("speculative", "B"), result("speculative", "A")]
    assert misrouted("split", split) == 1
    assert misrouted("features", [result("speculative"), result("baseline")]) == 0  # not pinned
