"""The sweeping commands' kit (sweep, compare, calibrate, demo): their load options, the plan of a
level and every target swept level by level."""

from __future__ import annotations

import argparse
import asyncio
import functools
import sys
from collections.abc import Callable, Coroutine, Mapping
from typing import Any

import aiohttp
import orjson

from ..args import levels as _levels
from ..client import Target
from ..prompts import source
from ..report import level_warnings
from ..stats import DEFAULT_MIN_REQUESTS, LevelStats
from ..sweep import DuringWindow, LevelPlan, TargetUnreachable, first_model, make_session, run_level

DEFAULT_LEVELS = "1,2,5,10,30,70,100,250"
# --max-duration-s by default: generous, since it is spent only on levels short of good requests
# (the lowest, whose requests take longest), and a level cut short is thrown away.
MAX_DURATION_FACTOR = 10.0


def _json_object(raw: str) -> dict[str, Any]:
    try:
        value = orjson.loads(raw)
    except orjson.JSONDecodeError:
        raise argparse.ArgumentTypeError(f"{raw!r} is not JSON") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"{raw!r} is not a JSON object")
    return value


def add_load_options(p: argparse.ArgumentParser, levels: str = DEFAULT_LEVELS) -> None:
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


def max_duration(args: argparse.Namespace) -> float | None:
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
        max_duration_s=max_duration(args),
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
    async with make_session() as session:
        for c in args.concurrency:
            for name, target in targets.items():
                sampler = (samplers or {}).get(name)
                beside = None if sampler is None else functools.partial(sampler, c)
                out[name].append(await _one_level(session, name, target, c, plan, args, beside))
    return out


async def _one_level(
    session: aiohttp.ClientSession,
    name: str,
    target: Target,
    c: int,
    plan: LevelPlan,
    args: argparse.Namespace,
    beside: DuringWindow | None,
) -> LevelStats:
    """One target at one level, a progress bar while it runs and its summary line after."""
    from tqdm import tqdm

    bar = tqdm(desc=f"{name:>11} c={c:<4}", unit="req", file=sys.stderr, leave=False, disable=args.quiet or None)

    def progress(phase: str, done: int, errors: int, client_errors: int) -> None:
        bar.set_postfix_str(f"{phase}, {errors} errors, {client_errors} client errors", refresh=False)
        bar.update(done - bar.n)

    prompts = source(args.prompts, args.seed)
    stats, _ = await run_level(session, target, c, plan, prompts, progress, args.min_requests, beside)
    bar.close()
    window = f", window {stats.duration_s:.1f} s (extended +{stats.extended_s:.1f} s)" if stats.extended_s else ""
    print(
        f"{name:>11} c={c:<4} {stats.output_tok_s:>10,.1f} tok/s  {stats.completed} ok, "
        f"{stats.errors} errors, {stats.client_errors} client errors{window}",
        file=sys.stderr,
        flush=True,
    )
    for line in level_warnings([stats], name):
        print(line.lstrip("* "), file=sys.stderr, flush=True)
    return stats


def settings_of(args: argparse.Namespace) -> dict[str, Any]:
    """The command's settings for its JSON: every argument but the API key."""
    return {k: v for k, v in vars(args).items() if k != "api_key"}


def default_prompts(args: argparse.Namespace, real: bool = False) -> None:
    """--prompts left out: short prompts for the real CPU pair, diverse ones otherwise."""
    if args.prompts is None:
        args.prompts = "short" if real else "diverse"
