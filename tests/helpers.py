"""Shared test helpers: waiting for a condition, scraping Prometheus text, reading SSE streams,
the gateway's /routing."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import inspect
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import orjson

from loadtest.procs import Proc, on_free_port, start
from proxy.config import Settings
from proxy.fleet import promtext
from proxy.fleet.servers import Health, Server, servers_of
from proxy.fleet.topology import Topology
from proxy.observability.metrics import Metrics
from proxy.policy.base import PolicyConfig, PolicyName
from proxy.policy.beliefs import AdaptiveConfig


def scrape(url: str) -> dict[str, float]:
    """Every sample of a /metrics page, summed over labels, by sample name."""
    return promtext.totals(httpx.get(url + "/metrics", timeout=5).text)


def sse_events(raw: bytes) -> list[bytes]:
    """The `data:` payloads of an SSE body, in order."""
    events = []
    for block in raw.split(b"\n\n"):
        if block.strip():
            assert block.startswith(b"data: "), block
            events.append(block[len(b"data: ") :])
    return events


def sse_json(raw: bytes) -> list[dict[str, Any]]:
    events = sse_events(raw)
    assert events[-1] == b"[DONE]"
    return [orjson.loads(e) for e in events[:-1]]


def wait_for(check: Callable[[], object], timeout_s: float = 5.0, interval_s: float = 0.02) -> float:
    """Poll `check` until it is truthy; fail after `timeout_s`. Returns the seconds it took.
    The bounded wait that replaces a fixed sleep before an assertion."""
    t0 = time.monotonic()
    deadline = t0 + timeout_s
    while not check():
        assert time.monotonic() < deadline, f"condition not reached within {timeout_s:g} s: {check}"
        time.sleep(interval_s)
    return time.monotonic() - t0


async def wait_until(
    check: Callable[[], object | Awaitable[object]], timeout_s: float = 5.0, interval_s: float = 0.02
) -> float:
    """`wait_for` in an event loop: `check` may be a coroutine function, and the waits between its
    tries leave the loop to the app and the servers running in it."""
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    while not await _result(check()):
        assert loop.time() < t0 + timeout_s, f"condition not reached within {timeout_s:g} s: {check}"
        await asyncio.sleep(interval_s)
    return loop.time() - t0


async def _result(value: object | Awaitable[object]) -> object:
    return await value if inspect.isawaitable(value) else value


def routing(url: str, **headers: str) -> dict[str, Any]:
    """The gateway's /routing at `url`."""
    r = httpx.get(url + "/routing", headers=headers, timeout=5)
    assert r.status_code == 200, r.text
    found: dict[str, Any] = r.json()
    return found


# A generation that outlasts any test, within the simulator's context (131072 tokens: SGLang, and so
# the simulator, refuses prompt + max_tokens past it with 400).
LONG = {"prompt": "p", "max_tokens": 120_000, "stream": True}


@contextlib.contextmanager
def open_stream(url: str, body: dict[str, Any] | None = None, **kw: Any) -> Iterator[httpx.Response]:
    """A streaming completion at `url` held open (first event read) until the block ends."""
    with httpx.Client(timeout=30) as http, http.stream("POST", url + "/v1/completions", json=body or LONG, **kw) as r:
        lines = r.iter_lines()
        next(lines)
        r.extensions["lines"] = lines  # keep the generator referenced: dropping it closes the stream
        yield r


@dataclass
class Proxy:
    """specgate running as a process: its URL, the process, and the environment it was given."""

    url: str
    proc: Proc
    env: dict[str, str]


def start_proxy(speculative_url: str, baseline_url: str, ready: str = "/health", **env: str) -> Proxy:
    """specgate as a process (`python -m proxy`) on a free loopback port in front of the given
    servers, returned once `ready` answers 200. `env`: SPECGATE_* settings over these defaults."""
    return on_free_port(lambda port: _start_proxy(port, speculative_url, baseline_url, ready, env))


def _start_proxy(port: int, speculative_url: str, baseline_url: str, ready: str, env: dict[str, str]) -> Proxy:
    full = {
        "SPECGATE_HOST": "127.0.0.1",
        "SPECGATE_PORT": str(port),
        "SPECGATE_SPECULATIVE_URL": speculative_url,
        "SPECGATE_BASELINE_URL": baseline_url,
        "SPECGATE_HEALTH_INTERVAL_S": "0.2",
        "SPECGATE_LOG_LEVEL": "warning",
        **env,
    }
    url = f"http://127.0.0.1:{port}"
    return Proxy(url, start("proxy", ["-m", "proxy"], ready_url=url + ready, env=full), full)


@dataclass
class Clock:
    """A clock the test moves by hand (`clock.t += 2`), for what takes `clock=`."""

    t: float = 1000.0

    def __call__(self) -> float:
        return self.t


# What the policy does with nothing asked of the adaptive extras: no dwell, no probes, the
# shortest freshness the gateway uses, and no hold before speculation returns (the default's 2 s is
# tested in test_config and test_policy). Tests of those extras set them.
PLAIN_POLICY: dict[str, Any] = {
    "low_hold_s": 0.0,
    "min_dwell_s": 0.0,
    "probe_s": 0.0,
    "probe_max_s": 0.0,
    "probe_max_load": 0,
    "probe_shadow": False,
    "accept_fresh_s": 10.0,
}


def policy_cfg(
    policy: PolicyName = "threshold", high: int | None = None, low: int | None = None, **fields: Any
) -> PolicyConfig:
    """The configuration the gateway builds for `policy` (Settings.policy_config: the defaults'
    one source), with these watermarks and fields."""
    over: dict[str, Any] = {"policy": policy, **PLAIN_POLICY, **fields}
    if high is not None:
        over["high_watermark"] = high
    if low is not None:
        over["low_watermark"] = low
    return dataclasses.replace(Settings(_env_file=None).policy_config(None), **over)


def adaptive_cfg(**fields: Any) -> AdaptiveConfig:
    return dataclasses.replace(Settings(_env_file=None).adaptive_config(), **fields)


@dataclass
class Rig:
    """What the gateway builds at start for these settings, nothing started: the servers (their
    `health` set by the test as the health loops would) and the metrics, for a Router or a Fleet."""

    settings: Settings
    topology: Topology
    servers: dict[str, Server]
    metrics: Metrics

    @property
    def health(self) -> dict[str, Health]:
        return {name: s.health for name, s in self.servers.items()}


def rig(healthy: bool = True, **settings: Any) -> Rig:
    """The rig for these settings, every server healthy unless asked."""
    s = Settings(_env_file=None, **settings)
    t = s.routing_topology()
    r = Rig(s, t, servers_of(t), Metrics(t.names(), [g.name for g in t.groups]))
    for h in r.health.values():
        h.healthy = healthy
    return r
