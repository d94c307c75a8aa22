"""The quick-calibration benchmark's scoring and its command line (no run)."""

from __future__ import annotations

import pytest

from loadtest.__main__ import build_parser, main
from loadtest.experiments.quickcal import CELLS, Run, grid_cell, lines, score


def test_a_watermarks_cell_counts_the_grid_levels_at_or_below_it() -> None:
    assert [grid_cell(h) for h in (0, 1, 4, 5, 17, 30, 249, 250)] == [0, 1, 2, 3, 4, 5, 7, 8]


def run(search: str, high: int | None, wall_s: float) -> Run:
    low = None if high is None else high * 3 // 4
    return Run(search, wall_s, 0 if high is not None else 3, None, high, low, (10, 30))


def test_within_one_level_and_the_target() -> None:
    cell = CELLS[0]
    met = score(cell, run("full", 18, 120.0), run("bisect", 9, 30.0))  # cells 4 and 3: adjacent
    assert met["within_one_level"] and met["time_ratio"] == 0.25 and met["target_met"]
    slow = score(cell, run("full", 18, 120.0), run("bisect", 17, 60.0))
    assert slow["within_one_level"] and not slow["target_met"]
    apart = score(cell, run("full", 18, 120.0), run("bisect", 4, 10.0))  # cells 4 and 2
    assert not apart["within_one_level"] and not apart["target_met"]
    none = score(cell, run("full", 18, 120.0), run("bisect", None, 10.0))  # no recommendation: a miss
    assert not none["within_one_level"]
    text = "\n".join(lines([met, slow]))
    assert "ratio 0.38; target missed" in text and "18/13" in text


def test_the_protocol_is_the_help_and_bad_cells_are_refused(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        build_parser().parse_args(["quickcal", "--help"])
    assert "Target: within one level in every cell" in capsys.readouterr().out
    assert main(["quickcal", "--cells", "nope", "--out-dir", "unused"]) == 2
    assert "--cells: nope" in capsys.readouterr().err
