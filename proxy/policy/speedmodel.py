"""A model of each server's speed: its decode step time as a function of its batch and the context
it holds, fitted by `loadtest calibrate`, corrected live, and the crossover it calls for. Pure
arithmetic; the clock is not needed (corrections count observations, not seconds).

The step. For role r (speculative, baseline), one decode step of a batch of B streams holding T
tokens of context in all (prompts plus what they generated so far) takes

    step_r(B, T) = k_r * (a_r + b_r*B + c_r*T)

a: the weights read once a step; b: each stream's own work (its logits, a verify's extra query
tokens, the draft); c: the KV cache every step reads. k_r is the live correction (below, 1 at
first). A baseline step gives each stream 1 token, a speculative one A (the live acceptance length,
bonus token included), so

    per-stream speed  v_r(B, T) = n_r / step_r(B, T)       n_baseline = 1, n_speculative = A
    throughput        X_r(B, T) = B * v_r(B, T)

The fit. a, b, c per role minimise the relative squared error over calibrate's points (levels x
prompt lengths): sum_i ((a + b*B_i + c*T_i - y_i) / y_i)^2, a 3x3 normal-equation solve; a
coefficient that comes out negative is fixed at 0 and the rest refitted (a step never gets cheaper
with more streams or context). On the H200 table (Llama-3.1-8B shape, 1k and 4k tokens, batch 1 to
256) the form is within 15% at every point and 8% rms (tests/routing/test_speedmodel.py): the measured
step is flat at small batches and steeper than linear at large ones, which three coefficients
cannot follow exactly.

The crossover. Under the threshold rule every new request of a group goes to one role, so once the
other drains that role holds the group's whole load. With L streams in the group (the new request
included), t their mean context (tokens over streams, the new request's prompt included), and m_r
servers of role r sharing them (1 in a pair),

    speculation pays at L  iff  v_spec(L/m_s, L*t/m_s) > v_base(L/m_b, L*t/m_b)

and since both roles hold the same streams, per-stream speed and the group's throughput give the
same answer. Linear step times make the load where they are equal a closed form:

    L*(t, A) = (A*a_b' - a_s') / ((b_s' + c_s'*t)/m_s - A*(b_b' + c_b'*t)/m_b)      (x' = k*x)

(a denominator <= 0: speculation pays at every load; a numerator <= 0: at none). The crossover so
moves with context as it moves with acceptance: on the H200 a verify reads the KV cache once for
several tokens, so longer contexts move it up (A*c_b > c_s); a server whose drafts read more KV per
token than they save moves it down.

The rule (SPECGATE_POLICY=model): the threshold rule, with watermarks from L* and a margin m
(SPECGATE_ADAPTIVE_MARGIN), so that it does not flap:

    high = floor(L*(t, A*(1+m)))      leave speculation where the baseline is ahead by m
    low  = min(floor(L*(t, A/(1+m))), high - max(1, ceil(high/4)))   come back where speculation is

high within [SPECGATE_ADAPTIVE_MIN_WATERMARK, _MAX_WATERMARK], low within [0, high] (as the adaptive
policy's). They are recomputed for each new
request (its prompt counted in t) and whenever load changes, each (A, t) solved once to 0.01 of A
and 1% of t while the live corrections stand; the adaptive policy's dwell and probes
apply unchanged. Without a fit, the adaptive policy's watermarks are used as they are.

Topology. A pair shares one GPU: the model is of one server alone on it (calibrate sweeps one at a
time, and live corrections come only from streams that ran while the other server had none from
this gateway); the drain after a switch, when both run at once, is not modelled. A pool's servers
each have a GPU: a role's load is taken as spread evenly over its m_r servers that are up.

The live correction. Each stream that ran alone on its server (observe.py) gives an observed step
time n_r / tok_s at its batch and context; k_r moves toward observed / predicted as an exponential
average in logs, each observation's ratio clipped to [1/2, 2], k_r bounded to [1/2, 2]: a fit from
another day or GPU converges within a few dozen streams, and no one stream moves it far.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from .base import BASELINE, ROLES, SPECULATIVE, Role, hysteresis_low
from .calibration import MODEL_FORM, ModelFit, StepFit

# The weight of one observation in the live correction's average (of logs).
CORRECTION_ALPHA = 0.1
# The correction, and each observation's ratio, stay within [1/MAX_CORRECTION, MAX_CORRECTION].
MAX_CORRECTION = 2.0
# A fit needs points at two per-stream contexts at least this far apart (relative), or c is unknown.
MIN_CONTEXT_SPREAD = 0.25
MIN_POINTS = 3
# Solves kept (StepModel._solve): acceptances and contexts a group sees in a while.
MAX_SOLVED = 4096


@dataclass(frozen=True)
class Point:
    """One measured step: `step_s` seconds at `batch` streams holding `tokens` tokens in all."""

    batch: float
    tokens: float
    step_s: float


def _solve(m: list[list[float]], v: list[float]) -> list[float] | None:
    """Gaussian elimination with partial pivoting; None when singular."""
    n = len(v)
    a = [[*row, v[i]] for i, row in enumerate(m)]
    for col in range(n):
        pivot = max(range(col, n), key=lambda r: abs(a[r][col]))
        if abs(a[pivot][col]) < 1e-12:
            return None
        a[col], a[pivot] = a[pivot], a[col]
        for r in range(col + 1, n):
            f = a[r][col] / a[col][col]
            for k in range(col, n + 1):
                a[r][k] -= f * a[col][k]
    x = [0.0] * n
    for r in range(n - 1, -1, -1):
        x[r] = (a[r][n] - sum(a[r][k] * x[k] for k in range(r + 1, n))) / a[r][r]
    return x


def _least_squares(points: Sequence[Point], free: Sequence[int]) -> list[float] | None:
    """Relative least squares over the coefficients in `free` (0: a, 1: b, 2: c), the others 0.
    Columns are scaled to a largest value of 1 first: B runs to hundreds and T to millions, and
    unscaled normal equations would square that spread."""
    cols = [[1.0, p.batch, p.tokens] for p in points]
    scale = [max(abs(row[j]) for row in cols) or 1.0 for j in range(3)]
    rows = [[row[j] / scale[j] / p.step_s for j in free] for row, p in zip(cols, points, strict=True)]
    n = len(free)
    normal = [[sum(r[i] * r[j] for r in rows) for j in range(n)] for i in range(n)]
    rhs = [sum(r[i] for r in rows) for i in range(n)]  # each target y/y = 1
    x = _solve(normal, rhs)
    if x is None:
        return None
    out = [0.0, 0.0, 0.0]
    for k, j in enumerate(free):
        out[j] = x[k] / scale[j]
    return out


def fit_step(points: Sequence[Point]) -> StepFit | None:
    """a, b, c by relative least squares, none negative; None when the points cannot tell them
    apart (fewer than MIN_POINTS, one batch size, or one per-stream context)."""
    good = [
        p
        for p in points
        if math.isfinite(p.batch) and p.batch >= 1 and math.isfinite(p.tokens) and p.tokens >= 0
        if p.step_s > 0 and math.isfinite(p.step_s)
    ]
    if len(good) < MIN_POINTS or len({p.batch for p in good}) < 2:
        return None
    per_stream = sorted(p.tokens / p.batch for p in good)
    if per_stream[-1] < per_stream[0] * (1 + MIN_CONTEXT_SPREAD) or per_stream[-1] <= 0:
        return None
    free = [0, 1, 2]
    while free:
        coef = _least_squares(good, free)
        if coef is None:
            return None
        negative = [j for j in free if coef[j] < 0]
        if not negative:
            break
        # Fix the most negative at 0 (a step never gets cheaper with more streams or context).
        free.remove(min(negative, key=lambda j: coef[j]))
    else:
        return None
    fit = StepFit(coef[0], coef[1], coef[2])
    if fit.step_s(1, 0) <= 0:
        return None
    rel = [(fit.step_s(p.batch, p.tokens) - p.step_s) / p.step_s for p in good]
    return StepFit(
        fit.a,
        fit.b,
        fit.c,
        points=len(good),
        rms_rel=math.sqrt(sum(r * r for r in rel) / len(rel)),
        max_rel=max(abs(r) for r in rel),
    )


def crossover(spec: StepFit, base: StepFit, accept: float, context: float, n_spec: int = 1, n_base: int = 1) -> float:
    """L*(t, A): the group's load (streams) where both roles' per-stream speeds are equal, each
    role holding all of it spread over its n servers (module docstring). inf: speculation pays at
    every load; 0: at none."""
    num = accept * base.a - spec.a
    den = (spec.b + spec.c * context) / n_spec - accept * (base.b + base.c * context) / n_base
    if num <= 0:
        return 0.0
    if den <= 0:
        return math.inf
    return num / den


@dataclass(frozen=True)
class Prediction:
    """One role's predicted step, per-stream speed and throughput at a batch and context."""

    batch: float
    tokens: float
    step_s: float
    tok_s_per_stream: float
    tok_s: float

    def describe(self) -> dict[str, float]:
        return {
            "batch": round(self.batch, 2),
            "tokens": round(self.tokens),
            "step_ms": round(self.step_s * 1000, 3),
            "tok_s_per_stream": round(self.tok_s_per_stream, 2),
            "tok_s": round(self.tok_s, 1),
        }


@dataclass
class Correction:
    """A role's live multiplicative correction of its fitted step time (module docstring)."""

    log_k: float = 0.0
    observations: int = 0

    @property
    def k(self) -> float:
        return math.exp(self.log_k)

    def observe(self, ratio: float) -> None:
        if not (ratio > 0 and math.isfinite(ratio)):
            return
        bound = math.log(MAX_CORRECTION)
        x = min(max(math.log(ratio), -bound), bound)
        self.log_k = min(max(self.log_k + CORRECTION_ALPHA * (x - self.log_k), -bound), bound)
        self.observations += 1


def _context_key(t: float) -> int:
    return round(math.log(max(t, 1.0)) * 100)


def _scaled(fit: StepFit, k: float) -> StepFit:
    return StepFit(fit.a * k, fit.b * k, fit.c * k, fit.points, fit.rms_rel, fit.max_rel)


@dataclass(frozen=True, kw_only=True)
class ModelLimits:
    """Bounds the model's watermarks stay in, and its band (from the adaptive settings)."""

    min_watermark: int
    max_watermark: int
    margin: float


@dataclass
class StepModel:
    """The fit, its live corrections, and the watermarks and predictions it last gave."""

    fit: ModelFit
    limits: ModelLimits
    servers: Mapping[Role, int] = field(default_factory=lambda: {r: 1 for r in ROLES})
    corrections: dict[Role, Correction] = field(default_factory=dict)
    context: float = 0.0  # the mean context per stream last used
    accept: float = 0.0
    accept_source: str = "calibrated"
    crossover: float | None = None
    high: int = 0
    low: int = 0
    # The group's load the watermarks were last solved at (None: never); predictions and why are
    # made from it when read (/routing), not on every request.
    load_seen: int | None = None

    def __post_init__(self) -> None:
        self.corrections = {r: Correction() for r in ROLES}
        # Each role's fit scaled by its correction, as last scaled (solved for every request and
        # lease: made again only when the correction moved).
        self._steps: dict[Role, tuple[float, StepFit]] = {}
        self._solved: dict[tuple[int, int, float, float], tuple[float, int, int]] = {}
        # Until a stream is seen, the mean context is the calibration's first prompt length.
        self.context = float(self.fit.prompt_tokens[0] + self.fit.max_tokens / 2)
        # The context's bucket (1%) that solves and the pool's rates are kept by.
        self.context_key = _context_key(self.context)
        self.accept = self.fit.accept_length

    def serve(self, servers: Mapping[Role, int]) -> bool:
        """The servers of each role that are up now, which a role's load is spread over: True where
        that changed (and every solve is made afresh)."""
        if servers == self.servers:
            return False
        self.servers = dict(servers)
        self._solved.clear()
        return True

    def step(self, role: Role) -> StepFit:
        log_k = self.corrections[role].log_k
        kept = self._steps.get(role)
        if kept is None or kept[0] != log_k:
            kept = self._steps[role] = (log_k, _scaled(self.fit.of(role), math.exp(log_k)))
        return kept[1]

    def per_step(self, role: Role) -> float:
        return self.accept if role == SPECULATIVE else 1.0

    def predict(self, role: Role, load: float, tokens: float) -> Prediction:
        """Role `role` holding the group's `load` streams and `tokens` tokens (over its servers)."""
        n = self.servers.get(role, 1) or 1
        batch, held = max(load, 1.0) / n, tokens / n
        s = self.step(role).step_s(batch, held)
        v = self.per_step(role) / s
        return Prediction(batch, held, s, v, batch * v)

    def watermarks(self, load: int, tokens: float, streams: int, accept: float | None, source: str) -> tuple[int, int]:
        """(high, low) for a group with `load` streams before the new request, whose `streams`
        (this gateway's, the new request included) hold `tokens` tokens; `accept` the live
        acceptance (None: the calibration's)."""
        if streams > 0 and tokens > 0:
            t = tokens / streams
            if t != self.context:
                self.context, self.context_key = t, _context_key(t)
        self.accept, self.accept_source = (
            (accept, source) if accept is not None else (self.fit.accept_length, "calibrated")
        )
        at, high, low = self._solve(self.accept)
        self.crossover = at if math.isfinite(at) else None
        self.high, self.low = high, low
        self.load_seen = load
        return high, low

    @property
    def predictions(self) -> dict[str, dict[str, Prediction]]:
        """Each role's step, speed and throughput at the load last solved at, and with one more."""
        if self.load_seen is None:
            return {}
        t, load = self.context, self.load_seen
        now, more = float(max(load, 1)), float(load + 1)
        return {
            role: {"now": self.predict(role, now, now * t), "with_one_more": self.predict(role, more, more * t)}
            for role in ROLES
        }

    @property
    def why(self) -> str:
        """The last solve, in words."""
        if self.load_seen is None:
            return ""
        at = math.inf if self.crossover is None else self.crossover
        where = "at every load" if self.crossover is None else f"below {at:.1f} streams"
        if at == 0:
            where = "at no load"
        return (
            f"speculation pays {where} at {self.context:.0f} tokens of context a stream and acceptance "
            f"{self.accept:.2f} ({self.accept_source}); leave at {self.high}, come back at {self.low}"
        )

    def _solve(self, a: float) -> tuple[float, int, int]:
        """L*(t, a) at the context last seen and the watermarks it calls for (the module's rule),
        solved once per acceptance to 0.01 and context to 1% (at the first of each seen) while the
        corrections stand: every request and lease asks, and within those steps the answer moves by
        under 1%."""
        c = self.corrections
        key = (round(a * 100), self.context_key, c[SPECULATIVE].log_k, c[BASELINE].log_k)
        found = self._solved.get(key)
        if found is None:
            if len(self._solved) >= MAX_SOLVED:
                self._solved.clear()
            found = self._solved[key] = self._solve_at(a, self.context)
        return found

    def _solve_at(self, a: float, t: float) -> tuple[float, int, int]:
        spec, base = self.step(SPECULATIVE), self.step(BASELINE)
        ns, nb = self.servers.get(SPECULATIVE, 1) or 1, self.servers.get(BASELINE, 1) or 1
        up = 1.0 + self.limits.margin
        lo_wm, hi_wm = self.limits.min_watermark, self.limits.max_watermark

        def floor(x: float) -> int:
            return hi_wm if not math.isfinite(x) else int(min(math.floor(x + 1e-9), hi_wm))

        high = min(max(floor(crossover(spec, base, a * up, t, ns, nb)), lo_wm), hi_wm)
        low = min(max(min(floor(crossover(spec, base, a / up, t, ns, nb)), hysteresis_low(high)), 0), high)
        return crossover(spec, base, a, t, ns, nb), high, low

    def class_watermarks(self, accept: float) -> tuple[int, int]:
        """(high, low) for a traffic class of acceptance `accept`, at the context last seen."""
        _, high, low = self._solve(accept)
        return high, low

    def observe(self, role: Role, batch: float, tokens: float, tok_s: float, accept: float | None) -> None:
        """A stream's decode speed (tokens/s) while its server held `batch` streams and `tokens`
        tokens (over the role's servers); `accept` the speculative server's acceptance then."""
        if not (tok_s > 0 and math.isfinite(tok_s) and batch >= 1):
            return
        n = self.servers.get(role, 1) or 1
        per_step = (accept or self.fit.accept_length) if role == SPECULATIVE else 1.0
        predicted = self.fit.of(role).step_s(max(batch / n, 1.0), max(tokens, 0.0) / n)
        self.corrections[role].observe((per_step / tok_s) / predicted)

    def describe(self) -> dict[str, Any]:
        def coef(f: StepFit) -> dict[str, float]:
            return {"a_s": f.a, "b_s_per_stream": f.b, "c_s_per_token": f.c, "rms_rel": round(f.rms_rel, 4),
                    "max_rel": round(f.max_rel, 4), "points": f.points}  # fmt: skip

        return {
            "form": MODEL_FORM,
            "fit": {role: coef(self.fit.of(role)) for role in ROLES},
            # A summary: the calibration's list may be long, and /routing shows it in every group.
            "prompt_tokens_measured": _summary(self.fit.prompt_tokens),
            "accept_length_calibrated": self.fit.accept_length,
            "correction": {
                role: {"k": round(c.k, 4), "observations": c.observations} for role, c in self.corrections.items()
            },
            "accept_length": self.accept,
            "accept_length_source": self.accept_source,
            "context_per_stream": round(self.context, 1),
            "servers_up": {role: self.servers.get(role, 1) for role in ROLES},
            "crossover_streams": None if self.crossover is None else round(self.crossover, 2),
            "watermarks": {"high": self.high, "low": self.low},
            "predictions": {role: {k: p.describe() for k, p in by.items()} for role, by in self.predictions.items()},
            "why": self.why,
        }


def _summary(values: tuple[int, ...]) -> dict[str, int]:
    return {"count": len(values), "min": min(values, default=0), "max": max(values, default=0)}
