"""A radix prefix cache of KV pages, as SGLang's RadixAttention keeps one per server. Pure.

A page holds `page_tokens` tokens (the simulator counts four bytes of text a token, so a page of 16
is 64 bytes of the prompt as the model sees it, or 16 token ids). Each full page is keyed by a hash
of the whole prefix up to and including it, so equal keys mean equal prefixes and the keys of a
prompt are the path from the root of SGLang's tree. Requests lock the pages they use; unlocked pages
are evicted least recently used, leaves first (a page whose longer prefixes are still cached cannot
go before them, as in a radix tree).

The cache has no capacity of its own: the KV pool is shared with running requests, so the engine
owns the accounting, asks `evict` for room and inserts only what fits.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

# Python's own hash of a (previous key, page) tuple: fast (a 30k-token prompt keys in well under a
# millisecond) and stable within the process, which is all one simulated server needs.
_ROOT = 0x5EED


def page_keys(data: bytes | Sequence[int], page_tokens: int = 16) -> list[int]:
    """A key for each full page of `data` (bytes, four to a token, or token ids)."""
    step = page_tokens * 4 if isinstance(data, bytes) else page_tokens
    keys: list[int] = []
    key = _ROOT
    for start in range(0, len(data) - step + 1, step):
        page = data[start : start + step]
        key = hash((key, page if isinstance(page, bytes) else tuple(page)))
        keys.append(key)
    return keys


@dataclass(eq=False)
class _Page:
    parent: int | None
    children: int = 0
    refs: int = 0


class PrefixCache:
    def __init__(self, page_tokens: int = 16) -> None:
        self.page_tokens = page_tokens
        self._pages: dict[int, _Page] = {}
        # Unlocked pages without cached children, least recently used first: what eviction takes.
        self._leaves: OrderedDict[int, None] = OrderedDict()
        self._locked_pages = 0

    # ----- sizes, in tokens -----
    @property
    def size_tokens(self) -> int:
        return len(self._pages) * self.page_tokens

    @property
    def locked_tokens(self) -> int:
        return self._locked_pages * self.page_tokens

    @property
    def evictable_tokens(self) -> int:
        """What eviction could free: every unlocked page, since a locked page's ancestors are
        locked too (a request locks its whole prefix), so the unlocked ones all end in leaves."""
        return self.size_tokens - self.locked_tokens

    # ----- lookups -----
    def match(self, keys: Sequence[int]) -> int:
        """How many leading pages of `keys` are cached; they become the most recently used."""
        n = 0
        for key in keys:
            if key not in self._pages:
                break
            n += 1
        for key in keys[:n]:
            if key in self._leaves:
                self._leaves.move_to_end(key)
        return n

    def acquire(self, keys: Sequence[int]) -> None:
        """Lock cached pages (a prefix of some request's keys) against eviction."""
        for key in keys:
            page = self._pages[key]
            if page.refs == 0:
                self._locked_pages += 1
                self._leaves.pop(key, None)
            page.refs += 1

    def release(self, keys: Sequence[int]) -> None:
        """Undo `acquire` of the same keys."""
        for key in keys:
            page = self._pages[key]
            if page.refs <= 0:
                raise ValueError("release of a page that was not acquired")
            page.refs -= 1
            if page.refs == 0:
                self._locked_pages -= 1
                if page.children == 0:
                    self._leaves[key] = None

    def insert(self, keys: Sequence[int]) -> int:
        """Cache the pages of `keys` not cached yet; returns the tokens added."""
        added = 0
        parent: int | None = None
        for key in keys:
            page = self._pages.get(key)
            if page is None:
                page = _Page(parent)
                self._pages[key] = page
                if parent is not None:
                    self._add_child(parent)
                added += 1
                self._leaves[key] = None
            elif key in self._leaves:
                self._leaves.move_to_end(key)
            parent = key
        return added * self.page_tokens

    def evict(self, tokens: int) -> int:
        """Free at least `tokens` tokens if unlocked pages allow; returns the tokens freed."""
        freed = 0
        while freed < tokens and self._leaves:
            key, _ = self._leaves.popitem(last=False)
            page = self._pages.pop(key)
            freed += self.page_tokens
            if page.parent is not None:
                parent = self._pages[page.parent]
                parent.children -= 1
                if parent.children == 0 and parent.refs == 0:
                    # Just become a leaf, last used when its child was: the oldest, first in line.
                    self._leaves[page.parent] = None
                    self._leaves.move_to_end(page.parent, last=False)
        return freed

    def _add_child(self, key: int) -> None:
        page = self._pages[key]
        page.children += 1
        self._leaves.pop(key, None)
