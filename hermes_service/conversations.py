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

import threading
import time
import uuid
from contextlib import contextmanager

from filelock import FileLock, Timeout

from . import metrics
from .config import Config
from .errors import BadRequest, Conflict, NotFound, ServiceError, TooLarge, check_id
from .hermes_state import find_started_session
from .runner import ChatResult, HermesRunner
from .session_store import SessionStore, now_iso
from .user_homes import UserHomes


class Conversations:
    """Create, list, delete sessions and run turns on them."""

    def __init__(self, config: Config, store: SessionStore, homes: UserHomes, runner: HermesRunner):
        self.store = store
        self.homes = homes
        self.runner = runner
        self.max_message_bytes = config["hermes"]["max_message_bytes"]
        # a request waits for a busy session no longer than for a CLI slot
        self.turn_wait = float(config["hermes"]["queue_wait_seconds"])
        self.locks_dir = config.data_dir / "locks"
        self._local_locks: dict[str, threading.Lock] = {}
        self._guard = threading.Lock()

    # -- sessions --------------------------------------------------------
    def create(self, user_id: str, session_id: str | None = None, **fields) -> dict:
        """Create a session (and the user's home on first use). Returns the record.

        Raises BadRequest (bad id), Conflict (``session_exists``), Unconfigured.
        """
        check_id(user_id, "user_id")
        session_id = check_id(session_id, "session_id") if session_id else str(uuid.uuid4())
        self.homes.ensure(user_id)
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
        another ``kind`` (``v1`` sessions of the v1 API, ``mnote`` sessions of the client proxy)."""
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
        return self.store.list(lambda r: (user_id is None or r.get("user_id") == user_id)
                               and all(r.get(k) == v for k, v in match.items()))

    def delete(self, session_id: str, owner: str | None = None, kind: str | None = None) -> dict:
        """Forget a session (the Hermes transcript stays in the user's state.db)."""
        rec = self.get(session_id, owner, kind)
        with self.turn_lock(session_id, wait=self.turn_wait):
            self.store.delete(session_id)
        return rec

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

    def send(self, session_id: str, message: str, owner: str | None = None, *, prompt: str | None = None,
             extra_env: dict | None = None, on_spawn=None, cancel=None, wait: float | None = None,
             model: str | None = None, toolsets: list[str] | None = None,
             record: dict | None = None, kind: str | None = None) -> tuple[dict, ChatResult]:
        """Run one turn: ``prompt`` (default ``message``) goes to Hermes.

        ``extra_env`` is added to this run's CLI environment only; ``model`` is passed as
        ``-m``; ``toolsets`` are offered in addition to ``hermes.toolsets``; ``record`` fields
        are stored on the session after a successful turn.

        Returns (updated record, result). Raises NotFound, TooLarge, Conflict
        (``session_busy``), TooManyRuns, Unconfigured or a RunError.
        """
        self.check_message(message)
        self.get(session_id, owner, kind)
        with self.turn_lock(session_id, self.turn_wait if wait is None else wait):
            rec = self.get(session_id, owner, kind)   # re-read: a turn may have just finished
            home = self.homes.ensure(rec["user_id"])
            env = self.homes.cli_env(home, self.runner.command_path(), extra_env)
            started = time.time() - 1.0
            text = prompt if prompt is not None else message
            clock = metrics.TurnClock("cli", kind)
            try:
                result = self.runner.run_chat(
                    text, rec.get("hermes_session_id"), env,
                    str(home.root), on_spawn=clock.on_spawn(on_spawn), cancel=cancel,
                    log_ctx={"user": rec["user_id"], "session": session_id, "family": kind},
                    model=model, toolsets=toolsets)
            except ServiceError as err:
                clock.finished(err.code)
                # an aborted or failed turn may still have been saved by Hermes: keep its id so
                # the next turn continues that conversation
                saved = getattr(err, "hermes_session_id", None)
                if not saved and not rec.get("hermes_session_id"):
                    # killed before it printed its id (abort, timeout): look in state.db
                    saved = find_started_session(home.hermes_home, started, text)
                if saved and saved != rec.get("hermes_session_id"):
                    self.store.update(session_id, hermes_session_id=saved)
                raise
            clock.finished("ok")
            updated = self.store.update(
                session_id, hermes_session_id=result.hermes_session_id or rec.get("hermes_session_id"),
                message_count=rec.get("message_count", 0) + 1, last_run_at=now_iso(),
                **(record or {}))
        if updated is None:
            raise NotFound(f"session {session_id} was deleted during the turn",
                           code="session_not_found")
        return updated, result
