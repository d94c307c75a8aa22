"""`specgate serve|doctor|calibrate|sweep|compare|demo`: one command for what a user runs.

Each subcommand hands its arguments to the module that owns it (`python -m proxy`, `python -m
proxy.doctor`, `python -m loadtest ...` keep working and take the same arguments), so this module
holds no option of its own beyond `serve`'s and none is defined twice.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from importlib.metadata import PackageNotFoundError, version

PROG = "specgate"


def _serve(argv: Sequence[str]) -> int:
    from proxy import __main__ as gateway
    from proxy.config import Settings

    parser = argparse.ArgumentParser(
        prog=f"{PROG} serve",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Serve the gateway on SPECGATE_HOST:SPECGATE_PORT (as `python -m proxy`). Every setting is an "
        "environment variable, read from the environment and then from --env-file (docs/settings.md says what "
        "each is for):\n\n" + _settings_table(Settings),
    )
    parser.add_argument(
        "--env-file",
        default=".env",
        metavar="FILE",
        help="read SPECGATE_* settings from this file too; the environment wins over it (default .env, where present)",
    )
    args = parser.parse_args(argv)
    return gateway.main(env_file=args.env_file)


def _settings_table(settings: type) -> str:
    """One line per setting with its default, from the settings class itself: no second copy."""
    from proxy.config import DEPRECATED as deprecated

    fields = settings.model_fields  # type: ignore[attr-defined]
    width = max(len(name) for name in fields) + len("SPECGATE_") + 2
    lines = []
    for name, field in fields.items():
        default = field.default
        shown = (
            "unset" if default in (None, (), "") else ",".join(default) if isinstance(default, tuple) else str(default)
        )
        lines.append(f"  {'SPECGATE_' + name.upper():<{width}}{shown}{'  (deprecated)' if name in deprecated else ''}")
    return "\n".join(lines)


def _doctor(argv: Sequence[str]) -> int:
    from proxy.doctor import cli as doctor

    return doctor.main(argv, prog=f"{PROG} doctor")


def _loadtest(command: str) -> Callable[[Sequence[str]], int]:
    def run(argv: Sequence[str]) -> int:
        from loadtest import __main__ as loadtest

        loadtest.stop_on_sigterm()
        return loadtest.main([command, *argv], prog=PROG)

    return run


# name: (what it does, the function given the rest of the arguments); the order is that of --help.
COMMANDS: dict[str, tuple[str, Callable[[Sequence[str]], int]]] = {
    "serve": ("run the gateway (SPECGATE_* settings; python -m proxy)", _serve),
    "doctor": ("check the configured servers and print the settings to use", _doctor),
    "calibrate": ("find where speculation stops paying and write a calibration file", _loadtest("calibrate")),
    "sweep": ("measure one server or gateway at each load level", _loadtest("sweep")),
    "compare": ("measure several servers or gateways side by side", _loadtest("compare")),
    "demo": ("simulated servers, a calibration and specgate against both, with plots", _loadtest("demo")),
}


def _version() -> str:
    try:
        return version("specgate")
    except PackageNotFoundError:  # a checkout run without installing it
        return "unknown (not installed)"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=PROG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="An OpenAI-compatible gateway that decides per request whether speculative decoding pays.",
        epilog="commands:\n"
        + "\n".join(f"  {name:<10} {text}" for name, (text, _) in COMMANDS.items())
        + f"\n\n`{PROG} COMMAND --help` gives each command's options.",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    parser.add_argument("command", choices=COMMANDS, metavar="COMMAND", help="one of the commands below")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    # The command is the first word; what follows is its own (its --help included), so only the
    # words up to it are parsed here.
    head = argv[:1] if argv and not argv[0].startswith("-") else argv
    args = build_parser().parse_args(head)
    return COMMANDS[args.command][1](argv[1:])
