"""`python -m loadtest.simulator [pair] ...`: one simulated SGLang server, or a speculative/baseline pair."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import math
import signal
import sys
from collections.abc import Sequence

from ..args import non_negative, positive
from .profile import Profile, ProfileError, builtin_names, load_profile
from .server import ServerConfig, SimServer
from .state import SharedGpu
from .steptimes import H200_GPU_GIB, StepTimes, load_steptimes, steptime_names

_EPILOG = """\
Durations and rates follow --time-scale: with --time-scale 10 every delay is ten times shorter
and every throughput ten times higher than the profile says.

Acceptance: a speculative decode step takes the time the profile gives at the profile's
acceptance length A (its '# accept_length:' line, else 3), and each request advances by its own
acceptance length that step, so throughput is the profile's times the running requests' mean
acceptance over A. Each request accepts --accept-length (default A), or, with
--accept-from-prompt, 1 + (M - 1) * r, where r in [0, 1] is how repetitive its prompt is (the
share of its word 4-grams seen earlier in it) and M the --max-accept-length.

Step-time profiles (h200-llama8b, h200-llama70b-tp4) follow a table measured on an H200 instead:
a step's time depends on the batch, its mean context and the draft depth (--spec-steps), prompts
are prefilled in chunks (--chunked-prefill-size) that decoding waits behind, requests queue while
the KV pool (--max-total-tokens, else the profile's memory on --gpu-memory-gb) cannot hold them,
and --accept-length is a request's acceptance at --spec-steps draft steps (default 2.5).
--ttft-base-ms and --prefill-tok-s apply to the CSV profiles only.
"""


def _probability(raw: str) -> float:
    value = float(raw)
    if not 0.0 <= value <= 1.0:
        raise argparse.ArgumentTypeError(f"{raw} is not a probability in [0, 1]")
    return value


def _accept_length(raw: str) -> float:
    value = float(raw)
    if not 1 <= value < math.inf:
        raise argparse.ArgumentTypeError(f"{raw} must be >= 1 (an acceptance length counts the bonus token)")
    return value


def _positive_int(raw: str) -> int:
    value = int(raw)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"{raw} must be a positive integer")
    return value


def _common(p: argparse.ArgumentParser) -> None:
    """The options one server and a pair share, in --help's order."""
    for group in (_engine_options, _server_options, _accept_options, _request_options, _surface_options):
        group(p)


def _engine_options(p: argparse.ArgumentParser) -> None:
    """Speed and memory: the profile, the draft depth, prefill chunks, the KV pool, the prefix cache."""
    p.add_argument(
        "--profile",
        default="seed-parallel",
        help=f"throughput curve: {' or '.join(builtin_names())}, or a path to a CSV; or step times measured on "
        f"an H200: {' or '.join(steptime_names())}, or a path to such a .json",
    )
    p.add_argument(
        "--spec-steps",
        type=_positive_int,
        default=3,
        help="EAGLE draft steps (top-k 1) of a step-time profile's speculative role, 1-7; the adaptive role's "
        "acceptance is given at this depth",
    )
    p.add_argument(
        "--chunked-prefill-size",
        type=_positive_int,
        default=8192,
        help="prompt tokens a prefill chunk holds (step-time profiles; SGLang's flag)",
    )
    p.add_argument(
        "--max-total-tokens",
        type=_positive_int,
        default=None,
        help="the KV pool in tokens (SGLang's flag); default: a step-time profile's memory arithmetic on "
        "--gpu-memory-gb, else 2,000,000",
    )
    p.add_argument(
        "--gpu-memory-gb",
        type=positive,
        default=H200_GPU_GIB,
        help=f"the GPU's memory in GiB as nvidia-smi reports it (default {H200_GPU_GIB:g}, an H200), for the "
        "default KV pool of a step-time profile",
    )
    p.add_argument(
        "--enable-cache-report",
        action="store_true",
        help="report usage.prompt_tokens_details.cached_tokens in responses (SGLang's flag)",
    )
    p.add_argument(
        "--disable-radix-cache",
        action="store_true",
        help="no prefix cache: every prompt is prefilled whole (SGLang's flag)",
    )


def _server_options(p: argparse.ArgumentParser) -> None:
    """Where it listens, what it serves, its clock, admission and start-up."""
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--served-model-name", default="default")
    p.add_argument(
        "--model-path",
        default=None,
        help="model_path that /get_server_info reports (default: the served name); routers that load the "
        "model's tokenizer from it, like sglang-router, find a local one there instead of reaching for a hub",
    )
    p.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' as SGLang does")
    p.add_argument("--time-scale", type=positive, default=1.0, help="run everything X times faster")
    p.add_argument(
        "--max-running-requests",
        type=_positive_int,
        default=256,
        help="past this many admitted requests, new ones queue",
    )
    p.add_argument("--warmup-s", type=non_negative, default=0.0, help="/health answers 503 this long after start")
    p.add_argument(
        "--load-s",
        type=non_negative,
        default=0.0,
        help="refuse connections this long before listening (weights loading)",
    )


def _accept_options(p: argparse.ArgumentParser) -> None:
    """What a speculative step accepts: one length, or each prompt's own."""
    accept = p.add_mutually_exclusive_group()
    accept.add_argument(
        "--accept-length",
        type=_accept_length,
        default=None,
        help="tokens every request accepts per speculative step (one chunk); throughput scales by it over the "
        "profile's acceptance (default: the profile's accept_length, else 3, so the profile's speed)",
    )
    accept.add_argument(
        "--accept-from-prompt",
        action="store_true",
        help="each request accepts 1 + (max - 1) * r per step, r in [0, 1] how repetitive its prompt is: "
        "varied prompts near 1, prompts that repeat themselves near --max-accept-length",
    )
    p.add_argument(
        "--max-accept-length",
        type=_accept_length,
        default=None,
        help="acceptance of a perfectly repetitive prompt under --accept-from-prompt (default: the profile's "
        "max_accept_length, else its accept_length + 1)",
    )


def _request_options(p: argparse.ArgumentParser) -> None:
    """Faults injected into requests, and the CSV profiles' prefill and default output length."""
    p.add_argument("--fail-rate", type=_probability, default=0.0, help="share of requests answered 500")
    p.add_argument(
        "--stall-rate",
        type=_probability,
        default=0.0,
        help="share of requests that stop producing mid-way and hang until the client leaves",
    )
    p.add_argument("--ttft-base-ms", type=non_negative, default=20.0, help="fixed part of time to first token")
    p.add_argument("--prefill-tok-s", type=positive, default=50_000.0, help="prompt tokens per second of prefill")
    p.add_argument(
        "--default-max-tokens",
        type=_positive_int,
        default=256,
        help="output length when a request sets none (then it ends with finish_reason=stop)",
    )


def _surface_options(p: argparse.ArgumentParser) -> None:
    """/metrics and /health as SGLang shows them, fixed fields for byte comparisons, logging."""
    p.add_argument(
        "--metrics-prefix",
        choices=("sglang:", "sglang_"),
        default="sglang:",
        help="metric name prefix: 'sglang:' as SGLang's servers export them; 'sglang_' as SGLang's router "
        "(sgl-model-gateway) rewrites them when it aggregates workers' metrics",
    )
    p.add_argument(
        "--live-gauges",
        action="store_true",
        help="refresh gauges on every scrape instead of SGLang's every-40-steps cadence",
    )
    p.add_argument(
        "--busy-health-s",
        type=non_negative,
        default=0.0,
        help="/health takes this long while requests are running (SGLang's runs a generation; a saturated "
        "llama-server answers after its batch), unscaled",
    )
    p.add_argument(
        "--no-metrics",
        action="store_true",
        help="no /metrics (404), as SGLang without --enable-metrics",
    )
    p.add_argument("--created", type=int, default=None, help="fixed 'created' timestamp (for byte comparisons)")
    p.add_argument("--seed", type=int, default=None, help="seed of the fault-injection draws")
    p.add_argument("--log-level", default="info", choices=("debug", "info", "warning", "error"))


def build_parser(pair: bool) -> argparse.ArgumentParser:
    prog = "python -m loadtest.simulator" + (" pair" if pair else "")
    p = argparse.ArgumentParser(prog=prog, description=__doc__, epilog=_EPILOG)
    if pair:
        p.add_argument("--speculative-port", type=int, default=30001)
        p.add_argument("--baseline-port", type=int, default=30002)
        p.add_argument(
            "--shared-gpu",
            action="store_true",
            help="both servers share one compute budget, as when started on the same GPUs (and, on a "
            "step-time profile, the GPU's memory, split as compose.yaml splits it)",
        )
    else:
        p.add_argument(
            "--role",
            choices=("speculative", "baseline", "adaptive"),
            required=True,
            help="adaptive: one EAGLE-3 server choosing its draft steps by batch size and acceptance, as "
            "SGLang's --speculative-adaptive (step-time profiles only)",
        )
        p.add_argument("--port", type=int, default=30000)
    _common(p)
    return p


def configs_from_args(argv: Sequence[str]) -> tuple[list[ServerConfig], bool]:
    pair = bool(argv) and argv[0] == "pair"
    parser = build_parser(pair)
    args = parser.parse_args(argv[1:] if pair else argv)
    try:
        profile = _profile(args.profile)
    except ProfileError as exc:
        parser.error(str(exc))
    _check(parser, args, profile, pair)
    common = dict(
        profile=profile,
        host=args.host,
        served_model_name=args.served_model_name,
        model_path=args.model_path,
        api_key=args.api_key,
        time_scale=args.time_scale,
        max_running_requests=args.max_running_requests,
        warmup_s=args.warmup_s,
        load_s=args.load_s,
        accept_length=args.accept_length,
        accept_from_prompt=args.accept_from_prompt,
        max_accept_length=args.max_accept_length,
        fail_rate=args.fail_rate,
        stall_rate=args.stall_rate,
        ttft_base_ms=args.ttft_base_ms,
        prefill_tok_s=args.prefill_tok_s,
        default_max_tokens=args.default_max_tokens,
        metrics_prefix=args.metrics_prefix,
        live_gauges=args.live_gauges,
        busy_health_s=args.busy_health_s,
        metrics=not args.no_metrics,
        created=args.created,
        seed=args.seed,
        spec_steps=args.spec_steps,
        chunked_prefill_size=args.chunked_prefill_size,
        max_total_tokens=args.max_total_tokens,
        gpu_memory_gb=args.gpu_memory_gb,
        shared_gpu=pair and args.shared_gpu,
        enable_cache_report=args.enable_cache_report,
        disable_radix_cache=args.disable_radix_cache,
    )
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if pair:
        return [
            ServerConfig(role="speculative", port=args.speculative_port, **common),
            ServerConfig(role="baseline", port=args.baseline_port, **common),
        ], args.shared_gpu
    return [ServerConfig(role=args.role, port=args.port, **common)], False


def _profile(name_or_path: str) -> Profile | StepTimes:
    if name_or_path in steptime_names() or name_or_path.endswith(".json"):
        return load_steptimes(name_or_path)
    return load_profile(name_or_path)


def _check(parser: argparse.ArgumentParser, args: argparse.Namespace, profile: Profile | StepTimes, pair: bool) -> None:
    if not isinstance(profile, StepTimes):
        if not pair and args.role == "adaptive":
            parser.error(f"--role adaptive needs a step-time profile ({', '.join(steptime_names())})")
        return
    if not 1 <= args.spec_steps <= 7:
        parser.error("--spec-steps must be 1-7 (the step-time table measured drafts of up to 8 tokens)")
    most = args.spec_steps + 1
    for flag, value in (("--accept-length", args.accept_length), ("--max-accept-length", args.max_accept_length)):
        if value is not None and value > most:
            parser.error(f"{flag} {value:g} is more than {args.spec_steps} draft steps can accept ({most})")
    try:
        for role in ("speculative", "baseline") if pair else (args.role,):
            if args.max_total_tokens is None:
                profile.pool_tokens(args.gpu_memory_gb, role, pair and args.shared_gpu)
    except ProfileError as exc:
        parser.error(str(exc))


async def serve(configs: list[ServerConfig], shared_gpu: bool) -> None:
    gpu = SharedGpu() if shared_gpu else None
    servers = [SimServer(cfg, gpu) for cfg in configs]
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    try:
        await asyncio.gather(*(s.start() for s in servers))
        await stop.wait()
    finally:
        for s in servers:
            await s.stop()


def main(argv: Sequence[str] | None = None) -> int:
    configs, shared_gpu = configs_from_args(list(sys.argv[1:] if argv is None else argv))
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a dependency; plain asyncio still works
        runner = asyncio.run
    else:
        runner = uvloop.run
    try:
        runner(serve(configs, shared_gpu))
    except OSError as exc:
        print(f"simulator: cannot listen: {exc.strerror or exc}", file=sys.stderr)
        return 1
    with contextlib.suppress(Exception):
        sys.stdout.flush()
    return 0
