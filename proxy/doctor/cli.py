"""`specgate doctor`: read the configured servers, say what is right, what is wrong and what to set.

The servers are the gateway's own settings (SPECGATE_SPECULATIVE_URL, SPECGATE_BASELINE_URL,
SPECGATE_UPSTREAM_API_KEY, SPECGATE_ENGINE, SPECGATE_LOAD_SIGNAL, SPECGATE_TOPOLOGY,
SPECGATE_CALIBRATION, ...), read as the gateway reads them; the flags override them. Exit status:
0 when nothing blocks, 1 when something does, 2 for bad arguments or settings.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from collections.abc import Sequence
from typing import Any

from pydantic import ValidationError

from ..config import Settings, describe_error, redact_url
from ..fleet.topology import entries
from ..policy.base import Role
from . import judge, probe, report
from .recommend import Setup, recommend

EXIT_OK, EXIT_BLOCKED, EXIT_USAGE = 0, 1, 2
DEFAULT_TIMEOUT_S = 30.0


def _positive(raw: str) -> float:
    try:
        value = float(raw)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{raw!r} is not a number") from None
    if not 0 < value <= 3600:
        raise argparse.ArgumentTypeError(f"{raw} must be a number of seconds in (0, 3600]")
    return value


def build_parser(prog: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=prog,
        description="Check the servers specgate would route to: reachable, engine, model, context and KV "
        "pool, whether each speculates (one short probe request each), the load signal; then the topology "
        "and policy to run and the settings to paste. Reads the gateway's SPECGATE_* settings; flags "
        "override them.",
        epilog="Exit status: 0 nothing blocks, 1 something blocks, 2 bad arguments or settings.",
    )
    p.add_argument("--speculative", metavar="URL[,URL]", help="the speculative server(s) (SPECGATE_SPECULATIVE_URL)")
    p.add_argument("--baseline", metavar="URL[,URL]", help="the baseline server(s) (SPECGATE_BASELINE_URL)")
    p.add_argument(
        "--adaptive",
        metavar="URL[,URL]",
        help="servers that draft adaptively in the engine (SPECGATE_ADAPTIVE_URL); with them alone, pass "
        "--speculative none --baseline none",
    )
    p.add_argument("--api-key", help="the servers' --api-key (SPECGATE_UPSTREAM_API_KEY); never printed")
    p.add_argument("--engine", choices=("auto", "sglang", "vllm", "llamacpp"), help="SPECGATE_ENGINE")
    p.add_argument("--load-signal", choices=("local", "engine", "max"), help="SPECGATE_LOAD_SIGNAL")
    p.add_argument("--calibration", metavar="FILE", help="a file from `specgate calibrate` (SPECGATE_CALIBRATION)")
    gpus = p.add_mutually_exclusive_group()
    gpus.add_argument(
        "--shared-gpu",
        dest="shared_gpu",
        action="store_const",
        const=True,
        help="each speculative server shares its GPU with the baseline server listed in the same place",
    )
    gpus.add_argument(
        "--separate-gpus", dest="shared_gpu", action="store_const", const=False, help="the servers use different GPUs"
    )
    p.add_argument(
        "--timeout-s",
        type=_positive,
        default=DEFAULT_TIMEOUT_S,
        help=f"each request's limit, the probe's included (default {DEFAULT_TIMEOUT_S:g})",
    )
    p.add_argument("--json", action="store_true", help="a machine-readable report on stdout")
    return p


def settings_from(args: argparse.Namespace) -> Settings:
    """The gateway's settings with the flags over them; ValidationError where one is bad."""
    given: dict[str, Any] = {
        "speculative_url": args.speculative,
        "baseline_url": args.baseline,
        "adaptive_url": args.adaptive,
        "upstream_api_key": args.api_key,
        "engine": args.engine,
        "load_signal": args.load_signal,
        "calibration": args.calibration,
    }
    return Settings(**{k: v for k, v in given.items() if v is not None})


def diagnose(settings: Settings, shared_gpu: bool | None, timeout_s: float) -> report.Diagnosis:
    topology = settings.routing_topology()
    key = settings.upstream_api_key.get_secret_value() if settings.upstream_api_key else None
    observations = asyncio.run(probe.observe_all(topology.servers, key, timeout_s))
    verdicts = [judge.judge_server(o, settings.engine, settings.load_signal) for o in observations]
    calibration = settings.load_calibration()
    raw = {
        Role.SPECULATIVE: settings.speculative_url,
        Role.BASELINE: settings.baseline_url,
        Role.ADAPTIVE: settings.adaptive_url,
    }
    shown = {role: [(name, redact_url(url)) for name, url in entries(raw[role])] for role in raw}
    setup = Setup(
        speculative=shown[Role.SPECULATIVE],
        baseline=shown[Role.BASELINE],
        adaptive=shown[Role.ADAPTIVE],
        shared_gpu=shared_gpu,
        calibration=settings.calibration,
        calibration_has_model=calibration is not None and calibration.model is not None,
        topology_set=settings.topology,
        api_key_set=key is not None,
        credentials_left_out=any(redact_url(s.url) != s.url for s in topology.servers),
    )
    fleet = judge.fleet_findings(verdicts, settings.load_signal)
    return report.Diagnosis(verdicts, fleet, settings.load_signal, recommend(setup))


def main(argv: Sequence[str] | None = None, prog: str = "specgate doctor") -> int:
    parser = build_parser(prog)
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # --help (0) or a bad argument (2), argparse's message already printed
        return int(exc.code or 0)
    try:
        settings = settings_from(args)
    except ValidationError as exc:
        print(f"{prog}: invalid setting: {describe_error(exc)}", file=sys.stderr)
        return EXIT_USAGE
    result = diagnose(settings, args.shared_gpu, args.timeout_s)
    sys.stdout.write(report.as_json(result) if args.json else report.text(result))
    return EXIT_BLOCKED if result.blocks else EXIT_OK
