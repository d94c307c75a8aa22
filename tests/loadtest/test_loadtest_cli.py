"""The load generator end to end: real sweeps through the proxy and against simulators."""

from __future__ import annotations

import json
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from loadtest.kit.processes import Fleet, NotReady
from loadtest.llamacpp import LlamaServer
from loadtest.procs import free_port, on_free_port, port_taken, simulator_args, start

from ..conftest import StartSim, StartStack

QUICK = ["--duration-s", "1", "--max-tokens", "16", "--quiet"]


def loadtest(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "loadtest", *args], capture_output=True, text=True, timeout=120)


def test_sweep_through_the_proxy(stack: StartStack, tmp_path: Path) -> None:
    s = stack(SPECGATE_HIGH_WATERMARK="3", SPECGATE_LOW_WATERMARK="1")
    out = tmp_path / "r.json"
    proc = loadtest("sweep", "--url", s.url, "--concurrency", "1,6", *QUICK, "--out", str(out))
    assert proc.returncode == 0, proc.stderr
    assert "out tok/s" in proc.stdout and "TTFT" in proc.stdout
    data = json.loads(out.read_text())
    one, six = data["levels"]
    assert (one["concurrency"], six["concurrency"]) == (1, 6)
    assert one["errors"] == six["errors"] == 0
    assert one["output_tok_s"] > 0 and one["median_ttft_ms"] > 0 and one["p99_itl_ms"] > 0
    assert one["backend_share"] == {"speculative": 1.0}
    assert six["backend_share"].get("baseline", 0) > 0.5  # six streams sit above the high watermark
    assert data["settings"]["max_tokens"] == 16


def test_unreachable_target_exits_non_zero_with_a_message() -> None:
    proc = loadtest("sweep", "--url", f"http://127.0.0.1:{free_port()}", *QUICK)
    assert proc.returncode == 2
    assert "cannot reach" in proc.stderr


def _calibrate(simulator: StartSim, profile: str, tmp_path: Path) -> tuple[str, dict]:  # type: ignore[type-arg]
    args = ("--profile", profile, "--time-scale", "2")
    spec, base = simulator("speculative", *args), simulator("baseline", *args)
    out = tmp_path / "cal.json"
    proc = loadtest("calibrate", "--speculative", spec.url, "--baseline", base.url, "--concurrency", "1,10,30",
                    "--endpoint", "completions", "--prompts", "fixed", *QUICK, "--out", str(out))  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    return proc.stdout, json.loads(out.read_text())


def test_calibrate_finds_the_crossover(simulator: StartSim, tmp_path: Path) -> None:
    stdout, data = _calibrate(simulator, "crossover", tmp_path)
    rec = data["recommendation"]
    assert rec["verdict"] == "crosses"
    assert 10 <= rec["high"] < 30 and rec["low"] < rec["high"]  # the profile crosses at 20
    assert f"SPECGATE_HIGH_WATERMARK={rec['high']}" in stdout


def test_calibrate_says_when_speculation_never_pays(simulator: StartSim, tmp_path: Path) -> None:
    stdout, data = _calibrate(simulator, "seed-parallel", tmp_path)
    assert data["recommendation"]["verdict"] == "never_pays"
    assert "SPECGATE_HIGH_WATERMARK=0" in stdout
    assert "never paid" in stdout


def test_calibrate_bisects_the_default_grid_and_says_how_long_it_takes(simulator: StartSim, tmp_path: Path) -> None:
    args = ("--profile", "crossover", "--time-scale", "4")
    spec, base = simulator("speculative", *args), simulator("baseline", *args)
    out = tmp_path / "cal.json"
    proc = loadtest("calibrate", "--speculative", spec.url, "--baseline", base.url, "--endpoint", "completions",
                    "--prompts", "fixed", *QUICK, "--out", str(out))  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    # Before the run, from the plan; after it, the time it took.
    assert "estimate: 2-4 of the grid's 8 levels (--search bisect" in proc.stderr
    assert proc.stderr.index("estimate:") < proc.stderr.index("search: 10 streams")
    assert re.search(r"calibrate took \d+\.\d s", proc.stdout), proc.stdout
    # The profile crosses at 20: ahead at 10, behind at 30, adjacent levels of the grid; 1 and 250 never run.
    data = json.loads(out.read_text())
    assert [r["concurrency"] for r in data["sweeps"]["speculative"]] == [10, 30]
    assert "search done: bracketed: speculation ahead at 10 and behind at 30" in proc.stderr
    assert "search: 10 streams ahead; 1 measured in" in proc.stderr and "at most 3 more" in proc.stderr
    rec = data["recommendation"]
    assert rec["verdict"] == "crosses" and 10 <= rec["high"] < 30
    assert f"SPECGATE_HIGH_WATERMARK={rec['high']}" in proc.stdout


def test_calibrate_with_classes_prints_a_policy_that_prices_them(simulator: StartSim, tmp_path: Path) -> None:
    args = ("--profile", "crossover", "--time-scale", "4", "--accept-from-prompt")
    spec, base = simulator("speculative", *args), simulator("baseline", *args)
    proc = loadtest("calibrate", "--speculative", spec.url, "--baseline", base.url, "--concurrency", "1,10,30",
                    "--class", "chat:0.5:diverse", "--class", "code:0.5:repetitive", *QUICK)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    pasted = proc.stdout[proc.stdout.index("Paste into") :]
    assert "SPECGATE_POLICY=adaptive" in pasted and "SPECGATE_CLASS_KEY=header" in pasted
    assert "SPECGATE_POLICY=threshold" not in proc.stdout
    assert "x-specgate-class" in pasted and "threshold would ignore the classes" in pasted


def test_extra_body_reaches_the_server(simulator: StartSim, tmp_path: Path) -> None:
    sim = simulator("baseline", "--time-scale", "20")
    # The simulator refuses n != 1 with a 400: every request carries the extra field.
    out = tmp_path / "r.json"
    loadtest("sweep", "--url", sim.url, "--concurrency", "1", *QUICK, "--extra-body", '{"n": 2}', "--out", str(out))
    (level,) = json.loads(out.read_text())["levels"]
    assert level["completed"] == 0 and level["errors"] > 0
    assert all("HTTP 400" in e and "n=1" in e for e in level["error_samples"]), level["error_samples"]
    ok = loadtest("sweep", "--url", sim.url, "--concurrency", "1", *QUICK, "--extra-body", '{"n": 1}')
    assert ok.returncode == 0 and "0 errors" in ok.stderr, ok.stderr
    bad = loadtest("sweep", "--url", sim.url, *QUICK, "--extra-body", "[1]")
    assert bad.returncode == 2 and "not a JSON object" in bad.stderr


def test_compare_with_extra_targets(simulator: StartSim, tmp_path: Path) -> None:
    args = ("--profile", "crossover", "--time-scale", "20")
    spec, base = simulator("speculative", *args), simulator("baseline", *args)
    # A third server stands in for SGLang's --speculative-adaptive one; no specgate in this compare.
    third = simulator("speculative", *args, "--accept-length", "2")
    out, plot = tmp_path / "c.json", tmp_path / "c.png"
    proc = loadtest("compare", "--speculative", spec.url, "--baseline", base.url, "--extra", f"adaptive={third.url}/",
                    "--concurrency", "1,10", *QUICK, "--out", str(out), "--plot", str(plot))  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    table = proc.stdout.split("output tok/s by concurrency")[1]
    head = table.strip().splitlines()[0]
    assert head.split() == ["conc", "speculative", "baseline", "adaptive", "vs", "better"]
    data = json.loads(out.read_text())
    assert set(data["sweeps"]) == {"speculative", "baseline", "adaptive"}
    assert all(r["output_tok_s"] > 0 and r["errors"] == 0 for r in data["sweeps"]["adaptive"])
    assert plot.stat().st_size > 0
    # A name taken by a built-in target, a bad pair and an unreachable extra are refused, naming them.
    for bad, says in (("specgate=http://x", "built-in"), ("adaptive", "NAME=URL")):
        proc = loadtest("compare", "--speculative", spec.url, "--baseline", base.url, "--extra", bad, *QUICK)
        assert proc.returncode == 2 and says in proc.stderr, proc.stderr
    gone = f"gone=http://127.0.0.1:{free_port()}"
    proc = loadtest("compare", "--speculative", spec.url, "--baseline", base.url, "--extra", gone, *QUICK)
    assert proc.returncode == 2 and "gone:" in proc.stderr and "cannot reach" in proc.stderr, proc.stderr


# A pair that crosses at 7 streams, speculation 1.6x ahead at 1-4 (issue: calibrate recommended 0 on
# levels it had itself called inconclusive). At a quarter-second window, its low levels finish too
# few requests unless the window runs on.
X7_PROFILE = """concurrency,speculative_tok_s,baseline_tok_s
1,142,88
2,258,172
4,451,334
7,600,600
12,700,950
24,760,1500
"""
X7_ARGS = ["--concurrency", "1,2,4,7,12", "--duration-s", "0.25", "--max-tokens", "64", "--quiet"]


def _x7_pair(simulator: StartSim, tmp_path: Path) -> tuple[str, str]:
    profile = tmp_path / "x7.csv"
    profile.write_text(X7_PROFILE)
    args = ("--profile", str(profile), "--time-scale", "4")
    return simulator("speculative", *args).url, simulator("baseline", *args).url


def test_calibrate_extends_short_windows_and_brackets_the_crossover(simulator: StartSim, tmp_path: Path) -> None:
    spec, base = _x7_pair(simulator, tmp_path)
    out, save = tmp_path / "cal.json", tmp_path / "calibration.json"
    proc = loadtest("calibrate", "--speculative", spec, "--baseline", base, *X7_ARGS, "--out", str(out),
                    "--save", str(save))  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    data = json.loads(out.read_text())
    for role in ("speculative", "baseline"):
        rows = data["sweeps"][role]
        assert all(r["conclusive"] for r in rows), rows
        # One stream finishes a 64-token request in 0.11-0.18 s: ten of them need a longer window.
        assert rows[0]["extended_s"] > 0 and rows[0]["duration_s"] > 0.25 + rows[0]["extended_s"] - 0.1
        assert rows[0]["duration_s"] <= 2.5 + 0.5  # --max-duration-s: 10 x --duration-s
    rec = data["recommendation"]
    assert rec["verdict"] == "crosses" and 4 <= rec["high"] <= 7, rec  # within one level of 7
    assert f"SPECGATE_HIGH_WATERMARK={rec['high']}" in proc.stdout
    assert "windows run past --duration-s for want of good requests" in proc.stdout
    assert "extended up to 2.5 s (--max-duration-s)" in proc.stderr
    assert save.exists()


def test_calibrate_refuses_when_the_levels_cannot_bracket_the_crossover(simulator: StartSim, tmp_path: Path) -> None:
    spec, base = _x7_pair(simulator, tmp_path)
    out, save = tmp_path / "cal.json", tmp_path / "calibration.json"
    # No room to run on: the lowest levels stay short of good requests, as in the run. The
    # grid leaves out 4 and 7, which sit at the crossover and near the bar of good requests: either
    # could fall on either side and bracket it. The full sweep, so no level is measured again with
    # its window doubled (the bisect search's own refusal is tested with its planner).
    grid = [*X7_ARGS[:1], "1,2,12", *X7_ARGS[2:]]
    proc = loadtest("calibrate", "--speculative", spec, "--baseline", base, *grid, "--max-duration-s", "0.25",
                    "--search", "full", "--out", str(out), "--save", str(save))  # fmt: skip
    assert proc.returncode == 3, proc.stdout + proc.stderr
    rec = json.loads(out.read_text())["recommendation"]
    # Unknown where some levels were conclusive, no data where none was: either way, no watermarks.
    assert rec["verdict"] in ("unknown", "no_data") and rec["high"] is None and rec["low"] is None, rec
    assert "No watermarks are recommended" in proc.stdout
    assert "SPECGATE_HIGH_WATERMARK" not in proc.stdout and "Nothing to paste" in proc.stdout
    assert not save.exists() and f"{save} not written" in proc.stderr
    # No room was given to run on, and none is reported.
    assert "windows run past" not in proc.stdout and "extended" not in proc.stderr


SIGTERMED = """
import time
from loadtest.__main__ import stop_on_sigterm
from loadtest.kit.processes import Fleet
stop_on_sigterm()
fleet = Fleet()
try:
    child = fleet.start("sleeper", ["-c", "import time; time.sleep(120)"], [])
    print(child.pid, flush=True)
    time.sleep(120)
finally:
    fleet.stop()
"""


def test_a_sigterm_stops_what_the_command_started() -> None:
    """kill (or a CI job's timeout) on a scenario unwinds it as Ctrl-C does: the servers it started
    are stopped, not left running."""
    parent = subprocess.Popen([sys.executable, "-c", SIGTERMED], stdout=subprocess.PIPE, text=True)
    try:
        assert parent.stdout is not None
        child = int(parent.stdout.readline())
        assert Path(f"/proc/{child}").exists()
        parent.terminate()
        assert parent.wait(timeout=30) != 0
    finally:
        parent.kill()
        parent.wait()
    deadline = time.monotonic() + 15
    while Path(f"/proc/{child}").exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not Path(f"/proc/{child}").exists()


def test_a_llama_servers_own_log_is_removed_when_it_stops_and_a_given_one_kept(tmp_path: Path) -> None:
    # Every start of the real-engine tier used to leave its log in the temporary directory.
    for owns in (True, False):
        log = tmp_path / f"llama-{owns}.log"
        log.write_bytes(b"loading model\n")
        proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
        server = LlamaServer("llama-baseline", proc, "baseline", 1, "http://127.0.0.1:1", log, owns)
        assert server.log_tail() == "loading model"
        server.stop()
        assert proc.poll() is not None
        assert log.exists() is not owns


def test_a_process_that_dies_before_it_is_ready_says_why() -> None:
    # The race fresh_start retries: the port free_port found is taken before the server binds it.
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        fleet = Fleet()
        fleet.start("simulators-x", simulator_args("speculative", port), [f"http://127.0.0.1:{port}/health"])
        try:
            with pytest.raises(NotReady) as raised:
                fleet.ready()
        finally:
            fleet.stop()
    said = str(raised.value)
    assert said.startswith("simulators-x exited with code 1 before it was ready; its stderr ended:")
    assert "address already in use" in said and port_taken(raised.value)


def test_a_gateway_on_a_taken_port_is_told_apart_from_one_that_fails_otherwise() -> None:
    # tests.helpers.start_proxy starts again on a fresh port only for the first.
    env = {"SPECGATE_SPECULATIVE_URL": "http://127.0.0.1:1", "SPECGATE_BASELINE_URL": "http://127.0.0.1:2"}
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(RuntimeError) as raised:
            start("proxy", ["-m", "proxy"], ready_url=f"http://127.0.0.1:{port}/health",
                  env={**env, "SPECGATE_PORT": str(port)})  # fmt: skip
    assert port_taken(raised.value)
    with pytest.raises(RuntimeError) as raised:
        start("proxy", ["-m", "proxy"], ready_url="http://127.0.0.1:1/health", env={**env, "SPECGATE_PORT": "-5"})
    assert "exited with code" in str(raised.value) and not port_taken(raised.value)


def test_a_launch_whose_port_was_taken_is_tried_once_more_on_a_fresh_one() -> None:
    tried: list[int] = []

    def taken_once(port: int) -> int:
        tried.append(port)
        if len(tried) == 1:
            raise RuntimeError("x exited with code 1 before it was ready; ...: address already in use")
        return port

    assert on_free_port(taken_once) == tried[1] and len(tried) == 2

    def broken(port: int) -> int:
        tried.append(port)
        raise RuntimeError("x exited with code 2 before it was ready")

    tried.clear()
    with pytest.raises(RuntimeError, match="code 2"):
        on_free_port(broken)
    assert len(tried) == 1  # not a taken port: not tried again
