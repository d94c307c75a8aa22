"""`python -m loadtest headtohead`: baseline alone, one adaptive EAGLE-3 server and specgate in front
of a shared-GPU pair, each on a simulated H200 of its own, under multi-turn traffic (cli.py describes it).

plan: the settings; run: the processes and the calibration; score: pure functions of what a cell
recorded; report and plot: what is printed and drawn. The sessions' sizes (kit.multiturn), a cell's
measuring (kit.cells) and each target's figures (kit.figures) are the kit's.
"""

from ..kit.figures import TargetCell, target_cell
from ..kit.multiturn import Sizes, sizes_for
from .cli import add_parser, cmd_headtohead, plan_of, run_headtohead
from .plan import HeadPlan
from .score import Cell, best_target, compare

__all__ = [
    "Cell",
    "HeadPlan",
    "Sizes",
    "TargetCell",
    "add_parser",
    "best_target",
    "cmd_headtohead",
    "compare",
    "plan_of",
    "run_headtohead",
    "sizes_for",
    "target_cell",
]
