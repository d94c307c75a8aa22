"""`python -m loadtest calibrate`: measure both servers at the levels the search picks (measure.py),
find where speculation stops paying, recommend watermarks and, with --save, write the calibration
specgate loads (SPECGATE_CALIBRATION)."""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import orjson

from proxy.policy.calibration import ModelFit, parse, to_json

from ..acceptance import AcceptanceMeter, redact
from ..args import sorted_ints
from ..kit.interrupt import comparison, reported_if_interrupted
from ..kit.sweeps import add_load_options, default_prompts, max_duration, settings_of, sweep_targets
from ..report import calibration_text, compare_table, write_json
from ..stats import LevelStats
from ..sweep import first_model
from . import (
    EXIT_NO_RECOMMENDATION,
    ContextSweep,
    Recommendation,
    calibrate,
    calibration_file,
    class_acceptance,
    class_env_lines,
    model_fit,
)
from .measure import estimate, measure_levels
from .search import SEARCHES


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("calibrate", help="find where speculation stops paying; recommend watermarks")
    p.add_argument("--speculative", required=True, metavar="URL")
    p.add_argument("--baseline", required=True, metavar="URL")
    add_load_options(p)
    p.add_argument(
        "--search",
        choices=SEARCHES,
        default="bisect",
        help="which levels of --concurrency (the grid) to measure. bisect (default): start at the grid's middle "
        "level, step up the grid 1, 2, 4... levels while speculation is ahead (down while behind), then bisect "
        "between the highest level ahead and the lowest behind, and stop when they are adjacent levels of the grid "
        "(the crossover within one level), speculation is behind at the lowest level or ahead at the highest; "
        "an inconclusive level is never evidence: its neighbours are tried, then it is measured again with its "
        "window doubled, and a bracket across it is no bracket. full: every level of the grid",
    )
    p.add_argument(
        "--save",
        default=None,
        metavar="FILE",
        help="write the calibration specgate loads (SPECGATE_CALIBRATION): both servers' curves, the acceptance "
        "length the speculative server's /metrics reported, the settings and the recommendation",
    )
    p.add_argument(
        "--prompt-tokens",
        type=_lengths,
        default=_lengths(DEFAULT_PROMPT_TOKENS),
        metavar="LIST",
        help="with --save: after the sweep, sweep both servers again at each of these prompt lengths (tokens, "
        "comma list; 'none': no more sweeps) and fit the speed model SPECGATE_POLICY=model uses to the sweeps' "
        f"levels, the first sweep at its measured mean prompt included (default {DEFAULT_PROMPT_TOKENS})",
    )


# A long context beside the main sweep's (diverse prompts: a few hundred tokens on average).
DEFAULT_PROMPT_TOKENS = "4096"


def _lengths(raw: str) -> list[int]:
    if raw.strip().lower() == "none":
        return []
    too_small = "prompt lengths must be integers of at least 16 tokens"
    return sorted_ints(raw, 16, too_small, "a comma list of integers, or none")


def cmd_calibrate(args: argparse.Namespace, clock: Callable[[], float] = time.monotonic) -> int:
    default_prompts(args)
    print(estimate(args), file=sys.stderr, flush=True)
    started = clock()
    # Ctrl-C: the levels measured so far, as the comparison table (kit/interrupt.py).
    with reported_if_interrupted(args, comparison):
        code = asyncio.run(_calibrate(args))
    print(f"calibrate took {_took(clock() - started)}", flush=True)
    return code


def _took(seconds: float) -> str:
    return f"{seconds:.1f} s" if seconds < 120 else f"{seconds / 60:.1f} min ({seconds:.0f} s)"


async def _sweep(
    args: argparse.Namespace, urls: Mapping[str, str]
) -> tuple[dict[str, list[LevelStats]], AcceptanceMeter | None, dict[str, str]]:
    """Both servers swept; with --save, the speculative server's acceptance read beside its levels."""
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
        return await measure_levels(urls, args, samplers), meter, models
    finally:
        if meter is not None:
            await meter.close()


async def _calibrate(args: argparse.Namespace) -> int:
    urls = {"speculative": args.speculative, "baseline": args.baseline}
    sweeps, meter, models = await _sweep(args, urls)
    tp, lat, rec = calibrate(sweeps["speculative"], sweeps["baseline"])
    print(compare_table(sweeps) + "\n")
    env = class_env_lines(rec, args.save) if args.classes else None
    print(calibration_text(tp, lat, rec, env))
    if args.out:
        write_json(
            args.out, {"settings": settings_of(args), "sweeps": sweeps, "crossover": [tp, lat], "recommendation": rec}
        )
    if not rec.made:
        if args.save:
            print(f"loadtest: {args.save} not written: no recommendation to save", file=sys.stderr)
        return EXIT_NO_RECOMMENDATION
    if meter is not None:
        model = await _model_sweeps(args, urls, sweeps, meter)
        if meter.engine is not None:
            meter.finish()
            if meter.reason:
                _not_measured(meter.reason)
        return _save(args.save, sweeps, rec, meter, _calibration_settings(args, models, meter), model)
    return 0


async def _model_sweeps(
    args: argparse.Namespace,
    urls: Mapping[str, str],
    sweeps: Mapping[str, Sequence[LevelStats]],
    meter: AcceptanceMeter,
) -> ModelFit | None:
    """Both servers swept again at each --prompt-tokens length (one-turn requests of exactly that
    many tokens), and the speed model fitted to those and the first sweep; None (said why) when
    there is none."""
    found = [ContextSweep(sweeps["speculative"], sweeps["baseline"], dict(meter.by_level))]
    extra = AcceptanceMeter(args.speculative, args.api_key)  # the first one's session is closed
    await extra.open()
    try:
        for tokens in args.prompt_tokens:
            print(f"speed model: sweeping both servers at {tokens} prompt tokens", file=sys.stderr, flush=True)
            more = argparse.Namespace(**vars(args))
            more.workload, more.classes, more.prompts = "longctx", [], None
            more.prompt_tokens_mean, more.prompt_tokens_spread = tokens, 0.0
            more.prompt_tokens_max = max(tokens, args.prompt_tokens_max)
            more.concurrency = [r.concurrency for r in sweeps["speculative"]]  # the levels the search measured
            extra.by_level = {}
            samplers = {"speculative": extra.during_window} if extra.engine else None
            swept = await sweep_targets(urls, more, samplers)
            found.append(ContextSweep(swept["speculative"], swept["baseline"], dict(extra.by_level)))
    finally:
        await extra.close()
    model, why = model_fit(found, args.max_tokens)
    if model is None:
        print(f"speed model not saved: {why}", file=sys.stderr, flush=True)
        return None
    for role in ("speculative", "baseline"):
        f = model.of(role)
        print(
            f"speed model, {role}: step = {f.a * 1000:.3f} ms + {f.b * 1e6:.3f} us/stream + {f.c * 1e9:.3f} ns/token "
            f"({f.points} points at {', '.join(map(str, model.prompt_tokens))} prompt tokens; residuals rms "
            f"{f.rms_rel:.1%}, max {f.max_rel:.1%})"
        )
    return model


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
        "workload": args.workload,
        "classes": [f"{c.name}:{c.share:g}:{c.kind}" for c in args.classes],
        "seed": args.seed,
        "max_tokens": args.max_tokens,
        "ignore_eos": not args.no_ignore_eos,
        "extra_body": args.extra_body or {},
        "levels": list(args.concurrency),
        "search": args.search,
        "duration_s": None if args.requests else args.duration_s,
        "max_duration_s": max_duration(args),
        "requests": args.requests,
        "warmup_s": args.warmup_s,
        "min_requests": args.min_requests,
        "acceptance": meter.source,
        "prompt_tokens": list(args.prompt_tokens),
    }


def _save(
    path: str,
    sweeps: Mapping[str, Sequence[LevelStats]],
    rec: Recommendation,
    meter: AcceptanceMeter,
    settings: Mapping[str, Any],
    model: ModelFit | None = None,
) -> int:
    created = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    try:
        per_event = meter.engine is not None and meter.engine.stream_steps
        classes = class_acceptance(sweeps["speculative"], per_event)
        cal = calibration_file(
            sweeps["speculative"], sweeps["baseline"], rec, meter.by_level, settings, created, model, classes
        )
    except ValueError as exc:
        print(f"loadtest: {path} not written: {exc}", file=sys.stderr)
        return 1
    data = to_json(cal)
    parse(data)  # what specgate will accept, or a bug here
    tmp = f"{path}.tmp"
    Path(tmp).write_bytes(orjson.dumps(data, option=orjson.OPT_INDENT_2) + b"\n")
    os.replace(tmp, path)
    accept = "not measured" if cal.accept_length is None else f"{cal.accept_length:.2f}"
    accept += "".join(f"; class {n} {a:.2f}" for n, a in cal.classes.items())
    print(f"\ncalibration saved: {path} (levels {', '.join(map(str, cal.levels))}; acceptance length {accept})")
    print(
        f"use it: SPECGATE_CALIBRATION={path} (with SPECGATE_POLICY=threshold it applies the recommended "
        "watermarks; with SPECGATE_POLICY=adaptive the curves; with SPECGATE_POLICY=model the speed model too)"
    )
    return 0
