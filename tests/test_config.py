"""Settings come from SPECGATE_* variables; a bad value stops the start with one line naming it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import orjson
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


def _cal_file(tmp_path: Path, **over: object) -> Path:
    cal = {
        "format": "specgate-calibration/1",
        "levels": [1, 10, 30],
        "speculative": {"output_tok_s": [180, 1100, 1650], "accept_length": [3.0, 3.0, None]},
        "baseline": {"output_tok_s": [100, 880, 1950]},
        "accept_length": 3.0,
        "recommendation": {"high_watermark": 19, "low_watermark": 14, "verdict": "crosses"},
        **over,
    }
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
