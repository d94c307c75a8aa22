"""Reliability under faults and shutdown: the chaos soak's short version, SIGTERM under load, and
secrets that must never leave the proxy."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
from pathlib import Path

import httpx
import pytest

from loadtest.procs import http_status

from ..conftest import StartStack
from ..helpers import routing, wait_for


def test_chaos_soak_short(tmp_path: Path) -> None:
    out = tmp_path / "chaos.json"
    proc = subprocess.run(
        [sys.executable, "-m", "loadtest", "chaos", "--phase-s", "2", "--concurrency", "8",
         "--memory-requests", "100", "--out", str(out)],
        capture_output=True, text=True, timeout=240,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    data = json.loads(out.read_text())
    report = data["report"]
    assert data["ok"] and report["violations"] == []
    assert report["kills"] == 5
    assert set(report["leaks"].values()) == {0}
    assert report["disconnects_steady"] > 0 and report["aborted_steady"] >= report["disconnects_steady"]
    assert report["outcomes"]["ok"] > 100
    assert report["rss_after_10n_mib"] - report["rss_after_n_mib"] < 20
    assert "PASS" in proc.stdout


def test_sigterm_under_load_finishes_streams_and_refuses_new_ones(stack: StartStack) -> None:
    s = stack(sim_args=("--time-scale", "2"))
    body = {"prompt": "p", "max_tokens": 60, "stream": True}  # ~0.4 s each at this speed
    results: list[tuple[int, bytes]] = []

    def client() -> None:
        with httpx.stream("POST", s.url + "/v1/completions", json=body, timeout=30) as r:
            results.append((r.status_code, r.read()))

    threads = [threading.Thread(target=client) for _ in range(10)]
    for t in threads:
        t.start()
    wait_for(lambda: routing(s.url)["inflight"] == 10, timeout_s=10)
    s.proxy.popen.send_signal(signal.SIGTERM)
    wait_for(lambda: http_status(s.url + "/health") is None)  # the listener closes at once...
    with pytest.raises(httpx.ConnectError):  # ...so no new connections once draining
        httpx.post(s.url + "/v1/completions", json={"prompt": "p", "max_tokens": 2}, timeout=5)
    assert s.proxy.alive()  # while the streams run on
    for t in threads:
        t.join(30)
    assert s.proxy.popen.wait(15) == 0
    assert len(results) == 10
    for status, raw in results:
        assert status == 200
        assert raw.endswith(b"data: [DONE]\n\n") and b'"error"' not in raw  # nothing cut mid-stream


def test_upstream_key_never_reaches_a_client_or_a_log(stack: StartStack, tmp_path: Path) -> None:
    key = "upstream-secret-4f9c"
    s = stack(sim_args=("--time-scale", "20", "--api-key", key), SPECGATE_UPSTREAM_API_KEY=key,
              SPECGATE_API_KEYS="client-key-77", SPECGATE_LOG_LEVEL="debug")  # fmt: skip
    # The proxy under test logs to a file we can read: restart it with stderr captured.
    s.proxy.stop()
    log_path = tmp_path / "proxy.log"
    with log_path.open("wb") as log:
        proxy = subprocess.Popen([sys.executable, "-m", "proxy"], env={**s.env}, stdout=log, stderr=log)
        try:
            wait_for(lambda: proxy.poll() is not None or http_status(s.url + "/ready") == 200, timeout_s=20)
            assert proxy.poll() is None, log_path.read_text()
            seen = b""
            for headers in ({"Authorization": "Bearer client-key-77"}, {"Authorization": "Bearer wrong"}, {}):
                for path, body in (("/v1/completions", {"prompt": "secret prompt text", "max_tokens": 3}),
                                   ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                                                             "max_tokens": 3, "stream": True})):  # fmt: skip
                    r = httpx.post(s.url + path, json=body, headers=headers)
                    seen += r.content + str(r.headers).encode()
            for path in ("/routing", "/metrics", "/health", "/ready"):
                r = httpx.get(s.url + path)
                seen += r.content + str(r.headers).encode()
            assert key.encode() not in seen
        finally:
            proxy.send_signal(signal.SIGTERM)
            proxy.wait(15)
    logged = log_path.read_bytes()
    assert logged, "the proxy logged nothing at debug level"
    assert key.encode() not in logged
    assert b"client-key-77" not in logged
    assert b"secret prompt text" not in logged
