"""The model policy: the adaptive rule (adaptive.py), with watermarks solved from the step-time
model (speedmodel.py) for each new request.

model: adaptive, with the watermarks the speed model (speedmodel.py) solves for the group's load,
context and acceptance, where the calibration file has a fit (else adaptive's).
"""

from __future__ import annotations

from .adaptive import AdaptivePolicy
from .base import PolicyName


class ModelPolicy(AdaptivePolicy):
    """SPECGATE_POLICY=model: adaptive's rule; the router solves its watermarks where the calibration has a fit."""

    name: PolicyName = "model"
    solves: bool = True
