"""metrics.Tally: the decision count kept as a plain dict is exported as the Counter it replaced."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, generate_latest

from proxy.observability.metrics import Metrics, Tally


def _lines(registry: CollectorRegistry, name: str) -> list[str]:
    text = generate_latest(registry).decode()
    return sorted(line for line in text.splitlines() if "_created" not in line and name in line)


def test_a_tally_is_exported_as_a_counter_with_the_same_counts() -> None:
    as_counter, as_tally = CollectorRegistry(), CollectorRegistry()
    counter = Counter("sg_decisions", "Decisions.", ["backend", "reason"], registry=as_counter)
    tally = Tally("sg_decisions", "Decisions.", ["backend", "reason"], as_tally)
    counter.labels("baseline", "batch")
    tally.prime("baseline", "batch")  # a zero series, there before the first count
    for labels in [("speculative", "light_load")] * 3 + [("baseline", "heavy_load")]:
        counter.labels(*labels).inc()
        tally.inc(*labels)
    assert _lines(as_tally, "sg_decisions") == _lines(as_counter, "sg_decisions")
    assert tally.value("speculative", "light_load") == 3 and tally.value("none", "probe") == 0
    # No `_created` series: the process turns them off for every metric (proxy/__main__.py).
    assert "_created" not in generate_latest(as_tally).decode()


def test_every_decision_series_is_there_from_the_start() -> None:
    m = Metrics(["s1"], [])
    text = generate_latest(m.registry).decode()
    assert 'specgate_routing_decisions_total{backend="speculative",reason="light_load"} 0.0' in text
    assert 'specgate_routing_decisions_total{backend="none",reason="no_healthy_backend"} 0.0' in text
