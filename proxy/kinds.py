"""The small fixed vocabularies that requests, the transport and the client side are described by.

A module of its own, with no dependencies, so that the transport (upstream.py, conn.py) and the
client side (edge.py) can name an error kind or an endpoint without importing Prometheus: metrics.py
labels by these, it does not define them.
"""

from __future__ import annotations

from typing import Literal

Endpoint = Literal["chat", "completions", "responses", "generate", "other"]
ENDPOINTS: tuple[Endpoint, ...] = ("chat", "completions", "responses", "generate", "other")
# The endpoints whose requests say something of acceptance: they may be probes, or shadowed.
GENERATIONS: tuple[Endpoint, ...] = ("chat", "completions", "responses")
# The endpoints whose requests have a traffic class: SGLang's native one too, whose responses say
# their decode steps (engines.reported_steps).
CLASSED: tuple[Endpoint, ...] = (*GENERATIONS, "generate")
# How talking to a server failed (proxy/transport/upstream.py).
ErrorKind = Literal["connect", "timeout", "disconnect", "protocol"]
ERROR_KINDS: tuple[ErrorKind, ...] = ("connect", "timeout", "disconnect", "protocol")
# Why a client connection was refused or closed before its request (proxy/edge/protocol.py).
Rejection = Literal["limit", "header_timeout", "head_too_large", "upgrade"]
REJECTIONS: tuple[Rejection, ...] = ("limit", "header_timeout", "head_too_large", "upgrade")
