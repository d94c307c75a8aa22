"""In-flight accounting: each admitted request holds a lease, released exactly once on every path."""

from __future__ import annotations

from collections.abc import Callable

from .policy import BACKENDS, Backend


class Lease:
    """One request's slot on one backend. `release()` is idempotent, so every exit path may call it."""

    __slots__ = ("_released", "_tracker", "backend")

    def __init__(self, tracker: InflightTracker, backend: Backend) -> None:
        self._tracker = tracker
        self.backend = backend
        self._released = False

    @property
    def released(self) -> bool:
        return self._released

    def release(self) -> None:
        if not self._released:
            self._released = True
            self._tracker._release(self.backend)

    def __del__(self) -> None:
        # Last resort: a lease dropped without release (a bug elsewhere) must not leak the count.
        if not self._released:
            self.release()


class InflightTracker:
    """Per-backend counts. `on_change(backend, count)` runs after every change (metrics, mode)."""

    def __init__(self, on_change: Callable[[Backend, int], None] | None = None) -> None:
        self._counts: dict[Backend, int] = dict.fromkeys(BACKENDS, 0)
        self._on_change = on_change

    def acquire(self, backend: Backend) -> Lease:
        self._counts[backend] += 1
        if self._on_change is not None:
            self._on_change(backend, self._counts[backend])
        return Lease(self, backend)

    def _release(self, backend: Backend) -> None:
        self._counts[backend] -= 1
        if self._on_change is not None:
            self._on_change(backend, self._counts[backend])

    def count(self, backend: Backend) -> int:
        return self._counts[backend]

    def snapshot(self) -> dict[Backend, int]:
        return dict(self._counts)

    @property
    def total(self) -> int:
        return sum(self._counts.values())
