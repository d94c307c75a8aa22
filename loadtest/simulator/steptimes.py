"""Step times measured on an H200, what they make a decode step and a prefill chunk cost, the KV pool
a GPU's memory leaves, and SGLang's adaptive choice of draft steps. Pure: the only I/O is reading a
profile file.

A profile (`profiles/h200-*.json`, generated from `shared/profiles/h200-step-times.json` by
`python -m loadtest.simulator.steptimes generate SHARED_JSON OUT_DIR`) holds, per context length,
`target_step_s[B][q]` (one forward of the target model at batch B with q query tokens per sequence)
and `draft_step_s[B][q]` (one EAGLE-3-style draft step), the measured cost of two processes sharing
the GPU, and the memory figures of the model's shape. Between measured points everything is linear
(in B, in q, in the context), and beyond them extrapolated linearly from the last two points.
"""

from __future__ import annotations

import bisect
import json
import math
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

from .profile import ProfileError

# An H200 as nvidia-smi reports it: 143,771 MiB.
H200_GPU_GIB = 143_771 / 1024
GIB = 1024**3
# The share of the memory left for KV pools that compose.yaml gives the speculative server when
# both share a GPU: its pool against the baseline's in .env.example (49,152 tokens of 132 KiB
# against 90,112 of 128 KiB), kept when the GPU is larger.
SHARED_SPECULATIVE_SHARE = 49_152 * 132 / (49_152 * 132 + 90_112 * 128)
# Pages of 16 tokens: a pool is a whole number of them.
POOL_ROUNDING = 16

_PROFILES = ("h200-llama8b", "h200-llama70b-tp4")
_SHAPES = {"h200-llama8b": "llama8b", "h200-llama70b-tp4": "llama70b_tp4"}

# Figures of each model's published shape (not measured): GiB and bytes per token of KV cache.
# They mirror .env.example's derivation for an 80 GB GPU (process, weights, draft, runtime).
MEMORY: dict[str, dict[str, Any]] = {
    "llama8b": {
        "about": "Llama-3.1-8B in bf16 at TP 1, with its EAGLE-3 draft; figures from the model's shape, "
        "not measured (as .env.example derives them for an 80 GB GPU)",
        "process_gib": 1.00,
        "weights_gib": 14.96,
        "draft_gib": 2.00,
        "runtime_gib": 13.58,
        "kv_bytes_per_token": 32 * 8 * 128 * 2 * 2,
        "draft_kv_bytes_per_token": 1 * 8 * 128 * 2 * 2,
    },
    "llama70b_tp4": {
        "about": "one GPU's shard of a Llama-3.1-70B at TP 4 in bf16, with its EAGLE-3 draft's shard; "
        "figures from the model's shape, not measured",
        "process_gib": 1.00,
        "weights_gib": round(70.55e9 * 2 / 4 / GIB, 2),
        "draft_gib": 1.00,
        "runtime_gib": 13.58,
        "kv_bytes_per_token": 80 * 2 * 128 * 2 * 2,
        "draft_kv_bytes_per_token": 1 * 2 * 128 * 2 * 2,
    },
}


def _interp(xs: Sequence[float], ys: Sequence[float], x: float) -> float:
    """Linear between points, extrapolated linearly from the last two beyond the last; clamped
    below the first (no batch under 1, no query under one token)."""
    if x <= xs[0] or len(xs) == 1:
        return ys[0]
    i = bisect.bisect_left(xs, x)
    if i >= len(xs):
        i = len(xs) - 1
    x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
    return y0 + (y1 - y0) * (x - x0) / (x1 - x0)


@dataclass(frozen=True)
class _Grid:
    """One table: step seconds by batch (rows) and query tokens (columns)."""

    batches: tuple[float, ...]
    queries: tuple[float, ...]
    rows: tuple[tuple[float, ...], ...]

    @classmethod
    def of(cls, table: Mapping[str, Mapping[str, float]]) -> _Grid:
        batches = sorted(table, key=float)
        queries = sorted(table[batches[0]], key=float)
        for b in batches:
            if sorted(table[b], key=float) != queries:
                raise ProfileError(f"batch {b}: query sizes differ from batch {batches[0]}'s")
        rows = tuple(tuple(_seconds(table[b][q]) for q in queries) for b in batches)
        return cls(tuple(map(float, batches)), tuple(map(float, queries)), rows)

    def at(self, b: float, q: float) -> float:
        column = [_interp(self.queries, row, q) for row in self._near(b)]
        return _interp(self._near_batches(b), column, b)

    def _span(self, b: float) -> tuple[int, int]:
        i = bisect.bisect_left(self.batches, b)
        i = min(max(i, 1), len(self.batches) - 1)
        return i - 1, i + 1

    def _near(self, b: float) -> tuple[tuple[float, ...], ...]:
        lo, hi = self._span(b)
        return self.rows[lo:hi]

    def _near_batches(self, b: float) -> tuple[float, ...]:
        lo, hi = self._span(b)
        return self.batches[lo:hi]


def _seconds(raw: object) -> float:
    if isinstance(raw, bool) or not isinstance(raw, (int, float)) or not math.isfinite(raw) or raw <= 0:
        raise ProfileError(f"a step time must be a positive number of seconds, got {raw!r}")
    return float(raw)


@dataclass(frozen=True)
class StepTimes:
    name: str
    about: str
    contexts: tuple[float, ...]
    targets: tuple[_Grid, ...]
    drafts: tuple[_Grid, ...]
    # Measured: the shares of their solo speed two processes sharing the GPU kept, summed, by batch.
    contention_batches: tuple[float, ...]
    contention_shares: tuple[float, ...]
    memory: Mapping[str, Any]

    # ----- step costs, seconds on the GPU -----
    def target_s(self, b: float, q: float, ctx: float) -> float:
        return self._in_ctx(self.targets, b, q, ctx)

    def draft_s(self, b: float, q: float, ctx: float) -> float:
        return self._in_ctx(self.drafts, b, q, ctx)

    def baseline_step_s(self, b: float, ctx: float) -> float:
        return self.target_s(b, 1, ctx)

    def eagle_step_s(self, b: float, steps: int, ctx: float) -> float:
        """An EAGLE iteration with top-k 1: `steps` draft steps, one verify of steps + 1 tokens and
        the draft's pass over them; at 0 steps (the adaptive role not drafting) a plain decode step
        and the draft's catch-up over its token, which SGLang still runs."""
        if steps == 0:
            return self.target_s(b, 1, ctx) + self.draft_s(b, 1, ctx)
        q = steps + 1
        return steps * self.draft_s(b, 1, ctx) + self.target_s(b, q, ctx) + self.draft_s(b, q, ctx)

    def prefill_s(self, tokens: int, ctx: float, draft: bool) -> float:
        """A prompt chunk of `tokens` tokens over a prefix of `ctx`. The table has no prefill: a
        chunk costs what a batch of as many query tokens does, 32 per sequence (the table's widest
        verify), and on a speculative server the draft's pass over them, 8 per sequence."""
        cost = self.target_s(tokens / 32, 32, ctx) if tokens >= 32 else self.target_s(1, tokens, ctx)
        if draft:
            cost += self.draft_s(tokens / 8, 8, ctx) if tokens >= 8 else self.draft_s(1, tokens, ctx)
        return cost

    def contention(self, b: float) -> float:
        return _interp(self.contention_batches, self.contention_shares, b) if self.contention_batches else 1.0

    def _in_ctx(self, grids: tuple[_Grid, ...], b: float, q: float, ctx: float) -> float:
        values = [g.at(b, q) for g in grids]
        if len(values) == 1:
            return values[0]
        i = min(max(bisect.bisect_left(self.contexts, ctx), 1), len(values) - 1)
        c0, c1, y0, y1 = self.contexts[i - 1], self.contexts[i], values[i - 1], values[i]
        # A step reads more KV cache with more context, never less: a measured dip is noise.
        slope = max(0.0, (y1 - y0) / (c1 - c0))
        # Below the shortest context measured, never under half its time (weights are read anyway).
        return max(y0 + slope * (ctx - c0), 0.5 * values[0])

    # ----- memory -----
    def pool_tokens(self, gpu_gib: float, role: str, shared: bool) -> int:
        """The KV pool in tokens of a server alone on a GPU of `gpu_gib`, or, `shared`, of one of a
        pair (speculative and baseline) on it, split as compose.yaml splits the memory left."""
        m = self.memory
        fixed = m["process_gib"] + m["weights_gib"] + m["runtime_gib"]
        drafting = role != "baseline"
        per_token = m["kv_bytes_per_token"] + (m["draft_kv_bytes_per_token"] if drafting else 0)
        if shared:
            left = gpu_gib - 2 * fixed - m["draft_gib"]
            share = SHARED_SPECULATIVE_SHARE if drafting else 1 - SHARED_SPECULATIVE_SHARE
            pool_gib = left * share
        else:
            pool_gib = gpu_gib - fixed - (m["draft_gib"] if drafting else 0.0)
        tokens = int(pool_gib * GIB / per_token) // POOL_ROUNDING * POOL_ROUNDING
        if tokens <= 0:
            where = "beside the other server" if shared else "alone"
            raise ProfileError(
                f"{self.name}: a {gpu_gib:g} GiB GPU leaves no memory for a {role} server's KV cache {where}"
            )
        return tokens


# ----- SGLang's --speculative-adaptive -----

# v0.5.23's defaults (speculative/adaptive_spec_params.py): candidate steps by the smallest batch
# size of each tier. v0.5.19's first tier was (1, 3, 7); 5 now sits between 3 and 7, so a request
# mix that keeps about four drafts accepted settles at 5 steps instead of 7.
ADAPTIVE_TIERS: tuple[tuple[int, tuple[int, ...]], ...] = (
    (1, (1, 3, 5, 7)),
    (8, (0, 1, 3)),
    (32, (0, 1)),
    (64, (0,)),
)
# The batch sizes SGLang captures CUDA graphs for (a batch runs padded up to the next one).
CUDA_GRAPH_BATCHES: tuple[int, ...] = (1, 2, 4, 8, 12, 16, 24, *range(32, 257, 8))


class AdaptiveSteps:
    """The draft depth SGLang's `--speculative-adaptive` picks, per batch-size tier: an EMA (alpha
    0.2) of the drafts a request got accepted, updated after every iteration that drafted; after 10
    warm-up iterations, every 5th it moves down a candidate while the EMA is at most the lower
    candidate less 0.5 (0.5 to reach 0 steps; 0.25 lower still in the first tier), else up while
    it exceeds the current one less 0.5; from 0 steps it probes the next candidate up. The batch
    size is padded to a captured CUDA-graph size before its tier is looked up (a batch above the largest
    captured size keeps its own). Mirrored from `AdaptiveStepSlot` (SGLang,
    speculative/adaptive_spec_params.py, its default EMA strategy) and the batch-size routing of
    speculative/adaptive_step_router.py; tiers of v0.5.23."""

    EMA_ALPHA = 0.2
    WARMUP = 10
    UPDATE_EVERY = 5

    def __init__(self, initial_steps: int = 3) -> None:
        self._slots = {low: _Slot(candidates, initial_steps, first=low == 1) for low, candidates in ADAPTIVE_TIERS}

    def choose(self, batch_size: int) -> int:
        return self._slot(batch_size).steps

    def observe(self, batch_size: int, steps: int, accept_length: float) -> None:
        """`accept_length`: the iteration's mean tokens per request, the bonus token included."""
        self._slot(batch_size).update(steps, accept_length - 1.0, self)

    def _slot(self, batch_size: int) -> _Slot:
        i = bisect.bisect_left(CUDA_GRAPH_BATCHES, batch_size)
        padded = CUDA_GRAPH_BATCHES[i] if i < len(CUDA_GRAPH_BATCHES) else batch_size
        low = max(t for t, _ in ADAPTIVE_TIERS if t <= padded)
        return self._slots[low]


class _Slot:
    def __init__(self, candidates: tuple[int, ...], initial: int, first: bool) -> None:
        self.candidates = candidates
        self.steps = initial if initial in candidates else candidates[len(candidates) // 2]
        self.ema = float(self.steps - 1)
        self.down_hysteresis = -0.25 if first else 0.0
        self.batches = 0

    def update(self, steps: int, drafts_accepted: float, rule: AdaptiveSteps) -> None:
        if steps > 0:
            self.ema = (1 - rule.EMA_ALPHA) * self.ema + rule.EMA_ALPHA * drafts_accepted
        self.batches += 1
        if self.batches <= rule.WARMUP or (self.batches - rule.WARMUP) % rule.UPDATE_EVERY:
            return
        i = self.candidates.index(self.steps)
        if self.steps == 0:
            i = min(i + 1, len(self.candidates) - 1)
            if self.candidates[i] > 0 and self.ema < 0:
                self.ema = float(self.candidates[i] - 1)
            self.steps = self.candidates[i]
            return
        start = i
        while i > 0:
            lower = self.candidates[i - 1]
            if self.ema <= (0.5 if lower == 0 else lower - 0.5) + self.down_hysteresis:
                i -= 1
            else:
                break
        if i == start:
            while i < len(self.candidates) - 1 and self.ema > self.candidates[i] - 0.5:
                i += 1
        self.steps = self.candidates[i]


# ----- acceptance at another depth -----


def accept_at_steps(accept: float, ref_steps: int, steps: int) -> float:
    """A request's tokens per iteration at `steps` draft steps, given `accept` at `ref_steps`: with
    chain drafting (top-k 1) each drafted token is accepted with probability p if all before it
    were, so s steps accept (1 - p^(s+1)) / (1 - p) tokens, the bonus token included."""
    if steps <= 0:
        return 1.0
    most = ref_steps + 1.0
    if accept >= most:
        p = 1.0
    elif accept <= 1.0:
        p = 0.0
    else:
        lo, hi = 0.0, 1.0
        for _ in range(60):  # bisection: the length grows with p; 60 halvings reach float precision
            mid = (lo + hi) / 2
            if _chain(mid, ref_steps) < accept:
                lo = mid
            else:
                hi = mid
        p = (lo + hi) / 2
    return _chain(p, steps)


def _chain(p: float, steps: int) -> float:
    return float(steps + 1) if p >= 1.0 else (1 - p ** (steps + 1)) / (1 - p)


# ----- profiles -----


def steptime_names() -> list[str]:
    return list(_PROFILES)


def load_steptimes(name_or_path: str) -> StepTimes:
    if name_or_path in _PROFILES:
        text = resources.files(__package__).joinpath("profiles", f"{name_or_path}.json").read_text(encoding="utf-8")
        return parse_steptimes(text, name_or_path)
    path = Path(name_or_path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ProfileError(f"cannot read step-time profile {path}: {exc.strerror}") from exc
    return parse_steptimes(text, path.stem)


def parse_steptimes(text: str, name: str) -> StepTimes:
    try:
        doc = json.loads(text)
        tables = sorted(doc["tables"], key=lambda t: float(t["ctx"]))
        if not tables:
            raise ProfileError(f"{name}: no tables")
        contexts = tuple(float(t["ctx"]) for t in tables)
        if len(set(contexts)) != len(contexts) or contexts[0] <= 0:
            raise ProfileError(f"{name}: contexts must be positive and distinct")
        results = doc.get("shared_gpu", {}).get("results", {})
        contention = sorted((float(b), float(r["share_sum"])) for b, r in results.items())
        memory = doc["memory"]
        for key in ("process_gib", "weights_gib", "draft_gib", "runtime_gib", "kv_bytes_per_token"):
            _seconds(memory[key])  # positive numbers, as step times are
        return StepTimes(
            name=name,
            about=str(doc.get("about", "")),
            contexts=contexts,
            targets=tuple(_Grid.of(t["target_step_s"]) for t in tables),
            drafts=tuple(_Grid.of(t["draft_step_s"]) for t in tables),
            contention_batches=tuple(b for b, _ in contention),
            contention_shares=tuple(s for _, s in contention),
            memory=memory,
        )
    except ProfileError as exc:
        raise ProfileError(f"{name}: {exc}") from None
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise ProfileError(f"{name}: not a step-time profile ({type(exc).__name__}: {exc})") from None


def generate(shared: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    """The shipped profiles from the shared table. The 70B shard was measured at 1k tokens of
    context only: its 4k table adds the 8B's growth from 1k to 4k, scaled by the KV bytes a token
    of each reads (attention time grows with the KV cache read)."""
    by_shape: dict[str, dict[float, dict[str, Any]]] = {}
    for t in shared["tables"]:
        by_shape.setdefault(t["model_shape"], {})[float(t["ctx"])] = t
    small = by_shape["llama8b"]
    out: dict[str, dict[str, Any]] = {}
    for name, shape in _SHAPES.items():
        tables = [dict(t) for _, t in sorted(by_shape[shape].items())]
        derived = ""
        if shape != "llama8b" and len(tables) == 1:
            # The target's and the draft's growth each scale by their own KV bytes a token.
            scales = {
                key: MEMORY[shape][kv] / MEMORY["llama8b"][kv]
                for key, kv in (("target_step_s", "kv_bytes_per_token"), ("draft_step_s", "draft_kv_bytes_per_token"))
            }
            base, short, long = tables[0], small[1024.0], small[4096.0]
            extra: dict[str, Any] = {"model_shape": shape, "ctx": 4096, "derived": (
                "not measured: the 1k table plus the 8B's growth from 1k to 4k tokens, times the KV bytes a "
                f"token of this shard reads over the 8B's ({scales['target_step_s']:g} for the target, "
                f"{scales['draft_step_s']:g} for the draft)")}  # fmt: skip
            for key, scale in scales.items():
                extra[key] = {
                    b: {q: round(v + scale * (long[key][b][q] - short[key][b][q]), 6) for q, v in row.items()}
                    for b, row in base[key].items()
                }
            tables.append(extra)
            derived = " The 4096-token table of this profile is derived, not measured (see its `derived`)."
        out[name] = {
            "about": shared["about"],
            "generated": "by `python -m loadtest.simulator.steptimes generate` from shared/profiles/"
            "h200-step-times.json: the tables of one model shape, the shared-GPU measurement and memory "
            "figures from the model's shape." + derived,
            "gpu": shared["gpu"],
            "tables": tables,
            "shared_gpu": shared["shared_gpu"],
            "memory": MEMORY[shape],
        }
    return out


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) != 3 or args[0] != "generate":
        print("usage: python -m loadtest.simulator.steptimes generate SHARED_JSON OUT_DIR", file=sys.stderr)
        return 2
    shared = json.loads(Path(args[1]).read_text(encoding="utf-8"))
    for name, doc in generate(shared).items():
        Path(args[2], f"{name}.json").write_text(json.dumps(doc, indent=1) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
