"""`python -m loadtest field`'s pure parts: the protocol and its checks, each configuration's fleet
and settings, the configurations skipped before SPECGATE_ADAPTIVE_URL, and the scoring, pooling and
verdicts on scripted numbers."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from loadtest.__main__ import build_parser
from loadtest.field.cli import cell_list, dry_run, plan_of
from loadtest.field.protocol import (
    ADAPTIVE,
    BALANCED,
    CONFIGS,
    MIXED,
    POOL,
    REFERENCE,
    SMG_BASELINE,
    Cell,
    CellRun,
    FieldPlan,
    default_cells,
    gate_settings,
    roles,
    runnable,
)
from loadtest.field.report import markdown, protocol_lines, summary_lines, table, verdicts
from loadtest.field.run import gate_env, runs_from
from loadtest.field.score import (
    MET,
    MISSED,
    NOT_APPLICABLE,
    UNKNOWN,
    FieldRun,
    class_verdict,
    goodput_verdict,
    overall,
    pooled,
)
from loadtest.kit.figures import TargetCell
from loadtest.report import write_json


def test_the_protocol_keeps_both_n_both_traffics_and_the_heavy_load_at_both_contexts() -> None:
    plan = FieldPlan()
    cells = set(plan.cells)
    for n in (2, 4):
        assert {Cell(n, "AB", 1000, 64), Cell(n, "AB", 8000, 64), Cell(n, "A", 1000, 64)} <= cells
    assert plan.seeds >= 5 and plan.configs == CONFIGS and plan.seed_list() == (0, 1, 2, 3, 4)
    assert (plan.slo_ttft_ms, plan.slo_tpot_ms, plan.max_accept_length) == (1000, 50, 3.2)
    flags = plan.simulator_flags(0.5)
    assert "--accept-from-prompt" in flags and "--enable-cache-report" in flags and "--shared-gpu" not in flags


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"cells": (Cell(3, "AB", 1000, 8),)}, "even"),
        ({"cells": (Cell(2, "C", 1000, 8),)}, "traffic"),
        ({"configs": ("nginx",)}, "--configs"),
        ({"seeds": 0}, "--seeds"),
        ({"window_s": 30.0}, "--window-s"),
        ({"cells": ()}, "no cells"),
    ],
)
def test_a_plan_that_cannot_run_is_refused(change: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        FieldPlan(**change)  # type: ignore[arg-type]


def test_each_configuration_puts_its_servers_one_a_gpu() -> None:
    assert roles(REFERENCE, 4) == ("adaptive",) * 4 and roles(SMG_BASELINE, 2) == ("baseline",) * 2
    assert roles(POOL, 4) == ("speculative", "speculative", "baseline", "baseline")
    with pytest.raises(ValueError, match="4 GPUs"):
        roles(MIXED, 2)
    assert roles(MIXED, 4) == ("speculative", "baseline", "adaptive", "adaptive")
    assert roles(ADAPTIVE, 2) == roles(BALANCED, 2) == ("adaptive", "adaptive")


def test_specgates_run_with_classes_and_their_placement() -> None:
    assert gate_settings(POOL) == {"class_key": "header", "policy": "adaptive", "topology": "pooled"}
    assert gate_settings(ADAPTIVE)["adaptive_placement"] == "homogeneous"
    assert gate_settings(BALANCED)["adaptive_placement"] == "least_loaded"
    with pytest.raises(ValueError):
        gate_settings(REFERENCE)


def test_the_env_lists_each_roles_servers_and_the_adaptive_ones_apart() -> None:
    pool = {
        "speculative-0": "http://a",
        "speculative-1": "http://b",
        "baseline-2": "http://c",
        "baseline-3": "http://d",
    }
    env = gate_env(9, pool, 0.5, {"policy": "adaptive"})
    assert (
        env["SPECGATE_SPECULATIVE_URL"] == "http://a,http://b" and env["SPECGATE_BASELINE_URL"] == "http://c,http://d"
    )
    assert "SPECGATE_ADAPTIVE_URL" not in env and env["SPECGATE_POLICY"] == "adaptive"
    env = gate_env(9, {"adaptive-0": "http://a", "adaptive-1": "http://b"}, 0.5, gate_settings(ADAPTIVE))
    assert env["SPECGATE_SPECULATIVE_URL"] == env["SPECGATE_BASELINE_URL"] == ""
    assert env["SPECGATE_ADAPTIVE_URL"] == "http://a,http://b"
    assert env["SPECGATE_ADAPTIVE_PLACEMENT"] == "homogeneous"


def test_configurations_needing_the_adaptive_url_are_skipped_with_a_note() -> None:
    configs, skipped = runnable(CONFIGS, {"speculative_url", "baseline_url"})
    assert configs == (REFERENCE, SMG_BASELINE, POOL) and set(skipped) == {ADAPTIVE, BALANCED, MIXED}
    assert all("adaptive_url" in why for why in skipped.values())
    assert runnable(CONFIGS, {"adaptive_url"}) == (CONFIGS, {})


def test_slos_go_to_specgate_in_wall_ms_only_where_it_has_them() -> None:
    plan = FieldPlan()
    assert plan.slo_settings(0.5, {"policy"}) == {}
    assert plan.slo_settings(0.5, {"slo_ttft_ms", "slo_tpot_ms"}) == {"slo_ttft_ms": "2000", "slo_tpot_ms": "100"}


def test_a_one_offs_settings_reach_every_specgate_on_the_wall_clock_and_the_report_says_so() -> None:
    args = build_parser().parse_args(["field", "--set", "prefill_tok_s=20000", "--set", "affinity_balance=2"])
    plan = plan_of(args)
    # A rate on the simulated clock: at time scale 4 the simulators run 4 times the wall's speed.
    assert plan.extra_settings(4.0) == {"prefill_tok_s": "80000", "affinity_balance": "2"}
    assert FieldPlan().extra_settings(4.0) == {}
    assert any(
        "Not the protocol's: every specgate with prefill_tok_s=20000" in line
        for line in protocol_lines(plan, "c", None)
    )
    assert not any("Not the protocol's" in line for line in protocol_lines(FieldPlan(), "c", None))
    with pytest.raises(SystemExit):
        build_parser().parse_args(["field", "--set", "no_such_setting=1"])


def test_time_scales_hold_the_cells_output_and_the_run_view_draws_from_its_seed() -> None:
    plan = FieldPlan()
    heavy4, heavy2 = Cell(4, "AB", 1000, 64), Cell(2, "AB", 1000, 64)
    assert plan.time_scale(heavy4, 6) == pytest.approx(plan.time_scale(heavy2, 6) / 2, rel=1e-3)
    assert plan.time_scale(heavy4, 3) == pytest.approx(2 * plan.time_scale(heavy4, 6), rel=1e-3)
    assert plan.time_scale(Cell(2, "AB", 8000, 16), 3) == 4.0  # capped
    view = CellRun(plan, heavy2, 3, 0.25)
    spec = view.workload(1000, heavy2.sessions)
    assert spec.seed == 3 * 1000 + 128 and [c.name for c in spec.classes] == ["A", "B"]
    assert CellRun(plan, Cell(2, "A", 1000, 64), 3, 0.25).workload(1000, 128).classes[0].share == 1.0
    assert view.time_scale(1, 1) == 0.25 and view.window_s == plan.window_s


def test_cells_parse_and_the_dry_run_lists_the_plan() -> None:
    assert cell_list("2:AB:1k:64,4:A:8k:16") == (Cell(2, "AB", 1000, 64), Cell(4, "A", 8000, 16))
    args = build_parser().parse_args(["field", "--cells", "2:AB:1k:4", "--seeds", "5", "--dry-run"])
    plan = plan_of(args)
    lines = dry_run(plan, (REFERENCE, POOL), {MIXED: "why"})
    assert "skipped specgate-mixed: why" in lines and lines[-1] == "seeds 0, 1, 2, 3, 4; 5 runs"
    assert default_cells() == FieldPlan().cells


def tc(name: str, goodput: float, conclusive: bool = True) -> TargetCell:
    nan = math.nan
    return TargetCell(name, 100, 0, 0, 10, conclusive, 1000.0, goodput, 0.9, 0.5, 1000.0, nan, nan, nan, nan, 2.0)


def run(cell: Cell, seed: int, figures: dict[str, tuple[float, float]], conclusive: bool = True) -> FieldRun:
    """A run where each configuration's classes had the goodput given (A, B)."""
    targets = {n: tc(n, a + b, conclusive or n != POOL) for n, (a, b) in figures.items()}
    per_class = {n: {"A": a, "B": b} if len(cell.traffic) > 1 else {"A": a} for n, (a, b) in figures.items()}
    return FieldRun(cell, seed, 0.5, targets, per_class)


TWO = Cell(2, "AB", 1000, 64)
ONE = Cell(2, "A", 1000, 64)


def test_the_pooled_ratio_is_the_ratio_of_sums_and_its_interval_decides() -> None:
    runs = [run(TWO, s, {REFERENCE: (5.0, 5.0), POOL: (5.0, 7.0 + s * 0.1)}) for s in range(5)]
    p = pooled(runs, POOL)
    assert p.ratio == pytest.approx(sum(12.0 + s * 0.1 for s in range(5)) / 50.0)
    assert p.interval is not None and p.interval[0] >= 1.10 and goodput_verdict(runs, POOL) == MET
    assert class_verdict(runs, POOL) == MET
    # Class A dropped to half of its goodput under smg-adaptive: the class target missed.
    low = [run(TWO, s, {REFERENCE: (5.0, 5.0), POOL: (2.5, 10.0)}) for s in range(5)]
    assert goodput_verdict(low, POOL) == MET and class_verdict(low, POOL) == MISSED
    # An interval across the goal: unknown, never a pass.
    mixed = [run(TWO, s, {REFERENCE: (5.0, 5.0), POOL: (5.0, 5.0 + (4.0 if s % 2 else 0.0))}) for s in range(5)]
    assert goodput_verdict(mixed, POOL) == UNKNOWN


def test_one_class_cells_are_held_to_the_floor() -> None:
    even = [run(ONE, s, {REFERENCE: (10.0, 0.0), POOL: (10.0, 0.0)}) for s in range(5)]
    assert goodput_verdict(even, POOL) == MET  # 1.00x >= 0.97x, though short of 1.10x
    short = [run(ONE, s, {REFERENCE: (10.0, 0.0), POOL: (8.0, 0.0)}) for s in range(5)]
    assert goodput_verdict(short, POOL) == MISSED and class_verdict(short, POOL) == MISSED


def test_an_inconclusive_seed_or_too_few_seeds_is_unknown() -> None:
    runs = [run(TWO, s, {REFERENCE: (5.0, 5.0), POOL: (9.0, 9.0)}, conclusive=s != 2) for s in range(5)]
    assert pooled(runs, POOL).inconclusive == 1 and goodput_verdict(runs, POOL) == UNKNOWN
    assert goodput_verdict(runs[:4], POOL) == UNKNOWN


def test_where_nobody_met_the_slos_the_target_does_not_apply_and_a_lone_server_meets_it() -> None:
    none = [run(TWO, s, {REFERENCE: (0.0, 0.0), SMG_BASELINE: (0.0, 0.0), POOL: (0.0, 0.0)}) for s in range(5)]
    assert goodput_verdict(none, POOL) == NOT_APPLICABLE
    alone = [run(TWO, s, {REFERENCE: (0.0, 0.0), POOL: (0.0, 1.0)}) for s in range(5)]
    assert pooled(alone, POOL).ratio is None and goodput_verdict(alone, POOL) == MET
    assert overall([MET, NOT_APPLICABLE]) == MET and overall([MET, MISSED]) == MISSED
    assert overall([MET, UNKNOWN]) == UNKNOWN and overall([NOT_APPLICABLE]) == UNKNOWN


def test_the_report_has_its_protocol_its_table_and_the_pools_verdicts() -> None:
    configs = (REFERENCE, SMG_BASELINE, POOL)
    runs = [run(TWO, s, {REFERENCE: (5.0, 5.0), SMG_BASELINE: (6.0, 3.0), POOL: (5.0, 7.0)}) for s in range(5)]
    runs += [run(ONE, s, {REFERENCE: (10.0, 0.0), SMG_BASELINE: (11.0, 0.0), POOL: (8.0, 0.0)}) for s in range(5)]
    lines = table(runs, configs)
    assert lines[0].startswith("| cell | seeds | config |") and len([x for x in lines if "| N=2 " in x]) == 6
    assert "| N=2 AB 1k 64/GPU | 5 | specgate-pool | 12.00 | 1.20x (1.20-1.20) | 1.00x (1.00-1.00) |" in "\n".join(
        lines
    )
    found = verdicts(runs, configs)[POOL]
    assert list(found.values()) == [MET, MISSED, MISSED]
    summary = summary_lines(runs, configs, {MIXED: "not run"})
    assert summary[1].startswith("- **specgate-pool** (the targets)") and "- specgate-mixed: not run" in summary
    body = markdown(FieldPlan(configs=configs), runs, configs, {}, "python -m loadtest field", 12.0)
    assert "\n## Protocol\n" in body and "## Results" in body and len(body.splitlines()) <= 200
    assert ">= 1.1x in every two-class cell" in body


def test_a_configuration_absent_from_a_cell_is_left_out_of_its_rows_and_verdicts(tmp_path: Path) -> None:
    four = Cell(4, "AB", 1000, 64)
    runs = [run(TWO, s, {REFERENCE: (5.0, 5.0), POOL: (5.0, 7.0)}) for s in range(5)]
    runs += [run(four, s, {REFERENCE: (5.0, 5.0), POOL: (5.0, 7.0), MIXED: (5.0, 6.0)}) for s in range(5)]
    lines = table(runs, (REFERENCE, POOL, MIXED))
    assert not [x for x in lines if "| N=2 " in x and MIXED in x]
    assert [x for x in lines if "| N=4 " in x and MIXED in x]
    assert summary_lines(runs, (REFERENCE, POOL, MIXED), {})[1].startswith("- **specgate-pool**")
    # The runs as field.json holds them report the same again (--report-from).
    path = tmp_path / "field.json"
    write_json(path, {"settings": FieldPlan(cells=(TWO, four)), "runs": runs})
    plan, again = runs_from(path)
    assert plan.cells == (TWO, four) and [(r.cell, r.seed) for r in again] == [(r.cell, r.seed) for r in runs]
    assert table(again, (REFERENCE, POOL, MIXED)) == lines
