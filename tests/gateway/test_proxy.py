"""The gateway as a process: the proxy under uvicorn in front of two simulator processes, driven by
the real openai SDK and raw HTTP. The gateway's behaviour through its HTTP surface is tested
in-process (test_gateway.py); what is left here needs the process: the SDK on a socket, the
process's own settings, a SIGTERM."""

from __future__ import annotations

import signal

import httpx
import openai
import orjson
import pytest
from openai.types.chat import ChatCompletionMessageParam

from loadtest.simulator.wire import token_text

from ..conftest import StartStack

CHAT: list[ChatCompletionMessageParam] = [{"role": "user", "content": "What is speculative decoding?"}]


def client(url: str, key: str = "unused") -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key=key, max_retries=0, timeout=30)


def test_openai_sdk_chat_and_completions_streaming_and_not(stack: StartStack) -> None:
    s = stack()
    c = client(s.url)
    chat = c.chat.completions.create(model="m", messages=CHAT, max_tokens=8)
    assert chat.choices[0].message.content == token_text(0, 8)
    assert chat.usage is not None and chat.usage.completion_tokens == 8
    chunks = list(c.chat.completions.create(model="m", messages=CHAT, max_tokens=8, stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == token_text(0, 8)
    assert all(ch.usage is None for ch in chunks)  # the usage chunk specgate asked for is dropped
    comp = c.completions.create(model="m", prompt="hello", max_tokens=5)
    assert comp.choices[0].text == token_text(0, 5)
    texts = [ch.choices[0].text for ch in c.completions.create(model="m", prompt="hello", max_tokens=5, stream=True)]
    assert "".join(texts) == token_text(0, 5)
    # The process disables the `_created` series (proxy/__main__.py); an app built in-process has them.
    assert "_created" not in httpx.get(s.url + "/metrics").text


def test_the_openai_sdk_switches_speculation_by_extra_body_and_header(stack: StartStack) -> None:
    s = stack(SPECGATE_CLASS_SPECULATION="creative=off")
    c = client(s.url)
    cases = [
        ({"extra_body": {"speculation": "off"}}, ("baseline", "client_off")),
        ({"extra_body": {"speculation": True}}, ("speculative", "client_on")),
        ({"extra_headers": {"x-specgate-speculation": "off"}}, ("baseline", "client_off")),
        ({"extra_headers": {"x-specgate-class": "creative"}}, ("baseline", "client_off")),
        ({}, ("speculative", "light_load")),
    ]
    for extra, expected in cases:
        raw = c.chat.completions.with_raw_response.create(model="m", messages=CHAT, max_tokens=4, **extra)  # type: ignore[arg-type]
        assert (raw.headers["x-specgate-backend"], raw.headers["x-specgate-reason"]) == expected, extra
        assert raw.parse().choices[0].message.content == token_text(0, 4)
    with pytest.raises(openai.BadRequestError) as err:
        c.chat.completions.create(model="m", messages=CHAT, max_tokens=4, extra_body={"speculation": "sometimes"})
    assert err.value.code == "invalid_speculation"


def test_sigterm_lets_running_streams_finish(stack: StartStack) -> None:
    s = stack(sim_args=("--time-scale", "1"))
    body = {"prompt": "p", "max_tokens": 40, "stream": True}  # ~0.5 s at the seed profile's speed
    with httpx.Client(timeout=30) as http, http.stream("POST", s.url + "/v1/completions", json=body) as r:
        lines = r.iter_lines()
        next(lines)
        s.proxy.popen.send_signal(signal.SIGTERM)
        rest = list(lines)
    events = [line for line in rest if line]
    assert events[-1] == "data: [DONE]"
    texts = [orjson.loads(e[len("data: ") :])["choices"][0]["text"] for e in events[:-1]]
    assert "".join(texts) == token_text(1, 39)  # nothing cut: every token after the first arrived
    assert s.proxy.popen.wait(10) == 0
    with pytest.raises(httpx.ConnectError):
        httpx.get(s.url + "/health")
