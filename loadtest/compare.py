"""`python -m loadtest sweep` (one URL) and `compare` (both servers, specgate and others at the same levels)."""

from __future__ import annotations

import argparse
import asyncio
import re

from .calibrate import crossovers
from .kit.interrupt import reported_if_interrupted, tables_and_comparison
from .kit.sweeps import add_load_options, default_prompts, settings_of, slo_of, sweep_targets
from .report import class_table, compare_table, describe_crossover, level_table, plot_compare, write_json

RESERVED_NAMES = ("speculative", "baseline", "specgate")


def _extra(raw: str) -> tuple[str, str]:
    name, sep, url = raw.partition("=")
    if not sep or not re.fullmatch(r"[A-Za-z0-9_-]+", name):
        raise argparse.ArgumentTypeError(f"{raw!r} is not NAME=URL (NAME of letters, digits, _ and -)")
    if name in RESERVED_NAMES:
        raise argparse.ArgumentTypeError(f"{name!r} names one of the built-in targets; choose another")
    if not url.startswith(("http://", "https://")):
        raise argparse.ArgumentTypeError(f"{raw!r}: the URL must start with http:// or https://")
    return name, url.rstrip("/")


def add_parsers(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    sweep = sub.add_parser("sweep", help="closed-loop load at each concurrency level against one URL")
    sweep.add_argument("--url", required=True, help="OpenAI-compatible base URL (a server or specgate)")
    add_load_options(sweep)
    compare = sub.add_parser("compare", help="sweep both servers and specgate at the same levels")
    for name in ("speculative", "baseline"):
        compare.add_argument(f"--{name}", required=True, metavar="URL")
    compare.add_argument("--proxy", metavar="URL", help="specgate in front of both (left out: the servers only)")
    compare.add_argument(
        "--extra",
        type=_extra,
        action="append",
        default=[],
        metavar="NAME=URL",
        help="another target swept beside the others, tabled against the better server and plotted (repeatable), "
        "e.g. adaptive=http://node:30003 for SGLang's --speculative-adaptive server",
    )
    compare.add_argument("--plot", default="compare.png", help="PNG to write (default compare.png)")
    add_load_options(compare)


def cmd_sweep(args: argparse.Namespace) -> int:
    default_prompts(args)
    with reported_if_interrupted(args, lambda sweep: level_table(f"sweep of {args.url}", sweep["target"])):
        sweeps = asyncio.run(sweep_targets({"target": args.url}, args))
    print(level_table(f"sweep of {args.url}", sweeps["target"]))
    print("\n" + class_table("by traffic class", sweeps["target"], slo_of(args)))
    if args.out:
        write_json(args.out, {"settings": settings_of(args), "levels": sweeps["target"]})
    return 0


def cmd_compare(args: argparse.Namespace) -> int:
    default_prompts(args)
    urls = {"speculative": args.speculative, "baseline": args.baseline}
    if args.proxy:
        urls["specgate"] = args.proxy
    for name, url in args.extra:
        if name in urls:
            raise ValueError(f"--extra {name}= given twice")
        urls[name] = url
    with reported_if_interrupted(args, tables_and_comparison):
        sweeps = asyncio.run(sweep_targets(urls, args))
    tp, lat = crossovers(sweeps["speculative"], sweeps["baseline"])
    for name, rows in sweeps.items():
        print(level_table(name, rows) + "\n")
        print(class_table(f"{name} by traffic class", rows, slo_of(args)) + "\n")
    print(compare_table(sweeps))
    print(f"\nthroughput (output tok/s):  {describe_crossover(tp)}")
    print(f"per-request latency (TPOT): {describe_crossover(lat)}")
    plot_compare(args.plot, sweeps, tp)
    print(f"\nplot: {args.plot}")
    if args.out:
        write_json(args.out, {"settings": settings_of(args), "sweeps": sweeps, "crossover": [tp, lat]})
    return 0
