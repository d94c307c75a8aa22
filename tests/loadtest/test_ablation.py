"""`loadtest ablation`'s protocol, plan, stacks' settings and scoring (loadtest/ablation/): pure, no
process started."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import pytest

from loadtest.__main__ import build_parser, main
from loadtest.ablation.cli import finite, is_protocol, protocol_of, report, save
from loadtest.ablation.protocol import (
    BY_NAME,
    CELLS,
    COPY,
    FULL,
    MECHANISMS,
    MIN_SEEDS,
    ON,
    Protocol,
    coverage,
    describe,
    full_settings,
    off_stack,
    select_cells,
    stack_settings,
)
from loadtest.ablation.report import cell_table, summary_table, times
from loadtest.ablation.run import AblationPlan, calibration_plan, cell_plan, counters, stack_env
from loadtest.ablation.score import (
    BOTH,
    COSTS,
    NOISE,
    PAYS,
    UNKNOWN,
    Ratio,
    Run,
    cell_noise,
    gain,
    ratio,
    score,
    score_cell,
    spread,
    summarise,
    verdict,
)
from loadtest.kit.figures import TargetCell
from loadtest.kit.multiturn import default_time_scale
from proxy.config import Settings
from proxy.policy.base import Role

CELL = {c.name: c for c in CELLS}


def test_every_mechanism_is_measured_somewhere_on_at_least_three_seeds() -> None:
    protocol = Protocol()
    assert len(protocol.seeds) >= MIN_SEEDS and protocol.complete
    assert all(coverage(protocol.cells).values()), coverage(protocol.cells)
    # Where a mechanism can act only in a pool, it is measured in one; a pair's own in pairs.
    cov = coverage(CELLS)
    assert all(CELL[c].topology == "paired" for m in ("kv-forecast", "switch-cost") for c in cov[m])
    assert any(CELL[c].topology == "pooled" for c in cov["classes"])
    assert any(CELL[c].topology == "pooled" for c in cov["affinity"])
    (rule,) = cov["affinity-rule"]
    assert CELL[rule].baselines > 1 and CELL[rule].policy == "model"
    (spill,) = cov["kv-spill"]
    assert CELL[spill].context * CELL[spill].sessions > 0.9 * 419_000  # past the pair's baseline pool


def test_a_stack_differs_from_the_full_one_in_its_one_switch_only() -> None:
    for cell in CELLS:
        full = full_settings(cell)
        assert stack_settings(cell, FULL) == stack_settings(cell, COPY) == full
        assert cell.stacks[:2] == (FULL, COPY) and len(set(cell.stacks)) == len(cell.stacks)
        for name in cell.mechanisms:
            off = stack_settings(cell, off_stack(name))
            changed = {k for k in off if off[k] != full.get(k, Settings.model_fields[k].default)}
            assert changed == set(BY_NAME[name].off), (cell.name, name)
            # Each is a value specgate takes.
            Settings(_env_file=None, **off)  # type: ignore[arg-type]
        with pytest.raises(ValueError):
            stack_settings(cell, "no-nothing")
    # The switch is really off: each differs from what the full stack runs with (the mechanisms
    # made opt-in since are on there, ON; the others at their default).
    for m in MECHANISMS:
        assert all(ON.get(k, Settings.model_fields[k].default) != v for k, v in m.off.items()), m.name


def test_a_cell_names_known_mechanisms_and_a_pool_for_several_baselines() -> None:
    with pytest.raises(ValueError, match="no mechanism"):
        dataclasses.replace(CELLS[0], mechanisms=("turbo",))
    with pytest.raises(ValueError, match="pool"):
        dataclasses.replace(CELLS[0], baselines=2)
    with pytest.raises(ValueError, match="--cells"):
        select_cells(["pair-1k-8", "pair-2k-9"])
    assert [c.name for c in select_cells(["pool-8k-32", "pair-1k-8"])] == ["pair-1k-8", "pool-8k-32"]


def test_runs_go_seed_by_seed_through_every_cell_and_calibrate_once_per_topology_and_context() -> None:
    protocol = Protocol(cells=select_cells(["pair-1k-8", "pair-1k-32", "pool-8k-32"]), seeds=(1, 2, 3))
    assert [(c.name, s) for c, s in protocol.order()][:4] == [
        ("pair-1k-8", 1), ("pair-1k-32", 1), ("pool-8k-32", 1), ("pair-1k-8", 2)
    ]  # fmt: skip
    assert protocol.calibrations() == {("paired", 1000): (8, 32), ("pooled", 8000): (32,)}
    assert Protocol().calibrations()[("pooled", 8000)] == (32, 48)
    # The calibration's levels reach the top sessions of its cells.
    plan = calibration_plan(Protocol(), "paired", 1000, (8, 32, 128))
    assert plan.calibration_levels() == (4, 16, 64, 256) and plan.seed == Protocol().seeds[0]
    for bad in ({"seeds": ()}, {"seeds": (1, 1, 2)}, {"window_s": 0.0}, {"window_s": 90.0}):
        with pytest.raises(ValueError):
            Protocol(**bad)


def test_a_cells_time_scale_is_headtoheads_times_three_over_its_stacks() -> None:
    for cell in CELLS:
        expected = default_time_scale(cell.sessions, cell.context) * 3 / len(cell.stacks)
        assert cell.time_scale() == pytest.approx(expected, abs=1e-4)
        plan = cell_plan(Protocol(), cell, 901)
        assert isinstance(plan, AblationPlan) and plan.targets == cell.stacks
        assert plan.time_scale(cell.sessions, cell.context) == cell.time_scale()
        assert (plan.seed, plan.topology, plan.baselines) == (901, cell.topology, cell.baselines)
        # The SLOs and the sessions' think times are on the simulators' clock.
        assert plan.wall_slo(cell.sessions, cell.context).ttft_ms == pytest.approx(1000 / cell.time_scale())
        assert plan.workload(cell.context, cell.sessions).seed == 901 * 1000 + cell.sessions


def test_a_stacks_specgate_is_told_its_settings_its_pool_and_the_clock(tmp_path: Path) -> None:
    rule = CELL["pool2-8k-48"]
    servers = {"speculative": "http://127.0.0.1:1", "b0": "http://127.0.0.1:2", "b1": "http://127.0.0.1:3"}
    env = stack_env(rule, "no-affinity-rule", 4000, servers, 2.0, tmp_path / "cal.json")
    assert env["SPECGATE_BASELINE_URL"] == "b0=http://127.0.0.1:2,b1=http://127.0.0.1:3"
    assert (env["SPECGATE_AFFINITY_RULE"], env["SPECGATE_POLICY"], env["SPECGATE_TOPOLOGY"]) == (
        "in_flight", "model", "pooled"
    )  # fmt: skip
    s = Settings(_env_file=None, speculative_url=env["SPECGATE_SPECULATIVE_URL"],
                 baseline_url=env["SPECGATE_BASELINE_URL"], topology="pooled")  # fmt: skip
    (group,) = s.routing_topology().groups
    assert group.of(Role.BASELINE) == ("b0", "b1")
    pair = CELL["pair-8k-32"]
    two = {"speculative": "http://127.0.0.1:1", "b0": "http://127.0.0.1:2"}
    full = stack_env(pair, FULL, 4000, two, 2.0, tmp_path / "cal.json")
    assert full["SPECGATE_BASELINE_URL"] == "http://127.0.0.1:2"
    assert full["SPECGATE_CLASS_KEY"] == "header" and full["SPECGATE_CALIBRATION"] == str(tmp_path / "cal.json")
    # Time settings on the simulators' clock, but a switch turned off stays off.
    assert full["SPECGATE_ADAPTIVE_MIN_DWELL_S"] == "5" and full["SPECGATE_KV_FORECAST_S"] == "5"
    assert stack_env(pair, "no-dwell", 4000, two, 2.0, tmp_path / "c.json")["SPECGATE_ADAPTIVE_MIN_DWELL_S"] == "0"
    assert stack_env(pair, "no-switch-cost", 4000, two, 2.0, tmp_path / "c.json")["SPECGATE_PREFILL_TOK_S"] == "0"


def test_the_counters_read_from_a_specgates_metrics() -> None:
    text = (
        'specgate_routing_decisions_total{backend="baseline",reason="kv_spill"} 3\n'
        'specgate_routing_decisions_total{backend="speculative",reason="kv_spill"} 2\n'
        'specgate_routing_decisions_total{backend="baseline",reason="dwell_hold"} 7\n'
        'specgate_shadow_probes_total{outcome="sent"} 4\n'
        'specgate_affinity_breaks_total{reason="load"} 5\n'
    )
    found = counters(text)
    assert found["reason:kv_spill"] == 5 and found["reason:dwell_hold"] == 7
    assert found["shadow_probes"] == 4 and found["affinity_breaks:load"] == 5 and found["mode_switches"] == 0


def _target(goodput: float, conclusive: bool = True, tok_s: float = 1000.0) -> TargetCell:
    return TargetCell(
        target="x", completed=50, errors=0, client_errors=0, min_ok=10, conclusive=conclusive,
        output_tok_s=tok_s, goodput_req_s=goodput, goodput_share=0.9, prefix_cache_hit_rate=0.6,
        mean_prompt_tokens=1000.0, p50_ttft_ms=300.0, p99_ttft_ms=900.0, p50_tpot_ms=30.0, p99_tpot_ms=45.0,
        window_s=12.0,
    )  # fmt: skip


def _run(seed: int, full: float, copy: float, **off: float) -> Run:
    stacks = {FULL: _target(full), COPY: _target(copy)}
    stacks |= {off_stack(k.replace("_", "-")): _target(v) for k, v in off.items()}
    counters = {FULL: {"reason:dwell_hold": 3.0, "shadow_probes": 1.0}, "no-dwell": {"reason:light_load": 9.0}}
    return Run("pair-1k-8", seed, 0.75, stacks, counters)


def test_a_gain_is_fulls_goodput_over_offs_with_the_edges_said() -> None:
    assert ratio(_target(6.0), _target(4.0)) == Ratio(1.5)
    assert ratio(_target(1.0), _target(0.0)) == Ratio(math.inf)  # full served where off served none
    assert ratio(_target(0.0), _target(2.0)) == Ratio(0.0)
    assert ratio(_target(0.0, tok_s=900), _target(0.0, tok_s=1000)) == Ratio(0.9, on_tok_s=True)
    assert ratio(_target(0.0, tok_s=0), _target(0.0, tok_s=0)) is None
    assert ratio(_target(6.0, conclusive=False), _target(4.0)) is None  # a client failure says nothing
    r = _run(900, 5.0, 4.0, dwell=4.0)
    assert gain(r, "dwell") == Ratio(1.25) and gain(r, "classes") is None
    assert spread(r) == pytest.approx(0.2)


def test_a_cell_pays_only_where_every_seed_clears_the_noise() -> None:
    assert verdict([1.10, 1.08, 1.12], 0.05) == PAYS
    assert verdict([1.10, 1.04, 1.12], 0.05) == NOISE  # one seed inside
    assert verdict([0.90, 0.92, 0.85], 0.05) == COSTS
    assert verdict([0.90, 1.20, 0.85], 0.05) == NOISE
    assert verdict([math.inf, math.inf, 1.3], 0.2) == PAYS
    assert verdict([1.10, None, 1.12], 0.05) == UNKNOWN  # a seed inconclusive
    assert verdict([1.10, 1.12], 0.05) == UNKNOWN  # too few seeds
    assert verdict([1.10, 1.08, 1.12], None) == UNKNOWN
    assert verdict([1.10, 1.08, 1.12], math.inf) == NOISE  # the copy served where full served none
    runs = [_run(900, 5.0, 5.1, dwell=4.0), _run(901, 5.0, 4.8, dwell=4.5), _run(902, 5.0, 5.0, dwell=4.4)]
    assert cell_noise(runs) == pytest.approx(0.04)
    s = score_cell(runs, "dwell")
    assert (s.verdict, s.seeds, s.acted, s.acted_off) == (PAYS, (900, 901, 902), 9.0, 0.0)
    assert s.median == pytest.approx(5 / 4.4) and s.low == pytest.approx(5 / 4.5) and s.high == 1.25
    assert score_cell(runs, "kv-forecast").acted is None  # no counter shows it
    assert cell_noise([*runs, _run(903, 5.0, 0.0)]) == pytest.approx(1.0)
    assert cell_noise([]) is None


def test_a_mechanisms_verdict_over_its_cells() -> None:
    runs = [_run(s, 5.0, 5.1, dwell=4.0, probes=6.0, classes=5.02) for s in (900, 901, 902)]
    other = [dataclasses.replace(r, cell="pair-1k-32") for r in runs]
    scores = score([*runs, *other], {"pair-1k-8": ("dwell", "probes", "classes"), "pair-1k-32": ("dwell",)})
    rows = {r.mechanism: r for r in summarise(scores)}
    assert rows["dwell"].verdict == PAYS and len(rows["dwell"].pays) == 2
    assert rows["probes"].verdict == COSTS
    assert rows["classes"].verdict == NOISE
    mixed = dataclasses.replace(rows["dwell"], costs=rows["probes"].costs)
    assert mixed.verdict == BOTH
    assert dataclasses.replace(rows["classes"], inside=()).verdict == UNKNOWN
    table = summary_table(list(rows.values()))
    assert "| dwell (`SPECGATE_ADAPTIVE_MIN_DWELL_S=0`) | pair 1k/8: 1.25x (1.25x-1.25x), noise 2%" in table
    assert table.count("\n") == 2 + len(rows) - 1
    assert "| pair 1k/8 | probes | 0.83x, 0.83x, 0.83x |" in cell_table(scores)
    assert times(math.inf) == "inf" and times(None) == "unknown"


def test_the_command_says_its_protocol_and_its_data_has_no_infinity(tmp_path: Path) -> None:
    args = build_parser().parse_args(["ablation"])
    assert is_protocol(protocol_of(args))
    smoke = build_parser().parse_args(["ablation", "--cells", "pair-8k-32", "--seeds", "900", "--window-s", "4"])
    assert not is_protocol(protocol_of(smoke)) and not protocol_of(smoke).complete
    text = describe(Protocol())
    assert all(m.switch in text for m in MECHANISMS) and all(c.name in text for c in CELLS)
    assert main(["ablation", "--dry-run"]) == 0
    runs = [_run(s, 5.0, 5.0, dwell=0.0) for s in (900, 901, 902)]
    out = report(Protocol(cells=select_cells(["pair-1k-8"])), runs)
    assert finite({"a": [math.inf, -math.inf, 1.0]}) == {"a": ["inf", "-inf", 1.0]}
    save(tmp_path / "a.json", out)
    data = json.loads((tmp_path / "a.json").read_text(), parse_constant=lambda c: pytest.fail(f"{c} in the data"))
    assert data["verdicts"]["dwell"] == PAYS and data["protocol"]["as_fixed"] is False
