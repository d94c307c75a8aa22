"""`loadtest headtohead-affinity`'s plan, stacks and scoring (loadtest/experiments/affinityrule.py): pure,
no process started."""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Sequence
from pathlib import Path

import pytest

from loadtest.__main__ import build_parser
from loadtest.experiments.affinityrule import (
    PRICED,
    TARGETS,
    AffinityCell,
    AffinityPlan,
    comparison,
    has_fit,
    stack_env,
    summary_lines,
    target_settings,
)
from loadtest.kit.cells import CellCapture
from loadtest.kit.figures import TargetCell
from loadtest.kit.multiturn import default_time_scale
from loadtest.kit.processes import Fleet, NotReady, fresh_start
from loadtest.production import WorkloadRun
from proxy.config import Settings
from proxy.policy.base import Role


def test_the_targets_differ_only_in_the_affinity_rule() -> None:
    features = {"policy": "model", "class_key": "header", "topology": "pooled"}
    priced = target_settings("priced")
    assert priced == {**features, "affinity_rule": "priced"}
    assert target_settings("both") == {**features, "affinity_rule": "both"}
    assert target_settings("in-flight") == {**features, "affinity_rule": "in_flight"}
    assert target_settings("no-affinity") == {**features, "affinity_entries": 0}
    assert target_settings("priced", "adaptive")["policy"] == "adaptive"
    with pytest.raises(ValueError):
        target_settings("smg")


def test_the_model_policy_needs_a_calibration_with_a_fit(tmp_path: Path) -> None:
    with_fit, without, broken = tmp_path / "a.json", tmp_path / "b.json", tmp_path / "c.json"
    with_fit.write_text(json.dumps({"format": "specgate-calibration/2", "model": {"form": "step_s = a + b*B + c*T"}}))
    without.write_text(json.dumps({"format": "specgate-calibration/2", "model": None}))
    broken.write_text("[")
    assert has_fit(with_fit) and not has_fit(without) and not has_fit(broken)
    assert not has_fit(tmp_path / "missing.json")
    with pytest.raises(ValueError):
        AffinityPlan(policy="threshold")


def test_a_stack_is_a_pool_of_one_speculative_and_n_baseline_servers(tmp_path: Path) -> None:
    servers = {"speculative": "http://127.0.0.1:1", "b0": "http://127.0.0.1:2", "b1": "http://127.0.0.1:3"}
    env = stack_env("in-flight", 4000, servers, 2.0, tmp_path / "cal.json")
    assert env["SPECGATE_BASELINE_URL"] == "b0=http://127.0.0.1:2,b1=http://127.0.0.1:3"
    assert (env["SPECGATE_AFFINITY_RULE"], env["SPECGATE_TOPOLOGY"]) == ("in_flight", "pooled")
    assert env["SPECGATE_CALIBRATION"] == str(tmp_path / "cal.json")
    # specgate reads it as one pool whose baseline role has both servers.
    s = Settings(_env_file=None, speculative_url=env["SPECGATE_SPECULATIVE_URL"],
                 baseline_url=env["SPECGATE_BASELINE_URL"], topology="pooled")  # fmt: skip
    (group,) = s.routing_topology().groups
    assert group.of(Role.BASELINE) == ("b0", "b1") and len(group.of(Role.SPECULATIVE)) == 1
    # priced: the default prefill rate, on the simulators' clock (twice as fast at time scale 2).
    assert stack_env("priced", 4000, servers, 2.0, tmp_path / "cal.json")["SPECGATE_PREFILL_TOK_S"] == "40000"


def test_the_plan_scales_time_by_its_servers() -> None:
    plan = AffinityPlan(contexts=(8000,), sessions=(16,), baselines=2)
    # Four pools of three servers, where headtohead's scale is made for six servers; fewer rules
    # side by side (--targets), fewer servers.
    assert plan.time_scale(16, 8000) == pytest.approx(default_time_scale(16, 8000) * 12 / 6, abs=1e-4)
    three = AffinityPlan(contexts=(8000,), sessions=(16,), baselines=2, rules=("priced", "both", "in-flight"))
    assert three.time_scale(16, 8000) == pytest.approx(default_time_scale(16, 8000) * 9 / 6, abs=1e-4)
    for bad in (("priced",), ("priced", "priced"), ("priced", "smg")):
        with pytest.raises(ValueError, match="--targets"):
            AffinityPlan(rules=bad)
    assert build_parser().parse_args(["headtohead-affinity", "--targets", "priced, both"]).targets == ("priced", "both")
    assert AffinityPlan(baselines=1).time_scale(16, 8000) < plan.time_scale(16, 8000)
    assert plan.topology == "pooled"
    # The sessions' think time and stagger are on the simulators' clock at that scale.
    w = plan.workload(8000, 16)
    assert w.stagger_s == pytest.approx(plan.stagger_s / plan.time_scale(16, 8000))
    args = plan.baseline_args(3.0, 5555)
    assert args[:4] == ["-m", "loadtest.simulator", "--role", "baseline"]
    assert {"--enable-cache-report", "h200-llama8b", "5555", "3"} <= set(args)
    with pytest.raises(ValueError):
        AffinityPlan(baselines=0)


def _target(name: str, goodput: float, conclusive: bool = True) -> TargetCell:
    return TargetCell(
        target=name, completed=50, errors=0, client_errors=0, min_ok=10, conclusive=conclusive,
        output_tok_s=1000.0, goodput_req_s=goodput, goodput_share=0.9, prefix_cache_hit_rate=0.6,
        mean_prompt_tokens=8000.0, p50_ttft_ms=300.0, p99_ttft_ms=900.0, p50_tpot_ms=30.0, p99_tpot_ms=45.0,
        window_s=12.0,
    )  # fmt: skip


def _cell(priced: float, in_flight: float, none: float = 4.0, seed: int = 0, conclusive: bool = True) -> AffinityCell:
    goodput = {"priced": priced, "both": priced, "in-flight": in_flight, "no-affinity": none}
    targets = {n: _target(n, goodput[n], conclusive or n != PRICED) for n in TARGETS}
    return AffinityCell(8000, 16, 2.0, targets, {n: 0.65 for n in TARGETS}, {n: 3.0 for n in TARGETS}, seed=seed)


def test_priced_against_each_other_target_pooled_over_runs() -> None:
    same = [_cell(5.0 + 0.3 * (-1) ** i, 5.0 - 0.3 * (-1) ** i, seed=i) for i in range(10)]
    line = comparison(same, PRICED, "in-flight")
    assert "1.00x over 10 runs" in line and line.endswith("no difference measured")
    better = [_cell(5.5 + 0.1 * i, 5.0 + 0.1 * i, seed=i) for i in range(10)]
    assert comparison(better, PRICED, "in-flight").endswith(": better")
    assert comparison(better, PRICED, "no-affinity").endswith(": better")
    worse = [_cell(4.0 + 0.1 * i, 5.0 + 0.1 * i, seed=i) for i in range(10)]
    assert comparison(worse, PRICED, "in-flight").endswith(": worse")
    # Fewer runs than an interval needs: the ratio alone; an inconclusive run is left out.
    few = [_cell(5.0, 4.0), _cell(9.0, 1.0, conclusive=False)]
    assert comparison(few, PRICED, "in-flight") == "priced / in-flight: 1.25x over 1 runs (too few for an interval)"
    assert "unknown" in comparison([_cell(1.0, 0.0)], PRICED, "in-flight")
    # Past a tenth of the runs inconclusive, pooling the rest would judge without the worst: unknown.
    slow = [_cell(0.5, 5.0, seed=20 + i, conclusive=False) for i in range(2)]
    assert comparison([*better, slow[0]], PRICED, "in-flight").endswith(": better")  # 1 of 11
    assert comparison([*better, *slow], PRICED, "in-flight").endswith(": unknown (2 of 12 runs inconclusive)")


def test_summary_lines_name_every_target_and_each_comparison() -> None:
    runs = [_cell(5.0, 5.0, seed=i) for i in range(3)]
    runs.append(_breaks_unread(runs[0]))
    lines = summary_lines(runs)
    assert lines[0] == "8k/16 (4 runs):"
    assert any(line.strip().startswith("priced ") and "hit 60%" in line and "oracle 65%" in line for line in lines)
    assert sum("priced / " in line for line in lines) == len(TARGETS) - 1
    assert sum("both / in-flight" in line for line in lines) == 1
    # A run of some rules only (--targets): their lines and comparisons alone.
    some = [dataclasses.replace(c, targets={n: c.targets[n] for n in ("priced", "in-flight")}) for c in runs[:3]]
    lines_some = summary_lines(some)
    assert not any(line.strip().startswith(("both", "no-affinity")) for line in lines_some)
    assert [line.strip().split(":")[0] for line in lines_some if " / " in line] == ["priced / in-flight"]
    assert any("load breaks 3 a run" in line for line in lines)
    # Each target's figures over the runs it was conclusive in, all of them; a saturated CPU is said.
    odd = dataclasses.replace(_cell(9.0, 5.0, seed=7, conclusive=False), cpu_warning="the machine's CPU was 99% busy")
    odd.oracle_hit[PRICED] = 0.05
    lines = summary_lines([*runs[:3], odd])
    priced = next(line for line in lines if line.strip().startswith("priced "))
    assert "goodput 5.00 req/s" in priced and "oracle 65%" in priced and priced.endswith("(3 of 4 runs conclusive)")
    assert "  warning: the machine's CPU was saturated in 1 of 4 runs: timings stretched" in lines


def _breaks_unread(cell: AffinityCell) -> AffinityCell:
    """A run whose breaks were not read: left out of the mean, not counted as 0."""
    return AffinityCell(
        cell.context, cell.sessions, cell.time_scale, cell.targets, cell.oracle_hit,
        {n: None for n in TARGETS}, seed=9,
    )  # fmt: skip


def test_the_command_parses() -> None:
    args = build_parser().parse_args(["headtohead-affinity", "--contexts", "1k,8k", "--baseline-servers", "3"])
    assert (args.contexts, args.baseline_servers, args.sessions, args.policy) == ((1000, 8000), 3, (16, 48), "model")
    assert math.isclose(args.window_s, 12.0)


def test_a_targets_queue_is_its_mean_over_the_window_alone() -> None:
    # Samples before the window (warm-up) and after it (the drain, and the other targets' runs on)
    # are not the window's.
    run = WorkloadRun([], t0=10.0, t1=20.0, concurrency=4)
    cap = CellCapture(runs={"a": run}, queued={"a": [(5.0, 0.0), (10.0, 4.0), (15.0, 6.0), (20.0, 5.0), (25.0, 0.0)]})
    assert cap.mean_queued("a") == 5.0
    assert CellCapture(runs={"a": run}, queued={"a": [(25.0, 3.0)]}).mean_queued("a") is None
    assert cap.mean_queued("b") is None


def test_a_run_whose_processes_did_not_start_is_started_again_once() -> None:
    tries: list[int] = []

    def flaky() -> str:
        tries.append(1)
        if len(tries) == 1:
            raise NotReady("pool-in-flight exited with code 1 before it was ready")
        return "measured"

    assert fresh_start(flaky, quiet=True) == "measured" and len(tries) == 2

    def dead() -> str:
        tries.append(1)
        raise NotReady("never")

    tries.clear()
    with pytest.raises(NotReady):
        fresh_start(dead, quiet=True)
    assert len(tries) == 2  # once more, not forever


def test_a_pool_is_a_pair_and_its_further_baselines_each_on_its_own_port(monkeypatch: pytest.MonkeyPatch) -> None:
    started: list[tuple[str, list[str], list[str]]] = []

    def record(self: Fleet, name: str, args: Sequence[str], urls: Sequence[str], env: object = None) -> None:
        started.append((name, list(args), list(urls)))

    monkeypatch.setattr(Fleet, "start", record)
    servers = Fleet().start_pool("pool", lambda s, b: ["pair", str(s), str(b)], lambda p: ["base", str(p)], 3)
    assert list(servers) == ["speculative", "b0", "b1", "b2"]
    assert [name for name, _, _ in started] == ["pool", "pool-b1", "pool-b2"]
    pair = started[0]
    assert pair[2] == [servers["speculative"] + "/health", servers["b0"] + "/health"]
    assert pair[1][1:] == [u.rsplit(":", 1)[1] for u in (servers["speculative"], servers["b0"])]
    for i, (_, args, urls) in enumerate(started[1:], start=1):
        assert args == ["base", servers[f"b{i}"].rsplit(":", 1)[1]] and urls == [servers[f"b{i}"] + "/health"]
    assert len(set(servers.values())) == 4
