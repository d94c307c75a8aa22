"""When a level's window has enough to end, and how a target's verdict treats inconclusive figures."""

from __future__ import annotations

from loadtest.report import target_verdict
from loadtest.sweep import enough


def test_a_window_ends_with_enough_good_requests_from_half_the_streams() -> None:
    # 10 good requests (--min-requests 10) from at least half of 4 streams.
    assert not enough(4, 10, good=9, streams=4, failed=0)
    assert enough(4, 10, good=10, streams=2, failed=0)
    # Enough requests, but from one stream of four: the others' latencies are not in them yet.
    assert not enough(4, 10, good=12, streams=1, failed=0)
    # 30 streams need 15 good requests (half the streams), from 15 streams.
    assert not enough(30, 10, good=14, streams=14, failed=0)
    assert enough(30, 10, good=15, streams=15, failed=0)


def test_a_failing_server_does_not_hold_the_window_open() -> None:
    # As many failures as the level needs good requests: more time would only measure failures.
    assert enough(4, 10, good=0, streams=0, failed=10)
    assert not enough(4, 10, good=3, streams=2, failed=9)


def test_no_minimum_means_nothing_to_wait_for() -> None:
    assert enough(8, 0, good=0, streams=0, failed=0)


def test_an_inconclusive_figure_is_neither_a_miss_nor_a_pass() -> None:
    label = "specgate >= 0.97x the better"
    assert target_verdict(label, [], [], 3) == f"{label}: yes"
    # A conclusive miss is a miss, whatever else is unknown.
    assert target_verdict(label, ["c=5: 0.91"], ["c=1"], 2) == f"{label}: NO (c=5: 0.91); inconclusive at c=1"
    # Met wherever measured, but one level unknown: not a yes.
    unknown = target_verdict(label, [], ["c=1"], 2)
    assert unknown == f"{label}: unknown (met at the 2 conclusive; inconclusive at c=1)"
    assert target_verdict(label, [], ["c=1", "c=5"], 0) == f"{label}: unknown (inconclusive at c=1; c=5)"
    assert target_verdict(label, [], [], 0) == f"{label}: unknown (nothing measured)"
