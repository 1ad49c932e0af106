"""Retention and cleanup: ``.venv/bin/python main.py gc`` and the service's periodic run
(docs/data-and-durability.md §Retention and cleanup).

One pass (:func:`collect`) removes, in this order:

1. **Temp files** a killed writer left in shard folders (a shard write also drops them).
2. **Session mappings** not used (``updated_at``, else ``created_at``) for ``older_than``
   seconds — only when ``older_than`` is given. Each is removed while holding its turn lock
   (``data/locks/session-<id>.lock``, taken without waiting: a session whose lock is held —
   a running turn, a delete — is kept) and only if it is still stale under its shard lock.
   With ``purge_transcripts`` its Hermes transcript goes first: every Hermes session of
   the lineage of its ``hermes_session_id`` that no other mapping of the user still
   continues, deleted by Hermes's own ``hermes sessions delete --yes <id>`` in the user's
   home; if that fails the mapping is kept (and retried next time).
3. **Owner links without a record** (a create or delete killed half-way), older than
   :data:`LINK_GRACE_SECONDS` (so a create in flight is never touched).
4. **Lock files** ``data/locks/session-<id>.lock`` of sessions that no longer exist and
   that nobody holds: taken without waiting and unlinked while held (filelock re-opens a
   lock file that was unlinked under a waiter, so two holders can never result). Lock
   files of live sessions and ``home-<user>.lock`` stay (bounded by sessions and users).
5. **Idempotency-Key records** expired ``service.idempotency_ttl_seconds`` after their
   outcome (``data/idempotency.db``; one in progress only when its process is gone: docs/v1-api.md
   §Idempotent retries, :meth:`~hermes_service.idempotency.IdempotencyStore.prune`).
6. In the service only (``in_service``): idle entries of the in-memory turn-lock table
   (:meth:`Conversations.prune_idle_locks`) — memory of that process.
7. The extensions' steps (``svc.retention_steps``,
   :class:`~hermes_service.extensions.RetentionStep`), e.g. the page store's idempotency
   records past ``retention.idempotency_window_seconds`` and the run event logs.

Nothing is removed with ``dry_run``; the report says what would be. Users' homes are read only
through :func:`~hermes_service.homes.hermes_state.lineage_ids` (which never follows what a user's
agent planted there: a tampered ``state.db`` is a problem of the report, its mapping kept);
run folders are swept by :meth:`RunFiles.sweep <hermes_service.runner.RunFiles.sweep>` at
start, which follows nothing either.
"""
from __future__ import annotations

import logging
import re
import sqlite3
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING

from filelock import FileLock, Timeout

from .errors import ServiceError
from .homefs import HomeTampered
from .homes.hermes_state import lineage_ids
from .session_store import CorruptShard

if TYPE_CHECKING:
    from .services import Services

log = logging.getLogger("hermes_service.retention")

#: An owner link younger than this is never removed (a create may be between its two steps).
LINK_GRACE_SECONDS = 3600
_HERMES_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.:-]{0,127}$")

# the core's report kinds, in the order the summary lists them (the extensions' follow)
KINDS = ("temp files", "session mappings", "transcripts", "owner links", "lock files",
         "idempotency keys", "lock-table entries", "home images")


@dataclass
class GcReport:
    """What one pass removed (or, ``dry_run``, would remove): ``lines`` for people,
    ``counts`` per kind (:data:`KINDS`, then the extensions' ``kinds``), ``problems``
    (damaged shards, failed purges)."""
    dry_run: bool
    kinds: tuple[str, ...] = KINDS
    lines: list[str] = field(default_factory=list)
    counts: dict[str, int] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)
    #: users whose shard lock was not free within the store's lock_timeout (a stuck holder):
    #: the rest of the pass leaves them alone instead of waiting again or giving up
    busy: set[str] = field(default_factory=set)

    def __post_init__(self):
        self.counts = {**dict.fromkeys(self.kinds, 0), **self.counts}

    def shard_busy(self, store, user_id: str) -> None:
        self.busy.add(user_id)
        self.problem(f"skipped user {user_id}: the lock of its session registry "
                     f"({store.root / user_id / 'sessions.json.lock'}) stayed held for "
                     f"{store.lock_timeout:g} s; nothing of that user was cleaned")

    def removed(self, kind: str, text: str | None, n: int = 1) -> None:
        self.counts[kind] += n
        if text:
            self.lines.append(("would remove " if self.dry_run else "removed ") + text)

    def kept(self, text: str) -> None:
        self.lines.append("kept " + text)

    def problem(self, text: str) -> None:
        if text in self.problems:
            return
        self.problems.append(text)
        self.lines.append("problem: " + text)

    def summary(self) -> str:
        done = ", ".join(f"{n} {k}" for k, n in self.counts.items() if n) or "nothing"
        verb = "would remove" if self.dry_run else "removed"
        tail = f"; {len(self.problems)} problem(s)" if self.problems else ""
        note = " (dry run: nothing was removed)" if self.dry_run else ""
        return f"gc: {verb} {done}{tail}{note}"


def last_used(record: dict) -> float | None:
    """Unix time of a record's ``updated_at`` (else ``created_at``); None if neither parses
    (such a record is never stale)."""
    for key in ("updated_at", "created_at"):
        try:
            value = datetime.fromisoformat(str(record.get(key)))
        except ValueError:
            continue
        return (value if value.tzinfo else value.replace(tzinfo=UTC)).timestamp()
    return None


def _stale(record: dict, cutoff: float) -> bool:
    used = last_used(record)
    return used is not None and used < cutoff


@contextmanager
def _try_lock(path: Path, create: bool) -> Iterator[FileLock | bool | None]:
    """Take the file lock at ``path`` without waiting. Yields the held lock, False if someone
    else holds it, or True when it does not exist and ``create`` is false (nobody holds it)."""
    if not create and not path.exists():
        yield True
        return
    lock = FileLock(str(path), timeout=0)
    try:
        lock.acquire(blocking=False)
    except Timeout:
        yield False
        return
    try:
        yield lock
    finally:
        lock.release()


def collect(svc: Services, *, older_than: float | None, dry_run: bool = False,
            purge_transcripts: bool = False, in_service: bool = False,
            now: float | None = None) -> GcReport:
    """One cleanup pass over ``svc``'s data dir (module doc). ``older_than``: seconds a session
    mapping must be unused to go (None: mappings are kept). Returns the report; never raises
    for a damaged shard (reported as a problem)."""
    now = time.time() if now is None else now
    steps = list(svc.retention_steps)
    report = GcReport(dry_run, kinds=KINDS + tuple(k for step in steps for k in step.kinds))
    locks_dir = svc.config.data_dir / "locks"
    _temp_files(svc, report, dry_run)
    if older_than is not None:
        _sessions(svc, report, now - older_than, purge_transcripts, dry_run, locks_dir)
    known = _Known(svc.store, report)
    _links(svc, report, dry_run, known)
    _lock_files(svc, report, dry_run, locks_dir, known)
    _home_images(svc, report, dry_run)
    n = svc.idempotency.prune(dry_run=dry_run)
    if n:
        report.removed("idempotency keys", f"{n} expired Idempotency-Key record(s)", n)
    if in_service and not dry_run:
        n = svc.conversations.prune_idle_locks()
        report.removed("lock-table entries", f"{n} idle turn-lock table entries" if n else None, n)
    for step in steps:
        step.run(svc, report, now=now, dry_run=dry_run, in_service=in_service)
    return report


def _sessions(svc, report: GcReport, cutoff: float, purge: bool, dry_run: bool,
              locks_dir: Path) -> None:
    store = svc.store
    since = datetime.fromtimestamp(cutoff, UTC).isoformat(timespec="seconds")
    for user_id in store.users():
        if user_id in report.busy:
            continue
        try:
            records = store.list(user_id)
        except CorruptShard as exc:
            report.problem(f"skipped {exc}")
            continue
        remaining = {r["session_id"]: r for r in records}
        for rec in [r for r in records if _stale(r, cutoff)]:
            if not _session(svc, report, user_id, rec, remaining, cutoff, since, purge, dry_run,
                            locks_dir):
                break


def _session(svc, report: GcReport, user_id: str, rec: dict, remaining: dict, cutoff: float,
             since: str, purge: bool, dry_run: bool, locks_dir: Path) -> bool:
    """One stale session ``rec`` of ``user_id``: its mapping, lock file and (``purge``) the
    Hermes transcripts only it continues removed (or, ``dry_run``, reported), unless a turn
    holds it or it was used again; ``remaining`` loses it when it goes. False when the user's
    shard is busy (the user's other sessions wait for the next pass)."""
    sid = rec["session_id"]
    what = f"session {sid} of user {user_id} (unused since {rec.get('updated_at')})"
    lock_path = locks_dir / f"session-{sid}.lock"
    had_lock_file = lock_path.exists()
    with _try_lock(lock_path, create=not dry_run) as held:
        if not held:
            report.kept(f"session {sid} of user {user_id}: a turn holds its lock")
            return True
        try:
            doomed = _transcripts(svc, user_id, rec, remaining) if purge else []
        except (sqlite3.Error, OSError, HomeTampered) as exc:
            report.problem(f"session {sid} of user {user_id}: its Hermes transcripts "
                           f"could not be read ({exc}); the mapping is kept")
            return True
        if dry_run:
            report.removed("session mappings", what)
            for hid in doomed:
                report.removed("transcripts", f"Hermes session {hid} of user {user_id}")
            if had_lock_file:
                report.removed("lock files", f"lock file {lock_path}")
            remaining.pop(sid)
            return True
        if not _delete_transcripts(svc, report, user_id, sid, doomed):
            return True
        try:
            gone = svc.store.delete(sid, where=lambda r: _stale(r, cutoff))
        except Timeout:
            report.shard_busy(svc.store, user_id)
            return False
        if gone is None:
            report.kept(f"session {sid} of user {user_id}: used again after {since}")
            return True
        remaining.pop(sid)
        report.removed("session mappings", what)
        if isinstance(held, FileLock):       # we hold it: nobody else can be using it
            lock_path.unlink(missing_ok=True)
            if had_lock_file:
                report.removed("lock files", f"lock file {lock_path}")
    return True


def _delete_transcripts(svc, report: GcReport, user_id: str, sid: str,
                        doomed: list[str]) -> bool:
    """Delete the Hermes sessions ``doomed`` of session ``sid``; False (reported: the mapping
    is kept) when one could not be."""
    try:
        for hid in doomed:
            if _delete_transcript(svc, user_id, hid):
                report.removed("transcripts", f"Hermes session {hid} of user {user_id}")
    except ServiceError as err:
        report.problem(f"session {sid} of user {user_id}: Hermes session {hid} was not "
                       f"deleted ({err.detail}); the mapping is kept")
        return False
    return True


def _transcripts(svc, user_id: str, rec: dict, remaining: dict) -> list[str]:
    """Hermes session ids of ``rec``'s lineage that no other remaining mapping continues."""
    home = svc.homes.path(user_id).hermes_home
    mine = lineage_ids(home, rec.get("hermes_session_id"))
    if not mine:
        return []
    kept: set[str] = set()
    for other in remaining.values():
        if other["session_id"] != rec["session_id"]:
            kept.update(lineage_ids(home, other.get("hermes_session_id")))
    return [hid for hid in mine if hid not in kept and _HERMES_ID.fullmatch(hid)]


def _delete_transcript(svc, user_id: str, hermes_id: str) -> bool:
    """``hermes sessions delete --yes <id>`` in the user's home (a CLI slot is held).
    True if Hermes deleted it, False if it was already gone; RunError if the CLI failed."""
    home = svc.homes.path(user_id)
    env = svc.homes.cli_env(home, svc.processes.command_path())
    with svc.processes.slot():
        out = svc.processes.spawn(["sessions", "delete", "--yes", hermes_id], env, home,
                                  65536).wait(float(svc.config.hermes.execute.timeout_seconds))
    if out.returncode == 0 and "Deleted session" in out.stdout:
        return True
    if out.returncode == 0 and "not found" in out.stdout:
        return False
    raise ServiceError(f"hermes sessions delete exited {out.returncode}: "
                       f"{(out.stderr or out.stdout).strip()[-300:]}", code="hermes_failed")


class _Known:
    """Which session ids each owner's shard holds, read once per pass (None: damaged)."""

    def __init__(self, store, report: GcReport):
        self.store, self.report = store, report
        self.ids: dict[str, set | None] = {}

    def owner_and_state(self, session_id: str) -> tuple[str | None, bool | None]:
        """(owner, whether its shard holds the record); state None if the link or the shard
        is damaged (reported once)."""
        try:
            owner = self.store.owner(session_id)
        except CorruptShard as exc:
            self.report.problem(f"skipped {exc}")
            return None, None
        if owner is None:
            return None, False
        if owner not in self.ids:
            try:
                self.ids[owner] = {r["session_id"] for r in self.store.list(owner)}
            except CorruptShard as exc:
                self.ids[owner] = None
                self.report.problem(f"skipped {exc}")
        held = self.ids[owner]
        return owner, None if held is None else session_id in held


def _links(svc, report: GcReport, dry_run: bool, known: _Known) -> None:
    for sid, _path in svc.store.links():
        owner, present = known.owner_and_state(sid)
        if owner is None or present is not False or owner in report.busy:
            continue
        try:
            if svc.store.drop_dangling_link(sid, LINK_GRACE_SECONDS, dry_run=dry_run):
                report.removed("owner links", f"owner link of {sid} (user {owner}; no record)")
        except CorruptShard as exc:
            report.problem(f"skipped {exc}")
        except Timeout:
            report.shard_busy(svc.store, owner)


def _home_images(svc, report: GcReport, dry_run: bool) -> None:
    """The image of a home an operator removed (``<homes>/users/<id>`` gone, no loop device
    on it: docs/sandbox.md §Home images)."""
    try:
        found = svc.disk.images.orphans()
    except Exception as exc:  # noqa: BLE001 - losetup missing or failing: a problem, not a crash
        report.problem(f"home images not checked: {exc}")
        return
    for img in found:
        if not dry_run:
            img.unlink(missing_ok=True)
        report.removed("home images", f"the image of a removed home {img}")


def _temp_files(svc, report: GcReport, dry_run: bool) -> None:
    for user_id in svc.store.users():
        try:
            found = svc.store.sweep_temp_files(user_id, dry_run=dry_run)
        except Timeout:
            report.shard_busy(svc.store, user_id)
            continue
        for path in found:
            report.removed("temp files", f"temp file {path}")


def _lock_files(svc, report: GcReport, dry_run: bool, locks_dir: Path, known: _Known) -> None:
    if not locks_dir.is_dir():
        return
    for path in sorted(locks_dir.glob("session-*.lock")):
        sid = path.name[len("session-"):-len(".lock")]
        try:
            _owner, present = known.owner_and_state(sid)
        except ServiceError:               # not a session id of ours: not ours to remove
            continue
        if present is not False:           # a live session's (used on its next turn), or damaged
            continue
        with _try_lock(path, create=False) as held:
            if not held:
                report.kept(f"lock file {path}: held")
                continue
            if not dry_run:
                path.unlink(missing_ok=True)
            report.removed("lock files", f"lock file {path}")


class RetentionJob:
    """The service's periodic cleanup (``retention`` in config): every ``interval_seconds``
    one :func:`collect` pass with ``in_service=True``; mappings only when
    ``sessions_older_than`` is set. Started by the serve command; a daemon thread.

    The settings are read from ``svc.config`` at every pass, so a reload (docs/configuring.md
    §Reload) applies from the next one; while ``interval_seconds`` is 0 no pass runs (the thread
    looks again every :attr:`idle_check` seconds)."""
    idle_check = 60.0

    def __init__(self, svc: Services):
        self.svc = svc
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def interval(self) -> float:
        return float(self.svc.config.retention.interval_seconds)

    @property
    def older_than(self) -> float | None:
        return self.svc.config.retention.sessions_older_than_seconds

    def run_once(self) -> GcReport:
        """One pass; logs each removal at info and problems at warning."""
        report = collect(self.svc, older_than=self.older_than, in_service=True,
                         purge_transcripts=bool(self.svc.config.retention.purge_transcripts))
        for line in report.lines:
            log.info("retention: %s", line)
        for problem in report.problems:
            log.warning("retention: %s", problem)
        if any(report.counts.values()) or report.problems:
            log.info("retention: %s", report.summary())
        return report

    def start(self) -> bool:
        """Start the thread (once). Returns whether passes run now (``interval_seconds`` > 0)."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="retention", daemon=True)
            self._thread.start()
        return self.interval > 0

    def stop(self) -> None:
        """End the thread after the pass in progress, if any."""
        self._stop.set()

    def _loop(self) -> None:
        while True:
            interval = self.interval
            if self._stop.wait(interval if interval > 0 else self.idle_check):
                return
            if self.interval <= 0:
                continue
            try:
                self.run_once()
            except Exception:     # a failed pass must not end the thread; the next one retries
                log.exception("retention pass failed")
