"""The open event streams of runs (docs/mnote-client.md §Events, §Event-stream fan-out): each
is a :class:`Subscription` — one of ``mnote.max_event_streams`` slots and the waitress thread
that serves it, asleep on its own :class:`threading.Event` between events — and one
:class:`ClientWatch` thread per service ends the streams of clients that went away."""
from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from typing import Protocol

#: How often :class:`ClientWatch` asks whether the clients of open event streams are still
#: connected (seconds): a vanished client's slot is freed within about this long.
DISCONNECT_CHECK_SECONDS = 1.0


class Followed(Protocol):
    """A run a stream follows (:class:`~.run.Run`, :class:`~.foreign_run.ForeignRun`)."""

    def follow(self, after: int, keepalive: float, wake: threading.Event | None = None,
               stop: Callable[[], bool] | None = None) -> Iterator[list[tuple[int, dict]]]: ...


class Subscription:
    """One open event stream of a run (:meth:`RunManager.subscribe`): its slot, the Event its
    thread sleeps on, and whether its client went away (:attr:`gone`, set by
    :class:`ClientWatch`)."""

    def __init__(self, run: Followed, release: Callable[[], None],
                 client_gone: Callable[[], bool] | None, watch: ClientWatch):
        self.run = run
        self.client_gone = client_gone
        self.gone = False
        self.wake = threading.Event()
        self._release = release
        self._watch = watch

    def events(self, after: int, keepalive: float) -> Iterator[list[tuple[int, dict]]]:
        """:meth:`Run.follow` for this subscriber; ends early once the client is gone."""
        return self.run.follow(after, keepalive, self.wake, lambda: self.gone)

    def close(self) -> None:
        """Give the slot back and stop watching the client (safe to call twice)."""
        self._watch.discard(self)
        self._release()


class ClientWatch:
    """One daemon thread that asks, every :data:`DISCONNECT_CHECK_SECONDS`, whether the client
    of each watched :class:`Subscription` is still connected, and wakes the stream of one that
    went away (it then ends: its slot and its waitress thread are free again).

    waitress notices a closed connection while the stream's request is in progress only with
    ``channel_request_lookahead`` > 0 (:func:`hermes_service.lifecycle.waitress_options`);
    without this watch the stream would hold its slot until a keepalive write failed.
    The thread starts with the first watched stream and sleeps while none is open; one check
    is a flag read, so 1 000 streams cost ~0.1 ms per check."""

    def __init__(self, interval: float = DISCONNECT_CHECK_SECONDS):
        self.interval = interval
        self._subs: set[Subscription] = set()
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None

    def add(self, sub: Subscription) -> None:
        with self._cond:
            self._subs.add(sub)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="stream-client-watch",
                                                daemon=True)
                self._thread.start()
            self._cond.notify()

    def discard(self, sub: Subscription) -> None:
        with self._cond:
            self._subs.discard(sub)

    def __len__(self) -> int:
        return len(self._subs)

    def check(self) -> int:
        """Check every watched client once; returns how many were found gone."""
        with self._cond:
            subs = list(self._subs)
        found = 0
        for sub in subs:
            if sub.client_gone is None:
                continue
            try:
                gone = sub.client_gone()
            except Exception:  # noqa: BLE001 - a broken check never ends a stream
                gone = False
            if gone:
                found += 1
                sub.gone = True
                sub.wake.set()
                self.discard(sub)
        return found

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._subs:
                    self._cond.wait()
            self.check()
            time.sleep(self.interval)
