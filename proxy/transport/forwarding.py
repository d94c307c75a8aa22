"""Which headers go up to a server and which come back to the client: the hop-by-hop rules (RFC 9110
7.6.1), the headers specgate sets itself, and who may tell specgate where a request came from
(SPECGATE_TRUSTED_PROXIES). Header policy over bytes, with no I/O: the transport (upstream.py) writes
what this module builds."""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable

# Connection-scoped headers (RFC 9110 7.6.1) and those the proxy sets itself.
HOP_BY_HOP = frozenset(
    {
        b"connection",
        b"keep-alive",
        b"proxy-authenticate",
        b"proxy-authorization",
        b"proxy-connection",
        b"te",
        b"trailer",
        b"transfer-encoding",
        b"upgrade",
    }
)
_NOT_FORWARDED_UP = HOP_BY_HOP | {
    b"host",
    b"content-length",
    b"authorization",
    b"accept-encoding",
    b"x-request-id",
    b"expect",
    b"content-type",
    # The client's speculation switch is where specgate sends the request (proxy/routing/switch.py).
    b"x-specgate-speculation",
}
_NOT_RETURNED = HOP_BY_HOP | {b"server", b"date"}
# W3C trace context: with tracing on, the server gets specgate's (`traced`), not the client's.
_TRACE_CONTEXT = frozenset({b"traceparent", b"tracestate"})
# Who the client is and how it came: set by specgate from the peer, kept only from trusted proxies.
_FORWARDING = frozenset(
    {b"x-forwarded-for", b"x-forwarded-proto", b"x-forwarded-host", b"x-forwarded-port", b"x-real-ip", b"forwarded"}
)
# `Connection` options that name no header.
_CONNECTION_OPTIONS = frozenset({b"close", b"keep-alive"})
# Peers whose trust is remembered; past this the memory starts afresh (a flood of addresses).
_TRUST_MEMORY = 4096


def _tokens(value: bytes) -> set[bytes]:
    """The names in a `Connection` header, lower-cased."""
    return {t.strip().lower() for t in value.split(b",") if t.strip()}


def response_headers(headers: Iterable[tuple[bytes, bytes]]) -> list[tuple[bytes, bytes]]:
    """A server's headers minus hop-by-hop ones, those its `Connection` names included."""
    out: list[tuple[bytes, bytes]] = []
    hop: set[bytes] | None = None
    for k, v in headers:
        name = k.lower()
        if name not in _NOT_RETURNED:
            out.append((name, v))
        elif name == b"connection" and v.lower() not in _CONNECTION_OPTIONS:
            hop = (hop or set()) | (_tokens(v) - _CONNECTION_OPTIONS)
    return [(k, v) for k, v in out if k not in hop] if hop else out


def renamed(headers: bytes, request_id: str, new_id: str) -> bytes:
    """Head lines from `Forwarding.request_headers` with another request id (it ends them)."""
    line = b"x-request-id: " + request_id.encode("latin-1") + b"\r\n"
    if not headers.endswith(line):
        raise ValueError("not head lines from Forwarding.request_headers")
    return headers[: -len(line)] + b"x-request-id: " + new_id.encode("latin-1") + b"\r\n"


def traced(headers: bytes, traceparent: str, tracestate: str | None) -> bytes:
    """Head lines with the W3C trace context of specgate's span added (the client's was left out:
    `Forwarding(own_trace_context=True)`). The values are the propagator's, never a client's bytes."""
    lines = headers + b"traceparent: " + traceparent.encode("latin-1") + b"\r\n"
    if tracestate:
        lines += b"tracestate: " + tracestate.encode("latin-1") + b"\r\n"
    return lines


class Forwarding:
    """The request headers a server gets, given which peers are trusted proxies and whether
    specgate sends a trace context of its own (then the client's stays out)."""

    def __init__(self, trusted_proxies: Iterable[str] = (), *, own_trace_context: bool = False) -> None:
        self._dropped = _NOT_FORWARDED_UP | _TRACE_CONTEXT if own_trace_context else _NOT_FORWARDED_UP
        self._trusted_nets = [ipaddress.ip_network(n, strict=False) for n in trusted_proxies]
        self._trusted_seen: dict[str, bool] = {}

    def trusted(self, peer: str) -> bool:
        """Whether `peer` is one of SPECGATE_TRUSTED_PROXIES (remembered per address)."""
        if not self._trusted_nets:
            return False
        found = self._trusted_seen.get(peer)
        if found is None:
            try:
                addr = ipaddress.ip_address(peer)
                found = any(addr in net for net in self._trusted_nets)
            except ValueError:
                found = False
            if len(self._trusted_seen) >= _TRUST_MEMORY:
                self._trusted_seen.clear()
            self._trusted_seen[peer] = found
        return found

    def request_headers(
        self,
        client_headers: Iterable[tuple[bytes, bytes]],
        request_id: str,
        peer: str | None = None,
        scheme: str = "http",
    ) -> bytes:
        """The head's lines for the server: the client's headers minus hop-by-hop ones (those its
        `Connection` names too, RFC 9110 7.6.1) and credentials, plus the request id and
        `X-Forwarded-For`/`-Proto` as nginx's `$proxy_add_x_forwarded_for` builds them: the
        client's own, only from a trusted proxy, then the peer's address.
        uvicorn's parser already refused any header with CR or LF in it."""
        trusted = peer is not None and self.trusted(peer)
        out: list[bytes] = []
        hop: set[bytes] | None = None
        forwarded_for = b""
        proto = b""
        dropped = self._dropped
        for k, v in client_headers:
            name = k.lower()
            if name in dropped:
                if name == b"connection" and v.lower() not in _CONNECTION_OPTIONS:
                    hop = (hop or set()) | (_tokens(v) - _CONNECTION_OPTIONS)
            elif name not in _FORWARDING:
                out.append(name + b": " + v + b"\r\n")
            elif trusted:
                if name == b"x-forwarded-for":
                    forwarded_for = forwarded_for + b", " + v if forwarded_for else v
                elif name == b"x-forwarded-proto":
                    proto = proto or v
                else:
                    out.append(name + b": " + v + b"\r\n")
        if hop:  # rare: the client named headers as hop-by-hop
            out = [line for line in out if line.split(b":", 1)[0] not in hop]
            if b"x-forwarded-for" in hop:
                forwarded_for = b""
            if b"x-forwarded-proto" in hop:
                proto = b""
        if peer is not None:
            addr = peer.encode("latin-1")
            forwarded_for = forwarded_for + b", " + addr if forwarded_for else addr
        if forwarded_for:
            out.append(b"x-forwarded-for: " + forwarded_for + b"\r\n")
        out.append(
            b"x-forwarded-proto: "
            + (proto or scheme.encode("latin-1"))
            + b"\r\ncontent-type: application/json\r\nx-request-id: "
            + request_id.encode("latin-1")
            + b"\r\n"
        )
        return b"".join(out)
