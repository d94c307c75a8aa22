"""specgate's environment in a scenario. With --time-scale T the simulators run T times faster, and
specgate does not know it: its time settings are divided by T so that they mean what they would at
time scale 1."""

from __future__ import annotations

from proxy.config import Settings


def default_over(name: str, time_scale: float) -> float:
    """A specgate time setting's default, divided by the time scale."""
    return float(Settings.model_fields[name].default) / time_scale


def specgate_env(
    port: int,
    speculative: str,
    baseline: str,
    time_scale: float | None = None,
    log_level: str = "warning",
    **settings: object,
) -> dict[str, str]:
    """SPECGATE_* for one specgate on 127.0.0.1:`port`, `settings` named as Settings' fields. With a
    time scale, how often it reads acceptance and load, and when a frozen gauge means an idle server,
    scaled to the simulators' clock."""
    env = {
        "SPECGATE_HOST": "127.0.0.1",
        "SPECGATE_PORT": str(port),
        "SPECGATE_SPECULATIVE_URL": speculative,
        "SPECGATE_BASELINE_URL": baseline,
        **{f"SPECGATE_{name.upper()}": str(value) for name, value in settings.items()},
        "SPECGATE_LOG_LEVEL": log_level,
    }
    if time_scale is not None:
        env["SPECGATE_HEALTH_INTERVAL_S"] = f"{default_over('health_interval_s', time_scale):g}"
        env["SPECGATE_ENGINE_STALE_S"] = f"{default_over('engine_stale_s', time_scale):g}"
    return env
