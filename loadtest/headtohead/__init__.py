"""`python -m loadtest headtohead`: baseline alone, one adaptive EAGLE-3 server and specgate in front
of a shared-GPU pair, each on a simulated H200 of its own, under multi-turn traffic (cli.py describes it).

plan: the settings and the sessions' sizes; run: the processes and the load; score: pure functions of
what a cell recorded; report and plot: what is printed and drawn.
"""

from .cli import add_parser, cmd_headtohead, plan_of, run_headtohead
from .plan import HeadPlan, Sizes, sizes_for
from .score import Cell, TargetCell, best_target, compare, target_cell

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
