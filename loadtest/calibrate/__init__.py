"""Where speculation stops paying, and the watermarks that follow from it. Pure functions.

An inconclusive level is unknown, never evidence. A level where either server had too few good
requests (see stats.min_ok_requests) counts as not measured, and a verdict may rest only on levels
measured conclusively:

- "crosses" at x: speculation ahead at a conclusive level a and behind at the next planned level b,
  conclusive too; x interpolated linearly between them (the arithmetic specgate's adaptive policy
  uses). Below a and above b the levels' values could not change that crossing: speculation's
  advantage falls with load, so an unknown level under one where it was ahead is taken to be ahead.
- "never_pays": the lowest planned level conclusive, the baseline ahead there and at every other
  conclusive level (one where speculation is ahead says the sweep contradicts itself).
- "always_pays": the highest planned level conclusive, speculation ahead at every conclusive level.
- "unknown": none of these can be told, because an inconclusive level lies where its value would
  change the verdict (between the last level ahead and the first behind, under the lowest level
  behind, above the highest level ahead), or the levels disagree; "no_data": no level conclusive.

The recommendation speculates only where speculation pays on both counts (throughput and TPOT):
below the earlier of the two crossovers. It is made only when that earlier crossover's watermark is
known whatever the unknown levels hold; otherwise there is none (`Recommendation.made` is False),
and `calibrate` prints no watermarks and writes no file. `calibration_file` makes what
`calibrate --save` writes (format: proxy/policy/calibration.py).

The speed model (`model_fit`, proxy/policy/speedmodel.py). Each conclusive level of each sweep (the main
one and one per --prompt-tokens length) is a point per server: c streams, each holding its mean
prompt P plus half of max_tokens M on average while it decodes, so T = c * (P + M/2) tokens; its
step time is the per-stream TPOT times the tokens a step gives (1 for the baseline, the acceptance
measured at that level, else the sweep's mean, for the speculative server); without a TPOT, c / tok_s
times the same. `fit_step` fits a, b, c to them.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from proxy.policy.base import hysteresis_low
from proxy.policy.calibration import MAX_ACCEPT, Calibration, Curve, ModelFit
from proxy.policy.crossover import crossing
from proxy.policy.speedmodel import Point, fit_step

from ..stats import LevelStats

# `calibrate`'s exit status when the levels measured do not decide the watermarks: no recommendation.
EXIT_NO_RECOMMENDATION = 3

# The adaptive policy's verdicts, and "unknown": inconclusive levels where they would change it.
CrossVerdict = Literal["crosses", "never_pays", "always_pays", "no_data", "unknown"]


@dataclass(frozen=True)
class Crossover:
    metric: str
    verdict: CrossVerdict
    # Interpolated concurrency where the speculative advantage reaches zero ("crosses" only).
    at: float | None = None
    # "unknown": the crossover lies above `above` (the highest conclusive level with speculation
    # ahead; None: no such level under `below`) and at or below `below` (the lowest conclusive level
    # with it behind; None: none), and `why` says which levels left it unknown.
    above: int | None = None
    below: int | None = None
    why: str = ""


def _levels_text(levels: Sequence[int]) -> str:
    return ", ".join(str(c) for c in levels)


def _were(levels: Sequence[int]) -> str:
    return f"{_levels_text(levels)} {'was' if len(levels) == 1 else 'were'} not measured conclusively"


def find_crossover(
    metric: str,
    levels: Sequence[int],
    speculative: Sequence[float],
    baseline: Sequence[float],
    higher_is_better: bool = True,
) -> Crossover:
    """Where speculation stops beating the baseline on one metric, from the levels measured (NaN:
    not measured conclusively). See the module's docstring for the rule."""
    sign = 1.0 if higher_is_better else -1.0
    adv = [sign * (s - b) for s, b in zip(speculative, baseline, strict=True)]  # NaN: not measured
    known = [i for i, a in enumerate(adv) if not math.isnan(a)]
    if not known:
        return Crossover(metric, "no_data", why=f"no level measured {metric} conclusively on both servers")
    behind = next((i for i in known if adv[i] <= 0), None)
    if behind is None:
        top = known[-1]
        if top == len(levels) - 1:
            return Crossover(metric, "always_pays")
        above = levels[top + 1 :]
        return Crossover(metric, "unknown", above=levels[top], why=(
            f"speculation was ahead at every conclusive level up to {levels[top]} streams, and {_were(above)}"
        ))  # fmt: skip
    ahead_before = [i for i in known if i < behind]
    if not ahead_before:
        if behind > 0:
            return Crossover(metric, "unknown", below=levels[behind], why=(
                f"the baseline was ahead from {levels[behind]} streams, the lowest conclusive level, and "
                f"{_were(levels[:behind])}"
            ))  # fmt: skip
        ahead_later = [levels[i] for i in known if adv[i] > 0]
        if ahead_later:
            return Crossover(metric, "unknown", why=(
                f"the baseline was ahead at {levels[0]} streams but speculation at {_levels_text(ahead_later)}: the "
                "levels disagree (speculation's advantage falls with load; are --speculative and --baseline the "
                "right way round?)"
            ))  # fmt: skip
        return Crossover(metric, "never_pays")
    a = ahead_before[-1]
    if behind > a + 1:
        return Crossover(metric, "unknown", above=levels[a], below=levels[behind], why=(
            f"speculation was ahead at {levels[a]} and behind at {levels[behind]} streams, and "
            f"{_were(levels[a + 1 : behind])}"
        ))  # fmt: skip
    # The bracket's two levels, interpolated by the arithmetic the adaptive policy uses.
    pair = [a, behind]
    c = crossing(
        [levels[i] for i in pair], [speculative[i] for i in pair], [baseline[i] for i in pair], higher_is_better
    )
    return Crossover(metric, "crosses", c.at)


@dataclass(frozen=True)
class Recommendation:
    # None: no recommendation (the verdict is "unknown" or "no_data").
    high: int | None
    low: int | None
    verdict: CrossVerdict
    explanation: str
    # Levels not measured conclusively (a server had too few good requests there).
    inconclusive_levels: tuple[int, ...] = ()

    @property
    def made(self) -> bool:
        return self.high is not None

    def env_lines(self) -> str:
        if not self.made:
            return ""
        return f"SPECGATE_POLICY=threshold\nSPECGATE_HIGH_WATERMARK={self.high}\nSPECGATE_LOW_WATERMARK={self.low}\n"


def watermark_range(c: Crossover, max_level: int) -> tuple[float, float]:
    """The high watermarks the crossover allows, whatever its unknown levels hold: (least, most).

    The watermark is floor(crossover) (at least 1); never paying is 0; paying at every level is the
    highest level measured (no more: nothing was measured above it)."""
    if c.verdict == "crosses" and c.at is not None:
        h = float(max(1, math.floor(c.at + 1e-9)))  # 1e-9: as the adaptive policy's high_for
        return h, h
    if c.verdict == "never_pays":
        return 0.0, 0.0
    if c.verdict == "always_pays":
        return float(max_level), float(max_level)
    lo = 0.0 if c.above is None else float(c.above)
    hi = math.inf if c.below is None else float(c.below)
    return lo, hi


def recommend(
    throughput: Crossover, latency: Crossover, max_level: int, inconclusive: Sequence[int] = ()
) -> Recommendation:
    """Speculate only where it pays on both counts: below the earlier of the two crossovers, made
    only when the unknown levels cannot move that watermark.

    `max_level` is the highest level planned; `inconclusive` the levels not measured conclusively.
    """
    left_out = tuple(inconclusive)
    note = (
        f" Not measured conclusively: {_levels_text(left_out)} concurrent streams (too few good requests); "
        "they could not change this verdict."
        if left_out
        else ""
    )
    ranges = [(c, watermark_range(c, max_level)) for c in (throughput, latency)]
    least = min(lo for _, (lo, _) in ranges)
    most = min(hi for _, (_, hi) in ranges)
    if least != most:
        if all(c.verdict == "no_data" for c, _ in ranges):
            why = (
                f"No level had enough good requests on both servers to conclude anything (too few at "
                f"{_levels_text(left_out)} concurrent streams)."
                if left_out
                else "Not enough successful requests to compare the servers."
            )
            return Recommendation(None, None, "no_data", why + _MEASURE_AGAIN, left_out)
        names = {"output_tok_s": "throughput", "mean_tpot_ms": "TPOT"}
        whys = [f"on {names.get(c.metric, c.metric)}, {c.why}" for c, (lo, _) in ranges if c.why and lo < most]
        return Recommendation(
            None,
            None,
            "unknown",
            "The crossover is not bracketed by conclusive levels: " + "; ".join(whys) + "." + _MEASURE_AGAIN,
            left_out,
        )
    decided = [c for c, (lo, hi) in ranges if lo == hi == least]
    c = next((x for x in decided if x.verdict == "never_pays"), None) or next(
        (x for x in decided if x.verdict == "crosses"), decided[0]
    )
    high = int(least)
    if c.verdict == "never_pays":
        which = "throughput" if throughput.verdict == "never_pays" else "per-request latency (TPOT)"
        return Recommendation(
            0,
            0,
            "never_pays",
            f"Speculation never paid: the baseline was ahead on {which} from the lowest level measured, and at "
            "every conclusive level. Send everything to the baseline (a high watermark of 0 does that)." + note,
            left_out,
        )
    if c.verdict == "always_pays":
        return Recommendation(
            high,
            hysteresis_low(high),
            "always_pays",
            f"Speculation paid at every level measured, up to {high} concurrent streams. Measure higher "
            "levels before raising the high watermark further." + note,
            left_out,
        )
    at = c.at if c.at is not None else float(high)
    return Recommendation(
        high,
        hysteresis_low(high),
        "crosses",
        f"Speculation stops paying at about {at:.1f} concurrent streams; new requests go to the baseline "
        f"from {high} in flight and return to speculation at {hysteresis_low(high)}." + note,
        left_out,
    )


def class_env_lines(rec: Recommendation, save: str | None) -> str:
    """What to paste when the traffic has classes (--class): a policy that prices them, and how
    specgate tells them apart (docs/routing.md, Traffic classes). `threshold` ignores acceptance,
    so its watermarks would treat a class accepting 1.3 as one accepting 3; `adaptive` with the
    calibration file knows each class's acceptance from its first request and both servers' curves.
    With the file, its watermarks apply; without it, the recommended ones are adaptive's start."""
    if not rec.made:
        return ""
    lines = ["SPECGATE_POLICY=adaptive"]
    if save:
        lines.append(f"SPECGATE_CALIBRATION={save}")
    else:
        lines += [f"SPECGATE_HIGH_WATERMARK={rec.high}", f"SPECGATE_LOW_WATERMARK={rec.low}"]
    lines.append("SPECGATE_CLASS_KEY=header")
    note = [
        "",
        "# Classes: clients name theirs in x-specgate-class (SPECGATE_CLASS_KEY=header); with clients you do",
        "# not trust, SPECGATE_CLASS_KEY=api_key and SPECGATE_API_KEYS, a key per class. adaptive (or model,",
        "# where the file has a speed model) prices each class by its acceptance: in a pooled topology",
        "# (SPECGATE_TOPOLOGY=pooled) a class's request goes where the pool gains most; in a pair the mode",
        "# decides for all at the classes' mixed acceptance. threshold would ignore the classes.",
    ]
    if not save:
        note.append(
            "# Without --save, a class's acceptance is unknown until its first streams end: save a calibration."
        )
    return "\n".join(lines + note) + "\n"


_MEASURE_AGAIN = (
    " No watermarks are recommended: measure those levels again (a longer --max-duration-s, or see their "
    "errors); specgate's watermarks stay as they are until then."
)


def inconclusive_levels(*sweeps: Sequence[LevelStats]) -> tuple[int, ...]:
    """Levels at which any of the sweeps (aligned level by level) had too few good requests."""
    return tuple(rows[0].concurrency for rows in zip(*sweeps, strict=True) if not all(r.conclusive for r in rows))


def crossovers(speculative: Sequence[LevelStats], baseline: Sequence[LevelStats]) -> tuple[Crossover, Crossover]:
    """Throughput and TPOT crossovers from the levels both servers measured conclusively."""
    levels = [s.concurrency for s in speculative]
    keep = [s.conclusive and b.conclusive for s, b in zip(speculative, baseline, strict=True)]

    def values(rows: Sequence[LevelStats], name: str) -> list[float]:
        # NaN is find_crossover's "not measured".
        return [float(getattr(r, name)) if k else math.nan for r, k in zip(rows, keep, strict=True)]

    tp = find_crossover("output_tok_s", levels, values(speculative, "output_tok_s"), values(baseline, "output_tok_s"))
    lat = find_crossover(
        "mean_tpot_ms",
        levels,
        values(speculative, "mean_tpot_ms"),
        values(baseline, "mean_tpot_ms"),
        higher_is_better=False,
    )
    return tp, lat


def calibrate(
    speculative: Sequence[LevelStats], baseline: Sequence[LevelStats]
) -> tuple[Crossover, Crossover, Recommendation]:
    """The crossovers and the watermarks, from conclusive levels only."""
    tp, lat = crossovers(speculative, baseline)
    left_out = inconclusive_levels(speculative, baseline)
    return tp, lat, recommend(tp, lat, max((s.concurrency for s in speculative), default=0), left_out)


def calibration_file(
    speculative: Sequence[LevelStats],
    baseline: Sequence[LevelStats],
    rec: Recommendation,
    accept_by_level: Mapping[int, float | None],
    settings: Mapping[str, Any],
    created: str,
    model: ModelFit | None = None,
    classes: Mapping[str, float] | None = None,
) -> Calibration:
    """The reusable calibration: both servers' curves over the levels both measured conclusively (a
    level without a positive throughput on either is left out too), the speculative server's
    acceptance at each (NaN where it reported none) and their mean, and the recommendation as made.
    Raises ValueError when no level is left (there are no curves to write) or no recommendation
    was made (curves without the levels that left it unknown would let the adaptive policy conclude
    what calibrate would not)."""
    if not rec.made:
        raise ValueError("no recommendation was made: " + rec.explanation)

    def usable(r: LevelStats) -> bool:
        return r.conclusive and math.isfinite(r.output_tok_s) and round(r.output_tok_s, 2) > 0

    keep = [(s, b) for s, b in zip(speculative, baseline, strict=True) if usable(s) and usable(b)]
    if not keep:
        raise ValueError("no level was conclusive on both servers: no curves to save")
    levels = tuple(s.concurrency for s, _ in keep)

    # Rounded well below what a level can measure, so the file reads easily.
    def curve(rows: Sequence[LevelStats], accept: tuple[float, ...] = ()) -> Curve:
        tok_s = tuple(round(r.output_tok_s, 2) for r in rows)
        tpot = tuple(round(r.mean_tpot_ms, 4) if math.isfinite(r.mean_tpot_ms) else math.nan for r in rows)
        return Curve(tok_s, tuple(t if t > 0 else math.nan for t in tpot), accept)

    raw = [accept_by_level.get(c) for c in levels]
    accept = tuple(math.nan if a is None else round(a, 3) for a in raw)
    measured = [a for a in accept if not math.isnan(a)]
    return Calibration(
        levels=levels,
        speculative=curve([s for s, _ in keep], accept),
        baseline=curve([b for _, b in keep]),
        accept_length=round(math.fsum(measured) / len(measured), 3) if measured else None,
        high_watermark=rec.high or 0,
        low_watermark=rec.low or 0,
        verdict=rec.verdict,
        explanation=rec.explanation,
        inconclusive_levels=tuple(s.concurrency for s in speculative if s.concurrency not in levels),
        settings=dict(settings),
        created=created,
        model=model,
        classes=dict(classes or {}),
    )


def class_acceptance(speculative: Sequence[LevelStats], one_event_a_step: bool) -> dict[str, float]:
    """Each traffic class's acceptance on the speculative server, measured as specgate measures it
    live (proxy/relay/observe.py's ClassLearning): its good requests' output tokens over their content
    events at the conclusive levels, each request's first event and token set aside,

        accept_c = decode_tokens_c / decode_events_c

    Empty where the engine does not send one event a decode step (`one_event_a_step`, its adapter's
    `stream_steps`: the ratio is not acceptance there), or with fewer than two classes (the sweep's
    mean says it all)."""
    tokens: dict[str, int] = {}
    events: dict[str, int] = {}
    for level in speculative:
        if not level.conclusive:
            continue
        for name, c in level.classes.items():
            tokens[name] = tokens.get(name, 0) + c.decode_tokens
            events[name] = events.get(name, 0) + c.decode_events
    known = [n for n in tokens if events[n] > 0 and tokens[n] >= events[n]]
    if not one_event_a_step or len(known) < 2:
        return {}
    return {n: round(min(tokens[n] / events[n], MAX_ACCEPT), 3) for n in sorted(known)}


@dataclass(frozen=True)
class ContextSweep:
    """One sweep of both servers at one prompt length, for the speed model: the levels of each and
    the speculative server's acceptance at each level (None where not read)."""

    speculative: Sequence[LevelStats]
    baseline: Sequence[LevelStats]
    accept_by_level: Mapping[int, float | None]


def _step_s(r: LevelStats, per_step: float) -> float:
    if math.isfinite(r.mean_tpot_ms) and r.mean_tpot_ms > 0:
        return per_step * r.mean_tpot_ms / 1000
    if math.isfinite(r.output_tok_s) and r.output_tok_s > 0:
        return per_step * r.concurrency / r.output_tok_s
    return math.nan


def model_fit(sweeps: Sequence[ContextSweep], max_tokens: int) -> tuple[ModelFit | None, str]:
    """The speed model from sweeps at several prompt lengths (module docstring), or None and why."""
    accepts = [a for s in sweeps for a in s.accept_by_level.values() if a is not None and math.isfinite(a)]
    if not accepts:
        return None, "no acceptance length was read from the speculative server: no speed model"
    mean_accept = math.fsum(accepts) / len(accepts)
    points: dict[str, list[Point]] = {"speculative": [], "baseline": []}
    prompts: list[int] = []
    seen: list[float] = []
    for sweep in sweeps:
        for s, b in zip(sweep.speculative, sweep.baseline, strict=True):
            prompt = (s.mean_prompt_tokens + b.mean_prompt_tokens) / 2
            if not (s.conclusive and b.conclusive and math.isfinite(prompt)):
                continue
            c = s.concurrency
            tokens = c * (prompt + max_tokens / 2)
            accept = sweep.accept_by_level.get(c) or mean_accept
            for role, row, per_step in (("speculative", s, accept), ("baseline", b, 1.0)):
                step = _step_s(row, per_step)
                if math.isfinite(step):
                    points[role].append(Point(c, tokens, step))
            seen.append(prompt)
        if seen:
            prompts.append(round(math.fsum(seen) / len(seen)))
            seen.clear()
    spec, base = fit_step(points["speculative"]), fit_step(points["baseline"])
    if spec is None or base is None:
        return None, (
            "the sweeps do not tell batch and context apart (they need conclusive levels at two or more batch "
            "sizes and at prompt lengths at least 25% apart, with usage reported): no speed model"
        )
    return ModelFit(spec, base, tuple(sorted(prompts)), max_tokens, round(mean_accept, 3)), ""
