"""Following a run that another service process owns (docs/data-and-durability.md §Runs and
their events): a :class:`ForeignRun` read from the run's durable log, and the one
:class:`LogPoller` thread of a process that notices the log grow, closes runs whose owner
died, and hands this process the requests other processes append for its own runs."""
from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator
from typing import Protocol

from ... import instance
from ...errors import BadRequest
from .log import LogState, RunLogs
from .questions import not_pending

log = logging.getLogger("hermes_service.runs")

#: How often the one :class:`LogPoller` thread of a process looks at the run files it watches
#: (seconds): the size of each run another process owns that a stream here follows, and the
#: request file of each run this process owns (an abort or an answer sent to another process).
POLL_SECONDS = 0.05
#: How often the poller asks whether the owner of a followed foreign run is still alive.
OWNER_CHECK_SECONDS = 1.0


class Owner(Protocol):
    """What a foreign run and the poller need of the process's runs
    (:class:`~.runs.RunManager`)."""
    poller: LogPoller

    @property
    def logs(self) -> RunLogs | None: ...

    def owned_active(self) -> list: ...
    def poll_requests(self) -> None: ...


class ForeignRun:
    """A run owned by another service process on this data dir (alive or gone), read from its
    durable log (:mod:`hermes_service.mnote.runs.log`; docs/data-and-durability.md §Runs and their
    events). It offers what the client routes use of a :class:`Run`: ``position``,
    ``follow`` (polled: :class:`LogPoller`), and ``answer`` / ``answer_clarify``, which are
    checked against the log here and handed to the owner as a request line."""
    foreign = True

    def __init__(self, manager: Owner, state: LogState):
        meta = state.meta
        self.run_id = meta["run_id"]
        self.session_id: str = meta.get("session_id") or ""
        self.actor_id: str | None = meta.get("actor_id")
        self.trace_id: str = meta.get("trace_id") or ""
        self.owner = meta.get("owner")
        self.state = state
        self._manager = manager
        if manager.logs is None:
            raise ValueError("a run of another process is read from the run logs")
        self._logs: RunLogs = manager.logs
        self._lock = threading.Lock()
        self.polled_size = state.size       # the poller's view of the file size

    @property
    def events(self) -> list:
        return self.state.events

    @property
    def done(self) -> bool:
        return self.state.done

    def refresh(self) -> None:
        """Read what the owner appended since the last read."""
        with self._lock:
            self._logs.read_more(self.state)

    def close_if_orphaned(self) -> None:
        """Close the run (``run_interrupted``) if it has not ended and its owner is dead."""
        if not self.done and not instance.alive(self.owner):
            self._logs.close_interrupted(self.run_id)
            self.refresh()

    def position(self) -> tuple[int, bool]:
        self.refresh()
        return len(self.events), self.done

    def _pending(self) -> dict:
        """Questions asked and not yet resolved, from the log: id -> (kind, choices)."""
        if self.done:
            return {}
        pending = {}
        for e in self.events:
            name = e.get("event")
            if name == "approval.request":
                pending[e.get("approval_id")] = ("approval", e.get("choices") or [])
            elif name == "clarify.request":
                pending[e.get("clarify_id")] = ("clarify", e.get("choices"))
            elif name == "approval.responded":
                pending.pop(e.get("approval_id"), None)
            elif name == "clarify.responded":
                pending.pop(e.get("clarify_id"), None)
        return pending

    def request(self, op: dict) -> None:
        """Hand ``op`` (an abort, an answer) to the run's owner (its request file)."""
        self._logs.request(self.run_id, op)

    def answer(self, approval_id: str, choice: str, resolved_by: str = "user") -> str:
        """As :meth:`Run.answer` (the same errors), checked against the log; the owner
        applies it within ~:data:`POLL_SECONDS` (if still pending then)."""
        choices = self._choices(approval_id, "approval") or []
        if choice not in choices:
            raise BadRequest(f"choice must be one of {', '.join(choices)}",
                             code="invalid_request")
        self._pass_on(approval_id, "approval", choice,
                      {"op": "approval", "approval_id": approval_id, "choice": choice})
        return choice

    def answer_clarify(self, clarify_id: str, answer: str | None,
                       resolved_by: str = "user") -> None:
        """As :meth:`Run.answer_clarify`, through the owner (see :meth:`answer`)."""
        self._choices(clarify_id, "clarify")
        self._pass_on(clarify_id, "clarify", answer,
                      {"op": "clarify", "clarify_id": clarify_id, "answer": answer})

    def _choices(self, question_id: str, kind: str) -> list | None:
        """The choices of the pending question ``question_id`` of ``kind``, read from the log
        now; Conflict ``<kind>_not_pending`` when it is not pending."""
        self.refresh()
        question = self._pending().get(question_id)
        if question is None or question[0] != kind:
            raise not_pending(question_id, kind)
        return question[1]

    def _pass_on(self, question_id: str, kind: str, value, op: dict) -> None:
        """Claim the one answer of ``question_id`` for ``value`` (Conflict when another answer
        won, in any process) and hand ``op`` to the owner, who applies it."""
        if self._logs.claim(self.run_id, question_id, {"value": value, "resolved_by": "user"}):
            raise not_pending(question_id, kind)
        self._logs.request(self.run_id, op)

    def follow(self, after: int, keepalive: float, wake: threading.Event | None = None,
               stop: Callable[[], bool] | None = None) -> Iterator[list[tuple[int, dict]]]:
        """As :meth:`Run.follow`, from the file: the :class:`LogPoller` sets ``wake`` when the
        file grows (or closes the run when its owner died), so the stream sees an event
        within ~:data:`POLL_SECONDS` of its write. Ends without a terminal event only if the
        file is deleted meanwhile (retention), cut below what was read or replaced by what is
        not a regular file (a damaged data dir), or ``stop()``."""
        wake = wake or threading.Event()
        stop = stop or (lambda: False)
        seq = max(0, after)
        poller = self._manager.poller
        poller.add(self, wake)
        try:
            while not stop():
                self.refresh()
                seen = self.state.size
                batch = list(enumerate(self.events[seq:], seq + 1))
                if batch:
                    seq += len(batch)
                    yield batch
                    if self.done:
                        return
                    continue
                if self.done:
                    return
                wake.clear()
                size = self._logs.size(self.run_id)
                if size < 0:          # the file is gone (retention, gc): nothing will follow
                    return
                if size < self.state.offset:   # cut below what was read, or replaced by a
                    log.warning("run %s: its event log shrank below what was read; its "
                                "stream ends here", self.run_id)   # damaged data dir
                    return
                if size != seen:      # it grew since the read: no sleep
                    continue
                if not wake.wait(keepalive):
                    yield []
        finally:
            poller.discard(self, wake)


class LogPoller:
    """One daemon thread per process (started on first use, asleep while it has nothing to
    watch) that every :data:`POLL_SECONDS`:

    * stats the file of each foreign run a stream here follows and wakes its streams when the
      size changed; every :data:`OWNER_CHECK_SECONDS` closes such a run whose owner is dead
      (:meth:`ForeignRun.close_if_orphaned`);
    * reads the request file of each run this process owns that has not ended, and applies
      what other processes asked (:meth:`RunManager.apply_request`).

    Local streams never go through it: they keep the in-memory wake-up of :meth:`Run.emit`."""

    def __init__(self, manager: Owner, interval: float = POLL_SECONDS):
        self.manager = manager
        self.interval = interval
        self._followers: dict[ForeignRun, set] = {}
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None

    def add(self, run: ForeignRun, wake: threading.Event) -> None:
        with self._cond:
            self._followers.setdefault(run, set()).add(wake)
            self._start()

    def discard(self, run: ForeignRun, wake: threading.Event) -> None:
        with self._cond:
            wakes = self._followers.get(run)
            if wakes is not None:
                wakes.discard(wake)
                if not wakes:
                    del self._followers[run]

    def kick(self) -> None:
        """Something to watch was added (a local run started)."""
        with self._cond:
            self._start()

    def _start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="run-log-poller",
                                            daemon=True)
            self._thread.start()
        self._cond.notify()

    def check(self, owners: bool = False) -> None:
        """One pass (``owners``: also check the owners of followed runs)."""
        with self._cond:
            followed = [(run, set(wakes)) for run, wakes in self._followers.items()]
        for run, wakes in followed:
            if owners:
                try:
                    run.close_if_orphaned()
                except OSError:
                    log.exception("run %s: could not close it", run.run_id)
            size = run._logs.size(run.run_id)
            if size != run.polled_size:
                run.polled_size = size
                for wake in wakes:
                    wake.set()
        self.manager.poll_requests()

    def _run(self) -> None:
        last_owner_check = 0.0
        while True:
            with self._cond:
                while not self._followers and not self.manager.owned_active():
                    self._cond.wait(1.0)
            now = time.monotonic()
            owners = now - last_owner_check >= OWNER_CHECK_SECONDS
            if owners:
                last_owner_check = now
            try:
                self.check(owners)
            except Exception:          # never let the poller die
                log.exception("run-log poller pass failed")
            time.sleep(self.interval)
