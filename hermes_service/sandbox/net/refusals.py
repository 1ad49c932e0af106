"""Refusals of a sandbox's requests in the service log, at a rate no sandbox sets
(docs/sandbox.md §Network, docs/operations.md §Logs).

A sandbox can send thousands of refused requests a second; a line for each would let it
write the service's log (and fill its disk) for it. :class:`RefusalLog` writes the first
refusal of a sandbox for a reason at once, counts the next ones of that sandbox and reason
for :data:`INTERVAL` seconds, and then writes one line with the count and the last one's
detail: at most two lines per sandbox and reason an interval, whatever the rate. Every
refusal is still counted in ``/metrics`` by its caller.
"""
from __future__ import annotations

import logging
import time
from collections.abc import Callable, Hashable
from dataclasses import dataclass

INTERVAL = 60.0


@dataclass
class _Window:
    since: float
    count: int = 0
    detail: str = ""


class RefusalLog:
    """``refused(sandbox, reason, detail)`` for every refusal; :meth:`flush` (on a timer, and
    when a sandbox ends) writes the counts of the windows that are over. ``sandbox``: any
    hashable naming one sandbox; ``detail``: the line's text without the reason; ``kind``:
    what refused it (``egress``, ``service``: one window each). Used from one thread (the
    sockets' loop)."""

    def __init__(self, logger: logging.Logger, interval: float = INTERVAL,
                 clock: Callable[[], float] = time.monotonic):
        self.log, self.interval, self.clock = logger, interval, clock
        self.windows: dict[tuple[Hashable, str, str], _Window] = {}

    def refused(self, sandbox: Hashable, reason: str, detail: str, kind: str = "",
                exc_info: BaseException | None = None) -> None:
        key = (sandbox, kind, reason)
        window = self.windows.get(key)
        now = self.clock()
        if window is not None and now - window.since < self.interval:
            window.count += 1
            window.detail = detail
            return
        if window is not None:
            self._write(key, window)
        self.windows[key] = _Window(now)
        self.log.warning("%s (%s)", detail, reason, exc_info=exc_info)

    def flush(self, sandbox: Hashable | None = None) -> None:
        """Write and end the windows that are over — or all of ``sandbox``'s (it ended)."""
        now = self.clock()
        for key, window in list(self.windows.items()):
            if key[0] == sandbox if sandbox is not None else now - window.since >= self.interval:
                self._write(key, window)
                del self.windows[key]

    def _write(self, key: tuple[Hashable, str, str], window: _Window) -> None:
        if window.count:
            self.log.warning("%s (%s) and %d more like it in %.0f s", window.detail, key[2],
                             window.count, self.clock() - window.since)
