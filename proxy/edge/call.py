"""The proxied call: a client's request once ingress has checked it, as the relay and the shadow
prober both take it. A module of its own so that neither imports the other to name it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..kinds import Endpoint
from ..routing.switch import Source, Switch

if TYPE_CHECKING:
    from ..observability.tracing import RequestTrace


@dataclass(frozen=True)
class ProxyCall:
    """A validated client request, ready to send to a backend."""

    target: bytes  # path and query, as the client sent them
    endpoint: Endpoint
    body: bytes
    headers: bytes  # the upstream request's header lines (Forwarding.request_headers)
    request_id: str
    stream: bool
    # The proxy asked the server for a usage chunk the client did not ask for: drop it again.
    strip_usage: bool
    started: float
    # Who sent it, for pooling acceptance evidence by client (access.client_key): never a secret.
    client: str = ""
    # Responses API: the stored response this request continues (`previous_response_id`), and
    # whether the server will store this one (`store` is not false).
    previous: str | None = None
    stores: bool = False
    # Its spans, when tracing is on (proxy/observability/tracing.py).
    trace: RequestTrace | None = None
    # Its prompt's tokens as first guessed from the body (tokens.prompt_estimate), and as held on
    # its server (that guess scaled by what servers reported of earlier ones).
    prompt_estimate: int = 0
    prompt_tokens: int = 0
    # Whose ratio scales that guess (tokens.TokenRatio): the client, by a key specgate checked,
    # else by its address.
    ratio_client: str = ""
    # x-specgate-priority: batch (the default is interactive).
    batch: bool = False
    # The key its conversation is remembered by (affinity.conversation_key); None: none.
    affinity: bytes | None = None
    # Its traffic class (classes.class_of); None: none.
    traffic_class: str | None = None
    # What it asks of speculation, and where that came from (routing/switch.py); None: auto.
    speculation: Switch | None = None
    speculation_source: Source | None = None
