"""`loadtest defaultpolicy`'s plan, arms' settings and scoring (loadtest/experiments/defaultpolicy/):
pure, no process started."""

from __future__ import annotations

import itertools
import json
import math
from pathlib import Path

import pytest

from loadtest.__main__ import build_parser, main
from loadtest.experiments.defaultpolicy.cli import is_protocol, protocol_of, report, save
from loadtest.experiments.defaultpolicy.protocol import (
    ADAPTIVE,
    ARMS,
    CALIBRATED,
    LEVELS,
    MISS,
    PASS,
    THRESHOLD,
    UNKNOWN,
    ArmLevel,
    PairRun,
    Protocol,
    arm_order,
    better,
    level_figure,
    overall,
    plan,
    ratio,
    round_levels,
    score_pair,
    target_verdict,
)
from loadtest.experiments.defaultpolicy.run import arm_env, arm_level, sweep_args
from loadtest.stats import LevelStats


def parse(*argv: str) -> Protocol:
    return protocol_of(build_parser().parse_args(["defaultpolicy", *argv]))


def figures(tok_s: float, good: bool = True, tpot: float = 10.0, client_errors: int = 0) -> ArmLevel:
    return ArmLevel(tok_s, tpot, completed=40, errors=0, client_errors=client_errors, conclusive=good)


def pair_run(levels: dict[int, tuple[float, float, float]], rounds: int = 2) -> PairRun:
    """A run whose every round measured calibrated, adaptive, threshold at these tok/s."""
    run = PairRun("crossover", (20, 15))
    for r in range(rounds):
        run.rounds[r] = {c: {a: figures(x) for a, x in zip(ARMS, tok, strict=True)} for c, tok in levels.items()}
    return run


def test_the_defaults_are_the_protocol_and_a_subset_is_a_smoke_test() -> None:
    assert is_protocol(parse())
    assert parse().pairs[0].levels == LEVELS
    smoke = parse("--pairs", "crossover", "--levels", "1,250", "--rounds", "1")
    assert not is_protocol(smoke)
    assert [p.name for p in smoke.pairs] == ["crossover"] and smoke.pairs[0].levels == (1, 250)


@pytest.mark.parametrize(
    ("argv", "said"),
    [(("--pairs", "nope"), "--pairs: unknown nope"), (("--levels", "3"), "--levels: 3 not in the grid")],
)
def test_bad_arguments_are_said_not_raised(
    argv: tuple[str, ...], said: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["defaultpolicy", "--dry-run", *argv]) == 2
    assert said in capsys.readouterr().err


def test_rounds_climb_then_descend_and_every_arm_leads_in_turn() -> None:
    assert round_levels((5, 1, 2), 0) == (1, 2, 5)
    assert round_levels((5, 1, 2), 1) == (5, 2, 1)
    firsts = [arm_order(step)[0] for step in range(3)]
    assert sorted(firsts) == sorted(ARMS)
    steps = plan(Protocol(), Protocol().pairs[0])
    assert len(steps) == 2 * len(LEVELS)
    assert all(sorted(order) == sorted(ARMS) for _, _, order in steps)
    # The order rotates at every level, the turn from climbing to descending included.
    assert all(a[2][0] != b[2][0] for a, b in itertools.pairwise(steps))


def test_each_arm_names_its_policy_and_only_calibrated_reads_the_file() -> None:
    pair = Protocol().pairs[1]
    env = {arm: arm_env(arm, pair, Path("/x/cal.json"), 9000, "http://s", "http://b") for arm in ARMS}
    assert env[CALIBRATED]["SPECGATE_POLICY"] == "threshold"
    assert env[CALIBRATED]["SPECGATE_CALIBRATION"] == "/x/cal.json"
    assert env[ADAPTIVE]["SPECGATE_POLICY"] == "adaptive" and "SPECGATE_CALIBRATION" not in env[ADAPTIVE]
    assert env[THRESHOLD]["SPECGATE_POLICY"] == "threshold" and "SPECGATE_CALIBRATION" not in env[THRESHOLD]
    assert "SPECGATE_HIGH_WATERMARK" not in env[THRESHOLD]  # 16/8 by default, not set here
    # Time settings on the simulators' clock: the 15 s probe interval at time scale 0.5.
    assert float(env[ADAPTIVE]["SPECGATE_ADAPTIVE_PROBE_S"]) == pytest.approx(15.0 / 0.5)


def test_windows_are_simulated_seconds_and_figures_come_back_simulated() -> None:
    protocol, pair = Protocol(), Protocol().pairs[1]
    args = sweep_args(protocol, pair)
    assert args.duration_s == pytest.approx(protocol.window_s / 0.5)
    assert args.prompts == "diverse" and args.max_tokens == protocol.max_tokens
    stats = LevelStats(
        10, 20.0, 40, 0, 300.0, 2.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 30.0, 1.0, 1.0, {"speculative": 0.25}
    )
    found = arm_level(stats, 0.3, (19, 14))
    assert found.output_tok_s == pytest.approx(1000.0) and found.mean_tpot_ms == pytest.approx(9.0)
    assert (found.speculative_share, found.high, found.low) == (0.25, 19, 14)


def test_a_ratio_is_unknown_where_either_arm_is_not_good() -> None:
    assert ratio(figures(95.0), figures(100.0)) == pytest.approx(0.95)
    assert ratio(figures(95.0, good=False), figures(100.0)) is None
    assert ratio(figures(95.0), figures(100.0, client_errors=10)) is None  # 10 of 50 lost on the client
    assert ratio(figures(95.0), figures(0.0)) is None


def test_a_level_is_the_median_of_its_rounds_and_unknown_where_any_round_is() -> None:
    assert level_figure([0.9, 1.0]) == pytest.approx(0.95)
    assert level_figure([0.9, None]) is None
    assert level_figure([]) is None


def test_the_target_misses_on_one_level_and_is_not_shown_where_a_level_is_unknown() -> None:
    run = pair_run({1: (100.0, 97.0, 98.0), 30: (100.0, 94.0, 100.0), 250: (100.0, 100.0, 60.0)})
    scores = score_pair(run, (1, 30, 250))
    assert [s.verdicts[ADAPTIVE] for s in scores] == [PASS, MISS, PASS]
    assert [s.verdicts[THRESHOLD] for s in scores] == [PASS, PASS, MISS]
    assert [s.better for s in scores] == ["even", THRESHOLD, ADAPTIVE]
    assert target_verdict(scores) == MISS
    run.rounds[1][30][CALIBRATED] = figures(100.0, good=False)
    run.rounds[0][30][ADAPTIVE] = figures(100.0)
    assert target_verdict(score_pair(run, (1, 30, 250))) == UNKNOWN
    assert overall([PASS, PASS]) == PASS and overall([PASS, UNKNOWN]) == UNKNOWN and overall([]) == UNKNOWN
    assert better(None, 1.0) == UNKNOWN


def test_report_has_tables_and_an_incomplete_run_concludes_nothing(tmp_path: Path) -> None:
    protocol = parse("--pairs", "crossover", "--levels", "1,30", "--rounds", "2")
    run = pair_run({1: (100.0, 97.0, 99.0), 30: (100.0, 98.0, 80.0)})
    run.rounds[0][1][ADAPTIVE] = ArmLevel(97.0, math.nan, 40, 0, 0, True)
    found = report(protocol, [run])
    assert found["target"][ADAPTIVE]["overall"] == PASS
    assert found["target"][THRESHOLD]["overall"] == MISS
    assert "| 30 |" in found["tables"]["crossover"]
    assert report(parse(), [run])["target"][ADAPTIVE]["overall"].startswith("unknown")
    save(tmp_path / "d.json", found)
    data = json.loads((tmp_path / "d.json").read_text())
    assert data["tables"] and data["runs"][0]["rounds"]["0"]["1"]["adaptive"]["mean_tpot_ms"] is None
