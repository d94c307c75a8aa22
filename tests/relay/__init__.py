"""Relaying: event streams, the Responses API, hostile servers, the transport, traces."""
