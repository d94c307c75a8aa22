from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

import pytest

from loadtest.procs import Proc, free_port, simulator_args, start


@dataclass
class Sim:
    url: str
    port: int
    proc: Proc


StartSim = Callable[..., Sim]


@pytest.fixture
def simulator() -> Iterator[StartSim]:
    """Start a real simulator process: `simulator("speculative", "--time-scale", "10")`."""
    procs: list[Proc] = []

    def start_sim(role: str = "baseline", *args: str, wait_ready: bool = True) -> Sim:
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        ready = f"{url}/health" if wait_ready else None
        proc = start(f"simulator-{role}", simulator_args(role, port, *args), ready_url=ready)
        procs.append(proc)
        return Sim(url, port, proc)

    yield start_sim
    for proc in procs:
        proc.stop()


@dataclass
class Stack:
    """The proxy under uvicorn in front of two simulator processes, all on loopback."""

    url: str
    spec: Sim
    base: Sim
    proxy: Proc
    env: dict[str, str]
    restart_sim: Callable[[str], Sim]


StartStack = Callable[..., Stack]


@pytest.fixture
def stack(simulator: StartSim) -> Iterator[StartStack]:
    """`stack(sim_args=[...], SPECGATE_HIGH_WATERMARK="4")` starts simulators and proxy."""
    procs: list[Proc] = []

    def start_stack(
        sim_args: tuple[str, ...] = ("--time-scale", "20"),
        spec_args: tuple[str, ...] = (),
        base_args: tuple[str, ...] = (),
        **env: str,
    ) -> Stack:
        spec = simulator("speculative", *sim_args, *spec_args)
        base = simulator("baseline", *sim_args, *base_args)
        port = free_port()
        full_env = {
            "SPECGATE_HOST": "127.0.0.1",
            "SPECGATE_PORT": str(port),
            "SPECGATE_SPECULATIVE_URL": spec.url,
            "SPECGATE_BASELINE_URL": base.url,
            "SPECGATE_HEALTH_INTERVAL_S": "0.2",
            "SPECGATE_LOG_LEVEL": "warning",
            **env,
        }
        url = f"http://127.0.0.1:{port}"
        proxy = start("proxy", ["-m", "proxy"], ready_url=url + "/health", env=full_env)
        procs.append(proxy)
        roles = {"speculative": (spec, (*sim_args, *spec_args)), "baseline": (base, (*sim_args, *base_args))}

        def restart_sim(role: str) -> Sim:
            old, args = roles[role]
            old.proc.stop()
            new = start(f"simulator-{role}", simulator_args(role, old.port, *args), ready_url=old.url + "/health")
            procs.append(new)
            return Sim(old.url, old.port, new)

        return Stack(url, spec, base, proxy, full_env, restart_sim)

    yield start_stack
    for proc in procs:
        proc.stop()
