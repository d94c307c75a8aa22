"""No class starved: where SPECGATE_SLO_TPOT_MS is set, a pooled class's request that its own role
would decode slower than the SLO goes to the other role where that one would not (reason slo)."""

from __future__ import annotations

import pytest

from proxy.config import Settings
from proxy.policy.base import ClassView, Decision, PolicyState, PoolGains, Role
from proxy.routing.steps.classes import class_choice

from ..helpers import policy_cfg

pytestmark = pytest.mark.inprocess

UP = {Role.SPECULATIVE: True, Role.BASELINE: True}
SPEC_DOWN = {Role.SPECULATIVE: False, Role.BASELINE: True}
LIGHT = Decision(Role.SPECULATIVE, "light_load", PolicyState(Role.SPECULATIVE), 6)
VIEW = ClassView(False, 20, 15, 1.3)


def test_a_class_its_own_role_would_starve_takes_the_other_roles_room() -> None:
    slo = policy_cfg("adaptive", high=20, low=15, slo_tpot_ms=50.0)
    # The pool gains most with it on the baseline, where it would decode at 15 tokens/s (67 ms a
    # token); on speculation, 25 tokens/s (40 ms): it goes there.
    starved = PoolGains(100.0, 150.0, 25.0, 15.0)
    d = class_choice(LIGHT, VIEW, slo, UP, True, 5, None, starved)
    assert (d.backend, d.reason) == (Role.SPECULATIVE, "slo")
    # Without the SLO, or where the other role would miss it too, the pool's gain decides.
    plain = policy_cfg("adaptive", high=20, low=15)
    assert class_choice(LIGHT, VIEW, plain, UP, True, 5, None, starved)[:2] == (Role.BASELINE, "class")
    both_miss = PoolGains(100.0, 150.0, 18.0, 15.0)
    assert class_choice(LIGHT, VIEW, slo, UP, True, 5, None, both_miss)[:2] == (Role.BASELINE, "class")
    # Not onto a role that is down, nor into a speculative KV pool that is full.
    assert class_choice(LIGHT, VIEW, slo, SPEC_DOWN, True, 5, None, starved)[:2] == (Role.BASELINE, "class")
    full = policy_cfg("adaptive", high=20, low=15, slo_tpot_ms=50.0, capacity=5)
    assert class_choice(LIGHT, VIEW, full, UP, True, 5, None, starved)[:2] == (Role.BASELINE, "class")
    # And the other way: speculation would starve it, the baseline would not.
    crowded = PoolGains(200.0, 150.0, 19.0, 40.0)
    assert class_choice(LIGHT, VIEW, slo, UP, True, 5, None, crowded)[:2] == (Role.BASELINE, "slo")


def test_the_slos_are_settings_in_ms() -> None:
    s = Settings(_env_file=None, slo_tpot_ms=50, slo_ttft_ms=1000)
    assert s.policy_config(None).slo_tpot_ms == 50.0
    assert Settings(_env_file=None).policy_config(None).slo_tpot_ms is None
    with pytest.raises(ValueError):
        Settings(_env_file=None, slo_tpot_ms=0)
