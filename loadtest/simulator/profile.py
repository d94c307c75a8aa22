"""Measured throughput curves: total output tok/s of each server against concurrent streams.

A profile is a CSV with `#` comment lines and the columns
`concurrency,speculative_tok_s,baseline_tok_s`. Optional comment lines:
`# accept_length: A`, the acceptance length the speculative curve was measured at (default 3);
`# max_accept_length: M`, the most a request accepts, which a perfectly repetitive prompt reaches
under `--accept-from-prompt` (default A + 1).
"""

from __future__ import annotations

import csv
import io
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Literal

from proxy.policy.base import interpolate

# The adaptive role exists on step-time profiles only (a curve has no draft depth to adapt).
Role = Literal["speculative", "baseline", "adaptive"]
ROLES: tuple[Role, ...] = ("speculative", "baseline")
DEFAULT_ACCEPT_LENGTH = 3.0


class ProfileError(ValueError):
    pass


@dataclass(frozen=True)
class Profile:
    name: str
    concurrency: tuple[float, ...]
    speculative_tok_s: tuple[float, ...]
    baseline_tok_s: tuple[float, ...]
    accept_length: float | None = None
    max_accept_length: float | None = None

    @property
    def speculative_accept_length(self) -> float:
        """The acceptance length the speculative curve holds at."""
        return self.accept_length or DEFAULT_ACCEPT_LENGTH

    @property
    def speculative_max_accept_length(self) -> float:
        return self.max_accept_length or self.speculative_accept_length + 1.0

    def throughput(self, role: Role, c: float) -> float:
        """Total tok/s at `c` streams: linear between points, flat outside them."""
        ys = self.speculative_tok_s if role == "speculative" else self.baseline_tok_s
        return interpolate(self.concurrency, ys, c)


def builtin_names() -> list[str]:
    folder = resources.files(__package__).joinpath("profiles")
    return sorted(p.name.removesuffix(".csv") for p in folder.iterdir() if p.name.endswith(".csv"))


def load_profile(name_or_path: str) -> Profile:
    """Load a shipped profile by name (`crossover`) or any CSV by path."""
    if name_or_path.endswith(".csv") or "/" in name_or_path:
        path = Path(name_or_path)
        try:
            text = path.read_text(encoding="utf-8")
        except OSError as exc:
            raise ProfileError(f"cannot read profile {path}: {exc.strerror}") from exc
        return parse_profile(text, name=path.stem)
    if name_or_path not in builtin_names():
        raise ProfileError(
            f"unknown profile {name_or_path!r}; shipped: {', '.join(builtin_names())}, or give a path to a .csv"
        )
    resource = resources.files(__package__).joinpath("profiles", f"{name_or_path}.csv")
    return parse_profile(resource.read_text(encoding="utf-8"), name=name_or_path)


def parse_profile(text: str, name: str) -> Profile:
    accept_length: float | None = None
    max_accept_length: float | None = None
    rows: list[str] = []
    for line in text.splitlines():
        stripped = line.strip()
        if stripped.startswith("#"):
            key, _, value = stripped.lstrip("#").partition(":")
            if key.strip() == "accept_length":
                accept_length = _number(value, "accept_length", minimum=1.0)
            elif key.strip() == "max_accept_length":
                max_accept_length = _number(value, "max_accept_length", minimum=1.0)
            continue
        if stripped:
            rows.append(stripped)
    reader = csv.DictReader(io.StringIO("\n".join(rows)))
    wanted = {"concurrency", "speculative_tok_s", "baseline_tok_s"}
    if reader.fieldnames is None or not wanted <= set(reader.fieldnames):
        raise ProfileError(f"profile {name}: header must name {', '.join(sorted(wanted))}")
    points = sorted(
        (
            _number(r["concurrency"], "concurrency", minimum=1.0),
            _number(r["speculative_tok_s"], "speculative_tok_s", minimum=1e-9),
            _number(r["baseline_tok_s"], "baseline_tok_s", minimum=1e-9),
        )
        for r in reader
    )
    if not points:
        raise ProfileError(f"profile {name}: no data rows")
    xs = [p[0] for p in points]
    if len(set(xs)) != len(xs):
        raise ProfileError(f"profile {name}: repeated concurrency values")
    return Profile(
        name=name,
        concurrency=tuple(xs),
        speculative_tok_s=tuple(p[1] for p in points),
        baseline_tok_s=tuple(p[2] for p in points),
        accept_length=accept_length,
        max_accept_length=max_accept_length,
    )


def _number(raw: str | None, field: str, minimum: float) -> float:
    try:
        value = float(raw or "")
    except ValueError:
        raise ProfileError(f"{field}: {raw!r} is not a number") from None
    if not value >= minimum:
        raise ProfileError(f"{field}: {value} is below {minimum}")
    return value
