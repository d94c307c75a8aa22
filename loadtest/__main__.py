"""`python -m loadtest sweep|compare|calibrate|demo`: measure servers and specgate, find the crossover."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import os
import re
import sys
import time
from collections.abc import Callable, Coroutine, Mapping, Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import orjson

from proxy.calibration import parse, to_json

from .acceptance import AcceptanceMeter, redact
from .args import levels as _levels
from .calibrate import (
    EXIT_NO_RECOMMENDATION,
    Crossover,
    Recommendation,
    calibrate,
    calibration_file,
    crossovers,
)
from .client import Target
from .procs import Proc, free_port, start
from .prompts import source
from .report import (
    calibration_text,
    compare_table,
    describe_crossover,
    level_table,
    level_warnings,
    plot_compare,
    write_json,
)
from .scaleout import add_parser as add_scaleout_parser
from .scaleout import cmd_scaleout
from .shift import add_parser as add_shift_parser
from .shift import cmd_shift
from .slowloris import add_parser as add_slowloris_parser
from .slowloris import cmd_slowloris
from .stats import DEFAULT_MIN_REQUESTS, LevelStats
from .sweep import LevelPlan, TargetUnreachable, first_model, make_session, run_level

DEFAULT_LEVELS = "1,2,5,10,30,70,100,250"
# The demo's levels and windows: simulated pair (crossover ~20 streams), and the real CPU pair,
# whose servers have 4 slots each and cross over at a few streams.
DEMO_LEVELS, DEMO_DURATION_S = "1,5,10,30,70", 8.0
REAL_DEMO_LEVELS, REAL_DEMO_DURATION_S, REAL_DEMO_MAX_TOKENS = "1,2,4,6,8", 20.0, 32


RESERVED_NAMES = ("speculative", "baseline", "specgate")
# --max-duration-s by default: generous, since it is spent only on levels short of good requests
# (the lowest, whose requests take longest), and a level cut short is thrown away.
MAX_DURATION_FACTOR = 10.0


def _extra(raw: str) -> tuple[str, str]:
    name, sep, url = raw.partition("=")
    if not sep or not re.fullmatch(r"[A-Za-z0-9_-]+", name):
        raise argparse.ArgumentTypeError(f"{raw!r} is not NAME=URL (NAME of letters, digits, _ and -)")
    if name in RESERVED_NAMES:
        raise argparse.ArgumentTypeError(f"{name!r} names one of the built-in targets; choose another")
    if not url.startswith(("http://", "https://")):
        raise argparse.ArgumentTypeError(f"{raw!r}: the URL must start with http:// or https://")
    return name, url.rstrip("/")


def _json_object(raw: str) -> dict[str, Any]:
    try:
        value = orjson.loads(raw)
    except orjson.JSONDecodeError:
        raise argparse.ArgumentTypeError(f"{raw!r} is not JSON") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"{raw!r} is not a JSON object")
    return value


def _load_options(p: argparse.ArgumentParser, levels: str = DEFAULT_LEVELS) -> None:
    p.add_argument("--concurrency", type=_levels, default=_levels(levels), help=f"levels (default {levels})")
    group = p.add_mutually_exclusive_group()
    group.add_argument("--duration-s", type=float, default=30.0, help="measurement window per level (default 30)")
    group.add_argument("--requests", type=int, default=None, help="or: requests measured per level")
    p.add_argument(
        "--max-duration-s",
        type=float,
        default=None,
        help=f"a level's window runs on past --duration-s, up to this long, until it has the good requests "
        f"--min-requests asks for from at least half its streams (default {MAX_DURATION_FACTOR:g} x --duration-s)",
    )
    p.add_argument(
        "--warmup-s",
        type=float,
        default=0.0,
        help="least warm-up per level (warm-up also lasts until every stream finished one request)",
    )
    p.add_argument("--max-tokens", type=int, default=512)
    p.add_argument("--endpoint", choices=("chat", "completions"), default="chat")
    p.add_argument(
        "--prompts",
        default=None,
        help="diverse (default; --real demo: short), short (diverse at ~20 tokens, for CPU servers), repetitive "
        "(echo and copy tasks that repeat their own text: high acceptance), fixed, or a JSONL file of prompts/messages",
    )
    p.add_argument("--seed", type=int, default=0, help="seed of the diverse prompts")
    p.add_argument("--model", default=None, help="model name (default: the first of the target's /v1/models)")
    p.add_argument("--api-key", default=None)
    p.add_argument(
        "--no-ignore-eos", action="store_true", help="do not send ignore_eos (for servers that reject SGLang's extras)"
    )
    p.add_argument(
        "--min-requests",
        type=int,
        default=DEFAULT_MIN_REQUESTS,
        help=f"good requests a level needs, and at least half its streams, or it is marked inconclusive and "
        f"nothing is concluded from it (default {DEFAULT_MIN_REQUESTS}; 0: no check)",
    )
    p.add_argument(
        "--extra-body",
        type=_json_object,
        default=None,
        metavar="JSON",
        help="fields added to every request body, e.g. '{\"cache_prompt\": false}' (llama-server) or "
        "'{\"top_k\": 1}' (--real demo default: no prompt cache, so no target finds another's prompts cached)",
    )
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.add_argument("--out", default=None, help="write every figure and the settings as JSON here")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m loadtest", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    sweep = sub.add_parser("sweep", help="closed-loop load at each concurrency level against one URL")
    sweep.add_argument("--url", required=True, help="OpenAI-compatible base URL (a server or specgate)")
    _load_options(sweep)
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
    _load_options(compare)
    calibrate = sub.add_parser("calibrate", help="find where speculation stops paying; recommend watermarks")
    calibrate.add_argument("--speculative", required=True, metavar="URL")
    calibrate.add_argument("--baseline", required=True, metavar="URL")
    _load_options(calibrate)
    calibrate.add_argument(
        "--save",
        default=None,
        metavar="FILE",
        help="write the calibration specgate loads (SPECGATE_CALIBRATION): both servers' curves, the acceptance "
        "length the speculative server's /metrics reported, the settings and the recommendation",
    )
    demo = sub.add_parser("demo", help="no GPU needed: simulated pair + specgate, calibrate, compare, plot")
    demo.add_argument("--profile", default="crossover")
    demo.add_argument(
        "--time-scale",
        type=float,
        default=1.0,
        help="1 keeps TTFT real-time, so the proxy's own latency is not magnified",
    )
    demo.add_argument("--out-dir", default="demo-results")
    demo.add_argument(
        "--real",
        action="store_true",
        help="a real llama-server pair on the CPU (Gemma 3 270M; n-gram speculation on one) instead of the "
        "simulators (install: scripts/bootstrap real)",
    )
    demo.add_argument("--slots", type=int, default=4, help="--real: parallel slots of each llama-server")
    _load_options(demo, levels=DEMO_LEVELS)
    # Resolved in main(): the real pair needs other levels and longer windows than the simulators.
    demo.set_defaults(concurrency=None, duration_s=None, max_tokens=None)
    chaos = sub.add_parser("chaos", help="soak specgate and simulators while servers die, stall and fail")
    chaos.add_argument("--phase-s", type=float, default=20.0, help="length of each of the six phases")
    chaos.add_argument("--concurrency", type=int, default=12)
    chaos.add_argument("--time-scale", type=float, default=20.0)
    chaos.add_argument("--seed", type=int, default=0)
    chaos.add_argument("--memory-requests", type=int, default=500, help="N of the N vs 10 N memory check")
    chaos.add_argument("--out", default=None, help="write the report as JSON here")
    overhead = sub.add_parser("overhead", help="specgate's own cost per hop, beside nginx and direct")
    overhead.add_argument("--reps", type=int, default=3)
    overhead.add_argument("--no-nginx", action="store_true")
    overhead.add_argument("--peers-venv", default=None,
                          help="a venv with litellm[proxy] and sglang-router (scripts/install-peers); "
                               "default: .venv-peers beside this venv, when it exists")  # fmt: skip
    overhead.add_argument("--no-peers", action="store_true", help="measure neither LiteLLM nor sglang-router")
    overhead.add_argument("--only", action="append", default=None, metavar="TEXT",
                          help="run only the scenarios whose name contains TEXT (repeatable)")  # fmt: skip
    overhead.add_argument("--out", default=None, help="write every sample as JSON here")
    add_shift_parser(sub)
    add_scaleout_parser(sub)
    add_slowloris_parser(sub)
    return parser


def cmd_overhead(args: argparse.Namespace) -> int:
    from .overhead import SCENARIOS, default_peers_venv, format_results, run_overhead

    peers = None if args.no_peers else (Path(args.peers_venv) if args.peers_venv else default_peers_venv())
    scenarios = tuple(sc for sc in SCENARIOS if not args.only or any(t in sc.name for t in args.only))
    if not scenarios:
        print(f"loadtest: no scenario matches {args.only}; there are: {', '.join(sc.name for sc in SCENARIOS)}",
              file=sys.stderr)  # fmt: skip
        return 2
    results = run_overhead(args.reps, nginx=not args.no_nginx, peers_venv=peers, scenarios=scenarios)
    print(format_results(results))
    if args.out:
        write_json(args.out, {"settings": vars(args), "results": results})
    return 0


def cmd_chaos(args: argparse.Namespace) -> int:
    from .chaos import format_report, run_chaos

    report = asyncio.run(run_chaos(args.phase_s, args.concurrency, args.time_scale, args.seed,
                                   args.memory_requests))  # fmt: skip
    print(format_report(report))
    if args.out:
        write_json(args.out, {"settings": vars(args), "report": report.to_dict(), "ok": report.ok})
    return 0 if report.ok else 1


def _max_duration(args: argparse.Namespace) -> float | None:
    """The longest a level's window may run (None with --requests, which sets its own end)."""
    if args.requests:
        return None
    if args.max_duration_s is None:
        return float(args.duration_s) * MAX_DURATION_FACTOR
    if args.max_duration_s < args.duration_s:
        raise ValueError(f"--max-duration-s {args.max_duration_s:g} is shorter than --duration-s {args.duration_s:g}")
    return float(args.max_duration_s)


def _plan(args: argparse.Namespace) -> LevelPlan:
    return LevelPlan(
        duration_s=None if args.requests else args.duration_s,
        requests=args.requests,
        warmup_s=args.warmup_s,
        max_duration_s=_max_duration(args),
    )


async def _target(url: str, args: argparse.Namespace) -> Target:
    model = args.model or await first_model(url, args.api_key)
    return Target(
        url,
        model,
        chat=args.endpoint == "chat",
        api_key=args.api_key,
        max_tokens=args.max_tokens,
        ignore_eos=not args.no_ignore_eos,
        extra_body=args.extra_body or {},
    )


# Per target: runs beside each of its levels' measurement window, given the level and the window's end.
LevelSampler = Callable[[int, asyncio.Event], Coroutine[Any, Any, None]]


async def sweep_targets(
    urls: Mapping[str, str], args: argparse.Namespace, samplers: Mapping[str, LevelSampler] | None = None
) -> dict[str, list[LevelStats]]:
    """Every target at each level in turn (levels outer), so machine drift hits all of them alike."""
    targets = {}
    for name, url in urls.items():
        try:
            targets[name] = await _target(url, args)
        except TargetUnreachable as exc:
            raise TargetUnreachable(f"{name}: {exc}") from None
    plan = _plan(args)
    if plan.extends and args.min_requests > 0:
        print(
            f"each level measures {plan.duration_s:g} s, extended up to {plan.max_duration_s:g} s (--max-duration-s) "
            f"until it has {args.min_requests} good requests (--min-requests) from at least half its streams",
            file=sys.stderr,
            flush=True,
        )
    out: dict[str, list[LevelStats]] = {name: [] for name in targets}
    from tqdm import tqdm

    async with make_session() as session:
        for c in args.concurrency:
            for name, target in targets.items():
                bar = tqdm(
                    desc=f"{name:>11} c={c:<4}", unit="req", file=sys.stderr, leave=False, disable=args.quiet or None
                )

                def progress(phase: str, done: int, errors: int, client_errors: int, bar: Any = bar) -> None:
                    bar.set_postfix_str(f"{phase}, {errors} errors, {client_errors} client errors", refresh=False)
                    bar.update(done - bar.n)

                sampler = (samplers or {}).get(name)
                beside = None if sampler is None else functools.partial(sampler, c)
                stats, _ = await run_level(
                    session, target, c, plan, source(args.prompts, args.seed), progress, args.min_requests, beside
                )
                bar.close()
                out[name].append(stats)
                window = (
                    f", window {stats.duration_s:.1f} s (extended +{stats.extended_s:.1f} s)"
                    if stats.extended_s
                    else ""
                )
                print(
                    f"{name:>11} c={c:<4} {stats.output_tok_s:>10,.1f} tok/s  {stats.completed} ok, "
                    f"{stats.errors} errors, {stats.client_errors} client errors{window}",
                    file=sys.stderr,
                    flush=True,
                )
                for line in level_warnings([stats], name):
                    print(line.lstrip("* "), file=sys.stderr, flush=True)
    return out


def _crossovers(sweeps: Mapping[str, Sequence[LevelStats]]) -> tuple[Crossover, Crossover]:
    return crossovers(sweeps["speculative"], sweeps["baseline"])


def _settings(args: argparse.Namespace) -> dict[str, Any]:
    return {k: v for k, v in vars(args).items() if k != "api_key"}


async def cmd_sweep(args: argparse.Namespace) -> int:
    sweeps = await sweep_targets({"target": args.url}, args)
    print(level_table(f"sweep of {args.url}", sweeps["target"]))
    if args.out:
        write_json(args.out, {"settings": _settings(args), "levels": sweeps["target"]})
    return 0


async def cmd_compare(args: argparse.Namespace) -> int:
    urls = {"speculative": args.speculative, "baseline": args.baseline}
    if args.proxy:
        urls["specgate"] = args.proxy
    for name, url in args.extra:
        if name in urls:
            raise ValueError(f"--extra {name}= given twice")
        urls[name] = url
    sweeps = await sweep_targets(urls, args)
    tp, lat = _crossovers(sweeps)
    for name, rows in sweeps.items():
        print(level_table(name, rows) + "\n")
    print(compare_table(sweeps))
    print(f"\nthroughput (output tok/s):  {describe_crossover(tp)}")
    print(f"per-request latency (TPOT): {describe_crossover(lat)}")
    plot_compare(args.plot, sweeps, tp)
    print(f"\nplot: {args.plot}")
    if args.out:
        write_json(args.out, {"settings": _settings(args), "sweeps": sweeps, "crossover": [tp, lat]})
    return 0


def _recommendation(sweeps: Mapping[str, Sequence[LevelStats]]) -> tuple[Crossover, Crossover, Recommendation]:
    return calibrate(sweeps["speculative"], sweeps["baseline"])


async def cmd_calibrate(args: argparse.Namespace) -> int:
    urls = {"speculative": args.speculative, "baseline": args.baseline}
    meter: AcceptanceMeter | None = None
    models: dict[str, str] = {}
    if args.save:
        if not Path(args.save).parent.is_dir():
            raise ValueError(f"--save {args.save}: no such directory")
        models = {name: args.model or await first_model(url, args.api_key) for name, url in urls.items()}
        meter = AcceptanceMeter(args.speculative, args.api_key)
        await meter.open()
        if meter.reason:
            _not_measured(meter.reason)
    try:
        samplers = {"speculative": meter.during_window} if meter is not None and meter.engine else None
        sweeps = await sweep_targets(urls, args, samplers)
    finally:
        if meter is not None:
            await meter.close()
    tp, lat, rec = _recommendation(sweeps)
    print(compare_table(sweeps) + "\n")
    print(calibration_text(tp, lat, rec))
    if args.out:
        write_json(
            args.out, {"settings": _settings(args), "sweeps": sweeps, "crossover": [tp, lat], "recommendation": rec}
        )
    if not rec.made:
        if args.save:
            print(f"loadtest: {args.save} not written: no recommendation to save", file=sys.stderr)
        return EXIT_NO_RECOMMENDATION
    if meter is not None:
        if meter.engine is not None:
            meter.finish()
            if meter.reason:
                _not_measured(meter.reason)
        return _save(args.save, sweeps, rec, meter, _calibration_settings(args, models, meter))
    return 0


def _not_measured(reason: str) -> None:
    print(f"acceptance length not measured (null in the file): {reason}", file=sys.stderr, flush=True)


def _calibration_settings(
    args: argparse.Namespace, models: Mapping[str, str], meter: AcceptanceMeter
) -> dict[str, Any]:
    """What the sweep was, for the file: no API key, no credentials in URLs."""
    return {
        "speculative": redact(args.speculative),
        "baseline": redact(args.baseline),
        "models": dict(models),
        "endpoint": args.endpoint,
        "prompts": args.prompts,
        "seed": args.seed,
        "max_tokens": args.max_tokens,
        "ignore_eos": not args.no_ignore_eos,
        "extra_body": args.extra_body or {},
        "levels": list(args.concurrency),
        "duration_s": None if args.requests else args.duration_s,
        "max_duration_s": _max_duration(args),
        "requests": args.requests,
        "warmup_s": args.warmup_s,
        "min_requests": args.min_requests,
        "acceptance": meter.source,
    }


def _save(
    path: str,
    sweeps: Mapping[str, Sequence[LevelStats]],
    rec: Recommendation,
    meter: AcceptanceMeter,
    settings: Mapping[str, Any],
) -> int:
    created = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    try:
        cal = calibration_file(sweeps["speculative"], sweeps["baseline"], rec, meter.by_level, settings, created)
    except ValueError as exc:
        print(f"loadtest: {path} not written: {exc}", file=sys.stderr)
        return 1
    data = to_json(cal)
    parse(data)  # what specgate will accept, or a bug here
    tmp = f"{path}.tmp"
    Path(tmp).write_bytes(orjson.dumps(data, option=orjson.OPT_INDENT_2) + b"\n")
    os.replace(tmp, path)
    accept = "not measured" if cal.accept_length is None else f"{cal.accept_length:.2f}"
    print(f"\ncalibration saved: {path} (levels {', '.join(map(str, cal.levels))}; acceptance length {accept})")
    print(
        f"use it: SPECGATE_CALIBRATION={path} (with SPECGATE_POLICY=threshold it applies the recommended "
        "watermarks; with SPECGATE_POLICY=adaptive the curves)"
    )
    return 0


async def cmd_demo(args: argparse.Namespace) -> int:
    out_dir = Path(args.out_dir)
    proxy_port = free_port()
    procs: list[Proc] = []
    t_start = time.monotonic()
    with contextlib.ExitStack() as servers:
        servers.callback(_stop_all, procs)
        urls = _real_pair(servers, args) if args.real else _simulated_pair(procs, args)
        sweeps = await sweep_targets(urls, args)
        tp, lat, rec = _recommendation(sweeps)
        if not rec.made:
            # specgate with watermarks nobody measured would be a demonstration of nothing.
            print(compare_table(sweeps) + "\n")
            print(calibration_text(tp, lat, rec))
            return EXIT_NO_RECOMMENDATION
        env = {
            "SPECGATE_HOST": "127.0.0.1",
            "SPECGATE_PORT": str(proxy_port),
            "SPECGATE_SPECULATIVE_URL": urls["speculative"],
            "SPECGATE_BASELINE_URL": urls["baseline"],
            "SPECGATE_HIGH_WATERMARK": str(rec.high),
            "SPECGATE_LOW_WATERMARK": str(rec.low),
            "SPECGATE_LOG_LEVEL": "warning",
        }
        proxy_url = f"http://127.0.0.1:{proxy_port}"
        procs.append(start("specgate", ["-m", "proxy"], ready_url=proxy_url + "/ready", env=env))
        if args.real:
            # Real servers on shared CPUs drift over minutes more than the simulators do: the table
            # comes from a fresh sweep of all three, level by level, as `compare` runs them.
            print(f"specgate up with HIGH={rec.high} LOW={rec.low}; sweeping all three...", file=sys.stderr)
            sweeps = await sweep_targets({**urls, "specgate": proxy_url}, args)
        else:
            print(f"specgate up with HIGH={rec.high} LOW={rec.low}; sweeping it...", file=sys.stderr)
            sweeps.update(await sweep_targets({"specgate": proxy_url}, args))
    print(calibration_text(tp, lat, rec))
    print(compare_table(sweeps))
    first = {name: rows[0] for name, rows in sweeps.items()}
    spec1, gate1 = first["speculative"], first["specgate"]
    # ITL as a mean: chunks of a speculative server come in bursts (several tokens verified at
    # once, sent as one event each), so most gaps are ~0 and the median jumps between ~0 and a step.
    print(
        f"\nat concurrency {spec1.concurrency}: specgate/speculative TTFT "
        f"{gate1.median_ttft_ms / spec1.median_ttft_ms:.3f} (median over median), "
        f"ITL {gate1.mean_itl_ms / spec1.mean_itl_ms:.3f} (mean over mean)"
    )
    plot = out_dir / "compare.png"
    plot_compare(plot, sweeps, tp)
    write_json(
        out_dir / "demo.json",
        {"settings": _settings(args), "sweeps": sweeps, "crossover": [tp, lat], "recommendation": rec},
    )
    print(f"\nplot: {plot}   data: {out_dir / 'demo.json'}   ({time.monotonic() - t_start:.0f} s)")
    return 0


def _stop_all(procs: list[Proc]) -> None:
    for proc in reversed(procs):
        proc.stop()


def _simulated_pair(procs: list[Proc], args: argparse.Namespace) -> dict[str, str]:
    spec_port, base_port = free_port(), free_port()
    sim_args = [
        "-m",
        "loadtest.simulator",
        "pair",
        "--profile",
        args.profile,
        "--shared-gpu",
        "--time-scale",
        str(args.time_scale),
        "--speculative-port",
        str(spec_port),
        "--baseline-port",
        str(base_port),
        "--log-level",
        "warning",
    ]
    procs.append(start("simulators", sim_args, ready_url=f"http://127.0.0.1:{base_port}/health"))
    print(
        f"simulated pair up ({args.profile} profile, shared GPU, time scale {args.time_scale:g}); calibrating...",
        file=sys.stderr,
    )
    return {"speculative": f"http://127.0.0.1:{spec_port}", "baseline": f"http://127.0.0.1:{base_port}"}


def _real_pair(servers: contextlib.ExitStack, args: argparse.Namespace) -> dict[str, str]:
    from .llamacpp import pair  # needs scripts/bootstrap real

    p = servers.enter_context(pair(slots=args.slots))
    print(
        f"real llama-server pair up (Gemma 3 270M on the CPU, {args.slots} slots each, n-gram speculation on "
        "the speculative one, the cores shared); calibrating...",
        file=sys.stderr,
    )
    return {"speculative": p.speculative.url, "baseline": p.baseline.url}


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "chaos":
        return cmd_chaos(args)
    if args.command == "overhead":
        return cmd_overhead(args)
    if args.command in ("shift", "scaleout"):
        scenario = cmd_shift if args.command == "shift" else cmd_scaleout
        try:
            return scenario(args)
        except ValueError as exc:
            print(f"loadtest: {exc}", file=sys.stderr)
            return 2
        except KeyboardInterrupt:
            return 130
    if args.command == "slowloris":
        return cmd_slowloris(args)
    if getattr(args, "prompts", "") is None:
        args.prompts = "short" if getattr(args, "real", False) else "diverse"
    if args.command == "demo":
        if args.real and args.extra_body is None:
            # The demo sweeps the servers before specgate with the same prompts: with llama-server's
            # prompt cache on, specgate's run would find them cached (measured: half the TTFT, ~5%
            # more throughput at one stream), flattering specgate.
            args.extra_body = {"cache_prompt": False}
        if args.max_tokens is None:
            args.max_tokens = REAL_DEMO_MAX_TOKENS if args.real else 64
        if args.concurrency is None:
            args.concurrency = _levels(REAL_DEMO_LEVELS if args.real else DEMO_LEVELS)
        if args.duration_s is None and args.requests is None:
            args.duration_s = REAL_DEMO_DURATION_S if args.real else DEMO_DURATION_S
        Path(args.out_dir).mkdir(parents=True, exist_ok=True)
    command = {"sweep": cmd_sweep, "compare": cmd_compare, "calibrate": cmd_calibrate, "demo": cmd_demo}
    try:
        return asyncio.run(command[args.command](args))
    except TargetUnreachable as exc:
        print(f"loadtest: {exc}", file=sys.stderr)
        return 2
    except ValueError as exc:
        print(f"loadtest: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
