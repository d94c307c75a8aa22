"""scaleout's plot: throughput and evenness by level; specgate's load by group (or server) over time."""

from __future__ import annotations

import math
import textwrap
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from ..kit.plots import mark_windows, mode_strip, pyplot, seconds_label
from .measures import trusted_inflight
from .plan import CONFIGS, IMBALANCE_TARGET, RATIO_TARGET, SPLIT_TOLERANCE, ScaleoutPlan, describe
from .run import ConfigRun
from .score import LevelReport

STYLE = {
    "specgate": ("tab:green", "-", 2.4),
    "all-speculative": ("tab:orange", "--", 1.4),
    "all-baseline": ("tab:blue", "--", 1.4),
}


def _throughput(ax: Any, levels: Sequence[LevelReport]) -> None:
    cs = [lv.concurrency for lv in levels]
    for name in CONFIGS:
        colour, ls, lw = STYLE[name]
        ax.plot(cs, [lv.configs[name].tok_s for lv in levels], ls, marker="o", color=colour, lw=lw, label=name)
    shaky = [lv for lv in levels if not lv.conclusive]
    if shaky:
        ax.plot([lv.concurrency for lv in shaky], [lv.configs["specgate"].tok_s for lv in shaky], "o",
                markersize=12, markerfacecolor="none", color="tab:red", label="inconclusive level")  # fmt: skip
    right = ax.twinx()
    right.plot(cs, [lv.vs_better for lv in levels], ":", marker="s", color="k", lw=1.0, label="specgate / better")
    right.axhline(RATIO_TARGET, color="tab:red", lw=0.8, ls=":")
    right.set_ylim(0, 1.2)
    right.set_ylabel("specgate / better")
    ax.set_ylabel("output tok/s (servers' counters)")
    ax.set_title("throughput of the three configurations")
    ax.legend(loc="upper left", fontsize=8)
    right.legend(loc="lower right", fontsize=8)


def _evenness(ax: Any, plan: ScaleoutPlan, levels: Sequence[LevelReport]) -> None:
    cs = [lv.concurrency for lv in levels]
    if plan.topology == "paired":
        for name in CONFIGS:
            colour, ls, lw = STYLE[name]
            ax.plot(cs, [lv.configs[name].split_deviation or math.nan for lv in levels], ls, marker="o",
                    color=colour, lw=lw, label=name)  # fmt: skip
        ax.axhline(SPLIT_TOLERANCE, color="tab:red", ls=":", lw=1.0, label="target")
        ax.set_ylabel("max |group share x groups - 1|")
        ax.set_title("load split between groups (0: even)")
        return
    for name in CONFIGS:
        colour, _, lw = STYLE[name]
        for role, marker, ls in (("speculative", "o", "-"), ("baseline", "^", "--")):
            ys = [lv.configs[name].role_imbalance.get(role) for lv in levels]
            ax.plot(cs, [math.nan if y is None else y for y in ys], ls, marker=marker, color=colour, lw=lw,
                    label=f"{name}: {role}")  # fmt: skip
    ax.axhline(IMBALANCE_TARGET, color="tab:red", ls=":", lw=1.0, label="target")
    ax.set_ylabel("busiest server's mean in-flight / role's mean")
    ax.set_title("in-flight balance within each role (1: even)")


def _timeline(ax: Any, plan: ScaleoutPlan, levels: Sequence[LevelReport], run: ConfigRun) -> None:
    """specgate's in-flight by group (or server), each replica's mode per group as a strip on top."""
    groups = plan.group_names()
    paired = plan.topology == "paired"
    lines: dict[str, list[str]] = (
        {g: [s.name for s in run.servers if s.group == g] for g in groups}
        if paired
        else {s.name: [s.name] for s in run.servers}
    )
    for label, names in lines.items():
        series = [trusted_inflight(run.server_samples[n]) for n in names]
        length = min(len(x) for x in series)
        ts = [series[0][i][0] for i in range(length)]
        ax.plot(ts, [sum(x[i][1] for x in series) for i in range(length)], lw=1.0, label=label)
    strips = [(i, g) for g in groups for i in range(len(run.gate_samples))]
    height = 0.12 / max(1, len(strips))
    for row, (i, g) in enumerate(strips):
        y0 = 0.86 + row * height
        ax.text(1.002, y0, f"{g} r{i}", transform=ax.transAxes, fontsize=6, va="bottom")
        modes = [(x.t, x.modes[g]) for x in run.gate_samples[i] if g in x.modes]
        mode_strip(ax, modes, y0, height * 0.9, plan.sample_s)
    mark_windows(ax, ((lv.start_s, lv.scored_from_s) for lv in levels))
    for lv in levels:
        x = lv.start_s + 0.01 * plan.level_s
        ax.text(x, 0.8, f"{lv.concurrency}", transform=ax.get_xaxis_transform(), fontsize=9)
    ax.set_xlim(0, plan.duration_s)
    ax.set_ylim(bottom=0, top=ax.get_ylim()[1] * 1.3)
    ax.set_xlabel(seconds_label(plan.time_scale))
    ax.set_ylabel("running + queued (servers' gauges)")
    ax.set_title(
        f"specgate configuration: in flight by {'group' if paired else 'server'}; strips at the top: each replica's "
        f"mode per {'group' if paired else 'pool'} (orange speculative, blue baseline); grey: not scored"
    )
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8, loc="upper left")


def plot_scaleout(
    path: str | Path, plan: ScaleoutPlan, levels: Sequence[LevelReport], runs: Mapping[str, ConfigRun]
) -> None:
    """Throughput by level; evenness by level; specgate's load by group (or server) over time, with modes."""
    plt = pyplot()
    fig = plt.figure(figsize=(16, 10), constrained_layout=True)
    grid = fig.add_gridspec(2, 2)
    tput, even, timeline = fig.add_subplot(grid[0, 0]), fig.add_subplot(grid[0, 1]), fig.add_subplot(grid[1, :])
    _throughput(tput, levels)
    _evenness(even, plan, levels)
    cs = [lv.concurrency for lv in levels]
    for ax in (tput, even):
        ax.set_xscale("log")
        ax.set_xticks(cs, [str(c) for c in cs])
        ax.minorticks_off()
        ax.set_xlabel("total streams")
        ax.grid(True, which="both", alpha=0.3)
    even.legend(fontsize=7)
    _timeline(timeline, plan, levels, runs["specgate"])
    fig.suptitle(textwrap.fill(describe(plan), 150))
    fig.savefig(path, dpi=100)
    plt.close(fig)
