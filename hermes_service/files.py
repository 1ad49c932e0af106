"""Files written whole or not at all — the one atomic-write rule of the service (README
§Data and durability).

:func:`atomic_write` puts the new content in a temp file in the same folder (mode 0600),
flushes and fsyncs it, and renames it over the target, so a reader — or the next start after
``kill -9`` — sees the old file or the new one, never a part of either. With ``durable`` the
folder is fsynced too, so the new name also survives a power loss (the session registry, home
configs); throwaway files (run files, pid records) skip that.
"""
from __future__ import annotations

import os
import tempfile
from pathlib import Path


def fsync_dir(path: Path) -> None:
    """Make the names in folder ``path`` durable (fsync the folder). Raises OSError."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write(path: Path, data: bytes | str, *, durable: bool = True,
                 prefix: str | None = None) -> Path:
    """Replace ``path`` with ``data`` (``str`` is written as UTF-8) atomically; see the module
    doc. The temp file is ``<prefix>XXXX.tmp`` (default prefix ``.<name>.``) in the target's
    folder and is removed if anything fails. Returns ``path``; raises OSError."""
    path = Path(path)
    payload = data.encode("utf-8") if isinstance(data, str) else data
    fd, tmp = tempfile.mkstemp(prefix=prefix or f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(payload)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    if durable:
        fsync_dir(path.parent)
    return path
