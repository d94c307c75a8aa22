"""The doctor's judgement and recommendation as pure functions, and the engines' self-descriptions."""

from __future__ import annotations

from proxy.doctor.judge import Observation, Probe, acceptance, fleet_findings, judge_server
from proxy.doctor.recommend import Setup, recommend
from proxy.doctor.report import Diagnosis, text
from proxy.fleet.engines import LLAMACPP, SGLANG, VLLM, ServerFacts, server_facts
from proxy.policy.base import Role

SGLANG_METRICS = {"sglang:num_running_reqs": 0.0, "sglang:num_queue_reqs": 0.0, "sglang:spec_accept_length": 0.0}


def sglang_obs(role: Role, algorithm: str, **kw: object) -> Observation:
    facts = ServerFacts(("llama",), "sglang", 8192, 100_000, algorithm, None)
    fields: dict[str, object] = {
        "facts": facts,
        "metrics_before": SGLANG_METRICS,
        "metrics_after": SGLANG_METRICS,
        "probe": Probe(48, 48),
    }
    fields.update(kw)
    return Observation(str(role), role, f"http://10.0.0.1:{30001 if role == Role.SPECULATIVE else 30002}", **fields)  # type: ignore[arg-type]


def messages(obs: Observation, load_signal: str = "local") -> list[str]:
    return [f"{f.level}: {f.message}" for f in judge_server(obs, "auto", load_signal).findings]  # type: ignore[arg-type]


def test_server_facts_read_each_engines_own_fields() -> None:
    sglang_info = {
        "served_model_name": "llama",
        "context_length": None,
        "max_total_num_tokens": 500_000,
        "speculative_algorithm": "EAGLE3",
        "api_key": "sk-secret",
        "internal_states": [{"avg_spec_accept_length": 2.5}, {"avg_spec_accept_length": 3.5}],
    }
    models = {"data": [{"id": "llama", "owned_by": "sglang", "max_model_len": 131072}]}
    facts = server_facts(models, sglang_info, None)
    assert facts == ServerFacts(("llama",), "sglang", 131072, 500_000, "EAGLE3", 3.0)
    off = server_facts(models, {**sglang_info, "speculative_algorithm": None, "internal_states": [{}]}, None)
    assert off.speculative_algorithm == "" and off.avg_accept_length is None
    vllm = server_facts({"data": [{"id": "m", "owned_by": "vllm", "max_model_len": 4096}]}, None, None)
    assert (vllm.engine, vllm.context_len, vllm.speculative_algorithm) == ("vllm", 4096, None)
    props = {"default_generation_settings": {"n_ctx": 1024}, "total_slots": 4}
    llama = server_facts({"data": [{"id": "g", "owned_by": "llamacpp"}]}, None, props)
    assert (llama.engine, llama.context_len, llama.kv_pool_tokens) == ("llamacpp", 1024, 4096)
    # vLLM's dev-mode /server_info is not SGLang's; nonsense sizes are not read.
    assert server_facts(None, {"vllm_config": "x"}, None).engine is None
    assert server_facts({"data": [{"id": "m", "max_model_len": -1}]}, None, None).context_len is None


def test_acceptance_from_each_source() -> None:
    # llama-server's timings: 32 tokens, 7 of them accepted drafts: 25 steps.
    timed = Observation("s", Role.SPECULATIVE, "u", probe=Probe(32, 32, (32, 25)))
    assert acceptance(timed, LLAMACPP).speculates is True
    counters = {"llamacpp:spec_decode_num_accepted_tokens_total": 0.0, "llamacpp:spec_decode_num_drafts_total": 0.0}
    moved = {"llamacpp:spec_decode_num_accepted_tokens_total": 20.0, "llamacpp:spec_decode_num_drafts_total": 10.0}
    by_counters = Observation(
        "s", Role.SPECULATIVE, "u", metrics_before=counters, metrics_after=moved, probe=Probe(32, 32)
    )
    assert acceptance(by_counters, LLAMACPP).value == 3.0
    still = Observation("b", Role.BASELINE, "u", metrics_before=counters, metrics_after=counters, probe=Probe(32, 32))
    assert acceptance(still, LLAMACPP).speculates is False
    # vLLM streams one event a step: 48 tokens in 17 events accept about 3.
    streamed = acceptance(Observation("s", Role.SPECULATIVE, "u", probe=Probe(48, 17)), VLLM)
    assert streamed.speculates is True and streamed.value is not None and 2.5 < streamed.value < 3.5
    one_each = acceptance(Observation("b", Role.BASELINE, "u", probe=Probe(48, 48)), VLLM)
    assert (one_each.value, one_each.speculates) == (1.0, False)
    unknown = acceptance(Observation("s", Role.SPECULATIVE, "u", probe=Probe(error="HTTP 500")), SGLANG)
    assert unknown.speculates is None and "HTTP 500" in unknown.how


def test_a_correct_pair_has_no_findings() -> None:
    assert messages(sglang_obs(Role.SPECULATIVE, "EAGLE3", probe=Probe(48, 17))) == []
    assert messages(sglang_obs(Role.BASELINE, "")) == []


def test_each_misconfiguration_is_one_line_with_what_to_do() -> None:
    baseline_spec = messages(sglang_obs(Role.BASELINE, "EAGLE3", probe=Probe(48, 17)))
    assert len(baseline_spec) == 1 and baseline_spec[0].startswith("error: baseline http://10.0.0.1:30002: speculates")
    assert "start it without --speculative-algorithm" in baseline_spec[0]
    spec_off = messages(sglang_obs(Role.SPECULATIVE, ""))
    assert spec_off == [
        "error: speculative http://10.0.0.1:30001: does not speculate (acceptance 1.00): start it with "
        "--speculative-algorithm EAGLE3 --speculative-draft-model-path D"
    ]
    gone = messages(Observation("baseline", Role.BASELINE, "http://h:1", error="cannot connect"))
    assert gone[0].startswith("error: baseline http://h:1: unreachable (cannot connect): start it")
    no_metrics = sglang_obs(
        Role.BASELINE, "", metrics_problem="no /metrics (404)", metrics_before=None, metrics_after=None
    )
    assert any("no /metrics (404): start it with --enable-metrics" in m for m in messages(no_metrics))
    assert any(
        "not ready (/health answered 503)" in m
        for m in messages(sglang_obs(Role.BASELINE, "", health="/health answered 503"))
    )
    refused = messages(sglang_obs(Role.BASELINE, "", auth_refused=True))
    assert any("set SPECGATE_UPSTREAM_API_KEY" in m for m in refused)


def test_acceptance_unknown_is_a_warning_not_an_error() -> None:
    obs = Observation("speculative", Role.SPECULATIVE, "http://h:1", facts=ServerFacts(("m",)), probe=Probe(48, 48))
    found = judge_server(obs, "auto", "local").findings
    assert found and not any(f.blocks for f in found if "speculates" in f.message)
    assert any("whether it speculates is unknown" in f.message for f in found)


def test_fleet_findings_models_and_load_signal() -> None:
    spec = judge_server(sglang_obs(Role.SPECULATIVE, "EAGLE3"), "auto", "engine")
    other = sglang_obs(Role.BASELINE, "", facts=ServerFacts(("other",), "sglang", 4096, None, "", None))
    base = judge_server(other, "auto", "engine")
    lines = [f.message for f in fleet_findings([spec, base], "engine")]
    assert any("serve different models" in m and "llama" in m and "other" in m for m in lines)
    assert any("context lengths differ (4096, 8192 tokens)" in m for m in lines)
    no_metrics = judge_server(sglang_obs(Role.BASELINE, "", metrics_problem="no /metrics (404)"), "auto", "engine")
    signal = fleet_findings([spec, no_metrics], "engine")
    assert any(f.blocks and "SPECGATE_LOAD_SIGNAL=engine" in f.message for f in signal)
    assert not any("LOAD_SIGNAL" in f.message for f in fleet_findings([spec, no_metrics], "local"))


def setup(**kw: object) -> Setup:
    fields: dict[str, object] = {
        "speculative": [(None, "http://gpu1:30001")],
        "baseline": [(None, "http://gpu1:30002")],
        "shared_gpu": None,
        "calibration": None,
        "calibration_has_model": False,
        "topology_set": None,
        "api_key_set": False,
        "credentials_left_out": False,
    }
    fields.update(kw)
    return Setup(**fields)  # type: ignore[arg-type]


def test_recommended_topology_and_policy() -> None:
    same_host = recommend(setup())
    assert (same_host.topology, same_host.policy) == ("paired", "threshold")
    assert "specgate calibrate" in same_host.policy_why and "assumed" in same_host.topology_why
    apart = recommend(setup(baseline=[(None, "http://gpu2:30002")]))
    assert apart.topology == "pooled" and "different hosts" in apart.topology_why
    assert "SPECGATE_TOPOLOGY=pooled" in apart.settings
    assert recommend(setup(shared_gpu=False)).topology == "pooled"
    assert recommend(setup(shared_gpu=True, baseline=[(None, "http://gpu2:1")])).topology == "paired"
    unequal = recommend(setup(shared_gpu=True, baseline=[(None, "http://gpu1:2"), ("b2", "http://gpu1:3")]))
    assert unequal.topology == "pooled" and "unequal" in unequal.topology_why
    assert "SPECGATE_BASELINE_URL=http://gpu1:2,b2=http://gpu1:3" in unequal.settings
    calibrated = recommend(setup(calibration="cal.json"))
    assert calibrated.policy == "threshold" and "SPECGATE_CALIBRATION=cal.json" in calibrated.settings
    pooled = recommend(setup(calibration="cal.json", shared_gpu=False))
    assert (pooled.topology, pooled.policy) == ("pooled", "adaptive")
    assert recommend(setup(calibration="cal.json", shared_gpu=False, calibration_has_model=True)).policy == "model"
    conflict = recommend(setup(topology_set="paired", baseline=[(None, "http://gpu2:30002")]))
    assert [f.level for f in conflict.findings] == ["warning"]
    secret = recommend(setup(api_key_set=True, credentials_left_out=True))
    assert "SPECGATE_UPSTREAM_API_KEY=<the servers' --api-key, as you set it>" in secret.settings
    assert any("credentials" in f.message for f in secret.findings)


def test_text_report_marks_errors_and_says_ready_or_not() -> None:
    good = [judge_server(sglang_obs(Role.SPECULATIVE, "EAGLE3"), "auto", "local")]
    report = text(Diagnosis(good, [], "local", recommend(setup())))
    assert "problems: none" in report and report.rstrip().endswith("verdict: ready")
    bad = [judge_server(sglang_obs(Role.BASELINE, "EAGLE3", probe=Probe(48, 17)), "auto", "local")]
    diag = Diagnosis(bad, [], "local", recommend(setup()))
    assert diag.blocks and "  ERROR baseline http://10.0.0.1:30002: speculates" in text(diag)
