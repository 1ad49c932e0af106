"""Safe access to a directory a user's agent can write: the user's home and its run folder.

A user's Hermes process (and every command its tools run) may write anything in its home
(``data/users/<user_id>/``) and in its run folder (``data/runs/<user_id>/``): it can put a
symlink, a hardlink, a directory, a FIFO or a socket where the service keeps a file. The
service itself never follows such an entry. The rule, for everything the service reads or
writes there:

* **Folders are walked, not resolved.** :func:`open_dirs` opens a trusted folder (the data
  dir's ``users``/``runs``, configured by the admin) and then each name below it with
  ``O_DIRECTORY | O_NOFOLLOW`` relative to the folder before it (``openat(2)``), so a symlink
  anywhere on the way is refused (``ELOOP``/``ENOTDIR``) and the folder the service works in
  is pinned by its descriptor: renaming or swapping it afterwards does not move the service.
* **Files are opened by name inside a pinned folder, never followed.** :func:`read_file`
  opens with ``O_NOFOLLOW | O_NONBLOCK`` (a FIFO cannot block it, a socket cannot be opened:
  ``ENXIO``), checks with ``fstat`` that it is a regular file with one link (a hardlink to a
  file elsewhere has ``st_nlink > 1``) and reads at most ``limit`` bytes.
* **Files are written whole by a rename inside the pinned folder**
  (:func:`~hermes_service.files.atomic_write` with ``dir_fd``): the temp file is created
  with ``O_CREAT | O_EXCL | O_NOFOLLOW`` (a planted name is never opened) and renamed over
  the target's name, which replaces a symlink, a hardlink, a FIFO or a socket without
  touching what it pointed to; a directory in the way is removed first (:func:`write_file`).
* **Removal never follows:** :func:`remove` unlinks the name, or removes a directory with
  ``shutil.rmtree(dir_fd=...)`` (which does not follow symlinks inside it).

A folder the service must keep that is found to be something else is either repaired (the
planted entry removed and the service's folder or file made again) or refused with
:class:`HomeTampered` (409 ``home_tampered``). Sources: ``openat(2)``, ``open(2)``
(``O_NOFOLLOW``, ``O_NONBLOCK`` on a FIFO, ``ENXIO`` on a socket), ``rename(2)``,
``link(2)`` (``EXDEV``: no hardlink across mounts), Python ``os`` "paths relative to
directory descriptors" and ``shutil.rmtree.avoids_symlink_attacks``.
"""
from __future__ import annotations

import errno
import os
import shutil
import stat
from pathlib import Path

from .errors import ServiceError
from .files import atomic_write

DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
READ_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC
#: what the service reads of a small file of its own (markers, fingerprints)
SMALL = 64 * 1024


class HomeTampered(ServiceError):
    """A user's home or run folder holds something the service did not put there where it
    keeps a file or a folder (a symlink, a hardlink, a directory, a FIFO, a socket) and it
    could not be repaired. 409 Conflict (RFC 9110 §15.5.10): the request is fine, the state
    of the user's own home conflicts with it, and the user's agent made that state — not a
    server fault (5xx) and not a bad request (400). The detail names the entry and what it is."""
    status, code = 409, "home_tampered"


def kind(st: os.stat_result | None) -> str:
    """What an entry is, for messages: ``a symlink``, ``a directory``, ``a FIFO`` …"""
    if st is None:
        return "missing"
    mode = st.st_mode
    for test, name in ((stat.S_ISLNK, "a symlink"), (stat.S_ISDIR, "a directory"),
                       (stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket"),
                       (stat.S_ISCHR, "a device"), (stat.S_ISBLK, "a device")):
        if test(mode):
            return name
    if stat.S_ISREG(mode) and st.st_nlink > 1:
        return f"a file with {st.st_nlink} hard links"
    return "a regular file"


def plain(st: os.stat_result | None) -> bool:
    """Is ``st`` a regular file with exactly one name (no hardlink elsewhere)?"""
    return st is not None and stat.S_ISREG(st.st_mode) and st.st_nlink == 1


def lstat(dir_fd: int, name: str) -> os.stat_result | None:
    """``fstatat(dir_fd, name, AT_SYMLINK_NOFOLLOW)``; None when there is no such entry."""
    try:
        return os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except (FileNotFoundError, NotADirectoryError):
        return None


def remove(dir_fd: int, name: str) -> bool:
    """Remove entry ``name`` of the folder ``dir_fd`` whatever it is, following nothing (a
    directory with everything in it). Returns whether something was removed."""
    st = lstat(dir_fd, name)
    if st is None:
        return False
    try:
        if stat.S_ISDIR(st.st_mode):
            shutil.rmtree(name, dir_fd=dir_fd)
        else:
            os.unlink(name, dir_fd=dir_fd)
    except FileNotFoundError:
        return False
    return True


def _not_dir(exc: OSError) -> bool:
    return exc.errno in (errno.ELOOP, errno.ENOTDIR)


def open_dir(name: str, dir_fd: int, *, create: bool = False, repair: bool = False,
             mode: int = 0o700, where: str | None = None) -> int:
    """Open folder ``name`` inside ``dir_fd`` without following a symlink; returns its fd
    (the caller closes it). ``create``: make it (``mode``) when missing. ``repair``: an entry
    that is not a folder (a symlink, a file, a FIFO …) is removed and the folder made again.
    Raises FileNotFoundError (missing, not ``create``) or :class:`HomeTampered`."""
    for _ in range(4):
        try:
            return os.open(name, DIR_FLAGS, dir_fd=dir_fd)
        except FileNotFoundError:
            if not create:
                raise
            try:
                os.mkdir(name, mode, dir_fd=dir_fd)
            except FileExistsError:
                pass
        except OSError as exc:
            if not _not_dir(exc):
                raise
            if not (repair and create):
                raise HomeTampered(f"{where or name} is {kind(lstat(dir_fd, name))} where the "
                                   "service keeps a folder; it is not followed") from None
            remove(dir_fd, name)
    raise HomeTampered(f"{where or name} keeps being replaced while the service repairs it")


def open_dirs(base: Path, *names: str, create: bool = False, repair: bool = False,
              mode: int = 0o700) -> int:
    """Open the trusted folder ``base`` (the admin's path: followed as configured), then each
    of ``names`` below it with :func:`open_dir`; returns the last folder's fd. Raises
    FileNotFoundError, NotADirectoryError (``base``) or :class:`HomeTampered`."""
    fd = os.open(base, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    where = Path()           # named relative to base: no host path in a refusal's text
    try:
        for name in names:
            where = where / name
            nxt = open_dir(name, fd, create=create, repair=repair, mode=mode, where=str(where))
            os.close(fd)
            fd = nxt
    except BaseException:
        os.close(fd)
        raise
    return fd


def read_file(dir_fd: int, name: str, limit: int = SMALL, where: str | None = None
              ) -> bytes | None:
    """The content of the regular file ``name`` in folder ``dir_fd`` (at most ``limit``
    bytes), None when there is none. Never follows a symlink, never blocks on a FIFO, never
    reads through a hardlink. Raises :class:`HomeTampered` when the entry is anything but a
    regular file with one link, or is larger than ``limit``."""
    try:
        fd = os.open(name, READ_FLAGS, dir_fd=dir_fd)
    except FileNotFoundError:
        return None
    except OSError as exc:     # ELOOP: a symlink; ENXIO: a socket; EACCES …
        raise HomeTampered(f"{where or name} is {kind(lstat(dir_fd, name))} and cannot be read "
                           f"as the service's file ({exc.strerror})") from None
    try:
        st = os.fstat(fd)
        if not plain(st):
            raise HomeTampered(f"{where or name} is {kind(st)} where the service keeps a file")
        chunks, size = [], 0
        while size <= limit:
            chunk = os.read(fd, limit + 1 - size)
            if not chunk:
                break
            chunks.append(chunk)
            size += len(chunk)
        if size > limit:
            raise HomeTampered(f"{where or name} is larger than {limit} bytes")
        return b"".join(chunks)
    finally:
        os.close(fd)


def write_file(dir_fd: int, name: str, data: bytes | str, *, durable: bool = True,
               prefix: str | None = None) -> None:
    """Replace ``name`` in folder ``dir_fd`` with ``data`` by the one atomic-write rule
    (:func:`~hermes_service.files.atomic_write` with ``dir_fd``). Whatever entry had the name
    is replaced, not written through; a directory there is removed first. Raises OSError."""
    for _ in range(3):
        try:
            atomic_write(name, data, durable=durable, prefix=prefix, dir_fd=dir_fd)
            return
        except OSError as exc:
            if exc.errno not in (errno.EISDIR, errno.ENOTEMPTY, errno.EEXIST):
                raise
            remove(dir_fd, name)
    atomic_write(name, data, durable=durable, prefix=prefix, dir_fd=dir_fd)
