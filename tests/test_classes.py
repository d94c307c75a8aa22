"""Traffic classes: acceptance learnt per class from its speculative streams, and where speculation
has room for only part of the traffic, the classes that gain most from it get it (proxy/classes.py,
policy.class_choice)."""

from __future__ import annotations

import contextlib

import pytest

from proxy.classes import MIN_STEPS, NAME_CHARS, OTHER, ClassBook, class_of
from proxy.policy import Decision, PolicyState, Role, class_choice

from .helpers import policy_cfg, wait_until
from .inprocess import Gateway, StartGateway

UP = {Role.SPECULATIVE: True, Role.BASELINE: True}
VARIED = " ".join(f"word{i} means thing{i * 7 % 13}" for i in range(60))
REPEATED = "copy this line exactly as it is. " * 40


# ---------------------------------------------------------------------------------------------
# Units


def test_what_names_a_requests_class() -> None:
    body = {"user": "alice", "model": "llama"}
    assert class_of("header", b"code", body, b"") == "code"
    assert class_of("header", None, body, b"") is None
    assert class_of("header", b"x" * 500, body, b"") == "x" * NAME_CHARS
    assert class_of("header", b'a"b\\c\x01', body, b"") == "a_b_c_"
    assert class_of("user", None, body, b"") == "alice"
    assert class_of("model", None, body, b"") == "llama"
    assert class_of("model", None, {"model": 3}, b"") is None
    key = class_of("api_key", None, body, b"Bearer sk-secret")
    assert key is not None and key.startswith("key-") and "secret" not in key
    assert class_of("api_key", None, body, b"") is None
    assert class_of("none", b"code", body, b"Bearer k") is None


def test_the_book_is_bounded_learns_and_forgets() -> None:
    book = ClassBook(2, half_life_s=10.0)
    assert (book.tracked("a", 0.0), book.tracked("b", 0.0), book.tracked("c", 0.0)) == ("a", "b", OTHER)
    assert set(book.stats) == {"a", "b", OTHER}  # a full book pools the rest
    # Acceptance counts once a class has MIN_STEPS decode steps.
    book.measured("a", 3 * (MIN_STEPS - 1), MIN_STEPS - 1, 0.0)
    assert book.accept("a") is None
    book.measured("a", 3, 1, 0.0)
    assert book.accept("a") == 3.0
    book.measured("b", 13 * MIN_STEPS // 10, MIN_STEPS, 0.0)
    assert book.accept("b") == pytest.approx(1.3, abs=0.05)
    # Equal traffic: the better class gains most, the other not.
    assert (book.gains_most("a", 0.0), book.gains_most("b", 0.0)) == (True, False)
    # Most of the traffic the weaker class's: the better one still goes first.
    for _ in range(3):
        book.tracked("b", 0.0)
    assert (book.gains_most("a", 0.0), book.gains_most("b", 0.0)) == (True, False)
    # ...and where the better class is most of the traffic, the weaker one never gains most.
    for _ in range(6):
        book.tracked("a", 0.0)
    assert book.ranked(0.0) == {"a": True, "b": False}
    # Long after, `b` has faded and makes room for a new class, its series to be dropped.
    later = 10.0 * 20
    book.tracked("a", later)
    assert book.tracked("c", later) == "c" and book.take_forgotten() == ["b"]
    assert book.take_forgotten() == []


def test_a_class_choice_where_speculation_has_room_for_part() -> None:
    cfg = policy_cfg(high=8, low=2)
    state = PolicyState(Role.SPECULATIVE)
    band = Decision(Role.SPECULATIVE, "light_load", state, 5)
    yielded = class_choice(band, False, cfg, UP, pooled=False)
    assert (yielded.backend, yielded.reason, yielded.state) == (Role.BASELINE, "class", state)
    assert class_choice(band, True, cfg, UP, pooled=False).backend == Role.SPECULATIVE
    light = Decision(Role.SPECULATIVE, "light_load", state, 1)
    assert class_choice(light, False, cfg, UP, pooled=False) is light  # room for everyone: paired
    assert class_choice(light, False, cfg, UP, pooled=True).backend == Role.BASELINE  # a pool: always
    heavy = Decision(Role.BASELINE, "heavy_load", PolicyState(Role.BASELINE), 8)
    assert class_choice(heavy, True, cfg, UP, pooled=True) is heavy  # no room for anyone
    for reason in ("probe", "batch", "only_healthy", "affinity", "stored_response"):
        d = Decision(Role.SPECULATIVE, reason, state, 5)
        assert class_choice(d, False, cfg, UP, pooled=False) is d
    assert class_choice(band, False, cfg, {**UP, Role.BASELINE: False}, pooled=False) is band
    assert class_choice(band, False, policy_cfg("spillover", high=8, low=2), UP, pooled=False) is band


# ---------------------------------------------------------------------------------------------
# In-process: two classes through the gateway


async def _ask(gw: Gateway, cls: str, prompt: str, stream: bool = True) -> tuple[str, str]:
    body = {"messages": [{"role": "user", "content": prompt}], "max_tokens": 64, "stream": stream}
    r = await gw.client.post("/v1/chat/completions", json=body, headers={"x-specgate-class": cls})
    assert r.status_code == 200, r.text
    return r.headers["x-specgate-backend"], r.headers["x-specgate-reason"]


async def _engine_known(gw: Gateway) -> bool:
    return bool((await gw.routing())["servers"]["speculative"]["engine"] == "sglang")


@pytest.mark.anyio
async def test_the_class_that_gains_most_gets_speculation_first(gateway: StartGateway) -> None:
    gw = await gateway(
        sim={"time_scale": 20},
        spec={"accept_from_prompt": True},
        high_watermark=4,
        low_watermark=1,
        scrape_interval_s=0.1,
        affinity_entries=0,
    )
    await wait_until(lambda: _engine_known(gw))
    # At light load both classes go to the speculative server, which measures them.
    for _ in range(4):
        assert await _ask(gw, "code", REPEATED) == ("speculative", "light_load")
        assert await _ask(gw, "chat", VARIED) == ("speculative", "light_load")
    tracked = (await gw.routing())["classes"]["tracked"]
    assert tracked["code"]["accept_length"] > 2.5 > 1.5 > tracked["chat"]["accept_length"], tracked
    assert (tracked["code"]["gains_most"], tracked["chat"]["gains_most"]) == (True, False), tracked
    # Two long streams of unclassed work put the load between the watermarks: room for part.
    long = {"prompt": "p", "max_tokens": 120_000, "stream": True}
    async with contextlib.AsyncExitStack() as held:
        for _ in range(2):
            r = await held.enter_async_context(gw.client.stream("POST", "/v1/completions", json=long))
            await anext(r.aiter_lines())
        assert await _ask(gw, "code", REPEATED, stream=False) == ("speculative", "class")
        assert await _ask(gw, "chat", VARIED, stream=False) == ("baseline", "class")
    text = await gw.metrics_text()
    assert 'specgate_class_requests_total{backend="baseline",class="chat"} 1.0' in text
    assert 'specgate_class_accept_length{class="code"}' in text
    # Classless requests are routed as before.
    assert (await gw.client.post("/v1/completions", json={"prompt": "p", "max_tokens": 2})).status_code == 200


@pytest.mark.anyio
async def test_classes_off_and_bounded(gateway: StartGateway) -> None:
    off = await gateway(class_key="none")
    await _ask(off, "code", "hi", stream=False)
    assert (await off.routing())["classes"] == {"key": "none", "max": 32, "tracked": {}}
    small = await gateway(max_classes=2)
    for name in ("a", "b", "c", "d"):
        await _ask(small, name, "hi", stream=False)
    tracked = (await small.routing())["classes"]["tracked"]
    assert set(tracked) == {"a", "b", OTHER}
    text = await small.metrics_text()
    assert 'class="c"' not in text and 'specgate_class_requests_total{backend="speculative",class="other"} 2.0' in text
