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
