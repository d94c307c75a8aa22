"""headtohead's run: per cell, the three targets started fresh on simulated GPUs of their own (then
measured side by side: kit.cells); per accept length and context, a fresh pair calibrated first for
specgate's watermarks."""

from __future__ import annotations

import functools
from pathlib import Path

from ..kit.cells import Servers
from ..kit.command import say
from ..kit.multiturn import calibration_flags, context_label
from ..kit.processes import Fleet, calibrate_fresh_pair, calibrate_options
from ..kit.settings import specgate_env
from ..procs import free_port
from .plan import CALIBRATE_WINDOW_S, HeadPlan


def calibration_dir(out_dir: Path, accept: float, context: int) -> Path:
    return out_dir / f"calibration-a{accept:g}-{context_label(context)}"


def calibrate(plan: HeadPlan, accept: float, context: int, out_dir: Path, quiet: bool) -> Path:
    """Calibrate a fresh shared-GPU pair with this cell group's sessions, sent without think time so
    the levels are requests in flight, which is what specgate's watermarks count."""
    where = calibration_dir(out_dir, accept, context)
    where.mkdir(parents=True, exist_ok=True)
    s = plan.sizes(context)
    t = plan.calibration_scale(context)
    extra = [*calibrate_options(plan.seed, plan.max_tokens, plan.min_requests), *calibration_flags(s)]

    def pair(spec_port: int, base_port: int) -> list[str]:
        return plan.pair_args(accept, t, spec_port, base_port)

    say(f"accept {accept:g}, {context_label(context)} context (calibration at time scale {t:g}):", quiet)
    levels = plan.calibration_levels
    return calibrate_fresh_pair(pair, levels, extra, CALIBRATE_WINDOW_S / t, where, quiet, prompts=None)


def start_servers(plan: HeadPlan, accept: float, sessions: int, context: int, calibration: Path) -> Servers:
    """Baseline and adaptive alone, each a simulator process of its own (its own GPU), and the
    shared-GPU pair with a specgate in front of it configured from the calibration."""
    t = plan.time_scale(sessions, context)
    with (fleet := Fleet()).stopped_on_error():
        ports = {name: free_port() for name in ("baseline", "adaptive")}
        url = {name: f"http://127.0.0.1:{port}" for name, port in ports.items()}
        for role in ("baseline", "adaptive"):
            fleet.start(f"simulators-{role}", plan.server_args(role, ports[role], accept, t), [url[role] + "/health"])
        spec, base = fleet.start_pair("simulators-pair", functools.partial(plan.pair_args, accept, t))
        fleet.ready()
        env = functools.partial(
            specgate_env,
            speculative=spec,
            baseline=base,
            time_scale=t,
            policy="threshold",
            calibration=str(calibration),
        )
        gate = fleet.start_specgate("specgate", env)
        fleet.ready()
    return Servers(
        urls={"baseline": url["baseline"], "adaptive": url["adaptive"], "specgate": gate},
        servers={
            "baseline": {"baseline": url["baseline"]},
            "adaptive": {"adaptive": url["adaptive"]},
            "specgate": {"speculative": spec, "baseline": base},
        },
        fleet=fleet,
    )
