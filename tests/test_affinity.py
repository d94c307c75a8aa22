"""Cache affinity: a conversation's next turn goes where its prefix is cached, unless that server's
load exceeds the alternative's by more than the re-prefill saved (proxy/affinity.py), and the
engines' prefix cache hit rate per server."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import Any

import pytest

from proxy.affinity import MAX_ID_BYTES, AffinityTable, conversation_key, keep
from proxy.engines import ENGINES
from proxy.policy import Decision, PolicyState, Role, affinity_choice
from proxy.readings import read
from proxy.servers import Health

from .helpers import policy_cfg, wait_until
from .inprocess import Gateway, StartGateway, start_sim

SYSTEM = {"role": "system", "content": "You are a careful assistant. " * 20}


def _chat(*users: str) -> dict[str, Any]:
    messages: list[dict[str, str]] = [SYSTEM]
    for i, text in enumerate(users):
        if i:
            messages.append({"role": "assistant", "content": f"answer {i}"})
        messages.append({"role": "user", "content": text})
    return {"messages": messages}


# ---------------------------------------------------------------------------------------------
# Units


def test_a_conversation_keeps_its_key_from_turn_to_turn() -> None:
    first = conversation_key(None, _chat("plan a trip to Lisbon"), "chat")
    later = conversation_key(None, _chat("plan a trip to Lisbon", "and the hotels?", "and food?"), "chat")
    other = conversation_key(None, _chat("write a sonnet"), "chat")
    assert first is not None and first == later and first != other
    # A session id or the body's `user` names the conversation outright.
    assert conversation_key(b"abc", _chat("x"), "chat") == conversation_key(b"abc", _chat("y"), "chat") == b"s:abc"
    assert conversation_key(None, {**_chat("x"), "user": "u1"}, "chat") == b"u:u1"
    long = conversation_key(b"z" * (MAX_ID_BYTES + 1), {}, "chat")
    assert long is not None and len(long) < 40  # hashed: the table never holds a client's megabytes
    # The other APIs: a completion's leading characters, a Responses request's instructions and input.
    assert conversation_key(None, {"prompt": "p" * 5000}, "completions") == conversation_key(
        None, {"prompt": "p" * 4096 + "q"}, "completions"
    )
    responses = conversation_key(None, {"instructions": "be brief", "input": "hi"}, "responses")
    assert responses is not None and responses != conversation_key(None, {"input": "hi"}, "responses")
    for nothing in ({}, {"messages": "x"}, {"prompt": [1, 2, 3]}):
        assert conversation_key(None, nothing, "chat") is None
        assert conversation_key(None, nothing, "completions") is None


def test_the_slack_rule() -> None:
    # A server 4 requests busier than the best keeps a turn that has 4,000 tokens cached, at slack 1.
    assert keep(10, 6, 4000, 1.0)
    assert not keep(10, 6, 3999, 1.0)
    assert keep(10, 6, 2000, 2.0)
    assert not keep(1, 0, 100_000, 0.0)  # slack 0: the least loaded, always
    assert keep(3, 3, 0, 0.0)


def test_the_table_is_bounded_and_forgets_the_longest_unused() -> None:
    table = AffinityTable(2)
    table.remember(b"a", "s1", 10)
    table.remember(b"b", "s2", 20)
    assert table.get(b"a") is not None
    table.remember(b"c", "s1", 30)
    assert (len(table), table.get(b"b"), table.get(b"a")) == (2, None, table.get(b"a"))
    held = table.get(b"c")
    assert held is not None and (held.server, held.tokens) == ("s1", 30)
    off = AffinityTable(0)
    off.remember(b"a", "s1", 1)
    assert len(off) == 0


def test_between_the_watermarks_a_turn_keeps_its_role() -> None:
    cfg = policy_cfg(high=8, low=2)
    up = {Role.SPECULATIVE: True, Role.BASELINE: True}
    state = PolicyState(Role.BASELINE)
    band = Decision(Role.BASELINE, "hysteresis_hold", state, 5)
    kept = affinity_choice(band, Role.SPECULATIVE, cfg, up)
    assert (kept.backend, kept.reason, kept.state) == (Role.SPECULATIVE, "affinity", state)
    # At or past a watermark the policy's choice stands; so do probes, batch requests, and a role that is down.
    for load, reason in ((8, "heavy_load"), (2, "light_load")):
        d = Decision(Role.BASELINE, reason, state, load)  # type: ignore[arg-type]
        assert affinity_choice(d, Role.SPECULATIVE, cfg, up) is d
    for reason in ("probe", "batch", "only_healthy", "failover"):
        d = Decision(Role.BASELINE, reason, state, 5)  # type: ignore[arg-type]
        assert affinity_choice(d, Role.SPECULATIVE, cfg, up) is d
    assert affinity_choice(band, Role.SPECULATIVE, cfg, {**up, Role.SPECULATIVE: False}) is band
    assert affinity_choice(band, Role.SPECULATIVE, policy_cfg("spillover", high=8, low=2), up) is band
    # A pair's roles share one GPU: a turn sent back to the role the mode left would time-slice it.
    assert affinity_choice(band, Role.SPECULATIVE, cfg, up, pooled=False) is band


def test_the_engines_prefix_cache_hit_rate() -> None:
    h = Health()
    sglang = "sglang:num_running_reqs 0\nsglang:num_queue_reqs 0\nsglang:cache_hit_rate 0.625\n"
    found = read(h, 200, sglang.encode(), 1.0, ENGINES["sglang"], 60.0, 0)
    assert not isinstance(found, str) and found.cache_hit_rate == 0.625
    h = Health()
    rates = []
    for hits, queries in ((100, 400), (400, 800), (400, 800), (10, 20)):  # the last: a restart
        text = (
            "vllm:num_requests_running 0\nvllm:num_requests_waiting 0\n"
            f"vllm:prefix_cache_hits_total {hits}\nvllm:prefix_cache_queries_total {queries}\n"
        )
        found = read(h, 200, text.encode(), 1.0, ENGINES["vllm"], 60.0, 0)
        assert not isinstance(found, str)
        rates.append(found.cache_hit_rate)
        h.engine_cache_hit_rate = found.cache_hit_rate  # as the health loop keeps it
    # None until two scrapes; hits over queries between them; it stands while no prompt came; a
    # counter that went back starts afresh, the last value standing meanwhile.
    assert rates == [None, 0.75, 0.75, 0.75]


# ---------------------------------------------------------------------------------------------
# In-process: conversations through the gateway, in front of a pool of two baseline servers


@contextlib.asynccontextmanager
async def _pool(gateway: StartGateway, **settings: Any) -> AsyncIterator[Gateway]:
    """A gateway whose baseline is a pool of two servers, b0 and b1, that report cached tokens;
    everything goes to the baseline (watermark 0)."""
    sims = [await start_sim("baseline", time_scale=20.0, enable_cache_report=True) for _ in range(2)]
    try:
        yield await gateway(
            baseline_url=f"b0={sims[0].url},b1={sims[1].url}",
            topology="pooled",
            high_watermark=0,
            low_watermark=0,
            **settings,
        )
    finally:
        for sim in sims:
            await sim.stop()


async def _server_requests(gw: Gateway) -> dict[str, float]:
    text = await gw.metrics_text()
    out = {}
    for line in text.splitlines():
        if line.startswith("specgate_server_requests_total{"):
            name = line.split('server="', 1)[1].split('"', 1)[0]
            out[name] = float(line.rsplit(" ", 1)[1])
    return out


async def _served_by(gw: Gateway, before: dict[str, float]) -> str:
    after = await _server_requests(gw)
    moved = [name for name in after if after[name] > before.get(name, 0)]
    assert len(moved) == 1, (before, after)
    return moved[0]


@pytest.mark.anyio
async def test_later_turns_land_on_their_server_and_find_their_prefix_cached(gateway: StartGateway) -> None:
    async with _pool(gateway) as gw:
        cached_later: list[int] = []
        for c in range(6):
            users: list[str] = []
            where: list[str] = []
            for turn in range(4):
                users.append(f"conversation {c} turn {turn}: tell me more. " * 8)
                before = await _server_requests(gw)
                r = await gw.client.post("/v1/chat/completions", json={**_chat(*users), "max_tokens": 4})
                assert r.status_code == 200, r.text
                where.append(await _served_by(gw, before))
                if turn:
                    cached_later.append(r.json()["usage"]["prompt_tokens_details"]["cached_tokens"])
            assert len(set(where)) == 1, f"conversation {c} moved: {where}"
        # Every later turn found its conversation so far in its server's cache.
        assert all(cached > 100 for cached in cached_later), cached_later
        m = await gw.metrics()
        assert (m["specgate_affinity_hits_total"], m["specgate_affinity_misses_total"]) == (6 * 3, 6)
        assert m["specgate_affinity_entries"] == 6
        assert m["specgate_affinity_breaks_total"] == 0


@pytest.mark.anyio
async def test_a_turn_leaves_a_server_busier_than_its_cache_is_worth(gateway: StartGateway) -> None:
    async with _pool(gateway, affinity_slack=0.0, sim={"time_scale": 1.0}) as gw:
        hdr = {"x-session-id": "conv-1"}
        body = {**_chat("hello there"), "max_tokens": 2}
        before = await _server_requests(gw)
        assert (await gw.client.post("/v1/chat/completions", json=body, headers=hdr)).status_code == 200
        held = await _served_by(gw, before)
        # A long turn of the same conversation: its server holds nothing else, so it stays.
        long = {"prompt": "p", "max_tokens": 120_000, "stream": True}
        before = await _server_requests(gw)
        async with gw.client.stream("POST", "/v1/completions", json=long, headers=hdr) as r:
            await anext(r.aiter_lines())
            assert await _served_by(gw, before) == held
            # Now it holds one request more than the other server, and slack 0 allows none.
            before = await _server_requests(gw)
            assert (await gw.client.post("/v1/chat/completions", json=body, headers=hdr)).status_code == 200
            assert await _served_by(gw, before) != held
        text = await gw.metrics_text()
        assert 'specgate_affinity_breaks_total{reason="load"} 1.0' in text
        assert "specgate_affinity_hits_total 1.0" in text


@pytest.mark.anyio
async def test_affinity_off_and_a_server_that_went_down(gateway: StartGateway) -> None:
    off = await gateway(affinity_entries=0)
    await off.client.post("/v1/chat/completions", json={**_chat("hi"), "max_tokens": 2})
    m = await off.metrics()
    assert (m["specgate_affinity_entries"], m["specgate_affinity_misses_total"]) == (0, 0)
    assert (await off.routing())["affinity"] == {"entries": 0, "slack": 1.0}
    on = await gateway(health_interval_s=0.2)
    first = await on.client.post("/v1/chat/completions", json={**_chat("hi"), "max_tokens": 2})
    assert first.headers["x-specgate-backend"] == "speculative"
    await on.spec.stop()

    async def down() -> bool:
        return (await on.routing())["servers"]["speculative"]["healthy"] is False

    await wait_until(down)
    r = await on.client.post("/v1/chat/completions", json={**_chat("hi", "again"), "max_tokens": 2})
    assert r.headers["x-specgate-backend"] == "baseline"
    assert 'specgate_affinity_breaks_total{reason="down"} 1.0' in await on.metrics_text()
