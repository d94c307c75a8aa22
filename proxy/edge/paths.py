"""What a client may reach on a server: an allow-list of inference routes, and no path a
normalising hop could turn into another one.

An inference key must not open an engine's admin surface through the operator's upstream key:
SGLang serves /update_weights_from_disk and /flush_cache, vLLM /v1/load_lora_adapter, and a
hop that normalises `/v1/chat/completions/../../../flush_cache` or `/v1/%2e%2e/flush_cache`
between specgate and an engine would make admin routes of them. So a path is refused (400)
before any routing if it holds a dot segment, an encoded dot, slash or backslash (also encoded
twice), a backslash, or a NUL; and only paths on the list (`SPECGATE_ALLOWED_PATHS`) go on.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Literal

# Methods of the routes specgate itself serves on the list (GET /v1/models merges the servers').
_OWN = {"/v1/models": ("GET", "HEAD")}
_PROXIED = ("POST",)
# Encoded '.', '/', '\' and NUL, lower-cased; looked for in the raw and in the decoded path.
_ENCODED = ("%2e", "%2f", "%5c", "%00")

Verdict = Literal["proxy", "own", "bad_path", "method", "unknown"]


def path_problem(path: str, raw: bytes) -> str | None:
    """Why `path` (decoded) / `raw` (as sent) must not be forwarded, or None."""
    if "\x00" in path:
        return "a NUL"
    if "\\" in path:
        return "a backslash"
    lowered = raw.decode("latin-1").lower() + path.lower()
    if any(code in lowered for code in _ENCODED):
        return "an encoded dot, slash, backslash or NUL"
    if any(seg in (".", "..") for seg in path.split("/")):
        return "a dot segment"
    return None


class Routes:
    """The allow-list, compiled once; `check` runs on every request."""

    __slots__ = ("_exact", "_prefixes")

    def __init__(self, allowed: Iterable[str]) -> None:
        self._exact: dict[str, tuple[str, ...]] = {}
        prefixes: list[str] = []
        for path in allowed:
            if path.endswith("/*"):
                prefixes.append(path[:-1])
            else:
                self._exact[path] = _OWN.get(path, _PROXIED)
        self._prefixes = tuple(prefixes)

    def methods(self, path: str) -> tuple[str, ...] | None:
        """The methods `path` may be asked with, or None when it is not on the list."""
        found = self._exact.get(path)
        if found is None and self._prefixes and path.startswith(self._prefixes):
            found = _PROXIED
        return found

    def check(self, method: str, path: str, raw: bytes) -> Verdict:
        # The common case costs a few substring tests: no dot, percent, backslash or NUL.
        if ("." in path or "\\" in path or "\x00" in path or b"%" in raw) and path_problem(path, raw):
            return "bad_path"
        allowed = self.methods(path)
        if allowed is None:
            return "unknown"
        if method not in allowed:
            return "method"
        return "proxy" if allowed is _PROXIED else "own"
