"""The calibration file: what `python -m loadtest calibrate --save FILE` measured, as specgate reads it.

One JSON object (format "specgate-calibration/1"):

    {"format": "specgate-calibration/1",
     "created": "2026-12-03T12:00:00Z",
     "settings": {...the sweep's settings: max_tokens, prompts, endpoint, duration_s, ...},
     "levels": [1, 2, 5, 10, 30],                        # concurrent streams, strictly increasing
     "speculative": {"output_tok_s": [...], "mean_tpot_ms": [...],
                     "accept_length": [...]},             # per level; null where the server reported none
     "baseline": {"output_tok_s": [...], "mean_tpot_ms": [...]},
     "accept_length": 2.9,                               # the speculative server's mean over the sweep, or null
     "inconclusive_levels": [70],                        # measured, left out of the curves
     "recommendation": {"high_watermark": 19, "low_watermark": 14, "verdict": "crosses",
                        "explanation": "..."}}

Only conclusive levels make the curves. `mean_tpot_ms` entries may be null (not measured). Pure:
parsing and validation only; the file is read by the caller.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import orjson

FORMAT = "specgate-calibration/1"
VERDICTS = ("crosses", "never_pays", "always_pays", "no_data")


class CalibrationError(ValueError):
    pass


@dataclass(frozen=True)
class Curve:
    """One server's measured curve, level by level (NaN: not measured)."""

    output_tok_s: tuple[float, ...]
    mean_tpot_ms: tuple[float, ...]
    accept_length: tuple[float, ...] = ()


@dataclass(frozen=True)
class Calibration:
    levels: tuple[int, ...]
    speculative: Curve
    baseline: Curve
    accept_length: float | None
    high_watermark: int
    low_watermark: int
    verdict: str
    explanation: str = ""
    inconclusive_levels: tuple[int, ...] = ()
    settings: Mapping[str, Any] = field(default_factory=dict)
    created: str = ""

    def accept_at(self, i: int) -> float | None:
        """The acceptance the speculative server reported at level i, else the sweep's mean."""
        per_level = self.speculative.accept_length
        if i < len(per_level) and not math.isnan(per_level[i]):
            return per_level[i]
        return self.accept_length


def _floats(raw: object, name: str, n: int, *, positive: bool, nullable: bool) -> tuple[float, ...]:
    if not isinstance(raw, list) or len(raw) != n:
        raise CalibrationError(f"{name}: must be a list of {n} numbers, one per level")
    out: list[float] = []
    for v in raw:
        if v is None and nullable:
            out.append(math.nan)
            continue
        if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v):
            raise CalibrationError(f"{name}: {v!r} is not a finite number")
        if positive and v <= 0:
            raise CalibrationError(f"{name}: {v!r} must be > 0")
        out.append(float(v))
    return tuple(out)


def _accept(v: object, name: str) -> float | None:
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v) or v < 1:
        raise CalibrationError(f"{name}: {v!r} must be null or a number >= 1 (it counts the bonus token)")
    return float(v)


def _int(raw: Mapping[str, Any], key: str, where: str) -> int:
    v = raw.get(key)
    if isinstance(v, bool) or not isinstance(v, int) or v < 0:
        raise CalibrationError(f"{where}.{key}: {v!r} must be an integer >= 0")
    return v


def parse(data: object) -> Calibration:
    """Validate a decoded calibration file; CalibrationError names the first field that is wrong."""
    if not isinstance(data, dict):
        raise CalibrationError("not a JSON object")
    if data.get("format") != FORMAT:
        raise CalibrationError(f"format: {data.get('format')!r} is not {FORMAT!r}")
    levels_raw = data.get("levels")
    if (
        not isinstance(levels_raw, list)
        or not levels_raw
        or not all(isinstance(c, int) and not isinstance(c, bool) and c >= 1 for c in levels_raw)
        or any(b <= a for a, b in itertools.pairwise(levels_raw))
    ):
        raise CalibrationError("levels: must be a non-empty, strictly increasing list of positive integers")
    levels = tuple(levels_raw)
    n = len(levels)
    curves: dict[str, Curve] = {}
    for role in ("speculative", "baseline"):
        raw = data.get(role)
        if not isinstance(raw, dict):
            raise CalibrationError(f"{role}: missing or not an object")
        tok_s = _floats(raw.get("output_tok_s"), f"{role}.output_tok_s", n, positive=True, nullable=False)
        tpot = _floats(raw.get("mean_tpot_ms", [None] * n), f"{role}.mean_tpot_ms", n, positive=True, nullable=True)
        accept: tuple[float, ...] = ()
        if role == "speculative" and raw.get("accept_length") is not None:
            accept = _floats(raw["accept_length"], f"{role}.accept_length", n, positive=True, nullable=True)
            if any(a < 1 for a in accept if not math.isnan(a)):
                raise CalibrationError(f"{role}.accept_length: values must be >= 1 (they count the bonus token)")
        curves[role] = Curve(tok_s, tpot, accept)
    rec = data.get("recommendation")
    if not isinstance(rec, dict):
        raise CalibrationError("recommendation: missing or not an object")
    high, low = _int(rec, "high_watermark", "recommendation"), _int(rec, "low_watermark", "recommendation")
    if low > high:
        raise CalibrationError(f"recommendation: low_watermark {low} is above high_watermark {high}")
    verdict = rec.get("verdict")
    if verdict not in VERDICTS:
        raise CalibrationError(f"recommendation.verdict: {verdict!r} is not one of {', '.join(VERDICTS)}")
    inconclusive = data.get("inconclusive_levels", [])
    if not isinstance(inconclusive, list) or not all(isinstance(c, int) for c in inconclusive):
        raise CalibrationError("inconclusive_levels: must be a list of integers")
    settings = data.get("settings", {})
    return Calibration(
        levels=levels,
        speculative=curves["speculative"],
        baseline=curves["baseline"],
        accept_length=_accept(data.get("accept_length"), "accept_length"),
        high_watermark=high,
        low_watermark=low,
        verdict=str(verdict),
        explanation=str(rec.get("explanation", "")),
        inconclusive_levels=tuple(inconclusive),
        settings=settings if isinstance(settings, dict) else {},
        created=str(data.get("created", "")),
    )


def to_json(cal: Calibration) -> dict[str, Any]:
    """The file's object for a Calibration (NaN as null), the inverse of parse()."""

    def nulls(values: Sequence[float]) -> list[float | None]:
        return [None if math.isnan(v) else v for v in values]

    spec: dict[str, Any] = {
        "output_tok_s": list(cal.speculative.output_tok_s),
        "mean_tpot_ms": nulls(cal.speculative.mean_tpot_ms),
    }
    if cal.speculative.accept_length:
        spec["accept_length"] = nulls(cal.speculative.accept_length)
    return {
        "format": FORMAT,
        "created": cal.created,
        "settings": dict(cal.settings),
        "levels": list(cal.levels),
        "speculative": spec,
        "baseline": {
            "output_tok_s": list(cal.baseline.output_tok_s),
            "mean_tpot_ms": nulls(cal.baseline.mean_tpot_ms),
        },
        "accept_length": cal.accept_length,
        "inconclusive_levels": list(cal.inconclusive_levels),
        "recommendation": {
            "high_watermark": cal.high_watermark,
            "low_watermark": cal.low_watermark,
            "verdict": cal.verdict,
            "explanation": cal.explanation,
        },
    }


def load(path: str) -> Calibration:
    """Read and validate a calibration file; CalibrationError names the file and what is wrong."""
    try:
        with open(path, "rb") as f:
            data = orjson.loads(f.read())
    except OSError as exc:
        raise CalibrationError(f"{path}: cannot read: {exc.strerror or exc}") from None
    except orjson.JSONDecodeError as exc:
        raise CalibrationError(f"{path}: not JSON: {exc}") from None
    try:
        return parse(data)
    except CalibrationError as exc:
        raise CalibrationError(f"{path}: {exc}") from None
