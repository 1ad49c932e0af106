"""One sandbox's own name lookups for the egress proxy (docs/sandbox.md §Network): no
sandbox can slow another's.

The system resolver (``getaddrinfo``: ``/etc/hosts``, ``resolv.conf``, nsswitch — what the
operator set up for the host) blocks a thread per lookup, and a lookup cannot be cancelled
once started. A thread pool shared by every sandbox would let one sandbox holding many
lookups of slow or black-holed names take all its threads and stall every other sandbox's
requests. So each sandbox gets :class:`Lookups` of its own: a small thread pool of
``cap`` threads (made as lookups need them, ended with the sandbox), at most ``cap`` lookups
in flight — one more is refused at once (``lookup_busy``) — and each answer awaited at most
``timeout`` seconds (``lookup_timeout``). A timed-out lookup keeps its thread, and its place
under the cap, until the resolver gives up: the cost of a sandbox's slow names stays its own.

Why threads and not an asynchronous DNS library (aiodns/pycares, dnspython): those speak
DNS themselves and skip what ``getaddrinfo`` honours (nsswitch sources, the host's own
``/etc/hosts`` and search rules), so the proxy would resolve names differently from the host
it runs on; a pool per sandbox keeps the host's resolver and needs no new dependency.
"""
from __future__ import annotations

import asyncio
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

#: ``resolve(host, port)`` → ``(addresses, None)`` or ``([], reason)``
#: (:func:`hermes_service.sandbox.net.egress_policy.resolve`)
Resolve = Callable[[str, int], tuple[list, str | None]]


class Lookups:
    """One sandbox's lookups: at most ``cap`` in flight on threads of its own, each awaited
    at most ``timeout`` seconds (module doc). Used from one asyncio loop."""

    def __init__(self, cap: int, timeout: float):
        self.cap, self.timeout = cap, timeout
        self.busy = 0                   # lookups whose thread has not returned yet
        self._pool: ThreadPoolExecutor | None = None

    async def resolve(self, resolve: Resolve, host: str, port: int
                      ) -> tuple[list, str | None]:
        """``resolve(host, port)`` on this sandbox's threads; ``([], "lookup_busy")`` at the
        cap, ``([], "lookup_timeout")`` past the deadline."""
        if self.busy >= self.cap:
            return [], "lookup_busy"
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self.cap, thread_name_prefix="sandbox-lookup")
        self.busy += 1
        fut = asyncio.get_running_loop().run_in_executor(self._pool, resolve, host, port)
        fut.add_done_callback(self._done)
        try:
            return await asyncio.wait_for(asyncio.shield(fut), self.timeout)
        except TimeoutError:
            return [], "lookup_timeout"

    def _done(self, _fut: asyncio.Future) -> None:
        self.busy -= 1

    def close(self) -> None:
        """End the threads (one still in a lookup ends when it returns)."""
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
