"""`python -m loadtest.poison`: can one client steer the adaptive policy's mode for everyone?

A simulated pair (crossover profile, acceptance from each prompt: repetitive prompts accept ~4
tokens a step, varied ones ~1) is calibrated with diverse prompts, then specgate runs the adaptive
policy with shadow probes (probe wait, maximum and dwell at --probe-s) at a load where the baseline
is right. Honest clients (no API key, --streams of them, diverse prompts, --max-tokens) run through
three phases of --phase-s each, side by side in one run:

- quiet: the honest clients alone;
- attack N: beside them, one client with its own API key sends `"the cat sat on the mat and "*40`
  every --attack-every-s with max_tokens N (each of --attack-tokens, default 1 and 16).

Reported per phase: the share of the honest clients' requests that specgate sent to the
speculative server, the mode switches, the shadow probes sent and the acceptance and watermarks
/routing showed at the end; and each attack phase's share minus the quiet phase's, in points.
A request the client itself failed to send is not counted (client errors are never specgate's).
Nothing is concluded from a phase with fewer than --min-requests honest requests.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

from proxy.fleet import promtext

from .kit.processes import calibrate_fresh_pair, calibrate_options
from .kit.settings import specgate_env
from .procs import Proc, free_port, pair_args, start
from .prompts import source

POISON = "the cat sat on the mat and " * 40
# specgate's counters read at each phase's ends (summed over their labels).
COUNTERS = ("specgate_mode_switches_total", "specgate_shadow_probes_total")


@dataclass
class Phase:
    name: str
    honest: int = 0
    honest_speculative: int = 0
    client_errors: int = 0
    # Answered with another status than 200: not served, so not in the share either.
    failed: int = 0
    statuses: dict[str, int] = field(default_factory=dict)
    attacks: int = 0
    switches: float = 0.0
    shadows: float = 0.0
    accept_live: float | None = None
    watermarks: dict[str, int] = field(default_factory=dict)

    @property
    def share(self) -> float:
        return self.honest_speculative / self.honest if self.honest else float("nan")


async def _snapshot(session: aiohttp.ClientSession, url: str) -> tuple[float, float, dict[str, Any]]:
    async with session.get(url + "/metrics") as r:
        text = await r.text()
    async with session.get(url + "/routing") as r:
        routing = await r.json()
    values = promtext.totals(text, COUNTERS)
    return values.get(COUNTERS[0], 0.0), values.get(COUNTERS[1], 0.0), routing


async def _phase(url: str, model: str, args: argparse.Namespace, name: str, attack_tokens: int | None) -> Phase:
    phase = Phase(name)
    prompts = source("diverse", args.seed)
    end = time.monotonic() + args.phase_s
    timeout = aiohttp.ClientTimeout(total=120)
    async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0)) as session:
        switches0, shadows0, _ = await _snapshot(session, url)

        async def honest() -> None:
            while time.monotonic() < end:
                body = {"model": model, **next(prompts).body(True), "max_tokens": args.max_tokens, "stream": False}
                try:
                    async with session.post(url + "/v1/chat/completions", json=body) as r:
                        await r.read()
                        backend = r.headers.get("x-specgate-backend")
                        status = r.status
                except (aiohttp.ClientError, TimeoutError):
                    phase.client_errors += 1
                    await asyncio.sleep(0.05)
                    continue
                if status != 200:
                    phase.failed += 1
                    phase.statuses[str(status)] = phase.statuses.get(str(status), 0) + 1
                    await asyncio.sleep(0.05)
                    continue
                phase.honest += 1
                phase.honest_speculative += backend == "speculative"

        async def attacker(tokens: int) -> None:
            headers = {"Authorization": "Bearer attacker-key"}
            body = {"model": model, "messages": [{"role": "user", "content": POISON}], "max_tokens": tokens}
            while time.monotonic() < end:
                t0 = time.monotonic()
                try:
                    async with session.post(url + "/v1/chat/completions", json=body, headers=headers) as r:
                        await r.read()
                    phase.attacks += 1
                except (aiohttp.ClientError, TimeoutError):
                    pass
                await asyncio.sleep(max(0.0, args.attack_every_s - (time.monotonic() - t0)))

        tasks = [honest() for _ in range(args.streams)]
        if attack_tokens is not None:
            tasks.append(attacker(attack_tokens))
        await asyncio.gather(*tasks)
        switches1, shadows1, routing = await _snapshot(session, url)
    phase.switches, phase.shadows = switches1 - switches0, shadows1 - shadows0
    adaptive = routing.get("adaptive") or {}
    phase.accept_live = adaptive.get("accept_length_live")
    phase.watermarks = routing.get("watermarks", {})
    return phase


def _pair(args: argparse.Namespace, spec_port: int, base_port: int) -> list[str]:
    flags = ("--profile", "crossover", "--accept-from-prompt", "--time-scale", str(args.time_scale))
    return pair_args(spec_port, base_port, *flags)


def run(args: argparse.Namespace) -> dict[str, Any]:
    out_dir = Path(args.out_dir or tempfile.mkdtemp(prefix="specgate-poison-"))
    out_dir.mkdir(parents=True, exist_ok=True)
    print(f"calibrating a fresh pair (output in {out_dir})...", file=sys.stderr, flush=True)
    cal = calibrate_fresh_pair(
        lambda s, b: _pair(args, s, b),
        [1, 5, 10, 30, 70],
        calibrate_options(args.seed, args.max_tokens),
        3.0,
        out_dir,
        quiet=True,
    )
    spec_port, base_port, port = free_port(), free_port(), free_port()
    procs: list[Proc] = []
    try:
        procs.append(start("pair", _pair(args, spec_port, base_port), ready_url=f"http://127.0.0.1:{base_port}/health"))
        spec, base = f"http://127.0.0.1:{spec_port}", f"http://127.0.0.1:{base_port}"
        probe = args.probe_s
        env = specgate_env(port, spec, base, policy="adaptive", calibration=cal, adaptive_probe_s=probe,
                           adaptive_probe_max_s=probe, adaptive_min_dwell_s=probe, health_interval_s=0.5)  # fmt: skip
        url = f"http://127.0.0.1:{port}"
        procs.append(start("specgate", ["-m", "proxy"], ready_url=url + "/ready", env=env))
        phases: list[Phase] = []
        plan: list[tuple[str, int | None]] = [("quiet", None)]
        plan += [(f"attack max_tokens={n}", n) for n in args.attack_tokens]
        for name, tokens in plan:
            print(f"phase {name} ({args.phase_s:g} s)...", file=sys.stderr, flush=True)
            phases.append(asyncio.run(_phase(url, "m", args, name, tokens)))
    finally:
        for p in reversed(procs):
            p.stop()
    quiet = phases[0]
    report = {
        "settings": {k: v for k, v in vars(args).items()},
        "phases": [{**asdict(p), "share": p.share} for p in phases],
        "shift_points": {p.name: 100 * (p.share - quiet.share) for p in phases[1:]},
    }
    (out_dir / "poison.json").write_text(json.dumps(report, indent=2) + "\n")
    return report


def format_report(report: dict[str, Any], min_requests: int) -> str:
    head = (
        f"{'phase':<22} {'honest':>7} {'to spec':>8} {'share':>7} {'switches':>8} {'shadows':>7} {'accept':>7} "
        f"{'high/low':>9}"
    )
    lines = [head, "-" * len(head)]
    for p in report["phases"]:
        acc = "-" if p["accept_live"] is None else f"{p['accept_live']:.2f}"
        wm = p["watermarks"]
        lines.append(
            f"{p['name']:<22} {p['honest']:>7} {p['honest_speculative']:>8} {p['share']:>7.1%} {p['switches']:>8.0f} "
            f"{p['shadows']:>7.0f} {acc:>7} {wm.get('high', '-')!s:>4}/{wm.get('low', '-')!s:<4}"
        )
    quiet = report["phases"][0]
    for p in report["phases"][1:]:
        if min(quiet["honest"], p["honest"]) < min_requests:
            lines.append(f"{p['name']}: unknown (fewer than {min_requests} honest requests in a phase)")
            continue
        shift = report["shift_points"][p["name"]]
        verdict = "yes" if abs(shift) < 10 else "NO"
        lines.append(f"{p['name']}: honest share on speculative moved {shift:+.1f} points (< 10: {verdict})")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m loadtest.poison", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("--streams", type=int, default=30, help="honest clients (default 30: the baseline is right)")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--phase-s", type=float, default=60.0)
    p.add_argument("--probe-s", type=float, default=3.0, help="probe wait, maximum and dwell (default 3)")
    p.add_argument("--attack-every-s", type=float, default=0.3)
    p.add_argument("--attack-tokens", type=lambda v: [int(x) for x in v.split(",")], default=[1, 16])
    p.add_argument("--time-scale", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--min-requests", type=int, default=50)
    p.add_argument("--out-dir", default=None)
    args = p.parse_args(argv)
    report = run(args)
    print(format_report(report, args.min_requests))
    return 0


if __name__ == "__main__":
    sys.exit(main())
