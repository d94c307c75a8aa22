"""Stored response: a Responses request that continues a stored response (previous_response_id)
goes to the server that stored it, while that server is up; no policy runs, and the mode's state is
left as it is (reason stored_response). Where the server is down the request is placed as any
other, and that server's answer (not found) is the client's. proxy/relay/stored.py remembers where
each response lives."""

from __future__ import annotations

from ...policy.base import Decision, PolicyState, Reason, Role

REASON: Reason = "stored_response"


def pinned(role: Role, state: PolicyState, load: int) -> Decision:
    """The decision for a request that must go to a server of `role`."""
    return Decision(role, REASON, state, load)
