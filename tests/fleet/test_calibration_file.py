"""`calibrate --save`: the calibration file specgate loads, and the acceptance measured for it."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import math
import re
import subprocess
import sys
from collections.abc import Sequence
from datetime import datetime
from pathlib import Path

import pytest
from aiohttp import web

from loadtest.acceptance import AcceptanceMeter, level_acceptance
from loadtest.calibrate import Recommendation, calibration_file, class_acceptance
from loadtest.classes import ClassSummary
from loadtest.procs import free_port
from loadtest.stats import LevelStats
from proxy.fleet.engines import LLAMACPP, SGLANG, VLLM
from proxy.policy.calibration import MAX_CLASSES, CalibrationError, load, parse, to_json

from ..conftest import StartSim

LEVELS = [1, 10, 30]
QUICK = ["--duration-s", "1", "--max-tokens", "16", "--quiet", "--endpoint", "completions", "--prompts", "fixed"]
SIM = ("--profile", "crossover", "--time-scale", "20")
KEY = "sk-calibration-secret"


def calibrate(
    spec: str, base: str, save: Path, *args: str, quick: Sequence[str] = QUICK
) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "loadtest", "calibrate", "--speculative", spec, "--baseline", base, *quick,
           "--save", str(save), *args]  # fmt: skip
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120)


def test_save_writes_the_curves_acceptance_settings_and_recommendation(simulator: StartSim, tmp_path: Path) -> None:
    spec = simulator("speculative", *SIM, "--api-key", KEY)
    base = simulator("baseline", *SIM, "--api-key", KEY)
    save, out = tmp_path / "calibration.json", tmp_path / "out.json"
    levels = ",".join(map(str, LEVELS))
    proc = calibrate(
        spec.url,
        base.url,
        save,
        "--concurrency",
        levels,
        "--api-key",
        KEY,
        "--out",
        str(out),
        "--prompt-tokens",
        "1000",
    )
    assert proc.returncode == 0, proc.stderr
    cal = load(str(save))

    # The speed model: fitted to the fixed prompt's sweep and one of 1,000-token prompts.
    assert cal.model is not None, proc.stderr
    assert len(cal.model.prompt_tokens) == 2 and cal.model.prompt_tokens[-1] == pytest.approx(1000, rel=0.1)
    assert cal.model.max_tokens == 16 and cal.model.accept_length > 1
    for fit in (cal.model.speculative, cal.model.baseline):
        assert fit.a + fit.b > 0 and fit.points >= 4
    assert "speed model, baseline: step =" in proc.stdout

    # The levels the search measured (10 ahead, 30 behind: the crossover at 20 bracketed without 1)
    # make the curves, conclusive ones; the others are named, none lost. specgate loads such a file.
    assert sorted([*cal.levels, *cal.inconclusive_levels]) == [10, 30]
    assert "search: 10 streams" in proc.stderr and cal.settings["search"] == "bisect"
    assert cal.levels
    n = len(cal.levels)
    for curve in (cal.speculative, cal.baseline):
        assert len(curve.output_tok_s) == len(curve.mean_tpot_ms) == n
        assert all(v > 0 for v in curve.output_tok_s)
    # The same figures --out reports for those levels.
    sweeps = json.loads(out.read_text())["sweeps"]
    for role, curve in (("speculative", cal.speculative), ("baseline", cal.baseline)):
        by_level = {row["concurrency"]: row for row in sweeps[role]}
        assert list(curve.output_tok_s) == [round(by_level[c]["output_tok_s"], 2) for c in cal.levels]

    # The speculative simulator reports its acceptance (the profile's 3 tokens a step) at every level.
    assert len(cal.speculative.accept_length) == n
    assert all(a > 1 for a in cal.speculative.accept_length), cal.speculative.accept_length
    assert cal.accept_length is not None and cal.accept_length > 1
    assert cal.baseline.accept_length == ()
    assert "sglang:spec_accept_length" in cal.settings["acceptance"]

    # The settings of the sweep, and never the key.
    text = save.read_text()
    assert KEY not in text and "api_key" not in cal.settings
    s = cal.settings
    assert (s["levels"], s["max_tokens"], s["endpoint"], s["prompts"]) == (LEVELS, 16, "completions", "fixed")
    assert (s["duration_s"], s["requests"], s["seed"], s["extra_body"]) == (1.0, None, 0, {})
    assert s["min_requests"] == 10 and s["speculative"] == spec.url
    datetime.strptime(cal.created, "%Y-%m-%dT%H:%M:%SZ")  # UTC, ISO 8601

    # The recommendation as calibrate printed it (and as --out has it).
    high = re.search(r"SPECGATE_HIGH_WATERMARK=(\d+)", proc.stdout)
    low = re.search(r"SPECGATE_LOW_WATERMARK=(\d+)", proc.stdout)
    assert high and low, proc.stdout
    assert (cal.high_watermark, cal.low_watermark) == (int(high[1]), int(low[1]))
    assert cal.explanation and cal.explanation in proc.stdout
    rec = json.loads(out.read_text())["recommendation"]
    assert (rec["high"], rec["low"], rec["verdict"], rec["explanation"]) == (
        cal.high_watermark, cal.low_watermark, cal.verdict, cal.explanation)  # fmt: skip

    assert f"calibration saved: {save}" in proc.stdout
    assert f"SPECGATE_CALIBRATION={save}" in proc.stdout
    assert "not measured" not in proc.stderr


def test_save_measures_each_classs_acceptance(simulator: StartSim, tmp_path: Path) -> None:
    # The speculative simulator accepts by the prompt: varied text about 1 token a step, text that
    # repeats itself up to 3.2.
    spec = simulator("speculative", *SIM, "--accept-from-prompt", "--max-accept-length", "3.2")
    base = simulator("baseline", *SIM)
    save = tmp_path / "calibration.json"
    classes = ("--class", "prose:0.5:diverse", "--class", "code:0.5:repetitive")
    quick = [a for a in QUICK if a not in ("--prompts", "fixed")]  # the classes choose the prompts
    proc = calibrate(
        spec.url, base.url, save, "--concurrency", "1,10", "--prompt-tokens", "none", *classes, quick=quick
    )
    assert proc.returncode == 0, proc.stderr
    cal = load(str(save))
    assert set(cal.classes) == {"prose", "code"}, cal.classes
    assert cal.classes["code"] > 2.2 > 1.5 > cal.classes["prose"] >= 1.0, cal.classes
    assert f"class code {cal.classes['code']:.2f}" in proc.stdout


def test_a_server_without_metrics_gives_null_acceptance_and_still_a_file(simulator: StartSim, tmp_path: Path) -> None:
    spec = simulator("speculative", *SIM, "--no-metrics")
    base = simulator("baseline", *SIM, "--no-metrics")
    save = tmp_path / "calibration.json"
    proc = calibrate(spec.url, base.url, save, "--concurrency", "1,4")
    assert proc.returncode == 0, proc.stderr
    cal = load(str(save))
    assert cal.accept_length is None
    assert len(cal.speculative.accept_length) == len(cal.levels)
    assert all(math.isnan(a) for a in cal.speculative.accept_length)
    assert json.loads(save.read_text())["accept_length"] is None
    lines = [line for line in proc.stderr.splitlines() if "acceptance length not measured" in line]
    assert len(lines) == 1 and "404" in lines[0], proc.stderr
    assert cal.settings["acceptance"].startswith("not measured")
    assert "; acceptance length not measured)" in proc.stdout


def test_a_server_without_speculation_gives_null_acceptance(simulator: StartSim, tmp_path: Path) -> None:
    # A baseline as the "speculative" server: its metrics are SGLang's, its acceptance gauge 0.
    base = simulator("baseline", *SIM)
    save = tmp_path / "calibration.json"
    proc = calibrate(base.url, base.url, save, "--concurrency", "1")
    assert proc.returncode == 0, proc.stderr
    cal = load(str(save))
    assert cal.accept_length is None and all(math.isnan(a) for a in cal.speculative.accept_length)
    assert "reported no acceptance" in proc.stderr


def test_save_into_a_missing_directory_fails_before_measuring(tmp_path: Path) -> None:
    url = f"http://127.0.0.1:{free_port()}"
    proc = calibrate(url, url, tmp_path / "nowhere" / "calibration.json")
    assert proc.returncode == 2 and "no such directory" in proc.stderr


# ----- the file from known figures -----


def level(c: int, tok_s: float, tpot_ms: float = 5.0, conclusive: bool = True) -> LevelStats:
    nan = math.nan
    return LevelStats(concurrency=c, duration_s=10.0, completed=50, errors=0, output_tok_s=tok_s, request_per_s=1.0,
                      mean_ttft_ms=nan, median_ttft_ms=nan, p99_ttft_ms=nan, mean_itl_ms=nan, median_itl_ms=nan,
                      p95_itl_ms=nan, p99_itl_ms=nan, mean_tpot_ms=tpot_ms, mean_e2e_ms=nan, median_e2e_ms=nan,
                      min_ok=10, conclusive=conclusive)  # fmt: skip


REC = Recommendation(14, 10, "crosses", "Speculation stops paying at about 14.9 concurrent streams.", (30,))


def test_the_file_keeps_conclusive_levels_and_their_acceptance() -> None:
    spec = [level(1, 200.0, 2.0), level(10, 1500.0, math.nan), level(30, 900.0, conclusive=False)]
    base = [level(1, 100.0, 8.0), level(10, 1200.0, 8.0), level(30, 3000.0)]
    cal = calibration_file(spec, base, REC, {1: 3.0, 10: None, 30: 2.0}, {"max_tokens": 16}, "2026-01-01T00:00:00Z")
    assert cal.levels == (1, 10) and cal.inconclusive_levels == (30,)
    assert cal.speculative.output_tok_s == (200.0, 1500.0) and cal.baseline.output_tok_s == (100.0, 1200.0)
    assert cal.speculative.mean_tpot_ms[0] == 2.0 and math.isnan(cal.speculative.mean_tpot_ms[1])
    # Per level, null where none was reported; the mean only over the levels in the file.
    assert cal.speculative.accept_length[0] == 3.0 and math.isnan(cal.speculative.accept_length[1])
    assert cal.accept_length == 3.0 and cal.accept_at(1) == 3.0
    assert (cal.high_watermark, cal.low_watermark, cal.verdict, cal.explanation) == (14, 10, "crosses", REC.explanation)
    data = to_json(cal)
    assert data["speculative"]["mean_tpot_ms"] == [2.0, None]
    assert data["speculative"]["accept_length"] == [3.0, None]
    assert parse(json.loads(json.dumps(data))) == cal


def with_classes(row: LevelStats, **per_class: tuple[int, int]) -> LevelStats:
    """`row` with, per class, its good requests' decode tokens and content events."""
    nan = math.nan
    classes = {name: ClassSummary(name, 10, 0, 5, nan, nan, nan, nan, 1.0, None, None, None, 0, nan, tokens, events)
               for name, (tokens, events) in per_class.items()}  # fmt: skip
    return dataclasses.replace(row, classes=classes)


def test_each_class_gets_its_acceptance_as_specgate_measures_it() -> None:
    spec = [
        with_classes(level(1, 200.0), chat=(130, 100), code=(300, 100)),
        with_classes(level(10, 1500.0), chat=(260, 200), code=(900, 300)),
        # Left out: an inconclusive level's requests are too few to trust.
        with_classes(level(30, 900.0, conclusive=False), chat=(900, 100), code=(100, 100)),
    ]
    # Tokens over events, summed over the conclusive levels.
    assert class_acceptance(spec, True) == {"chat": 1.3, "code": 3.0}
    # Unknown where the engine's events are not its steps, with one class (its mean is the file's)
    # or none.
    assert class_acceptance(spec, False) == {}
    assert class_acceptance([with_classes(level(1, 200.0), all=(300, 100))], True) == {}
    assert class_acceptance([level(1, 200.0)], True) == {}
    # The file carries them, and specgate reads them back.
    cal = calibration_file(spec, spec, REC, {1: 2.2}, {}, "", classes=class_acceptance(spec, True))
    data = json.loads(json.dumps(to_json(cal)))
    assert data["classes"] == {"chat": {"accept_length": 1.3}, "code": {"accept_length": 3.0}}
    assert parse(data).classes == {"chat": 1.3, "code": 3.0}


def test_a_files_classes_are_optional_and_checked() -> None:
    spec = [level(1, 200.0)]
    data = to_json(calibration_file(spec, spec, REC, {1: 2.0}, {}, ""))
    assert "classes" not in data and parse(data).classes == {}
    assert parse({**data, "classes": None}).classes == {}
    for bad, says in (
        ([1.3], "classes: must be an object"),
        ({f"c{i}": {"accept_length": 2.0} for i in range(MAX_CLASSES + 1)}, "classes: must be an object"),
        ({"": {"accept_length": 2.0}}, "is not 1-64 printable"),
        ({"x" * 65: {"accept_length": 2.0}}, "is not 1-64 printable"),
        ({"a\nb": {"accept_length": 2.0}}, "is not 1-64 printable"),
        ({" chat": {"accept_length": 2.0}}, "none at either end a space"),  # no request's class could match
        ({"chat": 1.3}, "classes.chat: not an object"),
        ({"chat": {}}, "classes.chat.accept_length"),
        ({"chat": {"accept_length": 0.5}}, "classes.chat.accept_length"),
        ({"chat": {"accept_length": math.inf}}, "classes.chat.accept_length"),
        ({"chat": {"accept_length": True}}, "classes.chat.accept_length"),
    ):
        with pytest.raises(CalibrationError, match=re.escape(says)):
            parse({**data, "classes": bad})


def test_no_conclusive_level_makes_no_file() -> None:
    spec, base = [level(1, 200.0, conclusive=False)], [level(1, 100.0)]
    with pytest.raises(ValueError, match="no level was conclusive"):
        calibration_file(spec, base, REC, {}, {}, "")


# ----- the acceptance meter against canned /metrics -----


def counters(prefix: str, accepted: float, drafts: float) -> str:
    return (
        f"# TYPE {prefix}spec_decode_num_accepted_tokens counter\n"
        f"{prefix}spec_decode_num_accepted_tokens_total {accepted}\n"
        f"# TYPE {prefix}spec_decode_num_drafts counter\n"
        f"{prefix}spec_decode_num_drafts_total {drafts}\n"
    )


def gauge(value: float) -> str:
    return f'# TYPE sglang:spec_accept_length gauge\nsglang:spec_accept_length{{tp_rank="0"}} {value}\n'


async def measure(answers: list[tuple[int, str]]) -> AcceptanceMeter:
    """A meter over one level against a /metrics that gives the (status, text) answers in turn, the
    last one from then on: probe, the window's start, its end."""
    served = 0

    async def handler(_: web.Request) -> web.Response:
        nonlocal served
        status, text = answers[min(served, len(answers) - 1)]
        served += 1
        return web.Response(status=status, text=text)

    app = web.Application()
    app.router.add_get("/metrics", handler)
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    meter = AcceptanceMeter(f"http://127.0.0.1:{port}", poll_s=60.0)
    try:
        await meter.open()
        if meter.engine is not None:
            ended = asyncio.Event()
            ended.set()  # the window's start is read, then its end at once
            await meter.during_window(7, ended)
            meter.finish()
    finally:
        await meter.close()
        await runner.cleanup()
    return meter


@pytest.mark.parametrize("prefix", ["vllm:", "llamacpp:"])
def test_counters_give_one_plus_accepted_per_draft_over_the_window(prefix: str) -> None:
    # 200 tokens accepted over 100 drafts between the window's start and end.
    answers = [(200, counters(prefix, 50, 40)), (200, counters(prefix, 100, 50)), (200, counters(prefix, 300, 150))]
    meter = asyncio.run(measure(answers))
    assert meter.engine is not None and meter.engine.name == prefix.rstrip(":")
    assert meter.by_level == {7: 3.0} and meter.reason is None


def test_the_gauge_is_read_inside_the_window_not_at_its_start() -> None:
    # Probe (idle: 0), the window's start (what the load before left), its end.
    meter = asyncio.run(measure([(200, gauge(0)), (200, gauge(2.0)), (200, gauge(2.5))]))
    assert meter.by_level == {7: 2.5}
    assert level_acceptance(SGLANG, None, None, [2.0, 3.0]) == 2.5


def test_no_drafts_or_a_restart_measures_nothing() -> None:
    def values(prefix: str, accepted: float, drafts: float) -> dict[str, float]:
        return {
            f"{prefix}spec_decode_num_accepted_tokens_total": accepted,
            f"{prefix}spec_decode_num_drafts_total": drafts,
        }

    idle = values("vllm:", 10, 5)
    assert level_acceptance(VLLM, idle, idle, []) is None
    assert level_acceptance(LLAMACPP, values("llamacpp:", 50, 10), values("llamacpp:", 3, 12), []) is None
    assert level_acceptance(SGLANG, None, None, []) is None


@pytest.mark.parametrize(
    ("answer", "why"),
    [
        ((404, "not found"), "answered 404"),
        ((500, "oops"), "answered HTTP 500"),
        ((200, "# TYPE foo_total counter\nfoo_total 1\n"), "no metrics of SGLang, vLLM or llama.cpp"),
        ((200, "this is { not prometheus"), "not Prometheus text"),
    ],
)
def test_why_acceptance_is_not_measured(answer: tuple[int, str], why: str) -> None:
    meter = asyncio.run(measure([answer]))
    assert meter.engine is None and meter.reason is not None and why in meter.reason, meter.reason
    assert meter.source.startswith("not measured")


def test_an_unreachable_server_is_not_measured() -> None:
    async def go() -> AcceptanceMeter:
        meter = AcceptanceMeter(f"http://user:pw@127.0.0.1:{free_port()}")
        await meter.open()
        await meter.close()
        return meter

    meter = asyncio.run(go())
    assert meter.engine is None and meter.reason is not None and "cannot reach" in meter.reason
    assert "pw" not in meter.reason
