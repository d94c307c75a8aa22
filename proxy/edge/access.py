"""Who may ask and who asked: API and admin keys checked in constant time, the key a client's
acceptance evidence is pooled under, and the request id echoed back. For the proxied path
(ingress.py) and specgate's own routes (admin.py) alike."""

from __future__ import annotations

import hashlib
import hmac
import os

from ..config import Settings
from ..errors import ApiError


def request_id_of(raw: bytes | None) -> str:
    # Only a sane id is echoed: it lands in headers and logs.
    if raw and len(raw) <= 128:
        rid = raw.decode("latin-1")
        if rid.isascii() and rid.isprintable():
            return rid
    return os.urandom(16).hex()  # as unique as a uuid4, at a fifth of its cost


def client_key(authorization: bytes, peer: str | None) -> str:
    """Who a request is from, as far as pooling acceptance evidence goes: its bearer token's hash
    (the key itself is never kept), else the peer's address."""
    scheme, _, token = authorization.partition(b" ")
    token = token.strip()
    if token and scheme.lower() == b"bearer":
        return "key:" + hashlib.blake2b(token, digest_size=8).hexdigest()
    return "addr:" + (peer or "-")


def authorize(settings: Settings, given: bytes) -> None:
    if settings.api_keys:
        check_key(settings.api_keys, given, "API key")


def check_key(keys: tuple[str, ...], given: bytes, what: str) -> None:
    """401 unless `given` is `Bearer <one of keys>`."""
    scheme, _, token = given.partition(b" ")
    token = token.strip()
    ok = False
    for key in keys:
        # Compare against every key, without early exit, in constant time per key.
        ok |= hmac.compare_digest(token, key.encode())
    if not (ok and scheme.lower() == b"bearer"):
        raise ApiError(
            401,
            f"Invalid or missing {what}: send 'Authorization: Bearer <key>'.",
            code="invalid_api_key",
            headers=((b"www-authenticate", b"Bearer"),),
        )
