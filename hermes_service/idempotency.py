"""Idempotent retries: the ``Idempotency-Key`` request header (docs/v1-api.md §Idempotent retries).

A client that may have lost an answer (a cut connection, a restart, a timeout) sends the
request again with the same ``Idempotency-Key``; it gets the first request's outcome instead
of a second turn. The routes that take the header say so with
:func:`hermes_service.web.helpers.idempotent` (``POST /api/v1/sessions``, ``POST
/api/v1/sessions/{id}/messages``, ``POST /api/hermes/client/sessions``, ``POST
/api/hermes/client/runs``), which applies the rules and the store of this module.

Rules (docs/v1-api.md §Idempotent retries is the manual):

* **The key**: 1-255 visible ASCII characters (``0x21``-``0x7E``, :data:`KEY_PATTERN`); any
  other value of the header — empty, longer, a space, a control or non-ASCII character — is
  400 ``invalid_idempotency_key`` (client routes: ``hermes_client_bad_request``). No header:
  an ordinary request (nothing is recorded).
* **Whose key**: a key belongs to its *scope* — the route family, the API key's identity (its
  SHA-256) and the acting user (v1: the user the request acts for; client routes: the
  actor their header names). The same key from another API key or user is a fresh request.
* **The same request**: the *fingerprint* is a SHA-256 of the method, the route, its path
  parameters, the query, the given ``X-Trace-Id`` (client routes) and the canonical JSON body
  (keys sorted, no insignificant white space), so field order and spacing do not matter. The
  same key with another fingerprint — another body, or another route — is 409
  ``idempotency_key_conflict`` (client: ``hermes_client_idempotency_conflict``).
* **What is replayed**: the first request's status, ``Content-Type`` and body, byte for byte
  (an error body keeps the first request's ``requestId``), with ``Idempotency-Replayed:
  true``; ``X-Request-Id`` is the retry's own. Recorded (:func:`recordable`): what did
  something — every 2xx, and 422 (a turn that ran and was ended by a limit). Not recorded:
  every other 4xx, which refused the request before anything ran (400, 401, 403, 404, 409,
  413 …, and 429, 409 ``session_busy``, which say "later": a retry is checked afresh and,
  while nothing changed, answered the same — so a client cannot make the service keep a
  record of a request that cost nothing), every 5xx (a provider, Hermes, a timeout or a
  stopping service; the failed turn was taken back, so the retry is a fresh attempt) and what
  is refused before the record is claimed (authentication, a bad key, a conflict). An
  unrecorded outcome releases the key: the next request with it runs.
* **How many**: one API key keeps at most ``service.idempotency_max_records_per_key``
  records (default 100 000, over every route and user of that key); a new one past it
  makes the key's oldest finished records go (a retry of one of those runs afresh). Going
  rather than refusing: one API key is usually every user's (mnote-web's server), so
  refusing keyed requests would turn one client's flood into everyone's outage, while the
  records that go are the ones least likely to be retried.
* **The store unusable** (``idempotency.db`` locked by another process beyond the busy
  timeout of 10 s, damaged, unwritable): a keyed request is 503 ``idempotency_unavailable``
  with ``Retry-After`` before anything runs (client: ``hermes_client_idempotency_unavailable``);
  requests without the header are not affected.
* **A retry while the first runs** waits for its outcome (the record is polled; at most
  ``hermes.queue_wait_seconds + hermes.timeout_seconds`` + :data:`WAIT_MARGIN_SECONDS`,
  then 409 ``idempotency_key_in_progress`` with ``Retry-After``). ``POST /runs`` records its
  answer (the ``runId``) as soon as the run is started, so a retry of it gets the same
  ``runId`` at once, while the run goes on.
* **A crash**: a record in progress names its owner (:func:`hermes_service.instance.current`).
  When that process is gone (:func:`hermes_service.instance.alive` False) the retry takes the
  record over and runs the request again: the interrupted turn was taken back by the runners'
  rewind before the next turn (docs/operations.md §Process lifetime), so the conversation holds it
  once.
* **Lifetime**: a finished record expires ``service.idempotency_ttl_seconds`` (default 86400)
  after its outcome; an expired key is a fresh request. Expired records are deleted by the
  retention job and ``main.py gc`` (:meth:`IdempotencyStore.prune`). A record in progress
  whose owner is alive never expires.

Store: SQLite ``<data_dir>/idempotency.db`` (WAL, ``busy_timeout``; shared by every service
process on the data dir). A claim is one ``BEGIN IMMEDIATE`` transaction, so two requests
racing with one key never both run. The outcome is written with ``synchronous=FULL`` before
the response leaves (durable across a power cut).
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import sqlite3
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from flask import Response, g, request

from . import instance
from .errors import BadRequest, Conflict

log = logging.getLogger("hermes_service")

HEADER = "Idempotency-Key"
REPLAYED_HEADER = "Idempotency-Replayed"
MAX_KEY_LENGTH = 255
#: the key rule as a JSON Schema pattern (ECMA-262 and Python alike): visible ASCII only
KEY_PATTERN = "^[!-~]+$"
KEY_SCHEMA = {"type": "string", "minLength": 1, "maxLength": MAX_KEY_LENGTH,
              "pattern": KEY_PATTERN}
_KEY = re.compile(r"[!-~]{1,%d}" % MAX_KEY_LENGTH)
#: added to the turn's own bound when a retry waits for the first request
WAIT_MARGIN_SECONDS = 30.0
#: how often a waiting retry looks at the record (another process may finish it)
POLL_SECONDS = 0.1
DB_NAME = "idempotency.db"

_SCHEMA = """
CREATE TABLE IF NOT EXISTS requests (
    scope TEXT NOT NULL,            -- sha256 of [family, api key digest, user]
    idem_key TEXT NOT NULL,
    fingerprint TEXT NOT NULL,      -- sha256 of method, route, path params, query, body
    state TEXT NOT NULL,            -- 'running' | 'done'
    owner TEXT,                     -- instance.current() of the process running it
    status INTEGER,
    content_type TEXT,
    body BLOB,
    created_at REAL NOT NULL,
    expires_at REAL NOT NULL,       -- unix seconds (a running record: when it was claimed + ttl)
    PRIMARY KEY (scope, idem_key)
);
CREATE INDEX IF NOT EXISTS requests_expires_at ON requests(expires_at);
"""
#: added to a store made by an earlier version (which had no per-API-key count)
_MIGRATE = ("ALTER TABLE requests ADD COLUMN api_key TEXT NOT NULL DEFAULT '-'",
            "CREATE INDEX IF NOT EXISTS requests_api_key ON requests(api_key, created_at)")
#: records one API key keeps (``service.idempotency_max_records_per_key``'s default)
MAX_RECORDS_PER_KEY = 100_000


def check_key(value: str | None) -> str | None:
    """The request's ``Idempotency-Key`` (None when the header is absent). Raises BadRequest
    ``invalid_idempotency_key`` unless it is 1-255 characters of ``0x21``-``0x7E``."""
    if value is None:
        return None
    if not _KEY.fullmatch(value):
        raise BadRequest(f"{HEADER} must be 1-{MAX_KEY_LENGTH} visible ASCII characters "
                         "(0x21-0x7E: no space, control or non-ASCII character)",
                         code="invalid_idempotency_key")
    return value


#: the 4xx recorded: a turn that ran and was ended by a limit (``run_limit_exceeded``)
RECORDED_4XX = frozenset({422})


def recordable(status: int, code: str | None = None) -> bool:
    """Is an outcome replayed to retries? What did something: every 2xx (and 3xx), and the
    4xx of :data:`RECORDED_4XX`. Every other 4xx refused the request before anything ran
    (a retry is checked afresh), and a 5xx is a failure the retry may overcome. ``code``
    (the error's) is accepted for callers; the status decides."""
    return status < 400 or status in RECORDED_4XX


def fingerprint(body: bytes, extra: tuple = ()) -> str:
    """SHA-256 of the request: method, route, path parameters, query, ``extra`` and the
    canonical JSON body (the raw bytes when the body is not JSON)."""
    try:
        parsed = json.loads(body.decode("utf-8")) if body else None
        canon = json.dumps(parsed, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    except (ValueError, UnicodeError, RecursionError):
        canon = "raw:" + body.hex()
    query = sorted(request.args.items(multi=True))
    parts = [request.method, request.url_rule.rule if request.url_rule else request.path,
             sorted((request.view_args or {}).items()), query, list(extra), canon]
    text = json.dumps(parts, ensure_ascii=False)
    try:
        data = text.encode()
    except UnicodeEncodeError:     # a lone surrogate (the route answers 400 invalid_json)
        data = json.dumps(parts).encode()      # \u escapes: still one text per request
    return hashlib.sha256(data).hexdigest()


def api_key_of() -> str:
    """The request's API key as records name it: its digest, ``-`` when keys are off."""
    return getattr(g.get("api_key"), "sha256", None) or "-"


def scope_of(family: str, user: str | None) -> str:
    """The owner of a key: ``family``, the request's API key (:func:`api_key_of`) and
    ``user``."""
    parts = [family, api_key_of(), user or "-"]
    return hashlib.sha256(json.dumps(parts).encode()).hexdigest()


@dataclass
class Outcome:
    """A finished request's recorded answer."""
    status: int
    content_type: str | None
    body: bytes

    def response(self) -> Response:
        resp = Response(self.body, status=self.status, content_type=self.content_type)
        resp.headers[REPLAYED_HEADER] = "true"
        return resp


class KeyConflict(Conflict):
    code = "idempotency_key_conflict"


class IdempotencyStore:
    """The records of ``<data_dir>/idempotency.db`` (module doc). ``clock`` gives unix
    seconds (tests move it). Raises :class:`~hermes_service.session_store.CorruptStore` when
    the file cannot be opened as the store (not SQLite, a folder, unreadable)."""

    def __init__(self, path: str | Path, ttl_seconds: float, busy_timeout: float = 10.0,
                 max_records_per_key: int = MAX_RECORDS_PER_KEY):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.configure(ttl_seconds, max_records_per_key)
        self.busy_timeout = busy_timeout
        self.clock: Callable[[], float] = time.time
        self._local = threading.local()
        self._changed = threading.Condition()     # wakes waiting retries in this process
        try:
            con = self._con()
            con.execute("PRAGMA journal_mode=WAL")
            con.executescript(f"BEGIN IMMEDIATE;{_SCHEMA}COMMIT;")
            columns = {row[1] for row in con.execute("PRAGMA table_info(requests)")}
            if "api_key" not in columns:
                con.executescript("BEGIN IMMEDIATE;" + ";".join(_MIGRATE) + ";COMMIT;")
            con.execute(_MIGRATE[1])
        except sqlite3.Error as err:
            from .session_store import CorruptStore  # the service refuses to start (exit 3)
            raise CorruptStore(
                f"{self.path}: the Idempotency-Key record store cannot be opened ({err}); "
                "stop every service process on the data dir, move it away with its -wal and "
                "-shm files, and start again (docs/v1-api.md §Idempotent retries)") from None

    def configure(self, ttl_seconds: float,
                  max_records_per_key: int = MAX_RECORDS_PER_KEY) -> None:
        """Take a reloaded ``service.idempotency_ttl_seconds`` (outcomes stored from now on
        expire that long after they were answered) and
        ``service.idempotency_max_records_per_key``."""
        self.ttl = float(ttl_seconds)
        self.max_records = int(max_records_per_key)

    def _con(self) -> sqlite3.Connection:
        """This thread's connection (re-opened after a fork)."""
        pid, con = getattr(self._local, "con", (None, None))
        if pid != os.getpid() or con is None:
            con = sqlite3.connect(self.path, timeout=self.busy_timeout, isolation_level=None,
                                  check_same_thread=False)
            con.execute(f"PRAGMA busy_timeout={int(self.busy_timeout * 1000)}")
            con.execute("PRAGMA synchronous=FULL")      # an outcome survives a power cut
            self._local.con = (os.getpid(), con)
        return con

    def claim(self, scope: str, key: str, fp: str, api_key: str = "-") -> Outcome | str | None:
        """Try to take ``key`` for this request: None when taken (run the request, then
        :meth:`finish` or :meth:`release`), the :class:`Outcome` to replay, or ``"running"``
        while another live request holds it. A record of a dead owner is taken over (None);
        an expired one is replaced. A new record past :attr:`max_records` of ``api_key``
        (:func:`api_key_of`) makes that key's oldest finished ones go. Raises
        :class:`KeyConflict` (409 ``idempotency_key_conflict``) for another fingerprint."""
        now, me = self.clock(), instance.current()
        con = self._con()
        con.execute("BEGIN IMMEDIATE")
        try:
            row = con.execute("SELECT fingerprint, state, owner, status, content_type, body, "
                              "expires_at FROM requests WHERE scope = ? AND idem_key = ?",
                              (scope, key)).fetchone()
            if row is not None:
                fp_old, state, owner, status, ctype, body, expires = row
                live = state == "running" and (owner == me or instance.alive(owner))
                if expires <= now and not live:
                    row = None                          # expired: a fresh request
                elif fp_old != fp:
                    raise KeyConflict(f"{HEADER} {key!r} was used for another request (another "
                                      "body or route); use a new key for a new request",
                                      code="idempotency_key_conflict")
                elif state == "done":
                    return Outcome(status, ctype, bytes(body))
                elif live:
                    return "running"
                else:
                    log.warning("idempotency key taken over: its request was in progress in "
                                "process %s, which is gone; running it again", owner)
                    con.execute("UPDATE requests SET owner = ?, expires_at = ? WHERE scope = ? "
                                "AND idem_key = ?", (me, now + self.ttl, scope, key))
                    return None
            con.execute("INSERT OR REPLACE INTO requests (scope, idem_key, fingerprint, state, "
                        "owner, created_at, expires_at, api_key) VALUES (?, ?, ?, 'running', ?, "
                        "?, ?, ?)", (scope, key, fp, me, now, now + self.ttl, api_key))
            held = con.execute("SELECT count(*) FROM requests WHERE api_key = ?",
                               (api_key,)).fetchone()[0]
            if held > self.max_records:
                con.execute("DELETE FROM requests WHERE rowid IN (SELECT rowid FROM requests "
                            "WHERE api_key = ? AND state = 'done' ORDER BY created_at LIMIT ?)",
                            (api_key, held - self.max_records))
            return None
        finally:
            con.execute("COMMIT")

    def finish(self, scope: str, key: str, outcome: Outcome) -> None:
        """Record the outcome of the request holding ``key`` (durably, before it is sent)."""
        now = self.clock()
        self._con().execute(
            "UPDATE requests SET state = 'done', status = ?, content_type = ?, body = ?, "
            "expires_at = ? WHERE scope = ? AND idem_key = ? AND owner = ? AND state = 'running'",
            (outcome.status, outcome.content_type, outcome.body, now + self.ttl, scope, key,
             instance.current()))
        self._notify()

    def release(self, scope: str, key: str) -> None:
        """Forget the claim of an outcome that is not replayed: the next request runs."""
        self._con().execute("DELETE FROM requests WHERE scope = ? AND idem_key = ? AND "
                            "owner = ? AND state = 'running'", (scope, key, instance.current()))
        self._notify()

    def _notify(self) -> None:
        with self._changed:
            self._changed.notify_all()

    def wait(self, seconds: float) -> None:
        """Sleep until a record of this process changes, or ``seconds`` (another process's
        change is seen on the next look)."""
        with self._changed:
            self._changed.wait(seconds)

    def prune(self, dry_run: bool = False) -> int:
        """Delete expired records (a finished one ``ttl`` after its outcome; one in progress
        only when its owner is gone). Returns how many (would be) deleted."""
        now = self.clock()
        con = self._con()
        rows = con.execute("SELECT scope, idem_key, state, owner FROM requests WHERE "
                           "expires_at <= ?", (now,)).fetchall()
        doomed = [(s, k) for s, k, state, owner in rows
                  if state == "done" or not instance.alive(owner)]
        if not dry_run and doomed:
            con.execute("BEGIN IMMEDIATE")
            try:
                con.executemany("DELETE FROM requests WHERE scope = ? AND idem_key = ? AND "
                                "expires_at <= ?", [(s, k, now) for s, k in doomed])
            finally:
                con.execute("COMMIT")
        return len(doomed)

    def count(self) -> int:
        return self._con().execute("SELECT count(*) FROM requests").fetchone()[0]
