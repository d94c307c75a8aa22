"""The gateway in front of real engines: a speculative (n-gram) and a baseline llama.cpp
`llama-server` on CPU serving Gemma 3 270M (loadtest/llamacpp.py), started once for this module,
with specgate under uvicorn in front, driven by the real openai SDK.

Needs `scripts/bootstrap real` (scripts/test runs it). Without llama-server the tests fail, naming
that command; SPECGATE_SKIP_REAL=1 skips them instead.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import threading
from collections.abc import Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import httpx
import openai
import orjson
import pytest

from loadtest.llamacpp import LlamaNotInstalled, Pair, model_path, pair, server_binary
from loadtest.procs import Proc

from ..helpers import routing, scrape, start_proxy, wait_for

# Small enough that the whole module takes well under a minute or two on 2 cores; the long
# generation (the disconnect test) needs the room.
SLOTS = 4
CTX_PER_SLOT = 2048
CHAT = [{"role": "user", "content": "List the days of the week."}]
PROMPT = "The days of the week are Monday, Tuesday,"


@pytest.fixture(scope="module")
def llama() -> Iterator[Pair]:
    if os.environ.get("SPECGATE_SKIP_REAL") == "1":
        pytest.skip("SPECGATE_SKIP_REAL=1")
    missing = None
    try:
        server_binary()
        model_path()
    except LlamaNotInstalled as exc:
        missing = str(exc)
    if missing:
        # A tier that skipped itself where llama-server is missing would pass in CI without running.
        pytest.fail(f"{missing}; or set SPECGATE_SKIP_REAL=1 to skip the real-engine tests", pytrace=False)
    with pair(slots=SLOTS, ctx_per_slot=CTX_PER_SLOT) as p:
        yield p


@dataclass
class Gateway:
    url: str
    proc: Proc
    llama: Pair

    def routing(self) -> dict[str, Any]:
        return routing(self.url)


def start_gateway(llama: Pair, **env: str) -> Gateway:
    proxy = start_proxy(llama.speculative.url, llama.baseline.url, **env)
    return Gateway(proxy.url, proxy.proc, llama)


@pytest.fixture(scope="module")
def gateway(llama: Pair) -> Iterator[Gateway]:
    """Watermarks far above any load here: every request goes to the speculative server, so its
    answers can be compared with that server's own."""
    gw = start_gateway(llama, SPECGATE_HIGH_WATERMARK="1000", SPECGATE_LOW_WATERMARK="999")
    yield gw
    gw.proc.stop()


@pytest.fixture(scope="module")
def switching(llama: Pair) -> Iterator[Gateway]:
    gw = start_gateway(llama, SPECGATE_HIGH_WATERMARK="2", SPECGATE_LOW_WATERMARK="1")
    yield gw
    gw.proc.stop()


def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)


def idle(server_url: str) -> bool:
    return scrape(server_url)["llamacpp:requests_processing"] == 0


def normalized(obj: dict[str, Any]) -> dict[str, Any]:
    """An answer or chunk without what differs between two runs of the same request: ids, the
    clock, and the numbers in llama-server's `timings` (its keys stay). A Responses API event
    holds its response, items and ids nested: those go at every depth."""
    out = {k: v for k, v in obj.items() if k not in _RUN_FIELDS}
    if isinstance(out.get("timings"), dict):
        out["timings"] = sorted(out["timings"])
    for k, v in out.items():
        if isinstance(v, dict):
            out[k] = normalized(v)
        elif isinstance(v, list):
            out[k] = [normalized(x) if isinstance(x, dict) else x for x in v]
    return out


_RUN_FIELDS = frozenset({"id", "created", "created_at", "item_id", "completed_at"})


# Each case: (endpoint, request). The same request goes to the speculative server directly and
# through specgate; the SDK's parse of both must match event for event.
CASES: dict[str, tuple[str, dict[str, Any]]] = {
    "chat-stream": ("chat", {"messages": CHAT, "stream": True}),
    "chat-stream-usage": ("chat", {"messages": CHAT, "stream": True, "stream_options": {"include_usage": True}}),
    "chat": ("chat", {"messages": CHAT}),
    "completions-stream": ("completions", {"prompt": PROMPT, "stream": True}),
    "completions-stream-usage": (
        "completions",
        {"prompt": PROMPT, "stream": True, "stream_options": {"include_usage": True}},
    ),
    "completions": ("completions", {"prompt": PROMPT}),
    "responses-stream": ("responses", {"input": CHAT, "stream": True}),
    "responses": ("responses", {"input": CHAT}),
}


def ask(url: str, endpoint: str, request: dict[str, Any]) -> tuple[Mapping[str, str], list[dict[str, Any]]]:
    """Response headers and every parsed event (one for a non-streamed answer), normalized."""
    c = client(url)
    if endpoint == "responses":
        raw: Any = c.responses.with_raw_response.create(model="m", max_output_tokens=24, temperature=0, **request)
    else:
        create = c.chat.completions.with_raw_response.create
        if endpoint == "completions":
            create = c.completions.with_raw_response.create  # type: ignore[assignment]
        raw = create(model="m", max_tokens=24, temperature=0, **request)
    parsed = raw.parse()
    events = list(parsed) if request.get("stream") else [parsed]
    return raw.headers, [normalized(e.model_dump()) for e in events]


@pytest.mark.parametrize("case", CASES)
def test_answers_through_specgate_equal_the_servers_own(gateway: Gateway, case: str) -> None:
    endpoint, request = CASES[case]
    spec = gateway.llama.speculative.url
    # The first run leaves the prompt in the server's cache; the two compared runs then find the
    # same cache (usage counts cached tokens, and a cached prefix can change the output).
    ask(spec, endpoint, request)
    _, direct = ask(spec, endpoint, request)
    counted = scrape(gateway.url)["specgate_output_tokens_total"]
    headers, proxied = ask(gateway.url, endpoint, request)
    counted = scrape(gateway.url)["specgate_output_tokens_total"] - counted
    assert headers["x-specgate-backend"] == "speculative"
    # llama-server puts `timings` on the finish chunk, or on the usage chunk when usage is asked
    # for; specgate asks for usage itself, and must not move or lose them.
    where = [i for i, e in enumerate(direct) if "timings" in e]
    if endpoint != "responses":  # whose events carry none
        assert where, "llama-server sent no timings: the comparison below would not check them"
    assert [i for i, e in enumerate(proxied) if "timings" in e] == where
    assert proxied == direct
    if endpoint == "responses":
        # Its usage is in the response (streamed: in `response.completed`), and specgate counted it.
        last = proxied[-1].get("response", proxied[-1])
        assert counted == last["usage"]["output_tokens"] > 0
    elif request.get("stream"):
        has_usage = [e["usage"] is not None for e in proxied]
        asked = "stream_options" in request or endpoint == "completions"  # completions always send it
        assert any(has_usage) == asked


def test_client_disconnect_aborts_the_generation(gateway: Gateway) -> None:
    spec = gateway.llama.speculative.url
    before = scrape(spec)["llamacpp:tokens_predicted_total"]
    max_tokens = 1500
    raw = client(gateway.url).completions.with_raw_response.create(
        model="m", prompt="Once upon a time", max_tokens=max_tokens, temperature=0, stream=True,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    assert raw.headers["x-specgate-backend"] == "speculative"
    stream = raw.parse()
    for _, _chunk in zip(range(5), stream, strict=False):
        pass
    assert scrape(spec)["llamacpp:requests_processing"] == 1
    stream.close()
    took = wait_for(partial(idle, spec))
    assert not any(slot["is_processing"] for slot in httpx.get(spec + "/slots", timeout=5).json())
    # Counted when the slot is released, aborted or not: far fewer than asked for.
    predicted = scrape(spec)["llamacpp:tokens_predicted_total"] - before
    assert predicted < max_tokens / 5, (predicted, took)
    wait_for(lambda: gateway.routing()["inflight"] == 0)


def test_heavy_load_switches_to_the_baseline_and_back(switching: Gateway) -> None:
    streams = 4
    c = client(switching.url)
    barrier = threading.Barrier(streams)

    def one(_: int) -> tuple[str, int]:
        barrier.wait()
        raw = c.completions.with_raw_response.create(
            model="m", prompt=PROMPT, max_tokens=16, temperature=0, stream=True,
            extra_body={"ignore_eos": True},
        )  # fmt: skip
        texts = [chunk.choices[0].text for chunk in raw.parse() if chunk.choices]
        return raw.headers["x-specgate-backend"], len([t for t in texts if t])

    switches_before = scrape(switching.url).get("specgate_mode_switches_total", 0.0)
    with ThreadPoolExecutor(streams) as pool:
        results = list(pool.map(one, range(streams)))
    backends = sorted(backend for backend, _ in results)
    # The first two are admitted at loads 0 and 1; the load then reaches the high watermark.
    assert backends == ["baseline", "baseline", "speculative", "speculative"], results
    assert all(tokens > 0 for _, tokens in results), results
    wait_for(lambda: switching.routing()["inflight"] == 0)
    assert [b["inflight"] for b in switching.routing()["backends"].values()] == [0, 0]
    wait_for(lambda: switching.routing()["mode"] == "speculative")  # the load fell to the low watermark
    assert scrape(switching.url)["specgate_mode_switches_total"] - switches_before >= 2
    for server in (switching.llama.speculative, switching.llama.baseline):
        wait_for(partial(idle, server.url))
    r = httpx.post(switching.url + "/v1/completions", json={"prompt": PROMPT, "max_tokens": 1}, timeout=30)
    assert (r.headers["x-specgate-backend"], r.headers["x-specgate-reason"]) == ("speculative", "light_load")


# Repeats itself, so n-gram drafting finds matches and the speculative server really drafts.
REPETITIVE = "one two three four five six. one two three four five six. one two three four five six. one two"


@contextmanager
def replica_traffic(server_url: str) -> Iterator[list[object]]:
    """Long streamed generations sent straight to a server, one after another, until the block
    ends; the list gets each one's status (or the error that ended the traffic). The one running
    at the end is closed, so llama-server aborts it."""
    stop = threading.Event()
    sent: list[object] = []

    def keep_busy() -> None:
        try:
            with httpx.Client(timeout=60) as http:
                while not stop.is_set():
                    with http.stream(
                        "POST",
                        server_url + "/v1/completions",
                        json={"prompt": "Once upon a time", "max_tokens": 1500, "stream": True, "ignore_eos": True},
                    ) as stream:
                        sent.append(stream.status_code)
                        for _ in stream.iter_lines():
                            if stop.is_set():
                                break
        except httpx.HTTPError as exc:
            sent.append(repr(exc))

    worker = threading.Thread(target=keep_busy, daemon=True)
    worker.start()
    try:
        yield sent
    finally:
        stop.set()
        worker.join(timeout=60)


def test_engine_load_and_acceptance_are_read_from_llama_server(llama: Pair) -> None:
    gw = start_gateway(llama, SPECGATE_LOAD_SIGNAL="engine", SPECGATE_HIGH_WATERMARK="1000")
    try:
        wait_for(lambda: all(b["engine_signal_up"] for b in gw.routing()["backends"].values()))
        r = gw.routing()
        assert (r["load_signal"], r["load_signal_in_effect"], r["load_signal_why"]) == ("engine", "engine", None)
        assert {b["engine"] for b in r["backends"].values()} == {"llamacpp"}
        # Another replica's traffic, straight to the server: only the engine's own count sees it.
        # Kept up until the gateway has read it: one long generation can end before a reading on a
        # fast CPU (n-gram drafting on a repetitive story), and then the server reads 0 throughout.
        with replica_traffic(llama.speculative.url) as served:
            seen: list[object] = []

            def reads_load() -> bool:
                b = gw.routing()["backends"]["speculative"]
                seen.append((b["engine_load"], b["engine_signal_up"], b["engine_signal_error"]))
                return (b["engine_load"] or 0) >= 1

            try:
                wait_for(reads_load, 30)
            except AssertionError:
                own = scrape(llama.speculative.url)["llamacpp:requests_processing"]
                raise AssertionError(
                    f"no engine load read; the last readings: {seen[-10:]}; the server's own now: {own}; "
                    f"sent: {served[-10:]}"
                ) from None
            wait_for(lambda: (r := gw.routing())["load"] >= 1 and r["inflight"] == 0, 30)
        wait_for(lambda: gw.routing()["load"] == 0, 30)
        drafts_before = scrape(llama.speculative.url)["llamacpp:spec_decode_num_drafts_total"]
        answer = client(gw.url).completions.create(model="m", prompt=REPETITIVE, max_tokens=48, temperature=0)
        assert answer.choices[0].text
        after = scrape(llama.speculative.url)
        assert after["llamacpp:spec_decode_num_drafts_total"] > drafts_before, "the server drafted nothing"
        wait_for(lambda: (gw.routing()["backends"]["speculative"]["spec_accept_length"] or 0) > 1)
        shown = gw.routing()["backends"]
        # 1 + accepted / drafts over the window: at most the server's own draft length plus the bonus.
        assert 1 < shown["speculative"]["spec_accept_length"] <= 17
        assert shown["baseline"]["spec_accept_length"] is None  # it does not speculate
        text = httpx.get(gw.url + "/metrics", timeout=5).text
        # The metric, read a moment later, may hold a newer poll's window: it says the same thing.
        exported = re.search(r'specgate_accept_length\{backend="speculative"\} ([0-9.]+)', text)
        assert exported is not None and 1 < float(exported.group(1)) <= 17
        assert 'specgate_accept_length{backend="baseline"} NaN' in text
        assert 'specgate_engine_signal_up{backend="baseline"} 1.0' in text
    finally:
        gw.proc.stop()


def test_a_conversations_next_turn_finds_its_prefix_cached_on_its_server(gateway: Gateway) -> None:
    # What only a real server shows: the next turn, the last one's prompt and reply resent through
    # the model's own chat template, finds them in that server's cache.
    c = client(gateway.url)
    session = {"x-session-id": "real-multiturn"}
    before = scrape(gateway.url)
    messages: list[dict[str, str]] = [
        {"role": "system", "content": "You answer in one short line."},
        {"role": "user", "content": "List the days of the week."},
    ]
    served, cached, prompts = [], [], []
    for follow_up in ("And the months of the year?", "And the seasons?"):
        raw = c.chat.completions.with_raw_response.create(
            model="m",
            messages=messages,  # type: ignore[arg-type]
            max_tokens=24,
            temperature=0,
            extra_headers=session,
        )
        answer = raw.parse()
        assert answer.usage is not None and answer.usage.prompt_tokens_details is not None
        served.append(raw.headers["x-specgate-backend"])
        cached.append(answer.usage.prompt_tokens_details.cached_tokens or 0)
        prompts.append(answer.usage.prompt_tokens)
        messages += [
            {"role": "assistant", "content": answer.choices[0].message.content or ""},
            {"role": "user", "content": follow_up},
        ]
    after = scrape(gateway.url)
    assert served == ["speculative", "speculative"]
    # All of the first turn's prompt, less at most the tokens its template renders after the reply.
    assert cached[1] >= prompts[0] - 8, (cached, prompts)
    assert after["specgate_affinity_hits_total"] - before.get("specgate_affinity_hits_total", 0) == 1
    assert after["specgate_affinity_misses_total"] - before.get("specgate_affinity_misses_total", 0) == 1

    # The server's prefix cache hit rate, read from llama-server's own counters (cached prompt
    # tokens over them plus the computed ones; before, none was read from llama-server). Its value
    # is the last two scrapes' share, which depends on where they fell among this module's requests
    # (one full-suite run in three saw 0 here for 15 s): that it is read is what only this server shows.
    def hit_rate() -> float | None:
        servers = gateway.routing()["servers"].values()
        found: float | None = next(s["engine_cache_hit_rate"] for s in servers if s["role"] == "speculative")
        return found

    wait_for(lambda: hit_rate() is not None, 15)
    rate = hit_rate()
    assert rate is not None and 0.0 <= rate <= 1.0


def test_a_class_learns_its_acceptance_from_llama_servers_own_timings(gateway: Gateway) -> None:
    # llama-server streams a token an event: only each response's timings say how many steps it took.
    c = client(gateway.url)
    ratios: dict[str, list[float]] = {"streamed": [], "whole": []}
    for name, stream in (("streamed", True), ("whole", False)):
        for n in range(4):
            messages = [{"role": "user", "content": f"{n}. Repeat this: {REPETITIVE}"}]
            raw = c.chat.completions.with_raw_response.create(
                model="m", messages=messages, max_tokens=48, temperature=0, stream=stream,  # type: ignore[arg-type]
                extra_headers={"x-specgate-class": name},
            )  # fmt: skip
            assert raw.headers["x-specgate-backend"] == "speculative"
            parsed = raw.parse()
            events = [e.model_dump() for e in (parsed if stream else [parsed])]  # type: ignore[union-attr]
            timings = next(e["timings"] for e in events if e.get("timings"))
            tokens, accepted = timings["predicted_n"], timings["draft_n_accepted"]
            if timings["draft_n"] > 0:
                ratios[name].append((tokens - 1) / (tokens - accepted - 1))
    tracked = gateway.routing()["classes"]["tracked"]
    for name, seen in ratios.items():
        assert seen and max(seen) > 1, f"llama-server accepted no drafts for {name}: nothing to learn from"
        # What the class learnt is a weighted mean of what its responses reported.
        assert min(seen) - 1e-9 <= tracked[name]["accept_length"] <= max(seen) + 1e-9, (name, seen, tracked)


def test_calibrate_against_the_real_pair_counts_no_client_errors(llama: Pair, tmp_path: Path) -> None:
    # llama-server closes the connection after every streamed response: the load tester must
    # resend what its pool wrote into a closed connection, and charge the server with nothing.
    out = tmp_path / "calibrate.json"
    done = subprocess.run(
        [sys.executable, "-m", "loadtest", "calibrate", "--speculative", llama.speculative.url,
         "--baseline", llama.baseline.url, "--concurrency", "1,4", "--duration-s", "5", "--max-tokens", "16",
         "--prompts", "short", "--min-requests", "0", "--quiet", "--out", str(out)],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    sweeps = orjson.loads(out.read_bytes())["sweeps"]
    levels = [level for name in ("speculative", "baseline") for level in sweeps[name]]
    assert len(levels) == 4
    assert [(lv["errors"], lv["client_errors"]) for lv in levels] == [(0, 0)] * 4, levels
    # How many complete in the window is this machine's speed, not the point: that some did.
    assert all(lv["completed"] >= 1 for lv in levels), levels
    assert "SPECGATE_HIGH_WATERMARK=" in done.stdout


def test_the_speculation_switch_picks_llama_servers_drafting_or_not(gateway: Gateway) -> None:
    # No llama-server takes a per-request switch that specgate could pass on: the switch is which
    # server answers, and the body field never reaches either (llama-server ignores unknown fields,
    # so its answer cannot show that: the in-process tests read what reached the server).
    c = client(gateway.url)
    drafted: dict[str, int] = {}
    for switch, headers, body in (("off", {}, {"speculation": False}), ("on", {"x-specgate-speculation": "on"}, {})):
        raw = c.chat.completions.with_raw_response.create(
            model="m", messages=[{"role": "user", "content": f"Repeat this: {REPETITIVE}"}], max_tokens=32,
            temperature=0, extra_headers=headers, extra_body=body,
        )  # fmt: skip
        assert raw.headers["x-specgate-reason"] == f"client_{switch}"
        assert raw.headers["x-specgate-backend"] == ("speculative" if switch == "on" else "baseline")
        timings = raw.parse().model_dump()["timings"]
        drafted[switch] = timings.get("draft_n", 0)
    assert drafted["off"] == 0 and drafted["on"] > 0, drafted
