"""`python -m loadtest shift`: one short real run (four simulated pairs, specgate static and adaptive,
the prompt mix switched twice), and the settle-time arithmetic on known inputs."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import orjson
import pytest

from loadtest.client import RequestResult
from loadtest.shift import RoutingSample, Tokens, settle_time
from loadtest.simulator.profile import load_profile

# Time scale 5, not 20: at 20 the four targets' ~45,000 chunks a second (the baseline emits a chunk a
# token) saturate two cores by themselves (measured: 96% busy, the baseline alone at 57% of its
# profile). At 5 they take ~65% of two idle cores, leaving room for a loaded machine.
TIME_SCALE = 5
PHASE_S = 7.0
LEVELS = (1, 2, 5, 10, 20, 30, 50, 70)


def diverse_calibration(path: Path) -> str:
    """What `calibrate --save` measures on a `--accept-from-prompt` pair with diverse prompts: the
    crossover profile at acceptance 1 (its speculative curve is at 3), in the simulators' time."""
    p = load_profile("crossover")
    a = p.speculative_accept_length
    spec = [p.throughput("speculative", c) * TIME_SCALE / a for c in LEVELS]
    base = [p.throughput("baseline", c) * TIME_SCALE for c in LEVELS]
    cal = {
        "format": "specgate-calibration/1",
        "levels": list(LEVELS),
        "speculative": {
            "output_tok_s": spec,
            "mean_tpot_ms": [1000 * c / s for c, s in zip(LEVELS, spec, strict=True)],
            "accept_length": [1.0] * len(LEVELS),
        },
        "baseline": {
            "output_tok_s": base,
            "mean_tpot_ms": [1000 * c / b for c, b in zip(LEVELS, base, strict=True)],
        },
        "accept_length": 1.0,
        "recommendation": {"high_watermark": 0, "low_watermark": 0, "verdict": "never_pays"},
    }
    path.write_bytes(orjson.dumps(cal))
    return str(path)


def in_phase(samples: list[dict[str, Any]], phase: dict[str, Any], key: str) -> list[Any]:
    inside = [s[key] for s in samples if phase["start_s"] <= s["t"] < phase["end_s"] and s[key] is not None]
    assert inside, f"no /routing sample with {key} in phase {phase['index'] + 1}"
    return inside


def last_in_phase(samples: list[dict[str, Any]], phase: dict[str, Any], key: str) -> Any:
    return in_phase(samples, phase, key)[-1]


def test_adaptive_follows_the_prompt_mix_through_two_shifts(tmp_path: Path) -> None:
    out = tmp_path / "out"
    # The adaptive settings are specgate's defaults scaled by the time scale, except the probes:
    # every 5 s of profile time (1 s here) instead of 15 doubling to 60, so that a repetitive phase
    # is learnt within its 7 s (a probe of a repetitive prompt is ~35 decode steps, and SGLang's
    # acceptance gauge refreshes every 40: it can take two).
    args = [
        sys.executable, "-m", "loadtest", "shift", "--profile", "crossover", "--concurrency", "10",
        "--phases", "repetitive,diverse,repetitive", "--phase-s", f"{PHASE_S:g}", "--settle-s", "3",
        "--time-scale", str(TIME_SCALE), "--calibration", diverse_calibration(tmp_path / "cal.json"),
        "--adaptive-setting", "probe_s=5", "--adaptive-setting", "probe_max_s=5",
        "--out-dir", str(out), "--quiet",
    ]  # fmt: skip
    done = subprocess.run(args, capture_output=True, text=True, timeout=110, check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "adapt/better" in done.stdout and f"plot: {out / 'shift.png'}" in done.stdout

    report = orjson.loads((out / "shift.json").read_bytes())
    assert report["settings"]["phases"] == ["repetitive", "diverse", "repetitive"]
    assert report["calibration"]["verdict"] == "never_pays"
    assert report["verdicts"] and isinstance(report["warnings"], list)
    (level,) = report["levels"]
    assert level["concurrency"] == 10
    assert set(level["rolling"]) == {"speculative", "baseline", "static", "adaptive"}
    assert {"machine_busy_mean", "by_process_s"} <= set(level["cpu"])
    phases = level["phases"]
    assert [p["source"] for p in phases] == ["repetitive", "diverse", "repetitive"]
    for p in phases:
        assert set(p["stats"]) == {"speculative", "baseline", "static", "adaptive"}
        assert set(p["vs_better"]) == set(p["settle_s"]) == set(p["mode_settle_s"]) == {"static", "adaptive"}
        assert set(p["switches"]) == {"static", "adaptive"}
        for name, st in p["stats"].items():
            # Every target answered, and no request failed on a server (client errors are not errors).
            assert st["completed"] > 0, (name, p["index"])
            assert st["errors"] == 0, (name, p["index"], st["error_samples"])
    assert not any(level["errors"].values()), level["errors"]

    samples = level["routing"]["adaptive"]
    assert all(s["mode"] in ("speculative", "baseline") for s in samples)
    # Repetitive prompts accept ~3.6 tokens a step: speculation wins at 10 streams. Diverse ones
    # accept ~1: it loses. The adaptive specgate ends each phase on the winner.
    assert [p["mode_at_end"]["adaptive"] for p in phases] == ["speculative", "baseline", "speculative"]
    # The acceptance as read during each later phase: the probes' pooled mean (evidence.py) of a
    # few probes, old ones among them, so which value stands at a phase's very end depends on
    # whether the last probe came back before it (1.49 or 1.86 at the diverse phase's end, in runs
    # of the same code). Each phase's reading reaches its traffic's side: under 1.5 while diverse,
    # over 2 once repetitive again (2.35-2.55, the mean of the probes when the mode went back to
    # speculation, which ends the probes).
    rep1 = last_in_phase(samples, phases[0], "accept_live")
    div = min(in_phase(samples, phases[1], "accept_live"))
    rep2 = max(in_phase(samples, phases[2], "accept_live"))
    assert rep1 > 2.5 and rep2 > 2.0 and div < 1.5, (rep1, div, rep2)
    highs = [last_in_phase(samples, p, "high") for p in phases]
    assert highs[0] > 10 > highs[1] and highs[2] > 10, highs
    # The static watermarks from this calibration send everything to the baseline, whatever the mix.
    assert [p["mode_at_end"]["static"] for p in phases] == ["baseline"] * 3
    assert all(s["high"] == 0 for s in level["routing"]["static"])

    png = (out / "shift.png").read_bytes()
    assert png.startswith(b"\x89PNG") and len(png) > 10_000


# ---------------------------------------------------------------------------------------------
# Settle time on known inputs


def steady(rate: float, start: float, end: float) -> RequestResult:
    """One request producing `rate` tokens a second, a chunk every 10 ms, over [start, end)."""
    n = round((end - start) * 100)
    times = [start + k / 100 for k in range(n)]
    return RequestResult(
        started=start, finished=end, ok=True, chunk_times=times, output_tokens=round(rate * (end - start))
    )


def tokens(*parts: tuple[float, float, float]) -> Tokens:
    return Tokens([steady(rate, a, b) for rate, a, b in parts], 0.0)


def modes(*changes: tuple[float, str], end: float = 60.0) -> list[RoutingSample]:
    out = []
    for k in range(int(end * 2)):
        t = k / 2
        mode = [m for at, m in changes if at <= t][-1]
        out.append(RoutingSample(t, 10, mode, 16, 12))
    return out


SPEC = tokens((100.0, 0.0, 60.0))
BASE = tokens((50.0, 0.0, 60.0))


def test_settle_time_is_when_the_gate_keeps_up_with_the_better_server_from_then_on() -> None:
    gate = tokens((50.0, 0.0, 8.0), (100.0, 8.0, 60.0))
    right = modes((0.0, "baseline"), (8.0, "speculative"))
    settled = settle_time(0.0, 60.0, gate, SPEC, BASE, right, "speculative", False, 10.0, 0.5)
    # Throughput alone: a 10 s window starting 1 s before the recovery already holds 95%, so 7 s;
    # the mode (speculative from 8 s) makes it 8.
    assert settled == pytest.approx(8.0)


def test_settle_time_waits_for_the_right_mode_unless_the_servers_tie() -> None:
    gate = tokens((100.0, 0.0, 60.0))
    wrong_until_20 = modes((0.0, "baseline"), (20.0, "speculative"))
    assert settle_time(0.0, 60.0, gate, SPEC, BASE, wrong_until_20, "speculative", False, 10.0, 0.5) == 20.0
    assert settle_time(0.0, 60.0, gate, SPEC, BASE, wrong_until_20, "speculative", True, 10.0, 0.5) == 0.0


def test_settle_time_is_none_when_the_gate_never_keeps_up_or_too_late() -> None:
    slow = tokens((90.0, 0.0, 60.0))
    right = modes((0.0, "speculative"))
    assert settle_time(0.0, 60.0, slow, SPEC, BASE, right, "speculative", False, 10.0, 0.5) is None
    late = tokens((50.0, 0.0, 55.0), (100.0, 55.0, 60.0))
    assert settle_time(0.0, 60.0, late, SPEC, BASE, right, "speculative", False, 10.0, 0.5) is None
    # A dip in the middle restarts the clock: settled only after it.
    dip = tokens((100.0, 0.0, 30.0), (20.0, 30.0, 32.0), (100.0, 32.0, 60.0))
    assert settle_time(0.0, 60.0, dip, SPEC, BASE, right, "speculative", False, 10.0, 0.5) == pytest.approx(
        32.0, abs=0.6
    )


def test_shift_rejects_a_settle_period_as_long_as_the_phase() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "loadtest", "shift", "--phase-s", "10", "--settle-s", "10", "--calibration", "x"],
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert done.returncode == 2 and "--settle-s" in done.stderr
