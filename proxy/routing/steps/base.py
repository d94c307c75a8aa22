"""What a step sees and what it is: the request (`Ask`), the group as the decision found it
(`Here`, with the reads only some steps make), and the `Step` protocol."""

from __future__ import annotations

from typing import NamedTuple, Protocol

from ...policy.base import (
    ClassView,
    Decision,
    LoadSnapshot,
    PolicyConfig,
    PolicyState,
    PoolGains,
    Reason,
    Role,
    Switch,
)


class Ask(NamedTuple):
    """A new request, as the steps see it."""

    # False: the request says nothing of acceptance (a model list, embeddings): no probe.
    can_probe: bool = True
    # x-specgate-priority: batch.
    batch: bool = False
    # The role of the server holding the request's conversation cache (None: none does), which
    # holds `cached_tokens` of its prompt.
    held: Role | None = None
    # What is known of its traffic class (None: it has none).
    klass: ClassView | None = None
    prompt_tokens: int = 0
    cached_tokens: int = 0
    # What the client asked of speculation (switch.py; None: auto).
    speculation: Switch | None = None


class GroupReads(Protocol):
    """What a step may read of its group beyond the snapshot, each on demand (a read costs)."""

    def kv_used(self, role: Role) -> tuple[float, float] | None:
        """The least and most full of the role's KV pools that are up (None: unknown)."""
        ...

    def pool_gains(self, accept: float, loads: tuple[int, int] | None = None) -> PoolGains | None:
        """What each role of a pool gains with one more stream of acceptance `accept`."""
        ...

    def kv_streams(self) -> int | None:
        """The streams the speculative role's KV pools hold (capacity.py; None: unknown), under
        every policy (cfg.capacity is told only to the learning ones)."""
        ...

    def prefill_ahead(self, role: Role) -> int:
        """Prompt tokens still to prefill ahead of a request on the role's least backed-up server
        (this gateway's requests there with no output yet)."""
        ...


class Here(NamedTuple):
    """The group as the decision found it: its load and health, the rule's parameters for this
    request, the mode's state before it, and whether its roles are on disjoint GPUs."""

    snapshot: LoadSnapshot
    cfg: PolicyConfig
    state: PolicyState
    pooled: bool
    group: GroupReads


class Step(Protocol):
    """One refinement of the placement. `decision` is what the steps before gave (None before the
    mode); a step returns its own decision, or None to pass."""

    @property
    def name(self) -> str:
        """How /routing names it."""
        ...

    @property
    def reasons(self) -> tuple[Reason, ...]:
        """The reasons it may give."""
        ...

    def place(self, ask: Ask, here: Here, decision: Decision | None) -> Decision | None: ...
