"""`python -m loadtest sweep|compare|calibrate|demo`: measure servers and specgate, find the crossover."""

from __future__ import annotations

import argparse
import signal
import sys
from collections.abc import Callable, Sequence

from . import chaos, compare, demo, headtohead, overhead, scaleout, shift, slowloris
from .ablation import cli as ablation
from .calibrate import command as calibrate
from .experiments import affinityrule, quickcal
from .experiments.defaultpolicy import cli as defaultpolicy
from .experiments.twoclass import cli as twoclass
from .field import cli as field
from .sweep import TargetUnreachable

# Each command's module defines its subparser and runs it; the order is that of `--help`.
COMMANDS: dict[str, Callable[[argparse.Namespace], int]] = {
    "sweep": compare.cmd_sweep,
    "compare": compare.cmd_compare,
    "calibrate": calibrate.cmd_calibrate,
    "demo": demo.cmd_demo,
    "chaos": chaos.cmd_chaos,
    "overhead": overhead.cmd_overhead,
    "shift": shift.cmd_shift,
    "scaleout": scaleout.cmd_scaleout,
    "slowloris": slowloris.cmd_slowloris,
    "headtohead": headtohead.cmd_headtohead,
    "headtohead-classes": twoclass.cmd_headtohead_classes,
    "headtohead-affinity": affinityrule.cmd_headtohead_affinity,
    "ablation": ablation.cmd_ablation,
    "defaultpolicy": defaultpolicy.cmd_defaultpolicy,
    "quickcal": quickcal.cmd_quickcal,
    "field": field.cmd_field,
}


def build_parser(prog: str = "python -m loadtest") -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=prog, description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    compare.add_parsers(sub)
    for module in (calibrate, demo, chaos, overhead, shift, scaleout, slowloris, headtohead, twoclass, affinityrule):
        module.add_parser(sub)
    ablation.add_parser(sub)
    defaultpolicy.add_parser(sub)
    quickcal.add_parser(sub)
    field.add_parser(sub)
    parser.epilog = (
        "Ctrl-C (exit 130) or SIGTERM (143) stops a command and every process it started; sweep, compare, "
        "calibrate and demo then print the levels they completed."
    )
    return parser


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised where the command is, so that it unwinds as Ctrl-C does."""


def _terminated(signum: int, frame: object) -> None:
    raise Terminated


def stop_on_sigterm() -> None:
    """Make SIGTERM (kill, a CI job's timeout) unwind the command like Ctrl-C: its default ends
    the process at once, and every simulator, specgate and peer a scenario started (each stopped
    in a `finally`) would go on running, holding its ports and CPU."""
    signal.signal(signal.SIGTERM, _terminated)


def main(argv: Sequence[str] | None = None, prog: str = "python -m loadtest") -> int:
    """Run one command; `prog` names the command in its help and usage (the `specgate` command's own)."""
    args = build_parser(prog).parse_args(argv)
    try:
        return COMMANDS[args.command](args)
    except (TargetUnreachable, ValueError) as exc:
        print(f"loadtest: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as exc:
        return 143 if isinstance(exc, Terminated) else 130


if __name__ == "__main__":
    stop_on_sigterm()
    sys.exit(main())
