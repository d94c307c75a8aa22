"""`python -m loadtest scaleout`: several groups of servers behind several specgate replicas (cli.py
describes it).

plan: the settings; run: the processes, the load and the samples; measures and drift: pure functions
of the samples; score: each level's figures; report and plot: what is printed and drawn.
"""

from .cli import add_parser, cmd_scaleout, plan_of, run_scaleout
from .drift import (
    Drift,
    Round,
    drift_of,
    error_summary,
    group_spreads,
    replica_rounds,
    spread,
    view_errors,
)
from .measures import (
    group_loads,
    group_shares,
    imbalance,
    instant_deviation,
    mean_inflight,
    split_deviation,
    switches_between,
    vs_better,
)
from .plan import ScaleoutPlan, Server, Watermarks, describe, gate_env
from .report import drift_lines
from .run import ConfigRun, GateSample, ServerSample, gate_sample, server_sample
from .score import ConfigLevel, LevelReport, even_throughput, profile_throughput

__all__ = [
    "ConfigLevel",
    "ConfigRun",
    "Drift",
    "GateSample",
    "LevelReport",
    "Round",
    "ScaleoutPlan",
    "Server",
    "ServerSample",
    "Watermarks",
    "add_parser",
    "cmd_scaleout",
    "describe",
    "drift_lines",
    "drift_of",
    "error_summary",
    "even_throughput",
    "gate_env",
    "gate_sample",
    "group_loads",
    "group_shares",
    "group_spreads",
    "imbalance",
    "instant_deviation",
    "mean_inflight",
    "plan_of",
    "profile_throughput",
    "replica_rounds",
    "run_scaleout",
    "server_sample",
    "split_deviation",
    "spread",
    "switches_between",
    "view_errors",
    "vs_better",
]
