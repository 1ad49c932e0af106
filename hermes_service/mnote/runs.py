"""Background runs and their event logs (client-proxy contract §2 POST /runs, GET /events).

A :class:`Run` is one turn started in a worker thread. Everything the client
sees of it is an ordered event log: each event gets a per-run sequence
number (the Server-Sent Events ``id``), so a client that connects late or
reconnects with ``Last-Event-ID`` receives exactly the events after that id,
then the live ones. Event payloads follow the contract::

    {"event": "run.started",   "run_id", "session_id"}
    {"event": "message.delta", "run_id", "session_id", "delta"}
    {"event": "reasoning.delta", "run_id", "session_id", "delta"}   (added: the model's reasoning)
    {"event": "tool.started",  "run_id", "session_id", "tool_call_id", "tool_name", "preview"}
    {"event": "tool.completed","run_id", "session_id", "tool_call_id", "tool_name", "preview", "ok",
    "error_code"} {"event": "run.completed", "run_id", "session_id", "output", "finish_reason",
    "usage": {input_tokens, output_tokens, total_tokens}[, "notice"]} {"event": "run.failed",
    "run_id", "session_id", "code", "error"} {"event": "abort.started", "run_id"} {"event":
    "run.cancelled", "run_id", "session_id"} {"event": "approval.request", "run_id", "session_id",
    "approval_id", "kind", "title", "detail", "choices"} {"event": "approval.responded", "run_id",
    "session_id", "approval_id", "choice", "resolved_by"} {"event": "clarify.request", "run_id",
    "session_id", "clarify_id", "question", "choices"} {"event": "clarify.responded", "run_id",
    "session_id", "clarify_id", "resolved_by"}

``approval.*`` (added; docs/mnote-client.md §Approvals): a question Hermes asks a human before a
dangerous command or an edit (:meth:`Run.ask_approval`), and how it was resolved
(:meth:`Run.answer`: ``resolved_by`` ``user`` | ``timeout`` | ``abort``). While a run has a question
pending its status is ``waiting_for_approval``. Each question has its own ``approval_id``; several
may be pending at once (parallel tool calls). ``clarify.*`` (added; docs/mnote-client.md §Approvals
→ Clarifying questions) the same for a question of Hermes's ``clarify`` tool
(:meth:`Run.ask_clarify`, :meth:`Run.answer_clarify`); the status meanwhile is
``waiting_for_answer``.

Exactly one of run.completed / run.failed / run.cancelled ends every run.
Finished runs stay replayable for ``mnote.events_retention_seconds``.

Durable logs (docs/data-and-durability.md §Runs and their events): with the service's
:class:`~hermes_service.mnote.run_log.RunLogs`, :meth:`Run.emit` also appends each event to
``data/run-events/<run_id>.jsonl`` (the terminal one fsynced before a follower is woken), so
any process on the data dir serves the run as a :class:`ForeignRun` (followed through the
one :class:`LogPoller` thread of that process), a session is busy across processes, aborts
and answers reach the owner as request lines, and a run whose owner died ends with
``{"event": "run.failed", …, "code": "run_interrupted"}`` exactly once.

Subscribers (docs/mnote-client.md §Events, §Event-stream fan-out): each open stream
is a :class:`Subscription` — one of ``mnote.max_event_streams`` slots, and the waitress thread
that serves it. The thread sleeps on its own :class:`threading.Event` between events (set by
:meth:`Run.emit`, so an idle subscriber costs no CPU, apart from a keepalive comment every
``mnote.keepalive_seconds``); one :class:`ClientWatch` thread per service notices clients that
went away (waitress's ``waitress.client_disconnected``) within
:data:`DISCONNECT_CHECK_SECONDS` and ends their streams, which frees slot and thread.

The event path does not care where deltas come from: the CLI runner has the
answer only at the end (one ``message.delta`` precedes ``run.completed``); the
ACP runner streams a ``message.delta`` per piece the model generates, through
:meth:`Run.listener`.
"""
from __future__ import annotations

import logging
import secrets
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from dataclasses import dataclass, field

from .. import instance, logs
from ..errors import (
    BadRequest,
    Conflict,
    NotFound,
    ServiceError,
    StorageFull,
    TooManyRuns,
    storage_full,
)
from ..limits import Limiter
from . import event_bounds, metrics
from .run_log import LogState, RunLogs, RunWriter

log = logging.getLogger("hermes_service.runs")

TERMINAL = ("run.completed", "run.failed", "run.cancelled")
#: how often a run whose log hit a full disk tries to write its waiting events again (s)
LOG_RETRY_SECONDS = 1.0
#: How often :class:`ClientWatch` asks whether the clients of open event streams are still
#: connected (seconds): a vanished client's slot is freed within about this long.
DISCONNECT_CHECK_SECONDS = 1.0
#: After writing, a subscriber of a run with n subscribers waits n × this (seconds) before its
#: next write, and then writes everything that arrived meanwhile at once. One write costs
#: ~0.2-0.6 ms of CPU (bench/stream_fanout.py), so a run streaming many deltas to many
#: subscribers makes about 1 000 writes per second in all, however many subscribers (1 000
#: subscribers: one write per second each), instead of taking every core. An event after a
#: quiet spell leaves at once; the terminal event never waits.
FANOUT_SPACING_SECONDS = 0.001
#: How often the one :class:`LogPoller` thread of a process looks at the run files it watches
#: (seconds): the size of each run another process owns that a stream here follows, and the
#: request file of each run this process owns (an abort or an answer sent to another process).
POLL_SECONDS = 0.05
#: How often the poller asks whether the owner of a followed foreign run is still alive.
OWNER_CHECK_SECONDS = 1.0


@dataclass
class Question:
    """One pending question of a run: its id, the choices it accepts and the Future the
    asking runner waits on (its result: the choice)."""
    question_id: str
    choices: list[str] | None
    kind: str = "approval"           # approval | clarify
    future: Future = field(default_factory=Future)


@dataclass
class Run:
    """One run: identity, status and its event log (thread-safe)."""
    run_id: str
    session_id: str
    actor_id: str
    trace_id: str
    status: str = "queued"         # queued | running | waiting_for_approval |
    #                                waiting_for_answer | completed | failed | cancelled
    finished: float | None = None
    cancel: threading.Event = field(default_factory=threading.Event)
    process: object = None          # the CliProcess while it runs
    events: list = field(default_factory=list)
    questions: dict = field(default_factory=dict)   # approval/clarify id -> Question, pending only
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
            self.events.append(payload)
            if event in TERMINAL:
                self.status = {"run.completed": "completed", "run.failed": "failed",
                               "run.cancelled": "cancelled"}[event]
                self.finished = time.time()
                self._ended.set()
                for question in self.questions.values():   # nobody waits for them any more
                    self._claim(question.question_id, None, "end")   # (answers after: 409)
                    question.future.set_result("deny" if question.kind == "approval" else None)
                self.questions.clear()
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
        if self._unwritten:
            self._unwritten.append((payload, durable))
            return
        try:
            self.writer.append(payload, durable=durable)
        except OSError as exc:
            if not storage_full(exc):
                log.exception("run %s: could not write its event log", self.run_id)
                self.writer.close()
                self.writer = None
                return
            log.warning("run %s: the disk is full: its events wait in memory and are written "
                        "when there is room", self.run_id)
            self._unwritten.append((payload, durable))
            threading.Thread(target=self._write_later, name=f"{self.run_id}-log",
                             daemon=True).start()
        except ValueError:
            log.exception("run %s: could not write its event log", self.run_id)
            self.writer.close()
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
    def done(self) -> bool:
        return bool(self.events) and self.events[-1]["event"] in TERMINAL

    # -- questions to the user (docs/mnote-client.md §Approvals)
    # ----------------------------------------
    def ask_approval(self, kind: str, title: str, detail: str,
                     choices: list[str]) -> tuple[str, Future] | None:
        """Put a question to the user: emits ``approval.request`` and sets the status to
        ``waiting_for_approval``. Returns ``(approval_id, future)`` — the future's result is
        the choice, set by :meth:`answer` — or None when the run is ending (aborted or
        finished: the caller denies)."""
        with self._cond:
            if self.done or self.cancel.is_set():
                return None
            question = Question("apr_" + secrets.token_hex(12), list(choices))
            self.questions[question.question_id] = question
            self._waiting()
            self.emit("approval.request", approval_id=question.question_id, kind=kind,
                      title=title, detail=detail, choices=list(choices))
        metrics.approval_asked(kind)
        return question.question_id, question.future

    def answer(self, approval_id: str, choice: str, resolved_by: str = "user",
               claimed: bool = False) -> str:
        """Resolve a pending question with ``choice`` (one of its choices): emits
        ``approval.responded`` and hands the choice to the waiting runner; the status is
        ``running`` again once no question is pending. Returns the choice.

        Exactly one answer wins across the processes of the data dir: the answer is claimed
        first (:meth:`RunLogs.claim`; ``claimed``: another process already claimed it for
        this one). When another answer won the claim, that answer is applied here and this
        one is refused like an answer to a question no longer pending.

        Raises BadRequest ``invalid_request`` for a choice the question does not offer,
        Conflict ``approval_not_pending`` for an id that is not pending (never asked,
        already answered — here or in another process —, timed out, or the run ended)."""
        with self._cond:
            question = self.questions.get(approval_id)
            if question is None or question.kind != "approval":
                raise _not_pending(approval_id)
            if choice not in question.choices:
                raise BadRequest(f"choice must be one of {', '.join(question.choices)}",
                                 code="invalid_request")
            won = None if claimed else self._claim(approval_id, choice, resolved_by)
            if won is not None:
                value = won.get("value")
                self._resolve(question, value if value in question.choices else "deny",
                              won.get("resolved_by") or "user")
                raise _not_pending(approval_id)
            self._resolve(question, choice, resolved_by)
        return choice

    def _claim(self, question_id: str, value, resolved_by: str) -> dict | None:
        """Claim the answer (under ``_cond``): None when it is this one (or no other process
        can answer: no durable log), else the answer that won."""
        if self.claims is None:
            return None
        try:
            return self.claims.claim(self.run_id, question_id,
                                     {"value": value, "resolved_by": resolved_by})
        except (OSError, ValueError):
            log.exception("run %s: could not record the answer to %s", self.run_id, question_id)
            return None

    def _resolve(self, question: Question, value, resolved_by: str) -> None:
        """Hand ``value`` to the waiting runner and say so on the stream (under ``_cond``)."""
        del self.questions[question.question_id]
        self._waiting()
        if question.kind == "approval":
            self.emit("approval.responded", approval_id=question.question_id, choice=value,
                      resolved_by=resolved_by)
            metrics.approval_answered(resolved_by, value)
        else:
            self.emit("clarify.responded", clarify_id=question.question_id,
                      resolved_by=resolved_by)
            metrics.approval_answered(resolved_by, "answer" if value is not None else "none")
        question.future.set_result(value)

    def ask_clarify(self, question: str, choices: list[str] | None) -> tuple[str, Future] | None:
        """Put a clarifying question to the user: emits ``clarify.request`` (``choices``:
        suggested answers, or None for an open question; any text is an answer) and sets the
        status to ``waiting_for_answer``. Returns ``(clarify_id, future)`` — the future's
        result is the answer text, or None when nobody answered — or None when the run is
        ending."""
        with self._cond:
            if self.done or self.cancel.is_set():
                return None
            asked = Question("clq_" + secrets.token_hex(12),
                             list(choices) if choices else None, kind="clarify")
            self.questions[asked.question_id] = asked
            self._waiting()
            self.emit("clarify.request", clarify_id=asked.question_id, question=question,
                      choices=asked.choices)
        metrics.approval_asked("clarify")
        return asked.question_id, asked.future

    def answer_clarify(self, clarify_id: str, answer: str | None,
                       resolved_by: str = "user", claimed: bool = False) -> None:
        """Resolve a pending clarifying question (``answer`` None: nobody answered): emits
        ``clarify.responded`` ``{clarify_id, resolved_by}`` (the answer itself goes to Hermes,
        which records it; it is not an event). Claimed like :meth:`answer`. Raises Conflict
        ``clarify_not_pending``."""
        with self._cond:
            question = self.questions.get(clarify_id)
            if question is None or question.kind != "clarify":
                raise _not_pending(clarify_id, "clarify")
            won = None if claimed else self._claim(clarify_id, answer, resolved_by)
            if won is not None:
                value = won.get("value")
                self._resolve(question, value if isinstance(value, str) else None,
                              won.get("resolved_by") or "user")
                raise _not_pending(clarify_id, "clarify")
            self._resolve(question, answer, resolved_by)

    def _waiting(self) -> None:
        """The status from the pending questions (under ``_cond``)."""
        if self.status not in ("running", "waiting_for_approval", "waiting_for_answer"):
            return
        kinds = {q.kind for q in self.questions.values()}
        self.status = ("waiting_for_approval" if "approval" in kinds else
                       "waiting_for_answer" if kinds else "running")

    def resolve_all(self, resolved_by: str) -> None:
        """Resolve every pending question (an abort): approvals denied, clarifying questions
        unanswered; an ``approval.responded`` / ``clarify.responded`` for each."""
        with self._cond:
            pending = [(q.question_id, q.kind) for q in self.questions.values()]
        for question_id, kind in pending:
            try:
                if kind == "approval":
                    self.answer(question_id, "deny", resolved_by)
                else:
                    self.answer_clarify(question_id, None, resolved_by)
            except (Conflict, BadRequest):     # answered meanwhile
                pass

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


def _not_pending(question_id: str, kind: str = "approval") -> Conflict:
    """409 ``approval_not_pending`` / ``clarify_not_pending`` (docs/mnote-client.md §Approvals)."""
    what = "approval" if kind == "approval" else "question"
    return Conflict(f"{what} {question_id} is not pending (never asked, already answered, "
                    "timed out, or the run ended)", code=f"{kind}_not_pending")


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
        fields = {"tool_call_id": call_id, "tool_name": name, "preview": preview}
        if event == "tool.completed":      # ok None: Hermes never said (docs: §Tool events)
            fields.update(ok=ok, error_code="tool_failed" if ok is False else None)
        self.run.emit(event, **fields)


class ForeignRun:
    """A run owned by another service process on this data dir (alive or gone), read from its
    durable log (:mod:`hermes_service.mnote.run_log`; docs/data-and-durability.md §Runs and their
    events). It offers what the client routes use of a :class:`Run`: ``position``,
    ``follow`` (polled: :class:`LogPoller`), and ``answer`` / ``answer_clarify``, which are
    checked against the log here and handed to the owner as a request line."""
    foreign = True

    def __init__(self, manager: RunManager, state: LogState):
        meta = state.meta
        self.run_id = meta["run_id"]
        self.session_id = meta.get("session_id")
        self.actor_id = meta.get("actor_id")
        self.trace_id = meta.get("trace_id")
        self.owner = meta.get("owner")
        self.state = state
        self._manager = manager
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
            self._logs.read_more(self.state, self.run_id)

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

    def answer(self, approval_id: str, choice: str, resolved_by: str = "user") -> str:
        """As :meth:`Run.answer` (the same errors), checked against the log; the owner
        applies it within ~:data:`POLL_SECONDS` (if still pending then)."""
        self.refresh()
        question = self._pending().get(approval_id)
        if question is None or question[0] != "approval":
            raise _not_pending(approval_id)
        if choice not in question[1]:
            raise BadRequest(f"choice must be one of {', '.join(question[1])}",
                             code="invalid_request")
        if self._logs.claim(self.run_id, approval_id, {"value": choice, "resolved_by": "user"}):
            raise _not_pending(approval_id)       # another answer won (any process)
        self._logs.request(self.run_id, {"op": "approval", "approval_id": approval_id,
                                         "choice": choice})
        return choice

    def answer_clarify(self, clarify_id: str, answer: str | None,
                       resolved_by: str = "user") -> None:
        """As :meth:`Run.answer_clarify`, through the owner (see :meth:`answer`)."""
        self.refresh()
        question = self._pending().get(clarify_id)
        if question is None or question[0] != "clarify":
            raise _not_pending(clarify_id, "clarify")
        if self._logs.claim(self.run_id, clarify_id, {"value": answer, "resolved_by": "user"}):
            raise _not_pending(clarify_id, "clarify")
        self._logs.request(self.run_id, {"op": "clarify", "clarify_id": clarify_id,
                                         "answer": answer})

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

    def __init__(self, manager: RunManager, interval: float = POLL_SECONDS):
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


class RunManager:
    """Starts runs in worker threads and keeps them for replay.

    ``execute(run)`` is the work of one run (supplied by the caller); it must
    emit the terminal event or raise a :class:`ServiceError` (turned into
    ``run.failed`` with the error's core ``code``; a blueprint maps core codes to its
    contract's codes when it sends events out).

    With ``logs`` (:class:`~hermes_service.mnote.run_log.RunLogs`, the service's) every run's events
    are also written to the data dir as they happen, so :meth:`get` finds runs of every
    process on it (:class:`ForeignRun`), a session is busy across processes, an abort or an
    answer reaches the owning process (:class:`LogPoller`), and runs of dead processes are
    closed with ``run.failed`` ``run_interrupted`` (docs/data-and-durability.md §Runs and
    their events). Without it (unit tests) runs live in memory only.
    """

    def __init__(self, retention_seconds: float, max_active: int, max_streams: int = 12,
                 logs: RunLogs | None = None, owner: str | None = None):
        self.retention = retention_seconds
        #: the owner id written in this process's run files (:func:`instance.current`;
        #: tests name another live process)
        self.owner = owner or instance.current()
        self.streams = Limiter(max_streams)   # open event streams (threads); resizable on reload
        self.watch = ClientWatch()
        self.max_active = max_active
        self.logs = logs
        self.poller = LogPoller(self)
        #: called with the run when an abort reaches it from another process
        self.on_abort: list[Callable[[Run], None]] = []
        self._runs: dict[str, Run] = {}
        self._by_session: dict[str, str] = {}
        self._lock = threading.Lock()

    def configure(self, retention_seconds: float, max_active: int, max_streams: int) -> None:
        """Take reloaded limits (docs/configuring.md §Reload): how long finished runs are kept, how
        many may be queued or running, how many event streams may be open (open ones stay)."""
        self.retention = retention_seconds
        self.max_active = max_active
        self.streams.resize(max_streams)

    def _sweep(self) -> None:
        cutoff = time.time() - self.retention
        for run_id, run in list(self._runs.items()):
            if run.finished and run.finished < cutoff:
                del self._runs[run_id]
        for key, run_id in list(self._by_session.items()):
            if run_id not in self._runs:
                del self._by_session[key]

    def sweep(self) -> int:
        """Forget finished runs older than ``events_retention_seconds`` (also done on every
        access; the service's retention job calls this periodically). Returns how many.
        Their files go with :meth:`sweep_files`."""
        with self._lock:
            before = len(self._runs)
            self._sweep()
            return before - len(self._runs)

    def sweep_files(self, dry_run: bool = False) -> int:
        """Delete the run files of runs that ended more than ``events_retention_seconds``
        ago, and close runs of dead processes (:meth:`RunLogs.sweep`); the retention pass and
        ``main.py gc``. Returns how many files were (would be) deleted."""
        return self.logs.sweep(self.retention, dry_run=dry_run) if self.logs else 0

    def close_dead(self) -> int:
        """Close every run of a dead process on the data dir (at start). Returns how many."""
        return self.logs.close_dead() if self.logs else 0

    def start(self, session_key: str, session_id: str, actor_id: str, trace_id: str,
              execute: Callable[[Run], None]) -> Run:
        """Start a run on a session (``session_key``: its store key; ``session_id``: the id the
        client knows, used in events). Raises Conflict ``session_busy`` if the session has an
        active run, in this or any other process on the data dir (``extra`` ``{"runId"}``:
        that run, for the caller to attach to), TooManyRuns if ``max_active`` runs are
        already queued or running here."""
        with self._lock:
            self._sweep()
            current = self._runs.get(self._by_session.get(session_key, ""))
            if current is not None and not current.done:
                raise Conflict(f"session {session_id} already has an active run ({current.run_id})",
                               code="session_busy", extra={"runId": current.run_id})
            if sum(1 for r in self._runs.values() if not r.done) >= self.max_active:
                raise TooManyRuns("too many runs in progress; retry later",
                                  headers={"Retry-After": "5"})
            run = Run("run_" + secrets.token_hex(12), session_id, actor_id, trace_id)
            if self.logs is not None:
                run.claims = self.logs
                run.writer = self.logs.create({
                    "run_id": run.run_id, "session_id": session_id, "session_key": session_key,
                    "actor_id": actor_id, "trace_id": trace_id, "owner": self.owner,
                    "created": time.time()})
                try:
                    other = self.logs.claim_session(
                        session_key, run.run_id, self.owner,
                        lambda rid: rid in self._runs and not self._runs[rid].done)
                except BaseException:      # a full disk: no run, no file left behind
                    run.writer.close()
                    self.logs.path(run.run_id).unlink(missing_ok=True)
                    raise
                if other is not None:
                    run.writer.close()
                    self.logs.path(run.run_id).unlink(missing_ok=True)
                    raise Conflict(f"session {session_id} already has an active run ({other})",
                                   code="session_busy", extra={"runId": other})
            self._runs[run.run_id] = run
            self._by_session[session_key] = run.run_id
        if self.logs is not None:
            self.poller.kick()
        logs.bind(run_id=run.run_id, trace_id=trace_id)    # this request's access line
        threading.Thread(target=self._work, args=(run, execute, logs.current()), name=run.run_id,
                         daemon=True).start()
        return run

    def active(self) -> int:
        """Runs queued or running now (the ``runs_active`` gauge)."""
        with self._lock:
            return sum(1 for r in self._runs.values() if not r.done)

    def owned_active(self) -> list[Run]:
        """This process's runs that have not ended."""
        with self._lock:
            return [r for r in self._runs.values() if not r.done]

    def active_ids(self) -> list[str]:
        """The ids of the runs queued or running now, oldest first."""
        with self._lock:
            return [run_id for run_id, r in self._runs.items() if not r.done]

    def peek(self, run_id: str) -> Run | ForeignRun | None:
        """The run of ``run_id`` (any actor; for the service's own log lines) — from its log
        once it ended (:meth:`_forget_logged`) —, or None."""
        with self._lock:
            run = self._runs.get(run_id)
        if run is None and self.logs is not None:
            run = self._foreign(run_id)
        return run

    def _work(self, run: Run, execute, log_context: dict) -> None:
        logs.start(**log_context)     # the worker logs with its request's ids (and the run's)
        try:
            execute(run)
        except ServiceError as err:
            with run._cond:      # atomic with abort(): no run.failed after abort.started
                if run.cancel.is_set():
                    run.emit("run.cancelled")
                elif run.overflow:
                    run.fail_overflow()
                else:
                    run.emit("run.failed", code=err.code, error=err.detail)
        except Exception as exc:   # never leave a run "running"
            if storage_full(exc):       # a full disk is expected: its own code
                log.error("run %s: a write failed for want of space: %s", run.run_id, exc)
                err = StorageFull("the service's disk is full")
                run.emit("run.failed", code=err.code, error=err.detail)
            else:
                log.exception("run %s crashed", run.run_id)
                run.emit("run.failed", code=ServiceError.code, error="internal error")
        finally:
            if not run.done:
                run.emit("run.failed", code=ServiceError.code,
                         error="the run ended without a result")
            run.process = None
            self._forget_logged(run)

    def _forget_logged(self, run: Run) -> None:
        """A finished run whose whole log is on disk is served from it from now on (as any
        process serves it: :class:`ForeignRun`), so its events leave this process's memory:
        finished runs cost no memory during their retention. Streams already following it
        keep the object until they end."""
        if self.logs is None or run.writer is None or not run.done:
            return
        with self._lock:
            if self._runs.get(run.run_id) is run:
                del self._runs[run.run_id]
    def get(self, run_id: str, actor_id: str) -> Run | ForeignRun:
        """The run if it exists and belongs to ``actor_id``; otherwise NotFound (no detail
        leaked). A run of another process comes from its log (:class:`ForeignRun`); if its
        owner is dead and it has not ended, it is closed here first (``run_interrupted``)."""
        with self._lock:
            self._sweep()
            run = self._runs.get(run_id)
        if run is None and self.logs is not None:
            run = self._foreign(run_id)
        if run is None or run.actor_id != actor_id:
            raise NotFound(f"run {run_id} not found", code="run_not_found")
        return run

    def _foreign(self, run_id: str) -> ForeignRun | None:
        state = self.logs.load(run_id)        # None for an id that is not a run id
        if state is None or state.meta.get("run_id") != run_id:
            return None
        run = ForeignRun(self, state)
        run.close_if_orphaned()
        if run.done and state.mtime < time.time() - self.retention:
            return None                       # past retention: as if swept
        return run

    def abort(self, run: Run | ForeignRun) -> list[dict]:
        """Ask a run to stop; returns the events to report (``abort.started``, or the final
        event of a run that already ended). The worker kills the process group and emits
        ``run.cancelled``. A run of another live process gets the abort as a request line
        (its poller applies it within ~:data:`POLL_SECONDS`)."""
        if run.foreign:
            run.close_if_orphaned()
            run.refresh()
            if run.done:
                return [run.events[-1]]
            self.logs.request(run.run_id, {"op": "abort"})
            return [{"event": "abort.started", "run_id": run.run_id}]
        with run._cond:
            if run.done:
                return [run.events[-1]]
            if not run.cancel.is_set():
                run.cancel.set()
                run.emit("abort.started")
        run.resolve_all("abort")       # a question pending: denied, resolved_by "abort"
        proc = run.process
        if proc is not None:
            threading.Thread(target=proc.kill, args=("cancelled",), daemon=True).start()
        return [{"event": "abort.started", "run_id": run.run_id}]

    def poll_requests(self) -> None:
        """Apply the requests other processes appended for this process's active runs."""
        if self.logs is None:
            return
        for run in self.owned_active():
            if self.logs.requests_size(run.run_id) <= run.requests_offset:
                continue
            ops, run.requests_offset = self.logs.requests_since(run.run_id, run.requests_offset)
            for op in ops:
                self.apply_request(run, op)

    def apply_request(self, run: Run, op: dict) -> None:
        """One request from another process: ``abort``, ``approval`` or ``clarify`` (one whose
        question is no longer pending is dropped)."""
        kind = op.get("op")
        try:
            if kind == "abort":
                self.abort(run)
                for hook in self.on_abort:
                    hook(run)
            elif kind == "approval":   # claimed by the process that took the answer
                run.answer(str(op.get("approval_id")), str(op.get("choice")), "user",
                           claimed=True)
            elif kind == "clarify":
                answer = op.get("answer")
                run.answer_clarify(str(op.get("clarify_id")),
                                   answer if isinstance(answer, str) else None, "user",
                                   claimed=True)
        except ServiceError as err:
            log.info("run %s: dropped a %s request from another process: %s", run.run_id,
                     kind, err.detail)

    def stream_slot(self) -> Callable[[], None]:
        """Take one event-stream slot; returns its release function (safe to call twice).
        Raises TooManyRuns ``too_many_streams`` when all are taken."""
        if not self.streams.acquire(blocking=False):
            raise TooManyRuns("too many open event streams; retry later", code="too_many_streams",
                              headers={"Retry-After": "5"})
        released = threading.Event()
        metrics.stream_opened()

        def release() -> None:
            if not released.is_set():
                released.set()
                self.streams.release()
                metrics.stream_closed()
        return release

    def subscribe(self, run: Run, client_gone: Callable[[], bool] | None = None) -> Subscription:
        """Open an event stream on ``run``: takes a slot (TooManyRuns ``too_many_streams`` when
        ``mnote.max_event_streams`` are open) until :meth:`Subscription.close`.

        ``client_gone``: a check whether the client has disconnected (waitress's
        ``waitress.client_disconnected``); when given, the stream ends within
        :data:`DISCONNECT_CHECK_SECONDS` of the client going away."""
        sub = Subscription(run, self.stream_slot(), client_gone, self.watch)
        if client_gone is not None:
            self.watch.add(sub)
        return sub


class Subscription:
    """One open event stream of a run (:meth:`RunManager.subscribe`): its slot, the Event its
    thread sleeps on, and whether its client went away (:attr:`gone`, set by
    :class:`ClientWatch`)."""

    def __init__(self, run: Run, release: Callable[[], None],
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
