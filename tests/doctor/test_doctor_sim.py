"""`specgate doctor` against simulator processes: a correct pair passes, each misconfiguration it
names blocks with its line."""

from __future__ import annotations

import re
import socket
import subprocess
import sys
from pathlib import Path

import orjson
import pytest

from loadtest.procs import free_port
from proxy.doctor.cli import main

from ..conftest import ROOT, Sim, StartSim
from ..helpers import wait_for

SIM = ("--profile", "crossover", "--time-scale", "20")


def doctor(capsys: pytest.CaptureFixture[str], spec: str, base: str, *extra: str) -> tuple[int, str]:
    code = main(["--speculative", spec, "--baseline", base, "--timeout-s", "20", *extra])
    return code, capsys.readouterr().out


def problems(out: str) -> list[str]:
    return [line.strip() for line in out.splitlines() if line.startswith("  ERROR") or line.startswith("  WARN")]


@pytest.fixture
def pair(simulator: StartSim) -> tuple[Sim, Sim]:
    return simulator("speculative", *SIM), simulator("baseline", *SIM)


def test_a_correct_pair_passes(pair: tuple[Sim, Sim], capsys: pytest.CaptureFixture[str]) -> None:
    spec, base = pair
    code, out = doctor(capsys, spec.url, base.url)
    assert code == 0, out
    assert "problems: none" in out and "verdict: ready" in out
    assert "engine:       sglang (its /metrics names)" in out
    # The simulator accepts 3 tokens a step; a 48-token stream reads it within about 10%.
    assert re.search(r"speculates:   yes, acceptance (2\.[7-9]\d|3\.[0-3]\d)", out), out
    assert "speculates:   no, acceptance 1.00" in out
    assert "KV pool:      2,000,000 tokens" in out and "context:      131,072 tokens" in out
    assert f"SPECGATE_SPECULATIVE_URL={spec.url}" in out and "SPECGATE_TOPOLOGY=paired" in out


def test_roles_swapped_block_with_both_lines(pair: tuple[Sim, Sim], capsys: pytest.CaptureFixture[str]) -> None:
    spec, base = pair
    code, out = doctor(capsys, base.url, spec.url)
    assert code == 1
    first, second = problems(out)
    assert first == (
        f"ERROR speculative {base.url}: does not speculate (acceptance 1.00): start it with --speculative-algorithm "
        "EAGLE3 --speculative-draft-model-path D"
    )
    assert re.fullmatch(
        rf"ERROR baseline {spec.url}: speculates \(acceptance [23]\.\d\d\): start it without --speculative-algorithm",
        second,
    ), second


def test_an_unreachable_server_blocks(simulator: StartSim, capsys: pytest.CaptureFixture[str]) -> None:
    spec = simulator("speculative", *SIM)
    gone = f"http://127.0.0.1:{free_port()}"
    code, out = doctor(capsys, spec.url, gone)
    assert code == 1
    [line] = problems(out)
    assert line.startswith(f"ERROR baseline {gone}: unreachable (cannot connect")
    assert line.endswith("start it, or correct SPECGATE_BASELINE_URL / --baseline")


def test_metrics_off_blocks_and_names_the_flag(simulator: StartSim, capsys: pytest.CaptureFixture[str]) -> None:
    spec, base = simulator("speculative", *SIM), simulator("baseline", *SIM, "--no-metrics")
    code, out = doctor(capsys, spec.url, base.url)
    assert code == 1
    assert problems(out) == [
        f"ERROR baseline {base.url}: no /metrics (404): start it with --enable-metrics; without it the engine load "
        "signal and acceptance reading are missing"
    ]
    assert "engine:       sglang (its /v1/models or info endpoints)" in out


def test_different_models_block(simulator: StartSim, capsys: pytest.CaptureFixture[str]) -> None:
    spec = simulator("speculative", *SIM, "--served-model-name", "llama-8b")
    base = simulator("baseline", *SIM, "--served-model-name", "qwen-7b")
    code, out = doctor(capsys, spec.url, base.url, "--separate-gpus")
    assert code == 1
    assert problems(out) == [
        f"ERROR the servers serve different models (speculative {spec.url}: llama-8b, baseline {base.url}: "
        "qwen-7b): start them with the same served model name"
    ]
    assert "topology: pooled" in out


def test_a_wrong_api_key_and_the_engine_signal(simulator: StartSim, capsys: pytest.CaptureFixture[str]) -> None:
    spec = simulator("speculative", *SIM, "--api-key", "right-key")
    base = simulator("baseline", *SIM, "--api-key", "right-key", "--no-metrics")
    code, out = doctor(capsys, spec.url, base.url, "--api-key", "wrong-key", "--load-signal", "engine")
    assert code == 1 and "wrong-key" not in out and "right-key" not in out
    lines = problems(out)
    assert f"ERROR speculative {spec.url}: refuses the API key: set SPECGATE_UPSTREAM_API_KEY to its --api-key" in lines
    assert any(line.startswith("ERROR SPECGATE_LOAD_SIGNAL=engine needs each server's engine load") for line in lines)
    code, out = doctor(capsys, spec.url, spec.url.replace("://", "://user:pw@"), "--api-key", "right-key")
    assert "pw@" not in out and "a server URL holds credentials" in out


def test_json_report_and_the_module_entry_point(pair: tuple[Sim, Sim], tmp_path: Path) -> None:
    spec, base = pair
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT)}
    args = ["--speculative", spec.url, "--baseline", base.url, "--json"]
    done = subprocess.run(
        [sys.executable, "-m", "proxy.doctor", *args], capture_output=True, env=env, cwd=tmp_path, timeout=60
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    doc = orjson.loads(done.stdout)
    assert doc["ok"] is True and doc["problems"] == []
    assert [s["speculates"] for s in doc["servers"]] == [True, False]
    assert doc["recommendation"]["topology"] == "paired"
    bad = subprocess.run(
        [sys.executable, "-m", "proxy.doctor", "--speculative", "nope"], capture_output=True, env=env, cwd=tmp_path
    )  # fmt: skip
    assert bad.returncode == 2 and b"SPECGATE_SPECULATIVE_URL" in bad.stderr and b"Traceback" not in bad.stderr


def test_a_server_still_warming_up_blocks(simulator: StartSim, capsys: pytest.CaptureFixture[str]) -> None:
    spec = simulator("speculative", *SIM)
    # /health answers 503 for its warm-up (SGLang's while it loads): listening, not ready.
    base = simulator("baseline", *SIM, "--warmup-s", "3600", wait_ready=False)
    wait_for(lambda: _listening(base.port), timeout_s=30)
    code, out = doctor(capsys, spec.url, base.url)
    assert code == 1
    assert problems(out) == [
        f"ERROR baseline {base.url}: not ready (/health answered 503): wait until /health answers 200"
    ]


def test_an_engine_setting_the_metrics_contradict_blocks(
    pair: tuple[Sim, Sim], capsys: pytest.CaptureFixture[str]
) -> None:
    spec, base = pair
    code, out = doctor(capsys, spec.url, base.url, "--engine", "vllm")
    assert code == 1
    lines = problems(out)
    for sim, role in ((spec, "speculative"), (base, "baseline")):
        want = f"ERROR {role} {sim.url}: SPECGATE_ENGINE=vllm but its /metrics are sglang's: set SPECGATE_ENGINE=auto"
        assert want in lines, out


def _listening(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
    except OSError:
        return False
    return True


def test_adaptive_servers_alone_and_one_listed_as_speculative(
    simulator: StartSim, capsys: pytest.CaptureFixture[str]
) -> None:
    steps = ("--profile", "h200-llama8b", "--time-scale", "20")
    first, second = simulator("adaptive", *steps), simulator("adaptive", *steps)
    code, out = doctor(capsys, "", "", "--adaptive", f"{first.url},{second.url}")
    assert code == 0, out
    assert "topology: adaptive" in out and f"SPECGATE_ADAPTIVE_URL={first.url},{second.url}" in out
    assert "SPECGATE_TOPOLOGY" not in out
    base = simulator("baseline", *steps)
    code, out = doctor(capsys, first.url, base.url)
    assert code == 0, out  # it still drafts: a warning, not a block
    assert f"WARN  speculative {first.url}: drafts adaptively in the engine" in "\n".join(problems(out))
