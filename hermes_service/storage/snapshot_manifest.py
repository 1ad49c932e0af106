"""A home snapshot's manifest: the list of folders and files of a home, and the rules a
manifest read back from PostgreSQL must pass before anything is written from it
(docs/data-and-durability.md §Home snapshots).

A manifest is ``entries`` (JSON, in walk order: a folder always before what it holds) and
``chunks`` (the files' chunk hashes, file after file). An entry is
``{"path": "a/b", "kind": "dir", "mode": 448}`` or
``{"path": "a/b/c", "kind": "file", "mode": 420, "size": 70000, "chunks": 2}``: ``path`` is
relative to the home, ``/``-separated, each part a valid file name (not empty, ``.`` or
``..``, no NUL, at most 255 bytes in UTF-8); ``mode`` the permission bits; a file's content
is its ``chunks`` chunks of :data:`CHUNK_BYTES` bytes (the last one shorter), so ``chunks``
is ``ceil(size / CHUNK_BYTES)``.

:func:`parse` refuses (:class:`SnapshotDamaged`) anything else — a path leaving the home, a
part ``..``, a file under a file, a path twice, a count that does not add up, more entries or
bytes than the limits — so a forged or damaged manifest writes nothing.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from ..errors import ServiceError

#: the size of a chunk (bytes): a file is cut at fixed offsets of this size
CHUNK_BYTES = 64 * 1024
#: the length of a chunk's hash (SHA-256)
HASH_BYTES = 32
#: the longest name of one part and of a whole path (bytes, UTF-8; Linux's NAME_MAX, PATH_MAX)
NAME_MAX = 255
PATH_MAX = 4096
DIR, FILE = "dir", "file"


class SnapshotDamaged(ServiceError):
    """The stored snapshot of a user's home is malformed (a manifest that breaks the rules of
    :mod:`.snapshot_manifest`, a chunk missing or not matching its hash): nothing of it is
    written, the home is left as it was. 503: this node cannot serve the user until an
    operator restores the database (docs/data-and-durability.md §Home snapshots)."""
    status, code = 503, "home_snapshot_damaged"


@dataclass
class Entry:
    """One folder or file of a snapshot; ``hashes``: a file's chunk hashes, in order."""
    path: str
    kind: str
    mode: int
    size: int = 0
    hashes: list[bytes] = field(default_factory=list)

    def as_json(self) -> dict:
        if self.kind == DIR:
            return {"path": self.path, "kind": DIR, "mode": self.mode}
        return {"path": self.path, "kind": FILE, "mode": self.mode, "size": self.size,
                "chunks": len(self.hashes)}


def name_problem(name: str) -> str | None:
    """Why ``name`` cannot be one part of a snapshot's path, or None when it can: empty,
    ``.``/``..``, a ``/`` or NUL in it, not UTF-8 (a name the file system gave as bytes that
    do not decode: surrogates), or longer than :data:`NAME_MAX` bytes."""
    if name in ("", ".", ".."):
        return f"the name {name!r} is not a file name"
    if "/" in name or "\0" in name:
        return "a name holds '/' or NUL"
    try:
        size = len(name.encode("utf-8"))
    except UnicodeEncodeError:
        return "a name is not valid UTF-8"
    if size > NAME_MAX:
        return f"a name is longer than {NAME_MAX} bytes"
    return None


def chunk_count(size: int) -> int:
    return -(-size // CHUNK_BYTES)


def _int(value, name: str, where: str, top: int) -> int:
    if type(value) is not int or not 0 <= value <= top:
        raise SnapshotDamaged(f"{where}: {name} is not an integer in 0..{top}")
    return value


def _entry(i: int, raw, kinds: dict[str, str]) -> Entry:
    """Entry ``i`` of a manifest with its path and mode checked against the entries before
    it (``kinds``: path → kind); a file's size and chunks are the caller's to check."""
    where = f"entry {i}"
    if not isinstance(raw, dict) or not isinstance(raw.get("path"), str) \
            or raw.get("kind") not in (DIR, FILE):
        raise SnapshotDamaged(f"{where} is not an object with a path and a kind")
    path, kind = raw["path"], raw["kind"]
    where = f"entry {i} ({path[:100]!r})"
    keys = {"path", "kind", "mode"} | ({"size", "chunks"} if kind == FILE else set())
    if set(raw) != keys:
        raise SnapshotDamaged(f"{where} has the keys {sorted(raw)}, not {sorted(keys)}")
    parts = path.split("/")
    problem = next((p for p in map(name_problem, parts) if p), None)
    if problem or len(path.encode("utf-8", "surrogatepass")) > PATH_MAX:
        raise SnapshotDamaged(f"{where}: {problem or 'the path is too long'}")
    if path in kinds:
        raise SnapshotDamaged(f"{where} is listed twice")
    parent = "/".join(parts[:-1])
    if parent and kinds.get(parent) != DIR:
        raise SnapshotDamaged(f"{where} is not under a folder listed before it")
    kinds[path] = kind
    return Entry(path, kind, _int(raw["mode"], "mode", where, 0o7777))


def parse(entries, chunks, max_entries: int, max_bytes: int) -> list[Entry]:
    """The entries of a stored manifest, checked (module doc); ``chunks`` its hash list.
    Raises :class:`SnapshotDamaged` naming the first problem."""
    if not isinstance(entries, list) or not isinstance(chunks, list):
        raise SnapshotDamaged("the manifest's entries or chunks are not lists")
    if len(entries) > max_entries:
        raise SnapshotDamaged(f"the manifest lists {len(entries)} entries, over {max_entries}")
    out: list[Entry] = []
    kinds: dict[str, str] = {}
    total = used = 0
    for i, raw in enumerate(entries):
        entry = _entry(i, raw, kinds)
        if entry.kind == FILE:
            where = f"entry {i} ({entry.path[:100]!r})"
            entry.size = _int(raw["size"], "size", where, max_bytes)
            count = _int(raw["chunks"], "chunks", where, len(chunks) - used)
            if count != chunk_count(entry.size):
                raise SnapshotDamaged(f"{where}: {count} chunks for {entry.size} bytes")
            entry.hashes = chunks[used:used + count]
            used += count
            total += entry.size
            if total > max_bytes:
                raise SnapshotDamaged(f"the manifest holds more than {max_bytes} bytes")
        out.append(entry)
    if used != len(chunks):
        raise SnapshotDamaged(f"the manifest's files name {used} chunks, its list {len(chunks)}")
    if any(not isinstance(h, bytes) or len(h) != HASH_BYTES for h in chunks):
        raise SnapshotDamaged("a chunk hash is not 32 bytes")
    return out
