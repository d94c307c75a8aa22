"""`python -m loadtest headtohead` end to end, once and small: one cell (two sessions, a 1k context),
the three targets started for real, a calibration given so that none is run."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import orjson

LEVELS = (1, 2, 4)


def write_calibration(out: Path) -> Path:
    """A calibration where speculation always pays, under the name --calibrations looks for."""
    where = out / "calibration-a2-1k"
    where.mkdir(parents=True)
    cal = {
        "format": "specgate-calibration/1",
        "levels": list(LEVELS),
        "speculative": {"output_tok_s": [300.0, 560.0, 1000.0], "mean_tpot_ms": [3.3, 3.6, 4.0],
                        "accept_length": [2.0] * 3},
        "baseline": {"output_tok_s": [160.0, 310.0, 600.0], "mean_tpot_ms": [6.2, 6.4, 6.7]},
        "accept_length": 2.0,
        "recommendation": {"high_watermark": 100, "low_watermark": 50, "verdict": "always_pays"},
    }  # fmt: skip
    (where / "calibration.json").write_bytes(orjson.dumps(cal))
    return out


def test_one_cell_measures_three_targets_side_by_side(tmp_path: Path) -> None:
    cals = write_calibration(tmp_path / "cals")
    out = tmp_path / "out"
    args = [
        sys.executable, "-m", "loadtest", "headtohead", "--accept-lengths", "2", "--contexts", "1k",
        "--sessions", "2", "--time-scale", "2", "--turns", "2", "--max-tokens", "16", "--think-time-s", "0",
        "--window-s", "1", "--max-window-s", "8", "--min-requests", "4", "--calibrations", str(cals),
        "--out-dir", str(out), "--quiet",
    ]  # fmt: skip
    done = subprocess.run(args, capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    report = orjson.loads((out / "headtohead.json").read_bytes())
    assert report["calibrations"]["2/1k"]["high_watermark"] == 100
    (cell,) = report["cells"]
    assert set(cell["targets"]) == {"baseline", "adaptive", "specgate"}
    for name, t in cell["targets"].items():
        assert t["conclusive"], (name, t)
        assert t["output_tok_s"] > 0 and t["goodput_req_s"] > 0
        # Second turns resend the first: the prefix cache reports hits.
        assert t["prefix_cache_hit_rate"] and t["prefix_cache_hit_rate"] > 0
    # Watermarks far above two sessions: everything to the speculative server.
    assert cell["targets"]["specgate"]["speculative_share"] == 1.0
    assert cell["pools"]["specgate/speculative"] < cell["pools"]["adaptive/adaptive"]
    assert "Verdict (1 of 1 cells conclusive" in done.stdout
    assert (out / "headtohead.png").stat().st_size > 0
