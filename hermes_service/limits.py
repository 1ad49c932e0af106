"""A counting limit whose size can change while it is held (docs/configuring.md §Reload).

Used for the CLI slots (``hermes.max_concurrent_runs``), the v1 admission places
(``max_concurrent_runs + max_waiting_requests``) and an extension's event-stream
slots, so a live reload can resize them without disturbing the
holders: shrinking never takes a place away, it only makes new callers wait until enough
holders have left.
"""
from __future__ import annotations

import threading
import time


class Limiter:
    """Like :class:`threading.BoundedSemaphore` (``acquire(blocking, timeout)`` / ``release``),
    plus :meth:`resize` and the :attr:`held` count."""

    def __init__(self, size: int):
        if size < 0:
            raise ValueError("size must be >= 0")
        self._size = size
        self._held = 0
        self._cond = threading.Condition()

    @property
    def size(self) -> int:
        return self._size

    @property
    def held(self) -> int:
        """Places taken right now (may exceed :attr:`size` just after a shrinking resize)."""
        return self._held

    def acquire(self, blocking: bool = True, timeout: float | None = None) -> bool:
        """Take a place; False if none became free (at once when ``blocking`` is false, else
        within ``timeout`` seconds; ``None`` waits for ever)."""
        deadline = None if timeout is None else time.monotonic() + max(0.0, timeout)
        with self._cond:
            while self._held >= self._size:
                if not blocking:
                    return False
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    return False
                self._cond.wait(remaining)
            self._held += 1
            return True

    def release(self) -> None:
        """Give a place back. ValueError if none is held (a bug, like BoundedSemaphore)."""
        with self._cond:
            if self._held <= 0:
                raise ValueError("Limiter released too many times")
            self._held -= 1
            self._cond.notify()

    def resize(self, size: int) -> None:
        """Change the number of places; waiters are woken when places were added."""
        if size < 0:
            raise ValueError("size must be >= 0")
        with self._cond:
            self._size = size
            self._cond.notify_all()

    def __enter__(self):
        self.acquire()
        return self

    def __exit__(self, *exc) -> None:
        self.release()


#: one holder (an mnote actor, docs/mnote-client.md §Per-actor shares) may take at most this
#: part of a node-wide limit ...
SHARE = 4
#: ... but never fewer than this many places (a reconnecting client briefly holds two)
SHARE_AT_LEAST = 2


def share(limit: int, at_least: int = SHARE_AT_LEAST) -> int:
    """Places one holder may take of a node-wide ``limit``: a :data:`SHARE`-th of it, at
    least ``at_least``, at most ``limit`` (12 → 3, 8 → 2, 2 → 2, 1 → 1)."""
    return max(0, min(limit, max(at_least, limit // SHARE)))
