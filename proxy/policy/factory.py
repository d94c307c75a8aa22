"""The one place a group's mode rule is built from the settings: a registry by SPECGATE_POLICY."""

from __future__ import annotations

from collections.abc import Callable

from .adaptive import AdaptivePolicy
from .base import Policy, PolicyName
from .model import ModelPolicy
from .spillover import SpilloverPolicy
from .threshold import ThresholdPolicy

POLICIES: dict[PolicyName, Callable[[], Policy]] = {
    "threshold": ThresholdPolicy,
    "spillover": SpilloverPolicy,
    "adaptive": AdaptivePolicy,
    "model": ModelPolicy,
}


def policy_for(name: PolicyName) -> Policy:
    """The mode rule SPECGATE_POLICY names (config.py has checked the name)."""
    return POLICIES[name]()
