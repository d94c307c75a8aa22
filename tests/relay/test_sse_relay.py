"""SseRelay and ResponseEvents: bytes pass through unchanged in whole events, framed with any line
end; the injected usage chunk is dropped across any split; a stream that breaks ends in whole
events and then its error."""

from __future__ import annotations

import itertools

import orjson
import pytest
from hypothesis import given
from hypothesis import strategies as st

from proxy.relay import sse
from proxy.relay.sse import (
    PARTIAL_EVENT_LIMIT,
    EventCuts,
    JsonUsage,
    ResponseEvents,
    SseRelay,
    reader_for,
    usage_of,
)
from proxy.relay.sseframe import data_of, last_end, split_events

ROLE = b'data: {"id":"1","choices":[{"index":0,"delta":{"role":"assistant","content":""}}]}\n\n'
TOKEN = b'data: {"id":"1","choices":[{"index":0,"delta":{"content":" hi"}}]}\n\n'
FINISH = b'data: {"id":"1","choices":[{"index":0,"delta":{},"finish_reason":"length"}]}\n\n'
USAGE = b'data: {"id":"1","choices":[],"usage":{"prompt_tokens":7,"completion_tokens":3,"total_tokens":10}}\n\n'
DONE = b"data: [DONE]\n\n"
STREAM = ROLE + TOKEN * 3 + FINISH + USAGE + DONE


def splits(data: bytes, size: int) -> list[bytes]:
    return [data[i : i + size] for i in range(0, len(data), size)]


@pytest.mark.parametrize("size", [1, 7, 64, 1000, len(STREAM)])
def test_strip_drops_only_the_usage_chunk_whatever_the_split(size: int) -> None:
    relay = SseRelay(strip_usage=True)
    out = b"".join(relay.feed(c) for c in splits(STREAM, size)) + relay.flush()
    assert out == ROLE + TOKEN * 3 + FINISH + DONE
    assert relay.usage() == (7, 3)


@pytest.mark.parametrize("size", [1, 13, len(STREAM)])
def test_without_strip_the_stream_passes_unchanged_in_whole_events(size: int) -> None:
    relay = SseRelay(strip_usage=False)
    out = [relay.feed(c) for c in splits(STREAM, size)]
    assert b"".join(out) + relay.flush() == STREAM
    assert all(o.endswith(b"\n\n") for o in out if o)  # a client never holds half an event
    assert relay.usage() == (7, 3)


def test_old_builds_with_usage_null_on_every_chunk() -> None:
    chunk = b'data: {"id":"1","choices":[{"index":0,"delta":{"content":"x"}}],"usage":null}\n\n'
    relay = SseRelay(strip_usage=True)
    assert relay.feed(chunk) == chunk
    assert relay.usage() is None


def test_native_generate_stream_takes_the_last_meta_info() -> None:
    events = [b'data: {"text":"a","meta_info":{"prompt_tokens":2,"completion_tokens":%d}}\n\n' % n for n in (1, 2)]
    relay = SseRelay(strip_usage=False)
    for e in [*events, DONE]:
        relay.feed(e)
    assert relay.usage() == (2, 2)


def test_stream_without_event_boundaries_is_not_held_forever() -> None:
    relay = SseRelay(strip_usage=True)
    blob = b"x" * (PARTIAL_EVENT_LIMIT + 10)
    assert relay.feed(blob) == blob
    assert relay.feed(b"more") == b"more"


def test_usage_of() -> None:
    assert usage_of({"usage": {"prompt_tokens": 1, "completion_tokens": 2}}) == (1, 2)
    assert usage_of({"meta_info": {"prompt_tokens": 1, "completion_tokens": 2}}) == (1, 2)
    assert usage_of({"usage": None}) is None
    assert usage_of([1]) is None
    # Counts no server could report are no usage: they would reach counters (a negative increment
    # raises), the prompt estimate and the affinity table.
    for p, c in ((-5, 3), (5, -1), (True, 3), (10**12, 3), (3, 2**70)):
        assert usage_of({"usage": {"prompt_tokens": p, "completion_tokens": c}}) is None, (p, c)
    assert usage_of({"usage": {"prompt_tokens": 0, "completion_tokens": 10**9}}) == (0, 10**9)


# llama-server: asked for usage, it moves `timings` from the finish chunk into the usage chunk.
LL_FINISH = b'data: {"choices":[{"delta":{},"finish_reason":"length","index":0}],"id":"1"}\n\n'
LL_USAGE = (
    b'data: {"choices":[],"id":"1","timings":{"draft_n":12,"draft_n_accepted":9,"predicted_n":3},'
    b'"usage":{"completion_tokens":3,"prompt_tokens":7,"total_tokens":10}}\n\n'
)
LL_STREAM = ROLE + TOKEN * 3 + LL_FINISH + LL_USAGE + DONE


@pytest.mark.parametrize("size", [1, 5, 64, len(LL_STREAM) - len(DONE), len(LL_STREAM)])
def test_strip_gives_fields_moved_into_the_usage_chunk_back_to_the_finish_chunk(size: int) -> None:
    relay = SseRelay(strip_usage=True)
    out = b"".join(relay.feed(c) for c in splits(LL_STREAM, size)) + relay.flush()
    events = out.split(b"\n\n")
    assert out.startswith(ROLE + TOKEN * 3) and out.endswith(DONE)
    assert len(events) == 7  # role, 3 tokens, finish, [DONE], and the empty tail: no usage chunk
    finish = orjson.loads(events[4].removeprefix(b"data: "))
    assert finish["timings"] == {"draft_n": 12, "draft_n_accepted": 9, "predicted_n": 3}
    assert finish["choices"][0]["finish_reason"] == "length" and "usage" not in finish
    assert relay.usage() == (7, 3)


@pytest.mark.parametrize("strip", [True, False])
def test_a_streams_own_acceptance_is_read_where_the_server_wrote_it(strip: bool) -> None:
    timings = b'"timings":{"draft_n":56,"draft_n_accepted":33,"predicted_n":64}'
    usage = b'data: {"choices":[],"id":"1",%s,"usage":{"completion_tokens":64,"prompt_tokens":7}}\n\n' % timings
    relay = SseRelay(strip_usage=strip)
    for c in splits(ROLE + TOKEN * 3 + LL_FINISH + usage + DONE, 9):
        relay.feed(c)
    relay.flush()
    assert (relay.usage(), relay.steps()) == ((7, 64), (64, 31))
    # SGLang's native stream: the last event's meta_info, which has spec_verify_ct once finished.
    native = SseRelay(strip_usage=False)
    native.feed(b'data: {"text":"a","meta_info":{"prompt_tokens":2,"completion_tokens":1}}\n\n')
    native.feed(b'data: {"text":"ab","meta_info":{"prompt_tokens":2,"completion_tokens":40,"spec_verify_ct":16}}\n\n')
    assert native.steps() == (40, 17)  # and the prefill's step
    # A body: its top-level timings; a stream with none, or a body read as nothing, reports none.
    body = JsonUsage()
    body.feed(b'{"choices":[],"usage":{"prompt_tokens":7,"completion_tokens":64},%s}' % timings)
    assert body.steps() == (64, 31)
    plain = SseRelay(strip_usage=strip)
    plain.feed(STREAM)
    assert plain.steps() is None
    assert reader_for("text/plain", 500, strip).steps() is None
    assert ResponseEvents().steps() is None


def test_finish_chunk_is_held_only_until_the_next_bytes() -> None:
    relay = SseRelay(strip_usage=True)
    assert relay.feed(ROLE + LL_FINISH) == ROLE  # the usage chunk may follow
    assert relay.feed(DONE) == LL_FINISH + DONE  # it did not: the finish chunk goes on unchanged
    assert SseRelay(strip_usage=False).feed(LL_FINISH) == LL_FINISH  # nothing held when nothing is dropped


def test_moved_fields_survive_when_the_finish_chunk_is_gone() -> None:
    relay = SseRelay(strip_usage=True)
    relay.feed(TOKEN)
    out = relay.feed(LL_USAGE + DONE)
    kept = orjson.loads(out.split(b"\n\n")[0].removeprefix(b"data: "))
    assert kept == {"choices": [], "id": "1", "timings": {"draft_n": 12, "draft_n_accepted": 9, "predicted_n": 3}}


def crlf(data: bytes) -> bytes:
    return data.replace(b"\n", b"\r\n")


@pytest.mark.parametrize("end", [b"\r\n", b"\r"], ids=["crlf", "cr"])
@pytest.mark.parametrize("size", [1, 5, 64, len(STREAM) * 2])
def test_any_line_end_frames_a_stream(end: bytes, size: int) -> None:
    framed = STREAM.replace(b"\n", end)
    relay = SseRelay(strip_usage=True)
    out = b"".join(relay.feed(c) for c in splits(framed, size)) + relay.flush()
    assert out == (ROLE + TOKEN * 3 + FINISH + DONE).replace(b"\n", end)
    assert relay.usage() == (7, 3)
    kept = SseRelay(strip_usage=False)
    assert b"".join(kept.feed(c) for c in splits(framed, size)) + kept.flush() == framed
    assert kept.usage() == (7, 3)
    assert sse.content_events(framed) == 3 and sse.completion_tokens(framed) == 3


@pytest.mark.parametrize("size", [1, 9, 1000])
def test_a_chat_stream_broken_mid_event_drops_the_half_event(size: int) -> None:
    for strip in (True, False):
        relay = SseRelay(strip_usage=strip)
        cut = ROLE + TOKEN + TOKEN[:20]
        out = b"".join(relay.feed(c) for c in splits(cut, size))
        out += relay.broken("Upstream stream broke", "upstream_disconnect")
        events = split_events(out)
        assert events[:2] == [ROLE, TOKEN] and events[-1] == DONE
        assert orjson.loads(data_of(events[2]) or b"")["error"]["code"] == "upstream_disconnect"
        assert len(events) == 4


def test_an_event_passed_on_past_the_limit_is_closed_before_the_error() -> None:
    relay = SseRelay(strip_usage=False)
    blob = b"data: " + b"x" * (PARTIAL_EVENT_LIMIT + 10)
    assert relay.feed(blob) == blob
    assert relay.broken("broke", "upstream_disconnect").startswith(b"\n\ndata: ")


CREATED = b'event: response.created\ndata: {"type":"response.created","sequence_number":0}\n\n'
DELTA = b'event: response.output_text.delta\ndata: {"type":"response.output_text.delta","delta":"a"}\n\n'
COMPLETED = (
    b'event: response.completed\ndata: {"type":"response.completed","response":{"id":"resp_1","object":"response",'
    b'"usage":{"input_tokens":11,"output_tokens":4}}}\n\n'
)


@pytest.mark.parametrize("end", [b"\n", b"\r\n", b"\r"], ids=["lf", "crlf", "cr"])
@pytest.mark.parametrize("size", [1, 7, 4096])
def test_responses_events_are_counted_without_comments_in_any_framing(end: bytes, size: int) -> None:
    body = (CREATED + b": ping\n\n" * 3 + DELTA + b":\n\n" + COMPLETED).replace(b"\n", end)
    reader = ResponseEvents()
    out = b"".join(reader.feed(c) for c in splits(body, size)) + reader.flush()
    assert out == body
    assert (reader.events, reader.usage(), reader.response_id()) == (3, (11, 4), "resp_1")


def test_a_responses_stream_broken_mid_event_ends_with_a_whole_error_event() -> None:
    reader = ResponseEvents()
    cut = CREATED + b": ping\n\n" + DELTA + b'event: response.output_text.delta\ndata: {"type": "resp'
    out = b"".join(reader.feed(c) for c in splits(cut, 11)) + reader.broken("broke", "upstream_disconnect")
    events = [e for e in split_events(out) if data_of(e) is not None]
    assert events[:2] == [CREATED, DELTA]
    error = orjson.loads(data_of(events[2]) or b"")
    assert (error["type"], error["sequence_number"], len(events)) == ("error", 2, 3)


def test_data_of_reads_fields_as_an_event_source_does() -> None:
    assert data_of(b"data: a\ndata:b\r\ndata\n\n") == b"a\nb\n"
    assert data_of(b": ping\n\n") is None
    assert data_of(b"event: x\ndatum: y\n\n") is None
    assert data_of(b"id: 1\rdata: z\r\r") == b"z"


@given(st.lists(st.sampled_from([b"\n", b"\r", b"\r\n", b"a", b"data: x", b":"]), max_size=30))
def test_framing_splits_any_bytes_back_into_themselves(parts: list[bytes]) -> None:
    data = b"".join(parts)
    events = split_events(data)
    assert b"".join(events) == data
    # Cut anywhere and fed in two pieces, the bytes come out as they went in, and what went out
    # never leaves the client inside an event: past its last blank line, line ends at most.
    ends = [0, *itertools.accumulate(len(e) for e in split_events(data[: last_end(data)]))]
    for at in range(len(data) + 1):
        for then in range(at, len(data) + 1, 3):
            cuts = EventCuts(1 << 20)
            sent = [cuts.cut(data[:at])]
            sent.append(sent[-1] + cuts.cut(data[at:then]))
            sent.append(sent[-1] + cuts.cut(data[then:]))
            assert sent[-1] + cuts.rest() == data
            for out in sent:
                assert not out[max(e for e in ends if e <= len(out)) :].strip(b"\r\n"), out


def test_events_past_the_hold_limit_are_still_counted_once() -> None:
    reader = ResponseEvents()
    reader._cuts = EventCuts(50)
    big = b"event: response.output_text.delta\ndata: " + b"x" * 120 + b"\n\n"
    body = CREATED + big + DELTA + COMPLETED
    out = b"".join(reader.feed(c) for c in splits(body, 40)) + reader.flush()
    assert out == body and reader.events == 4


@given(
    st.lists(st.tuples(st.integers(0, 90), st.sampled_from([b"\n", b"\r\n", b"\r"]), st.booleans()), max_size=8),
    st.integers(1, 40),
    st.integers(8, 64),
)
def test_responses_events_are_counted_once_whatever_the_reads_and_the_hold_limit(
    events: list[tuple[int, bytes, bool]], size: int, limit: int
) -> None:
    body = b"".join(
        (b"event: e\ndata: " + b"x" * n + b"\n\n" if data else b": p\n\n").replace(b"\n", end)
        for n, end, data in events
    )
    reader = ResponseEvents()
    reader._cuts = EventCuts(limit)
    out = b"".join(reader.feed(c) for c in splits(body, size)) + reader.flush()
    assert out == body
    assert reader.events == sum(data for _, _, data in events)


def test_a_usage_chunk_specgate_cannot_rewrite_is_dropped_whole() -> None:
    deep = b"[" * 300 + b"]" * 300  # orjson reads 1,024 levels, writes 254
    usage = b'data: {"choices":[],"usage":{"prompt_tokens":1,"completion_tokens":2},"x":%s}\n\n' % deep
    for before in (b"", LL_FINISH):
        relay = SseRelay(strip_usage=True)
        out = relay.feed(ROLE + before + usage + DONE) + relay.flush()
        assert out == ROLE + before + DONE and relay.usage() == (1, 2)


def test_a_usage_chunk_last_without_its_end_is_read_and_dropped() -> None:
    relay = SseRelay(strip_usage=True)
    out = relay.feed(ROLE + FINISH + USAGE.rstrip(b"\n")) + relay.flush()
    assert out == ROLE + FINISH and relay.usage() == (7, 3)


def test_empty_reads_do_not_hide_an_events_end() -> None:
    cuts = EventCuts(1 << 20)
    assert [cuts.cut(c) for c in (b"data: x\n", b"", b"", b"", b"\n")] == [b"", b"", b"", b"", b"data: x\n\n"]
