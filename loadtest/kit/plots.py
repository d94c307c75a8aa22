"""matplotlib for the load tester's plots, and the pieces its timelines share."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

MODE_COLOURS = {"speculative": "tab:orange", "baseline": "tab:blue"}


def pyplot() -> Any:
    """matplotlib.pyplot on the file-only backend (no display on a server)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:  # pragma: no cover - a dependency of the loadtest extra
        raise SystemExit("plotting needs matplotlib: pip install 'specgate[loadtest]'") from exc
    return plt


def mode_strip(ax: Any, modes: Sequence[tuple[float, str]], y0: float, height: float, last_s: float) -> None:
    """The mode as a strip along the axes (orange speculative, blue baseline): each (t, mode) holds
    until the next; the last for `last_s`."""
    for i, (t, mode) in enumerate(modes):
        t1 = modes[i + 1][0] if i + 1 < len(modes) else t + last_s
        ax.axvspan(t, t1, ymin=y0, ymax=y0 + height, color=MODE_COLOURS.get(mode, "k"), lw=0)


def mark_windows(ax: Any, windows: Iterable[tuple[float, float]]) -> None:
    """Each window's start as a line and its unscored part (start, scored_from) in grey."""
    for start, scored_from in windows:
        ax.axvline(start, color="k", lw=0.8)
        ax.axvspan(start, scored_from, color="0.92", zorder=0)


def seconds_label(time_scale: float) -> str:
    return "seconds" + (f" (time scale {time_scale:g})" if time_scale != 1 else "")
