"""Hostile settings (issue 25): calibration files that pass the start check and then break serving,
and server URLs whose passwords hold reserved characters. Each is refused at start with one line
(exit 2) that names the setting and never shows a password."""

from __future__ import annotations

import itertools
import math
import os
import subprocess
import sys
from pathlib import Path

import orjson
import pytest
from pydantic import ValidationError

from proxy.config import Settings, describe_error, redact_url
from proxy.policy import calibration as calib
from proxy.policy.base import ROLES, Role
from proxy.policy.beliefs import Adaptive
from proxy.policy.calibration import (
    MAX_ACCEPT,
    MAX_FILE_BYTES,
    MAX_LEVEL,
    MAX_TOK_S,
    MAX_TPOT_MS,
    MAX_WATERMARK,
    MIN_ACCEPT,
    MIN_TOK_S,
    MIN_TPOT_MS,
    CalibrationError,
    load,
    parse,
)
from proxy.policy.crossover import estimate, high_for
from proxy.policy.levelspeeds import Prior, SpeedModel

from ..helpers import adaptive_cfg
from .test_config import CALIBRATION

GOOD = CALIBRATION
REC = {"verdict": "crosses"}
REPO = Path(__file__).resolve().parents[2]


def _clean_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith("SPECGATE_")}


def _run_proxy(cwd: Path, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    # In a bare directory: no local .env is read. A bounded wait: a start that blocks (on a FIFO,
    # say) fails the test instead of hanging it.
    env = {**_clean_env(), "PYTHONPATH": str(REPO), **env}
    return subprocess.run([sys.executable, "-m", "proxy"], cwd=cwd, env=env, capture_output=True, text=True, timeout=30)


def _write(tmp_path: Path, cal: dict[str, object], name: str = "calibration.json") -> Path:
    path = tmp_path / name
    path.write_bytes(orjson.dumps(cal))
    return path


def _refused(monkeypatch: pytest.MonkeyPatch, path: Path | str, says: str) -> str:
    """The one-line start error for SPECGATE_CALIBRATION=path, checked to name the file and `says`."""
    with pytest.raises(CalibrationError, match=says):
        load(str(path))
    monkeypatch.setenv("SPECGATE_CALIBRATION", str(path))
    with pytest.raises(ValidationError) as info:
        Settings(_env_file=None)
    line = describe_error(info.value)
    assert "SPECGATE_CALIBRATION" in line and str(path) in line and says in line, line
    assert "\n" not in line
    return line


# --- Calibration values: finite, positive, in physical ranges -------------------------------------


@pytest.mark.parametrize(
    ("over", "says"),
    [
        # The probes: a start at watermarks=24/18, then 500s from OverflowError in adaptive.high_for.
        ({"speculative": {"output_tok_s": [180, 1e308, 1650]}}, "speculative.output_tok_s"),
        # A denormal: exit 3 with a ZeroDivisionError traceback.
        ({"speculative": {"output_tok_s": [180, 5e-324, 1650]}}, "speculative.output_tok_s"),
        # Every speculative value at 1e308: adaptive watermarks silently 0/0.
        (
            {
                "speculative": {
                    "output_tok_s": [1e308] * 3,
                    "mean_tpot_ms": [1e308] * 3,
                    "accept_length": [1e308] * 3,
                },
                "accept_length": 1e308,
            },
            "speculative",
        ),
        ({"recommendation": {"high_watermark": 2**63 - 1, "low_watermark": 14, **REC}}, "high_watermark"),
        # Each bound, just past it.
        ({"baseline": {"output_tok_s": [100, 880, MAX_TOK_S * 2]}}, "baseline.output_tok_s"),
        ({"baseline": {"output_tok_s": [100, MIN_TOK_S / 2, 1950]}}, "baseline.output_tok_s"),
        ({"baseline": {"output_tok_s": [100, 880, 1950], "mean_tpot_ms": [5e-324, 1, 1]}}, "baseline.mean_tpot_ms"),
        ({"baseline": {"output_tok_s": [100, 880, 1950], "mean_tpot_ms": [1, MAX_TPOT_MS * 2, 1]}}, "mean_tpot_ms"),
        ({"speculative": {"output_tok_s": [1, 2, 3], "accept_length": [MAX_ACCEPT + 1, 2, 2]}}, "accept_length"),
        ({"accept_length": MAX_ACCEPT + 1}, "accept_length"),
        ({"levels": [1, 10, MAX_LEVEL + 1]}, "levels"),
        ({"inconclusive_levels": [2**63 - 1]}, "inconclusive_levels"),
        ({"recommendation": {"high_watermark": MAX_WATERMARK + 1, "low_watermark": 1, **REC}}, "high_watermark"),
        ({"recommendation": {"high_watermark": 19, "low_watermark": -1, **REC}}, "low_watermark"),
    ],
)
def test_out_of_range_calibration_values_are_refused_at_start(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, over: dict[str, object], says: str
) -> None:
    _refused(monkeypatch, _write(tmp_path, {**GOOD, **over}), says)


def test_overflowing_calibration_exits_2_with_one_line(tmp_path: Path) -> None:
    path = _write(tmp_path, {**GOOD, "speculative": {"output_tok_s": [180, 1e308, 1650]}})
    proc = _run_proxy(tmp_path, {"SPECGATE_CALIBRATION": str(path), "SPECGATE_POLICY": "adaptive"})
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "SPECGATE_CALIBRATION" in lines[0] and str(path) in lines[0], proc.stderr
    assert "speculative.output_tok_s" in lines[0]


# --- The file itself: a regular file of at most MAX_FILE_BYTES -------------------------------------


def test_a_device_is_refused_without_reading_it(monkeypatch: pytest.MonkeyPatch) -> None:
    # /dev/zero never ends: read whole, a MemoryError after about 1.35 GB.
    _refused(monkeypatch, "/dev/zero", "not a regular file")


def test_a_fifo_is_refused_without_waiting_for_a_writer(tmp_path: Path) -> None:
    fifo = tmp_path / "calibration.fifo"
    os.mkfifo(fifo)
    proc = _run_proxy(tmp_path, {"SPECGATE_CALIBRATION": str(fifo)})
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "SPECGATE_CALIBRATION" in lines[0] and str(fifo) in lines[0], proc.stderr
    assert "not a regular file" in lines[0]


def test_a_directory_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _refused(monkeypatch, tmp_path, "not a regular file")


def test_an_oversized_file_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Valid JSON, a valid calibration but for its size: the cap holds whatever the content.
    path = _write(tmp_path, {**GOOD, "created": "x" * MAX_FILE_BYTES})
    _refused(monkeypatch, path, "larger than")


def test_a_file_at_the_cap_loads(tmp_path: Path) -> None:
    body = orjson.dumps(GOOD)
    path = tmp_path / "calibration.json"
    path.write_bytes(body + b" " * (MAX_FILE_BYTES - len(body)))
    assert load(str(path)).high_watermark == 19


def test_a_path_with_control_characters_stays_on_one_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "a\nb.json"
    monkeypatch.setenv("SPECGATE_CALIBRATION", str(path))
    with pytest.raises(ValidationError) as info:
        Settings(_env_file=None)
    line = describe_error(info.value)
    assert "\n" not in line and "cannot read" in line and "a\\nb.json" in line, line


# --- The watermark settings share the calibration's bound -------------------------------------------


@pytest.mark.parametrize(
    "name",
    [
        "SPECGATE_HIGH_WATERMARK",
        "SPECGATE_LOW_WATERMARK",
        "SPECGATE_ADAPTIVE_MIN_WATERMARK",
        "SPECGATE_ADAPTIVE_MAX_WATERMARK",
    ],
)
def test_watermark_settings_are_bounded(monkeypatch: pytest.MonkeyPatch, name: str) -> None:
    monkeypatch.setenv("SPECGATE_HIGH_WATERMARK", str(MAX_WATERMARK))
    monkeypatch.setenv("SPECGATE_ADAPTIVE_MAX_WATERMARK", str(MAX_WATERMARK))
    monkeypatch.setenv(name, str(2**63 - 1))
    with pytest.raises(ValidationError) as info:
        Settings(_env_file=None)
    line = describe_error(info.value)
    assert name in line and f"less than or equal to {MAX_WATERMARK}" in line, line
    monkeypatch.setenv(name, str(MAX_WATERMARK))
    Settings(_env_file=None)


# --- Whatever a valid file holds, the adaptive arithmetic stays finite -------------------------------


def _corner(levels: list[int], tok_s: tuple[float, ...], tpot: tuple[float | None, ...], accept: float) -> object:
    return {
        "format": "specgate-calibration/1",
        "levels": levels,
        "speculative": {"output_tok_s": list(tok_s[:2]), "mean_tpot_ms": list(tpot[:2]), "accept_length": [accept] * 2},
        "baseline": {"output_tok_s": list(tok_s[2:]), "mean_tpot_ms": list(tpot[2:])},
        "accept_length": accept,
        "recommendation": {"high_watermark": MAX_WATERMARK, "low_watermark": MAX_WATERMARK, "verdict": "crosses"},
        "inconclusive_levels": [MAX_LEVEL],
    }


def test_files_at_the_bounds_give_finite_watermarks_within_limits(tmp_path: Path) -> None:
    speeds = (MIN_TOK_S, MAX_TOK_S)
    tpots: list[tuple[float | None, ...]] = [(None,) * 4, *itertools.product((MIN_TPOT_MS, MAX_TPOT_MS), repeat=4)]
    cfg = adaptive_cfg(min_watermark=0, max_watermark=MAX_WATERMARK, max_step_per_s=1e9, margin=0.5)
    seen: set[int] = set()
    for levels in ([1, MAX_LEVEL], [MAX_LEVEL - 1, MAX_LEVEL]):
        for tok_s in itertools.product(speeds, repeat=4):
            for tpot in tpots:
                for accept in (MIN_ACCEPT, MAX_ACCEPT):
                    cal = parse(_corner(levels, tok_s, tpot, accept))
                    adaptive = Adaptive(cfg, cal, (MAX_WATERMARK, MAX_WATERMARK), now=0.0)
                    prior = Prior.of(cal)
                    assert all(0 < v < math.inf for v in (*prior.v_spec, *prior.v_base))
                    # Live observations at the extremes of speed, load and acceptance.
                    roles: tuple[Role, ...] = ROLES
                    for i, (backend, load_, speed, live) in enumerate(
                        itertools.product(roles, (1, MAX_LEVEL), speeds, (MIN_ACCEPT, MAX_ACCEPT))
                    ):
                        adaptive.model.observe(backend, load_, speed, live, now=float(i))
                    for reading in (None, MIN_ACCEPT, MAX_ACCEPT):
                        adaptive.update(reading, now=100.0)
                        high, low = adaptive.watermarks()
                        assert 0 <= low <= high <= MAX_WATERMARK
                        e = adaptive.estimate
                        for c in (e.throughput, e.latency):
                            assert c.at is None or math.isfinite(c.at)
                            h = high_for(c)
                            assert h is None or 0 <= h <= MAX_LEVEL
                        seen.add(high)
                    for model in (SpeedModel(prior), SpeedModel(None)):
                        e = estimate(model, MAX_ACCEPT, 0.0, 0.5)
                        assert e.high is None or 0 <= e.high <= MAX_LEVEL
    assert len(seen) > 1  # the corners do move the watermark


def test_bounds_are_documented() -> None:
    doc = calib.__doc__ or ""
    for name in ("MAX_FILE_BYTES", "MIN_TOK_S", "MAX_TOK_S", "MIN_TPOT_MS", "MAX_TPOT_MS", "MAX_ACCEPT", "MAX_LEVEL"):
        assert name in doc, name
    assert "MAX_WATERMARK" in doc


# --- Passwords in server URLs, whatever characters they hold ------------------------------------------

USER, SECRET = "usr7k", "s3cr"  # never in a message, alone or as part of a longer string


def _url_cases() -> list[str]:
    out = []
    for c in "#?/@,:":
        out.append(f"http://{USER}:{SECRET}{c}et@127.0.0.1:1")
    out += [
        f"http://{USER}:{SECRET}%40et#x@127.0.0.1:1",  # a percent-escape, then a fragment mark
        f"http://{USER}:{SECRET}@et#x@127.0.0.1:1",
        f"http://{USER}:12/{SECRET}@127.0.0.1:1",  # parses: host usr7k, port 12, path /s3cr@...
        f"{USER}:{SECRET}@127.0.0.1:1",  # no scheme
        f"{USER}:{SECRET}://x@127.0.0.1:1",
        f"http://{USER}:{SECRET}[@127.0.0.1:1",
        f"http://{USER}:{SECRET}@[::1:1",
        f"http://{USER}:{SECRET}@127.0.0.1:1/?token=x",
    ]
    return out


@pytest.mark.parametrize("name", ["SPECGATE_SPECULATIVE_URL", "SPECGATE_BASELINE_URL"])
@pytest.mark.parametrize("form", ["{}", "a=http://127.0.0.1:2,b={}", "{},http://127.0.0.1:2", "named={}"])
@pytest.mark.parametrize("url", _url_cases())
def test_url_passwords_never_shown(monkeypatch: pytest.MonkeyPatch, name: str, form: str, url: str) -> None:
    monkeypatch.setenv(name, form.format(url))
    other = "SPECGATE_BASELINE_URL" if name == "SPECGATE_SPECULATIVE_URL" else "SPECGATE_SPECULATIVE_URL"
    # As many servers on the other side: a valid URL then makes a valid topology.
    monkeypatch.setenv(other, ",".join(["http://127.0.0.1:3", "http://127.0.0.1:4"][: form.count(",") + 1]))
    try:
        s = Settings(_env_file=None)
    except ValidationError as exc:
        line = describe_error(exc)
        assert name in line, line
    else:
        # Accepted only where the password is unambiguous (an @ inside it); shown redacted.
        line = ",".join(redact_url(x.url) for x in s.routing_topology().servers)
        assert "127.0.0.1:1" in line
    assert USER not in line and SECRET not in line and "et@" not in line and "token" not in line, line


def test_url_password_with_a_hash_exits_2_with_one_line(tmp_path: Path) -> None:
    proc = _run_proxy(tmp_path, {"SPECGATE_SPECULATIVE_URL": f"http://{USER}:{SECRET}#et@127.0.0.1:1"})
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "SPECGATE_SPECULATIVE_URL" in lines[0], proc.stderr
    assert USER not in proc.stderr and SECRET not in proc.stderr and "et@" not in proc.stderr


@pytest.mark.parametrize(
    ("url", "shown"),
    [
        (f"http://{USER}:{SECRET}#et@h:1", "http://h:1"),
        (f"http://{USER}:{SECRET}?et@h:1/x", "http://h:1/x"),
        (f"http://{USER}:{SECRET}/et@h:1", "http://h:1"),
        (f"http://{USER}:{SECRET}@et@h:1", "http://h:1"),
        (f"http://{USER}:{SECRET}%40@h:1", "http://h:1"),
        (f"{USER}:{SECRET}@h:1", "h:1"),
        (f"{USER}:{SECRET}://x@h:1", "h:1"),
        ("http://h:1/x", "http://h:1/x"),
    ],
)
def test_redact_url_hides_any_userinfo(url: str, shown: str) -> None:
    assert redact_url(url) == shown


def test_a_url_without_userinfo_is_still_shown(monkeypatch: pytest.MonkeyPatch) -> None:
    # Nothing is secret without an @: the message keeps the URL to help fix it (less any query).
    monkeypatch.setenv("SPECGATE_BASELINE_URL", "http://127.0.0.1:notaport/?key=k3y")
    with pytest.raises(ValidationError) as info:
        Settings(_env_file=None)
    line = describe_error(info.value)
    assert "http://127.0.0.1:notaport/?..." in line and "k3y" not in line, line
