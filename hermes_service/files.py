"""Files written whole or not at all — the one atomic-write rule of the service
(docs/data-and-durability.md).

:func:`atomic_write` puts the new content in a temp file in the same folder (mode 0600),
flushes and fsyncs it, and renames it over the target, so a reader — or the next start after
``kill -9`` — sees the old file or the new one, never a part of either. With ``durable`` the
folder is fsynced too, so the new name also survives a power loss (the session registry, home
configs); throwaway files (run files, pid records) skip that.

With ``dir_fd`` the same rule works inside a folder held open by descriptor (a user's home
or run folder, which the user's agent can write: :mod:`hermes_service.homefs`): the target
is a name in that folder, the temp file is created there with ``O_CREAT | O_EXCL |
O_NOFOLLOW`` and renamed over the name with ``renameat(2)``, so no path is resolved again
and whatever entry had the name (a symlink, a hardlink, a FIFO) is replaced, never written
through.
"""
from __future__ import annotations

import os
import secrets
import tempfile
from pathlib import Path


def fsync_dir(path: Path) -> None:
    """Make the names in folder ``path`` durable (fsync the folder). Raises OSError."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write(path: Path | str, data: bytes | str, *, durable: bool = True,
                 prefix: str | None = None, dir_fd: int | None = None) -> Path:
    """Replace ``path`` with ``data`` (``str`` is written as UTF-8) atomically; see the module
    doc. The temp file is ``<prefix>XXXX.tmp`` (default prefix ``.<name>.``) in the target's
    folder and is removed if anything fails. With ``dir_fd``, ``path`` is a bare name in the
    folder open at ``dir_fd`` (module doc). Returns ``path``; raises OSError (``EISDIR``: a
    directory has the name)."""
    path = Path(path)
    payload = data.encode("utf-8") if isinstance(data, str) else data
    if dir_fd is not None:
        return _write_at(dir_fd, path, payload, durable, prefix)
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


_TEMP_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC


def _write_at(dir_fd: int, path: Path, payload: bytes, durable: bool, prefix: str | None) -> Path:
    name = path.name
    if str(path) != name or name in ("", ".", ".."):
        raise ValueError(f"with dir_fd the target must be a bare name, not {str(path)!r}")
    for _ in range(100):
        tmp = f"{prefix or f'.{name}.'}{secrets.token_hex(6)}.tmp"
        try:
            fd = os.open(tmp, _TEMP_FLAGS, 0o600, dir_fd=dir_fd)
            break
        except FileExistsError:
            continue
    else:
        raise FileExistsError(f"no free temp name for {name}")
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(payload)
            fh.flush()
            os.fsync(fh.fileno())
        os.rename(tmp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
    except BaseException:
        try:
            os.unlink(tmp, dir_fd=dir_fd)
        except OSError:
            pass
        raise
    if durable:
        os.fsync(dir_fd)
    return path
