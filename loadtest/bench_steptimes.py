"""Does the simulator keep the step-time table's time? Per-stream decode step time, measured against
the table's arithmetic, at fixed batch, acceptance and context.

    python -m loadtest.bench_steptimes [--profiles h200-llama8b,h200-llama70b-tp4] [--contexts 1024,4096]
                                       [--batches 1,16,64,256] [--roles baseline,speculative]

For each point one simulator runs at time scale 1, pinned to one core. One request is sent first
and its prompt prefilled (so the others find it in the prefix cache and their prefill is short),
then B - 1 more with the same prompt; once all B decode, two scrapes of its `/metrics` some steps
apart give the mean inter-token latency of that window, which times the tokens a stream advances
a step (1 on the baseline; the acceptance, an integer here, on the speculative role) is the
per-stream step time. The table's arithmetic (`steptimes.py`) at that batch, draft depth and the
window's mean context (prompt plus the mean output so far) is what it should be. The simulator
measures itself, so a slow client cannot make it look late; the client's CPU is printed all the
same. A ratio above 1 at 256 streams is the overrun: steps late because one core could not keep up.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from dataclasses import asdict, dataclass

import aiohttp

from proxy.fleet.promtext import totals

from .procs import pinned_simulator
from .simulator.steptimes import StepTimes, load_steptimes

ACCEPT = 2  # an integer, so every speculative step advances a stream by exactly this many tokens
SPEC_STEPS = 3
WINDOW_STEPS = 60


@dataclass
class Point:
    profile: str
    role: str
    batch: int
    ctx: float
    expected_step_s: float
    measured_step_s: float
    ratio: float
    simulator_cpu: float


def expected_step_s(table: StepTimes, role: str, batch: int, ctx: float) -> float:
    if role == "baseline":
        return table.baseline_step_s(batch, ctx)
    return table.eagle_step_s(batch, SPEC_STEPS, ctx)


async def _metrics(session: aiohttp.ClientSession, url: str) -> dict[str, float]:
    async with session.get(url + "/metrics") as r:
        return totals(await r.text())


async def _stream(session: aiohttp.ClientSession, url: str, body: dict[str, object], first: asyncio.Event) -> None:
    async with session.post(url + "/v1/completions", json=body) as resp:
        async for line in resp.content:
            if line.startswith(b"data: {"):
                first.set()


async def _measure(url: str, table: StepTimes, role: str, batch: int, ctx: int) -> tuple[float, float, float]:
    per_token = 1 if role == "baseline" else ACCEPT
    step = expected_step_s(table, role, batch, ctx)
    window_s = max(0.5, WINDOW_STEPS * step)
    # Output long enough to outlast the start, the settling and the window.
    max_tokens = int((3 * window_s + 2.0) / step * per_token) + 64
    prompt_tokens = max(16, ctx - int(WINDOW_STEPS * per_token))
    body = {"prompt": "abcd" * prompt_tokens, "max_tokens": max_tokens, "stream": True}
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=None)) as session:
        seen = asyncio.Event()
        tasks = [asyncio.create_task(_stream(session, url, body, seen))]
        await asyncio.wait_for(seen.wait(), 60)
        others = [asyncio.Event() for _ in range(batch - 1)]
        tasks += [asyncio.create_task(_stream(session, url, body, ev)) for ev in others]
        await asyncio.wait_for(asyncio.gather(*(ev.wait() for ev in others)), 120)
        await asyncio.sleep(window_s / 2)  # past the last prefill
        m0 = await _metrics(session, url)
        await asyncio.sleep(window_s)
        m1 = await _metrics(session, url)
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    itl = "sglang:inter_token_latency_seconds"
    count = m1[itl + "_count"] - m0[itl + "_count"]
    mean_itl = (m1[itl + "_sum"] - m0[itl + "_sum"]) / count
    gen = "sglang:generation_tokens_total"
    mid_output = (m0[gen] + m1[gen]) / 2 / batch
    mid_ctx = prompt_tokens + mid_output
    return mean_itl * per_token, expected_step_s(table, role, batch, mid_ctx), mid_ctx


def measure(profile: str, role: str, batch: int, ctx: int) -> Point:
    extra = ["--profile", profile, "--max-running-requests", str(max(batch, 1)), "--spec-steps", str(SPEC_STEPS)]
    if role != "baseline":
        extra += ["--accept-length", str(ACCEPT)]
    with pinned_simulator(role, *extra) as (proc, url):
        cpu0, t0 = proc.cpu_seconds(), time.monotonic()
        measured, expected, mid_ctx = asyncio.run(_measure(url, load_steptimes(profile), role, batch, ctx))
        sim_cpu = (proc.cpu_seconds() - cpu0) / (time.monotonic() - t0)
    return Point(profile, role, batch, mid_ctx, expected, measured, measured / expected, sim_cpu)


def _ints(raw: str) -> list[int]:
    return [int(x) for x in raw.split(",") if x]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m loadtest.bench_steptimes",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--profiles", default="h200-llama8b,h200-llama70b-tp4")
    p.add_argument("--contexts", default="1024,4096", help="tokens of context per stream")
    p.add_argument("--batches", default="1,16,64,256")
    p.add_argument("--roles", default="baseline,speculative")
    p.add_argument("--tolerance", type=float, default=0.05)
    p.add_argument("--out", default=None, help="write the points as JSON here")
    args = p.parse_args(argv)
    points: list[Point] = []
    head = f"{'profile':<18} {'role':<11} {'batch':>5} {'ctx':>6} {'table ms':>9} {'sim ms':>8} {'ratio':>6}"
    print(head + f" {'sim cpu':>8}")
    for profile in args.profiles.split(","):
        for ctx in _ints(args.contexts):
            for role in args.roles.split(","):
                for batch in _ints(args.batches):
                    pt = measure(profile, role, batch, ctx)
                    points.append(pt)
                    mark = "ok" if abs(pt.ratio - 1) <= args.tolerance else "OFF"
                    print(
                        f"{profile:<18} {role:<11} {batch:>5} {pt.ctx:>6.0f} {pt.expected_step_s * 1e3:>9.2f} "
                        f"{pt.measured_step_s * 1e3:>8.2f} {pt.ratio:>6.3f} {pt.simulator_cpu:>7.0%} {mark}",
                        flush=True,
                    )
    worst = max(points, key=lambda pt: abs(pt.ratio - 1))
    print(
        f"\nworst: {worst.profile} {worst.role} at {worst.batch} streams, ctx {worst.ctx:.0f}: ratio {worst.ratio:.3f}"
    )
    for pt in points:
        if pt.batch == max(_ints(args.batches)):
            print(f"overrun at {pt.batch} streams, {pt.profile} {pt.role} ctx {pt.ctx:.0f}: {pt.ratio - 1:+.1%}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump([asdict(pt) for pt in points], f, indent=2)
    return 0 if all(abs(pt.ratio - 1) <= args.tolerance for pt in points) else 1


if __name__ == "__main__":
    sys.exit(main())
