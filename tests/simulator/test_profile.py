from __future__ import annotations

from pathlib import Path

import pytest

from loadtest.simulator.profile import ProfileError, builtin_names, load_profile, parse_profile

CSV = """# a comment
concurrency,speculative_tok_s,baseline_tok_s
10,300,500
1,100,90
"""


def test_interpolates_linearly_and_is_flat_outside() -> None:
    p = parse_profile(CSV, "t")
    assert p.concurrency == (1.0, 10.0)  # rows sorted
    assert p.throughput("speculative", 1) == 100
    assert p.throughput("speculative", 5.5) == pytest.approx(200)
    assert p.throughput("baseline", 4) == pytest.approx(90 + 410 * 3 / 9)
    assert p.throughput("baseline", 1000) == 500
    assert p.throughput("baseline", 0.5) == 90
    assert p.accept_length is None


def test_accept_length_comment() -> None:
    assert parse_profile("# accept_length: 2.5\n" + CSV, "t").accept_length == 2.5


def test_shipped_profiles_match_shared_data() -> None:
    assert {"seed-parallel", "crossover"} <= set(builtin_names())
    seed = load_profile("seed-parallel")
    assert seed.throughput("baseline", 70) == pytest.approx(784.2)
    assert seed.throughput("speculative", 1) == pytest.approx(77.5)
    cross = load_profile("crossover")
    assert cross.throughput("speculative", 20) == cross.throughput("baseline", 20) == 1500
    shipped = Path(__file__).parents[2] / "loadtest/simulator/profiles/crossover.csv"
    assert shipped.read_text().startswith("# SYNTHETIC profile, not a measurement.")


def test_load_by_path(tmp_path: Path) -> None:
    f = tmp_path / "mine.csv"
    f.write_text(CSV)
    assert load_profile(str(f)).name == "mine"


@pytest.mark.parametrize(
    ("text", "fragment"),
    [
        ("a,b\n1,2\n", "header"),
        ("concurrency,speculative_tok_s,baseline_tok_s\n", "no data"),
        ("concurrency,speculative_tok_s,baseline_tok_s\n1,x,2\n", "not a number"),
        ("concurrency,speculative_tok_s,baseline_tok_s\n0,1,2\n", "below"),
        ("concurrency,speculative_tok_s,baseline_tok_s\n1,1,2\n1,3,4\n", "repeated"),
    ],
)
def test_bad_profiles(text: str, fragment: str) -> None:
    with pytest.raises(ProfileError, match=fragment):
        parse_profile(text, "bad")


def test_unknown_name_lists_shipped() -> None:
    with pytest.raises(ProfileError, match="crossover"):
        load_profile("nope")
