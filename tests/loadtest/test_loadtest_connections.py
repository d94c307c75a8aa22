"""The load tester against servers that close connections: its own failures are not the server's,
and a level with too few good requests concludes nothing. Real processes on loopback
(tests/scripted_server.py), the load tester run as users run it."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from loadtest.client import CLIENT_RETRIES, RequestResult, Target, stream_request
from loadtest.procs import Proc, free_port, start
from loadtest.prompts import fixed
from loadtest.sweep import make_session

QUICK = ["--duration-s", "1", "--quiet"]

Scripted = Callable[..., str]


@pytest.fixture
def scripted() -> Iterator[Scripted]:
    """`scripted("close_after_stream", "--tok-s", "500")` starts tests/scripted_server.py; its URL."""
    procs: list[Proc] = []

    def start_server(mode: str, *args: str) -> str:
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        procs.append(start(f"scripted-{mode}", ["-m", "tests.scripted_server", str(port), mode, *args],
                           ready_url=url + "/health"))  # fmt: skip
        return url

    yield start_server
    for proc in procs:
        proc.stop()


def loadtest(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "loadtest", *args], capture_output=True, text=True, timeout=120)


def sweep(url: str, tmp_path: Path, *args: str) -> tuple[subprocess.CompletedProcess[str], list[dict[str, Any]]]:
    out = tmp_path / "sweep.json"
    proc = loadtest("sweep", "--url", url, "--max-tokens", "8", *QUICK, "--out", str(out), *args)
    assert proc.returncode == 0, proc.stderr
    levels: list[dict[str, Any]] = json.loads(out.read_text())["levels"]
    return proc, levels


def row(table: str, concurrency: int) -> str:
    """The row of the compare table (unstarred concurrency column) for this level."""
    return next(line for line in table.splitlines() if line.startswith(f"{concurrency:>5} "))


def requests(url: str, n: int, **target: Any) -> list[RequestResult]:
    """`n` requests one after another on one pooled session, as one stream of a sweep sends them."""

    async def run() -> list[RequestResult]:
        prompts = fixed()
        async with make_session() as session:
            return [await stream_request(session, Target(url, "scripted", **target), next(prompts)) for _ in range(n)]

    return asyncio.run(run())


@pytest.mark.parametrize("mode", ["close_after_stream", "connection_close"])
def test_a_server_that_closes_after_every_stream_costs_no_errors(scripted: Scripted, tmp_path: Path, mode: str) -> None:
    url = scripted(mode, "--close-delay-s", "0")
    _, levels = sweep(url, tmp_path, "--concurrency", "1,8")
    for level in levels:
        assert level["errors"] == 0 and level["client_errors"] == 0, level
        assert level["completed"] >= 20 and level["conclusive"], level
        assert level["output_tok_s"] > 0 and level["mean_ttft_ms"] > 0
    if mode == "close_after_stream":
        # The pool did hand out connections the server had closed: the retries are what saved them.
        assert sum(level["retried"] for level in levels) > 0
    else:
        # `Connection: close` keeps the connection out of the pool, so nothing needs resending.
        assert sum(level["retried"] for level in levels) == 0


def test_a_resent_request_is_timed_from_the_try_that_was_answered(scripted: Scripted) -> None:
    # The server holds each finished connection 0.4 s before closing it, answering nothing on it:
    # the second request, sent on the pooled connection, waits that long for nothing.
    url = scripted("close_after_stream", "--close-delay-s", "0.4", "--ttft-ms", "5")
    t_before = time.monotonic()
    first, second = requests(url, 2, max_tokens=4)
    assert first.ok and first.attempts == 1
    assert second.ok and second.attempts == 2 and not second.client_error
    assert second.started - t_before > first.latency + 0.3  # started when the resend did
    assert second.ttft is not None and second.ttft < 0.2
    assert second.latency < 0.3


def test_resets_before_an_answer_are_client_errors_not_the_servers(scripted: Scripted, tmp_path: Path) -> None:
    url = scripted("reset_before_answer")
    (r,) = requests(url, 1)
    assert not r.ok and r.client_error and r.attempts == 1 + CLIENT_RETRIES
    assert r.error is not None and f"{1 + CLIENT_RETRIES} tries" in r.error

    proc, (level,) = sweep(url, tmp_path, "--concurrency", "2")
    assert level["errors"] == 0 and level["error_samples"] == []
    assert level["client_errors"] > 0 and level["client_error_samples"]
    assert level["completed"] == 0 and level["retried"] == 0
    assert level["conclusive"] is False
    assert "\n   2* " in proc.stdout  # the level's row is starred
    assert "c=2 is inconclusive" in proc.stdout
    assert "client errors" in proc.stderr and "not counted as the server's" in proc.stderr


def test_a_stream_cut_short_is_the_servers_error_and_is_not_resent(scripted: Scripted, tmp_path: Path) -> None:
    url = scripted("cut_mid_stream")
    (r,) = requests(url, 1)
    assert not r.ok and not r.client_error and r.attempts == 1

    _, (level,) = sweep(url, tmp_path, "--concurrency", "2")
    assert level["errors"] > 0 and level["client_errors"] == 0 and level["retried"] == 0
    assert level["completed"] == 0 and level["conclusive"] is False


@pytest.fixture
def misleading_pair(scripted: Scripted) -> tuple[str, str]:
    """A speculative server that fails nine in ten requests that come alone (so one stream gets a
    good request or two a second, which alone would say speculation never pays), faster than the
    baseline at 4 streams and slower at 40. Both close their connections after every response."""
    spec = scripted("close_after_stream", "--close-delay-s", "0", "--tok-s", "500", "--capacity-tok-s", "2000",
                    "--fail-alone", "10")  # fmt: skip
    base = scripted("close_after_stream", "--close-delay-s", "0", "--tok-s", "125", "--capacity-tok-s", "8000")
    return spec, base


def test_calibrate_recommends_nothing_from_a_level_with_too_few_good_requests(
    misleading_pair: tuple[str, str], tmp_path: Path
) -> None:
    spec, base = misleading_pair
    out = tmp_path / "cal.json"
    # The full sweep: the bisect search would start at 4 and never measure 1.
    proc = loadtest("calibrate", "--speculative", spec, "--baseline", base, "--concurrency", "1,4,40",
                    "--search", "full", "--max-tokens", "16", *QUICK, "--out", str(out))  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    data = json.loads(out.read_text())
    one = data["sweeps"]["speculative"][0]
    assert one["concurrency"] == 1 and one["conclusive"] is False and one["completed"] < one["min_ok"]
    assert all(level["conclusive"] for rows in data["sweeps"].values() for level in rows[1:])
    rec = data["recommendation"]
    assert rec["inconclusive_levels"] == [1]
    # From level 1's few good requests the verdict would be never_pays; from 4 and 40 it crosses.
    assert rec["verdict"] == "crosses" and 4 <= rec["high"] < 40
    assert row(proc.stdout, 1).split()[1].endswith("*")  # the speculative figure at level 1
    assert "speculative c=1 is inconclusive" in proc.stdout
    assert "Not measured conclusively: 1 concurrent streams" in proc.stdout
    assert f"SPECGATE_HIGH_WATERMARK={rec['high']}" in proc.stdout


def test_calibrate_with_no_conclusive_level_says_so_and_recommends_nothing(
    misleading_pair: tuple[str, str], tmp_path: Path
) -> None:
    spec, base = misleading_pair
    out = tmp_path / "cal.json"
    proc = loadtest("calibrate", "--speculative", spec, "--baseline", base, "--concurrency", "1,4",
                    "--max-tokens", "16", "--min-requests", "100000", "--max-duration-s", "1", *QUICK,
                    "--out", str(out))  # fmt: skip
    assert proc.returncode == 3, proc.stderr  # no recommendation
    rec = json.loads(out.read_text())["recommendation"]
    assert rec["verdict"] == "no_data" and rec["inconclusive_levels"] == [1, 4]
    assert rec["high"] is None and rec["low"] is None
    assert "No level had enough good requests" in proc.stdout
    assert "SPECGATE_HIGH_WATERMARK" not in proc.stdout


def test_compare_marks_a_level_with_too_few_good_requests(misleading_pair: tuple[str, str], tmp_path: Path) -> None:
    spec, base = misleading_pair
    out, plot = tmp_path / "cmp.json", tmp_path / "cmp.png"
    proc = loadtest("compare", "--speculative", spec, "--baseline", base, "--proxy", base, "--concurrency", "1,4",
                    "--max-tokens", "16", *QUICK, "--plot", str(plot), "--out", str(out))  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    data = json.loads(out.read_text())
    assert [level["conclusive"] for level in data["sweeps"]["speculative"]] == [False, True]
    table = proc.stdout[proc.stdout.index("output tok/s by concurrency") :]
    assert row(table, 1).split()[1].endswith("*")  # the speculative figure at level 1
    assert "speculative c=1 is inconclusive" in table
    # Level 1 left out, speculation pays at the one level left: not the never_pays that level 1 says.
    assert data["crossover"][0]["verdict"] == "always_pays"
    assert plot.stat().st_size > 0
