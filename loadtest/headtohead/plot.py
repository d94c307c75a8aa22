"""headtohead's plot: per accept length x context, goodput (solid, left) and output tok/s (dashed,
right) of the three targets against sessions; inconclusive points hollow."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ..kit.multiturn import context_label
from ..kit.plots import pyplot
from .plan import HeadPlan
from .score import Cell

COLOURS = {"baseline": "tab:blue", "adaptive": "tab:green", "specgate": "tab:red"}


def _series(ax: Any, cells: Sequence[Cell], name: str, attr: str, ls: str, label: str) -> None:
    xs = [c.sessions for c in cells]
    ys = [getattr(c.targets[name], attr) for c in cells]
    ax.plot(xs, ys, ls, color=COLOURS[name], lw=1.6, label=label)
    for c, y in zip(cells, ys, strict=True):
        filled = c.targets[name].conclusive
        ax.plot([c.sessions], [y], "o", color=COLOURS[name], mfc=COLOURS[name] if filled else "white", ms=5)


def plot_headtohead(path: str | Path, plan: HeadPlan, cells: Sequence[Cell]) -> None:
    plt = pyplot()
    rows, cols = len(plan.accept_lengths), len(plan.contexts)
    fig, axes = plt.subplots(rows, cols, figsize=(7.5 * cols, 4.6 * rows), squeeze=False, constrained_layout=True)
    for i, accept in enumerate(plan.accept_lengths):
        for j, context in enumerate(plan.contexts):
            ax = axes[i][j]
            mine = sorted((c for c in cells if c.accept == accept and c.context == context), key=lambda c: c.sessions)
            right = ax.twinx()
            for name in COLOURS:
                if mine:
                    _series(ax, mine, name, "goodput_req_s", "-", f"{name} goodput")
                    _series(right, mine, name, "output_tok_s", "--", f"{name} tok/s")
            ax.set_xscale("log", base=2)
            ax.set_xlabel("concurrent sessions")
            ax.set_ylabel("goodput (req/s, solid)")
            right.set_ylabel("output tok/s (dashed)")
            ax.set_ylim(bottom=0)
            right.set_ylim(bottom=0)
            ax.grid(True, alpha=0.3)
            ax.set_title(f"accept {accept:g}, {context_label(context)} context")
            if i == 0 and j == 0:
                h1, l1 = ax.get_legend_handles_labels()
                h2, l2 = right.get_legend_handles_labels()
                ax.legend(h1 + h2, l1 + l2, fontsize=7, loc="upper left")
    fig.suptitle(
        f"head to head on one simulated H200 ({plan.profile}): baseline alone, adaptive EAGLE-3, specgate + "
        f"shared-GPU pair (goodput: TTFT <= {plan.slo_ttft_ms:g} ms, TPOT <= {plan.slo_tpot_ms:g} ms; hollow: "
        "inconclusive)",
        fontsize=10,
    )
    fig.savefig(path, dpi=100)
    plt.close(fig)
