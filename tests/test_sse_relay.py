"""SseRelay: bytes pass through unchanged; the injected usage chunk is dropped across any split."""

from __future__ import annotations

import orjson
import pytest

from proxy.sse import PARTIAL_EVENT_LIMIT, JsonUsage, ResponseEvents, SseRelay, reader_for, usage_of

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
def test_without_strip_every_chunk_passes_unchanged(size: int) -> None:
    relay = SseRelay(strip_usage=False)
    pieces = splits(STREAM, size)
    assert [relay.feed(c) for c in pieces] == pieces
    assert relay.flush() == b""
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
