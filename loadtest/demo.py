"""`python -m loadtest demo`: no GPU needed. A simulated pair (or, with --real, a llama-server pair
on the CPU) is calibrated, specgate started with the recommended watermarks and swept beside the
servers; the table, the crossover and a plot."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import sys
import time
from pathlib import Path

from .args import levels
from .calibrate import EXIT_NO_RECOMMENDATION, calibrate
from .kit.interrupt import comparison, reported_if_interrupted
from .kit.settings import specgate_env
from .kit.sweeps import add_load_options, default_prompts, settings_of, sweep_targets
from .procs import Proc, free_port, pair_args, start
from .report import calibration_text, compare_table, plot_compare, write_json

# The demo's levels and windows: simulated pair (crossover ~20 streams), and the real CPU pair,
# whose servers have 4 slots each and cross over at a few streams.
DEMO_LEVELS, DEMO_DURATION_S = "1,5,10,30,70", 8.0
REAL_DEMO_LEVELS, REAL_DEMO_DURATION_S, REAL_DEMO_MAX_TOKENS = "1,2,4,6,8", 20.0, 32


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
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
    add_load_options(demo, levels=DEMO_LEVELS)
    # Resolved in cmd_demo(): the real pair needs other levels and longer windows than the simulators.
    demo.set_defaults(concurrency=None, duration_s=None, max_tokens=None)


def _defaults(args: argparse.Namespace) -> None:
    default_prompts(args, real=args.real)
    if args.real and args.extra_body is None:
        # The demo sweeps the servers before specgate with the same prompts: with llama-server's
        # prompt cache on, specgate's run would find them cached (measured: half the TTFT, ~5%
        # more throughput at one stream), flattering specgate.
        args.extra_body = {"cache_prompt": False}
    if args.max_tokens is None:
        args.max_tokens = REAL_DEMO_MAX_TOKENS if args.real else 64
    if args.concurrency is None:
        args.concurrency = levels(REAL_DEMO_LEVELS if args.real else DEMO_LEVELS)
    if args.duration_s is None and args.requests is None:
        args.duration_s = REAL_DEMO_DURATION_S if args.real else DEMO_DURATION_S


def cmd_demo(args: argparse.Namespace) -> int:
    _defaults(args)
    Path(args.out_dir).mkdir(parents=True, exist_ok=True)
    # Ctrl-C: the servers stop as the sweep unwinds (_demo's ExitStack), then the levels measured print.
    with reported_if_interrupted(args, comparison):
        return asyncio.run(_demo(args))


async def _demo(args: argparse.Namespace) -> int:
    out_dir = Path(args.out_dir)
    proxy_port = free_port()
    procs: list[Proc] = []
    t_start = time.monotonic()
    with contextlib.ExitStack() as servers:
        servers.callback(_stop_all, procs)
        urls = _real_pair(servers, args) if args.real else _simulated_pair(procs, args)
        sweeps = await sweep_targets(urls, args)
        tp, lat, rec = calibrate(sweeps["speculative"], sweeps["baseline"])
        if not rec.made:
            # specgate with watermarks nobody measured would be a demonstration of nothing.
            print(compare_table(sweeps) + "\n")
            print(calibration_text(tp, lat, rec))
            return EXIT_NO_RECOMMENDATION
        env = specgate_env(
            proxy_port, urls["speculative"], urls["baseline"], high_watermark=rec.high, low_watermark=rec.low
        )
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
    # Time per output token, not the gap between events (ITL): an event of a speculative server
    # carries every token its step accepted, so ITL is per event, and TPOT what a user waits a token.
    print(
        f"\nat concurrency {spec1.concurrency}: specgate/speculative TTFT "
        f"{gate1.median_ttft_ms / spec1.median_ttft_ms:.3f} (median over median), "
        f"time per output token {gate1.mean_tpot_ms / spec1.mean_tpot_ms:.3f} (mean over mean)"
    )
    plot = out_dir / "compare.png"
    plot_compare(plot, sweeps, tp)
    write_json(
        out_dir / "demo.json",
        {"settings": settings_of(args), "sweeps": sweeps, "crossover": [tp, lat], "recommendation": rec},
    )
    print(f"\nplot: {plot}   data: {out_dir / 'demo.json'}   ({time.monotonic() - t_start:.0f} s)")
    return 0


def _stop_all(procs: list[Proc]) -> None:
    for proc in reversed(procs):
        proc.stop()


def _simulated_pair(procs: list[Proc], args: argparse.Namespace) -> dict[str, str]:
    spec_port, base_port = free_port(), free_port()
    sim_args = pair_args(spec_port, base_port, "--profile", args.profile, "--time-scale", str(args.time_scale))
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
