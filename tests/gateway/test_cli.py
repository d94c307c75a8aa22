"""The `specgate` command: each subcommand reaches the module that owns it, with its own --help,
and `serve` runs the gateway from the same settings as `python -m proxy`."""

from __future__ import annotations

import tomllib
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from loadtest.procs import Proc, on_free_port, start
from proxy.config import DEPRECATED, Settings
from specgate import cli

from ..conftest import StartSim

ROOT = Path(__file__).resolve().parents[2]


def test_the_console_script_is_the_cli() -> None:
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts == {"specgate": "specgate.cli:main"}


@pytest.mark.parametrize("command", list(cli.COMMANDS))
def test_each_command_has_its_own_help(command: str, capsys: pytest.CaptureFixture[str]) -> None:
    # argparse exits on --help; a command may also catch that and return its status.
    try:
        code: object = cli.main([command, "--help"])
    except SystemExit as done:
        code = done.code
    assert code == 0
    assert f"usage: specgate {command}" in capsys.readouterr().out


def test_the_top_level_help_lists_every_command(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as done:
        cli.main(["--help"])
    assert done.value.code == 0
    out = capsys.readouterr().out
    assert all(f"  {name} " in out for name in cli.COMMANDS)


@pytest.mark.parametrize("argv", [[], ["bogus"], ["--bogus"]])
def test_no_command_or_an_unknown_one_is_a_usage_error(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as done:
        cli.main(argv)
    assert done.value.code == 2
    assert "usage: specgate" in capsys.readouterr().err


def test_serve_help_lists_every_setting_with_its_default(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        cli.main(["serve", "--help"])
    out = capsys.readouterr().out
    for name in Settings.model_fields:
        line = next(ln for ln in out.splitlines() if ln.strip().startswith(f"SPECGATE_{name.upper()} "))
        assert ("(deprecated)" in line) == (name in DEPRECATED)
    assert any(ln.split() == ["SPECGATE_PORT", "8000"] for ln in out.splitlines())


def test_serve_refuses_a_bad_setting_with_its_name(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("SPECGATE_PORT", "0")
    assert cli.main(["serve", "--env-file", str(tmp_path / "none.env")]) == 2
    assert "SPECGATE_PORT" in capsys.readouterr().err


def test_a_loadtest_command_reports_its_own_errors(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as done:
        cli.main(["calibrate", "--speculative", "http://127.0.0.1:9"])
    assert done.value.code == 2
    assert "usage: specgate calibrate" in capsys.readouterr().err


@pytest.fixture
def served(simulator: StartSim, tmp_path: Path) -> Iterator[tuple[str, Proc]]:
    """`specgate serve --env-file FILE` in front of two simulators, its settings only in the file."""
    spec, base = simulator("speculative", "--time-scale", "20"), simulator("baseline", "--time-scale", "20")

    def launch(port: int) -> tuple[str, Proc]:
        env_file = tmp_path / "specgate.env"
        env_file.write_text(
            f"SPECGATE_HOST=127.0.0.1\nSPECGATE_PORT={port}\nSPECGATE_SPECULATIVE_URL={spec.url}\n"
            f"SPECGATE_BASELINE_URL={base.url}\nSPECGATE_POLICY=adaptive\nSPECGATE_LOG_LEVEL=warning\n"
        )
        url = f"http://127.0.0.1:{port}"
        args = ["-m", "specgate", "serve", "--env-file", str(env_file)]
        return url, start("specgate", args, ready_url=url + "/health")

    url, proc = on_free_port(launch)
    yield url, proc
    proc.stop()


def test_serve_runs_the_gateway_from_its_env_file(served: tuple[str, Proc]) -> None:
    url, _ = served
    assert httpx.get(f"{url}/routing", timeout=5).json()["policy"] == "adaptive"
    r = httpx.post(
        f"{url}/v1/chat/completions",
        json={"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4},
        timeout=30,
    )
    assert r.status_code == 200
    assert r.json()["usage"]["completion_tokens"] == 4
