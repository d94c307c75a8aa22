"""shift's plot: per level, both specgates' load, watermarks and mode, and the four targets' throughput."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ..kit.plots import mark_windows, mode_strip, pyplot, seconds_label
from .plan import ShiftPlan
from .score import LevelReport

STYLE = {
    "speculative": ("tab:orange", "--", 1.4),
    "baseline": ("tab:blue", "--", 1.4),
    "static": ("tab:gray", "-", 1.8),
    "adaptive": ("tab:green", "-", 2.4),
}


def _routing(ax: Any, plan: ShiftPlan, lv: LevelReport) -> None:
    """Load, watermarks and the mode strip of both specgates; adaptive's crossover estimate."""
    for g in ("static", "adaptive"):
        colour = STYLE[g][0]
        smp = lv.routing[g]
        ts = [s.t for s in smp]
        ax.step(ts, [s.load for s in smp], where="post", color=colour, lw=1.0, alpha=0.7, label=f"{g} load")
        ax.step(ts, [s.high for s in smp], where="post", color=colour, ls="--", lw=1.8, label=f"{g} high")
        ax.step(ts, [s.low for s in smp], where="post", color=colour, ls=":", lw=1.8, label=f"{g} low")
        y0 = 0.955 if g == "adaptive" else 0.915
        mode_strip(ax, [(s.t, s.mode) for s in smp], y0, 0.035, plan.sample_s)
        ax.text(0.002, y0 + 0.005, f"{g} mode", transform=ax.transAxes, fontsize=7, va="bottom")
    cross = [(s.t, s.crossover) for s in lv.routing["adaptive"] if s.crossover is not None]
    if cross:
        ax.plot([t for t, _ in cross], [x for _, x in cross], color="tab:red", ls="-.", lw=1.2,
                label="adaptive crossover estimate")  # fmt: skip
    ax.set_ylabel("streams")
    ax.set_title(f"c={lv.concurrency}: load, watermarks and mode (strips: orange speculative, blue baseline)")


def _throughput(ax: Any, plan: ShiftPlan, lv: LevelReport) -> None:
    for name, points in lv.rolling.items():
        colour, ls, lw = STYLE[name]
        ax.plot([t for t, _ in points], [v for _, v in points], ls, color=colour, lw=lw, label=name)
    for p in lv.phases:
        settle = p.settle_s["adaptive"]
        if settle is not None:
            ax.axvline(p.start_s + settle, color="tab:green", ls=":", lw=1.0)
    ax.set_ylabel(f"output tok/s (trailing {plan.rolling_s:g} s)")
    ax.set_title(f"c={lv.concurrency}: throughput of the four targets (dotted green: adaptive settled)")


def plot_shift(path: str | Path, plan: ShiftPlan, levels: Sequence[LevelReport]) -> None:
    """Per level: load, watermarks, crossover estimate and mode of both specgates; rolling throughput."""
    plt = pyplot()
    rows = len(levels)
    fig, axes = plt.subplots(rows, 2, figsize=(17, 4.8 * rows), squeeze=False, constrained_layout=True)
    for row, lv in zip(axes, levels, strict=True):
        _routing(row[0], plan, lv)
        _throughput(row[1], plan, lv)
        for ax in row:
            mark_windows(ax, ((p.start_s, p.scored_from_s) for p in lv.phases))
            for p in lv.phases:
                ax.text(p.start_s + 0.01 * plan.phase_s, 0.86, p.source, transform=ax.get_xaxis_transform(),
                        fontsize=9)  # fmt: skip
            ax.set_xlabel(seconds_label(plan.time_scale))
            ax.set_xlim(0, plan.duration_s)
            ax.grid(True, alpha=0.3)
            ax.legend(fontsize=7, loc="lower right")
            ax.set_ylim(bottom=0, top=ax.get_ylim()[1] * 1.15)
    fig.suptitle(
        f"shift: {plan.profile} profile, prompts {' -> '.join(plan.phases)}, {plan.phase_s:g} s a phase "
        f"(grey: not scored)"
    )
    fig.savefig(path, dpi=100)
    plt.close(fig)
