"""The decision as a pipeline: each step gives its own reasons or passes, in the order /routing
shows, and every policy is built by the one factory."""

from __future__ import annotations

import logging

import pytest

from proxy.config import Settings, deprecated_set
from proxy.policy.base import REASONS, LoadSnapshot, PolicyState, Role
from proxy.policy.factory import POLICIES, policy_for
from proxy.routing.steps.base import Ask, Here
from proxy.routing.steps.pipeline import decide, run, steps_for

from ..helpers import policy_cfg
from ..inprocess import StartGateway

UP = {Role.SPECULATIVE: True, Role.BASELINE: True}


def snap(spec: int = 0, base: int = 0, healthy: dict[Role, bool] | None = None) -> LoadSnapshot:
    return LoadSnapshot({Role.SPECULATIVE: spec, Role.BASELINE: base}, {}, healthy or UP)


class Pools:
    """A group whose baseline pools are full and whose speculative ones have room."""

    def kv_used(self, role: Role) -> tuple[float, float] | None:
        return (0.95, 0.95) if role == Role.BASELINE else (0.1, 0.1)

    def pool_gains(self, accept: float, loads: tuple[int, int] | None = None) -> None:
        return None

    def kv_streams(self) -> int | None:
        return None

    def prefill_ahead(self, role: Role) -> int:
        return 0


def test_every_policy_comes_from_the_factory_and_names_itself() -> None:
    assert set(POLICIES) == {"threshold", "spillover", "adaptive", "model"}
    for name in POLICIES:
        policy = policy_for(name)
        assert policy.name == name
        assert policy.learns == (name in ("adaptive", "model"))
        assert policy.solves == (name == "model")


def test_the_steps_run_in_order_and_give_only_their_own_reasons() -> None:
    steps = steps_for(policy_for("adaptive"))
    assert [s.name for s in steps] == [
        "priority", "mode", "switch", "probe", "health", "class", "affinity", "kv_spill",
    ]  # fmt: skip
    assert [s.name for s in steps_for(policy_for("threshold"), pooled=False)] == [
        "priority",
        "mode",
        "switch",
        "health",
    ]
    given = [r for s in steps for r in s.reasons]
    assert set(given) <= set(REASONS)
    # Each reason is one step's, but the pooled class rule's affinity tie-break, which is the class
    # step's own reading of the same cache.
    assert sorted(r for r in given if given.count(r) > 1) == ["affinity", "affinity"]


def test_a_step_passes_on_what_is_not_its_own() -> None:
    cfg = policy_cfg("adaptive", high_watermark=10, low_watermark=4, kv_spill_at=0.9, kv_spill_room=0.6)
    here = Here(snap(2, 0), cfg, PolicyState(), True, Pools())
    decision = run(steps_for(policy_for("adaptive")), Ask(), here)
    assert (decision.backend, decision.reason) == (Role.SPECULATIVE, "light_load")
    for step in steps_for(policy_for("adaptive")):
        if step.name != "mode":
            assert step.place(Ask(), here, decision) is None, step.name


def test_a_full_baseline_spills_only_what_the_mode_sent_there() -> None:
    cfg = policy_cfg("adaptive", high_watermark=4, low_watermark=2, kv_spill_at=0.9, kv_spill_room=0.6)
    base = PolicyState(Role.BASELINE, since=0.0)
    here = Here(snap(0, 9), cfg, base, False, Pools())
    steps = steps_for(policy_for("adaptive"))
    assert run(steps, Ask(), here).reason == "kv_spill"
    # A batch request's baseline is its priority's, not the mode's: it waits there.
    assert run(steps, Ask(batch=True), here).reason == "batch"
    # A conversation cached on the baseline waits for memory where it is cached.
    assert run(steps, Ask(held=Role.BASELINE), here).reason == "heavy_load"


def test_health_follows_the_mode_and_nothing_after_it_picks_a_role_that_is_down() -> None:
    cfg = policy_cfg("threshold", high_watermark=10, low_watermark=4)
    down = {Role.SPECULATIVE: False, Role.BASELINE: True}
    d = decide(snap(1, 0, down), PolicyState(), cfg, Ask(held=Role.SPECULATIVE), pooled=True)
    assert (d.backend, d.reason) == (Role.BASELINE, "only_healthy")
    none = decide(snap(healthy={Role.SPECULATIVE: False, Role.BASELINE: False}), PolicyState(), cfg)
    assert (none.backend, none.reason) == (None, "no_healthy_backend")


@pytest.mark.anyio
async def test_routing_shows_the_pipeline_in_order(gateway: StartGateway) -> None:
    gw = await gateway(policy="adaptive")
    page = await gw.routing()
    # A pair: its classes and turns follow the mode, so neither step runs there.
    assert [s["step"] for s in page["pipeline"]] == [
        "stored_response", "priority", "mode", "switch", "probe", "health", "kv_spill",
    ]  # fmt: skip
    assert page["pipeline"][0]["reasons"] == ["stored_response"]
    assert "light_load" in page["pipeline"][2]["reasons"]


@pytest.mark.anyio
async def test_a_deprecated_setting_still_works_and_says_it_goes(
    gateway: StartGateway, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="specgate")
    assert deprecated_set(Settings(_env_file=None)) == []
    gw = await gateway(policy="adaptive", adaptive_probe_mode="request", adaptive_probe_tokens=200)
    assert gw.settings.policy_config(None).probe_shadow is False  # as set, for one more release
    said = [r.getMessage() for r in caplog.records if "deprecated" in r.getMessage()]
    assert [m.split(" is ")[0] for m in said] == ["SPECGATE_ADAPTIVE_PROBE_MODE", "SPECGATE_ADAPTIVE_PROBE_TOKENS"]
