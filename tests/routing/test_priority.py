"""Priority: `x-specgate-priority: batch` requests go to the baseline and are left out of the load
the mode compares, so batch work never takes speculation's room from interactive requests."""

from __future__ import annotations

import contextlib

import pytest

from proxy.policy.base import Decision, LoadSnapshot, PolicyConfig, PolicyState, Role
from proxy.routing.steps.base import Ask
from proxy.routing.steps.pipeline import decide

from ..helpers import policy_cfg, wait_until
from ..inprocess import Gateway, StartGateway

LONG = {"prompt": "p", "max_tokens": 120_000, "stream": True}
BATCH = {"x-specgate-priority": "batch"}


def batch_decision(snapshot: LoadSnapshot, state: PolicyState, cfg: PolicyConfig) -> Decision:
    return decide(snapshot, state, cfg, Ask(batch=True))


def _snapshot(spec: bool = True, base: bool = True) -> LoadSnapshot:
    return LoadSnapshot(
        {Role.SPECULATIVE: 1, Role.BASELINE: 5}, {}, {Role.SPECULATIVE: spec, Role.BASELINE: base}, 10.0, None
    )


def test_a_batch_request_goes_to_the_baseline_and_leaves_the_mode_alone() -> None:
    cfg = policy_cfg(high=2, low=1)
    state = PolicyState(Role.SPECULATIVE)
    d = batch_decision(_snapshot(), state, cfg)
    assert (d.backend, d.reason, d.state, d.shadow) == (Role.BASELINE, "batch", state, False)
    assert batch_decision(_snapshot(base=False), state, cfg).backend == Role.SPECULATIVE  # only_healthy
    assert batch_decision(_snapshot(base=False), state, cfg).reason == "only_healthy"
    assert batch_decision(_snapshot(False, False), state, cfg).backend is None


async def _routing_load(gw: Gateway) -> tuple[int, int, int]:
    page = await gw.routing()
    return page["load"], page["inflight"], page["servers"]["baseline"]["batch"]


@pytest.mark.anyio
async def test_batch_work_never_takes_speculations_room(gateway: StartGateway) -> None:
    gw = await gateway(sim={"time_scale": 1}, high_watermark=2, low_watermark=1)
    async with contextlib.AsyncExitStack() as held:
        for _ in range(4):
            r = await held.enter_async_context(gw.client.stream("POST", "/v1/completions", json=LONG, headers=BATCH))
            assert (r.headers["x-specgate-backend"], r.headers["x-specgate-reason"]) == ("baseline", "batch")
        # Four batch streams in flight, none of them in the load the watermarks compare.
        assert await _routing_load(gw) == (0, 4, 4)
        r = await gw.client.post("/v1/completions", json={"prompt": "p", "max_tokens": 2})
        assert (r.headers["x-specgate-backend"], r.headers["x-specgate-reason"]) == ("speculative", "light_load")
        # Interactive load still moves the mode as before.
        await held.enter_async_context(gw.client.stream("POST", "/v1/completions", json=LONG))
        await held.enter_async_context(gw.client.stream("POST", "/v1/completions", json=LONG))
        r = await gw.client.post("/v1/completions", json={"prompt": "p", "max_tokens": 2})
        assert (r.headers["x-specgate-backend"], r.headers["x-specgate-reason"]) == ("baseline", "heavy_load")
        m = await gw.metrics_text()
        assert 'specgate_routing_decisions_total{backend="baseline",reason="batch"} 4.0' in m

    async def drained() -> bool:
        return await _routing_load(gw) == (0, 0, 0)

    await wait_until(drained)


@pytest.mark.anyio
async def test_a_batch_request_moves_with_its_priority_on_failover(gateway: StartGateway) -> None:
    gw = await gateway(sim={"time_scale": 1}, health_interval_s=60, high_watermark=1, low_watermark=0)
    await gw.base.stop()
    async with gw.client.stream("POST", "/v1/completions", json=LONG, headers=BATCH) as r:
        assert (r.headers["x-specgate-backend"], r.headers["x-specgate-reason"]) == ("speculative", "failover")
        page = await gw.routing()
        assert (page["servers"]["speculative"]["batch"], page["load"]) == (1, 0)
        # The batch stream on the speculative server takes no room: an interactive request still gets it.
        nxt = await gw.client.post("/v1/completions", json={"prompt": "p", "max_tokens": 2})
        assert nxt.headers["x-specgate-backend"] == "speculative"

    async def released() -> bool:
        page = await gw.routing()
        return bool(page["inflight"] == 0 and page["servers"]["speculative"]["batch"] == 0)

    await wait_until(released)


@pytest.mark.anyio
async def test_an_unknown_priority_is_refused_clearly(gateway: StartGateway) -> None:
    gw = await gateway()
    r = await gw.client.post(
        "/v1/completions", json={"prompt": "p", "max_tokens": 2}, headers={"x-specgate-priority": "urgent"}
    )
    assert r.status_code == 400
    assert r.json()["error"]["code"] == "invalid_priority" and "interactive or batch" in r.json()["error"]["message"]
    ok = await gw.client.post(
        "/v1/completions", json={"prompt": "p", "max_tokens": 2}, headers={"x-specgate-priority": " Interactive"}
    )
    assert ok.status_code == 200 and ok.headers["x-specgate-reason"] == "light_load"
    assert (await gw.routing())["inflight"] == 0
