"""The simulator speaks SGLang's wire contract (shared/sglang-contract.md), checked on a real process."""

from __future__ import annotations

import socket
import time

import httpx
import openai
import orjson
import pytest
from openai.types.chat import ChatCompletionMessageParam

from loadtest.procs import http_status
from loadtest.simulator.wire import EOS_TOKEN_ID, token_text
from proxy.fleet import engines, readings

from ..conftest import StartSim, StartStack
from ..helpers import scrape, sse_events, sse_json, wait_for

FAST = ("--time-scale", "50")
CHAT: list[ChatCompletionMessageParam] = [{"role": "user", "content": "Explain speculative decoding in one paragraph."}]


def client(url: str, key: str = "unused") -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key=key, max_retries=0, timeout=20)


def test_chat_stream_chunk_order_and_no_usage_unless_asked(simulator: StartSim) -> None:
    sim = simulator("baseline", *FAST)
    chunks = list(client(sim.url).chat.completions.create(model="m", messages=CHAT, max_tokens=12, stream=True))
    first, *content, finish = chunks
    assert first.choices[0].delta.role == "assistant" and first.choices[0].delta.content == ""
    assert all(c.choices[0].finish_reason is None for c in content)
    assert "".join(c.choices[0].delta.content or "" for c in content) == token_text(0, 12)
    assert len(content) == 12  # baseline: one token per chunk
    assert finish.choices[0].finish_reason == "length"
    assert all(c.usage is None for c in chunks)
    assert len({c.id for c in chunks}) == 1 and first.model == "m"


def test_chat_stream_usage_chunk_when_asked_then_done(simulator: StartSim) -> None:
    sim = simulator("baseline", *FAST)
    body = {"messages": CHAT, "max_tokens": 9, "stream": True, "stream_options": {"include_usage": True}}
    raw = httpx.post(sim.url + "/v1/chat/completions", json=body, timeout=20).content
    events = sse_json(raw)
    assert events[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    usage_chunk = events[-1]
    assert usage_chunk["choices"] == []
    assert usage_chunk["usage"]["completion_tokens"] == 9
    assert usage_chunk["usage"]["prompt_tokens"] > 0
    assert events[-2]["choices"][0]["finish_reason"] == "length"
    assert all("usage" not in e for e in events[:-1])


def test_speculative_chunks_carry_several_tokens(simulator: StartSim) -> None:
    sim = simulator("speculative", *FAST, "--accept-length", "3")
    stream = client(sim.url).completions.create(model="m", prompt="hi", max_tokens=13, stream=True)
    texts = [c.choices[0].text for c in stream if c.choices and c.choices[0].finish_reason is None]
    sizes = [t.count(" ") for t in texts]
    # Prefill yields one token, then each decode step three, the last step what is left.
    assert sizes == [1, 3, 3, 3, 3]
    assert "".join(texts) == token_text(0, 13)


def test_non_streaming_chat_and_completion_usage(simulator: StartSim) -> None:
    sim = simulator("speculative", *FAST)
    c = client(sim.url)
    chat = c.chat.completions.create(model="served", messages=CHAT, max_tokens=20)
    assert chat.object == "chat.completion"
    assert chat.choices[0].message.content == token_text(0, 20)
    assert chat.usage is not None and chat.usage.completion_tokens == 20
    assert chat.usage.total_tokens == chat.usage.prompt_tokens + 20
    comp = c.completions.create(model="served", prompt="x" * 400, max_tokens=5)
    assert comp.object == "text_completion" and comp.choices[0].text == token_text(0, 5)
    assert comp.usage is not None and comp.usage.prompt_tokens == 100  # ~4 bytes a token
    assert comp.choices[0].finish_reason == "length"


def test_no_max_tokens_stops_on_eos(simulator: StartSim) -> None:
    sim = simulator("baseline", *FAST, "--default-max-tokens", "7")
    body = orjson.loads(httpx.post(sim.url + "/v1/chat/completions", json={"messages": CHAT}, timeout=20).content)
    choice = body["choices"][0]
    assert choice["finish_reason"] == "stop" and choice["matched_stop"] == EOS_TOKEN_ID
    assert body["usage"]["completion_tokens"] == 7


def test_max_completion_tokens_is_honoured(simulator: StartSim) -> None:
    sim = simulator("baseline", *FAST)
    chat = client(sim.url).chat.completions.create(model="m", messages=CHAT, max_completion_tokens=4)
    assert chat.usage is not None and chat.usage.completion_tokens == 4


def test_native_generate_streaming_and_not(simulator: StartSim) -> None:
    sim = simulator("baseline", *FAST)
    body = {"text": "hello", "sampling_params": {"max_new_tokens": 4}}
    full = httpx.post(sim.url + "/generate", json=body, timeout=20).json()
    assert full["text"] == token_text(0, 4)
    assert full["meta_info"]["finish_reason"] == {"type": "length", "length": 4}
    events = sse_json(httpx.post(sim.url + "/generate", json={**body, "stream": True}, timeout=20).content)
    assert [e["text"] for e in events] == [token_text(0, n) for n in (1, 2, 3, 4, 4)]
    assert events[-1]["meta_info"]["finish_reason"]["type"] == "length"
    assert "spec_verify_ct" not in full["meta_info"] and "spec_verify_ct" not in events[-1]["meta_info"]
    # A speculative server gives a finished request its verify steps, as SGLang does: 31 tokens at 3
    # a step are the prefill's first and 10 steps.
    spec = simulator("speculative", *FAST, "--accept-length", "3")
    body = {"text": "hello", "sampling_params": {"max_new_tokens": 31}}
    full = httpx.post(spec.url + "/generate", json=body, timeout=20).json()
    assert (full["meta_info"]["completion_tokens"], full["meta_info"]["spec_verify_ct"]) == (31, 10)
    events = sse_json(httpx.post(spec.url + "/generate", json={**body, "stream": True}, timeout=20).content)
    assert events[-1]["meta_info"]["spec_verify_ct"] == 10
    assert all("spec_verify_ct" not in e["meta_info"] for e in events[:-1])


def test_models_and_server_info(simulator: StartSim) -> None:
    spec = simulator("speculative", *FAST, "--served-model-name", "llama-8b", "--accept-length", "2.5")
    base = simulator("baseline", *FAST, "--model-path", "/models/llama-8b")
    models = httpx.get(spec.url + "/v1/models").json()
    assert models["object"] == "list" and models["data"][0]["id"] == "llama-8b"
    assert models["data"][0]["owned_by"] == "sglang"
    info = httpx.get(spec.url + "/get_server_info").json()
    assert info["internal_states"][0]["avg_spec_accept_length"] == 2.5
    # model_path is the served name unless --model-path says otherwise, as in SGLang.
    assert info["model_path"] == "llama-8b"
    assert httpx.get(base.url + "/get_server_info").json()["model_path"] == "/models/llama-8b"
    assert httpx.get(spec.url + "/server_info").json()["speculative_algorithm"] == "EAGLE3"
    assert "avg_spec_accept_length" not in httpx.get(base.url + "/get_server_info").json()["internal_states"][0]


def test_health_during_load_and_warmup(simulator: StartSim) -> None:
    sim = simulator("baseline", "--load-s", "1", "--warmup-s", "1.5", wait_ready=False)
    statuses: list[int | None] = []

    def ready() -> bool:
        status = http_status(sim.url + "/health", timeout_s=1)
        if not statuses or statuses[-1] != status:
            statuses.append(status)
        return status == 200

    wait_for(ready, timeout_s=10, interval_s=0.05)
    # Refused while "loading weights", then 503 while warming up, then 200.
    assert statuses == [None, 503, 200]


def test_metrics_names_labels_and_counters(simulator: StartSim) -> None:
    sim = simulator("speculative", *FAST, "--served-model-name", "llama-8b", "--accept-length", "3")
    client(sim.url).completions.create(model="m", prompt="abcdefgh", max_tokens=31)
    text = httpx.get(sim.url + "/metrics").text
    assert 'model_name="llama-8b"' in text
    m = scrape(sim.url)
    for name in ("num_running_reqs", "num_queue_reqs", "gen_throughput", "token_usage", "spec_accept_length"):
        assert f"sglang:{name}" in m, name
    assert m["sglang:prompt_tokens_total"] == 2
    assert m["sglang:generation_tokens_total"] == 31
    assert m["sglang:num_requests_total"] == 1
    assert m["sglang:num_aborted_requests_total"] == 0
    assert m["sglang:time_to_first_token_seconds_count"] == 1
    assert m["sglang:e2e_request_latency_seconds_count"] == 1
    assert m["sglang:inter_token_latency_seconds_count"] == 10  # one per chunk after the first


def test_metrics_prefix_of_newer_releases(simulator: StartSim) -> None:
    sim = simulator("baseline", *FAST, "--metrics-prefix", "sglang_")
    m = scrape(sim.url)
    assert "sglang_num_running_reqs" in m and "sglang:num_running_reqs" not in m


def test_gauges_are_stale_when_idle_unless_live(simulator: StartSim) -> None:
    stale = simulator("baseline", *FAST)
    live = simulator("baseline", *FAST, "--live-gauges")
    for sim in (stale, live):
        client(sim.url).completions.create(model="m", prompt="p", max_tokens=5)
    # SGLang refreshes gauges at prefill and every 40 decode steps, and keeps them when idle.
    assert scrape(stale.url)["sglang:num_running_reqs"] == 1
    assert scrape(live.url)["sglang:num_running_reqs"] == 0
    assert httpx.get(stale.url + "/get_load").json()[0]["num_reqs"] == 0


def test_client_disconnect_aborts_generation(simulator: StartSim) -> None:
    sim = simulator("baseline", "--time-scale", "1")
    with (
        httpx.Client(timeout=20) as http,
        http.stream("POST", sim.url + "/v1/completions", json={"prompt": "p", "max_tokens": 5000, "stream": True}) as r,
    ):
        lines = r.iter_lines()  # kept referenced: a dropped generator closes the response
        for _ in range(5):
            next(lines)
        assert httpx.get(sim.url + "/get_load").json()[0]["num_reqs"] == 1
    wait_for(lambda: scrape(sim.url)["sglang:num_aborted_requests_total"] >= 1)
    assert scrape(sim.url)["sglang:num_aborted_requests_total"] == 1
    assert httpx.get(sim.url + "/get_load").json()[0]["num_reqs"] == 0
    assert scrape(sim.url)["sglang:num_requests_total"] == 0


@pytest.mark.parametrize(
    ("path", "body", "fragment"),
    [
        ("/v1/chat/completions", b"{not json", "Invalid JSON"),
        ("/v1/chat/completions", b"[1, 2]", "JSON object"),
        ("/v1/chat/completions", b'{"model": "m"}', "messages"),
        ("/v1/chat/completions", b'{"messages": []}', "messages"),
        ("/v1/completions", b'{"max_tokens": 3}', "prompt"),
        ("/v1/completions", b'{"prompt": "p", "max_tokens": 0}', "max_tokens"),
        ("/v1/completions", b'{"prompt": "p", "max_tokens": -5}', "max_tokens"),
        ("/v1/completions", b'{"prompt": "p", "max_tokens": "ten"}', "max_tokens"),
        ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "x"}], "stream": "yes"}', "stream"),
    ],
)
def test_bad_requests_get_sglang_400(simulator: StartSim, path: str, body: bytes, fragment: str) -> None:
    sim = simulator("baseline", *FAST)
    r = httpx.post(sim.url + path, content=body, headers={"Content-Type": "application/json"})
    assert r.status_code == 400
    err = r.json()
    assert err["object"] == "error" and err["code"] == 400 and err["type"] == "BadRequestError"
    assert fragment in err["message"]
    assert err["param"] is None


def test_context_overflow_is_sglangs_400_through_specgate(stack: StartStack) -> None:
    """Prompt + max_tokens past the context length: SGLang's 400 and message at once, streaming
    or not, passed through specgate as the server sent it (not a generation until the timeout)."""
    s = stack(sim_args=FAST)
    chat = {"messages": [{"role": "user", "content": "hello"}], "max_tokens": 1_000_000_000}
    long_prompt = {"prompt": "word " * 140_000, "max_tokens": 1}  # ~175k tokens, context 131072
    at_the_limit = {"prompt": "p", "max_tokens": 131_071}  # 1 + 131071 = the context: refused (>=)
    cases = [("/v1/chat/completions", chat), ("/v1/chat/completions", {**chat, "stream": True}),
             ("/v1/completions", at_the_limit), ("/v1/completions", long_prompt)]  # fmt: skip
    for path, body in cases:
        t0 = time.monotonic()
        r = httpx.post(s.url + path, json=body, timeout=10)
        assert r.status_code == 400 and time.monotonic() - t0 < 2, (body.keys(), r.status_code)
        assert r.headers["x-specgate-backend"] == "speculative"  # the server's answer, relayed
        err = r.json()
        assert (err["object"], err["type"], err["code"], err["param"]) == ("error", "BadRequestError", 400, None)
        if body is long_prompt:
            assert err["message"].startswith("The input (") and "context length (131072 tokens)" in err["message"]
        else:
            assert err["message"].startswith(
                "Requested token count exceeds the model's maximum context length of 131072"
            )
    # One token under: generated.
    r = httpx.post(s.url + "/v1/completions", json={"prompt": "p", "max_tokens": 8}, timeout=10)
    assert r.status_code == 200
    assert httpx.get(s.url + "/routing").json()["inflight"] == 0


def test_bad_request_through_openai_sdk(simulator: StartSim) -> None:
    sim = simulator("baseline", *FAST)
    with pytest.raises(openai.BadRequestError) as info:
        client(sim.url).completions.create(model="m", prompt="p", max_tokens=0)
    assert info.value.status_code == 400


def test_api_key(simulator: StartSim) -> None:
    sim = simulator("baseline", *FAST, "--api-key", "sekret")
    with pytest.raises(openai.AuthenticationError):
        client(sim.url, "wrong").completions.create(model="m", prompt="p", max_tokens=2)
    r = httpx.post(sim.url + "/v1/completions", json={"prompt": "p", "max_tokens": 2})
    assert r.status_code == 401 and r.json() == {"error": "Unauthorized"}
    assert client(sim.url, "sekret").completions.create(model="m", prompt="p", max_tokens=2).choices
    assert httpx.get(sim.url + "/health").status_code == 200
    assert httpx.get(sim.url + "/metrics").status_code == 200


def test_fail_rate_injects_500s(simulator: StartSim) -> None:
    sim = simulator("baseline", *FAST, "--fail-rate", "1")
    r = httpx.post(sim.url + "/v1/completions", json={"prompt": "p", "max_tokens": 2})
    assert r.status_code == 500
    assert r.json()["object"] == "error" and r.json()["code"] == 500


def test_stall_rate_hangs_stream_until_client_leaves(simulator: StartSim) -> None:
    sim = simulator("baseline", *FAST, "--stall-rate", "1", "--seed", "3")
    body = {"prompt": "p", "max_tokens": 50, "stream": True}
    with pytest.raises(httpx.ReadTimeout):  # noqa: SIM117 - the stream must close inside raises
        with httpx.stream("POST", sim.url + "/v1/completions", json=body, timeout=httpx.Timeout(20, read=1)) as r:
            assert r.status_code == 200
            raw = b"".join(r.iter_raw())
    assert httpx.get(sim.url + "/get_load").json()[0]["num_reqs"] == 0
    assert scrape(sim.url)["sglang:num_aborted_requests_total"] == 1
    assert "raw" not in locals()


def test_queueing_past_max_running_requests(simulator: StartSim) -> None:
    sim = simulator("baseline", "--time-scale", "5", "--max-running-requests", "1", "--live-gauges")
    body = {"prompt": "p", "max_tokens": 5000, "stream": True}
    with httpx.Client(timeout=20) as http, http.stream("POST", sim.url + "/v1/completions", json=body) as first:
        first_lines = first.iter_lines()
        next(first_lines)
        with http.stream("POST", sim.url + "/v1/completions", json=body) as second:
            wait_for(lambda: httpx.get(sim.url + "/get_load").json()[0]["num_waiting_reqs"] == 1)
            load = httpx.get(sim.url + "/get_load").json()[0]
            assert load["num_waiting_reqs"] == 1 and load["num_reqs"] == 2
            m = scrape(sim.url)
            assert m["sglang:num_queue_reqs"] == 1 and m["sglang:num_running_reqs"] == 1
            assert second.status_code == 200


def test_port_in_use_exits_with_message(simulator: StartSim) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        from loadtest.procs import simulator_args, start

        proc = start("sim", simulator_args("baseline", port))
        assert proc.popen.wait(10) == 1


def test_stream_events_are_compact_sse(simulator: StartSim) -> None:
    sim = simulator("baseline", *FAST)
    r = httpx.post(sim.url + "/v1/completions", json={"prompt": "p", "max_tokens": 3, "stream": True})
    assert r.headers["content-type"].startswith("text/event-stream")
    events = sse_events(r.content)
    assert events[-1] == b"[DONE]"
    assert len(events) == 5  # three tokens, the finish chunk, [DONE]


def test_a_conversations_next_turn_reports_its_cached_tokens(simulator: StartSim) -> None:
    sim = simulator("speculative", *FAST, "--profile", "h200-llama8b", "--enable-cache-report", "--live-gauges")
    plain = simulator("baseline", *FAST)
    messages: list[ChatCompletionMessageParam] = [
        {"role": "system", "content": "You answer questions about GPUs. " * 60},
        {"role": "user", "content": "What is HBM?"},
    ]
    first = client(sim.url).chat.completions.create(model="m", messages=messages, max_tokens=40)
    assert first.usage is not None and first.usage.prompt_tokens_details is not None
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    reply = first.choices[0].message.content or ""
    messages += [{"role": "assistant", "content": reply}, {"role": "user", "content": "And NVLink?"}]
    stream = client(sim.url).chat.completions.create(
        model="m", messages=messages, max_tokens=8, stream=True, stream_options={"include_usage": True}
    )
    usage = next(c.usage for c in stream if c.usage is not None)
    assert usage.prompt_tokens_details is not None
    cached = usage.prompt_tokens_details.cached_tokens or 0
    # Everything up to the reply's end, but for the page that ends inside it.
    assert first.usage.prompt_tokens + 40 - 32 <= cached < usage.prompt_tokens
    m = scrape(sim.url)
    assert m["sglang:cache_hit_rate"] > 0
    # The counters SGLang exports, which specgate reads the hit rate from: the tokenizer's cached
    # tokens, and the scheduler's prompt tokens found cached and computed.
    assert m["sglang:cached_tokens_total"] == cached
    engine, values = readings.read_metrics(httpx.get(sim.url + "/metrics", timeout=5).text)
    assert engine is engines.SGLANG
    assert engine.read(values).cache_counters == (cached, first.usage.prompt_tokens + usage.prompt_tokens)
    assert m["sglang:max_total_num_tokens"] > 100_000 and m["sglang:num_used_tokens"] == 0
    # Without --enable-cache-report, SGLang reports no details.
    r = client(plain.url).chat.completions.create(model="m", messages=messages, max_tokens=2)
    assert r.usage is not None and r.usage.prompt_tokens_details is None


def test_a_prompt_the_kv_pool_cannot_hold_is_refused_and_an_output_shortened(simulator: StartSim) -> None:
    sim = simulator("baseline", *FAST, "--max-total-tokens", "1000")
    r = httpx.post(sim.url + "/v1/completions", json={"prompt": "word " * 1000, "max_tokens": 4})
    assert r.status_code == 400 and "exceeds the maximum allowed length" in r.json()["message"]
    r = httpx.post(sim.url + "/v1/completions", json={"prompt": "abcd" * 900, "max_tokens": 500}, timeout=30)
    assert r.status_code == 200
    assert r.json()["usage"]["completion_tokens"] == 100 and r.json()["choices"][0]["finish_reason"] == "length"
