"""Settings come from SPECGATE_* variables; a bad value stops the start with one line naming it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import orjson
import pytest

from loadtest.procs import free_port, http_status
from proxy.config import Settings, redact_url

from ..conftest import StartSim
from ..helpers import wait_for


def test_defaults_and_parsing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SPECGATE_API_KEYS", "k1, k2,,")
    monkeypatch.setenv("SPECGATE_POLICY", "spillover")
    monkeypatch.setenv("SPECGATE_BASELINE_URL", "http://10.0.0.2:30002/")
    s = Settings(_env_file=None)
    assert s.api_keys == ("k1", "k2")
    assert s.policy == "spillover"
    assert s.baseline_url == "http://10.0.0.2:30002"
    assert (s.host, s.port, s.load_signal, s.log_format) == ("0.0.0.0", 8000, "local", "text")
    assert s.low_watermark <= s.high_watermark


def test_safe_defaults_at_the_crossover() -> None:
    # Speculation returns after 2 s at the low watermark, and the engines' load is read every
    # 0.5 s where the mode routes on it (issue 28's scale-out run: loadtest scaleout --defaults).
    s = Settings(_env_file=None)
    assert (s.low_watermark_hold_s, s.scrape_every_s) == (2.0, 2.0)  # local: with the health poll
    assert Settings(_env_file=None, load_signal="engine").scrape_every_s == 0.5
    assert Settings(_env_file=None, load_signal="max", health_interval_s=0.3).scrape_every_s == 0.3
    assert Settings(_env_file=None, load_signal="engine", scrape_interval_s=0.2).scrape_every_s == 0.2
    # A turn leaves its server only where the priced rule and the one by requests in flight agree
    # (docs/benchmarks/2026-12-07-affinity.md: 1.04x-1.06x the rule by requests in flight at 1+3 8k/72).
    assert s.policy_config(None).affinity_rule == "in_flight"  # the priced rules are opt-in
    # A full baseline spills to the speculative pool's room (docs/routing.md); 0 turns it off, and a
    # room above the mark is refused only while the spill is on.
    assert (s.policy_config(None).kv_spill_at, s.policy_config(None).kv_spill_room) == (0.9, 0.6)
    assert Settings(_env_file=None, kv_spill_at=0, kv_spill_room=1).policy_config(None).kv_spill_at == 0
    # The mark alone set below the room's default: the room follows it down.
    assert Settings(_env_file=None, kv_spill_at=0.5).policy_config(None).kv_spill_room == 0.5


@pytest.mark.parametrize(
    ("env", "named"),
    [
        ({"SPECGATE_HIGH_WATERMARK": "many"}, "SPECGATE_HIGH_WATERMARK"),
        ({"SPECGATE_LOW_WATERMARK": "9", "SPECGATE_HIGH_WATERMARK": "4"}, "SPECGATE_LOW_WATERMARK"),
        ({"SPECGATE_POLICY": "random"}, "SPECGATE_POLICY"),
        ({"SPECGATE_LOAD_SIGNAL": "gpu"}, "SPECGATE_LOAD_SIGNAL"),
        ({"SPECGATE_AFFINITY_RULE": "cheapest"}, "SPECGATE_AFFINITY_RULE"),
        ({"SPECGATE_KV_SPILL_AT": "90"}, "SPECGATE_KV_SPILL_AT"),  # a fraction, not a percentage
        ({"SPECGATE_KV_SPILL_AT": "0.5", "SPECGATE_KV_SPILL_ROOM": "0.7"}, "SPECGATE_KV_SPILL_ROOM"),
        ({"SPECGATE_SPECULATIVE_URL": "localhost:30001"}, "SPECGATE_SPECULATIVE_URL"),
        ({"SPECGATE_READ_TIMEOUT_S": "-1"}, "SPECGATE_READ_TIMEOUT_S"),
        # URLs that parse as http:// but cannot be connected to: one line, not a traceback (exit 3).
        ({"SPECGATE_SPECULATIVE_URL": "http://127.0.0.1:abc"}, "SPECGATE_SPECULATIVE_URL"),
        ({"SPECGATE_BASELINE_URL": "http://127.0.0.1:99999"}, "SPECGATE_BASELINE_URL"),
        ({"SPECGATE_BASELINE_URL": "http://[::1:30002"}, "SPECGATE_BASELINE_URL"),
        ({"SPECGATE_BASELINE_URL": "http://:30002"}, "SPECGATE_BASELINE_URL"),
        ({"SPECGATE_BASELINE_URL": "http://h:30002/?x=1"}, "SPECGATE_BASELINE_URL"),
        ({"SPECGATE_TRUSTED_PROXIES": "10.0.0.0/8,not-an-ip"}, "SPECGATE_TRUSTED_PROXIES"),
        ({"SPECGATE_ALLOWED_PATHS": "/v1/chat/completions,/v1/../admin"}, "SPECGATE_ALLOWED_PATHS"),
        ({"SPECGATE_PROTECT_METRICS": "true"}, "SPECGATE_PROTECT_METRICS"),
        ({"SPECGATE_HEADER_TIMEOUT_S": "0"}, "SPECGATE_HEADER_TIMEOUT_S"),
        ({"SPECGATE_MAX_CLIENT_CONNECTIONS": "0"}, "SPECGATE_MAX_CLIENT_CONNECTIONS"),
    ],
)
def test_bad_setting_exits_non_zero_naming_it(env: dict[str, str], named: str) -> None:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("SPECGATE_")}
    proc = subprocess.run(
        [sys.executable, "-m", "proxy"], env={**clean, **env}, capture_output=True, text=True, timeout=30
    )
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and named in lines[0], proc.stderr


# A valid calibration file's object (test_hostile_config breaks it value by value).
CALIBRATION: dict[str, object] = {
    "format": "specgate-calibration/1",
    "levels": [1, 10, 30],
    "speculative": {"output_tok_s": [180, 1100, 1650], "accept_length": [3.0, 3.0, None]},
    "baseline": {"output_tok_s": [100, 880, 1950]},
    "accept_length": 3.0,
    "recommendation": {"high_watermark": 19, "low_watermark": 14, "verdict": "crosses"},
}


def _cal_file(tmp_path: Path, **over: object) -> Path:
    cal = {**CALIBRATION, **over}
    path = tmp_path / "calibration.json"
    path.write_bytes(orjson.dumps(cal))
    return path


@pytest.mark.parametrize(
    ("over", "says"),
    [
        ({"format": "other/1"}, "format"),
        ({"levels": [1, 10, 10]}, "levels"),
        ({"baseline": {"output_tok_s": [100, 880]}}, "baseline.output_tok_s"),
        ({"baseline": {"output_tok_s": [100, -1, 3]}}, "baseline.output_tok_s"),
        ({"accept_length": 0.5}, "accept_length"),
        ({"recommendation": {"high_watermark": 2, "low_watermark": 5, "verdict": "crosses"}}, "low_watermark"),
    ],
)
def test_bad_calibration_file_exits_2_naming_it(tmp_path: Path, over: dict[str, object], says: str) -> None:
    path = _cal_file(tmp_path, **over)
    clean = {k: v for k, v in os.environ.items() if not k.startswith("SPECGATE_")}
    env = {**clean, "SPECGATE_CALIBRATION": str(path)}
    proc = subprocess.run([sys.executable, "-m", "proxy"], env=env, capture_output=True, text=True, timeout=30)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "SPECGATE_CALIBRATION" in lines[0] and str(path) in lines[0], proc.stderr
    assert says in lines[0]


def test_missing_or_broken_calibration_file_exits_2(tmp_path: Path) -> None:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("SPECGATE_")}
    broken = tmp_path / "broken.json"
    broken.write_text("{not json")
    for path, says in ((tmp_path / "absent.json", "cannot read"), (broken, "not JSON")):
        env = {**clean, "SPECGATE_CALIBRATION": str(path)}
        proc = subprocess.run([sys.executable, "-m", "proxy"], env=env, capture_output=True, text=True, timeout=30)
        assert proc.returncode == 2 and says in proc.stderr and len(proc.stderr.strip().splitlines()) == 1


def test_threshold_takes_the_calibrations_watermarks_unless_set(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SPECGATE_CALIBRATION", str(_cal_file(tmp_path)))
    s = Settings(_env_file=None)
    assert s.watermarks(s.load_calibration()) == (19, 14)
    monkeypatch.setenv("SPECGATE_HIGH_WATERMARK", "30")
    s = Settings(_env_file=None)
    assert s.watermarks(s.load_calibration()) == (30, 8)
    monkeypatch.delenv("SPECGATE_CALIBRATION")
    s = Settings(_env_file=None)
    assert s.load_calibration() is None and s.watermarks(None) == (30, 8)


def test_passwords_in_server_urls_are_never_printed(simulator: StartSim, tmp_path: Path) -> None:
    """`http://user:password@host` becomes Basic auth upstream; the password appears in no log line,
    no /routing answer and no error message, whatever the URL's fate."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith("SPECGATE_")}
    # A bad URL: the message names the setting, not the password.
    env = {**clean, "SPECGATE_SPECULATIVE_URL": "http://admin:pw-5ecret@127.0.0.1:notaport"}
    proc = subprocess.run([sys.executable, "-m", "proxy"], env=env, capture_output=True, text=True, timeout=30)
    assert proc.returncode == 2 and "SPECGATE_SPECULATIVE_URL" in proc.stderr
    assert "pw-5ecret" not in proc.stderr and "admin:" not in proc.stderr
    # A good one (and a dead one): the startup line, health warnings, /routing.
    sim = simulator("speculative", "--time-scale", "20")
    port = free_port()
    env = {**clean, "SPECGATE_HOST": "127.0.0.1", "SPECGATE_PORT": str(port), "SPECGATE_LOG_LEVEL": "debug",
           "SPECGATE_SPECULATIVE_URL": f"http://admin:pw-5ecret@127.0.0.1:{sim.port}/",
           "SPECGATE_BASELINE_URL": f"http://ops:pw-d3ad@127.0.0.1:{free_port()}",
           "SPECGATE_HEALTH_INTERVAL_S": "0.2"}  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    log = tmp_path / "proxy.log"
    with log.open("wb") as sink:
        proxy = subprocess.Popen([sys.executable, "-m", "proxy"], env=env, stdout=sink, stderr=subprocess.STDOUT)
    try:
        wait_for(lambda: proxy.poll() is not None or http_status(url + "/ready") == 200, timeout_s=20)
        assert proxy.poll() is None, log.read_text()
        routing = httpx.get(url + "/routing").text
        httpx.post(url + "/v1/completions", json={"prompt": "p", "max_tokens": 2})
        wait_for(lambda: "baseline: cannot connect" in log.read_text())  # the dead server's failed polls
    finally:
        proxy.send_signal(signal.SIGTERM)
        proxy.wait(15)
    out = log.read_text()
    assert f"127.0.0.1:{sim.port}" in routing and "pw-" not in routing
    assert f"speculative=http://127.0.0.1:{sim.port}" in out, out  # the startup line, redacted
    assert "baseline: cannot connect" in out, out  # the dead server's polls are logged too
    assert "pw-5ecret" not in out and "pw-d3ad" not in out and "admin:" not in out and "ops:" not in out


@pytest.mark.parametrize(
    ("url", "shown"),
    [
        ("http://u:p@h:1/x", "http://h:1/x"),
        ("http://u:p@ss@h:1", "http://h:1"),  # an @ in the password: the last @ ends the userinfo
        # Also user h, password `1/path` or `1?q=a`: unencoded, a password may hold any of /?#@, so
        # all up to the last @ goes (Settings refuses a URL with an @ past its host).
        ("http://h:1/path@x", "http://x"),
        ("http://h:1?q=a@b", "http://b"),
        ("https://u@h", "https://h"),
        ("h:1", "h:1"),
    ],
)
def test_redact_url(url: str, shown: str) -> None:
    assert redact_url(url) == shown


def test_empty_values_count_as_unset(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # compose passes `${SPECGATE_HIGH_WATERMARK:-}`: empty must leave the calibration's watermarks.
    monkeypatch.setenv("SPECGATE_CALIBRATION", str(_cal_file(tmp_path)))
    monkeypatch.setenv("SPECGATE_HIGH_WATERMARK", "")
    monkeypatch.setenv("SPECGATE_LOW_WATERMARK", "")
    s = Settings(_env_file=None)
    assert s.watermarks(s.load_calibration()) == (19, 14)
    monkeypatch.setenv("SPECGATE_CALIBRATION", "")
    s = Settings(_env_file=None)
    assert s.calibration is None and s.watermarks(None) == (16, 8)
