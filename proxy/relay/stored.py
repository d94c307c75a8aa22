"""Where each stored response lives. The Responses API keeps a response (and the conversation that
led to it) on the server that made it, unless the request said `"store": false`; a later request
that continues it (`previous_response_id`) fails on any other server with 404. So the relay tells
this table which server made each stored response, and a continuation goes back there.

A bounded LRU table: past `capacity` the longest unused entry goes, and a continuation of a
forgotten response is routed as any new request (the server's own 404 answers it if it lands
elsewhere). Ids longer than MAX_ID_CHARS are never stored or looked up: engines make ids of ~40
characters, and a client must not make the table hold megabytes.
"""

from __future__ import annotations

from ..lru import Lru

MAX_ID_CHARS = 200


class StoredResponses(Lru[str, str]):
    """Response id -> the server that holds it."""

    __slots__ = ()

    def remember(self, response_id: str, server: str) -> None:
        if response_id and len(response_id) <= MAX_ID_CHARS:
            self.put(response_id, server)

    def server_of(self, response_id: str) -> str | None:
        """The server that made `response_id`, if remembered (a use keeps it longer)."""
        return self.get(response_id) if len(response_id) <= MAX_ID_CHARS else None
