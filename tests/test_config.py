"""Settings come from SPECGATE_* variables; a bad value stops the start with one line naming it."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from proxy.config import Settings


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


@pytest.mark.parametrize(
    ("env", "named"),
    [
        ({"SPECGATE_HIGH_WATERMARK": "many"}, "SPECGATE_HIGH_WATERMARK"),
        ({"SPECGATE_LOW_WATERMARK": "9", "SPECGATE_HIGH_WATERMARK": "4"}, "SPECGATE_LOW_WATERMARK"),
        ({"SPECGATE_POLICY": "random"}, "SPECGATE_POLICY"),
        ({"SPECGATE_LOAD_SIGNAL": "gpu"}, "SPECGATE_LOAD_SIGNAL"),
        ({"SPECGATE_SPECULATIVE_URL": "localhost:30001"}, "SPECGATE_SPECULATIVE_URL"),
        ({"SPECGATE_READ_TIMEOUT_S": "-1"}, "SPECGATE_READ_TIMEOUT_S"),
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
