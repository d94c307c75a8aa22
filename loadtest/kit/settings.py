"""specgate's environment in a scenario. With --time-scale T the simulators run T times faster, and
specgate does not know it: its time settings are divided by T (a rate multiplied by it) so that they
mean what they would at time scale 1. A scenario that slows the simulators to fit two cores (T < 1)
and left the adaptive policy's dwell, half-life, probe interval and return hold in wall seconds
measured a policy that moved, probed and forgot 1/T times faster than it does beside a real GPU."""

from __future__ import annotations

from collections.abc import Mapping

from proxy.config import ENGINE_SCRAPE_INTERVAL_S, Settings

# Time settings (Settings' fields) that are durations, scaled by 1 / T; and rates, scaled by T.
DURATIONS = (
    "health_interval_s",
    "engine_stale_s",
    "low_watermark_hold_s",
    "adaptive_min_dwell_s",
    "adaptive_half_life_s",
    "adaptive_probe_s",
    "adaptive_probe_max_s",
    "kv_forecast_s",
)
RATES = ("adaptive_max_step_per_s", "prefill_tok_s")
MIN_SCRAPE_INTERVAL_S = 0.1  # specgate's floor for SPECGATE_SCRAPE_INTERVAL_S


def on_clock(name: str, value: float, time_scale: float) -> float:
    """A time setting's value on the simulators' clock: a duration over the time scale, a rate
    times it; any other setting as it is."""
    if name in DURATIONS:
        return value / time_scale
    return value * time_scale if name in RATES else value


def specgate_env(
    port: int,
    speculative: str,
    baseline: str,
    time_scale: float | None = None,
    log_level: str = "warning",
    **settings: object,
) -> dict[str, str]:
    """SPECGATE_* for one specgate on 127.0.0.1:`port`, `settings` named as Settings' fields. With a
    time scale, every time setting not given in `settings` is its default scaled to the simulators'
    clock (given ones are taken as meant in wall seconds)."""
    env = {
        "SPECGATE_HOST": "127.0.0.1",
        "SPECGATE_PORT": str(port),
        "SPECGATE_SPECULATIVE_URL": speculative,
        "SPECGATE_BASELINE_URL": baseline,
        **settings_env(settings),
        "SPECGATE_LOG_LEVEL": log_level,
    }
    if time_scale is not None:
        for name in (*DURATIONS, *RATES):
            if name not in settings:
                env[f"SPECGATE_{name.upper()}"] = (
                    f"{on_clock(name, float(Settings.model_fields[name].default), time_scale):g}"
                )
        if settings.get("load_signal", "local") != "local" and "scrape_interval_s" not in settings:
            # The engine signal's own default (0.5 s), scaled; under `local` it follows the health poll.
            every = max(MIN_SCRAPE_INTERVAL_S, ENGINE_SCRAPE_INTERVAL_S / time_scale)
            env["SPECGATE_SCRAPE_INTERVAL_S"] = f"{every:g}"
    return env


def settings_env(settings: Mapping[str, object]) -> dict[str, str]:
    """SPECGATE_* for `settings` named as Settings' fields, as given (no time setting scaled)."""
    return {f"SPECGATE_{name.upper()}": str(value) for name, value in settings.items()}
