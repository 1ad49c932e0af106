"""Users' homes in PostgreSQL: content-addressed chunks and a manifest per saved turn
(docs/data-and-durability.md §Home snapshots; tables: :mod:`.snapshot_schema`).

* :meth:`HomeSnapshots.save` — inside the caller's open transaction (committed with the
  turn's other records, or rolled back with them: then no manifest is left): walks the home
  (:mod:`.snapshot_walk`: no-follow, bounded, SQLite databases copied consistently), cuts
  each file into 64 KiB chunks, asks which of their hashes the database already holds (one
  query per :data:`UPLOAD_BATCH_BYTES` of changed data), inserts only the missing ones
  (``ON CONFLICT DO NOTHING``), writes the manifest and deletes the user's manifests older
  than the last ``keep``. Files unchanged since this process's last snapshot of the home
  are not read again.
* :meth:`HomeSnapshots.restore` — the user's latest manifest, checked
  (:func:`.snapshot_manifest.parse`), written into a fresh sibling of the home and swapped in
  atomically (:mod:`.snapshot_restore`); None when the user has none.
* :func:`collect_garbage` — deletes the chunks no manifest names (the retention pass, in a
  transaction of its own). It takes :data:`GC_LOCK` exclusively, which every save takes
  shared for its transaction, so no save can rely on a chunk while it is deleted.

Errors: a home that is a symlink or a ``state.db`` that cannot be copied — 409
``home_tampered`` / 503 ``home_busy`` (as reading it); a save past :attr:`seconds` —
:class:`SnapshotTooSlow` (503 ``home_snapshot_too_slow``); a damaged stored snapshot — 503
``home_snapshot_damaged`` (:class:`~.snapshot_manifest.SnapshotDamaged`); a database error
is psycopg's, for the caller's transaction to map.
"""
from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from psycopg.types.json import Jsonb

from ..errors import ServiceError
from . import snapshot_walk
from .snapshot_manifest import FILE, Entry, SnapshotDamaged, parse
from .snapshot_restore import restore_into
from .snapshot_walk import FileCache, HomeWalk

__all__ = ["GC_LOCK", "HomeSnapshots", "SnapshotDamaged", "SnapshotInfo", "SnapshotTooSlow",
           "collect_garbage"]

#: the advisory lock between saves (shared) and the garbage collection (exclusive)
GC_LOCK = 0x68_6F_6D_65_73_6E_61_70        # "homesnap"
#: changed data gathered before one existence query and one batch of inserts
UPLOAD_BATCH_BYTES = 16 * 1024 * 1024
#: defaults: folders and files kept per snapshot; manifests kept per user; seconds a save
#: or a restore may take
MAX_ENTRIES = 20_000
KEEP = 3
SECONDS = 120.0
#: files whose hashes this process remembers (over every home), least recently saved first out
CACHE_FILES = 200_000


class SnapshotTooSlow(ServiceError):
    """A save did not finish in its time (a very large home on a slow disk or database): the
    turn is not acknowledged; retry."""
    status, code = 503, "home_snapshot_too_slow"


@dataclass(frozen=True)
class SnapshotInfo:
    """What one save or restore did: the manifest (``manifest_id``, ``seq``: the user's
    1, 2, …), ``files`` and their ``bytes``, ``chunks_total`` the files hold,
    ``chunks_uploaded`` (save: inserted now; restore: 0), ``bytes_uploaded``, ``seconds``,
    and ``skipped``: entries left out by reason (:data:`.snapshot_walk.SKIP_REASONS`)."""
    manifest_id: int
    seq: int
    files: int
    bytes: int
    chunks_total: int
    chunks_uploaded: int
    bytes_uploaded: int
    seconds: float
    skipped: dict[str, int] = field(default_factory=dict)


class _Uploader:
    """Chunks to store, deduplicated; each batch: one query for the hashes already there,
    one pipelined insert of the others."""

    def __init__(self, conn):
        self.conn = conn
        self.pending: dict[bytes, bytes] = {}
        self.seen: set[bytes] = set()
        self.size = self.uploaded = self.uploaded_bytes = 0

    def add(self, digest: bytes, data: bytes) -> None:
        if digest in self.seen:
            return
        self.seen.add(digest)
        self.pending[digest] = data
        self.size += len(data)
        if self.size >= UPLOAD_BATCH_BYTES:
            self.flush()

    def flush(self) -> None:
        if not self.pending:
            return
        have = {r[0] for r in self.conn.execute(
            "SELECT hash FROM home_chunks WHERE hash = ANY(%b)", (list(self.pending),))}
        missing = [(h, d) for h, d in self.pending.items() if h not in have]
        if missing:
            with self.conn.cursor() as cur:
                cur.executemany("INSERT INTO home_chunks (hash, data) VALUES (%b, %b) "
                                "ON CONFLICT DO NOTHING", missing)
        self.uploaded += len(missing)
        self.uploaded_bytes += sum(len(d) for _h, d in missing)
        self.pending.clear()
        self.size = 0


class HomeSnapshots:
    """Saves and restores users' homes (module doc). ``max_bytes``: the most a snapshot
    holds (the home's quota, ``hermes.sandbox.max_home_mb`` in bytes); ``max_entries``:
    folders and files; ``keep``: manifests kept per user; ``seconds``: the time a save or a
    restore may take; ``work_dir``: where SQLite copies are made (the system's temp folder
    by default; never the home); ``make_folder``: makes a restored home's new folder
    (:func:`.snapshot_restore.restore_into`). Thread-safe; one save or restore of a user at
    a time (the caller's turn lock)."""

    def __init__(self, max_bytes: int, max_entries: int = MAX_ENTRIES, keep: int = KEEP,
                 seconds: float = SECONDS, work_dir: Path | None = None,
                 make_folder: Callable[[Path], None] | None = None):
        if keep < 1:
            raise ValueError("keep must be at least 1")
        self.max_bytes, self.max_entries, self.keep = max_bytes, max_entries, keep
        self.seconds, self.work_dir, self.make_folder = seconds, work_dir, make_folder
        self._cache: OrderedDict[str, tuple[int, str, FileCache]] = OrderedDict()
        self._lock = threading.Lock()

    def save(self, conn, user_id: str, home: Path) -> SnapshotInfo:
        """Snapshot ``home`` as ``user_id``'s next manifest, in ``conn``'s open transaction
        (a psycopg 3 connection; the caller commits). Raises as the module doc says."""
        start = time.monotonic()
        with conn.pipeline():     # the lock, then the user's latest manifest: one round trip
            conn.execute("SELECT pg_advisory_xact_lock_shared(%s)", (GC_LOCK,))
            cur = conn.execute("SELECT id, seq FROM home_manifests WHERE user_id = %s "
                               "ORDER BY seq DESC LIMIT 1", (user_id,))
        latest = cur.fetchone()
        walk = HomeWalk(home, self.max_bytes, self.max_entries, start + self.seconds,
                        self._cached(user_id, home, latest[0] if latest else None),
                        self.work_dir)
        uploader = _Uploader(conn)
        entries: list[Entry] = []
        try:
            for entry, chunks in walk.entries():
                for digest, data in chunks or ():
                    uploader.add(digest, data)
                entries.append(entry)
        except snapshot_walk.SnapshotTooSlow as exc:
            raise SnapshotTooSlow(f"{exc} (more than {self.seconds:g} s)") from None
        uploader.flush()
        hashes = [h for e in entries for h in e.hashes]
        seq = latest[1] + 1 if latest else 1
        files = [e for e in entries if e.kind == FILE]
        size = sum(e.size for e in files)
        manifest_id = conn.execute(   # the new manifest, and the user's older ones pruned
            "WITH pruned AS (DELETE FROM home_manifests WHERE user_id = %s AND seq <= %s) "
            "INSERT INTO home_manifests (user_id, seq, files, bytes, entries, chunks) "
            "VALUES (%s, %s, %s, %s, %s, %b) RETURNING id",
            (user_id, seq - self.keep, user_id, seq, len(files), size,
             Jsonb([e.as_json() for e in entries]), hashes)).fetchone()[0]
        self._remember(user_id, home, manifest_id, walk.cache)
        return SnapshotInfo(manifest_id, seq, len(files), size, len(hashes), uploader.uploaded,
                            uploader.uploaded_bytes, time.monotonic() - start,
                            dict(walk.skipped))

    def restore(self, conn, user_id: str, home: Path) -> SnapshotInfo | None:
        """Replace ``home`` with ``user_id``'s latest manifest (module doc); None (the home
        untouched) when the user has none. Raises
        :class:`~.snapshot_manifest.SnapshotDamaged` for a manifest or chunk that breaks the
        rules, leaving the home as it was."""
        start = time.monotonic()
        row = conn.execute("SELECT id, seq, entries, chunks FROM home_manifests "
                           "WHERE user_id = %s ORDER BY seq DESC LIMIT 1", (user_id,)).fetchone()
        if row is None:
            return None
        manifest_id, seq, raw, chunks = row
        entries = parse(raw, chunks, self.max_entries, self.max_bytes)

        def fetch(hashes: list[bytes]) -> dict[bytes, bytes]:
            return {h: d for h, d in conn.execute(
                "SELECT hash, data FROM home_chunks WHERE hash = ANY(%b)", (hashes,))}
        cache = restore_into(home, entries, fetch, self.make_folder)
        self._remember(user_id, home, manifest_id, cache)
        files = [e for e in entries if e.kind == FILE]
        return SnapshotInfo(manifest_id, seq, len(files), sum(e.size for e in files),
                            len(chunks), 0, 0, time.monotonic() - start)

    def _cached(self, user_id: str, home: Path, latest: int | None) -> FileCache | None:
        """The hashes remembered for the home, if they belong to the user's latest manifest
        (another node's save, or a rolled-back one, makes them stale)."""
        with self._lock:
            found = self._cache.get(user_id)
        if found is None or latest is None or found[0] != latest or found[1] != str(home):
            return None
        return found[2]

    def _remember(self, user_id: str, home: Path, manifest_id: int, cache: FileCache) -> None:
        with self._lock:
            self._cache.pop(user_id, None)
            self._cache[user_id] = (manifest_id, str(home), cache)
            total = sum(len(c[2]) for c in self._cache.values())
            while total > CACHE_FILES and self._cache:
                total -= len(self._cache.popitem(last=False)[1][2])


def collect_garbage(conn) -> int:
    """Delete every chunk no manifest names, in ``conn``'s open transaction (the caller
    commits; its own transaction: saves wait for it while it runs); returns how many went.
    Takes :data:`GC_LOCK` exclusively (module doc)."""
    conn.execute("SELECT pg_advisory_xact_lock(%s)", (GC_LOCK,))
    cur = conn.execute("DELETE FROM home_chunks WHERE hash IN (SELECT hash FROM home_chunks "
                       "EXCEPT SELECT unnest(chunks) FROM home_manifests)")
    return cur.rowcount
