"""Starting and stopping the local processes that tests, benchmarks and the demo run against."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        port: int = s.getsockname()[1]
        return port


def http_status(url: str, timeout_s: float = 2.0) -> int | None:
    """Status of a GET, or None when nothing answers."""
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as resp:
            status: int = resp.status
            return status
    except urllib.error.HTTPError as exc:
        return exc.code
    except (urllib.error.URLError, OSError):
        return None


@dataclass
class Proc:
    name: str
    popen: subprocess.Popen[bytes]

    @property
    def pid(self) -> int:
        return self.popen.pid

    def alive(self) -> bool:
        return self.popen.poll() is None

    def stop(self, timeout_s: float = 10.0, sig: int = signal.SIGTERM) -> int:
        if self.popen.poll() is None:
            self.popen.send_signal(sig)
            try:
                self.popen.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait()
        return self.popen.returncode

    def rss_mib(self) -> float:
        """Resident memory now (Linux)."""
        with open(f"/proc/{self.pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
        raise RuntimeError(f"no VmRSS for {self.name}")

    def cpu_seconds(self) -> float:
        """User plus system CPU time so far (Linux)."""
        with open(f"/proc/{self.pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def start(
    name: str,
    args: Sequence[str],
    *,
    ready_url: str | None = None,
    timeout_s: float = 30.0,
    env: dict[str, str] | None = None,
    cpus: set[int] | None = None,
    quiet: bool = True,
) -> Proc:
    """Start `python ARGS` and wait until `ready_url` answers 200."""

    def pin() -> None:
        if cpus:
            os.sched_setaffinity(0, cpus)

    out = subprocess.DEVNULL if quiet else None
    popen = subprocess.Popen(
        [sys.executable, *args], env={**os.environ, **(env or {})}, stdout=out, stderr=out, preexec_fn=pin
    )
    proc = Proc(name, popen)
    if ready_url is not None:
        deadline = time.monotonic() + timeout_s
        while http_status(ready_url, timeout_s=1.0) != 200:
            if not proc.alive():
                raise RuntimeError(f"{name} exited with code {popen.returncode} before it was ready")
            if time.monotonic() > deadline:
                proc.stop()
                raise RuntimeError(f"{name} was not ready at {ready_url} within {timeout_s:g} s")
            time.sleep(0.05)
    return proc


@contextmanager
def running(name: str, args: Sequence[str], **kwargs: object) -> Iterator[Proc]:
    proc = start(name, args, **kwargs)  # type: ignore[arg-type]
    try:
        yield proc
    finally:
        proc.stop()


def simulator_args(role: str, port: int, *extra: str) -> list[str]:
    return ["-m", "loadtest.simulator", "--role", role, "--port", str(port), "--log-level", "warning", *extra]


@contextmanager
def pinned_simulator(role: str, *extra: str) -> Iterator[tuple[Proc, str]]:
    """One simulator on the first core and this process on the others (where there are two), so a
    benchmark measures the simulator, not its own client; the process and its URL."""
    cores = sorted(os.sched_getaffinity(0))
    sim_cpus, client_cpus = ({cores[0]}, set(cores[1:])) if len(cores) > 1 else (None, None)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = start("simulator", simulator_args(role, port, *extra), ready_url=url + "/health", cpus=sim_cpus)
    if client_cpus:
        os.sched_setaffinity(0, client_cpus)
    try:
        yield proc, url
    finally:
        proc.stop()
        os.sched_setaffinity(0, set(cores))


def pair_args(spec_port: int, base_port: int, *extra: str, shared: bool = True) -> list[str]:
    """A simulated pair sharing one compute budget (`loadtest.simulator pair --shared-gpu`), or
    with `shared` False on a GPU each."""
    ports = ["--speculative-port", str(spec_port), "--baseline-port", str(base_port)]
    gpu = ["--shared-gpu"] if shared else []
    return ["-m", "loadtest.simulator", "pair", *gpu, *ports, "--log-level", "warning", *extra]
