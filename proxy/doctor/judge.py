"""The judgement: what one server's observation says (engine, model, sizes, speculation), what is
wrong with the fleet, in one line a problem with what to do. Pure: the observations are read by
probe.py, and every engine fact comes from the adapters (proxy/fleet/engines.py).

A problem `blocks` where specgate would route wrongly or not at all: a server it cannot reach or
use, a baseline that speculates or a speculative server that does not (the routing between them
then buys nothing), servers that serve different models, an engine signal asked for but not
exported, a server without /metrics (no engine load, no acceptance reading). The rest warn.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal

from ..fleet.adapter import BadReading, Engine
from ..fleet.engines import ENGINES, LAUNCH_FLAGS, EngineSetting, ServerFacts, detect
from ..policy.base import LoadSignal, Role
from ..policy.evidence import stream_accept

Level = Literal["error", "warning", "ok"]
# Above this acceptance a server speculates; at or below it, one event a token, it does not.
SPECULATES_ABOVE = 1.05


@dataclass(frozen=True)
class Probe:
    """One short streamed request's answer."""

    tokens: int | None = None  # usage.completion_tokens
    content_events: int = 0  # SSE events that carried text
    reported: tuple[int, int] | None = None  # (tokens, steps) the response said of itself
    error: str | None = None


@dataclass(frozen=True)
class Observation:
    """What probe.py read from one server; the URL is already without credentials."""

    name: str
    role: Role
    url: str
    error: str | None = None  # unreachable: why
    health: str | None = None  # None: /health answered 200; else what it said
    auth_refused: bool = False
    facts: ServerFacts = field(default_factory=ServerFacts)
    metrics_problem: str | None = None  # why /metrics could not be read; None: it was
    metrics_before: Mapping[str, float] | None = None
    metrics_after: Mapping[str, float] | None = None
    probe: Probe | None = None


@dataclass(frozen=True)
class Finding:
    level: Level
    message: str  # one line: the server, what is wrong, what to do

    @property
    def blocks(self) -> bool:
        return self.level == "error"


@dataclass(frozen=True)
class Acceptance:
    value: float | None
    speculates: bool | None  # None: unknown
    how: str  # where it was read, or why it is unknown


@dataclass(frozen=True)
class ServerVerdict:
    obs: Observation
    engine: Engine | None
    engine_how: str
    acceptance: Acceptance
    load_readable: bool
    findings: tuple[Finding, ...]

    @property
    def kv_pool(self) -> int | None:
        """The KV pool in tokens: as the server describes itself, else as its /metrics say."""
        if self.obs.facts.kv_pool_tokens is not None or self.engine is None or not self.obs.metrics_after:
            return self.obs.facts.kv_pool_tokens
        try:
            return self.engine.read(self.obs.metrics_after).kv_capacity
        except BadReading:
            return None

    @property
    def who(self) -> str:
        return f"{self.obs.role} {self.obs.url}"


def engine_of(obs: Observation, setting: EngineSetting) -> tuple[Engine | None, str]:
    """The engine, and how it was told."""
    if setting != "auto":
        return ENGINES[setting], "SPECGATE_ENGINE"
    for values in (obs.metrics_after, obs.metrics_before):
        found = detect(values) if values else None
        if found is not None:
            return found, "its /metrics names"
    if obs.facts.engine is not None:
        return ENGINES[obs.facts.engine], "its /v1/models or info endpoints"
    return None, "not told: no metrics of SGLang, vLLM or llama.cpp, and /v1/models does not say"


def acceptance(obs: Observation, engine: Engine | None) -> Acceptance:
    """Whether the server speculates and at what acceptance: SGLang's configured algorithm, then
    the probe's own report (llama-server's timings), the draft counters' move over the probe, the
    probe's tokens over its content events (one a decode step), the engine's mean since start."""
    facts, probe = obs.facts, obs.probe
    measured = _measured(obs, engine)
    if facts.speculative_algorithm is not None:
        on = facts.speculative_algorithm != ""
        value = measured.value if measured.value is not None else facts.avg_accept_length if on else 1.0
        said = "/server_info's speculative_algorithm" + (f" {facts.speculative_algorithm}" if on else ": none")
        return Acceptance(value, on, said + (f"; measured by {measured.how}" if measured.value is not None else ""))
    if measured.speculates is not None or probe is None or probe.error:
        return measured
    if facts.avg_accept_length is not None:
        return Acceptance(facts.avg_accept_length, facts.avg_accept_length > SPECULATES_ABOVE, "the engine's mean")
    return measured


def _measured(obs: Observation, engine: Engine | None) -> Acceptance:
    probe = obs.probe
    if probe is None or probe.error:
        why = probe.error if probe is not None and probe.error else "no probe request was answered"
        return Acceptance(None, None, f"unknown: {why}")
    if probe.reported is not None:
        tokens, steps = probe.reported
        return _said(tokens / steps, "the probe's own report")
    if engine is not None and obs.metrics_before is not None and obs.metrics_after is not None:
        try:
            start, end = engine.accept_counters(obs.metrics_before), engine.accept_counters(obs.metrics_after)
        except BadReading:
            start = end = None
        if start is not None and end is not None and (probe.tokens or 0) > 0:
            accepted, drafts = end[0] - start[0], end[1] - start[1]
            if drafts > 0:
                return _said(1.0 + accepted / drafts, "the draft counters over the probe", True)
            return Acceptance(1.0, False, "the draft counters over the probe (no drafts)")
    if engine is not None and engine.stream_steps and probe.tokens is not None:
        value = stream_accept(probe.tokens, probe.content_events)
        if value is not None:
            return _said(value, "the probe's tokens over its stream events")
    if engine is None:
        return Acceptance(None, None, "unknown: the engine is not known")
    if obs.metrics_problem is not None:
        return Acceptance(None, None, f"unknown: {obs.metrics_problem}")
    return Acceptance(None, None, f"unknown: {engine.name} reported no acceptance for the probe")


def _said(value: float, how: str, drafted: bool = False) -> Acceptance:
    return Acceptance(value, drafted or value > SPECULATES_ABOVE, how)


def judge_server(obs: Observation, setting: EngineSetting, load_signal: LoadSignal) -> ServerVerdict:
    """One server's findings."""
    engine, how = engine_of(obs, setting)
    who = f"{obs.role} {obs.url}"
    if obs.error is not None:
        fix = f"start it, or correct SPECGATE_{obs.role.upper()}_URL / --{obs.role}"
        return _verdict(obs, engine, how, (Finding("error", f"{who}: unreachable ({obs.error}): {fix}"),))
    out: list[Finding] = []
    if obs.health is not None:
        out.append(Finding("error", f"{who}: not ready ({obs.health}): wait until /health answers 200"))
    if obs.auth_refused:
        out.append(Finding("error", f"{who}: refuses the API key: set SPECGATE_UPSTREAM_API_KEY to its --api-key"))
    elif not obs.facts.models:
        out.append(Finding("error", f"{who}: /v1/models lists no model: check that it serves a model"))
    flags = LAUNCH_FLAGS.get(engine.name) if engine else None
    if engine is None:
        out.append(Finding("warning", f"{who}: engine {how}: set SPECGATE_ENGINE=sglang, vllm or llamacpp"))
    elif setting != "auto" and obs.metrics_after and (seen := detect(obs.metrics_after)) and seen != engine:
        out.append(
            Finding(
                "error",
                f"{who}: SPECGATE_ENGINE={setting} but its /metrics are {seen.name}'s: set SPECGATE_ENGINE=auto",
            )
        )
    load_readable = False
    if obs.metrics_problem is not None:
        turn_on = f"start it with {flags.metrics}" if flags else "turn its /metrics on"
        lost = "without it the engine load signal and acceptance reading are missing"
        out.append(Finding("error", f"{who}: {obs.metrics_problem}: {turn_on}; {lost}"))
    elif engine is not None and obs.metrics_after is not None:
        missing = engine.missing(obs.metrics_after)
        load_readable = not missing and engine.load(obs.metrics_after) is not None
        if missing:
            level: Level = "error" if load_signal != "local" else "warning"
            out.append(
                Finding(level, f"{who}: /metrics lacks {', '.join(missing)}: the engine load signal is unreadable")
            )
    accept = acceptance(obs, engine)
    out.extend(_speculation(obs, accept, flags.speculation if flags else "its speculative decoding flags"))
    if obs.probe is not None and obs.probe.error:
        out.append(Finding("error", f"{who}: the probe request failed ({obs.probe.error}): check the server's log"))
    return _verdict(obs, engine, how, tuple(out), accept, load_readable)


def _speculation(obs: Observation, accept: Acceptance, flag: str) -> list[Finding]:
    who = f"{obs.role} {obs.url}"
    shown = f" (acceptance {accept.value:.2f})" if accept.value is not None else ""
    adaptive = obs.facts.speculative_adaptive
    if obs.role == Role.SPECULATIVE and adaptive:
        return [
            Finding(
                "warning",
                f"{who}: drafts adaptively in the engine (--speculative-adaptive), and stops drafting under "
                "load: list it in SPECGATE_ADAPTIVE_URL, or start it without that flag",
            )
        ]
    if obs.role == Role.ADAPTIVE and adaptive is False:
        return [Finding("error", f"{who}: does not draft adaptively: start it with --speculative-adaptive")]
    if accept.speculates is None:
        return [Finding("warning", f"{who}: whether it speculates is {accept.how}")]
    if obs.role == Role.BASELINE and accept.speculates:
        return [Finding("error", f"{who}: speculates{shown}: start it without {flag.split()[0]}")]
    if obs.role == Role.SPECULATIVE and not accept.speculates:
        return [Finding("error", f"{who}: does not speculate{shown}: start it with {flag}")]
    if obs.role == Role.ADAPTIVE and not accept.speculates:
        return [Finding("warning", f"{who}: did not draft for a one-stream probe{shown}: is it speculating?")]
    return []


def _verdict(
    obs: Observation,
    engine: Engine | None,
    how: str,
    findings: tuple[Finding, ...],
    accept: Acceptance | None = None,
    load_readable: bool = False,
) -> ServerVerdict:
    accept = accept or Acceptance(None, None, "unknown: unreachable")
    return ServerVerdict(obs, engine, how, accept, load_readable, findings)


def fleet_findings(verdicts: Sequence[ServerVerdict], load_signal: LoadSignal) -> list[Finding]:
    """What is wrong across the servers: models, context lengths, the load signal."""
    out: list[Finding] = []
    served = {v.who: v.obs.facts.models for v in verdicts if v.obs.facts.models}
    names = {m for models in served.values() for m in models[:1]}
    if len(names) > 1:
        listed = ", ".join(f"{who}: {models[0]}" for who, models in served.items())
        out.append(
            Finding(
                "error", f"the servers serve different models ({listed}): start them with the same served model name"
            )
        )
    contexts = {v.obs.facts.context_len for v in verdicts if v.obs.facts.context_len}
    if len(contexts) > 1:
        sizes = ", ".join(map(str, sorted(contexts)))
        out.append(Finding("warning", f"context lengths differ ({sizes} tokens): a long request fails on the smaller"))
    unread = [v.who for v in verdicts if v.obs.error is None and not v.load_readable]
    if load_signal != "local" and unread:
        what = f"SPECGATE_LOAD_SIGNAL={load_signal} needs each server's engine load, unreadable on {', '.join(unread)}"
        out.append(Finding("error", f"{what}: fix their /metrics or set SPECGATE_LOAD_SIGNAL=local"))
    return out
