"""The speed model (proxy/policy/speedmodel.py): the fit, its predictions, the crossover it solves, the
watermarks with their band, and the live correction. Pure: no servers."""

from __future__ import annotations

import math

import pytest

from loadtest.simulator.steptimes import load_steptimes
from proxy.policy.base import Role
from proxy.policy.calibration import ModelFit, StepFit
from proxy.policy.speedmodel import MAX_CORRECTION, MAX_SOLVED, ModelLimits, Point, StepModel, crossover, fit_step

SPEC = StepFit(0.014, 5.6e-4, 1.6e-7)
BASE = StepFit(0.006, 2e-5, 2e-8)
LIMITS = ModelLimits(min_watermark=0, max_watermark=256, margin=0.0)


def model(spec: StepFit = SPEC, base: StepFit = BASE, accept: float = 3.0, limits: ModelLimits = LIMITS) -> StepModel:
    return StepModel(ModelFit(spec, base, (100, 4000), 0, accept), limits)


def test_the_fit_recovers_a_known_formula_exactly() -> None:
    truth = StepFit(0.0062, 1.5e-5, 3.1e-8)
    points = [Point(b, b * ctx, truth.step_s(b, b * ctx)) for ctx in (512, 4096) for b in (1, 4, 16, 64, 256)]
    got = fit_step(points)
    assert got is not None and got.points == 10
    for name in ("a", "b", "c"):
        assert getattr(got, name) == pytest.approx(getattr(truth, name), rel=1e-9)
    assert got.max_rel < 1e-9


def test_the_fit_needs_two_contexts_and_never_goes_negative() -> None:
    truth = StepFit(0.006, 1e-5, 3e-8)
    one_context = [Point(b, b * 1024, truth.step_s(b, b * 1024)) for b in (1, 8, 64)]
    assert fit_step(one_context) is None  # c and b cannot be told apart
    # Step times that fall with context: c would come out negative; it is fixed at 0 instead.
    falling = [Point(b, b * ctx, 0.006 + 1e-5 * b - 1e-9 * b * ctx) for ctx in (512, 4096) for b in (1, 8, 64)]
    got = fit_step(falling)
    assert got is not None and got.c == 0.0 and got.a > 0 and got.b >= 0
    # A point of no finite size is left out, not fitted into NaNs.
    odd = fit_step([*falling, Point(8, math.inf, 0.01), Point(math.nan, 100.0, 0.01)])
    assert odd == got


@pytest.mark.parametrize("role", ["baseline", "speculative"])
def test_the_h200_table_fits_within_15_percent(role: str) -> None:
    # The simulator's H200 step times (Llama-3.1-8B shape) at 1k and 4k tokens a stream, batch 1 to
    # 256; the speculative step is EAGLE-3's with 3 draft steps.
    table = load_steptimes("h200-llama8b")
    points = [
        Point(b, b * ctx, table.baseline_step_s(b, ctx) if role == "baseline" else table.eagle_step_s(b, 3, ctx))
        for ctx in (1024.0, 4096.0)
        for b in (1, 2, 4, 8, 16, 32, 48, 64, 96, 128, 192, 256)
    ]
    got = fit_step(points)
    assert got is not None
    assert got.max_rel < 0.15 and got.rms_rel < 0.09, got
    # Step time grows with batch and with context.
    assert got.b > 0 and got.c > 0


def test_the_crossover_is_where_per_stream_speeds_meet() -> None:
    for context in (100.0, 4000.0):
        at = crossover(SPEC, BASE, 3.0, context)
        spec_v = 3.0 / SPEC.step_s(at, at * context)
        base_v = 1.0 / BASE.step_s(at, at * context)
        assert spec_v == pytest.approx(base_v, rel=1e-9)
    # Here drafting reads more KV a token than it saves: longer context, earlier crossover.
    assert crossover(SPEC, BASE, 3.0, 4000) < crossover(SPEC, BASE, 3.0, 100)
    # Higher acceptance: later crossover.
    assert crossover(SPEC, BASE, 3.5, 100) > crossover(SPEC, BASE, 3.0, 100)
    assert crossover(SPEC, BASE, 1.0, 100) == 0.0  # a speculative step dearer at no gain
    assert crossover(StepFit(0.006, 1e-5, 1e-8), BASE, 2.0, 100) == math.inf  # never loses
    # Two servers of a role share the load: each holds half.
    assert crossover(SPEC, BASE, 3.0, 100, n_spec=2) > crossover(SPEC, BASE, 3.0, 100)


def test_on_the_h200_longer_context_moves_the_crossover_up() -> None:
    # As the table itself says (shared/design.md: accept 1.5 at 48-64 streams with 1k, 64-96 with 4k).
    table = load_steptimes("h200-llama8b")
    fits = {}
    for role in ("baseline", "speculative"):
        pts = [
            Point(b, b * ctx, table.baseline_step_s(b, ctx) if role == "baseline" else table.eagle_step_s(b, 3, ctx))
            for ctx in (1024.0, 4096.0)
            for b in (1, 2, 4, 8, 16, 32, 48, 64, 96, 128, 192, 256)
        ]
        fits[role] = fit_step(pts)
    spec, base = fits["speculative"], fits["baseline"]
    assert spec is not None and base is not None
    short, long = crossover(spec, base, 1.5, 1024), crossover(spec, base, 1.5, 4096)
    assert 24 < short < long < 128


def test_watermarks_have_a_band_and_follow_context() -> None:
    m = model(limits=ModelLimits(min_watermark=0, max_watermark=256, margin=0.05))
    high, low = m.watermarks(0, 100.0, 1, None, "live")
    assert m.accept_source == "calibrated" and m.accept == 3.0
    leave = crossover(SPEC, BASE, 3.0 * 1.05, 100)
    assert high == math.floor(leave) and low < high
    assert low <= math.floor(crossover(SPEC, BASE, 3.0 / 1.05, 100))
    long_high, _ = m.watermarks(0, 8000.0, 2, None, "live")  # 4000 tokens a stream
    assert long_high < high
    # The live acceptance moves them too.
    assert m.watermarks(0, 200.0, 2, 3.6, "live")[0] > high and m.accept_source == "live"
    d = m.describe()
    assert d["watermarks"] == {"high": m.high, "low": m.low}
    assert set(d["predictions"]["speculative"]) == {"now", "with_one_more"}
    assert d["fit"]["baseline"]["a_s"] == BASE.a and d["why"]


def test_watermarks_stay_within_the_limits() -> None:
    never_loses = model(spec=StepFit(0.006, 1e-5, 1e-8), base=BASE, accept=2.0)
    assert never_loses.watermarks(0, 100.0, 1, None, "live")[0] == 256
    never_pays = model(accept=1.0)
    assert never_pays.watermarks(0, 100.0, 1, None, "live") == (0, 0)
    floor = model(accept=1.0, limits=ModelLimits(min_watermark=2, max_watermark=256, margin=0.0))
    assert floor.watermarks(0, 100.0, 1, None, "live")[0] == 2


def test_predictions_with_one_more_stream() -> None:
    m = model()
    m.watermarks(9, 1000.0, 10, None, "live")
    p = m.predictions
    now, more = p[Role.SPECULATIVE]["now"], p[Role.SPECULATIVE]["with_one_more"]
    assert (now.batch, more.batch) == (9, 10)
    assert now.tok_s_per_stream == pytest.approx(3.0 / SPEC.step_s(9, 900))
    assert more.tok_s == pytest.approx(10 * 3.0 / SPEC.step_s(10, 1000))
    assert more.tok_s_per_stream < now.tok_s_per_stream


def test_the_live_correction_converges_and_is_bounded() -> None:
    m = model()
    # A baseline 1.5x slower than fitted, seen at many loads and contexts.
    for i in range(100):
        b, t = 1 + i % 20, (1 + i % 20) * 500.0
        m.observe(Role.BASELINE, b, t, 1.0 / (1.5 * BASE.step_s(b, t)), None)
    assert m.corrections[Role.BASELINE].k == pytest.approx(1.5, rel=0.01)
    assert m.corrections[Role.SPECULATIVE].k == 1.0
    # A speculative server 10x slower moves it at most to MAX_CORRECTION; junk moves nothing.
    for _ in range(200):
        m.observe(Role.SPECULATIVE, 4, 400.0, 3.0 / (10 * SPEC.step_s(4, 400)), 3.0)
    m.observe(Role.SPECULATIVE, 4, 400.0, math.nan, 3.0)
    m.observe(Role.SPECULATIVE, 0, 400.0, 5.0, 3.0)
    assert m.corrections[Role.SPECULATIVE].k == pytest.approx(MAX_CORRECTION)
    assert m.corrections[Role.SPECULATIVE].observations == 200
    # The baseline slower: speculation pays further.
    slow_base = model()
    slow_base.corrections[Role.BASELINE].log_k = math.log(1.5)
    assert slow_base.watermarks(0, 100.0, 1, None, "live")[0] > model().watermarks(0, 100.0, 1, None, "live")[0]


# ----- the calibration file -----

FILE_V1 = {
    "format": "specgate-calibration/1",
    "levels": [1, 10],
    "speculative": {"output_tok_s": [100, 500]},
    "baseline": {"output_tok_s": [60, 550]},
    "accept_length": 3.0,
    "recommendation": {"high_watermark": 9, "low_watermark": 6, "verdict": "crosses"},
}
MODEL = {
    "form": "step_s = a + b*B + c*T",
    "prompt_tokens": [100, 4000],
    "max_tokens": 0,
    "accept_length": 3.0,
    "speculative": {"a": SPEC.a, "b": SPEC.b, "c": SPEC.c, "points": 16, "rms_rel": 0.05, "max_rel": 0.1},
    "baseline": {"a": BASE.a, "b": BASE.b, "c": BASE.c, "points": 16, "rms_rel": 0.04, "max_rel": 0.09},
}


def test_an_old_file_is_still_read_without_a_model() -> None:
    from proxy.policy.calibration import parse, to_json

    cal = parse(FILE_V1)
    assert cal.model is None and cal.high_watermark == 9
    written = to_json(cal)
    assert written["format"] == "specgate-calibration/2" and written["model"] is None
    assert parse(written) == cal


def test_the_model_round_trips_and_is_checked() -> None:
    from proxy.policy.calibration import CalibrationError, parse, to_json

    cal = parse({**FILE_V1, "format": "specgate-calibration/2", "model": MODEL})
    assert cal.model is not None
    assert cal.model.speculative == StepFit(SPEC.a, SPEC.b, SPEC.c, 16, 0.05, 0.1)
    assert cal.model.prompt_tokens == (100, 4000) and cal.model.accept_length == 3.0
    assert parse(to_json(cal)) == cal
    for bad in (
        {**MODEL, "baseline": {**MODEL["baseline"], "c": -1e-9}},  # type: ignore[dict-item]
        {**MODEL, "baseline": {**MODEL["baseline"], "a": 0, "b": 0}},  # type: ignore[dict-item]
        {**MODEL, "baseline": {**MODEL["baseline"], "a": 0, "b": 1e-320}},  # type: ignore[dict-item]
        {**MODEL, "speculative": {**MODEL["speculative"], "a": math.inf}},  # type: ignore[dict-item]
        {**MODEL, "prompt_tokens": []},
        {**MODEL, "accept_length": 0.5},
        "fast",
    ):
        with pytest.raises(CalibrationError, match="model"):
            parse({**FILE_V1, "model": bad})
    with pytest.raises(CalibrationError, match="format"):
        parse({**FILE_V1, "format": "specgate-calibration/3"})


def _solve(m: StepModel, a: float, t: float) -> tuple[float, int, int]:
    """The solve at acceptance `a` for a stream of `t` tokens of context, as a request asks it."""
    m.watermarks(1, t, 1, a, "live")
    return m._solve(a)


def test_a_solve_is_kept_per_hundredth_of_acceptance_and_percent_of_context() -> None:
    m = model()
    at = _solve(m, 3.0, 100.0)
    assert 0 < at[0] < math.inf  # speculation pays below some load here
    # Within 0.5% of the context and 0.005 of the acceptance: the same solve, not solved again.
    assert _solve(m, 3.004, 100.4) is at
    assert len(m._solved) == 1
    assert _solve(m, 3.0, 102.0) is not at  # another percent: solved afresh
    # A class's watermarks at the context last seen are solved there too.
    assert m.class_watermarks(3.0) == _solve(m, 3.0, 102.0)[1:]
    # A correction that moved solves afresh, at the corrected step times: a baseline read at half
    # its fitted speed moves the crossover out.
    for _ in range(5):
        m.observe(Role.BASELINE, 8, 8 * 100.0, 0.5 / BASE.step_s(8, 800.0), None)
    again = _solve(m, 3.0, 100.0)
    assert again == m._solve_at(3.0, 100.0) and again[0] > at[0]
    # Bounded: past MAX_SOLVED entries it starts afresh.
    for i in range(MAX_SOLVED + 5):
        _solve(m, 1.0 + i / 100, 100.0)
    assert len(m._solved) <= MAX_SOLVED
