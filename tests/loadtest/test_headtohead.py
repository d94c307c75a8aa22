"""`python -m loadtest headtohead`'s pure parts: the sizes that give a mean context, the time scale and
SLO conversion, scoring (goodput, conclusiveness, wins and losses), the verdict's wording and the table."""

from __future__ import annotations

import argparse
import math

import pytest

from loadtest.__main__ import build_parser
from loadtest.classes import ClassSummary
from loadtest.headtohead import Cell, HeadPlan, TargetCell, best_target, compare, plan_of, sizes_for, target_cell
from loadtest.headtohead.report import cell_table, verdicts, warnings
from loadtest.kit.multiturn import default_time_scale, mean_prompt, parse_context
from loadtest.simulator.wire import _chat_prompt_tokens, token_text
from loadtest.stats import LevelStats
from loadtest.textbank import TextBank
from loadtest.workload import Workload


def tc(
    target: str, goodput: float, conclusive: bool = True, tok_s: float = 1000.0, queued: float | None = None
) -> TargetCell:
    return TargetCell(
        target=target, completed=50, errors=0, client_errors=0, min_ok=10, conclusive=conclusive,
        output_tok_s=tok_s, goodput_req_s=goodput, goodput_share=1.0, prefix_cache_hit_rate=0.5,
        mean_prompt_tokens=1000.0, p50_ttft_ms=100.0, p99_ttft_ms=200.0, p50_tpot_ms=10.0, p99_tpot_ms=20.0,
        window_s=6.0, mean_queued=queued,
    )  # fmt: skip


def cell(sessions: int, base: TargetCell, adapt: TargetCell, gate: TargetCell, context: int = 1000) -> Cell:
    return Cell(1.5, context, sessions, 1.0, {"baseline": base, "adaptive": adapt, "specgate": gate})


# ----- plan -----


@pytest.mark.parametrize("context", [1000, 8000, 3000])
@pytest.mark.parametrize("turns", [2, 4, 8])
def test_sizes_give_the_requested_mean_context(context: int, turns: int) -> None:
    s = sizes_for(context, turns, 128)
    assert abs(s.predicted_mean_prompt - context) <= (turns + 1) / 2  # user tokens are rounded down
    assert s.system_tokens == round(context / 8)


def test_the_predicted_mean_is_what_the_simulator_counts_for_a_built_session() -> None:
    """A session built by the workload, replies as the simulator writes them, counted by its tokenizer:
    the mean prompt lands near the plan's (user messages vary +-30% around theirs)."""
    s = sizes_for(8000, 4, 128)
    plan = HeadPlan(contexts=(8000,), think_time_s=0)
    counts = []
    workload = Workload(plan.workload(8000, 4), TextBank(0))
    for stream in range(40):
        script = workload.stream(stream)
        reply: str | None = None
        for _ in range(s.turns):
            turn = script.send(reply)
            counts.append(_chat_prompt_tokens(list(turn.prompt.messages)))
            reply = token_text(0, s.max_tokens)
    measured = sum(counts) / len(counts)
    assert measured == pytest.approx(8000, rel=0.06)


def test_mean_prompt_counts_the_replies_and_the_template() -> None:
    # One turn: system + user + two messages' template, no reply yet.
    assert mean_prompt(100, 50, 1, 128) == 100 + 50 + 8
    # Without a system prompt, no system message.
    assert mean_prompt(0, 50, 1, 128) == 50 + 4


def test_a_context_too_small_for_the_replies_is_refused() -> None:
    with pytest.raises(ValueError, match="no room"):
        sizes_for(300, 8, 128)


def test_contexts_parse_with_k() -> None:
    assert parse_context("1k") == 1000
    assert parse_context("8K") == 8000
    assert parse_context("1500") == 1500
    with pytest.raises(ValueError):
        parse_context("lots")


def test_time_scale_per_level_and_slos_in_wall_time() -> None:
    assert default_time_scale(1) == 4.0  # capped: few events, spare the wall time
    assert default_time_scale(256) == default_time_scale(80) < default_time_scale(16) < 4.0
    # Longer contexts give fewer output tokens a second: a faster clock for the same event rate.
    assert default_time_scale(64, 8000) > default_time_scale(64, 1000)
    plan = HeadPlan(sessions=(1, 64), time_scales=(1.0, 0.25))
    assert plan.time_scale(64, 8000) == 0.25 and plan.time_scale(1, 1000) == 1.0
    slo = plan.wall_slo(64, 1000)
    # A simulated 100 ms lasts 400 wall ms at a quarter speed.
    assert slo.tpot_ms == pytest.approx(400.0) and slo.ttft_ms == pytest.approx(8000.0)
    assert plan.workload(1000, 64).think_time_s == pytest.approx(plan.think_time_s / 0.25)
    # The streams open at once unless staggered (as the documented runs did); a stagger is on the
    # simulators' clock too, and bounded by the warm-up's wait.
    assert plan.workload(1000, 64).stagger_s == 0.0
    assert HeadPlan(sessions=(1, 64), time_scales=(1.0, 0.25), stagger_s=5.0).workload(1000, 64).stagger_s == 20.0
    with pytest.raises(ValueError, match="--stagger-s"):
        HeadPlan(stagger_s=1000.0)
    # The calibration drives one server at a time: twice the cells' scale at its top level.
    assert HeadPlan().calibration_scale(1000) == pytest.approx(2 * default_time_scale(256, 1000))
    with pytest.raises(ValueError, match="one per"):
        HeadPlan(sessions=(1, 4, 16), time_scales=(1.0, 0.5))


def test_every_level_sends_other_sessions() -> None:
    plan = HeadPlan()
    assert plan.workload(1000, 4).seed != plan.workload(1000, 16).seed


def test_the_command_line_builds_the_plan() -> None:
    args = build_parser().parse_args(
        ["headtohead", "--accept-lengths", "2", "--contexts", "2k", "--sessions", "8,2", "--time-scale", "0.5"]
    )
    plan = plan_of(args)
    assert plan.accept_lengths == (2.0,) and plan.contexts == (2000,) and plan.sessions == (2, 8)
    assert plan.time_scale(8, 2000) == 0.5 and plan.stagger_s == 0.0
    assert plan_of(build_parser().parse_args(["headtohead", "--stagger-s", "12"])).stagger_s == 12.0
    with pytest.raises(SystemExit):
        build_parser().parse_args(["headtohead", "--accept-lengths", "0.5"])


def test_pair_and_servers_get_the_same_physics() -> None:
    plan = HeadPlan()
    pair = plan.pair_args(1.5, 0.25, 1, 2)
    alone = plan.server_args("adaptive", 3, 1.5, 0.25)
    for args in (pair, alone):
        for flag, value in (("--profile", "h200-llama8b"), ("--accept-length", "1.5"), ("--time-scale", "0.25")):
            assert args[args.index(flag) + 1] == value
        assert "--enable-cache-report" in args
    assert "--shared-gpu" in pair and "--shared-gpu" not in alone


# ----- scoring -----


def level_stats(conclusive: bool, tok_s: float, share: dict[str, float] | None = None) -> LevelStats:
    nan = math.nan
    return LevelStats(
        concurrency=4, duration_s=3.0, completed=20, errors=0, output_tok_s=tok_s, request_per_s=2.0,
        mean_ttft_ms=nan, median_ttft_ms=nan, p99_ttft_ms=nan, mean_itl_ms=nan, median_itl_ms=nan,
        p95_itl_ms=nan, p99_itl_ms=nan, mean_tpot_ms=nan, mean_e2e_ms=nan, median_e2e_ms=nan,
        backend_share=share or {}, min_ok=10, conclusive=conclusive,
    )  # fmt: skip


def test_target_cell_converts_wall_figures_to_simulated_time() -> None:
    summary = ClassSummary(
        name="all", completed=20, errors=0, sessions=4, p50_ttft_ms=400.0, p99_ttft_ms=800.0, p50_tpot_ms=40.0,
        p99_tpot_ms=80.0, output_tok_s=100.0, goodput_req_s=0.5, goodput_share=0.8, prefix_cache_hit_rate=0.6,
        cache_reported=20, mean_prompt_tokens=990.0,
    )  # fmt: skip
    t = target_cell("specgate", level_stats(True, 100.0, {"speculative": 0.75, "baseline": 0.25}), summary, 0.25)
    assert t.output_tok_s == pytest.approx(400.0)  # 100 wall tok/s at quarter speed
    assert t.goodput_req_s == pytest.approx(2.0)
    assert t.p50_ttft_ms == pytest.approx(100.0) and t.p99_tpot_ms == pytest.approx(20.0)
    assert t.window_s == pytest.approx(0.75)
    assert t.speculative_share == 0.75 and t.prefix_cache_hit_rate == 0.6
    assert t.mean_prompt_tokens == 990.0
    # Everything to the baseline: a share of 0; a target that is no specgate: none.
    assert target_cell("specgate", level_stats(True, 1.0, {"baseline": 1.0}), summary, 1.0).speculative_share == 0.0
    assert target_cell("adaptive", level_stats(True, 1.0), summary, 1.0, None, 1234.0).speculative_share is None
    assert target_cell("adaptive", level_stats(True, 1.0), summary, 1.0, None, 1234.0).mean_prompt_tokens == 1234.0


def test_compare_needs_both_figures_conclusive() -> None:
    assert compare(tc("specgate", 2.0), tc("adaptive", 1.0)) == ("wins", 2.0)
    assert compare(tc("specgate", 1.0), tc("adaptive", 2.0)) == ("loses", 0.5)
    assert compare(tc("specgate", 1.02), tc("adaptive", 1.0))[0] == "ties"
    assert compare(tc("specgate", 0.0), tc("adaptive", 0.0))[0] == "neither"
    assert compare(tc("specgate", 5.0, conclusive=False), tc("adaptive", 1.0))[0] == "unknown"
    assert compare(tc("specgate", 5.0), tc("adaptive", 1.0, conclusive=False))[0] == "unknown"


def test_best_target_is_unknown_while_any_figure_is_inconclusive() -> None:
    assert best_target(cell(4, tc("baseline", 1.0), tc("adaptive", 3.0), tc("specgate", 2.0))) == "adaptive"
    assert best_target(cell(4, tc("baseline", 1.0), tc("adaptive", 3.0), tc("specgate", 2.95))) == "adaptive=specgate"
    assert best_target(cell(4, tc("baseline", 1.0), tc("adaptive", 3.0, False), tc("specgate", 2.0))) is None
    assert best_target(cell(4, tc("baseline", 0.0), tc("adaptive", 0.0), tc("specgate", 0.0))) is None


# ----- verdict and report -----


def test_verdict_lists_an_inconclusive_cell_as_unknown_never_as_a_win_or_loss() -> None:
    cells = [
        cell(4, tc("baseline", 1.0), tc("adaptive", 1.0), tc("specgate", 2.0)),
        cell(256, tc("baseline", 1.0), tc("adaptive", 3.0, queued=0.0), tc("specgate", 1.0, queued=40.0), 8000),
        cell(64, tc("baseline", 1.0), tc("adaptive", 9.0), tc("specgate", 0.1, conclusive=False)),
    ]
    text = "\n".join(verdicts(HeadPlan(), cells))
    beats = next(line for line in text.splitlines() if "beats the adaptive" in line)
    loses = next(line for line in text.splitlines() if "loses to the adaptive" in line)
    unknown = next(line for line in text.splitlines() if "unknown" in line and "adaptive" in line)
    assert "4 sessions" in beats and "256" not in beats
    assert "256 sessions" in loses and "64 sessions" not in loses
    assert "64 sessions" in unknown
    assert "2 of 3 cells conclusive" in text
    assert "pair 40.0 queued on average, adaptive 0.0" in text


def test_verdict_says_nothing_was_measured_when_no_cell_was_conclusive() -> None:
    cells = [cell(4, tc("baseline", 1.0, False), tc("adaptive", 1.0, False), tc("specgate", 2.0, False))]
    text = "\n".join(verdicts(HeadPlan(), cells))
    assert "nothing measured conclusively" in text
    assert "beats" not in text and "loses" not in text


def test_table_marks_inconclusive_figures_and_names_the_best() -> None:
    cells = [
        cell(4, tc("baseline", 1.0), tc("adaptive", 3.0), tc("specgate", 2.0)),
        cell(64, tc("baseline", 1.0), tc("adaptive", 9.0, conclusive=False), tc("specgate", 2.0)),
    ]
    lines = cell_table(HeadPlan(), cells).splitlines()
    assert lines[2].rstrip().endswith("adaptive")
    assert "9.00*" in lines[3] and lines[3].rstrip().endswith("unknown")
    assert "TTFT <= 2000 ms and TPOT <= 100 ms" in lines[-1]


def test_warnings_keep_client_errors_apart_from_the_servers() -> None:
    client = TargetCell(**{**vars(tc("adaptive", 1.0)), "client_errors": 3})
    server = TargetCell(**{**vars(tc("baseline", 1.0)), "errors": 2})
    lines = warnings([cell(4, server, client, tc("specgate", 1.0))])
    assert any(line.startswith("warning:") and "server errors {'baseline': 2}" in line for line in lines)
    assert any(line.startswith("note:") and "client errors" in line and "'adaptive': 3" in line for line in lines)


def test_parser_registers_the_command() -> None:
    sub = build_parser()._subparsers
    assert sub is not None
    choices = next(a for a in sub._group_actions if isinstance(a, argparse._SubParsersAction)).choices
    assert "headtohead" in choices
