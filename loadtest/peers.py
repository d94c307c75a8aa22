"""The proxies `loadtest overhead` measures specgate beside, and how each is started: nginx as a plain
reverse proxy (configured here on loopback, one process, round robin), and the peers users would
deploy instead (LiteLLM's proxy, SGLang's Rust gateway smg, vLLM's Rust router vllm-router) when
scripts/install-peers put them in a venv. A proxy that does not start says why, from its log."""

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from .procs import Proc, free_port, http_status

# The model name every proxy serves and the backend answers to.
MODEL = "sim"
# LiteLLM's proxy refuses to start without a master key; clients then send it.
_LITELLM_KEY = "sk-overhead-benchmark"
# The peers, by the name their results carry, and the executable scripts/install-peers gives each.
PEERS = {"litellm": "litellm", "smg": "smg", "vllm-router": "vllm-router"}


def nginx_conf(port: int, backend_ports: Sequence[int], workdir: Path) -> Path:
    # One process (no master) so that its CPU can be read like the others'.
    conf = workdir / "nginx.conf"
    servers = " ".join(f"server 127.0.0.1:{p};" for p in backend_ports)
    conf.write_text(f"""
master_process off;
worker_processes 1;
pid {workdir}/nginx.pid;
error_log stderr warn;
daemon off;
events {{ worker_connections 4096; }}
http {{
  access_log off;
  client_body_temp_path {workdir}/body;
  proxy_temp_path {workdir}/proxy;
  upstream backend {{ {servers} keepalive 512; }}
  server {{
    listen 127.0.0.1:{port} backlog=4096;
    location / {{
      proxy_pass http://backend;
      proxy_http_version 1.1;
      proxy_set_header Connection "";
      proxy_buffering off;
      proxy_request_buffering off;
    }}
  }}
}}
""")
    return conf


def _litellm_conf(backend_ports: Sequence[int], workdir: Path) -> Path:
    # One deployment per server under one model name: LiteLLM's router spreads requests over them.
    conf = workdir / "litellm.yaml"
    deployments = "".join(f"""
  - model_name: {MODEL}
    litellm_params:
      model: openai/{MODEL}
      api_base: http://127.0.0.1:{p}/v1
      api_key: none""" for p in backend_ports)  # fmt: skip
    conf.write_text(f"model_list:{deployments}\nlitellm_settings:\n  telemetry: false\n  drop_params: true\n")
    return conf


def free_ports(n: int) -> list[int]:
    """n ports free now and distinct: each socket stays bound until all are chosen."""
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [int(s.getsockname()[1]) for s in socks]
    finally:
        for s in socks:
            s.close()


@dataclass(frozen=True)
class Launch:
    """How a proxy is started, and the path that answers 200 on its port once it is ready."""

    name: str
    argv: list[str]
    port: int
    ready_path: str
    ready_timeout_s: float
    env: dict[str, str] = field(default_factory=dict)
    headers: dict[str, str] = field(default_factory=dict)


def smg_argv(binary: str, port: int, metrics_port: int, workers: Sequence[str]) -> list[str]:
    """SGLang's gateway as a plain router over HTTP workers."""
    # round_robin: the hop is measured, not the default cache_aware policy's prefix tree. Metrics
    # default to port 29000, where a second router or anything else would stop it from starting.
    # A router over HTTP workers needs no tokenizer; without the flag it would look for the one of
    # the model the workers name.
    return [binary, "launch", "--host", "127.0.0.1", "--port", str(port), "--worker-urls", *workers,
            "--policy", "round_robin", "--prometheus-host", "127.0.0.1", "--prometheus-port", str(metrics_port),
            "--disable-tokenizer-autoload", "--worker-startup-check-interval", "1",
            "--log-level", "warn"]  # fmt: skip


def vllm_router_argv(binary: str, port: int, metrics_port: int, workers: Sequence[str]) -> list[str]:
    """vLLM's router over HTTP workers."""
    # As for smg: round_robin rather than cache_aware, and a metrics port of its own instead of 29000.
    # The startup check interval (30 s by default) bounds how long a worker that is slow to answer
    # its first health check delays readiness.
    return [binary, "--host", "127.0.0.1", "--port", str(port), "--worker-urls", *workers,
            "--policy", "round_robin", "--prometheus-host", "127.0.0.1", "--prometheus-port", str(metrics_port),
            "--worker-startup-check-interval", "1", "--log-level", "warning"]  # fmt: skip


def litellm_argv(binary: str, port: int, config: Path) -> list[str]:
    return [binary, "--config", str(config), "--host", "127.0.0.1", "--port", str(port), "--num_workers", "1"]


def peer_launches(peers_venv: Path, backend_ports: Sequence[int], workdir: Path) -> tuple[list[Launch], dict[str, str]]:
    """How to start each peer installed in peers_venv in front of the backends, and why each of the
    others is not measured."""
    missing: dict[str, str] = {}
    binaries: dict[str, str] = {}
    for name, executable in PEERS.items():
        path = peers_venv / "bin" / executable
        if path.exists():
            binaries[name] = str(path)
        else:
            missing[name] = f"not installed ({path} is missing; scripts/install-peers installs it)"
    workers = [f"http://127.0.0.1:{p}" for p in backend_ports]
    ports = iter(free_ports(5))
    launches = []
    if "litellm" in binaries:
        port = next(ports)
        # LOCAL_MODEL_COST_MAP: LiteLLM would otherwise fetch its price list from the internet.
        env = {"LITELLM_LOCAL_MODEL_COST_MAP": "True", "LITELLM_LOG": "ERROR", "LITELLM_MASTER_KEY": _LITELLM_KEY,
               "DISABLE_SCHEMA_UPDATE": "true"}  # fmt: skip
        argv = litellm_argv(binaries["litellm"], port, _litellm_conf(backend_ports, workdir))
        launches.append(Launch("litellm", argv, port, "/health/liveliness", 120.0, env,
                               {"Authorization": f"Bearer {_LITELLM_KEY}"}))  # fmt: skip
    # /readiness answers 200 once the workers are registered and healthy (/health already before).
    if "smg" in binaries:
        port, metrics = next(ports), next(ports)
        launches.append(Launch("smg", smg_argv(binaries["smg"], port, metrics, workers), port, "/readiness", 60.0))
    if "vllm-router" in binaries:
        port, metrics = next(ports), next(ports)
        argv = vllm_router_argv(binaries["vllm-router"], port, metrics, workers)
        launches.append(Launch("vllm-router", argv, port, "/readiness", 60.0))
    return launches, missing


def answers_ready(proc: Proc, url: str, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not proc.alive():
            return False
        if http_status(url, timeout_s=1.0) == 200:
            return True
        time.sleep(0.1)
    return False


_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")


def last_line(log: Path) -> str:
    lines = [_ANSI.sub("", line).strip() for line in log.read_text(errors="replace").splitlines()]
    lines = [line for line in lines if line]
    return lines[-1][:300] if lines else ""


def start_launch(launch: Launch, workdir: Path) -> tuple[Proc, str | None]:
    """Start a proxy and wait, at most its timeout, until it is ready: the process, and why it is not
    measured (None when it is ready)."""
    log = workdir / f"{launch.name}.log"
    with log.open("wb") as out:
        popen = subprocess.Popen(launch.argv, stdout=out, stderr=subprocess.STDOUT,
                                 env={**os.environ, **launch.env})  # fmt: skip
    proc = Proc(launch.name, popen)
    url = f"http://127.0.0.1:{launch.port}{launch.ready_path}"
    if answers_ready(proc, url, launch.ready_timeout_s):
        return proc, None
    if proc.alive():
        reason = f"not ready at {url} within {launch.ready_timeout_s:g} s"
    else:
        reason = f"exited with code {popen.returncode}"
    last = last_line(log)
    return proc, f"{reason}: {last}" if last else reason


def nginx_binary() -> str | None:
    return shutil.which("nginx") or ("/usr/sbin/nginx" if Path("/usr/sbin/nginx").exists() else None)


def proxy_launches(
    nginx: bool, peers_venv: Path | None, backend_ports: Sequence[int], workdir: Path
) -> tuple[list[Launch], dict[str, str]]:
    """How to start nginx (`nginx`) and each peer installed in `peers_venv` in front of the
    backends, and why each of the others is not measured."""
    launches: list[Launch] = []
    not_measured: dict[str, str] = {}
    binary = nginx_binary()
    if nginx and binary:
        port = free_port()
        conf = nginx_conf(port, backend_ports, workdir)
        launches.append(Launch("nginx", [binary, "-c", str(conf), "-e", "stderr"], port, "/health", 10.0))
    elif nginx:
        not_measured["nginx"] = "not found (Debian: apt-get install nginx-light)"
    if peers_venv is not None:
        peers, missing = peer_launches(peers_venv, backend_ports, workdir)
        launches += peers
        not_measured.update(missing)
    return launches, not_measured
