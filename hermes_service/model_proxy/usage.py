"""Model usage: what the provider reports for each request through the pass-through, and
what is counted when it reports nothing (docs/sandbox.md §Token usage).

* :class:`UsageReader` — the provider's own ``usage`` out of an answer body (JSON or an event
  stream), and an estimate of the answer's tokens from the text that went through;
* :class:`UsageStore` — per user and UTC day in ``<data_dir>/model_usage.db`` (SQLite,
  shared by every service process on the data dir), and what a user has spent today
  (:meth:`UsageStore.spent`, for ``hermes.limits.daily_tokens``);
* :func:`read_usage` — the rows ``main.py usage`` prints.
"""
from __future__ import annotations

import datetime as _dt
import json
import logging
import queue
import sqlite3
import threading
import time
import zlib
from pathlib import Path
from typing import NamedTuple

log = logging.getLogger("hermes_service.model_proxy")

USAGE_DB_NAME = "model_usage.db"      # in the data dir; see usage_db_path()
USAGE_SCAN_LIMIT = 16 * 1024 * 1024   # bytes of a JSON answer (decoded) kept to read its usage
RETRY_SECONDS = 5.0                   # a usage write that failed is tried again this often


def usage_db_path(data_dir: Path) -> Path:
    """Where the service keeps per-user model usage: ``<data_dir>/model_usage.db``."""
    return Path(data_dir) / USAGE_DB_NAME


def today() -> str:
    """The current UTC day, ``YYYY-MM-DD`` (the usage rows' ``day``)."""
    return _dt.datetime.now(_dt.UTC).date().isoformat()


class UsageReader:
    """Reads the provider's ``usage`` out of an answer body fed piece by piece.

    ``content_type``/``content_encoding``: the answer's headers. ``feed(data)`` with each raw
    piece as relayed; :meth:`tokens` then gives ``(prompt_tokens, completion_tokens)`` (0 for
    what the provider did not report), :attr:`reported` whether it reported any, and
    :meth:`estimate_completion` the completion tokens estimated from the text that went
    through (a quarter of its characters: content, reasoning, tool-call arguments). Event
    streams are scanned line by line; a JSON body is kept (decoded, up to
    :data:`USAGE_SCAN_LIMIT` bytes) and parsed once at the end. Any other type, an unknown
    content encoding or a body that does not parse counts no tokens.
    """

    def __init__(self, content_type: str | None, content_encoding: str | None):
        ctype = (content_type or "").split(";", 1)[0].strip().lower()
        self.kind = ("sse" if ctype == "text/event-stream"
                     else "json" if ctype == "application/json" or ctype.endswith("+json")
                     else None)
        enc = (content_encoding or "identity").strip().lower()
        self._inflate = None
        if enc in ("gzip", "x-gzip"):
            self._inflate = zlib.decompressobj(16 + zlib.MAX_WBITS)
        elif enc == "deflate":
            self._inflate = zlib.decompressobj()     # zlib-wrapped (RFC 9110 §8.4.1.2)
        elif enc != "identity":
            self.kind = None
        self._buf = bytearray()
        self._usage: dict[str, int] = {}
        self._chars = 0              # answer text seen (estimate_completion)
        self._parsed = False

    def feed(self, data: bytes) -> None:
        if self.kind is None or not data:
            return
        if self._inflate is not None:
            try:
                data = self._inflate.decompress(data)
            except zlib.error:
                self.kind = None
                return
        if self.kind == "json":
            if len(self._buf) + len(data) > USAGE_SCAN_LIMIT:
                self.kind = None
                return
            self._buf += data
            return
        self._buf += data
        if b"\n" not in data:
            return
        *lines, rest = bytes(self._buf).split(b"\n")
        self._buf = bytearray(rest)
        for line in lines:
            if not line.startswith(b"data:"):
                continue
            try:
                obj = json.loads(line[5:])
            except (ValueError, RecursionError):
                continue
            self._take(obj)
            self._count(obj, "delta")
        if len(self._buf) > USAGE_SCAN_LIMIT:          # one endless line: give up on it
            self._buf.clear()

    def _count(self, obj, key: str) -> None:
        """Add the answer text of a chunk (``key`` ``delta``) or a whole answer (``message``)."""
        choices = obj.get("choices") if isinstance(obj, dict) else None
        if not isinstance(choices, list):
            return
        for choice in choices:
            part = choice.get(key) if isinstance(choice, dict) else None
            if not isinstance(part, dict):
                continue
            for field in ("content", "reasoning_content", "reasoning"):
                if isinstance(part.get(field), str):
                    self._chars += len(part[field])
            for call in part.get("tool_calls") or ():
                fn = call.get("function") if isinstance(call, dict) else None
                if isinstance(fn, dict):
                    for field in ("name", "arguments"):
                        if isinstance(fn.get(field), str):
                            self._chars += len(fn[field])

    def _take(self, obj) -> None:
        if not isinstance(obj, dict):
            return
        usage = obj.get("usage")
        if not isinstance(usage, dict):           # Anthropic message_start: {"message": {usage}}
            inner = obj.get("message") or obj.get("response")
            usage = inner.get("usage") if isinstance(inner, dict) else None
        if not isinstance(usage, dict):
            return
        for key in ("prompt_tokens", "completion_tokens", "input_tokens", "output_tokens"):
            v = usage.get(key)
            if isinstance(v, int) and not isinstance(v, bool) and v >= 0:
                self._usage[key] = max(v, self._usage.get(key, 0))

    def _finish(self) -> None:
        if self.kind == "json" and self._buf and not self._parsed:
            try:
                obj = json.loads(bytes(self._buf))
                self._take(obj)
                self._count(obj, "message")
            except (ValueError, RecursionError):
                pass
            self._buf.clear()
        self._parsed = True

    def tokens(self) -> tuple[int, int]:
        self._finish()
        u = self._usage
        return (u.get("prompt_tokens", u.get("input_tokens", 0)),
                u.get("completion_tokens", u.get("output_tokens", 0)))

    @property
    def usage_seen(self) -> bool:
        """Has the provider's usage come in an event already (an event stream's usage chunk;
        a JSON answer's is known at its end only)?"""
        return bool(self._usage)

    @property
    def reported(self) -> bool:
        """Did the answer carry the provider's own usage?"""
        self._finish()
        return bool(self._usage)

    def estimate_completion(self) -> int:
        """Completion tokens estimated from the answer text that went through (chars / 4,
        rounded up)."""
        self._finish()
        return -(-self._chars // 4)


def _add_up(rows: dict[tuple[str, str], list[int]], batch: list) -> bool:
    """Add a batch of queued counts (``(user, day, prompt, completion, estimated)``) into
    ``rows``; True when the batch holds the stop mark (None)."""
    stop = False
    for it in batch:
        if it is None:
            stop = True
            continue
        r = rows.setdefault((it[0], it[1]), [0, 0, 0, 0])
        r[0] += 1
        r[1] += it[2]
        r[2] += it[3]
        r[3] += it[4]
    return stop


class UsageStore:
    """Per-user, per-UTC-day model usage in SQLite: table ``usage(user_id, day, requests,
    prompt_tokens, completion_tokens, estimated_requests)``, primary key ``(user_id, day)``,
    ``day`` as ``YYYY-MM-DD``; ``estimated_requests`` counts the requests whose tokens were
    estimated (the provider reported none: a stream cut before its usage chunk).

    :meth:`add` only queues; a background thread writes what is queued in one transaction
    (an upsert per user and day, ``INSERT … ON CONFLICT DO UPDATE``:
    https://www.sqlite.org/lang_upsert.html). WAL journal and a 10 s busy timeout
    (https://www.sqlite.org/wal.html), so two service processes sharing the data dir add to
    the same rows without losing counts. :meth:`flush` waits until everything queued is
    written (or failed); :meth:`close` flushes and stops the thread. A write that fails (a
    full disk) is logged and kept: retried with the next batch and every
    :data:`RETRY_SECONDS`, its tokens counting in :meth:`spent` meanwhile; what still cannot
    be written when the service stops is logged as lost (an ERROR line with the counts).
    """

    def __init__(self, path: Path):
        self.path = Path(path)
        self._queue: queue.Queue = queue.Queue()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._pending: dict[tuple[str, str], int] = {}     # tokens queued, not yet in the db
        self._reader: sqlite3.Connection | None = None
        with _connect(self.path, create=True):
            pass

    def add(self, user_id: str, prompt_tokens: int, completion_tokens: int,
            day: str | None = None, estimated: bool = False) -> None:
        """Count one request of ``user_id`` (today, UTC, unless ``day`` is given);
        ``estimated``: its tokens are the pass-through's estimate."""
        day = day or today()
        with self._lock:
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._writer, name="model-usage-writer",
                                                daemon=True)
                self._thread.start()
            key = (user_id, day)
            self._pending[key] = self._pending.get(key, 0) + int(prompt_tokens) + \
                int(completion_tokens)
        self._queue.put((user_id, day, int(prompt_tokens), int(completion_tokens),
                         1 if estimated else 0))

    def spent(self, user_id: str, day: str | None = None) -> int:
        """Tokens (prompt + completion) ``user_id`` used on ``day`` (today, UTC), every service
        process on the data dir counted: the db's row plus what this process has queued.
        Raises sqlite3.Error for an unreadable db."""
        key = (user_id, day or today())
        with self._lock:
            if self._reader is None:
                self._reader = _connect(self.path, create=False, shared=True)
            row = self._reader.execute(
                "SELECT prompt_tokens + completion_tokens FROM usage WHERE user_id = ? AND "
                "day = ?", key).fetchone()
            return (row[0] if row else 0) + self._pending.get(key, 0)

    def flush(self, timeout: float = 10.0) -> bool:
        """Wait until every queued count is written (or failed); False on timeout."""
        deadline = time.monotonic() + timeout
        while self._queue.unfinished_tasks:
            if time.monotonic() > deadline:
                return False
            with self._queue.all_tasks_done:
                self._queue.all_tasks_done.wait(0.05)
        return True

    def close(self, timeout: float = 10.0) -> None:
        self.flush(timeout)
        with self._lock:
            thread, self._thread = self._thread, None
            reader, self._reader = self._reader, None
        if reader is not None:
            reader.close()
        if thread is not None:
            self._queue.put(None)
            thread.join(timeout)

    def _writer(self) -> None:
        conn = None
        failed: dict[tuple[str, str], list[int]] = {}     # rows not written yet: retried
        while True:
            batch = self._take_batch(RETRY_SECONDS if failed else None)
            rows = failed
            failed = {}
            stop = _add_up(rows, batch)
            # under the lock: spent() reads the db and the pending counts as one (a count
            # is in exactly one of them)
            self._lock.acquire()
            try:
                if rows:
                    if conn is None:
                        conn = _connect(self.path, create=True)
                    self._write(conn, rows)
            except sqlite3.Error as exc:
                # kept (still in the pending counts: spent() goes on counting them) and
                # written with the next batch, or every RETRY_SECONDS
                failed = rows
                level = logging.ERROR if stop else logging.WARNING
                log.log(level, "model usage: %d count(s) not written to %s%s: %s",
                        sum(v[0] for v in rows.values()), self.path,
                        " and lost at this stop" if stop else " (kept; retried)", exc)
                if conn is not None:
                    conn.close()
                    conn = None
            finally:
                self._lock.release()
                for _ in batch:
                    self._queue.task_done()
            if stop:
                if conn is not None:
                    conn.close()
                return

    def _take_batch(self, wait: float | None) -> list:
        """The queued counts: the first waited for up to ``wait`` seconds (None: until one
        comes), then every one queued by then. None in the list: stop."""
        try:
            batch = [self._queue.get(timeout=wait)]
        except queue.Empty:
            batch = []
        while True:
            try:
                batch.append(self._queue.get_nowait())
            except queue.Empty:
                return batch

    def _write(self, conn: sqlite3.Connection, rows: dict[tuple[str, str], list[int]]) -> None:
        """Add ``rows`` (``(user, day)`` → requests, prompt and completion tokens, estimated
        requests) to the database in one transaction, and take them off the pending counts.
        Caller holds the lock."""
        with conn:
            conn.executemany(
                "INSERT INTO usage (user_id, day, requests, prompt_tokens, "
                "completion_tokens, estimated_requests) VALUES (?, ?, ?, ?, ?, ?) "
                "ON CONFLICT (user_id, day) DO UPDATE SET "
                "requests = requests + excluded.requests, "
                "prompt_tokens = prompt_tokens + excluded.prompt_tokens, "
                "completion_tokens = completion_tokens + excluded.completion_tokens, "
                "estimated_requests = estimated_requests + "
                "excluded.estimated_requests",
                [(u, d, *v) for (u, d), v in rows.items()])
        for key, v in rows.items():
            left = self._pending.get(key, 0) - v[1] - v[2]
            if left > 0:
                self._pending[key] = left
            else:
                self._pending.pop(key, None)


def _connect(path: Path, create: bool, shared: bool = False) -> sqlite3.Connection:
    if create:
        path.parent.mkdir(parents=True, exist_ok=True)
        conn = sqlite3.connect(str(path), timeout=10.0, check_same_thread=False)
        conn.execute("PRAGMA journal_mode=WAL")
        conn.execute("PRAGMA synchronous=NORMAL")
        conn.execute("CREATE TABLE IF NOT EXISTS usage (user_id TEXT NOT NULL, "
                     "day TEXT NOT NULL, requests INTEGER NOT NULL DEFAULT 0, "
                     "prompt_tokens INTEGER NOT NULL DEFAULT 0, "
                     "completion_tokens INTEGER NOT NULL DEFAULT 0, "
                     "estimated_requests INTEGER NOT NULL DEFAULT 0, "
                     "PRIMARY KEY (user_id, day))")
        columns = {r[1] for r in conn.execute("PRAGMA table_info(usage)")}
        if "estimated_requests" not in columns:      # a db of an earlier version
            try:
                conn.execute("ALTER TABLE usage ADD COLUMN estimated_requests INTEGER NOT NULL "
                             "DEFAULT 0")
            except sqlite3.OperationalError as exc:   # another process added it meanwhile
                if "duplicate column" not in str(exc):
                    raise
        return conn
    return sqlite3.connect(path.resolve().as_uri() + "?mode=ro", uri=True, timeout=10.0,
                           check_same_thread=not shared)


class UsageRow(NamedTuple):
    user_id: str
    day: str | None          # None in totals over several days
    requests: int
    prompt_tokens: int
    completion_tokens: int
    estimated_requests: int = 0


def read_usage(path: Path, user_id: str | None = None, days: int = 30,
               daily: bool = False, today: _dt.date | None = None) -> list[UsageRow]:
    """Usage of the last ``days`` UTC days (today included), per user (``daily``: per user
    and day), sorted by user (then day). ``user_id`` limits it to one user. A db that does not
    exist yet reads as no rows. Raises ValueError for ``days < 1``, sqlite3.Error for an
    unreadable db."""
    if days < 1:
        raise ValueError("days must be >= 1")
    path = Path(path)
    if not path.exists():
        return []
    today = today or _dt.datetime.now(_dt.UTC).date()
    since = (today - _dt.timedelta(days=days - 1)).isoformat()
    where, args = "day >= ?", [since]
    if user_id is not None:
        where += " AND user_id = ?"
        args.append(user_id)
    day_col, group = ("day", "user_id, day") if daily else ("NULL", "user_id")
    conn = _connect(path, create=False)
    try:
        columns = {r[1] for r in conn.execute("PRAGMA table_info(usage)")}
        estimated = "SUM(estimated_requests)" if "estimated_requests" in columns else "0"
        rows = conn.execute(
            f"SELECT user_id, {day_col}, SUM(requests), SUM(prompt_tokens), "
            f"SUM(completion_tokens), {estimated} FROM usage WHERE {where} GROUP BY {group} "
            f"ORDER BY {group}", args).fetchall()
    finally:
        conn.close()
    return [UsageRow(*r) for r in rows]


def seconds_to_midnight(now: _dt.datetime | None = None) -> int:
    """Seconds until the next UTC day begins (when a spent daily budget is renewed), >= 1."""
    now = now or _dt.datetime.now(_dt.UTC)
    tomorrow = (now + _dt.timedelta(days=1)).replace(hour=0, minute=0, second=0, microsecond=0)
    return max(1, int((tomorrow - now).total_seconds()) + 1)


def budget_message(spent: int, budget: int) -> str:
    """The one text of a spent ``hermes.limits.daily_tokens`` budget: what the pass-through
    answers Hermes (429 ``token_budget_exceeded``), what a refused turn's detail says; the
    runner recognises a turn that failed on it by :data:`BUDGET_MARK`."""
    return (f"{BUDGET_MARK}: this user has used {spent} of its {budget} model tokens today "
            "(hermes.limits.daily_tokens; renewed at 00:00 UTC)")


#: the words of :func:`budget_message` a failed turn's text is recognised by
BUDGET_MARK = "token budget spent"


def budget_error():
    """``token_budget_exceeded`` (429, ``Retry-After`` to 00:00 UTC): the user spent its
    ``hermes.limits.daily_tokens`` (a turn refused before Hermes starts, or one whose
    model request the pass-through refused)."""
    from ..errors import RunError
    return RunError("this user's model tokens for today are spent (hermes.limits.daily_tokens; "
                    "renewed at 00:00 UTC)", code="token_budget_exceeded", status=429,
                    headers={"Retry-After": str(seconds_to_midnight())})
