"""The overhead benchmark runs end to end (figures come from running it, not from tests), and starts
the peers it measures with the command lines they accept."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from loadtest import decisions
from loadtest.bench_upstream import CLIENTS, Case, format_table
from loadtest.bench_upstream import run as run_upstream
from loadtest.overhead import Scenario, format_results, run_overhead
from loadtest.peers import PEERS, Launch, peer_launches, start_launch

ROOT = Path(__file__).resolve().parents[2]
# Where scripts/install-peers puts the peers; CI does not, and the tests that need them skip.
PEERS_VENV = ROOT / ".venv-peers"


def test_overhead_benchmark_measures_every_target() -> None:
    # Enough small requests for the proxy's CPU to span many /proc clock ticks (10 ms each).
    scenarios = (
        Scenario("tiny", 2, False, 1, 400),
        Scenario("tiny stream", 2, True, 8, 10),
        Scenario("tiny paced", 3, True, 8, 6, pace_ms=5.0, spread=4),
    )
    measured = run_overhead(reps=1, nginx=False, scenarios=scenarios, say=lambda _: None)
    results = measured.results
    assert measured.not_measured == {}
    assert {(r.scenario, r.target) for r in results} == {(s.name, t) for s in scenarios for t in ("direct", "specgate")}
    for r in results:
        (sample,) = r.samples
        assert sample.errors == 0 and sample.req_s > 0 and sample.p50_ms > 0
        # Every token's event arrived, through the proxy as directly.
        assert sample.missing_chunks == 0
        if r.target == "specgate" and r.scenario == "tiny":
            assert sample.target_cpu_per_1k_s > 0  # the proxy's own CPU is measured
    stream = next(r for r in results if r.scenario == "tiny stream" and r.target == "specgate")
    assert stream.samples[0].chunks_s > 0 and stream.samples[0].ttft_p50_ms > 0
    paced = next(r for r in results if r.scenario == "tiny paced" and r.target == "direct").samples[0]
    # The paced backend spaces tokens by its decode step (5 ms): gaps are steps, not zero.
    assert paced.chunk_p50_ms >= 3.0
    assert Scenario("x", 1, True, 64, 1, spread=32).lengths() == list(range(32, 97, 4))
    assert "specgate" in format_results(measured)


def _flag(argv: list[str], name: str) -> list[str]:
    """The values after a flag, up to the next flag."""
    start = argv.index(name) + 1
    end = next((i for i in range(start, len(argv)) if argv[i].startswith("--")), len(argv))
    return argv[start:end]


def _fake_venv(root: Path, scripts: dict[str, str]) -> Path:
    (root / "bin").mkdir(parents=True)
    for name, text in scripts.items():
        path = root / "bin" / name
        path.write_text(text)
        path.chmod(0o755)
    return root


def test_peers_are_started_in_front_of_both_servers_with_ports_of_their_own(tmp_path: Path) -> None:
    venv = _fake_venv(tmp_path / "venv", {exe: "" for exe in PEERS.values()})
    launches, missing = peer_launches(venv, [41001, 41002], tmp_path)
    assert missing == {}
    by = {launch.name: launch for launch in launches}
    assert set(by) == {"litellm", "smg", "vllm-router"}
    workers = ["http://127.0.0.1:41001", "http://127.0.0.1:41002"]
    smg, router = by["smg"].argv, by["vllm-router"].argv
    assert smg[:2] == [str(venv / "bin" / "smg"), "launch"] and router[0] == str(venv / "bin" / "vllm-router")
    for argv in (smg, router):
        assert _flag(argv, "--worker-urls") == workers
        assert _flag(argv, "--policy") == ["round_robin"]
        assert _flag(argv, "--host") == _flag(argv, "--prometheus-host") == ["127.0.0.1"]
    assert "--disable-tokenizer-autoload" in smg  # a pure router: no tokenizer looked up anywhere
    # Every listener on a port of its own, none on the routers' default metrics port.
    metrics = [int(_flag(argv, "--prometheus-port")[0]) for argv in (smg, router)]
    ports = [launch.port for launch in launches] + metrics
    assert len(set(ports)) == len(ports) and 29000 not in ports
    for launch in launches:
        assert int(_flag(launch.argv, "--port")[0]) == launch.port
    assert by["smg"].ready_path == by["vllm-router"].ready_path == "/readiness"
    config = Path(_flag(by["litellm"].argv, "--config")[0]).read_text()
    assert all(f"api_base: {url}/v1" in config for url in workers)
    assert by["litellm"].headers["Authorization"].startswith("Bearer ")
    # A venv with only one of them: the others are reported, not guessed.
    launches, missing = peer_launches(_fake_venv(tmp_path / "one", {"smg": ""}), [41001, 41002], tmp_path)
    assert [launch.name for launch in launches] == ["smg"]
    assert set(missing) == {"litellm", "vllm-router"}
    assert all("scripts/install-peers" in why for why in missing.values())


# A peer that starts, answers its readiness check, and exits at the first request it is sent.
DIES_AT_FIRST_REQUEST = """#!{python}
import http.server, os, sys
port = int(sys.argv[sys.argv.index("--port") + 1])
class Handler(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200)
        self.send_header("content-length", "0")
        self.end_headers()
    def do_POST(self):
        print("dying at the first request", flush=True)
        os._exit(5)
http.server.HTTPServer(("127.0.0.1", port), Handler).serve_forever()
"""


def test_a_peer_that_fails_is_reported_not_measured_never_slow(tmp_path: Path) -> None:
    venv = _fake_venv(
        tmp_path / "venv",
        {
            "smg": "#!/bin/sh\necho 'error: unrecognized arguments: --policy' >&2\nexit 3\n",
            "vllm-router": DIES_AT_FIRST_REQUEST.format(python=sys.executable),
        },
    )
    said: list[str] = []
    scenarios = (Scenario("tiny", 2, False, 1, 40),)
    measured = run_overhead(reps=2, nginx=False, scenarios=scenarios, peers_venv=venv, say=said.append)
    assert {r.target for r in measured.results} == {"direct", "specgate"}
    assert all(s.errors == 0 for r in measured.results for s in r.samples)
    why = measured.not_measured
    assert set(why) == {"litellm", "smg", "vllm-router"}
    assert "not installed" in why["litellm"]
    assert why["smg"].startswith("exited with code 3") and "unrecognized arguments: --policy" in why["smg"]
    assert why["vllm-router"].startswith("exited with code 5 during tiny, repetition 1")
    assert "dying at the first request" in why["vllm-router"]
    assert any(line.startswith("smg: not measured") for line in said)
    table = format_results(measured)
    assert "not measured: vllm-router: exited with code 5" in table
    assert not any(line.startswith("tiny") and "vllm-router" in line for line in table.splitlines())


def test_a_peer_that_never_gets_ready_is_waited_for_a_bounded_time(tmp_path: Path) -> None:
    launch = Launch("stuck", [sys.executable, "-c", "import time; print('starting', flush=True); time.sleep(60)"],
                    1, "/readiness", 0.5)  # fmt: skip
    proc, why = start_launch(launch, tmp_path)
    try:
        assert why is not None and why.startswith("not ready at http://127.0.0.1:1/readiness within 0.5 s")
        assert why.endswith(": starting")
    finally:
        proc.stop()


def _installed(*executables: str) -> bool:
    return all((PEERS_VENV / "bin" / exe).exists() for exe in executables)


@pytest.mark.skipif(not _installed("smg", "vllm-router"), reason="peers not installed (scripts/install-peers)")
def test_installed_routers_accept_every_flag_they_are_given(tmp_path: Path) -> None:
    launches, _ = peer_launches(PEERS_VENV, [41001, 41002], tmp_path)
    for launch in launches:
        if launch.name == "litellm":
            continue
        help_argv = [*launch.argv[: 2 if launch.name == "smg" else 1], "--help"]
        text = subprocess.run(help_argv, capture_output=True, text=True, timeout=60, check=True).stdout
        for flag in (arg for arg in launch.argv if arg.startswith("--")):
            assert flag in text, f"{launch.name} has no {flag}"


@pytest.mark.skipif(not _installed("smg", "vllm-router"), reason="peers not installed (scripts/install-peers)")
def test_installed_routers_relay_every_event(tmp_path: Path) -> None:
    # Only the two routers (LiteLLM takes a minute to start): links in a venv of their own.
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    for exe in ("smg", "vllm-router"):
        (venv / "bin" / exe).symlink_to(PEERS_VENV / "bin" / exe)
    scenarios = (Scenario("tiny", 2, False, 1, 400), Scenario("tiny stream", 2, True, 8, 10))
    measured = run_overhead(reps=1, nginx=False, scenarios=scenarios, peers_venv=venv, say=lambda _: None)
    assert set(measured.not_measured) == {"litellm"}
    for r in measured.results:
        (sample,) = r.samples
        assert sample.errors == 0 and sample.missing_chunks == 0 and sample.req_s > 0
    routers = {r.target for r in measured.results if r.scenario == "tiny" and r.samples[0].target_cpu_per_1k_s > 0}
    assert {"smg", "vllm-router"} <= routers


def test_upstream_client_benchmark_runs_every_client() -> None:
    cases = (Case("tiny", 2, 1, False, 20), Case("tiny stream", 2, 8, True, 6))
    results = run_upstream(reps=1, cases=cases)
    for case in cases:
        assert set(results[case.name]) == set(CLIENTS)
        for samples in results[case.name].values():
            ((cpu_ms, req_s),) = samples
            assert cpu_ms > 0 and req_s > 0
    assert "httpx+aiohttp" in format_table(results)


@pytest.mark.inprocess
def test_the_decision_benchmark_times_each_policy_plain_and_with_classes_and_affinity() -> None:
    costs = decisions.run(("threshold", "adaptive"), n=200, reps=1)
    assert [(c.policy, c.classes, c.affinity) for c in costs] == [
        ("threshold", False, False),
        ("threshold", True, True),
        ("adaptive", False, False),
        ("adaptive", True, True),
    ]
    assert all(0 < c.decision_us < c.request_us for c in costs)
    text = decisions.report(costs)
    assert "threshold" in text and "adaptive" in text and "+classes+affinity" in text
