"""The documentation site (mkdocs.yml, docs/): it builds with --strict (no broken link, anchor or
page left out of the navigation), and its module map names exactly the modules that exist."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
MODULE_MAP = DOCS / "architecture.md"
# Dated reports of what one run measured (docs/benchmarks/YYYY-MM-DD-name.md), each with its data.
REPORTS = DOCS / "benchmarks"
REPORT_NAME = re.compile(r"^\d{4}-\d{2}-\d{2}-[a-z0-9-]+$")
REPORT_MAX_LINES = 200
PACKAGES = ("specgate", "proxy", "loadtest")
# A row of the module map: "| `proxy/relay/relay.py` | its job |".
MAP_ROW = re.compile(r"^\| `((?:specgate|proxy|loadtest)/[\w/]+\.py)` \|")
# A module's path anywhere in the prose (not `deploy/...`, nor an engine's own `.../engines.py`).
MODULE_PATH = re.compile(r"(?<![\w/.-])((?:specgate|proxy|loadtest)/[\w/]+\.py)\b")


def modules() -> set[str]:
    """Every module of the packages, as a path from the repository root."""
    return {
        path.relative_to(ROOT).as_posix()
        for package in PACKAGES
        for path in (ROOT / package).rglob("*.py")
        if "__pycache__" not in path.parts
    }


def tree(path: Path) -> set[str]:
    """What lies in a folder, one level down: the build must add nothing to the work tree."""
    return {entry.name for entry in path.iterdir()}


def test_site_builds_strict(tmp_path: Path) -> None:
    before = {folder: tree(folder) for folder in (ROOT, DOCS)}
    site = tmp_path / "site"
    # Run from tmp_path, so that nothing the build might leave behind lands in the work tree; the
    # config's docs_dir is relative to the config file, not to the working directory.
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}  # Material's end-of-life banner, printed on every build
    command = [sys.executable, "-m", "mkdocs", "build", "--strict", "--config-file", str(ROOT / "mkdocs.yml")]
    done = subprocess.run(
        [*command, "--site-dir", str(site)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, f"mkdocs build --strict failed:\n{done.stdout}{done.stderr}"
    for page in DOCS.rglob("*.md"):
        path = page.relative_to(DOCS).with_suffix("")
        built = site / (path.parent if path.name == "index" else path) / "index.html"
        assert built.is_file(), f"{path} was not built"
    for asset in [*DOCS.rglob("*.png"), *REPORTS.glob("*.json")]:
        assert (site / asset.relative_to(DOCS)).is_file(), f"{asset.relative_to(DOCS)} is not in the site"
    assert {folder: tree(folder) for folder in (ROOT, DOCS)} == before, "the build wrote into the work tree"


def test_module_map_names_exactly_the_modules() -> None:
    rows = [match[1] for line in MODULE_MAP.read_text().splitlines() if (match := MAP_ROW.match(line))]
    assert len(rows) == len(set(rows)), f"modules listed twice: {sorted({r for r in rows if rows.count(r) > 1})}"
    existing = modules()
    missing = sorted(existing - set(rows))
    gone = sorted(set(rows) - existing)
    assert not missing, f"docs/architecture.md has no row for {missing}: add one with the module's job"
    assert not gone, f"docs/architecture.md lists modules that do not exist: {gone}"


def test_reports_are_dated_short_and_carry_their_data() -> None:
    """A report is named by its run's date, stays short, and has its data file beside it, linked."""
    reports = sorted(page for page in REPORTS.glob("*.md") if page.stem != "index")
    assert reports, "docs/benchmarks/ holds no report"
    listed = (REPORTS / "index.md").read_text()
    for page in reports:
        text = page.read_text()
        assert REPORT_NAME.match(page.stem), f"{page.name}: not named YYYY-MM-DD-name"
        assert len(text.splitlines()) <= REPORT_MAX_LINES, f"{page.name}: over {REPORT_MAX_LINES} lines"
        assert "## Protocol" in text, f"{page.name}: no protocol at its head"
        data = page.with_suffix(".json")
        assert data.is_file(), f"{page.name}: no {data.name} beside it"
        assert f"]({data.name})" in text, f"{page.name}: does not link {data.name}"
        # Tables transcribed from a journal, or the JSON the benchmark command itself wrote.
        found = json.loads(data.read_text())
        assert found.get("tables") or found.get("runs"), f"{data.name}: no table and no runs"
        assert f"]({page.name})" in listed, f"{page.name}: not listed in docs/benchmarks/index.md"


# Reports are left out: a dated report names the modules of its day.
def test_docs_name_only_modules_that_exist() -> None:
    existing = modules()
    stale = {
        f"{page.relative_to(ROOT)}: {name}"
        for page in [ROOT / "README.md", *sorted(DOCS.glob("*.md"))]
        for name in MODULE_PATH.findall(page.read_text())
        if name not in existing
    }
    assert not stale, f"pages name modules that do not exist: {sorted(stale)}"
