"""Starting and stopping the local processes that tests, benchmarks and the demo run against."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import IO, TypeVar

T = TypeVar("T")

# The lines of a quiet process's stderr kept to say why it died (Proc.stderr_tail): enough for a
# traceback's end, bounded however much the process writes over a long run.
STDERR_LINES = 20


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
    # The last lines of stderr, where it was piped (start, quiet): kept by a reader thread.
    stderr_lines: deque[str] = field(default_factory=lambda: deque(maxlen=STDERR_LINES), kw_only=True)
    reader: threading.Thread | None = field(default=None, kw_only=True)

    def stderr_tail(self) -> str:
        """The last lines the process wrote to stderr, once it has exited (its reader has read to
        the end); empty where its stderr was not kept."""
        if self.reader is not None:
            self.reader.join(timeout=2.0)
        return "".join(self.stderr_lines).rstrip()

    def died(self, when: str) -> str:
        """`NAME exited with code N WHEN`, and its stderr's last lines where they were kept."""
        tail = self.stderr_tail()
        said = f"{self.name} exited with code {self.popen.returncode} {when}"
        return f"{said}; its stderr ended:\n{tail}" if tail else said

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

    # A quiet process's stderr is piped and its last lines kept, so that one which dies before it is
    # ready says why (a port taken between free_port and its bind, a bad flag) instead of only its code.
    popen = subprocess.Popen(
        [sys.executable, *args],
        env={**os.environ, **(env or {})},
        stdout=subprocess.DEVNULL if quiet else None,
        stderr=subprocess.PIPE if quiet else None,
        preexec_fn=pin,
    )
    proc = Proc(name, popen)
    if popen.stderr is not None:
        proc.reader = threading.Thread(target=_keep_lines, args=(popen.stderr, proc.stderr_lines), daemon=True)
        proc.reader.start()
    if ready_url is not None:
        try:
            _wait_ready(proc, ready_url, timeout_s)
        except BaseException:
            # Not ready, or Ctrl-C (SIGTERM) while waiting: the caller never got the process to stop.
            proc.stop()
            raise
    return proc


def _wait_ready(proc: Proc, ready_url: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while http_status(ready_url, timeout_s=1.0) != 200:
        if not proc.alive():
            raise RuntimeError(proc.died("before it was ready"))
        if time.monotonic() > deadline:
            raise RuntimeError(f"{proc.name} was not ready at {ready_url} within {timeout_s:g} s")
        time.sleep(0.05)


def port_taken(exc: BaseException) -> bool:
    """Whether `start` failed because the process found its port taken: free_port's port can be
    taken by another socket before the server binds it, and starting again on a fresh one is the cure."""
    return isinstance(exc, RuntimeError) and "address already in use" in str(exc)


def on_free_port(launch: Callable[[int], T], host: str = "127.0.0.1") -> T:
    """`launch(port)` on a port free_port found, and once more on a fresh one where that port was
    taken before the process bound it (port_taken); any other failure is raised as it is."""
    try:
        return launch(free_port(host))
    except RuntimeError as exc:
        if not port_taken(exc):
            raise
    return launch(free_port(host))


def _keep_lines(pipe: IO[bytes], lines: deque[str]) -> None:
    """Read `pipe` to its end (so the process never blocks on a full pipe), keeping the last lines."""
    with pipe:
        for raw in pipe:
            lines.append(raw.decode(errors="replace"))


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
