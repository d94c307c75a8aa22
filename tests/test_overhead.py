"""The overhead benchmark runs end to end (figures come from running it, not from tests)."""

from __future__ import annotations

from loadtest.bench_upstream import CLIENTS, Case, format_table
from loadtest.bench_upstream import run as run_upstream
from loadtest.overhead import Scenario, format_results, run_overhead


def test_overhead_benchmark_measures_every_target() -> None:
    # Enough small requests for the proxy's CPU to span many /proc clock ticks (10 ms each).
    scenarios = (
        Scenario("tiny", 2, False, 1, 400),
        Scenario("tiny stream", 2, True, 8, 10),
        Scenario("tiny paced", 3, True, 8, 6, pace_ms=5.0, spread=4),
    )
    results = run_overhead(reps=1, nginx=False, scenarios=scenarios, say=lambda _: None)
    assert {(r.scenario, r.target) for r in results} == {(s.name, t) for s in scenarios for t in ("direct", "specgate")}
    for r in results:
        (sample,) = r.samples
        assert sample.errors == 0 and sample.req_s > 0 and sample.p50_ms > 0
        # Every token's event arrived, through the proxy as directly.
        assert sample.missing_chunks == 0
        if r.target == "specgate" and r.scenario == "tiny":
            assert sample.target_cpu_per_1k_s > 0  # the proxy's own CPU is measured
    stream = next(r for r in results if r.scenario == "tiny stream" and r.target == "specgate")
    assert stream.samples[0].chunks_s > 0 and stream.samples[0].ttft_p50_ms > 0
    paced = next(r for r in results if r.scenario == "tiny paced" and r.target == "direct").samples[0]
    # The paced backend spaces tokens by its decode step (5 ms): gaps are steps, not zero.
    assert paced.chunk_p50_ms >= 3.0
    assert Scenario("x", 1, True, 64, 1, spread=32).lengths() == list(range(32, 97, 4))
    assert "specgate" in format_results(results)


def test_upstream_client_benchmark_runs_every_client() -> None:
    cases = (Case("tiny", 2, 1, False, 20), Case("tiny stream", 2, 8, True, 6))
    results = run_upstream(reps=1, cases=cases)
    for case in cases:
        assert set(results[case.name]) == set(CLIENTS)
        for samples in results[case.name].values():
            ((cpu_ms, req_s),) = samples
            assert cpu_ms > 0 and req_s > 0
    assert "httpx+aiohttp" in format_table(results)
