"""Tables, JSON and plots of sweep results. Reporting only: nothing here measures."""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .calibrate import Crossover, Recommendation
from .classes import Slo
from .kit.plots import pyplot
from .stats import LevelStats


def fmt(value: float | None, digits: int = 1) -> str:
    return "-" if value is None or math.isnan(value) else f"{value:,.{digits}f}"


def target_verdict(label: str, misses: Sequence[str], inconclusive: Sequence[str], scored: int) -> str:
    """A target's line: NO with the misses among conclusive figures; yes only when every figure was
    conclusive and met it; otherwise unknown, since an inconclusive figure is no evidence either way."""
    unknown = f"inconclusive at {'; '.join(inconclusive)}" if inconclusive else ""
    if misses:
        return f"{label}: NO ({'; '.join(misses)})" + (f"; {unknown}" if unknown else "")
    if not unknown:
        return f"{label}: yes" if scored else f"{label}: unknown (nothing measured)"
    if not scored:
        return f"{label}: unknown ({unknown})"
    return f"{label}: unknown (met at the {scored} conclusive; {unknown})"


def level_table(title: str, rows: Sequence[LevelStats]) -> str:
    """One target's levels; an inconclusive level is starred, and a note under the table says why."""
    head = (
        f"{'conc':>5} {'window':>7} {'out tok/s':>10} {'req/s':>7} {'TTFT mean':>9} {'med':>7} {'p99':>7} "
        f"{'ITL mean':>8} {'med':>6} {'p95':>6} {'p99':>6} {'TPOT':>6} {'E2E mean':>9} {'med':>8} "
        f"{'err':>4} {'cerr':>4}  backends"
    )
    lines = [title, head, "-" * len(head)]
    for r in rows:
        share = ", ".join(f"{b} {v:.0%}" for b, v in r.backend_share.items())
        lines.append(
            f"{_conc(r):>5} {_window(r):>7} {fmt(r.output_tok_s):>10} {fmt(r.request_per_s, 2):>7} "
            f"{fmt(r.mean_ttft_ms):>9} "
            f"{fmt(r.median_ttft_ms):>7} {fmt(r.p99_ttft_ms):>7} {fmt(r.mean_itl_ms):>8} {fmt(r.median_itl_ms):>6} "
            f"{fmt(r.p95_itl_ms):>6} {fmt(r.p99_itl_ms):>6} {fmt(r.mean_tpot_ms):>6} {fmt(r.mean_e2e_ms):>9} "
            f"{fmt(r.median_e2e_ms):>8} {r.errors:>4} {r.client_errors:>4}  {share}"
        )
    lines.append("(times in ms; window: the measurement window in s, + where it ran past --duration-s for want of "
                 "good requests; out tok/s from usage over the window; ITL: the gap between stream events, per event "
                 "not per token (a speculative server's event carries every token a step accepted); TPOT: the mean "
                 "time per output token, (E2E - TTFT) / (tokens - 1); err: the server's errors, cerr: the client's, "
                 "requests that failed before the server answered)")  # fmt: skip
    lines += level_warnings(rows)
    return "\n".join(lines)


def class_table(title: str, rows: Sequence[LevelStats], slo: Slo) -> str:
    """Each level's traffic classes: latency percentiles, throughput, goodput, prefix-cache hit rate."""
    head = (
        f"{'conc':>5} {'class':<12} {'ok':>5} {'err':>4} {'TTFT p50':>8} {'p99':>7} {'TPOT p50':>8} {'p99':>6} "
        f"{'out tok/s':>10} {'good req/s':>10} {'good':>5} {'cache hit':>9} {'prompt tok':>10}"
    )
    lines = [title, head, "-" * len(head)]
    unreported = False
    for r in rows:
        for c in r.classes.values():
            unreported |= c.prefix_cache_hit_rate is None
            lines.append(
                f"{_conc(r):>5} {c.name:<12} {c.completed:>5} {c.errors:>4} {fmt(c.p50_ttft_ms):>8} "
                f"{fmt(c.p99_ttft_ms):>7} {fmt(c.p50_tpot_ms):>8} {fmt(c.p99_tpot_ms):>6} {fmt(c.output_tok_s):>10} "
                f"{_opt(c.goodput_req_s, '{:,.2f}'):>10} {_opt(c.goodput_share, '{:.0%}'):>5} "
                f"{_opt(c.prefix_cache_hit_rate, '{:.1%}'):>9} {fmt(c.mean_prompt_tokens, 0):>10}"
            )
    lines.append(
        f"(times in ms; good: the share of requests within {slo.describe()}, good req/s those finished in the "
        "window; cache hit: cached prompt tokens over prompt tokens, from usage; prompt tok: the mean)"
        if slo.given
        else "(times in ms; goodput not measured: no SLO given (--slo-ttft-ms, --slo-tpot-ms); cache hit: cached "
        "prompt tokens over prompt tokens, from usage; prompt tok: the mean)"
    )
    if unreported:
        lines.append(
            "  note: cache hit n/a: the server's usage carried no prompt_tokens_details.cached_tokens (SGLang "
            "reports it when started with --enable-cache-report)"
        )
    return "\n".join(lines)


def _opt(value: float | None, spec: str) -> str:
    return "n/a" if value is None else "-" if math.isnan(value) else spec.format(value)


def _window(r: LevelStats) -> str:
    return f"{r.duration_s:.1f}" + ("+" if r.extended_s else "")


def _conc(r: LevelStats) -> str:
    return str(r.concurrency) if r.conclusive else f"{r.concurrency}*"


def level_warnings(rows: Sequence[LevelStats], name: str = "") -> list[str]:
    """A line per inconclusive level, per level with client errors, and per level that retried."""
    who = f"{name} " if name else ""
    out = []
    for r in rows:
        if not r.conclusive:
            longer = f", in a window extended to {r.duration_s:.1f} s (--max-duration-s)" if r.extended_s else ""
            why = (
                f"{r.completed} good requests, {r.min_ok} needed (--min-requests, and at least half the streams)"
                + longer
                if r.completed < r.min_ok
                else f"{r.client_errors} of its requests failed on the client's side, so the server was not "
                f"under the load of {r.concurrency} streams"
            )
            out.append(f"* warning: {who}c={r.concurrency} is inconclusive: {why}; nothing is concluded from it")
        if r.client_errors:
            out.append(
                f"  warning: {who}c={r.concurrency}: {r.client_errors} client errors (no answer from the server, "
                f"even on a new connection), not counted as the server's: {'; '.join(r.client_error_samples)}"
            )
        if r.retried:
            out.append(
                f"  note: {who}c={r.concurrency}: {r.retried} requests answered only when resent on a new connection "
                "(the target closes connections the client pooled); each timed from the try that was answered"
            )
    return out


def compare_table(sweeps: Mapping[str, Sequence[LevelStats]]) -> str:
    """Throughput side by side; a figure from an inconclusive level is starred and so is its ratio."""
    spec, base = sweeps["speculative"], sweeps["baseline"]
    proxy = sweeps.get("specgate")
    # Other targets (`compare --extra`): each against the better of the two servers.
    extras = {name: rows for name, rows in sweeps.items() if name not in ("speculative", "baseline", "specgate")}
    head = f"{'conc':>5} {'speculative':>12} {'baseline':>10}"
    if proxy is not None:
        head += f" {'specgate':>10} {'vs better':>9} {'spec share':>10}"
    for name in extras:
        width = max(10, len(name))
        head += f" {name:>{width}} {'vs better':>9}"
    lines = ["output tok/s by concurrency", head, "-" * len(head)]
    for i, (s, b) in enumerate(zip(spec, base, strict=True)):
        line = f"{s.concurrency:>5} {_star(s.output_tok_s, s):>12} {_star(b.output_tok_s, b):>10}"
        better = max(s.output_tok_s, b.output_tok_s)
        if proxy is not None:
            p = proxy[i]
            ratio = p.output_tok_s / better if better > 0 else math.nan
            all_conclusive = s.conclusive and b.conclusive and p.conclusive
            line += (
                f" {_star(p.output_tok_s, p):>10} {fmt(ratio, 3) + ('' if all_conclusive else '*'):>9}"
                f" {p.backend_share.get('speculative', 0.0):>10.0%}"
            )
        for name, rows in extras.items():
            e = rows[i]
            ratio = e.output_tok_s / better if better > 0 else math.nan
            all_conclusive = s.conclusive and b.conclusive and e.conclusive
            width = max(10, len(name))
            line += f" {_star(e.output_tok_s, e):>{width}} {fmt(ratio, 3) + ('' if all_conclusive else '*'):>9}"
        lines.append(line)
    longer = [
        f"{name} " + ", ".join(f"c={r.concurrency} {r.duration_s:.1f}" for r in extended)
        for name, rows in sweeps.items()
        if (extended := [r for r in rows if r.extended_s])
    ]
    if longer:
        lines.append("windows run past --duration-s for want of good requests (s): " + "; ".join(longer))
    for name, rows in sweeps.items():
        # Only what explains the stars: the per-target tables and the progress lines say the rest.
        lines += [w for w in level_warnings(rows, name) if w.startswith("*")]
    return "\n".join(lines)


def _star(value: float, r: LevelStats) -> str:
    return fmt(value) if r.conclusive else fmt(value) + "*"


def describe_crossover(c: Crossover) -> str:
    if c.verdict == "crosses":
        return f"speculation stops paying at ~{c.at:.1f} streams"
    return {
        "never_pays": "speculation never pays",
        "always_pays": "speculation pays at every level",
        "no_data": "no data",
        "unknown": f"unknown: {c.why}",
    }[c.verdict]


def calibration_text(throughput: Crossover, latency: Crossover, rec: Recommendation, env: str | None = None) -> str:
    """The verdicts, the recommendation and the lines to paste: `env`, else the watermarks'."""
    text = (
        f"throughput (output tok/s):  {describe_crossover(throughput)}\n"
        f"per-request latency (TPOT): {describe_crossover(latency)}\n\n{rec.explanation}\n\n"
    )
    if not rec.made:
        # Nothing was concluded to recommend from: printing watermarks to paste (specgate's defaults,
        # or 0) would pass an unknown off as a finding.
        return text + "Nothing to paste: no watermarks follow from these measurements.\n"
    return text + f"Paste into specgate's environment:\n\n{rec.env_lines() if env is None else env}"


def to_jsonable(obj: Any) -> Any:
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {k: to_jsonable(v) for k, v in dataclasses.asdict(obj).items()}
    if isinstance(obj, dict):
        return {str(k): to_jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [to_jsonable(v) for v in obj]
    if isinstance(obj, float) and math.isnan(obj):
        return None
    return obj


def write_json(path: str | Path, payload: Mapping[str, Any]) -> None:
    Path(path).write_text(json.dumps(to_jsonable(payload), indent=2) + "\n")


# The comparison plot's panels: a LevelStats field against concurrency, and its axis label. Latency
# per output token, not ITL: ITL is the gap between stream events, and an event of a speculative
# server carries every token its step accepted (~2.5), so at one stream its ITL reads slower than
# the baseline's while each token comes sooner (the simulated pair, crossover profile, one stream of
# 64 tokens: median ITL 17.1 ms against 10.2, TPOT 5.6 against 10.0). TPOT is what a user waits for
# each token; ITL stays in the tables and the JSON.
COMPARE_PANELS = (
    ("output_tok_s", "output tok/s"),
    ("median_ttft_ms", "median TTFT, ms"),
    ("mean_tpot_ms", "time per output token, ms"),
)


@dataclass(frozen=True)
class Panel:
    """One panel of the comparison plot: what it plots of each target, by concurrency."""

    field: str
    label: str
    # Per target: (concurrency, value) at each level it measured.
    series: dict[str, list[tuple[int, float]]]


def compare_panels(sweeps: Mapping[str, Sequence[LevelStats]]) -> list[Panel]:
    """The data plot_compare draws (pure, so a test reads what is plotted rather than pixels)."""
    return [
        Panel(field, label, {name: [(r.concurrency, getattr(r, field)) for r in rows] for name, rows in sweeps.items()})
        for field, label in COMPARE_PANELS
    ]


def plot_compare(path: str | Path, sweeps: Mapping[str, Sequence[LevelStats]], crossover: Crossover) -> None:
    """Throughput, TTFT and time per output token against concurrency for each target, the
    crossover marked."""
    plt = pyplot()
    style = {"speculative": ("tab:orange", "--"), "baseline": ("tab:blue", "--"), "specgate": ("tab:green", "-")}
    others = iter(("tab:purple", "tab:brown", "tab:pink", "tab:olive", "tab:cyan", "tab:gray"))
    for name in sweeps:
        style.setdefault(name, (next(others, "tab:gray"), "-."))
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.8), constrained_layout=True)
    for ax, panel in zip(axes, compare_panels(sweeps), strict=True):
        for name, points in panel.series.items():
            color, ls = style.get(name, ("tab:gray", "-"))
            ax.plot(
                [c for c, _ in points],
                [v for _, v in points],
                ls,
                marker="o",
                color=color,
                label=name,
                linewidth=2.5 if name == "specgate" else 1.5,
            )
        # Inconclusive levels get an open ring: drawn, but not to be read as a finding.
        shaky = [r for rows in sweeps.values() for r in rows if not r.conclusive]
        if shaky:
            ax.plot([r.concurrency for r in shaky], [getattr(r, panel.field) for r in shaky], "o", markersize=12,
                    markerfacecolor="none", color="tab:red", label="inconclusive level")  # fmt: skip
        if crossover.verdict == "crosses" and crossover.at is not None:
            ax.axvline(crossover.at, color="tab:red", linestyle=":", label=f"crossover ~{crossover.at:.0f}")
        ax.set_xscale("log")
        levels = sorted({r.concurrency for rows in sweeps.values() for r in rows})
        ax.set_xticks(levels, [str(c) for c in levels])
        ax.minorticks_off()
        ax.set_xlabel("concurrent streams")
        ax.set_ylabel(panel.label)
        ax.grid(True, which="both", alpha=0.3)
    axes[0].legend()
    fig.suptitle("specgate against each server alone")
    fig.savefig(path, dpi=110)
    plt.close(fig)
