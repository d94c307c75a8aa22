"""The radix prefix cache: page keys, hits, partial hits, insertion, eviction least recently used and
leaves first, locks, and its accounting against a plain model under random operations."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from loadtest.simulator.radix import PrefixCache, page_keys

PAGE = 64  # bytes of a 16-token page


def text(*parts: str) -> bytes:
    return "".join(parts).encode()


def test_keys_name_whole_prefixes() -> None:
    a = b"a" * PAGE * 3 + b"tail"
    assert len(page_keys(a)) == 3  # the partial last page has no key
    b = b"a" * PAGE + b"b" * PAGE + b"a" * PAGE
    ka, kb = page_keys(a), page_keys(b)
    assert ka[0] == kb[0] and ka[1] != kb[1] and ka[2] != kb[2]  # a change in page 1 changes 1 and after
    assert page_keys(b"a" * PAGE * 2) == ka[:2]
    ids = list(range(40))
    assert len(page_keys(ids)) == 2 and page_keys(ids)[:1] == page_keys(ids[:16])
    assert page_keys(b"") == [] and page_keys(b"x" * (PAGE - 1)) == []


def test_hit_partial_hit_and_miss() -> None:
    cache = PrefixCache()
    system = b"s" * PAGE * 4
    first = page_keys(system + b"q" * PAGE * 2)
    assert cache.match(first) == 0
    assert cache.insert(first) == 6 * 16
    assert cache.match(first) == 6
    assert cache.match(page_keys(system + b"r" * PAGE * 2)) == 4  # the shared system prompt
    assert cache.match(page_keys(b"t" * PAGE * 6)) == 0
    assert cache.insert(first) == 0  # already there


def test_a_finished_turn_is_found_by_the_next_one() -> None:
    cache = PrefixCache()
    prompt = text("<|system|>\n", "be brief " * 30, "<|user|>\nhi<|assistant|>\n")
    reply = b" the quick brown fox" * 20
    cache.insert(page_keys(prompt + reply))
    turn2 = prompt + reply + b"<|eot|>\n<|user|>\nmore<|assistant|>\n"
    assert cache.match(page_keys(turn2)) == len(prompt + reply) // PAGE


def test_eviction_is_least_recently_used_and_leaves_first() -> None:
    cache = PrefixCache()
    shared = b"s" * PAGE
    a, b = page_keys(shared + b"a" * PAGE), page_keys(shared + b"b" * PAGE)
    cache.insert(a)
    cache.insert(b)
    cache.match(a)  # a's branch is now the more recent
    assert cache.evict(16) == 16
    assert cache.match(b) == 1 and cache.match(a) == 2  # b's leaf went first; the shared page stays
    assert cache.evict(16) == 16  # a's leaf: the shared page is a leaf only once both branches went
    assert cache.match(a) == 1
    assert cache.evict(16) == 16 and cache.size_tokens == 0
    assert cache.evict(16) == 0


def test_locked_pages_are_never_evicted() -> None:
    cache = PrefixCache()
    keys = page_keys(b"x" * PAGE * 3)
    other = page_keys(b"y" * PAGE * 2)
    cache.insert(keys)
    cache.insert(other)
    cache.acquire(keys[:2])
    assert cache.locked_tokens == 32 and cache.evictable_tokens == 3 * 16
    assert cache.evict(10_000) == 3 * 16  # the unlocked third page of keys, and other's two
    assert cache.match(keys) == 2 and cache.size_tokens == 32
    cache.acquire(keys[:1])  # a second request on the first page
    cache.release(keys[:2])
    assert cache.locked_tokens == 16 and cache.evict(10_000) == 16
    cache.release(keys[:1])
    assert cache.locked_tokens == 0 and cache.evict(10_000) == 16 and cache.size_tokens == 0


def test_a_release_without_an_acquire_fails_loudly() -> None:
    cache = PrefixCache()
    keys = page_keys(b"x" * PAGE)
    cache.insert(keys)
    with pytest.raises(ValueError, match="not acquired"):
        cache.release(keys)


class Model:
    """A plain model: every cached prefix, and the lock counts of its pages."""

    def __init__(self) -> None:
        self.pages: dict[int, int | None] = {}  # key -> parent
        self.refs: dict[int, int] = {}


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["insert", "lock", "unlock", "evict"]), st.integers(0, 5),
                          st.integers(1, 6), st.integers(0, 200)), max_size=60))  # fmt: skip
def test_accounting_holds_under_random_operations(ops: list[tuple[str, int, int, int]]) -> None:
    cache = PrefixCache()
    model = Model()
    held: list[list[int]] = []
    # Six conversations sharing some prefixes: branch i shares i // 2 pages with the others.
    branches = [page_keys(b"s" * PAGE * (i // 2) + bytes([65 + i]) * PAGE * 6) for i in range(6)]
    for op, which, length, amount in ops:
        keys = branches[which][:length]
        if op == "insert":
            parent = None
            for k in keys:
                model.pages.setdefault(k, parent)
                parent = k
            cache.insert(keys)
        elif op == "lock":
            n = cache.match(keys)
            cache.acquire(keys[:n])
            held.append(keys[:n])
            for k in keys[:n]:
                model.refs[k] = model.refs.get(k, 0) + 1
        elif op == "unlock" and held:
            keys = held.pop(which % len(held))
            cache.release(keys)
            for k in keys:
                model.refs[k] -= 1
        elif op == "evict":
            unlocked = sum(1 for k in model.pages if not model.refs.get(k))
            freed = cache.evict(amount)
            # Page by page until enough, or until only locked pages are left.
            assert freed == min(-(-amount // 16), unlocked) * 16
            model.pages = {k: p for k, p in model.pages.items() if _cached(cache, k)}
        # The invariants: sizes agree with the model; locked pages and their ancestors stay.
        locked = {k for k, r in model.refs.items() if r > 0}
        assert cache.locked_tokens == 16 * len(locked)
        assert cache.size_tokens == 16 * len(model.pages)
        assert cache.evictable_tokens == cache.size_tokens - cache.locked_tokens
        assert locked <= set(model.pages)
        # Leaves first: no cached page ever lost its parent.
        assert all(p is None or p in model.pages for p in model.pages.values())


def _cached(cache: PrefixCache, key: int) -> bool:
    return key in cache._pages
