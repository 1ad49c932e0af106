"""Sessions and turns: the service object both blueprints call.

A session record (in ``sessions.json``) maps our ``session_id`` to its
owner (``user_id``) and to the Hermes session that continues it
(``hermes_session_id``, replaced by the newest id after every turn, since
Hermes may change it after context compression).

Turns on one session are serialized by a lock that holds across threads and
processes (``data/locks/session-<id>.lock``); a turn that cannot get it
within ``hermes.queue_wait_seconds`` fails with 409 ``session_busy``.
"""
from __future__ import annotations

import builtins
import logging
import threading
import uuid
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from filelock import FileLock, Timeout

from . import metrics
from .config import Config, HermesSettings
from .errors import BadRequest, Conflict, NotFound, ServiceError, TooLarge, check_id
from .homes import hermes_state
from .homes.users import UserHome, UserHomes
from .runner import Processes, Questions, RunnerChoice, TurnListener, TurnRequest, TurnResult
from .session_store import SessionStore, now_iso

if TYPE_CHECKING:       # storage.url only (psycopg)
    from .storage.node import SharedNode
    from .storage.sessions import PgSessionStore

log = logging.getLogger("hermes_service.conversations")


class _Timed:
    """A turn listener that marks the turn's start on its metrics clock, then passes every
    event on to the caller's listener (if any)."""

    def __init__(self, listener: TurnListener | None, clock: metrics.TurnClock):
        self._listener, self._clock = listener, clock

    def started(self, handle) -> None:
        self._clock.started()
        if self._listener is not None:
            self._listener.started(handle)

    def __getattr__(self, name):          # delta, reasoning, tool
        if self._listener is None:
            return lambda *a, **kw: None
        return getattr(self._listener, name)


@dataclass
class SendRequest:
    """One turn a caller asks of a session (:meth:`Conversations.send`).

    ``kind`` (the route family: ``v1`` or an extension's) must match the session's; ``wait``:
    seconds to wait for the session's turn lock (``None``: ``hermes.queue_wait_seconds``);
    ``model`` is the provider model (``-m``); ``toolsets`` are offered in addition to
    ``hermes.toolsets``; ``plugin_run`` is the run binding of the family's Hermes plugin
    (docs/mnote-tools.md §Run binding); ``listener`` receives live events; ``record`` fields
    are stored on the session when the turn starts; ``approvals`` answers Hermes's questions on
    the ACP runner (``TurnRequest.approvals``); ``log_ctx``: fields the caller adds to the
    turn's log lines (e.g. its run id)."""

    session_id: str
    message: str
    owner: str | None = None
    kind: str | None = None
    wait: float | None = None
    model: str | None = None
    toolsets: builtins.list[str] = field(default_factory=list)
    plugin_run: dict | None = None
    listener: TurnListener | None = None
    cancel: threading.Event | None = None
    record: dict | None = None
    approvals: Questions | None = None
    log_ctx: dict | None = None


class Conversations:
    """Create, list, delete sessions and run turns on them."""

    def __init__(self, config: Config, store: SessionStore | PgSessionStore, homes: UserHomes,
                 processes: Processes, runners: RunnerChoice, shared: SharedNode | None = None):
        self.store = store
        #: the shared storage of several nodes (:class:`~hermes_service.storage.node.SharedNode`)
        #: or None (a single node): then a turn holds the user's lease and ends by committing
        #: the home's snapshot with the record, before it is acknowledged
        self.shared = shared
        self.homes = homes
        self.processes = processes      # the Hermes command, process groups, toolsets
        self.runners = runners          # which runner takes a turn (runner.choice)
        self.locks_dir = config.data_dir / "locks"
        self._local_locks: dict[str, threading.Lock] = {}
        self._guard = threading.Lock()
        self.configure(config.hermes)

    def configure(self, hermes: HermesSettings) -> None:
        """Take a (reloaded) ``hermes`` section for new turns: the message size limit and how
        long a turn waits for a busy session (no longer than for a CLI slot)."""
        self.max_message_bytes = hermes.max_message_bytes
        self.turn_wait = float(hermes.queue_wait_seconds)

    # -- sessions --------------------------------------------------------
    def create(self, user_id: str, session_id: str | None = None, **fields) -> dict:
        """Create a session. Returns the record. The user's home is made at its first turn
        (:meth:`send`), not here: a session costs a registry entry, not a home
        (docs/data-and-durability.md §What an API client can make the service keep).

        Raises BadRequest (bad id), Conflict (``session_exists``).
        """
        check_id(user_id, "user_id")
        session_id = check_id(session_id, "session_id") if session_id else str(uuid.uuid4())
        now = now_iso()
        record = {"session_id": session_id, "user_id": user_id, "hermes_session_id": None,
                  "created_at": now, "updated_at": now, "status": "active", "message_count": 0,
                  **fields}
        try:
            return self.store.create(record)
        except KeyError:
            raise Conflict(f"session {session_id} already exists", code="session_exists") from None

    def get(self, session_id: str, owner: str | None = None, kind: str | None = None) -> dict:
        """The record; NotFound (``session_not_found``) if absent, owned by someone else, or of
        another ``kind`` (``v1`` sessions of the v1 API; an extension's family names its own)."""
        check_id(session_id, "session_id")
        rec = self.store.get(session_id)
        if rec is None or (owner is not None and rec.get("user_id") != owner) \
                or (kind is not None and rec.get("kind") != kind):
            raise NotFound(f"session {session_id} not found", code="session_not_found")
        return rec

    def list(self, user_id: str | None = None, **match) -> list[dict]:
        """Records of one user (or all), filtered by equal fields, oldest first."""
        if user_id is not None:
            check_id(user_id, "user_id")
        return self.store.list(user_id, lambda r: all(r.get(k) == v for k, v in match.items()))

    def delete(self, session_id: str, owner: str | None = None, kind: str | None = None) -> dict:
        """Forget a session (the Hermes transcript stays in the user's state.db)."""
        rec = self.get(session_id, owner, kind)
        with self.turn_lock(session_id, wait=self.turn_wait):
            self.store.delete(session_id)
        return rec

    def prune_idle_locks(self) -> int:
        """Drop entries of the in-memory turn-lock table that no turn holds (retention,
        docs/data-and-durability.md §Retention and cleanup); returns how many. A thread that fetched
        an entry just before it was dropped still serializes with later turns through the session's
        file lock."""
        with self._guard:
            idle = [sid for sid, lock in self._local_locks.items() if not lock.locked()]
            for sid in idle:
                del self._local_locks[sid]
        return len(idle)

    # -- turns -----------------------------------------------------------
    def check_message(self, message: str) -> None:
        """Raise BadRequest (NUL: a CLI argument cannot carry it) or TooLarge (413
        ``message_too_large``) over ``hermes.max_message_bytes``."""
        if "\x00" in message:
            raise BadRequest("message must not contain NUL characters", code="invalid_request")
        if len(message.encode("utf-8", "surrogatepass")) > self.max_message_bytes:
            raise TooLarge(f"message exceeds {self.max_message_bytes} bytes",
                           code="message_too_large")

    @contextmanager
    def turn_lock(self, session_id: str, wait: float):
        """Hold the session's turn lock; Conflict (``session_busy``) after ``wait`` seconds."""
        with self._guard:
            local = self._local_locks.setdefault(session_id, threading.Lock())
        if not (local.acquire(timeout=wait) if wait > 0 else local.acquire(blocking=False)):
            raise Conflict("another turn is in progress on this session", code="session_busy")
        try:
            try:
                flock = FileLock(str(self.locks_dir / f"session-{session_id}.lock"), timeout=wait)
                flock.acquire()
            except Timeout:
                raise Conflict("another turn is in progress on this session",
                               code="session_busy") from None
            try:
                yield
            finally:
                flock.release()
        finally:
            local.release()

    def send(self, ask: SendRequest) -> tuple[dict, TurnResult]:
        """Run the turn ``ask`` describes on its session (docs/runners.md).

        A turn that ends without an answer is taken back from Hermes's record
        (:func:`~hermes_service.homes.hermes_state.rewind_unanswered`), so a retried message
        reaches the model once; a Hermes session that keeps messages of a failed or aborted
        first turn is still mapped to this session (found exactly, by the turn marker).

        Returns (updated record, result). Raises NotFound, TooLarge, Conflict
        (``session_busy``), TooManyRuns, Unconfigured or a RunError.
        """
        session_id, message, owner, kind = ask.session_id, ask.message, ask.owner, ask.kind
        record, wait = ask.record, ask.wait
        self.check_message(message)
        user_id = self.get(session_id, owner, kind)["user_id"]
        with self._holding(user_id) as lease, \
                self.turn_lock(session_id, self.turn_wait if wait is None else wait):
            rec = self.get(session_id, owner, kind)   # re-read: a turn may have just finished
            if record and any(rec.get(k) != v for k, v in record.items()):
                # a durable write (fsync): only when a field changes, not on every turn
                rec = self.store.update(session_id, **record) or rec
            home = self.homes.ensure(rec["user_id"])
            family = rec.get("kind") or "v1"
            clock = metrics.TurnClock(self.runners.cli.name, family)
            req = TurnRequest(message, rec.get("hermes_session_id"), home,
                              self.homes.cli_env(home, self.processes.command_path()),
                              model=ask.model, toolsets=list(ask.toolsets), family=family,
                              plugin_run=ask.plugin_run, listener=_Timed(ask.listener, clock),
                              cancel=ask.cancel, approvals=ask.approvals,
                              log_ctx={"user": rec["user_id"], "session": session_id,
                                       "family": family, **(ask.log_ctx or {})})
            if hermes_state.rewind_orphan(home.hermes_home, req.resume_id,
                                          reap=self._reap_orphans):
                log.warning("took back the unanswered last turn of session %s: the service "
                            "died during it", session_id)
            try:
                result = self.runners.run_turn(req, clock)
            except ServiceError as err:
                clock.finished(err.code)
                if self.shared is not None:    # killed because the user went elsewhere?
                    self.shared.check_held(lease, err)
                self._after_failure(session_id, rec, home, err, message)
                raise
            fields = {"hermes_session_id": result.hermes_session_id
                      or rec.get("hermes_session_id"),
                      "message_count": rec.get("message_count", 0) + 1,
                      "last_run_at": now_iso()}
            if self.shared is None:
                updated = self.store.update(session_id, **fields)
            else:                      # acknowledged only once home + record are committed
                try:
                    updated = self.shared.commit_turn(lease, session_id, **fields)
                except ServiceError as err:
                    clock.finished(err.code)
                    # not acknowledged: the home goes back to the last committed snapshot
                    # (restored at the user's next request, here or on another node)
                    self.shared.abandon(rec["user_id"])
                    raise
            clock.finished("ok")
        if updated is None:
            raise NotFound(f"session {session_id} was deleted during the turn",
                           code="session_not_found")
        return updated, result

    def _holding(self, user_id: str):
        """With shared storage: hold ``user_id``'s lease for the turn (taken, and the home
        restored, when this node did not hold it); else nothing."""
        if self.shared is None:
            return nullcontext()
        return self.shared.ownership.using(user_id)

    def _reap_orphans(self) -> None:
        """Kill the Hermes processes of service processes that died (before a dead turn is
        taken back: another service process sharing the data dir did not restart, so its
        orphans may still be running; docs/operations.md §Process lifetime)."""
        reaped = self.processes.groups.reap_orphans()
        if reaped:
            log.warning("killed %d Hermes process group(s) left by a service that died", reaped)

    def prewarm(self, user_id: str, family: str,
                toolsets: builtins.list[str] | None = None) -> None:
        """Start the user's warm Hermes process for ``family`` in the background, when the
        ACP runner is configured (the panel created a session: a run is likely to follow)."""
        acp = self.runners.warm(family)
        if acp is None:
            return
        home = self.homes.ensure(user_id)
        acp.prewarm(home, self.homes.cli_env(home, self.processes.command_path()), family,
                    list(toolsets or []))

    def _after_failure(self, session_id: str, rec: dict, home: UserHome, err: ServiceError,
                       message: str) -> None:
        saved = getattr(err, "hermes_session_id", None)
        if not saved:
            return
        hermes_state.rewind_unanswered(home.hermes_home, saved, message)
        if saved != rec.get("hermes_session_id") \
                and hermes_state.has_messages(home.hermes_home, saved):
            # an aborted/failed turn Hermes kept (e.g. tool calls already made): the next
            # turn continues that conversation
            self.store.update(session_id, hermes_session_id=saved)
