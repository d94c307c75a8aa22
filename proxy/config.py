"""Settings: environment variables with prefix SPECGATE_ (and an optional .env), validated at start."""

from __future__ import annotations

import ipaddress
import re
from typing import Annotated, Literal
from urllib.parse import urlsplit

from pydantic import Field, PrivateAttr, SecretStr, field_validator, model_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

from .fleet.engines import EngineSetting
from .fleet.topology import Topology, TopologyName, entries
from .fleet.topology import build as build_topology
from .policy.base import LEARNING, AffinityRule, LoadSignal, PolicyConfig, PolicyName
from .policy.beliefs import AdaptiveConfig
from .policy.calibration import MAX_WATERMARK, Calibration, CalibrationError
from .policy.calibration import load as load_calibration
from .routing.classes import ClassKey
from .routing.homogeneous import AdaptivePlacement
from .routing.switch import Switch, class_defaults

# The inference routes a client may reach on a server (proxy/edge/paths.py): each engine's admin routes
# (SGLang's /update_weights_from_disk, /flush_cache; vLLM's /v1/load_lora_adapter) are not among them.
DEFAULT_ALLOWED_PATHS = (
    "/v1/chat/completions",
    "/v1/completions",
    "/v1/responses",
    "/v1/embeddings",
    "/v1/models",
    "/generate",
)

# /metrics is read this often by default where the mode routes on the engines' load. Measured in
# `loadtest scaleout` (2 groups behind 3 replicas, the engine signal, at 40 streams where the two
# servers tie): with the health interval's 2 s, 0.97x the better fixed choice; with 0.5 s, 0.99-1.00x.
ENGINE_SCRAPE_INTERVAL_S = 0.5
# The speculative pools' use under which a full baseline spills new conversations there, unless set
# (routing/steps/spill.py): room for those spilled to grow to SPECGATE_KV_SPILL_AT.
KV_SPILL_ROOM = 0.6


# Settings kept working for one release, with a warning at start where one is set: what each did is
# now fixed (or follows from another), for the reason given. docs/settings.md lists them apart.
DEPRECATED: dict[str, str] = {
    "adaptive_probe_mode": "probes will be shadow copies only: probes by the request itself were inside the noise "
    "of shadow ones in every cell of the mechanism benchmark (docs/benchmarks/2026-12-07-ablation.md)",
    "adaptive_probe_tokens": "it sizes the request probes SPECGATE_ADAPTIVE_PROBE_MODE=request sends, which go",
    "adaptive_shadow_tokens": "a shadow copy's size will be fixed at its default, 16 tokens: no other was measured",
    "adaptive_margin": "the estimate's margin will be fixed at its default, 5%: no other was ever measured",
}


def deprecated_set(settings: Settings) -> list[str]:
    """One line for each deprecated setting the environment (or .env) set."""
    return [
        f"SPECGATE_{name.upper()} is deprecated and goes in the next release: {why}"
        for name, why in DEPRECATED.items()
        if name in settings.model_fields_set
    ]


def default_scrape_interval(scrape_interval_s: float | None, load_signal: str, health_interval_s: float) -> float:
    """SPECGATE_SCRAPE_INTERVAL_S in effect (Settings.scrape_every_s)."""
    if scrape_interval_s is not None:
        return scrape_interval_s
    return min(ENGINE_SCRAPE_INTERVAL_S, health_interval_s) if load_signal != "local" else health_interval_s


class Settings(BaseSettings):
    """Every option of the gateway. Building it reads the environment; it starts nothing."""

    model_config = SettingsConfigDict(
        env_prefix="SPECGATE_", env_file=".env", extra="ignore", frozen=True, env_ignore_empty=True
    )

    host: str = "0.0.0.0"
    port: int = Field(8000, ge=1, le=65535)
    # A base URL, or a comma list of them, each optionally `NAME=URL` (proxy/fleet/topology.py).
    speculative_url: str = "http://127.0.0.1:30001"
    baseline_url: str = "http://127.0.0.1:30002"
    # Servers that draft adaptively in the engine (SGLang --speculative-adaptive), beside the pair or
    # pool, or alone with the two above set empty; how a request picks one: homogeneous.py.
    adaptive_url: str = ""
    adaptive_placement: AdaptivePlacement = "least_loaded"
    # paired: the i-th servers of both lists share GPUs (a group each); pooled: two pools on
    # disjoint GPUs. Unset: paired when the lists are as long.
    topology: TopologyName | None = None

    policy: PolicyName = "threshold"
    # threshold: switch to the baseline when the load reaches `high`, back when it falls to `low`.
    # 0 sends everything to the baseline (what `loadtest calibrate` says when speculation never pays).
    # At most MAX_WATERMARK streams (proxy/policy/calibration.py), as a calibration file's watermarks.
    high_watermark: int = Field(16, ge=0, le=MAX_WATERMARK)
    low_watermark: int = Field(8, ge=0, le=MAX_WATERMARK)
    # threshold and adaptive: the load must stay at or below the low watermark this long before
    # speculation returns (0: at once). See policy/threshold.py for why only that way, and why 2 s.
    low_watermark_hold_s: float = Field(2.0, ge=0)
    # spillover: the speculative server takes new requests while it has fewer than this in flight.
    spillover_limit: int = Field(8, ge=1)
    load_signal: LoadSignal = "local"
    # A file from `python -m loadtest calibrate --save`: its watermarks (threshold, unless the
    # watermarks are set too) or its curves (adaptive).
    calibration: str | None = None
    # adaptive: the watermarks stay in [min, max], move at most max_step_per_s streams a second,
    # and a mode lasts at least min_dwell_s (opt-in: its gain was inside the noise in every cell of
    # the mechanism benchmark, docs/benchmarks/2026-12-07-ablation.md). Observed speeds halve in
    # weight every half_life_s.
    adaptive_min_watermark: int = Field(0, ge=0, le=MAX_WATERMARK)
    adaptive_max_watermark: int = Field(256, ge=1, le=MAX_WATERMARK)
    adaptive_max_step_per_s: float = Field(10.0, gt=0)
    adaptive_min_dwell_s: float = Field(0.0, ge=0)
    adaptive_half_life_s: float = Field(60.0, gt=0)
    # While everything goes to the baseline, one request goes to the idle speculative server after
    # probe_s (doubling per probe, up to probe_max_s) to re-measure its acceptance. 0: never.
    adaptive_probe_s: float = Field(15.0, ge=0)
    adaptive_probe_max_s: float = Field(20.0, ge=0)
    # shadow: a probe is a copy of a request, capped to shadow_tokens output tokens, that the client
    # never sees; request: the request itself, in sessions of probe_tokens output tokens.
    adaptive_probe_mode: Literal["shadow", "request"] = "shadow"
    adaptive_shadow_tokens: int = Field(16, ge=8, le=4096)
    # A probe session sends requests one at a time until this many output tokens came back: by
    # default SGLang's gauge refresh (engines.py, gauge_refresh_steps: 40) at acceptance length 4.
    adaptive_probe_tokens: int = Field(160, ge=1)
    # Leave speculation where the baseline is ahead by this share, return where speculation is.
    adaptive_margin: float = Field(0.05, ge=0, le=0.5)
    # adaptive, paired groups: prompt tokens a second a server prefills, which prices a switch's
    # re-prefill of every conversation (policy/adaptive.py). Lower is more cautious; 20,000 is under
    # what an 8B model does on one H100 or H200. 0, the default: switches are not priced (opt-in:
    # pricing them was inside the noise in every cell of the mechanism benchmark).
    prefill_tok_s: float = Field(0.0, ge=0, le=1e9)
    # adaptive, paired groups: the speculative pool's cap (routing/capacity.py) is read at the footprint the
    # conversations' growth over the last this many seconds would reach as many seconds ahead, so
    # that the switch its filling forces comes while few conversations are there to re-prefill.
    # 0, the default: the cap is read at the footprint as it is (opt-in: the forecast's gain was
    # inside the noise in every cell of the mechanism benchmark, and it cost in one seed at 1k/128).
    kv_forecast_s: float = Field(0.0, ge=0, le=3600)
    # Engine gauges frozen this long are taken as an idle server (SGLang keeps them when idle).
    engine_stale_s: float = Field(10.0, gt=0)
    # Which engine's metrics to read: detected from each server's /metrics names, or fixed.
    engine: EngineSetting = "auto"

    api_keys: Annotated[tuple[str, ...], NoDecode] = ()
    upstream_api_key: SecretStr | None = None
    # When set, /routing needs one of these (and /metrics too with protect_metrics).
    admin_keys: Annotated[tuple[str, ...], NoDecode] = ()
    protect_metrics: bool = False
    # Paths forwarded to the servers; an entry ending in /* allows what lies under it.
    allowed_paths: Annotated[tuple[str, ...], NoDecode] = DEFAULT_ALLOWED_PATHS
    # Peers (addresses or networks) whose X-Forwarded-For/-Proto are kept; others' are replaced.
    trusted_proxies: Annotated[tuple[str, ...], NoDecode] = ()
    # The client side (proxy/edge/protocol.py): the whole request head within header_timeout_s, an idle
    # kept-alive connection closed after keepalive_timeout_s, new connections past the cap refused.
    header_timeout_s: float = Field(10.0, gt=0)
    keepalive_timeout_s: int = Field(5, ge=1)
    max_client_connections: int = Field(10_000, ge=1)

    health_interval_s: float = Field(2.0, gt=0)
    # How often each server's /metrics is read (the engine signal's age); unset: scrape_every_s's.
    scrape_interval_s: float | None = Field(None, ge=0.1)
    health_timeout_s: float = Field(5.0, gt=0)
    connect_timeout_s: float = Field(3.0, gt=0)
    read_timeout_s: float = Field(120.0, gt=0)
    max_body_bytes: int = Field(16 * 1024 * 1024, ge=1024)
    # The Responses API stores a response on the server that made it, and a request naming it in
    # `previous_response_id` fails anywhere else: where each was made is remembered (proxy/relay/stored.py),
    # for this many of the newest; 0 remembers none.
    responses_entries: int = Field(100_000, ge=0, le=10_000_000)
    # Cache affinity (proxy/routing/affinity.py): conversations whose server is remembered (0: none), and the
    # requests of load a turn's server may have beyond the best, per thousand tokens it has cached.
    affinity_entries: int = Field(100_000, ge=0, le=10_000_000)
    affinity_slack: float = Field(1.0, ge=0, le=1_000_000)
    # ... or while it holds at most this many times the best's load: at a full batch a few requests
    # more cost a stream little, and the re-prefill of every turn moved for them costs all its
    # server's streams (the field benchmark); 1: the rule by slack alone.
    affinity_balance: float = Field(1.5, ge=1.0, le=1_000)
    # Among a role's servers under the model policy (affinity.py): by requests in flight, by default;
    # the priced rules (priced, both) are opt-in, their gain inside the noise in the mechanism
    # benchmark (0.94x, 0.88x-0.99x) and before it (2026-12-07-affinity: both 1.04x, 1.00x-1.09x).
    affinity_rule: AffinityRule = "in_flight"
    # adaptive and model: once every baseline server's KV pool is at least this full, a request for
    # the baseline goes to the speculative role while its pools are under kv_spill_room (routing/steps/spill.py;
    # 0: never); unset, the room is the smaller of KV_SPILL_ROOM and the mark.
    kv_spill_at: float = Field(0.9, ge=0, le=1)
    kv_spill_room: float | None = Field(None, gt=0, le=1)
    # Traffic classes (proxy/routing/classes.py): what names a request's class, and how many are tracked.
    class_key: ClassKey = "header"
    max_classes: int = Field(32, ge=1, le=1000)
    # Each class's speculation where its client asks none (proxy/routing/switch.py): `code=on,creative=off`.
    class_speculation: str = ""
    # The SLOs a pooled class's request is placed to meet (routing/steps/classes.py), in ms; unset: none.
    slo_ttft_ms: float | None = Field(None, gt=0)
    slo_tpot_ms: float | None = Field(None, gt=0)
    max_connections_per_backend: int = Field(1024, ge=1)
    shutdown_grace_s: float = Field(30.0, ge=0)

    log_format: Literal["text", "json"] = "text"
    log_level: Literal["debug", "info", "warning", "error"] = "info"

    # Built once, by the validator that checks the URL settings.
    _topology: Topology | None = PrivateAttr(None)
    # class_speculation as a mapping, by its validator (ingress reads it on every request).
    _class_switches: dict[str, Switch] = PrivateAttr(default_factory=dict)

    @field_validator("api_keys", "admin_keys", "allowed_paths", "trusted_proxies", mode="before")
    @classmethod
    def _split_keys(cls, value: object) -> object:
        if isinstance(value, str):
            return tuple(k.strip() for k in value.split(",") if k.strip())
        return value

    @field_validator("speculative_url", "baseline_url", "adaptive_url")
    @classmethod
    def _check_urls(cls, value: str) -> str:
        if value.strip().lower() == "none":
            return ""  # no server of the role, said where an empty value cannot be (compose's `:-`)
        found = entries(value)
        if not found:
            return ""  # none of the role: the topology says whether that is allowed
        # Userinfo needs an @: without one nothing here is secret, and a bad URL is shown to help
        # fix it. With one, a password may hold any of `,/?#@:`, so the comma split or the URL
        # parser may have cut it anywhere: a URL that fails is named by its place, never shown.
        secret = "@" in value
        for i, (_, url) in enumerate(found, 1):
            problem = _url_problem(url)
            if problem is None:
                continue
            if not secret:
                raise ValueError(f"{_shown(url)!r} {problem}")
            where = "the URL" if len(found) == 1 else f"URL {i} of {len(found)}"
            raise ValueError(
                f"{where} (not shown: it may hold a password) {problem}; "
                "percent-encode any of , / ? # @ [ ] in its user or password"
            )
        return ",".join(f"{name}={url.rstrip('/')}" if name else url.rstrip("/") for name, url in found)

    @field_validator("allowed_paths")
    @classmethod
    def _check_paths(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        for path in value:
            bare = path.removesuffix("/*")
            if not path.startswith("/") or any(seg in (".", "..") for seg in bare.split("/")) or "%" in path:
                raise ValueError(f"{path!r} must be a plain absolute path (optionally ending in /*)")
        return value

    @field_validator("trusted_proxies")
    @classmethod
    def _check_proxies(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        for net in value:
            try:
                ipaddress.ip_network(net, strict=False)
            except ValueError:
                raise ValueError(f"{net!r} is not an IP address or network") from None
        return value

    @field_validator("class_speculation")
    @classmethod
    def _check_class_speculation(cls, value: str) -> str:
        class_defaults(value)
        return value

    @property
    def class_switches(self) -> dict[str, Switch]:
        """SPECGATE_CLASS_SPECULATION as {class: on|off} (a class set to auto is not in it)."""
        return self._class_switches

    @field_validator("calibration")
    @classmethod
    def _check_calibration(cls, value: str | None) -> str | None:
        if value is None or not value.strip():
            return None
        try:
            load_calibration(value)
        except CalibrationError as exc:
            raise ValueError(str(exc)) from None
        return value

    def routing_topology(self) -> Topology:
        """The servers and groups SPECGATE_SPECULATIVE_URL, _BASELINE_URL, _ADAPTIVE_URL and
        _TOPOLOGY describe. Beside adaptive servers, a pair's URL not set is none (its default
        names a server on this host that is not there): SPECGATE_ADAPTIVE_URL alone is a fleet of
        adaptive servers alone."""
        if self._topology is None:
            given = self.model_fields_set
            spec, base = self.speculative_url, self.baseline_url
            if self.adaptive_url:
                spec = spec if "speculative_url" in given else ""
                base = base if "baseline_url" in given else ""
            self._topology = build_topology(spec, base, self.topology, self.adaptive_url)
        return self._topology

    def load_calibration(self) -> Calibration | None:
        return load_calibration(self.calibration) if self.calibration else None

    def watermarks(self, calibration: Calibration | None) -> tuple[int, int]:
        """(high, low) for the threshold rule: the calibration's, unless either is set here."""
        explicit = {"high_watermark", "low_watermark"} & self.model_fields_set
        if calibration is None or explicit:
            return self.high_watermark, self.low_watermark
        return calibration.high_watermark, calibration.low_watermark

    @property
    def scrape_every_s(self) -> float:
        """How often /metrics is read: as set, else ENGINE_SCRAPE_INTERVAL_S where the mode
        routes on the engines' load (several replicas: a stale reading switches modes late), else
        with the health poll."""
        return default_scrape_interval(self.scrape_interval_s, self.load_signal, self.health_interval_s)

    def policy_config(self, calibration: Calibration | None) -> PolicyConfig:
        """The routing rule's parameters: these settings, with the calibration's watermarks unless
        they are set here."""
        high, low = self.watermarks(calibration)
        probe_max_load = self.adaptive_max_watermark
        if calibration is not None:
            probe_max_load = min(probe_max_load, calibration.levels[-1])
        return PolicyConfig(
            policy=self.policy,
            high_watermark=high,
            low_watermark=low,
            spillover_limit=self.spillover_limit,
            load_signal=self.load_signal,
            low_hold_s=self.low_watermark_hold_s,
            min_dwell_s=self.adaptive_min_dwell_s if self.policy in LEARNING else 0.0,
            probe_s=self.adaptive_probe_s,
            probe_max_s=self.adaptive_probe_max_s,
            probe_max_load=probe_max_load,
            probe_shadow=self.adaptive_probe_mode == "shadow",
            # A few polls: the engine's reading of a server that just had traffic lags by one.
            accept_fresh_s=max(10.0, 3 * self.health_interval_s),
            affinity_slack=self.affinity_slack,
            affinity_balance=self.affinity_balance,
            affinity_rule=self.affinity_rule,
            kv_spill_at=self.kv_spill_at,
            adaptive_placement=self.adaptive_placement,
            slo_tpot_ms=self.slo_tpot_ms,
            slo_ttft_ms=self.slo_ttft_ms,
            prefill_tok_s=self.prefill_tok_s,
            kv_spill_room=min(KV_SPILL_ROOM, self.kv_spill_at) if self.kv_spill_room is None else self.kv_spill_room,
        )

    def adaptive_config(self) -> AdaptiveConfig:
        return AdaptiveConfig(
            min_watermark=self.adaptive_min_watermark,
            max_watermark=self.adaptive_max_watermark,
            max_step_per_s=self.adaptive_max_step_per_s,
            half_life_s=self.adaptive_half_life_s,
            probe_tokens=self.adaptive_probe_tokens,
            margin=self.adaptive_margin,
            prefill_tok_s=self.prefill_tok_s,
            kv_forecast_s=self.kv_forecast_s,
        )

    @model_validator(mode="after")
    def _check_watermarks(self) -> Settings:
        if self.adaptive_min_watermark > self.adaptive_max_watermark:
            raise ValueError(
                f"SPECGATE_ADAPTIVE_MIN_WATERMARK ({self.adaptive_min_watermark}) must be <= "
                f"SPECGATE_ADAPTIVE_MAX_WATERMARK ({self.adaptive_max_watermark})"
            )
        try:
            self.routing_topology()
        except ValueError as exc:
            raise ValueError(
                f"SPECGATE_SPECULATIVE_URL / SPECGATE_BASELINE_URL / SPECGATE_ADAPTIVE_URL: {exc}"
            ) from None
        if self.kv_spill_at > 0 and self.kv_spill_room is not None and self.kv_spill_room > self.kv_spill_at:
            raise ValueError(
                f"SPECGATE_KV_SPILL_ROOM ({self.kv_spill_room}) must be <= SPECGATE_KV_SPILL_AT ({self.kv_spill_at})"
            )
        self._class_switches = class_defaults(self.class_speculation)
        if self._class_switches and self.class_key == "none":
            raise ValueError("SPECGATE_CLASS_SPECULATION names classes: it needs SPECGATE_CLASS_KEY other than none")
        if self.protect_metrics and not self.admin_keys:
            raise ValueError("SPECGATE_PROTECT_METRICS needs SPECGATE_ADMIN_KEYS")
        if self.low_watermark > self.high_watermark:
            raise ValueError(
                f"SPECGATE_LOW_WATERMARK ({self.low_watermark}) must be <= "
                f"SPECGATE_HIGH_WATERMARK ({self.high_watermark})"
            )
        return self


def _url_problem(value: str) -> str | None:
    """What is wrong with one server URL (None: nothing), in words that quote none of it."""
    try:
        parts = urlsplit(value)
    except ValueError:  # its message quotes the URL
        return "cannot be parsed as a URL"
    try:
        port = parts.port  # raises on a port that is not a number in 0-65535
    except ValueError:
        return "is not a valid URL: the port is not a number in 1-65535"
    if parts.scheme not in ("http", "https") or not parts.hostname:
        return "must be an http:// or https:// URL with a host"
    if port == 0 or parts.query or parts.fragment:
        return "must be a server's base URL (a port in 1-65535, no query or fragment)"
    if "@" in parts.path:
        # `http://u:12/pw@h` parses as host u, port 12: an unencoded / in a password. Refused, so
        # that every URL served has its userinfo, and only that, before its last @ (redact_url).
        return "has an @ after its host"
    return None


def _shown(url: str) -> str:
    """A URL without userinfo for a message, less any query or fragment (they may carry tokens)."""
    head = re.split(r"[?#]", url, maxsplit=1)[0]
    return head if head == url else head + "?..."


_SCHEME = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*://")


def redact_url(url: str) -> str:
    """`url` without its userinfo (`user:password@`); for every log and message.

    A password may hold any character, unencoded `/?#@:` included, so the URL's grammar cannot say
    where it ends: everything between the scheme and the last `@` goes, and with no scheme,
    everything up to that `@`. Settings refuses a URL with an `@` past its host, so for the URLs
    specgate serves this removes exactly the userinfo."""
    m = _SCHEME.match(url)
    head = m.group(0) if m else ""
    rest = url[len(head) :]
    if "@" not in rest:
        return url
    return head + rest.rpartition("@")[2]


def describe_error(exc: Exception) -> str:
    """One line naming the setting, from a pydantic ValidationError."""
    errors = getattr(exc, "errors", None)
    if callable(errors):
        parts = []
        for err in errors():
            loc = "_".join(str(p) for p in err.get("loc", ()))
            name = f"SPECGATE_{loc.upper()}" if loc else "settings"
            parts.append(f"{name}: {err.get('msg', 'invalid')}")
        return "; ".join(parts)
    return str(exc)
