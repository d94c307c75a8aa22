"""Ctrl-C and SIGTERM on the sweeping commands, as a user meets them: each command runs as its own
process (its own process group) against simulators, is signalled once a level has completed, and
must exit at once with 130 (143), print the levels it completed as its table, say it was
interrupted, and leave none of the processes it started running."""

from __future__ import annotations

import contextlib
import os
import queue
import re
import signal
import subprocess
import sys
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import IO

import pytest

from loadtest import procs

from ..conftest import StartSim

# Level 1 is short; level 2 (3 for the demo) takes at least --duration-s more, so a run that was
# not stopped at once would have completed it, and printed it, by the time it exits.
QUICK = ["--duration-s", "3", "--max-tokens", "16", "--min-requests", "3", "--quiet"]
# Long enough for a level on a loaded machine; it bounds the wait, it does not time the command.
LEVEL_WAIT_S = 180.0
EXIT_WAIT_S = 60.0


@dataclass
class Interrupted:
    code: int
    stdout: str
    stderr: str
    left: list[int]  # processes of the command's group still running after it exited


def _read(pipe: IO[str], lines: queue.Queue[str | None]) -> None:
    with pipe:
        for line in pipe:
            lines.put(line)
    lines.put(None)


def _group(pgid: int) -> list[int]:
    """The processes (not zombies) whose process group is `pgid`."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        state, _ppid, pgrp = stat.rsplit(")", 1)[1].split()[:3]
        if int(pgrp) == pgid and state != "Z":
            found.append(int(entry.name))
    return found


def _alive(entry: Path) -> bool:
    """Whether the process of /proc/PID has not exited (a zombie has, unreaped)."""
    return (entry / "stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"


def interrupt(args: list[str], after: str, sig: int) -> Interrupted:
    """Run `python -m loadtest ARGS`, send `sig` once a line of its stderr matches `after`."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "loadtest", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,  # its own group, so that what it leaves running can be found
    )
    assert proc.stdout is not None and proc.stderr is not None
    errs: queue.Queue[str | None] = queue.Queue()
    outs: queue.Queue[str | None] = queue.Queue()
    readers = [
        threading.Thread(target=_read, args=(proc.stderr, errs), daemon=True),
        threading.Thread(target=_read, args=(proc.stdout, outs), daemon=True),
    ]
    for reader in readers:
        reader.start()
    stderr: list[str] = []
    try:
        while True:
            line = errs.get(timeout=LEVEL_WAIT_S)
            if line is None:
                raise AssertionError(f"the command ended before a line matched {after!r}: {''.join(stderr)}")
            stderr.append(line)
            if re.search(after, line):
                break
        os.kill(proc.pid, sig)
        code = proc.wait(timeout=EXIT_WAIT_S)
        for reader in readers:
            reader.join(timeout=10)
        left = _group(proc.pid)
    finally:
        for pid in _group(proc.pid):  # a failed test leaves nothing running either
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return Interrupted(code, _drained(outs), "".join(stderr) + _drained(errs), left)


def _drained(lines: queue.Queue[str | None]) -> str:
    """What a reader, joined, put in `lines` and nobody took yet."""
    out = []
    while not lines.empty():
        line = lines.get_nowait()
        if line is not None:
            out.append(line)
    return "".join(out)


def rows(table: str, level: int) -> list[str]:
    """The table rows of this level (starred or not)."""
    return [line for line in table.splitlines() if re.match(rf"\s+{level}\*? ", line)]


def assert_reported(run: Interrupted, code: int, done: int, cut: int, last_sweep: str = "") -> None:
    """Exit `code`, said so, level `done` printed and `cut` not (in the text from `last_sweep` on)."""
    assert run.code == code, run.stderr
    assert "interrupted: the levels completed before the interrupt follow" in run.stdout
    assert rows(run.stdout, done), run.stdout
    assert not rows(run.stdout[run.stdout.index(last_sweep) :], cut), run.stdout
    assert "Traceback" not in run.stderr
    assert run.left == []


@pytest.fixture
def pair(simulator: StartSim) -> tuple[str, str]:
    args = ("--profile", "crossover", "--time-scale", "4")
    return simulator("speculative", *args).url, simulator("baseline", *args).url


def test_ctrl_c_on_a_sweep_prints_the_levels_completed(simulator: StartSim) -> None:
    url = simulator("baseline", "--time-scale", "4").url
    run = interrupt(["sweep", "--url", url, "--concurrency", "1,2", *QUICK], r"target c=1 ", signal.SIGINT)
    assert_reported(run, 130, done=1, cut=2)
    assert f"sweep of {url}" in run.stdout


@pytest.mark.parametrize(
    ("command", "sig", "code"), [("compare", signal.SIGTERM, 143), ("calibrate", signal.SIGINT, 130)]
)
def test_an_interrupted_comparison_prints_the_levels_both_servers_completed(
    pair: tuple[str, str], command: str, sig: int, code: int
) -> None:
    spec, base = pair
    args = [command, "--speculative", spec, "--baseline", base, "--concurrency", "1,2", *QUICK]
    run = interrupt(args, r"baseline c=1 ", sig)
    assert_reported(run, code, done=1, cut=2)
    assert "output tok/s by concurrency" in run.stdout
    assert "SPECGATE_HIGH_WATERMARK" not in run.stdout  # nothing concluded from a partial sweep


def test_ctrl_c_on_the_demo_stops_its_simulators_and_specgate(tmp_path: Path) -> None:
    args = ["demo", "--concurrency", "1,3", "--time-scale", "4", "--out-dir", str(tmp_path), *QUICK]
    run = interrupt(args, r"specgate c=1 ", signal.SIGINT)
    # The servers' sweep whole, then specgate's first level.
    assert_reported(run, 130, done=1, cut=3, last_sweep="sweep 2 of 2:\nspecgate")
    assert "sweep 1 of 2" in run.stdout and len(rows(run.stdout.split("sweep 2 of 2")[0], 3)) == 1
    assert not (tmp_path / "demo.json").exists()


def test_a_process_interrupted_before_it_was_ready_is_stopped(monkeypatch: pytest.MonkeyPatch) -> None:
    """Ctrl-C while start() waits for a process to be ready: the caller never got the process, so
    start() itself must stop it."""
    marker = f"sleeper-{os.getpid()}"

    def ctrl_c(url: str, timeout_s: float = 2.0) -> int | None:
        assert mine(), "the process was started"
        raise KeyboardInterrupt

    def mine() -> list[int]:
        found = []
        for entry in Path("/proc").iterdir():
            with contextlib.suppress(OSError):
                if entry.name.isdigit() and marker.encode() in (entry / "cmdline").read_bytes() and _alive(entry):
                    found.append(int(entry.name))
        return found

    monkeypatch.setattr(procs, "http_status", ctrl_c)
    with pytest.raises(KeyboardInterrupt):
        procs.start("sleeper", ["-c", f"import time; time.sleep(60)  # {marker}"], ready_url="http://127.0.0.1:9/")
    assert mine() == []
