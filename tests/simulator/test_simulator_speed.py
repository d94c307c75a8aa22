"""The simulator's speed follows its profile, and a shared GPU slows one server when the other works."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator

import pytest

from loadtest.procs import Proc, free_port, start
from loadtest.simulator.probe import ProbeResult, closed_loop
from loadtest.simulator.profile import Role, load_profile

from ..conftest import StartSim

SCALE = 4.0
TOLERANCE = 0.10


def probe(url: str, concurrency: int) -> ProbeResult:
    return asyncio.run(closed_loop(url, concurrency, warmup_s=1.0, measure_s=2.5, max_tokens=4096))


@pytest.mark.parametrize("role", ["speculative", "baseline"])
def test_closed_loop_throughput_follows_profile(simulator: StartSim, role: Role) -> None:
    sim = simulator(role, "--profile", "seed-parallel", "--time-scale", str(SCALE))
    profile = load_profile("seed-parallel")
    for concurrency in (1, 10, 70):
        result = probe(sim.url, concurrency)
        expected = profile.throughput(role, concurrency) * SCALE
        assert result.errors == 0
        assert result.tok_s == pytest.approx(expected, rel=TOLERANCE), (role, concurrency)


@pytest.fixture
def pair_factory() -> Iterator[Callable[..., tuple[str, str]]]:
    procs: list[Proc] = []

    def start_pair(*flags: str) -> tuple[str, str]:
        spec, base = free_port(), free_port()
        args = [
            "-m",
            "loadtest.simulator",
            "pair",
            "--speculative-port",
            str(spec),
            "--baseline-port",
            str(base),
            "--profile",
            "crossover",
            "--time-scale",
            str(SCALE),
            "--log-level",
            "warning",
            *flags,
        ]
        procs.append(start("pair", args, ready_url=f"http://127.0.0.1:{base}/health"))
        return f"http://127.0.0.1:{spec}", f"http://127.0.0.1:{base}"

    yield start_pair
    for proc in procs:
        proc.stop()


def both_busy(spec_url: str, base_url: str, concurrency: int) -> tuple[ProbeResult, ProbeResult]:
    async def run() -> tuple[ProbeResult, ProbeResult]:
        a, b = await asyncio.gather(
            closed_loop(spec_url, concurrency, warmup_s=1.0, measure_s=2.5, max_tokens=4096),
            closed_loop(base_url, concurrency, warmup_s=1.0, measure_s=2.5, max_tokens=4096),
        )
        return a, b

    return asyncio.run(run())


def test_shared_gpu_slows_one_server_when_the_other_is_busy(pair_factory: Callable[..., tuple[str, str]]) -> None:
    spec_url, base_url = pair_factory("--shared-gpu")
    alone_spec, alone_base = probe(spec_url, 10), probe(base_url, 10)
    busy_spec, busy_base = both_busy(spec_url, base_url, 10)
    # Time slicing: each step of one server waits for the other's, so both lose a large share.
    assert busy_spec.tok_s < 0.85 * alone_spec.tok_s
    assert busy_base.tok_s < 0.85 * alone_base.tok_s
    # The GPU is never idle while both have work: the two shares add up to about one whole.
    assert busy_spec.tok_s / alone_spec.tok_s + busy_base.tok_s / alone_base.tok_s == pytest.approx(1.0, rel=0.15)


def test_separate_gpus_do_not_interfere(pair_factory: Callable[..., tuple[str, str]]) -> None:
    spec_url, base_url = pair_factory()
    alone_spec = probe(spec_url, 10)
    busy_spec, _ = both_busy(spec_url, base_url, 10)
    assert busy_spec.tok_s == pytest.approx(alone_spec.tok_s, rel=TOLERANCE)
