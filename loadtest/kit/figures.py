"""One target's figures in a cell of targets measured side by side, in simulated time: what
headtohead and the experiments on its cells score.

Figures are converted from wall-clock to simulated time with the cell's time scale T (a simulated
second lasts 1/T wall seconds): rates are divided by T, latencies multiplied by it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..classes import ClassSummary
from ..stats import LevelStats

# Two targets' goodput within this share of each other: a tie, neither wins.
TIE = 0.05
# Goodput below this (requests a simulated second): the target met the SLOs on (almost) nothing.
NO_GOODPUT = 1e-9


@dataclass(frozen=True)
class TargetCell:
    """One target's figures in one cell, in simulated time."""

    target: str
    completed: int  # good requests started inside the window
    errors: int  # the server's failures
    client_errors: int  # failures before the server answered: the client's, never the server's
    min_ok: int  # good requests a conclusive cell needs
    conclusive: bool
    output_tok_s: float
    goodput_req_s: float  # requests finished inside the window within both SLOs, per second
    goodput_share: float  # of the requests started inside it
    prefix_cache_hit_rate: float | None
    # Over every good request of the cell (warm-up and drain too): the sessions all start together,
    # so the window alone holds more of their later, longer turns.
    mean_prompt_tokens: float
    p50_ttft_ms: float
    p99_ttft_ms: float
    p50_tpot_ms: float
    p99_tpot_ms: float
    window_s: float  # simulated seconds
    # specgate: the share of its requests it sent to the speculative server.
    speculative_share: float | None = None
    # Mean of the server's sglang:num_queue_reqs over the window's samples (the pair: both servers).
    mean_queued: float | None = None


def target_cell(
    target: str,
    stats: LevelStats,
    summary: ClassSummary | None,
    time_scale: float,
    mean_queued: float | None = None,
    mean_prompt_tokens: float | None = None,
) -> TargetCell:
    """One target's cell from its level's figures (wall-clock) at time scale `time_scale`;
    `mean_prompt_tokens`, when given, replaces the window's (see TargetCell)."""
    t = time_scale
    s = summary
    # No request to the speculative server is a share of 0, not an unknown one.
    share = stats.backend_share.get("speculative", 0.0) if stats.backend_share else None
    return TargetCell(
        target=target,
        completed=stats.completed,
        errors=stats.errors,
        client_errors=stats.client_errors,
        min_ok=stats.min_ok,
        conclusive=stats.conclusive,
        output_tok_s=stats.output_tok_s / t,
        goodput_req_s=(s.goodput_req_s or 0.0) / t if s else 0.0,
        goodput_share=(s.goodput_share if s and s.goodput_share is not None else math.nan),
        prefix_cache_hit_rate=s.prefix_cache_hit_rate if s else None,
        mean_prompt_tokens=mean_prompt_tokens
        if mean_prompt_tokens is not None
        else s.mean_prompt_tokens
        if s
        else math.nan,
        p50_ttft_ms=(s.p50_ttft_ms if s else math.nan) * t,
        p99_ttft_ms=(s.p99_ttft_ms if s else math.nan) * t,
        p50_tpot_ms=(s.p50_tpot_ms if s else math.nan) * t,
        p99_tpot_ms=(s.p99_tpot_ms if s else math.nan) * t,
        window_s=stats.duration_s * t,
        speculative_share=share,
        mean_queued=mean_queued,
    )
