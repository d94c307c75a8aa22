"""Acceptance evidence pooled by client, and shadow copies never asking more than their request
(issue 25: one client's repetitive prompts moved the acceptance estimate, and the mode, for all)."""

from __future__ import annotations

import asyncio

import orjson
import pytest

from proxy.edge.access import client_key
from proxy.policy.base import Role
from proxy.policy.evidence import KEY_TOKENS, MAX_KEYS, AcceptanceEvidence
from proxy.relay.shadow import MIN_SHADOW_TOKENS, shadow_body

from ..helpers import Clock
from .test_adaptive import calibration, router


def test_a_clients_recent_probes_make_its_reading() -> None:
    ev = AcceptanceEvidence(fresh_s=10.0)
    ev.measured("a", 16, 1.0, now=0.0, session=1)
    ev.measured("a", 48, 3.0, now=0.0, session=1)
    # One probe session's streams: 64 tokens in 16 + 16 steps, 2 tokens a step, not the mean.
    assert ev.value(0.0) == pytest.approx(64 / 32)
    # A client sending two kinds of request, probed one copy at a time, reads as their mix (a
    # batch's tokens a step: their plain mean, 2.125), not as whichever kind the last copy
    # happened to be (a code turn at 3.0, a chat turn at 1.25).
    mixed = AcceptanceEvidence(fresh_s=10.0)
    for i, accept in enumerate((3.0, 1.25, 3.0, 1.25, 3.0, 1.25)):
        mixed.measured("a", 16, accept, now=15.0 * i)
        value = mixed.value(15.0 * i)
        assert value is not None and (1.6 < value < 2.6 or i == 0)
    assert mixed.value(75.0) == pytest.approx(2.125, abs=0.3)
    # Older probes fade: a client whose traffic changed is read anew within a few probes.
    for i in range(6, 12):
        mixed.measured("a", 16, 4.0, now=15.0 * i)
    assert mixed.value(15.0 * 11) == pytest.approx(4.0, rel=0.15)


def test_a_client_weighs_what_it_is_served() -> None:
    ev = AcceptanceEvidence(fresh_s=10.0)
    # The attacker: repetitive prompts every 0.3 s, each answered with a few tokens,
    # measured over and over, beside 30 streams of varied prompts served 50 times as much.
    for _ in range(200):
        ev.served("attacker", 16, now=0.0)
        ev.measured("attacker", 16, 3.75, now=0.0)
    assert ev.value(0.0) == pytest.approx(3.75)  # alone, it is all the traffic there is
    ev.served("honest", 50 * 200 * 16, now=0.0)
    ev.measured("honest", KEY_TOKENS, 1.0, now=0.0)
    assert ev.value(0.0) == pytest.approx((1 * 3.75 + 50 * 1.0) / 51)
    # A short measurement counts for what it measured.
    ev2 = AcceptanceEvidence(fresh_s=10.0)
    for key, accept, tokens in (("a", 1.0, KEY_TOKENS), ("b", 3.0, KEY_TOKENS / 4)):
        ev2.served(key, 100, now=0.0)
        ev2.measured(key, tokens, accept, now=0.0)
    assert ev2.value(0.0) == pytest.approx((1.0 * 1.0 + 0.25 * 3.0) / 1.25)
    # Measured but never served (only a probe's client so far): by measurement alone.
    ev3 = AcceptanceEvidence(fresh_s=10.0)
    ev3.measured("a", KEY_TOKENS, 2.0, now=0.0)
    assert ev3.value(0.0) == pytest.approx(2.0)


def test_evidence_fades_is_forgotten_and_is_bounded() -> None:
    ev = AcceptanceEvidence(fresh_s=10.0, memory_s=60.0)
    for key, accept, at in (("old", 1.0, 0.0), ("new", 3.0, 30.0)):
        ev.served(key, 100, now=at)
        ev.measured(key, KEY_TOKENS, accept, now=at)
    # Pooled over the memory, each weight fading with a half-life of a quarter of it (15 s).
    old = 100 * 0.25 * min(1.0, 0.25)
    assert ev.value(30.0) == pytest.approx((old * 1.0 + 100 * 3.0) / (old + 100))
    # Stands only while the newest measurement is fresh; then the engine's own reading does.
    assert ev.value(40.5) is None
    ev.measured("new", KEY_TOKENS, 3.0, now=61.0)
    assert ev.value(61.0) == pytest.approx(3.0)  # "old" forgotten after the memory
    assert len(ev) == 1
    for i in range(MAX_KEYS + 10):
        ev.served(f"k{i}", 16, now=70.0)
    assert len(ev) == MAX_KEYS
    # Nonsense never counts.
    ev.clear()
    for tokens, accept in ((0, 2.0), (16, 0.5), (16, float("nan")), (16, float("inf")), (-5, 2.0)):
        ev.measured("x", tokens, accept, now=0.0)
    ev.served("x", float("inf"), now=0.0)
    assert ev.value(0.0) is None


def test_a_client_measured_in_full_is_not_copied_again_while_others_are_served() -> None:
    ev = AcceptanceEvidence(fresh_s=10.0, memory_s=60.0)
    assert ev.wants_copy("a", 0.0)
    ev.measured("a", KEY_TOKENS - 1, 2.0, now=0.0)
    assert ev.wants_copy("a", 0.0)
    ev.measured("a", 16, 2.0, now=0.0)
    assert ev.wants_copy("a", 0.0)  # alone: its traffic is all there is
    ev.served("b", 100, now=1.0)
    assert not ev.wants_copy("a", 1.0) and ev.wants_copy("b", 1.0)
    assert ev.wants_copy("a", 12.0)  # b not served lately


def test_the_router_weighs_each_clients_reading_by_its_traffic() -> None:
    clock = Clock()
    r, health, _ = router(calibration(), clock)
    health["speculative"].engine = "sglang"
    # One client's repetitive prompt: 3.75 tokens a step, over and over. Alone, it is read on.
    for _ in range(20):
        r.note_output(Role.BASELINE, 16, client="key:attacker")
        r.note_shadow(61, 17, "key:attacker")
    assert r.learning.accept_live(clock.t)[0] == pytest.approx(3.75)
    assert r.wants_shadow_of("key:attacker")
    # Others are served far more, and measured once: the attacker is not copied again.
    r.note_output(Role.BASELINE, 20 * 16 * 9, client="addr:10.0.0.2")
    assert not r.wants_shadow_of("key:attacker") and r.wants_shadow_of("addr:10.0.0.2")
    r.note_shadow(64, 64, "addr:10.0.0.2")  # varied prompts: one token a step
    value, source = r.learning.accept_live(clock.t)
    assert value == pytest.approx((1 * 3.75 + 9 * 1.0) / 10) and source == "from probe streams"


def test_a_shadow_copy_never_asks_more_than_its_request() -> None:
    wide = {
        "model": "m",
        "prompt": [f"prompt {i}" for i in range(200)],
        "max_tokens": 12,
        "n": 4,
        "best_of": 8,
        "use_beam_search": True,
        "logprobs": 5,
        "prompt_logprobs": 5,
        "return_logprob": True,
        "top_logprobs_num": 5,
        "echo": True,
        "tools": [{"type": "function", "function": {"name": "f"}}],
        "response_format": {"type": "json_object"},
        "regex": "a+",
        "min_tokens": 100,
        "seed": 7,
    }
    copy = orjson.loads(shadow_body(orjson.dumps(wide), 16) or b"")
    assert copy == {
        "model": "m",
        "prompt": "prompt 0",  # one prompt of the 200
        "seed": 7,
        "max_tokens": 12,  # the client's, below the probe's 16
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    # A single tokenized prompt stays whole; a batch of them is cut to one.
    assert orjson.loads(shadow_body(b'{"prompt": [1, 2, 3]}', 16) or b"")["prompt"] == [1, 2, 3]
    assert orjson.loads(shadow_body(b'{"prompt": [[1, 2], [3]]}', 16) or b"")["prompt"] == [1, 2]
    # A client asking for 1 token (or fewer than a reading needs) gets no copy at all.
    for limit in (0, 1, MIN_SHADOW_TOKENS - 1):
        assert shadow_body(orjson.dumps({"messages": [], "max_tokens": limit}), 16) is None
        assert shadow_body(orjson.dumps({"messages": [], "max_completion_tokens": limit}), 16) is None
    assert orjson.loads(shadow_body(b'{"messages": [], "max_tokens": "9"}', 16) or b"")["max_tokens"] == 16


def test_a_body_too_deep_to_write_back_is_not_copied() -> None:
    deep = b'{"messages": [], "x": ' + b"[" * 300 + b"]" * 300 + b"}"
    assert shadow_body(deep, 16) is not None  # "x" is not kept: nothing deep is written
    deeper = b'{"messages": [{"role": "user", "content": ' + b"[" * 300 + b"]" * 300 + b"}]}"
    assert shadow_body(deeper, 16) is None


def test_the_client_key_hides_the_api_key() -> None:
    key = client_key(b"Bearer sk-secret-123", "10.0.0.1")
    assert key.startswith("key:") and "sk-secret" not in key
    assert key == client_key(b"bearer  sk-secret-123 ", "10.0.0.2")  # the key, wherever it comes from
    assert key != client_key(b"Bearer sk-other", "10.0.0.1")
    assert client_key(b"", "10.0.0.1") == "addr:10.0.0.1"
    assert client_key(b"Basic abc", None) == "addr:-"


# ----- a probe that fails for a reason of specgate's own is said once, and probes go on -----


class _Resp:
    status = 200

    def __init__(self) -> None:
        self._chunks = [b'data: {"choices":[{"delta":{"content":"a"}}]}\n\n' * 17,
                        b'data: {"usage":{"completion_tokens":61}}\n\ndata: [DONE]\n\n']  # fmt: skip

    async def read_chunk(self) -> bytes:
        return self._chunks.pop(0) if self._chunks else b""

    def release(self) -> None:
        pass

    def close(self) -> None:
        pass


class _Upstream:
    async def send(self, server: str, target: bytes, body: bytes, headers: bytes) -> _Resp:
        return _Resp()


class _Lease:
    server = "speculative"
    released = 0

    def release(self) -> None:
        _Lease.released += 1


class _Router:
    def __init__(self) -> None:
        self.fail = True
        self.noted = 0

    def wants_shadow_of(self, client: str) -> bool:
        return True

    def admit(self, role: str, tokens: int = 0) -> _Lease:
        return _Lease()

    def note_shadow(self, tokens: int, events: int, client: str) -> None:
        if self.fail:
            self.fail = False
            raise ZeroDivisionError("a bug in learning")
        self.noted += 1


def test_a_probe_that_raises_is_logged_once_and_probes_go_on(caplog: pytest.LogCaptureFixture) -> None:
    from proxy.edge.call import ProxyCall
    from proxy.observability.metrics import Metrics
    from proxy.relay.shadow import Prober

    body = b'{"messages": [], "max_tokens": 64}'
    call = ProxyCall(b"/v1/chat/completions", "chat", body, b"x-request-id: rid\r\n", "rid", False, False, 0.0,
                     "addr:x")  # fmt: skip
    router = _Router()
    metrics = Metrics(("speculative", "baseline"), ("group-0",))

    async def two_probes() -> None:
        prober = Prober(_Upstream(), metrics, 16)  # type: ignore[arg-type]
        for _ in range(2):
            assert prober.start(call, router)  # type: ignore[arg-type]
            task = prober._task
            assert task is not None
            await task  # the task ends normally: nothing escapes it

    with caplog.at_level("INFO", logger="specgate.probe"):
        asyncio.run(two_probes())
    failed = [r for r in caplog.records if "failed; probes go on" in r.getMessage()]
    assert len(failed) == 1 and failed[0].exc_info is not None
    assert any("shadow probes work again" in r.getMessage() for r in caplog.records)
    assert router.noted == 1 and _Lease.released == 2  # the lease released on both paths
    outcomes = {s.labels["outcome"]: s.value for m in metrics.registry.collect() for s in m.samples
                if s.name == "specgate_shadow_probes_total"}  # fmt: skip
    assert outcomes["error"] == 1 and outcomes["ok"] == 1


def test_a_shadow_that_could_not_be_sent_is_not_counted_and_the_count_is_bounded() -> None:
    import dataclasses

    from proxy.policy.base import PolicyState, Role
    from proxy.routing.steps.pipeline import decide
    from proxy.routing.steps.probe import MAX_PROBE_DOUBLINGS

    from .test_adaptive import SHADOW, snap

    # The attacker sends requests no copy can be made of (max_tokens 1), many a second,
    # while a probe is due: each was counted as a probe, the count passed 1,023 and 2.0 ** probes
    # overflowed into a 500 for every client.
    state = PolicyState(Role.BASELINE, since=0.0, probes=5000)
    assert decide(snap(0, 12, 100.0, 0.0), state, SHADOW).shadow  # no OverflowError
    d = decide(snap(0, 12, 100.0, 0.0), PolicyState(Role.BASELINE, since=0.0, probes=MAX_PROBE_DOUBLINGS), SHADOW)
    assert d.state.probes == MAX_PROBE_DOUBLINGS
    # Not sent: the next request may be the probe, as if this one had not been due.
    clock = Clock()
    r, _, _ = router(calibration(), clock)
    r.state = dataclasses.replace(r.state, probes=3)
    r.shadow_not_sent()
    assert r.state.probes == 2
    r.state = dataclasses.replace(r.state, probes=0)
    r.shadow_not_sent()
    assert r.state.probes == 0
