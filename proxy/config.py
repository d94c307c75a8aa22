"""Settings: environment variables with prefix SPECGATE_ (and an optional .env), validated at start."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, SecretStr, field_validator, model_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

from .engines import EngineSetting

PolicyName = Literal["threshold", "spillover"]
LoadSignal = Literal["local", "engine", "max"]


class Settings(BaseSettings):
    """Every option of the gateway. Building it reads the environment; it starts nothing."""

    model_config = SettingsConfigDict(env_prefix="SPECGATE_", env_file=".env", extra="ignore", frozen=True)

    host: str = "0.0.0.0"
    port: int = Field(8000, ge=1, le=65535)
    speculative_url: str = "http://127.0.0.1:30001"
    baseline_url: str = "http://127.0.0.1:30002"

    policy: PolicyName = "threshold"
    # threshold: switch to the baseline when the load reaches `high`, back when it falls to `low`.
    # 0 sends everything to the baseline (what `loadtest calibrate` says when speculation never pays).
    high_watermark: int = Field(16, ge=0)
    low_watermark: int = Field(8, ge=0)
    # spillover: the speculative server takes new requests while it has fewer than this in flight.
    spillover_limit: int = Field(8, ge=1)
    load_signal: LoadSignal = "local"
    # Engine gauges frozen this long are taken as an idle server (SGLang keeps them when idle).
    engine_stale_s: float = Field(10.0, gt=0)
    # Which engine's metrics to read: detected from each server's /metrics names, or fixed.
    engine: EngineSetting = "auto"

    api_keys: Annotated[tuple[str, ...], NoDecode] = ()
    upstream_api_key: SecretStr | None = None

    health_interval_s: float = Field(2.0, gt=0)
    health_timeout_s: float = Field(5.0, gt=0)
    connect_timeout_s: float = Field(3.0, gt=0)
    read_timeout_s: float = Field(120.0, gt=0)
    max_body_bytes: int = Field(16 * 1024 * 1024, ge=1024)
    max_connections_per_backend: int = Field(1024, ge=1)
    shutdown_grace_s: float = Field(30.0, ge=0)

    log_format: Literal["text", "json"] = "text"
    log_level: Literal["debug", "info", "warning", "error"] = "info"

    @field_validator("api_keys", mode="before")
    @classmethod
    def _split_keys(cls, value: object) -> object:
        if isinstance(value, str):
            return tuple(k.strip() for k in value.split(",") if k.strip())
        return value

    @field_validator("speculative_url", "baseline_url")
    @classmethod
    def _check_url(cls, value: str) -> str:
        if not value.startswith(("http://", "https://")) or len(value.split("://", 1)[1].strip("/")) == 0:
            raise ValueError(f"must be an http:// or https:// URL, got {value!r}")
        return value.rstrip("/")

    @model_validator(mode="after")
    def _check_watermarks(self) -> Settings:
        if self.low_watermark > self.high_watermark:
            raise ValueError(
                f"SPECGATE_LOW_WATERMARK ({self.low_watermark}) must be <= "
                f"SPECGATE_HIGH_WATERMARK ({self.high_watermark})"
            )
        return self


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
