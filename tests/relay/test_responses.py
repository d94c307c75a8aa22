"""The OpenAI Responses API (`POST /v1/responses`) through specgate: relayed streamed and not, its
usage counted from `response.completed`, its own error event when a stream breaks, the lease
released on every path, a retry before the first byte, and a continuation (`previous_response_id`)
sent back to the server that stored the response. In-process against the simulators, and with the
real openai SDK against the proxy as a process."""

from __future__ import annotations

from typing import Any

import openai
import orjson
import pytest

from loadtest.simulator.wire import token_text
from proxy.relay.shadow import shadow_body
from proxy.relay.sse import ResponseEvents, response_deltas, usage_of
from proxy.relay.stored import MAX_ID_CHARS, StoredResponses

from ..conftest import StartStack
from ..helpers import scrape, wait_for, wait_until
from ..inprocess import Gateway, StartGateway

# A generation that outlasts any test, within the simulator's context.
LONG = {"input": "p", "max_output_tokens": 120_000, "stream": True}
# The events of a streamed response, in order, with one delta per decode step in the middle.
OPENING = ["response.created", "response.in_progress", "response.output_item.added", "response.content_part.added"]
CLOSING = ["response.output_text.done", "response.content_part.done", "response.output_item.done"]


def typed_events(raw: bytes) -> list[tuple[str, dict[str, Any]]]:
    """(event, data) of each event of a Responses stream; every event names its type twice."""
    out = []
    for block in raw.split(b"\n\n"):
        if not block.strip():
            continue
        head, data = block.split(b"\n", 1)
        assert head.startswith(b"event: ") and data.startswith(b"data: "), block
        obj = orjson.loads(data[len(b"data: ") :])
        assert obj["type"] == head[len(b"event: ") :].decode()
        out.append((obj["type"], obj))
    return out


async def _inflight_is(gw: Gateway, n: int) -> bool:
    return bool((await gw.metrics())["specgate_inflight_requests"] == n)


# ---------------------------------------------------------------------------------------------
# In-process: the gateway's behaviour


@pytest.mark.anyio
async def test_a_streamed_response_is_relayed_and_its_usage_counted(gateway: StartGateway) -> None:
    gw = await gateway()
    r = await gw.client.post(
        "/v1/responses", json={"model": "m", "input": "hello", "max_output_tokens": 9, "stream": True}
    )
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    assert r.headers["x-specgate-backend"] == "speculative"
    events = typed_events(r.content)
    kinds = [k for k, _ in events]
    assert kinds[:4] == OPENING and kinds[-4:-1] == CLOSING and kinds[-1] == "response.completed"
    assert set(kinds[4:-4]) == {"response.output_text.delta"}
    assert [e["sequence_number"] for _, e in events] == list(range(len(events)))  # as sent: nothing added
    assert "".join(e["delta"] for k, e in events if k.endswith(".delta")) == token_text(0, 9)
    usage = events[-1][1]["response"]["usage"]
    m = await gw.metrics()
    assert m["specgate_output_tokens_total"] == usage["output_tokens"] == 9
    assert m["specgate_prompt_tokens_total"] == usage["input_tokens"] > 0
    # Time to first token is the first delta's, not `response.created`'s (sent before the prompt is read).
    assert m["specgate_time_to_first_token_seconds_count"] == 1
    assert m["specgate_inflight_requests"] == 0
    text = await gw.metrics_text()
    assert 'specgate_requests_total{backend="speculative",code="2xx",endpoint="responses"} 1.0' in text


@pytest.mark.anyio
async def test_a_non_streamed_response_is_relayed_as_sent(gateway: StartGateway) -> None:
    gw = await gateway(sim={"created": 1700000000})
    r = await gw.client.post(
        "/v1/responses", json={"input": "hello", "instructions": "be brief", "max_output_tokens": 6}
    )
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "response" and body["id"].startswith("resp_")
    assert body["output"][0]["content"][0]["text"] == token_text(0, 6)
    m = await gw.metrics()
    assert m["specgate_output_tokens_total"] == body["usage"]["output_tokens"] == 6
    assert m["specgate_prompt_tokens_total"] == body["usage"]["input_tokens"]


@pytest.mark.anyio
async def test_a_continuation_goes_back_to_the_server_that_stored_its_response(gateway: StartGateway) -> None:
    # No hold: speculation returns as soon as each request is done.
    gw = await gateway(sim={"time_scale": 1}, high_watermark=1, low_watermark=0, low_watermark_hold_s=0)
    first = await gw.client.post("/v1/responses", json={"input": "remember the number 7", "max_output_tokens": 4})
    unstored = await gw.client.post("/v1/responses", json={"input": "x", "max_output_tokens": 4, "store": False})
    assert first.headers["x-specgate-backend"] == unstored.headers["x-specgate-backend"] == "speculative"
    assert (await gw.metrics())["specgate_stored_responses"] == 1  # `store: false` is not remembered
    # One long stream puts the load at the watermark: new requests go to the baseline...
    async with gw.client.stream("POST", "/v1/responses", json=LONG) as held:
        assert held.headers["x-specgate-backend"] == "speculative"
        fresh = await gw.client.post("/v1/responses", json={"input": "x", "max_output_tokens": 2})
        assert fresh.headers["x-specgate-backend"] == "baseline"
        # ...but a continuation of a stored response goes where that response is.
        after = {"input": "and the number?", "previous_response_id": first.json()["id"], "max_output_tokens": 3}
        nxt = await gw.client.post("/v1/responses", json=after)
        assert nxt.status_code == 200, nxt.text
        assert (nxt.headers["x-specgate-backend"], nxt.headers["x-specgate-reason"]) == (
            "speculative",
            "stored_response",
        )
        # The server held the conversation: the new prompt starts with the cached one.
        assert nxt.json()["usage"]["input_tokens"] > first.json()["usage"]["input_tokens"]
        assert nxt.json()["usage"]["input_tokens_details"]["cached_tokens"] > 0
        # A response that was not stored, or an id nobody made, is routed as any request; the
        # server that gets it answers for itself.
        lost = await gw.client.post("/v1/responses", json={**after, "previous_response_id": unstored.json()["id"]})
        assert (lost.status_code, lost.headers["x-specgate-backend"]) == (404, "baseline")
    m = await gw.metrics()
    assert m["specgate_stored_responses"] == 3  # and the fresh one's, and the continuation's
    await wait_until(lambda: _inflight_is(gw, 0))


@pytest.mark.anyio
async def test_a_continuation_whose_server_is_down_is_routed_as_any_request(gateway: StartGateway) -> None:
    gw = await gateway()
    first = await gw.client.post("/v1/responses", json={"input": "hi", "max_output_tokens": 2})
    assert first.headers["x-specgate-backend"] == "speculative"
    await gw.spec.stop()
    await wait_until(lambda: _spec_down(gw))
    after = {"input": "again", "previous_response_id": first.json()["id"], "max_output_tokens": 2}
    r = await gw.client.post("/v1/responses", json=after)
    # The baseline never saw that response, and says so: a clear 404, not a hang or a 5xx.
    assert (r.status_code, r.headers["x-specgate-backend"]) == (404, "baseline")
    assert "not found" in r.json()["message"]


async def _spec_down(gw: Gateway) -> bool:
    return (await gw.routing())["backends"]["speculative"]["healthy"] is False


@pytest.mark.anyio
async def test_a_broken_stream_ends_with_the_responses_error_event(gateway: StartGateway) -> None:
    gw = await gateway(sim={"stall_rate": 1, "seed": 1}, read_timeout_s=0.5)
    r = await gw.client.post("/v1/responses", json={"input": "p", "max_output_tokens": 1000, "stream": True})
    assert r.status_code == 200
    events = typed_events(r.content)
    kind, error = events[-1]
    assert kind == "error" and error["code"] == "upstream_timeout" and "read timeout" in error["message"]
    assert error["sequence_number"] == len(events) - 1  # numbered on from the server's events
    assert b"[DONE]" not in r.content  # this API has none
    assert any(k == "response.output_text.delta" for k, _ in events)
    m = await gw.metrics()
    assert m["specgate_inflight_requests"] == 0
    assert m["specgate_upstream_errors_total"] == 1


@pytest.mark.anyio
async def test_a_client_that_leaves_aborts_the_generation_and_releases(gateway: StartGateway) -> None:
    gw = await gateway(sim={"time_scale": 1})
    async with gw.client.stream("POST", "/v1/responses", json=LONG) as r:
        lines = r.aiter_lines()
        while "output_text.delta" not in await anext(lines):
            pass
        assert (await gw.routing())["inflight"] == 1

    async def aborted() -> bool:
        return (await gw.metrics(gw.spec.url))["sglang:num_aborted_requests_total"] == 1

    await wait_until(aborted)
    await wait_until(lambda: _inflight_is(gw, 0))
    assert (await gw.metrics())["specgate_client_disconnects_total"] == 1


@pytest.mark.anyio
async def test_a_refused_connection_is_retried_on_the_other_server(gateway: StartGateway) -> None:
    gw = await gateway(health_interval_s=60)  # no poll notices the stop: the request must
    await gw.spec.stop()
    r = await gw.client.post("/v1/responses", json={"input": "p", "max_output_tokens": 3, "stream": True})
    assert r.status_code == 200
    assert (r.headers["x-specgate-backend"], r.headers["x-specgate-reason"]) == ("baseline", "failover")
    assert typed_events(r.content)[-1][0] == "response.completed"
    assert (await gw.metrics())["specgate_inflight_requests"] == 0


# ---------------------------------------------------------------------------------------------
# Units: the stream reader, the probe's copy, the table


def _stream(deltas: list[str], usage: dict[str, int] | None) -> bytes:
    events: list[dict[str, Any]] = [{"type": "response.created", "response": {"id": "resp_1", "object": "response"}}]
    events += [{"type": "response.output_text.delta", "delta": d} for d in deltas]
    events.append({"type": "response.output_text.done", "text": "".join(deltas)})
    done = {"id": "resp_1", "object": "response", "output": [{"text": "".join(deltas)}], "usage": usage}
    events.append({"type": "response.completed", "response": done})
    return b"".join(
        b"event: " + e["type"].encode() + b"\ndata: " + orjson.dumps({**e, "sequence_number": i}) + b"\n\n"
        for i, e in enumerate(events)
    )


def test_the_reader_finds_usage_and_id_however_the_stream_is_cut() -> None:
    raw = _stream(["a", "bc", "", "d"], {"input_tokens": 11, "output_tokens": 4, "total_tokens": 15})
    for cut in range(len(raw) + 1):
        for step in (1, 7) if cut == 0 else (len(raw),):
            reader = ResponseEvents()
            pieces = [raw[:cut]] + [raw[i : i + step] for i in range(cut, len(raw), step)]
            assert b"".join(reader.feed(p) for p in pieces) == raw  # passed on unchanged
            reader.flush()
            assert (reader.usage(), reader.response_id(), reader.events) == ((11, 4), "resp_1", 7), (cut, step)
    # Three of the four deltas hold text; the done and completed events repeat it and do not count.
    assert response_deltas(raw) == 3


def test_the_reader_without_a_completed_event_knows_no_usage() -> None:
    raw = _stream(["a"], None)
    reader = ResponseEvents()
    reader.feed(raw[: raw.index(b"event: response.completed")])
    assert reader.usage() is None and reader.response_id() is None
    assert usage_of({"usage": {"prompt_tokens": 2, "completion_tokens": 3}}) == (2, 3)
    assert usage_of({"usage": {"input_tokens": 2, "output_tokens": 3}}) == (2, 3)


def test_a_probes_copy_of_a_responses_request() -> None:
    body = {
        "model": "m",
        "input": [{"role": "user", "content": "hi"}],
        "instructions": "terse",
        "max_output_tokens": 500,
        "tools": [{"type": "function", "name": "f"}],
        "metadata": {"k": "v"},
        "temperature": 0.2,
    }
    copy = orjson.loads(shadow_body(orjson.dumps(body), 16, typed=True) or b"null")
    assert copy == {
        "model": "m",
        "input": [{"role": "user", "content": "hi"}],
        "instructions": "terse",
        "temperature": 0.2,
        "max_output_tokens": 16,
        "stream": True,
        "store": False,  # a copy must leave nothing stored on the server
    }
    short = {**body, "max_output_tokens": 3}
    assert orjson.loads(shadow_body(orjson.dumps(short), 16, typed=True) or b"null") is None
    continued = {**body, "previous_response_id": "resp_1"}
    assert shadow_body(orjson.dumps(continued), 16, typed=True) is None


def test_the_table_of_stored_responses_is_bounded() -> None:
    table = StoredResponses(2)
    table.remember("a", "s1")
    table.remember("b", "s2")
    assert table.server_of("a") == "s1"  # used: now the newest
    table.remember("c", "s1")
    assert (len(table), table.server_of("b"), table.server_of("a"), table.server_of("c")) == (2, None, "s1", "s1")
    table.remember("x" * (MAX_ID_CHARS + 1), "s1")
    assert len(table) == 2 and table.server_of("x" * (MAX_ID_CHARS + 1)) is None
    off = StoredResponses(0)
    off.remember("a", "s1")
    assert len(off) == 0


# ---------------------------------------------------------------------------------------------
# Loopback: the real openai SDK against the proxy as a process


def _client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=30)


def test_openai_sdk_responses_streamed_and_not_and_continued(stack: StartStack) -> None:
    s = stack()
    c = _client(s.url)
    r = c.responses.create(model="m", input="What is speculative decoding?", max_output_tokens=8)
    assert r.output_text == token_text(0, 8)
    assert r.usage is not None and r.usage.output_tokens == 8
    events = list(c.responses.create(model="m", input="hello", max_output_tokens=6, stream=True))
    assert events[0].type == "response.created" and events[-1].type == "response.completed"
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == token_text(0, 6)
    assert events[-1].response.usage is not None and events[-1].response.usage.output_tokens == 6
    with c.responses.stream(model="m", input="hello", max_output_tokens=5) as stream:
        assert stream.get_final_response().output_text == token_text(0, 5)
    after = c.responses.create(model="m", input="and then?", previous_response_id=r.id, max_output_tokens=3)
    assert after.usage is not None and after.usage.input_tokens > r.usage.input_tokens


def test_openai_sdk_responses_errors_and_a_client_that_leaves(stack: StartStack) -> None:
    s = stack(sim_args=("--time-scale", "1"))
    c = _client(s.url)
    with pytest.raises(openai.NotFoundError) as err:
        c.responses.create(model="m", input="x", previous_response_id="resp_nobody", max_output_tokens=2)
    assert "not found" in str(err.value)
    with pytest.raises(openai.BadRequestError):
        c.responses.create(model="m", input=[], max_output_tokens=2)
    stream = c.responses.create(model="m", input="p", max_output_tokens=100_000, stream=True)
    for event in stream:
        if event.type == "response.output_text.delta":
            break
    stream.close()

    def gone() -> bool:
        m = scrape(s.url)
        return m["specgate_client_disconnects_total"] == 1 and m["specgate_inflight_requests"] == 0

    wait_for(gone, timeout_s=10)
    wait_for(lambda: scrape(s.spec.url)["sglang:num_aborted_requests_total"] == 1, timeout_s=10)
