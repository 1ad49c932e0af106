"""One background run and its event log (client-proxy contract §2 POST /runs, GET /events;
docs/mnote-client.md §Events; the payloads: :mod:`.events`).

A :class:`Run` is one turn started in a worker thread. Everything the client sees of it is an
ordered event log: each event gets a per-run sequence number (the Server-Sent Events ``id``),
so a client that connects late or reconnects with ``Last-Event-ID`` receives exactly the
events after that id, then the live ones. Exactly one of ``run.completed`` / ``run.failed`` /
``run.cancelled`` ends every run. With the service's
:class:`~hermes_service.mnote.runs.log.RunLogs`, :meth:`Run.emit` also appends each event to
its durable log (the terminal one fsynced before a follower is woken). The event path does
not care where deltas come from: the CLI runner has the answer only at the end, the ACP
runner streams a ``message.delta`` per piece, both through :meth:`Run.listener`.
"""
from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Protocol

from ...errors import storage_full
from .. import event_bounds
from .log import RunLogs, RunWriter
from .questions import RunQuestions

log = logging.getLogger("hermes_service.runs")


class TurnHandle(Protocol):
    """What a runner hands a turn's listener (:meth:`~hermes_service.runner.TurnListener.started`):
    ``kill(reason)`` ends the turn, ``touch()`` feeds its stall watchdog."""

    def kill(self, reason: str) -> None: ...
    def touch(self) -> None: ...

TERMINAL = ("run.completed", "run.failed", "run.cancelled")
#: how often a run whose log hit a full disk tries to write its waiting events again (s)
LOG_RETRY_SECONDS = 1.0
#: After writing, a subscriber of a run with n subscribers waits n × this (seconds) before its
#: next write, and then writes everything that arrived meanwhile at once. One write costs
#: ~0.2-0.6 ms of CPU (bench/stream_fanout.py), so a run streaming many deltas to many
#: subscribers makes about 1 000 writes per second in all, however many subscribers (1 000
#: subscribers: one write per second each), instead of taking every core. An event after a
#: quiet spell leaves at once; the terminal event never waits.
FANOUT_SPACING_SECONDS = 0.001


@dataclass
class Run:
    """One run: identity, status, its event log and its questions to the user
    (:attr:`questions`; thread-safe)."""
    run_id: str
    session_id: str
    actor_id: str
    trace_id: str
    status: str = "queued"         # queued | running | waiting_for_approval |
    #                                waiting_for_answer | completed | failed | cancelled
    finished: float | None = None
    cancel: threading.Event = field(default_factory=threading.Event)
    process: TurnHandle | None = None   # the turn's handle while it runs (kill, touch)
    events: list = field(default_factory=list)
    questions: RunQuestions = field(init=False, repr=False)   # its pending questions
    _cond: threading.Condition = field(default_factory=threading.Condition)
    _wakers: set = field(default_factory=set)      # the wake Event of each follower
    _ended: threading.Event = field(default_factory=threading.Event)   # set with the terminal event
    writer: RunWriter | None = field(default=None, repr=False)   # its durable log (run_log.py)
    _unwritten: list = field(default_factory=list, repr=False)  # events waiting for disk room
    requests_offset: int = 0        # how far the owner has read the run's request file
    claims: RunLogs | None = field(default=None, repr=False)   # exactly one answer (run_log)
    event_bytes: int = 0            # the size of its events so far (event_bounds.RUN_EVENT_BYTES)
    overflow: bool = False          # an event did not fit: the run fails run_limit_exceeded
    foreign = False                 # owned by this process (ForeignRun: by another)
    #: ``fn(run, terminal_payload)`` storing the finished run where every node reads it
    #: (shared storage: :meth:`RunManager.archived`), before its terminal event is seen
    archive: Callable[[Run, dict], None] | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        self.questions = RunQuestions(self)

    # -- its questions (hermes_service.runner.Questions; the answer routes) ------------------
    def ask_approval(self, kind: str, title: str, detail: str,
                     choices: list[str]) -> tuple[str, Future] | None:
        """:meth:`RunQuestions.ask_approval`."""
        return self.questions.ask_approval(kind, title, detail, choices)

    def ask_clarify(self, question: str, choices: list[str] | None) -> tuple[str, Future] | None:
        """:meth:`RunQuestions.ask_clarify`."""
        return self.questions.ask_clarify(question, choices)

    def answer(self, approval_id: str, choice: str, resolved_by: str = "user",
               claimed: bool = False) -> str:
        """:meth:`RunQuestions.answer`."""
        return self.questions.answer(approval_id, choice, resolved_by, claimed)

    def answer_clarify(self, clarify_id: str, answer: str | None,
                       resolved_by: str = "user", claimed: bool = False) -> None:
        """:meth:`RunQuestions.answer_clarify`."""
        self.questions.answer_clarify(clarify_id, answer, resolved_by, claimed)

    def resolve_all(self, resolved_by: str) -> None:
        """:meth:`RunQuestions.resolve_all`."""
        self.questions.resolve_all(resolved_by)

    def emit(self, event: str, **fields) -> int:
        """Append an event; returns its sequence number (1-based). Ignored after a terminal event.
        Wakes every follower (:meth:`follow`). Its text fields are cut to their caps; an
        event past the run's cap is dropped and ends the turn (:mod:`.event_bounds`)."""
        with self._cond:
            if self.done:
                return len(self.events)
            payload = {"event": event, "run_id": self.run_id, "session_id": self.session_id,
                       **event_bounds.bound_fields(fields)}
            terminal = event in TERMINAL
            if not event_bounds.fits(self.event_bytes, payload, terminal):
                self._overflowed()
                return len(self.events)
            self.event_bytes += event_bounds.size(payload)
            if self.writer is not None:     # durable first; the terminal event fsynced
                self._log(payload, durable=event in TERMINAL)
            if terminal and self.archive is not None:
                self.archive(self, payload)
            self.events.append(payload)
            if event in TERMINAL:
                self.status = {"run.completed": "completed", "run.failed": "failed",
                               "run.cancelled": "cancelled"}[event]
                self.finished = time.time()
                self._ended.set()
                self.questions.end()           # nobody waits for them any more
            for wake in self._wakers:
                wake.set()
            return len(self.events)

    def _log(self, payload: dict, durable: bool) -> None:
        """Append ``payload`` to the run's log (caller holds ``_cond``). On a full disk the
        event waits in memory with every later one, in order, and a thread writes them as
        soon as there is room again (every :data:`LOG_RETRY_SECONDS`): the log ends up with
        the same events, the same ids and the same terminal event as the live stream, and
        other processes see the run as running meanwhile (docs/data-and-durability.md §Runs
        and their events)."""
        writer = self.writer
        if writer is None:
            return
        if self._unwritten:
            self._unwritten.append((payload, durable))
            return
        try:
            writer.append(payload, durable=durable)
        except OSError as exc:
            if not storage_full(exc):
                log.exception("run %s: could not write its event log", self.run_id)
                writer.close()
                self.writer = None
                return
            log.warning("run %s: the disk is full: its events wait in memory and are written "
                        "when there is room", self.run_id)
            self._unwritten.append((payload, durable))
            threading.Thread(target=self._write_later, name=f"{self.run_id}-log",
                             daemon=True).start()
        except ValueError:
            log.exception("run %s: could not write its event log", self.run_id)
            writer.close()
            self.writer = None

    def _write_later(self) -> None:
        while True:
            time.sleep(LOG_RETRY_SECONDS)
            with self._cond:
                while self._unwritten and self.writer is not None:
                    payload, durable = self._unwritten[0]
                    try:
                        self.writer.append(payload, durable=durable)
                    except OSError:
                        break
                    self._unwritten.pop(0)
                if not self._unwritten or self.writer is None:
                    if self.writer is not None or not self._unwritten:
                        log.info("run %s: its event log is whole again", self.run_id)
                    self._unwritten.clear()
                    return

    def finish(self, events: list[tuple[str, dict]]) -> None:
        """Emit the closing events of a successful run — unless an abort came first, in which
        case ``run.cancelled`` is emitted instead, or its events passed their cap
        (:meth:`fail_overflow`). Atomic with :meth:`RunManager.abort`, so
        ``run.completed`` never follows ``abort.started``."""
        with self._cond:
            if self.cancel.is_set():
                self.emit("run.cancelled")
                return
            for name, fields in events:
                if self.overflow:
                    break
                self.emit(name, **fields)
            if self.overflow:
                self.fail_overflow()

    def _overflowed(self) -> None:
        """An event did not fit (under ``_cond``): the turn is ended (off this thread: a
        kill waits for the process)."""
        if self.overflow:
            return
        self.overflow = True
        log.warning("run %s: its events passed %d bytes; ending it", self.run_id,
                    event_bounds.RUN_EVENT_BYTES)
        proc = self.process
        if proc is not None:
            threading.Thread(target=proc.kill, args=("output",), daemon=True).start()

    def fail_overflow(self) -> None:
        """End the run with ``run.failed`` ``run_limit_exceeded`` naming the events' cap."""
        self.emit("run.failed", code="run_limit_exceeded",
                  error=f"the run's events passed their cap of "
                        f"{event_bounds.RUN_EVENT_BYTES // (1024 * 1024)} MiB "
                        "(docs/mnote-client.md §Sizes of events); the run was ended")

    @property
    def lock(self) -> threading.Condition:
        """The run's lock: its events, its end, an abort and the answers to its questions
        are atomic under it."""
        return self._cond

    @property
    def done(self) -> bool:
        return bool(self.events) and self.events[-1]["event"] in TERMINAL

    def position(self) -> tuple[int, bool]:
        """``(last_id, done)`` read together: the id of the newest event (0 before the first;
        the run has issued exactly the ids 1..last_id) and whether it is the terminal one."""
        with self._cond:
            return len(self.events), self.done

    def listener(self) -> RunListener:
        """The turn listener that turns a runner's live events into this run's events."""
        return RunListener(self)

    def touch(self) -> None:
        """Record activity (e.g. a tool call) for the stall watchdog."""
        proc = self.process
        if proc is not None:
            proc.touch()

    def follow(self, after: int, keepalive: float, wake: threading.Event | None = None,
               stop: Callable[[], bool] | None = None) -> Iterator[list[tuple[int, dict]]]:
        """Yield the events with id > ``after``, live, in batches ``[(id, event), …]`` (everything
        that arrived since the previous batch), until the batch with the terminal event; an
        empty batch when ``keepalive`` seconds pass without an event.

        Between events the caller's thread sleeps on ``wake`` (its own Event; set by
        :meth:`emit`). Whoever sets ``wake`` after making ``stop()`` true ends the iteration
        early, without the terminal event (a client that went away). With n followers, a
        batch is followed by a pause of n × :data:`FANOUT_SPACING_SECONDS` (cut short by the
        terminal event), so busy runs are sent in fewer, larger batches."""
        wake = wake or threading.Event()
        stop = stop or (lambda: False)
        seq = max(0, after)
        with self._cond:
            self._wakers.add(wake)
        try:
            while not stop():
                with self._cond:
                    batch = list(enumerate(self.events[seq:], seq + 1))
                    finished = self.done
                    if not batch and not finished:
                        wake.clear()     # under the lock: an emit after this sets it again
                if batch:
                    seq += len(batch)
                    yield batch
                    if finished:         # the batch ends with the terminal event
                        return
                    followers = len(self._wakers)
                    if followers > 1:    # coalesce what comes next (see FANOUT_SPACING_SECONDS)
                        self._ended.wait(followers * FANOUT_SPACING_SECONDS)
                elif finished:
                    return
                elif not wake.wait(keepalive):
                    yield []
        finally:
            with self._cond:
                self._wakers.discard(wake)


class RunListener:
    """A :class:`~hermes_service.runner.TurnListener` writing a run's event log:
    ``run.started`` when Hermes begins (once, even if a lost session makes the runner start
    twice; never after ``abort.started``: a run aborted before its turn began has none),
    ``message.delta``, ``reasoning.delta``, and ``tool.*`` of builtin tools."""

    def __init__(self, run: Run):
        self.run = run

    def started(self, handle) -> None:
        run = self.run
        run.process = handle
        with run._cond:      # atomic with RunManager.abort
            if run.status != "running" and not run.cancel.is_set():
                run.status = "running"
                run.emit("run.started")

    def delta(self, text: str) -> None:
        if text:
            self.run.emit("message.delta", delta=text)

    def reasoning(self, text: str) -> None:
        if text:
            self.run.emit("reasoning.delta", delta=text)

    def tool(self, event: str, call_id: str | None, name: str | None, ok: bool | None,
             preview: str | None = None) -> None:
        fields: dict[str, object] = {"tool_call_id": call_id, "tool_name": name,
                                     "preview": preview}
        if event == "tool.completed":      # ok None: Hermes never said (docs: §Tool events)
            fields.update(ok=ok, error_code="tool_failed" if ok is False else None)
        self.run.emit(event, **fields)
