"""The sweeping commands' kit (sweep, compare, calibrate, demo): their load options, the plan of a
level and every target swept level by level."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import functools
import sys
from collections.abc import AsyncIterator, Callable, Coroutine, Mapping
from typing import Any, Protocol

import aiohttp
import orjson

from ..args import count, non_negative, non_negative_int, positive
from ..args import levels as _levels
from ..classes import Slo
from ..client import Target
from ..report import level_warnings
from ..stats import DEFAULT_MIN_REQUESTS, LevelStats
from ..sweep import DuringWindow, LevelPlan, TargetUnreachable, first_model, make_session, run_level
from ..textbank import TextBank
from ..workload import WORKLOADS, Workload, WorkloadSpec, parse_class
from .interrupt import measured_of

DEFAULT_LEVELS = "1,2,5,10,30,70,100,250"
# --specgate-headers: auto decides by the workload (sends_headers).
SPECGATE_HEADERS = ("auto", "on", "off")
# --max-duration-s by default: generous, since it is spent only on levels short of good requests
# (the lowest, whose requests take longest), and a level cut short is thrown away.
MAX_DURATION_FACTOR = 10.0
# ... or, by default, this many times the level's longest warm-up request where that is longer: a
# request at long contexts and many streams (queued for the KV pool) can outlast any fixed bound.
MAX_DURATION_REQUESTS = 3.0


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
        f"--min-requests asks for from at least half its streams (default {MAX_DURATION_FACTOR:g} x --duration-s, or "
        f"{MAX_DURATION_REQUESTS:g} x the level's longest warm-up request where that is longer, so that long "
        "contexts at many streams conclude)",
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
    p.add_argument("--seed", type=int, default=0, help="seed of the prompts, the sessions and the classes' draws")
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
    p.add_argument(
        "--specgate-headers",
        choices=SPECGATE_HEADERS,
        default="auto",
        help="send each request's traffic class as x-specgate-class and its session as x-session-id, the "
        "headers specgate routes by (classes, cache affinity; servers ignore them). auto (default): on when the "
        "workload has either to tell, --workload multiturn (conversations) or --class; off for one-turn requests "
        "of one class, whose every request would be a session and a class 'all' of its own, which no real "
        "client sends",
    )
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.add_argument("--out", default=None, help="write every figure and the settings as JSON here")
    add_workload_options(p)


def add_workload_options(p: argparse.ArgumentParser) -> None:
    """Production traffic (docs/loadtest.md): the workload, its traffic classes and the SLOs of goodput."""
    d = WorkloadSpec()
    g = p.add_argument_group("production traffic")
    g.add_argument(
        "--workload",
        choices=WORKLOADS,
        default="single",
        help="single: one-turn requests of --prompts (default); multiturn: sessions of --turns chat turns over a "
        "shared system prompt, each turn resending the whole conversation; longctx: one-turn requests of lengths "
        "drawn around --prompt-tokens-mean",
    )
    g.add_argument(
        "--system-tokens",
        type=non_negative_int,
        default=d.system_tokens,
        help=f"multiturn: the system prompt every session shares (default {d.system_tokens}; 0: none)",
    )
    g.add_argument("--turns", type=count, default=d.turns, help=f"multiturn: turns a session (default {d.turns})")
    g.add_argument(
        "--user-tokens",
        type=count,
        default=d.user_tokens,
        help=f"multiturn: mean tokens of a user message, spread +-30%% (default {d.user_tokens})",
    )
    g.add_argument(
        "--think-time-s",
        type=non_negative,
        default=d.think_time_s,
        help=f"multiturn: mean wait between a reply and the next turn, exponential, at most 5 x the mean, "
        f"divided by --time-scale where the command has one (default {d.think_time_s:g})",
    )
    g.add_argument(
        "--stagger-s",
        type=non_negative,
        default=d.stagger_s,
        help="multiturn and longctx: each stream's first request waits a draw uniform in [0, this), so the "
        "streams do not open their conversations in step; divided by --time-scale where the command has one "
        f"(default {d.stagger_s:g}: all at once)",
    )
    g.add_argument(
        "--prompt-tokens-mean",
        type=count,
        default=d.prompt_tokens_mean,
        help=f"longctx: mean prompt length (default {d.prompt_tokens_mean})",
    )
    g.add_argument(
        "--prompt-tokens-spread",
        type=non_negative,
        default=d.prompt_tokens_spread,
        help=f"longctx: coefficient of variation of the lognormal lengths (default {d.prompt_tokens_spread:g})",
    )
    g.add_argument(
        "--prompt-tokens-max",
        type=count,
        default=d.prompt_tokens_max,
        help=f"longctx: longest prompt, lengths clamped to [16, it] (default {d.prompt_tokens_max}; keep "
        "it under the model's context less --max-tokens)",
    )
    g.add_argument(
        "--class",
        dest="classes",
        type=parse_class,
        action="append",
        default=[],
        metavar="NAME:SHARE:KIND",
        help="a traffic class (repeatable; shares sum to 1), KIND diverse, repetitive or mixed (not single), "
        "e.g. --class chat:0.7:diverse --class code:0.3:repetitive: each session (or request) is drawn into "
        "one; reported per class (default: one class, all)",
    )
    g.add_argument("--slo-ttft-ms", type=positive, default=None, help="goodput: a request's TTFT at most this")
    g.add_argument("--slo-tpot-ms", type=positive, default=None, help="goodput: a request's TPOT at most this")


def workload_spec(args: argparse.Namespace) -> WorkloadSpec:
    """The workload the flags ask for, or ValueError naming the flag. Think time is divided by the
    command's --time-scale, if it has one (demo: the simulators run that much faster)."""
    return WorkloadSpec(
        kind=args.workload,
        classes=tuple(args.classes),
        seed=args.seed,
        prompts=args.prompts or "diverse",
        system_tokens=args.system_tokens,
        turns=args.turns,
        user_tokens=args.user_tokens,
        think_time_s=args.think_time_s / getattr(args, "time_scale", 1.0),
        stagger_s=args.stagger_s / getattr(args, "time_scale", 1.0),
        prompt_tokens_mean=args.prompt_tokens_mean,
        prompt_tokens_spread=args.prompt_tokens_spread,
        prompt_tokens_max=args.prompt_tokens_max,
    )


def sends_headers(args: argparse.Namespace) -> bool:
    """Whether requests carry x-specgate-class and x-session-id (--specgate-headers). auto: when the
    workload has sessions of several turns or classes of its own, what a client that knows them
    would send (docs/routing.md); a single-turn workload of one class has neither, and naming each
    request a session and class "all" would have specgate learn a class and remember conversations
    that untagged traffic does not have."""
    if args.specgate_headers != "auto":
        return bool(args.specgate_headers == "on")
    return bool(args.workload == "multiturn" or args.classes)


def slo_of(args: argparse.Namespace) -> Slo:
    return Slo(args.slo_ttft_ms, args.slo_tpot_ms)


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
        max_duration_per_request=MAX_DURATION_REQUESTS if args.max_duration_s is None else 0.0,
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
        tag_requests=sends_headers(args),
    )


# Per target: runs beside each of its levels' measurement window, given the level and the window's end.
LevelSampler = Callable[[int, asyncio.Event], Coroutine[Any, Any, None]]


async def sweep_targets(
    urls: Mapping[str, str], args: argparse.Namespace, samplers: Mapping[str, LevelSampler] | None = None
) -> dict[str, list[LevelStats]]:
    """Every target at each level in turn (levels outer), so machine drift hits all of them alike."""
    out: dict[str, list[LevelStats]] = {name: [] for name in urls}
    async with level_runner(urls, args, samplers) as measure:
        for c in args.concurrency:
            for name, stats in (await measure(c)).items():
                out[name].append(stats)
    return out


# Measures every target at one level, back to back; the window doubled `tries` times (a level
# measured again, as calibrate's search does with one it could not conclude).
class MeasureLevel(Protocol):
    async def __call__(self, c: int, tries: int = 0) -> dict[str, LevelStats]: ...


@contextlib.asynccontextmanager
async def level_runner(
    urls: Mapping[str, str], args: argparse.Namespace, samplers: Mapping[str, LevelSampler] | None = None
) -> AsyncIterator[MeasureLevel]:
    """`measure(c, tries=0)`: every target at `c` streams in turn, each from the same workload start."""
    targets = {}
    for name, url in urls.items():
        try:
            targets[name] = await _target(url, args)
        except TargetUnreachable as exc:
            raise TargetUnreachable(f"{name}: {exc}") from None
    spec = workload_spec(args)
    bank = TextBank(spec.seed) if spec.kind != "single" else None
    plan = _plan(args)
    if plan.extends and args.min_requests > 0:
        k = plan.max_duration_per_request
        by_request = f", or {k:g} x its longest warm-up request where longer," if k else ""
        print(
            f"each level measures {plan.duration_s:g} s, extended up to {plan.max_duration_s:g} s (--max-duration-s)"
            f"{by_request} until it has {args.min_requests} good requests (--min-requests) from at least half its "
            "streams",
            file=sys.stderr,
            flush=True,
        )
    # Each level kept, as it completes, where the command can print it if interrupted (kit/interrupt.py).
    measured = measured_of(args)
    kept = measured.begin(targets) if measured is not None else None
    async with make_session() as session:

        async def measure(c: int, tries: int = 0) -> dict[str, LevelStats]:
            out = {}
            for name, target in targets.items():
                sampler = (samplers or {}).get(name)
                beside = None if sampler is None else functools.partial(sampler, c)
                workload = Workload(spec, bank)  # each level and target from the same start
                out[name] = await _one_level(session, name, target, c, doubled(plan, tries), args, workload, beside)
                if kept is not None:
                    kept[name].append(out[name])
            return out

        yield measure


def doubled(plan: LevelPlan, times: int) -> LevelPlan:
    """The plan with its window (and its bound, or its requests) doubled `times` times."""
    if times <= 0:
        return plan
    k = 2**times
    return dataclasses.replace(
        plan,
        duration_s=None if plan.duration_s is None else plan.duration_s * k,
        max_duration_s=None if plan.max_duration_s is None else plan.max_duration_s * k,
        requests=None if plan.requests is None else plan.requests * k,
    )


async def _one_level(
    session: aiohttp.ClientSession,
    name: str,
    target: Target,
    c: int,
    plan: LevelPlan,
    args: argparse.Namespace,
    workload: Workload,
    beside: DuringWindow | None,
) -> LevelStats:
    """One target at one level, a progress bar while it runs and its summary line after."""
    from tqdm import tqdm

    bar = tqdm(desc=f"{name:>11} c={c:<4}", unit="req", file=sys.stderr, leave=False, disable=args.quiet or None)

    def progress(phase: str, done: int, errors: int, client_errors: int) -> None:
        bar.set_postfix_str(f"{phase}, {errors} errors, {client_errors} client errors", refresh=False)
        bar.update(done - bar.n)

    slo = slo_of(args)
    try:
        stats, _ = await run_level(session, target, c, plan, workload, progress, args.min_requests, beside, slo)
    finally:
        bar.close()  # interrupted too: the interrupted report is not printed after a half-drawn bar
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
    """The command's settings for its JSON: every argument but the API key, and whether the
    requests carried specgate's headers (--specgate-headers auto resolved)."""
    settings = {k: v for k, v in vars(args).items() if k not in ("api_key", "measured")}
    if "specgate_headers" in settings:
        settings["sent_specgate_headers"] = sends_headers(args)
    return settings


def default_prompts(args: argparse.Namespace, real: bool = False) -> None:
    """--prompts left out: short prompts for the real CPU pair, diverse ones otherwise. --prompts
    with a generated workload or with --class is refused, and left unset (null in --out): those
    choose the prompts themselves."""
    chosen_elsewhere = args.workload != "single" or bool(args.classes)
    if args.prompts is not None and chosen_elsewhere:
        raise ValueError(
            "--prompts applies to --workload single without --class: the classes' KIND (and the "
            "workload) choose the prompts otherwise"
        )
    workload_spec(args)  # a bad combination fails here, before any server is asked for its model
    if args.prompts is None and not chosen_elsewhere:
        args.prompts = "short" if real else "diverse"
