"""The calibration file: what `python -m loadtest calibrate --save FILE` measured, as specgate reads it.

One JSON object (format "specgate-calibration/2"; files of format 1, which have no "model", are
still read):

    {"format": "specgate-calibration/2",
     "created": "2026-12-03T12:00:00Z",
     "settings": {...the sweep's settings: max_tokens, prompts, endpoint, duration_s, ...},
     "levels": [1, 2, 5, 10, 30],                        # concurrent streams, strictly increasing
     "speculative": {"output_tok_s": [...], "mean_tpot_ms": [...],
                     "accept_length": [...]},             # per level; null where the server reported none
     "baseline": {"output_tok_s": [...], "mean_tpot_ms": [...]},
     "accept_length": 2.9,                               # the speculative server's mean over the sweep, or null
     "inconclusive_levels": [70],                        # measured, left out of the curves
     "recommendation": {"high_watermark": 19, "low_watermark": 14, "verdict": "crosses",
                        "explanation": "..."},
     "classes": {"chat": {"accept_length": 1.3},          # optional: each traffic class's acceptance, by
                 "code": {"accept_length": 3.0}},         # the names calibrate --class gave (classes.py)
     "model": {"form": "step_s = a + b*B + c*T",           # optional: the speed model (speedmodel.py)
               "prompt_tokens": [380, 4096],             # mean prompt tokens of each sweep fitted
               "max_tokens": 512, "accept_length": 2.9,  # the sweeps' output tokens and acceptance
               "speculative": {"a": 0.0078, "b": 8.6e-05, "c": 3.5e-08,
                               "points": 16, "rms_rel": 0.079, "max_rel": 0.137},
               "baseline": {...}}}

Only conclusive levels make the curves. A file without "model" (or with it null) has no speed
model: SPECGATE_POLICY=model then routes as `adaptive` does. A file without "classes" (or with it
empty) leaves every traffic class to be learnt from live traffic; with it, a class named there is
known from its first request (classes.py). Older readers ignore it. `mean_tpot_ms` entries may be null (not measured).

Bounds. A file that passes load() must not be able to break serving later: the adaptive policy
divides by levels and acceptance and floors crossovers it interpolates from these numbers, so
every value is finite, positive and within a physical range, wide enough for any real server:

    MAX_FILE_BYTES  1 MiB             a sweep's file is a few KiB; only regular files are read
    MIN_TOK_S       1e-3 tok/s        output_tok_s: a token per 1000 s ...
    MAX_TOK_S       1e7 tok/s         ... to ten million tokens a second
    MIN_TPOT_MS     1e-3 ms           mean_tpot_ms: a microsecond ...
    MAX_TPOT_MS     1e6 ms            ... to 1000 s a token
    MIN_ACCEPT      1                 accept_length: the bonus token alone ...
    MAX_ACCEPT      64                ... to 63 accepted draft tokens a step
    MAX_LEVEL       1,000,000         levels and inconclusive_levels: concurrent streams
    MAX_WATERMARK   1,000,000         recommendation's watermarks; SPECGATE_*_WATERMARK too
    MAX_STEP_COEF   1e3               model coefficients a, b, c: seconds, >= 0, a + b > 0
    MAX_PROMPT      10,000,000        model.prompt_tokens and max_tokens
    MAX_CLASSES     256               classes; a name is 1-64 printable characters (a metric label)

Within them the per-stream speeds (tok_s / level / acceptance) lie in [1.5e-11, 1e7]: no
product, quotient or crossover computed from them overflows, underflows to 0 or leaves
[0, MAX_LEVEL]. Pure but for load(), which reads the file.
"""

from __future__ import annotations

import itertools
import math
import os
import stat
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import orjson

FORMAT = "specgate-calibration/2"
# Still read: written before the speed model.
FORMATS = ("specgate-calibration/1", FORMAT)
MODEL_FORM = "step_s = a + b*B + c*T"
VERDICTS = ("crosses", "never_pays", "always_pays", "no_data")

MAX_FILE_BYTES = 1 << 20
MIN_TOK_S, MAX_TOK_S = 1e-3, 1e7
MIN_TPOT_MS, MAX_TPOT_MS = 1e-3, 1e6
MIN_ACCEPT, MAX_ACCEPT = 1.0, 64.0
MAX_LEVEL = 1_000_000
MAX_WATERMARK = 1_000_000
MAX_STEP_COEF = 1e3
# The least a fitted step of one stream may take, in seconds.
MIN_STEP_S = 1e-6
MAX_PROMPT = 10_000_000
MAX_CLASSES = 256
MAX_CLASS_NAME = 64


class CalibrationError(ValueError):
    pass


@dataclass(frozen=True)
class StepFit:
    """One role's step time: a + b*B + c*T seconds, and how well it fitted its points."""

    a: float
    b: float
    c: float
    points: int = 0
    rms_rel: float = 0.0  # root mean square of the relative residuals
    max_rel: float = 0.0  # the largest relative residual

    def step_s(self, batch: float, tokens: float) -> float:
        return self.a + self.b * batch + self.c * tokens


@dataclass(frozen=True)
class ModelFit:
    """What calibrate fitted: both roles' step times, the prompt lengths measured (mean tokens), the
    output tokens a request asked for, and the acceptance the speculative points were taken at."""

    speculative: StepFit
    baseline: StepFit
    prompt_tokens: tuple[int, ...]
    max_tokens: int
    accept_length: float

    def of(self, role: str) -> StepFit:
        """The fit of a role, by its name ("speculative" or "baseline": policy.Role's values)."""
        return self.speculative if role == "speculative" else self.baseline


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
    model: ModelFit | None = None
    # Each traffic class's acceptance as calibrate measured it, by class name.
    classes: Mapping[str, float] = field(default_factory=dict)

    def accept_at(self, i: int) -> float | None:
        """The acceptance the speculative server reported at level i, else the sweep's mean."""
        per_level = self.speculative.accept_length
        if i < len(per_level) and not math.isnan(per_level[i]):
            return per_level[i]
        return self.accept_length


def _floats(raw: object, name: str, n: int, bounds: tuple[float, float], *, nullable: bool) -> tuple[float, ...]:
    if not isinstance(raw, list) or len(raw) != n:
        raise CalibrationError(f"{name}: must be a list of {n} numbers, one per level")
    return tuple(math.nan if v is None and nullable else _float(v, name, bounds) for v in raw)


def _float(v: object, name: str, bounds: tuple[float, float]) -> float:
    lo, hi = bounds
    if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v):
        raise CalibrationError(f"{name}: {v!r} is not a finite number")
    if not lo <= v <= hi:
        raise CalibrationError(f"{name}: {v!r} is outside [{lo:g}, {hi:g}]")
    return float(v)


def _accept(v: object, name: str) -> float | None:
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v):
        raise CalibrationError(f"{name}: {v!r} must be null or a finite number")
    return _float(v, name, (MIN_ACCEPT, MAX_ACCEPT))


def _int(raw: Mapping[str, Any], key: str, where: str, top: int) -> int:
    v = raw.get(key)
    if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v <= top:
        raise CalibrationError(f"{where}.{key}: {v!r} must be an integer in [0, {top}]")
    return v


def _level(c: object) -> bool:
    return isinstance(c, int) and not isinstance(c, bool) and 1 <= c <= MAX_LEVEL


def parse(data: object) -> Calibration:
    """Validate a decoded calibration file; CalibrationError names the first field that is wrong."""
    if not isinstance(data, dict):
        raise CalibrationError("not a JSON object")
    if data.get("format") not in FORMATS:
        raise CalibrationError(f"format: {data.get('format')!r} is not one of {', '.join(map(repr, FORMATS))}")
    levels_raw = data.get("levels")
    if (
        not isinstance(levels_raw, list)
        or not levels_raw
        or not all(_level(c) for c in levels_raw)
        or any(b <= a for a, b in itertools.pairwise(levels_raw))
    ):
        raise CalibrationError(f"levels: must be a non-empty, strictly increasing list of integers in [1, {MAX_LEVEL}]")
    levels = tuple(levels_raw)
    n = len(levels)
    curves: dict[str, Curve] = {}
    for role in ("speculative", "baseline"):
        raw = data.get(role)
        if not isinstance(raw, dict):
            raise CalibrationError(f"{role}: missing or not an object")
        tok_s = _floats(raw.get("output_tok_s"), f"{role}.output_tok_s", n, (MIN_TOK_S, MAX_TOK_S), nullable=False)
        tpot_raw = raw.get("mean_tpot_ms", [None] * n)
        tpot = _floats(tpot_raw, f"{role}.mean_tpot_ms", n, (MIN_TPOT_MS, MAX_TPOT_MS), nullable=True)
        accept: tuple[float, ...] = ()
        if role == "speculative" and raw.get("accept_length") is not None:
            bounds = (MIN_ACCEPT, MAX_ACCEPT)  # MIN_ACCEPT: it counts the bonus token
            accept = _floats(raw["accept_length"], f"{role}.accept_length", n, bounds, nullable=True)
        curves[role] = Curve(tok_s, tpot, accept)
    rec = data.get("recommendation")
    if not isinstance(rec, dict):
        raise CalibrationError("recommendation: missing or not an object")
    high = _int(rec, "high_watermark", "recommendation", MAX_WATERMARK)
    low = _int(rec, "low_watermark", "recommendation", MAX_WATERMARK)
    if low > high:
        raise CalibrationError(f"recommendation: low_watermark {low} is above high_watermark {high}")
    verdict = rec.get("verdict")
    if verdict not in VERDICTS:
        raise CalibrationError(f"recommendation.verdict: {verdict!r} is not one of {', '.join(VERDICTS)}")
    inconclusive = data.get("inconclusive_levels", [])
    if not isinstance(inconclusive, list) or not all(_level(c) for c in inconclusive):
        raise CalibrationError(f"inconclusive_levels: must be a list of integers in [1, {MAX_LEVEL}]")
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
        model=_model(data.get("model")),
        classes=_classes(data.get("classes")),
    )


def _classes(raw: object) -> dict[str, float]:
    if raw is None:
        return {}
    if not isinstance(raw, dict) or len(raw) > MAX_CLASSES:
        raise CalibrationError(f"classes: must be an object of at most {MAX_CLASSES} classes")
    out = {}
    for name, entry in raw.items():
        bad = not name.isprintable() or '"' in name or "\\" in name or name != name.strip()
        if not 0 < len(name) <= MAX_CLASS_NAME or bad:
            # A name no request's class could be (classes.class_of strips it) would never match.
            raise CalibrationError(
                f"classes: {name[:80]!r} is not 1-{MAX_CLASS_NAME} printable characters, none at either end a space"
            )
        if not isinstance(entry, dict):
            raise CalibrationError(f"classes.{name}: not an object")
        out[name] = _float(entry.get("accept_length"), f"classes.{name}.accept_length", (MIN_ACCEPT, MAX_ACCEPT))
    return out


def _model(raw: object) -> ModelFit | None:
    if raw is None:
        return None
    if not isinstance(raw, dict):
        raise CalibrationError("model: must be an object or null")
    fits: dict[str, StepFit] = {}
    for role in ("speculative", "baseline"):
        f = raw.get(role)
        if not isinstance(f, dict):
            raise CalibrationError(f"model.{role}: missing or not an object")
        a, b, c = (_float(f.get(k), f"model.{role}.{k}", (0.0, MAX_STEP_COEF)) for k in ("a", "b", "c"))
        if a + b < MIN_STEP_S:
            # A step of one stream in less than a microsecond is no GPU's: speeds from it overflow.
            raise CalibrationError(f"model.{role}: a + b must be at least {MIN_STEP_S:g} s (a step takes time)")
        points = f.get("points", 0)
        if isinstance(points, bool) or not isinstance(points, int) or not 0 <= points <= MAX_LEVEL:
            raise CalibrationError(f"model.{role}.points: {points!r} must be an integer in [0, {MAX_LEVEL}]")
        rms, most = (_float(f.get(k, 0.0), f"model.{role}.{k}", (0.0, 1e3)) for k in ("rms_rel", "max_rel"))
        fits[role] = StepFit(a, b, c, points, rms, most)
    prompts = raw.get("prompt_tokens")
    if (
        not isinstance(prompts, list)
        or not prompts
        or not all(isinstance(p, int) and not isinstance(p, bool) and 0 <= p <= MAX_PROMPT for p in prompts)
    ):
        raise CalibrationError(f"model.prompt_tokens: must be a non-empty list of integers in [0, {MAX_PROMPT}]")
    max_tokens = raw.get("max_tokens")
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or not 0 <= max_tokens <= MAX_PROMPT:
        raise CalibrationError(f"model.max_tokens: {max_tokens!r} must be an integer in [0, {MAX_PROMPT}]")
    accept = _float(raw.get("accept_length"), "model.accept_length", (MIN_ACCEPT, MAX_ACCEPT))
    return ModelFit(fits["speculative"], fits["baseline"], tuple(prompts), max_tokens, accept)


def model_json(fit: ModelFit) -> dict[str, Any]:
    def one(f: StepFit) -> dict[str, Any]:
        return {"a": f.a, "b": f.b, "c": f.c, "points": f.points, "rms_rel": f.rms_rel, "max_rel": f.max_rel}

    return {
        "form": MODEL_FORM,
        "prompt_tokens": list(fit.prompt_tokens),
        "max_tokens": fit.max_tokens,
        "accept_length": fit.accept_length,
        "speculative": one(fit.speculative),
        "baseline": one(fit.baseline),
    }


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
        **({"classes": {n: {"accept_length": a} for n, a in cal.classes.items()}} if cal.classes else {}),
        "model": None if cal.model is None else model_json(cal.model),
    }


def load(path: str) -> Calibration:
    """Read and validate a calibration file; CalibrationError names the file and what is wrong."""
    # One line whatever the path holds: a newline in it must not split the start error.
    shown = path if path.isprintable() else ascii(path)
    try:
        data = orjson.loads(_read(path))
    except OSError as exc:
        raise CalibrationError(f"{shown}: cannot read: {exc.strerror or exc}") from None
    except orjson.JSONDecodeError as exc:
        raise CalibrationError(f"{shown}: not JSON: {exc}") from None
    except CalibrationError as exc:
        raise CalibrationError(f"{shown}: {exc}") from None
    try:
        return parse(data)
    except CalibrationError as exc:
        raise CalibrationError(f"{shown}: {exc}") from None


def _read(path: str) -> bytes:
    """The bytes of a regular file of at most MAX_FILE_BYTES. O_NONBLOCK: opening a FIFO would
    otherwise wait for a writer; a device (/dev/zero) or FIFO is refused before any read."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise CalibrationError("not a regular file")
        chunks: list[bytes] = []
        size = 0
        # Read to the cap, not to st_size: the file may grow between fstat and read.
        while size <= MAX_FILE_BYTES:
            chunk = os.read(fd, MAX_FILE_BYTES + 1 - size)
            if not chunk:
                break
            chunks.append(chunk)
            size += len(chunk)
    finally:
        os.close(fd)
    if size > MAX_FILE_BYTES:
        raise CalibrationError(f"larger than {MAX_FILE_BYTES} bytes: not a calibration file")
    return b"".join(chunks)
