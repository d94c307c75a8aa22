"""What specgate reads beside the relayed API, end to end: the engine load signal and when it
cannot be read, passive health, and fields passed on for the server to judge."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import httpx

from loadtest.procs import free_port, http_status

from .conftest import StartStack
from .helpers import LONG, open_stream, routing, scrape, wait_for


def test_unreadable_engine_signal_is_said_not_hidden(stack: StartStack) -> None:
    # SGLang without --enable-metrics: no /metrics on the speculative server.
    s = stack(spec_args=("--no-metrics",), SPECGATE_LOAD_SIGNAL="engine")
    wait_for(lambda: routing(s.url)["backends"]["baseline"]["engine_signal_up"])
    r = routing(s.url)
    assert (r["load_signal"], r["load_signal_in_effect"]) == ("engine", "mixed")
    assert "speculative" in r["load_signal_why"] and "404" in r["load_signal_why"]
    spec, base = r["backends"]["speculative"], r["backends"]["baseline"]
    assert not spec["engine_signal_up"] and "404" in spec["engine_signal_error"] and spec["engine_load"] is None
    assert base["engine"] == "sglang" and base["engine_load"] == 0 and base["engine_signal_error"] is None
    m = scrape(s.url)
    assert m["specgate_engine_signal_up"] == 1  # summed over the two backends: baseline 1, speculative 0
    text = httpx.get(s.url + "/metrics").text
    assert 'specgate_engine_signal_up{backend="speculative"} 0.0' in text
    assert 'specgate_accept_length{backend="speculative"} NaN' in text


def test_no_engine_signal_at_all_routes_on_the_local_count_and_says_so(stack: StartStack) -> None:
    s = stack(sim_args=("--time-scale", "20", "--no-metrics"), SPECGATE_LOAD_SIGNAL="max")
    wait_for(lambda: routing(s.url)["load_signal_in_effect"] == "local")
    assert "no engine load readable" in routing(s.url)["load_signal_why"]
    # The warning comes once per outage, not once per poll: run a second proxy with its log kept.
    port = free_port()
    log_path = Path(f"signal-{port}.log").absolute()
    env = {**s.env, "SPECGATE_PORT": str(port), "SPECGATE_LOG_LEVEL": "info", "SPECGATE_HEALTH_INTERVAL_S": "0.05"}
    with log_path.open("wb") as log:
        proxy = subprocess.Popen([sys.executable, "-m", "proxy"], env=env, stdout=log, stderr=log)
        try:
            deadline = time.monotonic() + 20
            while http_status(f"http://127.0.0.1:{port}/health") != 200:
                assert time.monotonic() < deadline and proxy.poll() is None
                time.sleep(0.05)
            time.sleep(1)  # about 20 polls
        finally:
            proxy.terminate()
            proxy.wait(10)
    logged = log_path.read_text()
    log_path.unlink()
    warnings = [line for line in logged.splitlines() if "engine load of" in line and "unreadable" in line]
    assert len(warnings) == 2, logged  # one per server
    assert all("SPECGATE_LOAD_SIGNAL=max" in w and "WARNING" in w for w in warnings)


def test_engine_metrics_name_the_engine_and_its_acceptance(stack: StartStack) -> None:
    s = stack(sim_args=("--time-scale", "20", "--live-gauges"), spec_args=("--accept-length", "2.5"))
    httpx.post(s.url + "/v1/completions", json={"prompt": "p", "max_tokens": 40})
    # The simulator's gauge: tokens per decode step over its last log interval (SGLang's own rule).
    wait_for(lambda: 2 <= (routing(s.url)["backends"]["speculative"]["spec_accept_length"] or 0) <= 2.5)
    r = routing(s.url)
    assert r["backends"]["speculative"]["engine"] == "sglang" and r["engine_setting"] == "auto"
    assert r["backends"]["baseline"]["spec_accept_length"] is None  # no speculation there
    assert r["load_signal_in_effect"] == "local" and r["load_signal_why"] is None
    text = httpx.get(s.url + "/metrics").text
    shown = routing(s.url)["backends"]["speculative"]["spec_accept_length"]
    assert f'specgate_accept_length{{backend="speculative"}} {shown}' in text
    assert 'specgate_accept_length{backend="baseline"} NaN' in text


def test_a_configured_engine_that_is_not_there_is_reported(stack: StartStack) -> None:
    s = stack(SPECGATE_ENGINE="vllm", SPECGATE_LOAD_SIGNAL="engine")
    wait_for(lambda: routing(s.url)["load_signal_in_effect"] == "local")
    err = routing(s.url)["backends"]["speculative"]["engine_signal_error"]
    assert "vllm:num_requests_running" in err and "vllm" in err


def test_a_server_answering_proxied_requests_stays_up_while_its_health_is_slow(stack: StartStack) -> None:
    # /health takes 3 s while the server has work (as SGLang's and a saturated llama-server's do),
    # against a 0.3 s health timeout: every poll times out while a stream runs.
    s = stack(
        spec_args=("--busy-health-s", "3"),
        SPECGATE_HEALTH_TIMEOUT_S="0.3",
        SPECGATE_HEALTH_INTERVAL_S="0.2",
    )
    with open_stream(s.url) as r:  # a long stream through specgate: proxied traffic flows
        assert r.headers["x-specgate-backend"] == "speculative"
        deadline = time.monotonic() + 3  # ~6 polls, each timing out
        while time.monotonic() < deadline:
            assert routing(s.url)["backends"]["speculative"]["healthy"]
            time.sleep(0.1)
        assert "proxied requests got answers" in routing(s.url)["backends"]["speculative"]["last_error"]
    wait_for(lambda: routing(s.url)["backends"]["speculative"]["last_error"] is None)
    # The same slow /health with the work coming from elsewhere (nothing through specgate): down.
    with open_stream(s.spec.url, LONG):
        wait_for(lambda: not routing(s.url)["backends"]["speculative"]["healthy"], timeout_s=10)
        assert "timed out 3 times" in routing(s.url)["backends"]["speculative"]["last_error"]
    wait_for(lambda: routing(s.url)["backends"]["speculative"]["healthy"], timeout_s=10)


def test_fields_specgate_need_not_understand_are_the_servers_to_judge(stack: StartStack) -> None:
    s = stack()
    for body in ({"prompt": "p", "stream": "yes"}, {"prompt": "p", "stream": True, "stream_options": 3}):
        r = httpx.post(s.url + "/v1/completions", json=body)
        # The server's own answer (the simulator refuses both), not specgate's.
        assert r.status_code == 400 and r.headers["x-specgate-backend"] == "speculative", r.text
    r = httpx.post(
        s.url + "/v1/completions",
        json={"prompt": "p", "max_tokens": 2, "stream": True, "stream_options": {"include_usage": "yes"}},
    )
    assert r.headers["x-specgate-backend"] == "speculative"  # passed on as sent
    assert routing(s.url)["inflight"] == 0
