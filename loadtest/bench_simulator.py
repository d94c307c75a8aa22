"""How much load one simulator process sustains while staying true to its profile.

    python -m loadtest.bench_simulator [--concurrency 250,500,1000] [--time-scales 10,20,40,80]

For each concurrency and time scale it starts one simulator pinned to one core, runs closed-loop
streaming load from this process (pinned to another core when there is one), and compares the
measured output tok/s with the profile's figure times the time scale. A point passes when the
ratio is within --tolerance. The client's own CPU use is printed beside it: a client at 100% of
its core means the point measured the client, not the simulator.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import resource
import sys
import time
from dataclasses import asdict, dataclass

from .procs import pinned_simulator
from .simulator.probe import closed_loop
from .simulator.profile import load_profile


@dataclass
class Point:
    role: str
    concurrency: int
    time_scale: float
    expected_tok_s: float
    measured_tok_s: float
    ratio: float
    simulator_cpu: float
    client_cpu: float
    ok: bool


def _client_cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def measure(
    role: str, profile: str, concurrency: int, time_scale: float, tolerance: float, warmup_s: float, measure_s: float
) -> Point:
    extra = ("--profile", profile, "--time-scale", str(time_scale), "--max-running-requests", str(concurrency))
    with pinned_simulator(role, *extra) as (proc, url):
        cpu0, client0, t0 = proc.cpu_seconds(), _client_cpu(), time.monotonic()
        result = asyncio.run(closed_loop(url, concurrency, warmup_s=warmup_s, measure_s=measure_s))
        wall = time.monotonic() - t0
        sim_cpu = (proc.cpu_seconds() - cpu0) / wall
        client_cpu = (_client_cpu() - client0) / wall
    expected = load_profile(profile).throughput(role, concurrency) * time_scale  # type: ignore[arg-type]
    ratio = result.tok_s / expected
    return Point(
        role,
        concurrency,
        time_scale,
        expected,
        result.tok_s,
        ratio,
        sim_cpu,
        client_cpu,
        abs(ratio - 1) <= tolerance and result.errors == 0,
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m loadtest.bench_simulator",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--role",
        choices=("baseline", "speculative"),
        default="baseline",
        help="baseline is the harder case: one token per chunk",
    )
    p.add_argument("--profile", default="seed-parallel")
    p.add_argument("--concurrency", default="250,500,1000")
    p.add_argument("--time-scales", default="10,20,40,80")
    p.add_argument("--tolerance", type=float, default=0.05)
    p.add_argument("--warmup-s", type=float, default=1.5)
    p.add_argument("--measure-s", type=float, default=4.0)
    p.add_argument("--out", default=None, help="write the points as JSON here")
    args = p.parse_args(argv)
    points: list[Point] = []
    print(f"{'conc':>5} {'scale':>6} {'expected':>9} {'measured':>9} {'ratio':>6} {'sim cpu':>8} {'client cpu':>10}")
    for c in (int(x) for x in args.concurrency.split(",")):
        for scale in (float(x) for x in args.time_scales.split(",")):
            pt = measure(args.role, args.profile, c, scale, args.tolerance, args.warmup_s, args.measure_s)
            points.append(pt)
            print(
                f"{c:>5} {scale:>6g} {pt.expected_tok_s:>9.0f} {pt.measured_tok_s:>9.0f} {pt.ratio:>6.3f} "
                f"{pt.simulator_cpu:>7.0%} {pt.client_cpu:>10.0%} {'ok' if pt.ok else 'OFF'}",
                flush=True,
            )
            if not pt.ok:
                break  # larger time scales at this concurrency would only be further off
    passing = [pt for pt in points if pt.ok]
    if passing:
        best = max(passing, key=lambda pt: pt.expected_tok_s)
        print(
            f"\nlargest load within {args.tolerance:.0%}: {best.concurrency} streams at time scale "
            f"{best.time_scale:g} ({best.measured_tok_s:.0f} tok/s, simulator at {best.simulator_cpu:.0%} "
            f"of one core)"
        )
    if args.out:
        with open(args.out, "w") as f:
            json.dump([asdict(pt) for pt in points], f, indent=2)
    return 0 if passing else 1


if __name__ == "__main__":
    sys.exit(main())
