"""The sweeping commands as a user meets them, in-process: the class and session headers their
requests carry (--specgate-headers), what an interrupted command prints, and what the comparison
plot's latency panel plots."""

from __future__ import annotations

import argparse
from collections import Counter, defaultdict
from pathlib import Path

import pytest

from loadtest.__main__ import build_parser
from loadtest.calibrate import Crossover
from loadtest.client import RequestResult
from loadtest.kit.interrupt import Measured, comparison, interrupted_text, reported_if_interrupted
from loadtest.kit.sweeps import default_prompts, settings_of, sweep_targets
from loadtest.report import compare_panels, plot_compare
from loadtest.stats import LevelStats, summarize

from ..recorder import Recorder, serving


def sweep_args(url: str, *flags: str) -> argparse.Namespace:
    quick = ["--concurrency", "2", "--duration-s", "0.2", "--max-tokens", "3", "--min-requests", "0", "--quiet"]
    args = build_parser().parse_args(["sweep", "--url", url, "--model", "m", *quick, *flags])
    default_prompts(args)
    return args


MULTITURN = ["--workload", "multiturn", "--turns", "2", "--system-tokens", "20", "--user-tokens", "20",
             "--think-time-s", "0", "--class", "chat:0.5:diverse", "--class", "code:0.5:repetitive"]  # fmt: skip


@pytest.mark.anyio
async def test_a_multiturn_sweep_with_classes_sends_each_requests_class_and_session_by_default() -> None:
    rec = Recorder()
    async with serving(rec) as url:
        args = sweep_args(url, *MULTITURN)
        await sweep_targets({"target": url}, args)
    assert rec.seen and settings_of(args)["sent_specgate_headers"] is True
    classes: dict[str, set[str | None]] = defaultdict(set)
    turns: Counter[str] = Counter()
    for cls, session, _ in rec.seen:
        assert cls in ("chat", "code") and session
        classes[session].add(cls)
        turns[session] += 1
    # One class a conversation, and its turns under one session: what specgate's affinity keys on.
    assert all(len(c) == 1 for c in classes.values())
    assert max(turns.values()) == 2
    assert {c for cs in classes.values() for c in cs} == {"chat", "code"}


@pytest.mark.anyio
@pytest.mark.parametrize(
    ("flags", "sent"),
    [
        ([], False),  # one-turn requests of one class: nothing to tell
        (["--specgate-headers", "on"], True),
        ([*MULTITURN, "--specgate-headers", "off"], False),
    ],
)
async def test_the_headers_follow_the_option(flags: list[str], sent: bool) -> None:
    rec = Recorder()
    async with serving(rec) as url:
        args = sweep_args(url, *flags)
        await sweep_targets({"target": url}, args)
    assert rec.seen and settings_of(args)["sent_specgate_headers"] is sent
    if sent:
        assert all(cls == "all" and session for cls, session, _ in rec.seen)
    else:
        assert all(cls is None and session is None for cls, session, _ in rec.seen)


def test_a_bad_header_choice_is_refused_naming_the_flag(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        build_parser().parse_args(["sweep", "--url", "http://x", "--specgate-headers", "yes"])
    assert "--specgate-headers" in capsys.readouterr().err


# --- what the comparison plots ---------------------------------------------------------------------


def one_stream(gap_s: float, events: int, tokens: int) -> LevelStats:
    """A level of requests whose `events` stream events come `gap_s` apart and carry `tokens` in all."""
    results = []
    t = 0.0
    for _ in range(10):
        r = RequestResult(started=t, ttft=0.025, ok=True, output_tokens=tokens)
        r.chunk_times = [t + 0.025 + i * gap_s for i in range(events)]
        r.finished = r.chunk_times[-1]
        results.append(r)
        t = r.finished
    return summarize(1, results, 0.0, t)


def test_the_latency_panel_plots_time_per_output_token_not_the_gap_between_events(tmp_path: Path) -> None:
    # At one stream a speculative server sends an event every 17 ms with ~2.5 tokens in each, the
    # baseline one token every 10 ms: its gaps are longer, its tokens come sooner.
    spec, base = one_stream(0.017, 26, 64), one_stream(0.010, 64, 64)
    assert spec.median_itl_ms > base.median_itl_ms
    panels = compare_panels({"speculative": [spec], "baseline": [base]})
    (latency,) = [p for p in panels if "token" in p.label]
    assert latency.label == "time per output token, ms" and latency.field == "mean_tpot_ms"
    (spec_point,), (base_point,) = latency.series["speculative"], latency.series["baseline"]
    assert spec_point[0] == base_point[0] == 1
    assert spec_point[1] == pytest.approx(25 * 17 / 63) and base_point[1] == pytest.approx(10.0)
    assert spec_point[1] < base_point[1]
    assert not any("ITL" in p.label for p in panels)
    nothing = Crossover("throughput", "no_data")
    plot_compare(tmp_path / "compare.png", {"speculative": [spec], "baseline": [base]}, nothing)
    assert (tmp_path / "compare.png").stat().st_size > 0


# --- an interrupted command -------------------------------------------------------------------------


def test_an_interrupt_prints_the_levels_every_target_completed_and_goes_on(capsys: pytest.CaptureFixture[str]) -> None:
    spec, base = one_stream(0.017, 26, 64), one_stream(0.010, 64, 64)
    args = argparse.Namespace()
    with pytest.raises(KeyboardInterrupt), reported_if_interrupted(args, comparison) as measured:
        assert args.measured is measured  # where the command's sweeps keep their levels
        sweep = measured.begin(["speculative", "baseline"])
        sweep["speculative"].append(spec)
        sweep["baseline"].append(base)
        sweep["speculative"].append(spec)  # the level the interrupt cut: the baseline's never came
        raise KeyboardInterrupt
    text = capsys.readouterr().out
    assert text.startswith("\ninterrupted:") and "output tok/s by concurrency" in text
    rows = [line for line in text.splitlines() if line.startswith("    1 ")]
    assert len(rows) == 1  # the level both servers completed, once
    assert "interrupted before any level completed" in interrupted_text(Measured(), comparison)
