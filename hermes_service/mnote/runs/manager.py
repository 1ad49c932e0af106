"""Background runs of the client routes (client-proxy contract §2 POST /runs, GET /events;
docs/mnote-client.md): :class:`RunManager` starts each in a worker thread, keeps it for
replay, finds the runs of other processes on the data dir, aborts, and opens event streams.

A run is :class:`~.run.Run` (its event log and questions: :mod:`.run`,
:mod:`.run_questions`); a run of another process is :class:`~.foreign_run.ForeignRun`;
an open stream is :class:`~.streams.Subscription`.
"""
from __future__ import annotations

import logging
import secrets
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from ... import instance, logs
from ...errors import Conflict, NotFound, ServiceError, StorageFull, TooManyRuns, storage_full
from ...limits import Limiter, share
from .. import metrics
from .foreign import ForeignRun, LogPoller
from .log import LogState, RunLogs, valid_run_id
from .run import Run
from .streams import ClientWatch, Subscription

if TYPE_CHECKING:       # storage.url only (psycopg)
    from ...storage.runs import RunArchive

log = logging.getLogger("hermes_service.runs")

class RunManager:
    """Starts runs in worker threads and keeps them for replay.

    ``execute(run)`` is the work of one run (supplied by the caller); it must
    emit the terminal event or raise a :class:`ServiceError` (turned into
    ``run.failed`` with the error's core ``code``; a blueprint maps core codes to its
    contract's codes when it sends events out).

    With ``logs`` (:class:`~hermes_service.mnote.runs.log.RunLogs`, the service's) every
    run's events are also written to the data dir as they happen, so :meth:`get` finds runs of every
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
        self._streams_of: dict[str, int] = {}     # actor id -> its open event streams
        #: ``mnote.max_streams_per_actor`` (None: :func:`~hermes_service.limits.share`)
        self.streams_per_actor: int | None = None
        #: finished runs in the shared storage of several nodes
        #: (:class:`~hermes_service.storage.runs.RunArchive`), or None (a single node)
        self.archive: RunArchive | None = None

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
        n = self.logs.sweep(self.retention, dry_run=dry_run) if self.logs else 0
        if self.archive is not None and not dry_run:    # and their rows in the shared storage
            n += self.archive.prune(self.retention)
        return n

    def close_dead(self) -> int:
        """Close every run of a dead process on the data dir (at start). Returns how many."""
        return self.logs.close_dead() if self.logs else 0

    def start(self, session_key: str, session_id: str, actor_id: str, trace_id: str,
              execute: Callable[[Run], None]) -> Run:
        """Start a run on a session (``session_key``: its store key; ``session_id``: the id the
        client knows, used in events). Raises Conflict ``session_busy`` if the session has an
        active run, in this or any other process on the data dir (``extra`` ``{"runId"}``:
        that run, for the caller to attach to), TooManyRuns if ``max_active`` runs are
        already queued or running here, or ``actor_id`` already has its share of them
        (:func:`hermes_service.limits.share`)."""
        with self._lock:
            self._sweep()
            current = self._runs.get(self._by_session.get(session_key, ""))
            if current is not None and not current.done:
                raise Conflict(f"session {session_id} already has an active run ({current.run_id})",
                               code="session_busy", extra={"runId": current.run_id})
            if sum(1 for r in self._runs.values() if not r.done) >= self.max_active:
                raise TooManyRuns("too many runs in progress; retry later",
                                  headers={"Retry-After": "5"})
            mine = sum(1 for r in self._runs.values() if not r.done and r.actor_id == actor_id)
            if mine >= share(self.max_active):
                raise TooManyRuns(f"this actor has {mine} runs in progress, its share of "
                                  f"{self.max_active}; retry when one has ended",
                                  headers={"Retry-After": "5"})
            run = Run("run_" + secrets.token_hex(12), session_id, actor_id, trace_id)
            meta = {"run_id": run.run_id, "session_id": session_id, "session_key": session_key,
                    "actor_id": actor_id, "trace_id": trace_id, "owner": self.owner,
                    "created": time.time()}
            if self.archive is not None:
                run.archive = self._archiver(meta)
            if self.logs is not None:
                run.claims = self.logs
                run.writer = self.logs.create(meta)
                try:
                    other = self.logs.claim_session(
                        session_key, run.run_id, self.owner,
                        lambda rid: rid in self._runs and not self._runs[rid].done)
                except BaseException:      # a full disk: no run, no file left behind
                    self._discard_file(run)
                    raise
                if other is not None:
                    self._discard_file(run)
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

    def _archiver(self, meta: dict) -> Callable[[Run, dict], None]:
        """The run's ``archive`` hook: its meta record and events into the shared storage
        when it ends. A failure (the database unreachable) is logged: the run stays
        replayable on this node from its file, and the turn it ran was committed already."""
        archive = self.archive
        assert archive is not None

        def store(run: Run, terminal: dict) -> None:
            try:
                archive.save(run.actor_id, run.run_id, meta, [*run.events, terminal])
            except ServiceError as err:
                log.warning("run %s: not stored in the shared storage (%s): it replays on "
                            "this node only", run.run_id, err.code)
        return store

    def _discard_file(self, run: Run) -> None:
        """Close and remove the log of a run that did not start."""
        if run.writer is not None:
            run.writer.close()
        path = self.logs.path(run.run_id) if self.logs is not None else None
        if path is not None:
            path.unlink(missing_ok=True)

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
            run: Run | ForeignRun | None = self._runs.get(run_id)
        if run is None and self.logs is not None:
            run = self._foreign(run_id)
        return run

    def _work(self, run: Run, execute, log_context: dict) -> None:
        logs.start(**log_context)     # the worker logs with its request's ids (and the run's)
        try:
            execute(run)
        except ServiceError as err:
            with run.lock:      # atomic with abort(): no run.failed after abort.started
                if run.cancel.is_set():
                    run.emit("run.cancelled")
                elif run.overflow:
                    run.fail_overflow()
                else:
                    run.emit("run.failed", code=err.code, error=err.detail)
        except Exception as exc:   # never leave a run "running"
            if storage_full(exc):       # a full disk is expected: its own code
                log.error("run %s: a write failed for want of space: %s", run.run_id, exc)
                full = StorageFull("the service's disk is full")
                run.emit("run.failed", code=full.code, error=full.detail)
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
            run: Run | ForeignRun | None = self._runs.get(run_id)
        if run is None and self.logs is not None:
            run = self._foreign(run_id)
        if run is None or run.actor_id != actor_id:
            raise NotFound(f"run {run_id} not found", code="run_not_found")
        return run

    def _foreign(self, run_id: str) -> ForeignRun | None:
        if self.logs is None:
            return None
        state = self.logs.load(run_id)        # None for an id that is not a run id
        if state is None and self.archive is not None and valid_run_id(run_id):
            found = self.archive.load(run_id)  # a run another node ran and finished
            if found is not None:
                meta, events, ended = found
                state = LogState(run_id, meta, events, mtime=ended)
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
        if isinstance(run, ForeignRun):
            run.close_if_orphaned()
            run.refresh()
            if run.done:
                return [run.events[-1]]
            run.request({"op": "abort"})
            return [{"event": "abort.started", "run_id": run.run_id}]
        with run.lock:
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

    def stream_slot(self, actor_id: str | None = None) -> Callable[[], None]:
        """Take one event-stream slot; returns its release function (safe to call twice).
        Raises TooManyRuns ``too_many_streams`` when all are taken, or when ``actor_id``
        holds its share of them (``mnote.max_streams_per_actor``, else
        :func:`hermes_service.limits.share` of ``mnote.max_event_streams``)."""
        key = actor_id or ""
        with self._lock:
            mine = self._streams_of.get(key, 0)
            cap = self.streams_per_actor or share(self.streams.size)
            if mine >= cap:
                raise TooManyRuns(f"this actor has {mine} event streams open, its share of "
                                  f"{self.streams.size}; close one or retry later",
                                  code="too_many_streams", headers={"Retry-After": "5"})
            if not self.streams.acquire(blocking=False):
                raise TooManyRuns("too many open event streams; retry later",
                                  code="too_many_streams", headers={"Retry-After": "5"})
            self._streams_of[key] = mine + 1
        released = threading.Event()
        metrics.stream_opened()

        def release() -> None:
            with self._lock:
                if released.is_set():
                    return
                released.set()
                left = self._streams_of.get(key, 1) - 1
                if left > 0:
                    self._streams_of[key] = left
                else:
                    self._streams_of.pop(key, None)
            self.streams.release()
            metrics.stream_closed()
        return release

    def subscribe(self, run: Run | ForeignRun,
                  client_gone: Callable[[], bool] | None = None) -> Subscription:
        """Open an event stream on ``run``: takes a slot (TooManyRuns ``too_many_streams`` when
        ``mnote.max_event_streams`` are open) until :meth:`Subscription.close`.

        ``client_gone``: a check whether the client has disconnected (waitress's
        ``waitress.client_disconnected``); when given, the stream ends within
        :data:`DISCONNECT_CHECK_SECONDS` of the client going away."""
        sub = Subscription(run, self.stream_slot(run.actor_id), client_gone, self.watch)
        if client_gone is not None:
            self.watch.add(sub)
        return sub
