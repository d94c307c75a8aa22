"""How long the simulated GPU takes: a decode step, a prefill, in simulated seconds (time scale applied).

Two models. `CurveSpeed` is the throughput-curve model of the CSV profiles: a decode step lasts
`A_p * c / T(c)` whatever the context, and a prompt's prefill is a timer of
`ttft_base + tokens / prefill_tok_s` beside decoding, never delaying it. `TableSpeed` follows the
measured H200 step-time table (`steptimes.py`): a step's cost depends on the batch, the draft depth
and the batch's mean context, and prompt chunks run inside the step loop, so decoding waits behind
them, as SGLang's chunked prefill makes it.

A request's acceptance is given at the server's draft depth (`--spec-steps`); at another depth (the
adaptive role changes it every iteration) it follows the chain-drafting model of `accept_at_steps`.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Protocol

from .steptimes import AdaptiveSteps, StepTimes, accept_at_steps


class Speed(Protocol):
    # Prompt chunks run in the step loop (True) or as timers beside it (False).
    @property
    def chunked(self) -> bool: ...

    def steps(self, batch: int) -> int:
        """Draft steps of the next iteration at this batch size (0: a plain decode step)."""
        ...

    def observe(self, batch: int, steps: int, accept_length: float) -> None:
        """What an iteration accepted, for a server that picks its draft depth from it."""
        ...

    def decode_s(self, batch: int, ctx: float, steps: int) -> float: ...

    def prefill_s(self, tokens: int, ctx: float) -> float: ...

    def accept(self, accept_length: float, steps: int) -> float:
        """A request's tokens per iteration at `steps` draft steps, given its acceptance at the server's."""
        ...

    def contention(self, batch: int) -> float:
        """The share of its solo speed a step keeps while another server on the GPU also has work."""
        ...


class CurveSpeed:
    """The CSV profiles' model (see the module docstring); unchanged from before the step-time table."""

    chunked = False

    def __init__(
        self, throughput: Callable[[int], float], step_accept_length: float, ttft_base_s: float, prefill_tok_s: float
    ) -> None:
        self._throughput = throughput
        self._step_accept_length = step_accept_length
        self._ttft_base_s = ttft_base_s
        self._prefill_tok_s = prefill_tok_s

    def steps(self, batch: int) -> int:
        return 0

    def observe(self, batch: int, steps: int, accept_length: float) -> None:
        return None

    def decode_s(self, batch: int, ctx: float, steps: int) -> float:
        return self._step_accept_length * batch / self._throughput(batch)

    def prefill_s(self, tokens: int, ctx: float) -> float:
        return self._ttft_base_s + tokens / self._prefill_tok_s

    def accept(self, accept_length: float, steps: int) -> float:
        return accept_length

    def contention(self, batch: int) -> float:
        return 1.0


class TableSpeed:
    """The measured step-time table: the baseline's step is T(B,1,ctx); an EAGLE iteration with s
    steps s*D(B,1) + T(B,s+1,ctx) + D(B,s+1); the adaptive role's s comes from `AdaptiveSteps`."""

    chunked = True

    def __init__(
        self,
        table: StepTimes,
        role: str,
        spec_steps: int,
        time_scale: float,
        adaptive: AdaptiveSteps | None = None,
    ) -> None:
        self.table = table
        self._role = role
        self._spec_steps = spec_steps
        self._scale = time_scale
        self._adaptive = adaptive

    def steps(self, batch: int) -> int:
        if self._role == "baseline":
            return 0
        if self._adaptive is not None:
            return self._adaptive.choose(batch)
        return self._spec_steps

    def observe(self, batch: int, steps: int, accept_length: float) -> None:
        if self._adaptive is not None:
            self._adaptive.observe(batch, steps, accept_length)

    def decode_s(self, batch: int, ctx: float, steps: int) -> float:
        if self._role == "baseline":
            return self.table.baseline_step_s(batch, ctx) / self._scale
        return self.table.eagle_step_s(batch, steps, ctx) / self._scale

    def prefill_s(self, tokens: int, ctx: float) -> float:
        return self.table.prefill_s(tokens, ctx, draft=self._role != "baseline") / self._scale

    def accept(self, accept_length: float, steps: int) -> float:
        if self._role == "baseline":
            return 1.0
        return _accept(accept_length, self._spec_steps, steps)

    def contention(self, batch: int) -> float:
        return self.table.contention(batch)


@functools.lru_cache(maxsize=4096)
def _accept(accept_length: float, ref_steps: int, steps: int) -> float:
    # Memoised: a batch holds few distinct acceptances, and each solves for p by bisection.
    if steps == ref_steps:
        return min(accept_length, steps + 1.0)
    return accept_at_steps(accept_length, ref_steps, steps)
