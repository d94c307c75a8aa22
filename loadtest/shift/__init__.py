"""`python -m loadtest shift`: the prompt mix changes mid-run at a fixed concurrency (cli.py describes it).

plan: the settings; run: the processes and the load; score: pure functions of what a run recorded;
report and plot: what is printed and drawn.
"""

from .cli import add_parser, cmd_shift, plan_of, run_shift
from .plan import ShiftPlan
from .run import Capture, RoutingSample
from .score import LevelReport, PhaseReport, Tokens, mode_settle_time, settle_time

__all__ = [
    "Capture",
    "LevelReport",
    "PhaseReport",
    "RoutingSample",
    "ShiftPlan",
    "Tokens",
    "add_parser",
    "cmd_shift",
    "mode_settle_time",
    "plan_of",
    "run_shift",
    "settle_time",
]
