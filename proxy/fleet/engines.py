"""What each inference engine reports about itself: one small adapter per engine.

specgate relays the OpenAI API, which SGLang, vLLM and llama.cpp's llama-server all serve alike.
They differ in what specgate reads beside it: the names of the metrics that count running and
queued requests, how speculative acceptance is reported, and what `/health` means. Everything
engine-specific lives in an `Engine` value here (what an adapter is and how it reads: adapter.py);
the rest of the proxy asks these, never a name.

- SGLang: `sglang:num_running_reqs` + `sglang:num_queue_reqs`; acceptance: the gauge
  `sglang:spec_accept_length`.
- vLLM: `vllm:num_requests_running` + `vllm:num_requests_waiting`; acceptance: a rate of the
  counters `vllm:spec_decode_num_accepted_tokens_total` and `vllm:spec_decode_num_drafts_total`.
- llama.cpp: `llamacpp:requests_processing` + `llamacpp:requests_deferred`; acceptance: the same
  counters with the `llamacpp:` prefix.

KV cache in use, the engine's own count of the work it holds in tokens: SGLang's
`sglang:num_used_tokens` (tokens) and `sglang:token_usage` (the pool's fraction in use); vLLM's
`vllm:kv_cache_usage_perc` (a fraction, despite its name; no token count); llama-server exports none
now (its `kv_cache_tokens` and `kv_cache_usage_ratio` were removed upstream in 2025). The pool's
size in tokens: SGLang's `sglang:max_total_num_tokens`; vLLM's `vllm:cache_config_info`, an info
gauge (value 1) whose labels are CacheConfig's fields: `num_gpu_blocks` * `block_size`, one series
per engine (data-parallel rank); `num_gpu_blocks` reads "None" until the engine profiled memory.

Prefix cache hit rate, the share of prompt tokens found cached, from counters taken between scrapes:
SGLang's `sglang:realtime_tokens_total{mode="prefill_cache"}` over it plus `{mode="prefill_compute"}`
(added per prefill batch; a mode's series appears once it moved); vLLM's `vllm:prefix_cache_hits_total`
over `vllm:prefix_cache_queries_total`; llama-server's `llamacpp:prompt_tokens_cached_total` over it
plus `llamacpp:prompt_tokens_total` (which excludes cached tokens). SGLang's gauge `sglang:cache_hit_rate`
is read only where its counter is absent (older servers): it holds the last prefill batch's rate and
decode-stats logging (every 40 decode steps) sets it to 0, so under decode load it mostly reads 0.

Label sets: each name's series are summed (data-parallel ranks, vLLM's engines), except SGLang's
scheduler metrics (`SGLANG_SERIES`): with `--enable-metrics-for-all-schedulers` every tensor-parallel
rank writes the same values, and with priority scheduling a gauge's total sits under priority=""
beside each priority's share. Of those, only the total's series of the lowest tp_rank of each
dp_rank count (with DP attention a dp_rank's first tp_rank is not 0). A rank's ratio (`averaged`:
the KV pool's fraction in use, the acceptance length, the hit rate gauge) is averaged over the
ranks, not summed: two ranks each a third full are a server a third full.

Counters that move only when a request finishes: llama-server's `spec_decode_*` and
`tokens_predicted_total` (a running request's drafts appear at its end), as SGLang's tokenizer
counters (`prompt_tokens_total`, `cached_tokens_total`); SGLang's `realtime_tokens_total` moves
per prefill batch and decode step.

Streams: SGLang (with its default `--stream-interval 1`) and vLLM send one SSE content event per
decode step, so a single stream's tokens over its content events is its acceptance length, with no
wait for a gauge's refresh (`stream_steps`); llama-server sends one event per token. Asked for
usage, llama-server moves its `timings` from the finish chunk into the usage chunk; the SSE module
(sse.py) puts any such field back when it drops a usage chunk specgate asked for. SGLang writes its
end of body right after `data: [DONE]`, but in a write of its own (`DONE_GRACE_S`).

SGLang's native API: `POST /generate` (`GENERATE_PATH`), whose responses and stream events carry
their token counts in `meta_info` where the OpenAI API has `usage` (`USAGE_FIELDS`).

Per request, a response's own acceptance (`reported_steps`, a traffic class's evidence where its
stream does not count steps): llama-server's `timings` (`draft_n`, `draft_n_accepted`, on the finish
or usage chunk and on a whole body, for chat and completions alike) and SGLang's native
`meta_info.spec_verify_ct`; SGLang's OpenAI endpoints and vLLM write none.

Per-request speculation: none of the three takes a switch that turns speculation off for one request
on a server launched with a draft model, in the OpenAI API: SGLang's RFC #30263 and its draft PR
#30264 and vLLM's `disable_spec_decode` (PR #55412) closed unmerged. llama-server reads
`speculative.n_max` (and `.n_min`, `.p_min`) from a request's body, 0 drafting nothing for it, but a
llama.cpp-only field. A client's switch (routing/switch.py) is therefore where a request goes, on
every engine, and its field is removed before forwarding.

Connections: SGLang's uvicorn closes a kept-alive connection after `keepalive_s` idle; a request
written into a connection it is closing is lost, so the pool closes its own sooner
(`POOL_KEEPALIVE_S`).

SGLang's own names use `sglang:`; `sglang_` is what SGLang's router re-exports them as, so both are
read. Acceptance length counts the bonus token (adapter.py).

`/health`: 200 means serving for all three. SGLang answers 503 while warming up (and runs a
one-token generation for every check, so it is slow under load); vLLM refuses connections until
its engine is up and answers 503 once it died; llama-server answers 503 "Loading model".
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

import orjson

from . import promtext
from .adapter import MAX_ACCEPT_LENGTH, MAX_COUNTER, MAX_KV_TOKENS, MIN_ACCEPT_LENGTH, Engine, EngineName

# What SPECGATE_ENGINE may say: one of ENGINES, or "auto" (each server's from its /metrics).
EngineSetting = Literal["auto", "sglang", "vllm", "llamacpp"]


# SGLang's native generation endpoint, which specgate relays beside the OpenAI ones.
GENERATE_PATH = "/generate"
# Where a response or stream event holds its token counts: OpenAI's `usage`, else SGLang's native
# `meta_info`; the first present one counts.
USAGE_FIELDS = ("usage", "meta_info")
# How long the relay holds a stream's `data: [DONE]` for the server's end of body to go with it, so
# that a client that stops reading at `[DONE]` finds the response complete. SGLang's end follows at
# once; a server that keeps its body open after `[DONE]` has its last bytes delayed this long, no
# more. The relay does not know a server's engine, so this holds for every server, as before.
DONE_GRACE_S = 0.01


def reported_steps(obj: Any) -> tuple[int, int] | None:
    """(output tokens, decode steps) that a response body reports of its own speculation, where an
    engine writes them per request: llama-server's `timings` (`predicted_n` tokens, `draft_n` drafted
    and `draft_n_accepted` of them accepted: each step makes one token of its own besides the drafts
    it accepted, so predicted_n - draft_n_accepted steps, the prefill's first token among them; only
    where it drafted), and SGLang's native `meta_info` (`completion_tokens` in `spec_verify_ct` verify
    steps, only with speculation on, and the prefill's step, which it does not count). The steps are
    counted as a stream's content events are: the first is the prefill's. vLLM's responses say
    nothing of it. None elsewhere, or where the figures are not a server's: a step makes at least
    one token and at most MAX_ACCEPT_LENGTH."""
    if not isinstance(obj, dict):
        return None
    timings = obj.get("timings")
    if isinstance(timings, dict):
        tokens, drafted, accepted = (_count(timings.get(k)) for k in ("predicted_n", "draft_n", "draft_n_accepted"))
        if tokens is None or drafted is None or accepted is None or drafted == 0 or accepted > drafted:
            return None
        return _steps(tokens, tokens - accepted)
    meta = obj.get("meta_info")
    if isinstance(meta, dict):
        tokens, steps = _count(meta.get("completion_tokens")), _count(meta.get("spec_verify_ct"))
        if tokens is not None and steps:  # 0: it verified nothing (it made one token, or none)
            return _steps(tokens, steps + 1)
    return None


def _count(value: Any) -> int | None:
    """The value, where it is a count a server could write (a bool is an int to Python, not to JSON)."""
    ok = isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= MAX_COUNTER
    return value if ok else None


def _steps(tokens: int, steps: int) -> tuple[int, int] | None:
    """A step makes at least one token and at most MAX_ACCEPT_LENGTH."""
    return (tokens, steps) if 0 < steps <= tokens <= steps * MAX_ACCEPT_LENGTH else None


# SGLang's scheduler writes these, per scheduler process (labels tp_rank, dp_rank, ...); its
# tokenizer's counters (prompt_tokens_total, ...) are one process's, and carry a request's priority.
SGLANG_SERIES = promtext.Series(
    names=(
        "num_running_reqs",
        "num_queue_reqs",
        "num_used_tokens",
        "token_usage",
        "max_total_num_tokens",
        "gen_throughput",
        "spec_accept_length",
        "cache_hit_rate",
        "realtime_tokens_total",
    ),
    total=("priority", ""),
    rank="tp_rank",
    group="dp_rank",
)
SGLANG = Engine(
    "sglang",
    ("sglang:", "sglang_"),
    running="num_running_reqs",
    queued="num_queue_reqs",
    accept_gauge="spec_accept_length",
    kv_tokens="num_used_tokens",
    kv_usage="token_usage",
    kv_capacity="max_total_num_tokens",
    cache_hit_gauge="cache_hit_rate",
    cache_hits_counter='realtime_tokens_total{mode="prefill_cache"}',
    cache_misses_counter='realtime_tokens_total{mode="prefill_compute"}',
    cache_hits_once_moved=True,
    split=(("realtime_tokens_total", "mode"),),
    series=SGLANG_SERIES,
    averaged=("token_usage", "spec_accept_length", "cache_hit_rate"),
    unset_at_zero=("spec_accept_length",),
    freezes_when_idle=True,
    gauge_refresh_steps=40,
    keepalive_s=5.0,  # uvicorn's default
    stream_steps=True,
    activity=(
        "num_running_reqs",
        "num_queue_reqs",
        "gen_throughput",
        "generation_tokens_total",
        "prompt_tokens_total",
        "num_requests_total",
    ),
)
VLLM = Engine(
    "vllm",
    ("vllm:",),
    running="num_requests_running",
    queued="num_requests_waiting",
    accepted_counter="spec_decode_num_accepted_tokens_total",
    drafts_counter="spec_decode_num_drafts_total",
    kv_usage="kv_cache_usage_perc",
    kv_capacity="cache_config_info",
    label_product=("cache_config_info", ("num_gpu_blocks", "block_size")),
    averaged=("kv_cache_usage_perc",),
    cache_hits_counter="prefix_cache_hits_total",
    cache_queries_counter="prefix_cache_queries_total",
    stream_steps=True,
)
LLAMACPP = Engine(
    "llamacpp",
    ("llamacpp:",),
    running="requests_processing",
    queued="requests_deferred",
    accepted_counter="spec_decode_num_accepted_tokens_total",
    drafts_counter="spec_decode_num_drafts_total",
    # Both written from the first scrape (0 before any prompt); builds without the cached one read
    # no hit rate.
    cache_hits_counter="prompt_tokens_cached_total",
    cache_misses_counter="prompt_tokens_total",
)
ENGINES: dict[EngineName, Engine] = {e.name: e for e in (SGLANG, VLLM, LLAMACPP)}
# Idle pooled connections older than this are closed rather than reused: a second inside SGLang's
# window. The pool does not know which engine a server runs (`auto` learns it later, from /metrics),
# so every server gets this, as before.
POOL_KEEPALIVE_S = 4.0


def detect(values: Mapping[str, float]) -> Engine | None:
    """The engine whose metric names these are, or None."""
    for engine in ENGINES.values():
        if engine.owns(values):
            return engine
    return None


def describe_health(status: int, body: bytes) -> str:
    """Why a server's `/health` is not 200, in the operator's words."""
    message = ""
    try:
        obj = orjson.loads(body) if body else None
    except orjson.JSONDecodeError:
        obj = None
    if isinstance(obj, dict):
        err = obj.get("error")
        found = err.get("message") if isinstance(err, dict) else obj.get("message", err)
        if isinstance(found, str):
            message = found[:120]
    return f"/health answered {status}" + (f": {message}" if message else "")


# What a server says of itself beside /metrics, as `specgate doctor` reads it (the gateway does
# not): `/v1/models` (every engine; `owned_by` names it; SGLang and vLLM give `max_model_len`, the
# context length), SGLang's `/server_info` (older builds: `/get_server_info`; its ServerArgs, with
# `speculative_algorithm` null when off, `context_length` null unless set, and the scheduler's
# `max_total_num_tokens`, the KV pool, and `internal_states[i].avg_spec_accept_length` while
# speculating), and llama-server's `/props` (`default_generation_settings.n_ctx`, one slot's
# context, and `total_slots`: its KV cache is n_ctx a slot times the slots). These bodies hold
# the server's settings, its API key among them: only the fields below are read.
MODELS_PATH = "/v1/models"
SERVER_INFO_PATHS = ("/server_info", "/get_server_info")
PROPS_PATH = "/props"


@dataclass(frozen=True)
class LaunchFlags:
    """What an operator sets on an engine's command line, for the advice `doctor` gives."""

    metrics: str  # how /metrics is turned on
    speculation: str  # how speculative decoding is turned on
    served_name: str  # how the model's served name is set


LAUNCH_FLAGS: dict[EngineName, LaunchFlags] = {
    "sglang": LaunchFlags(
        "--enable-metrics", "--speculative-algorithm EAGLE3 --speculative-draft-model-path D", "--served-model-name"
    ),
    "vllm": LaunchFlags(
        "nothing: vLLM serves /metrics unless disabled", "--speculative-config '{...}'", "--served-model-name"
    ),
    "llamacpp": LaunchFlags("--metrics", "--spec-type (or --model-draft)", "--alias"),
}


@dataclass(frozen=True)
class ServerFacts:
    """What a server's own descriptions say; None where it does not say."""

    models: tuple[str, ...] = ()
    engine: EngineName | None = None  # as /v1/models' owned_by, /server_info or /props names it
    context_len: int | None = None
    kv_pool_tokens: int | None = None
    # SGLang's /server_info: the configured algorithm ("" where it says speculation is off);
    # None where the engine does not say.
    speculative_algorithm: str | None = None
    avg_accept_length: float | None = None  # since start, where the engine reports it
    # SGLang's /server_info: whether it drafts adaptively (--speculative-adaptive); None: not said.
    speculative_adaptive: bool | None = None


def server_facts(models: Any, info: Any, props: Any) -> ServerFacts:
    """The facts in a server's `/v1/models`, SGLang's `/server_info` and llama-server's `/props`
    bodies (each parsed JSON, or None where absent)."""
    cards = models.get("data") if isinstance(models, dict) else None
    cards = [c for c in cards if isinstance(c, dict)] if isinstance(cards, list) else []
    names = tuple(c["id"] for c in cards if isinstance(c.get("id"), str))
    owners = {c.get("owned_by") for c in cards}
    engine: EngineName | None = next((e for e in ENGINES if e in owners), None)
    context = next((n for c in cards if (n := _size(c.get("max_model_len"))) is not None), None)
    pool, algorithm, accept, adaptive = None, None, None, None
    if isinstance(info, dict) and "internal_states" in info:  # SGLang's (vLLM's dev mode has a /server_info)
        engine = engine or "sglang"
        context = context or _size(info.get("context_length"))
        pool = _size(info.get("max_total_num_tokens"))
        found = info.get("speculative_algorithm")
        algorithm = found if isinstance(found, str) else ""
        said = info.get("speculative_adaptive")
        adaptive = said if isinstance(said, bool) else None
        states = info.get("internal_states")
        if isinstance(states, list):
            kept = [m for s in states if isinstance(s, dict) and (m := _mean(s.get("avg_spec_accept_length")))]
            accept = sum(kept) / len(kept) if kept else None
    if isinstance(props, dict):
        engine = engine or "llamacpp"
        settings = props.get("default_generation_settings")
        per_slot = _size(settings.get("n_ctx")) if isinstance(settings, dict) else None
        slots = _size(props.get("total_slots")) or 1
        context = context or per_slot
        pool = pool or (per_slot * slots if per_slot else None)
    return ServerFacts(names, engine, context, pool, algorithm, accept, adaptive)


def _size(value: Any) -> int | None:
    """A token count a server could report."""
    ok = isinstance(value, int) and not isinstance(value, bool) and 0 < value <= MAX_KV_TOKENS
    return value if ok else None


def _mean(value: Any) -> float | None:
    """An acceptance length a server could report."""
    ok = isinstance(value, int | float) and not isinstance(value, bool)
    return float(value) if ok and MIN_ACCEPT_LENGTH <= value <= MAX_ACCEPT_LENGTH else None
