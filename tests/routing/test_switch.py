"""A client's speculation switch: `x-specgate-speculation`, the body's `speculation` field and the
class defaults send a request to a server that speculates or one that does not, the body field
never reaches a server, and anything else is a clear 400."""

from __future__ import annotations

from typing import Any

import orjson
import pytest

from proxy.config import Settings
from proxy.errors import ApiError
from proxy.policy.base import LoadSnapshot, PolicyState, Role
from proxy.policy.factory import policy_for
from proxy.routing import switch
from proxy.routing.steps.base import Ask, Here
from proxy.routing.steps.pipeline import decide, run, steps_for

from ..helpers import policy_cfg
from ..inprocess import StartGateway
from ..recorder import Recorder, serving

pytestmark = pytest.mark.inprocess

UP = {Role.SPECULATIVE: True, Role.BASELINE: True}
CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


class _Pools:
    """A group whose speculative KV pools hold `streams` streams."""

    def __init__(self, streams: int) -> None:
        self.streams = streams

    def kv_used(self, role: Role) -> tuple[float, float] | None:
        return None

    def pool_gains(self, accept: float, loads: tuple[int, int] | None = None) -> None:
        return None

    def kv_streams(self) -> int | None:
        return self.streams

    def prefill_ahead(self, role: Role) -> int:
        return 0


def snap(spec: int = 0, base: int = 0, healthy: dict[Role, bool] | None = None) -> LoadSnapshot:
    return LoadSnapshot({Role.SPECULATIVE: spec, Role.BASELINE: base}, {}, healthy or UP)


@pytest.mark.parametrize(
    ("value", "found"),
    [(None, (False, None)), (b"on", (True, "on")), (b" OFF ", (True, "off")), (b"Auto", (True, None))],
)
def test_the_header_says_on_off_or_auto(value: bytes | None, found: tuple[bool, str | None]) -> None:
    assert switch.from_header(value) == found


@pytest.mark.parametrize("value", [b"", b"yes", b"1", b"true", b"on,off"])
def test_any_other_header_value_is_a_400(value: bytes) -> None:
    with pytest.raises(ApiError) as err:
        switch.from_header(value)
    assert (err.value.status, err.value.code) == (400, "invalid_speculation")


@pytest.mark.parametrize(
    ("value", "found"), [(True, "on"), (False, "off"), ("on", "on"), ("OFF", "off"), ("auto", None)]
)
def test_the_body_field_takes_words_and_booleans(value: object, found: str | None) -> None:
    assert switch.from_body(value) == found


@pytest.mark.parametrize("value", [None, 1, 0, "yes", [], {"on": True}])
def test_any_other_body_value_is_a_400(value: object) -> None:
    with pytest.raises(ApiError) as err:
        switch.from_body(value)
    assert (err.value.status, err.value.code, err.value.param) == (400, "invalid_speculation", "speculation")


def test_the_header_and_the_body_must_agree_and_either_beats_the_class() -> None:
    defaults = switch.class_defaults("code=on,creative=off")
    assert switch.asked((True, "on"), (True, "on"), "creative", defaults) == ("on", "header")
    assert switch.asked((False, None), (True, "off"), "code", defaults) == ("off", "body")
    # auto is no preference: the class's default stands.
    assert switch.asked((True, None), (False, None), "code", defaults) == ("on", "class")
    assert switch.asked((False, None), (True, None), "creative", defaults) == ("off", "class")
    assert switch.asked((False, None), (False, None), "other", defaults) == (None, None)
    assert switch.asked((False, None), (False, None), None, defaults) == (None, None)
    with pytest.raises(ApiError) as err:
        switch.asked((True, "on"), (True, "off"), None, {})
    assert (err.value.status, err.value.code) == (400, "conflicting_speculation")
    with pytest.raises(ApiError):
        switch.asked((True, None), (True, "off"), None, {})


def test_class_defaults_are_checked_at_start() -> None:
    assert switch.class_defaults(" code = on , creative=OFF, chat=auto ,") == {"code": "on", "creative": "off"}
    for bad in ("code", "code=yes", "=on", "code=on,code=off"):
        with pytest.raises(ValueError):
            switch.class_defaults(bad)
    assert Settings(_env_file=None, class_speculation="a=on").class_switches == {"a": "on"}
    with pytest.raises(ValueError, match="CLASS_KEY"):
        Settings(_env_file=None, class_speculation="a=on", class_key="none")


def test_off_goes_to_the_baseline_and_on_to_speculation_whatever_the_load() -> None:
    cfg = policy_cfg(high=4, low=2)
    light, heavy = snap(1, 0), snap(3, 5)
    assert decide(light, PolicyState(), cfg, Ask(speculation="off"))[:2] == (Role.BASELINE, "client_off")
    assert decide(heavy, PolicyState(), cfg, Ask())[:2] == (Role.BASELINE, "heavy_load")
    assert decide(heavy, PolicyState(), cfg, Ask(speculation="on"))[:2] == (Role.SPECULATIVE, "client_on")
    assert decide(light, PolicyState(), cfg, Ask(speculation="on"))[:2] == (Role.SPECULATIVE, "client_on")
    # The mode still moves with the load: a client's request does not hold it.
    state = PolicyState(Role.SPECULATIVE)
    assert decide(heavy, state, cfg, Ask(speculation="on")).state.mode == Role.BASELINE


def test_a_switch_that_cannot_be_honoured_leaves_the_usual_decision_and_its_reason() -> None:
    cfg = policy_cfg(high=4, low=2)
    spec_down = {Role.SPECULATIVE: False, Role.BASELINE: True}
    base_down = {Role.SPECULATIVE: True, Role.BASELINE: False}
    assert decide(snap(3, 5, spec_down), PolicyState(), cfg, Ask(speculation="on"))[:2] == (
        Role.BASELINE,
        "heavy_load",
    )
    assert decide(snap(1, 0, spec_down), PolicyState(), cfg, Ask(speculation="on"))[:2] == (
        Role.BASELINE,
        "only_healthy",
    )
    assert decide(snap(1, 0, base_down), PolicyState(), cfg, Ask(speculation="off"))[:2] == (
        Role.SPECULATIVE,
        "light_load",
    )
    # The speculative role's KV pool holds 3 streams: a fourth would wait for memory there.
    full = policy_cfg(high=4, low=2, capacity=3)
    assert decide(snap(3, 5), PolicyState(), full, Ask(speculation="on"))[:2] == (Role.BASELINE, "heavy_load")
    assert decide(snap(2, 5), PolicyState(), full, Ask(speculation="on"))[:2] == (Role.SPECULATIVE, "client_on")
    # Under every policy: the group's reading of the pool when the policy is not told it.
    room = Here(snap(3, 5), cfg, PolicyState(), False, _Pools(3))
    assert run(steps_for(policy_for("threshold"), False), Ask(speculation="on"), room)[:2] == (
        Role.BASELINE,
        "heavy_load",
    )
    room = Here(snap(2, 5), cfg, PolicyState(), False, _Pools(3))
    assert run(steps_for(policy_for("threshold"), False), Ask(speculation="on"), room)[:2] == (
        Role.SPECULATIVE,
        "client_on",
    )
    # A batch request never takes speculation's room.
    assert decide(snap(0, 0), PolicyState(), cfg, Ask(batch=True, speculation="on"))[:2] == (Role.BASELINE, "batch")


def test_no_later_step_moves_what_the_client_asked() -> None:
    cfg = policy_cfg("adaptive", high=10, low=4, kv_spill_at=0.9, kv_spill_room=0.6)
    # A turn held on speculation between the watermarks would stay there (affinity); asked off, it does not.
    ask = Ask(held=Role.SPECULATIVE, speculation="off")
    assert decide(snap(3, 3), PolicyState(), cfg, ask, pooled=True)[:2] == (Role.BASELINE, "client_off")
    # A probe due in baseline mode waits for a request that did not ask for the baseline.
    probing = policy_cfg("adaptive", high=2, low=0, probe_s=1.0, probe_shadow=False, probe_max_load=50)
    state = PolicyState(Role.BASELINE, since=-100.0)
    due = LoadSnapshot({Role.SPECULATIVE: 0, Role.BASELINE: 0}, {}, UP, now=0.0, speculative_idle_since=-100.0)
    assert decide(due, state, probing, Ask())[:2] == (Role.SPECULATIVE, "probe")
    assert decide(due, state, probing, Ask(speculation="off"))[:2] == (Role.BASELINE, "client_off")


async def _post(gw: Any, body: dict[str, Any], headers: dict[str, str] | None = None) -> tuple[int, Any]:
    r = await gw.client.post("/v1/chat/completions", json=body, headers=headers)
    return r.status_code, r


@pytest.mark.anyio
async def test_the_gateway_honours_the_switch_and_counts_it(gateway: StartGateway) -> None:
    gw = await gateway(class_speculation="code=on,creative=off", high_watermark=64, low_watermark=32)
    cases: list[tuple[dict[str, str], dict[str, Any], tuple[str, str]]] = [
        ({"x-specgate-speculation": "off"}, {}, ("baseline", "client_off")),
        ({"x-specgate-speculation": "on"}, {}, ("speculative", "client_on")),
        ({}, {"speculation": False}, ("baseline", "client_off")),
        ({}, {"speculation": "on"}, ("speculative", "client_on")),
        ({"x-specgate-class": "creative"}, {}, ("baseline", "client_off")),
        ({"x-specgate-class": "creative", "x-specgate-speculation": "on"}, {}, ("speculative", "client_on")),
        ({"x-specgate-class": "chat"}, {}, ("speculative", "light_load")),
    ]
    for headers, extra, expected in cases:
        status, r = await _post(gw, {**CHAT, **extra}, headers)
        assert status == 200, r.text
        assert (r.headers["x-specgate-backend"], r.headers["x-specgate-reason"]) == expected, (headers, extra)
    m = await gw.metrics_text()
    assert 'specgate_speculation_switch_total{honoured="true",source="header",switch="on"} 2.0' in m
    assert 'specgate_speculation_switch_total{honoured="true",source="body",switch="off"} 1.0' in m
    assert 'specgate_speculation_switch_total{honoured="true",source="class",switch="off"} 1.0' in m
    assert 'specgate_routing_decisions_total{backend="baseline",reason="client_off"} 3.0' in m
    page = await gw.routing()
    assert [s["step"] for s in page["pipeline"]][:4] == ["stored_response", "priority", "mode", "switch"]
    assert page["speculation"]["class_defaults"] == {"code": "on", "creative": "off"}
    assert page["speculation"]["asked"]["on"] == {"honoured": 3, "not_honoured": 0}


@pytest.mark.anyio
async def test_bad_switches_are_400s_that_leave_nothing_behind(gateway: StartGateway) -> None:
    gw = await gateway()
    bad: list[tuple[dict[str, str], dict[str, Any], str]] = [
        ({"x-specgate-speculation": "maybe"}, {}, "invalid_speculation"),
        ({}, {"speculation": 1}, "invalid_speculation"),
        ({}, {"speculation": None}, "invalid_speculation"),
        ({"x-specgate-speculation": "on"}, {"speculation": "off"}, "conflicting_speculation"),
    ]
    for headers, extra, code in bad:
        status, r = await _post(gw, {**CHAT, **extra}, headers)
        assert status == 400
        assert r.json()["error"]["code"] == code
    r = await gw.client.post(
        "/v1/chat/completions",
        json=CHAT,
        headers=[("x-specgate-speculation", "on"), ("x-specgate-speculation", "on")],
    )
    assert (r.status_code, r.json()["error"]["code"]) == (400, "repeated_header")
    assert (await gw.routing())["inflight"] == 0
    assert gw.spec.hits["/v1/chat/completions"] + gw.base.hits["/v1/chat/completions"] == 0


@pytest.mark.anyio
async def test_the_switch_never_reaches_a_server(gateway: StartGateway) -> None:
    spec, base = Recorder(), Recorder()
    async with serving(spec) as spec_url, serving(base) as base_url:
        gw = await gateway(speculative_url=spec_url, baseline_url=base_url, health_interval_s=0.05)
        # A seed past 64 bits and a float to the bit go on exactly as sent.
        raw = (
            b'{"model":"m","speculation":"off","seed":123456789012345678901234567890,'
            b'"temperature":0.1000000000000000055511151231257827,'
            b'"messages":[{"role":"user","content":"h\\u00e9"}],"stream":true}'
        )
        r = await gw.client.post(
            "/v1/chat/completions",
            content=raw,
            headers={"content-type": "application/json", "x-specgate-speculation": "off"},
        )
        assert r.status_code == 200, r.text
        assert r.headers["x-specgate-reason"] == "client_off"
    assert not spec.raw and len(base.raw) == 1
    sent = base.raw[0]
    assert b"speculation" not in sent
    assert "x-specgate-speculation" not in base.header_names[0]
    assert b"123456789012345678901234567890" in sent
    got = orjson.loads(sent)
    assert got["temperature"] == 0.1 and got["messages"][0]["content"] == "h\u00e9"
    assert set(got) == {"model", "seed", "temperature", "messages", "stream", "stream_options"}
