"""`python -m loadtest field` end to end, once and small: one tiny cell (2 GPUs, two classes, two
sessions a GPU) at one seed, specgate-pool with smg-baseline and smg-adaptive where smg is installed
(scripts/install-peers; else specgate-pool alone), a calibration given so that none is run."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import orjson

from loadtest.overhead import default_peers_venv
from tests.loadtest.test_headtohead_run import write_calibration


def smg() -> Path | None:
    venv = default_peers_venv()
    found = venv / "bin" / "smg" if venv else None
    return found if found is not None and found.exists() else None


def test_one_tiny_cell_runs_every_configuration_it_can(tmp_path: Path) -> None:
    cals = write_calibration(tmp_path / "cals")
    (cals / "calibration-a2-1k").rename(cals / "calibration-1k")
    binary = smg()
    configs = ["smg-adaptive", "smg-baseline", "specgate-pool"] if binary else ["specgate-pool"]
    out = tmp_path / "out"
    args = [
        sys.executable, "-m", "loadtest", "field", "--cells", "2:AB:1k:2", "--seeds", "1", "--configs",
        ",".join(configs), "--turns", "2", "--max-tokens", "16", "--think-time-s", "0", "--stagger-s", "0",
        "--window-s", "1", "--max-window-s", "8", "--min-requests", "4", "--calibrations", str(cals),
        "--out-dir", str(out), "--markdown", str(tmp_path / "report.md"), "--quiet",
        *(["--smg", str(binary)] if binary else []),
    ]  # fmt: skip
    done = subprocess.run(args, capture_output=True, text=True, timeout=110, check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    report = orjson.loads((out / "field.json").read_bytes())
    (one,) = report["runs"]
    assert list(one["targets"]) == configs and one["cell"] == {
        "gpus": 2,
        "traffic": "AB",
        "context": 1000,
        "per_gpu": 2,
    }
    for name, t in one["targets"].items():
        assert t["conclusive"] and t["goodput_req_s"] > 0, (name, t)
        assert set(one["class_goodput"][name]) == {"A", "B"}
    assert report["tables"][0].startswith("| cell |") and "specgate-pool" in done.stdout
    assert "## Protocol" in (tmp_path / "report.md").read_text()
