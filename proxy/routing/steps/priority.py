"""Priority: a batch request goes to the baseline, whatever the mode.

batch requests (x-specgate-priority: batch), whatever the policy:

    backend = baseline                                          (reason batch)

and they are left out of L and S: a batch job of any size never moves interactive requests off
speculation, nor takes its room.
"""

from __future__ import annotations

from typing import Final

from ...policy.base import BASELINE, Decision, Reason, total_load
from .base import Ask, Here


class Priority:
    name: Final = "priority"
    reasons: Final[tuple[Reason, ...]] = ("batch",)

    def place(self, ask: Ask, here: Here, decision: Decision | None) -> Decision | None:
        if not ask.batch or decision is not None:
            return None
        # The mode is left as it is: a batch request is no evidence of the interactive load.
        return Decision(BASELINE, "batch", here.state, total_load(here.snapshot, here.cfg.load_signal))
