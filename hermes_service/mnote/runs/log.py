"""Durable event logs of runs, shared by every service process on a data dir
(docs/data-and-durability.md §Runs and their events; client-proxy contract §2 GET /events).

Layout, under ``<data_dir>/run-events/`` (0700; files 0600; only the service writes here — the
users' agents never see this folder, unlike ``data/runs/<user_id>/``):

``<run_id>.jsonl``
    one run's event log, append-only JSON Lines. Line 1 is the run's meta record::

        {"meta": {"run_id", "session_id", "session_key", "actor_id", "trace_id",
                  "owner", "created"}}

    (``owner``: :func:`hermes_service.instance.current` of the process running the turn;
    ``created``: unix seconds). Every further line is one event payload exactly as the stream
    sends it (:mod:`hermes_service.mnote.runs.manager` lists them); the event's id
    (``Last-Event-ID``) is its line number after the meta line (1-based). Deltas are appended
    without fsync; the terminal event (``run.completed`` / ``run.failed`` / ``run.cancelled``)
    is fsynced before any subscriber sees it. Only complete lines (ending in ``\\n``) count: a
    line torn by a crash mid-write is never read, and is cut off (under the lock below) before
    a closer appends. The file's mtime after the terminal event is the run's end (retention).
``<run_id>.requests``
    requests from other processes for the owner (JSON Lines, appended with ``O_APPEND``):
    ``{"op": "abort"}``, ``{"op": "approval", "approval_id", "choice"}``,
    ``{"op": "clarify", "clarify_id", "answer"}``. The owner's poller applies them.
``<run_id>.<question_id>.answer``
    the one answer a question of the run got (``{"value", "resolved_by"}``), made with
    ``link(2)`` of a complete temp file, which fails if the name exists (:meth:`RunLogs.claim`):
    whoever links it first — the owner answering a user or timing out, another process
    answering a user — wins; every other answer gets 409 (docs/data-and-durability.md
    §Runs and their events, "Exactly one answer").
``sessions/<sha256(session_key)[:32]>``
    the run last started on a session (its ``run_id``), written under ``sessions.lock``
    (filelock) together with the busy check: a session whose indexed run is not terminal and
    whose owner lives is busy in every process.

**Exactly one terminal event.** The owner writes the terminal event of its runs. A run whose
owner is dead (:func:`hermes_service.instance.alive` False) and whose log has no terminal
event is closed by :meth:`RunLogs.close_interrupted` with ``run.failed`` code
``run_interrupted``: under an exclusive ``flock`` on the run file, re-reading the last line,
so two processes noticing at once write it once.

Run ids become file names only through :func:`valid_run_id` (the id rule of
:func:`hermes_service.errors.is_id` plus the shape ``run_<24 hex>`` every run gets).

One module over 500 lines on purpose: the file format, its writer, its readers, the exactly-once
close, the session index and the answers' claims all rest on one locking rule on the same files
(``flock`` on the run file, the sessions lock); apart, each would have to restate it.
"""
from __future__ import annotations

import errno
import fcntl
import hashlib
import json
import logging
import os
import re
import stat
import time
from dataclasses import dataclass, field
from pathlib import Path

from filelock import FileLock

from ... import instance
from ...errors import is_id
from .. import metrics

log = logging.getLogger("hermes_service.run_log")

TERMINAL = ("run.completed", "run.failed", "run.cancelled")
RUN_ID = re.compile(r"run_[0-9a-f]{24}")
QUESTION_ID = re.compile(r"(apr|clq)_[0-9a-f]{24}")
INTERRUPTED = "run_interrupted"
INTERRUPTED_DETAIL = ("the service process running this run stopped before the run ended "
                      "(crash, kill -9 or power loss); the turn was not answered")
#: the meta line is at most this long (ids are at most 128 characters each)
META_LIMIT = 8192


def valid_run_id(run_id) -> bool:
    """True for an id this service could have issued (``run_<24 hex>``, an id by the one id
    rule): the only run ids that ever become a path."""
    return is_id(run_id) and RUN_ID.fullmatch(run_id) is not None


@dataclass
class LogState:
    """What a reader has of one run file: its run id, its meta record, the events of its
    complete lines, the byte offset after the last complete line, and the file's mtime when
    read."""
    run_id: str
    meta: dict
    events: list = field(default_factory=list)
    offset: int = 0
    mtime: float = 0.0
    size: int = 0          # the file's size when last read (a torn tail is past ``offset``)

    @property
    def done(self) -> bool:
        return bool(self.events) and self.events[-1].get("event") in TERMINAL


def _parse_lines(data: bytes) -> tuple[list[dict], int]:
    """The JSON objects of the complete lines of ``data`` and how many bytes they span (a torn
    last line, without its ``\\n``, is left out). A complete line that does not parse is
    skipped (logged)."""
    end = data.rfind(b"\n") + 1
    out = []
    for line in data[:end].splitlines():
        try:
            obj = json.loads(line)
        except (ValueError, RecursionError):     # nested beyond the parser: damaged too
            log.warning("skipped a damaged line in a run event log")
            continue
        if isinstance(obj, dict):
            out.append(obj)
    return out, end


class RunWriter:
    """The owner's append handle of one run file (:meth:`RunLogs.create`)."""

    def __init__(self, fd: int):
        self.fd = fd

    def append(self, event: dict, durable: bool = False) -> None:
        """Append one event line (one ``write``); ``durable``: fsync before returning (the
        terminal event), then the file is closed. A line that cannot be written whole (a
        full disk) is cut off again, so the file still ends with a whole line, and OSError
        raised: the caller may append it again later."""
        self.append_line(_line(event), durable)

    def append_line(self, data: bytes, durable: bool = False) -> None:
        """:meth:`append` of a line already encoded."""
        start = os.lseek(self.fd, 0, os.SEEK_END)
        view = memoryview(data)
        try:
            while view:
                view = view[os.write(self.fd, view):]
            if durable:
                os.fsync(self.fd)
        except OSError:
            try:
                os.ftruncate(self.fd, start)
            except OSError:
                pass
            raise
        if durable:
            self.close()

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


class RunLogs:
    """The run event logs of a data dir (module doc). Thread-safe; every method works from the
    files, so any process on the data dir sees the same runs."""

    def __init__(self, root: Path):
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True, mode=0o700)
        (self.root / "sessions").mkdir(exist_ok=True, mode=0o700)
        self._sessions_lock = FileLock(str(self.root / "sessions.lock"), timeout=30)

    # -- paths ----------------------------------------------------------------------------
    def path(self, run_id: str) -> Path | None:
        """The run file of ``run_id``; None for an id the service never issues."""
        return self.root / f"{run_id}.jsonl" if valid_run_id(run_id) else None

    def _requests_path(self, run_id: str) -> Path | None:
        return self.root / f"{run_id}.requests" if valid_run_id(run_id) else None

    def _claim_path(self, run_id: str, question_id: str) -> Path | None:
        if not valid_run_id(run_id) or not QUESTION_ID.fullmatch(str(question_id)):
            return None
        return self.root / f"{run_id}.{question_id}.answer"

    def _index_path(self, session_key: str) -> Path:
        return self.root / "sessions" / hashlib.sha256(session_key.encode()).hexdigest()[:32]

    # -- writing ----------------------------------------------------------------------------
    def create(self, meta: dict) -> RunWriter:
        """Create the run file of ``meta["run_id"]`` with its meta line (fsynced, with the
        folder, so the run exists for every process before anyone is told its id)."""
        path = self.path(meta["run_id"])
        if path is None:
            raise ValueError(f"not a run id: {meta['run_id']!r}")
        fd = _open_file(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_EXCL)
        writer = RunWriter(fd)
        try:
            writer.append({"meta": meta})
            os.fsync(fd)
            self._fsync_dir()
        except BaseException:          # a full disk: no run, and no empty file left
            writer.close()
            path.unlink(missing_ok=True)
            raise
        return writer

    def _fsync_dir(self) -> None:
        fd = os.open(self.root, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    # -- reading ----------------------------------------------------------------------------
    def load(self, run_id: str) -> LogState | None:
        """The whole run file (meta + events); None when there is none (or no valid meta)."""
        fd = self._open_run(run_id)
        if fd is None:
            return None
        try:
            st = os.fstat(fd)
            data = _read_all(fd)
        finally:
            os.close(fd)
        lines, end = _parse_lines(data)
        if not lines or not isinstance(lines[0].get("meta"), dict):
            return None
        return LogState(run_id, lines[0]["meta"], lines[1:], end, st.st_mtime, len(data))

    def _open_run(self, run_id: str) -> int | None:
        """A descriptor of run ``run_id``'s file opened to read (never through a symlink:
        :func:`_open_file`), or None when there is none."""
        path = self.path(run_id)
        if path is None:
            return None
        try:
            return _open_file(path, os.O_RDONLY)
        except OSError:
            return None

    def read_more(self, state: LogState) -> bool:
        """Add the events appended since ``state.offset``; returns whether there were any."""
        fd = self._open_run(state.run_id)
        if fd is None:
            return False
        try:
            st = os.fstat(fd)
            if st.st_size == state.size:
                return False
            os.lseek(fd, state.offset, os.SEEK_SET)
            data = _read_all(fd)
        finally:
            os.close(fd)
        lines, end = _parse_lines(data)
        state.size = state.offset + len(data)
        state.offset += end
        state.mtime = st.st_mtime
        state.events.extend(lines)
        return bool(lines)

    def size(self, run_id: str) -> int:
        """The run file's size now (the follow poller's cheap check); -1 when gone or no
        longer a regular file (replaced by a symlink, FIFO …: never followed)."""
        path = self.path(run_id)
        if path is None:
            return -1
        try:
            st = os.lstat(path)
        except OSError:
            return -1
        return st.st_size if stat.S_ISREG(st.st_mode) else -1

    def run_ids(self) -> list[str]:
        """The ids of every run file."""
        try:
            names = os.listdir(self.root)
        except OSError:
            return []
        return sorted(n[:-6] for n in names if n.endswith(".jsonl") and valid_run_id(n[:-6]))

    # -- closing interrupted runs ------------------------------------------------------------
    def close_interrupted(self, run_id: str) -> bool:
        """Close a run whose owner is dead with ``run.failed`` ``run_interrupted`` (fsynced).
        Exactly once across threads and processes: under an exclusive ``flock`` on the run
        file the last complete line is re-read and nothing is written if it is terminal or
        the owner lives. A torn last line (a crash mid-write) is cut off first. Returns True
        if this call wrote the terminal event."""
        path = self.path(run_id)
        if path is None:
            return False
        try:
            fd = _open_file(path, os.O_RDWR | os.O_APPEND)
        except OSError:
            return False
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            data = _read_all(fd)
            lines, end = _parse_lines(data)
            if not lines or not isinstance(lines[0].get("meta"), dict):
                return False
            meta, events = lines[0]["meta"], lines[1:]
            if events and events[-1].get("event") in TERMINAL:
                return False
            if instance.alive(meta.get("owner")):
                return False
            if end < len(data):        # a torn line: the owner died writing it
                os.ftruncate(fd, end)
            RunWriter(fd).append({"event": "run.failed", "run_id": run_id,
                                  "session_id": meta.get("session_id"), "code": INTERRUPTED,
                                  "error": INTERRUPTED_DETAIL})
            os.fsync(fd)
        finally:
            os.close(fd)         # releases the flock
        metrics.run_interrupted()
        log.warning("closed run %s with run.failed run_interrupted: its service process (%s) "
                    "is gone", run_id, meta.get("owner"))
        return True

    def close_dead(self) -> int:
        """Close every run of the data dir whose owner is dead (at start; the retention
        pass). Returns how many this call closed."""
        closed = 0
        for run_id in self.run_ids():
            head = self._head(run_id)
            if head is None or head[1] or instance.alive(head[0].get("owner")):
                continue
            closed += self.close_interrupted(run_id)
        return closed

    def _head(self, run_id: str) -> tuple[dict, bool, float] | None:
        """(meta, done, mtime) from the first line and the last complete line only."""
        path = self.path(run_id)
        try:
            fd = _open_file(path, os.O_RDONLY)
        except (OSError, TypeError):
            return None
        try:
            st = os.fstat(fd)
            first = os.pread(fd, META_LIMIT, 0)
            meta_lines, _ = _parse_lines(first[:first.find(b"\n") + 1])
            if not meta_lines or not isinstance(meta_lines[0].get("meta"), dict):
                return None
            last = _last_line(fd, st.st_size)
        finally:
            os.close(fd)
        done = isinstance(last, dict) and last.get("event") in TERMINAL
        return meta_lines[0]["meta"], done, st.st_mtime

    # -- retention --------------------------------------------------------------------------
    def sweep(self, retention: float, dry_run: bool = False, now: float | None = None) -> int:
        """Delete the run files (and request files) of runs that ended more than
        ``retention`` seconds ago (the file's mtime is the terminal event's write); close runs
        of dead owners on the way (they are kept for ``retention`` from now). Index files of
        sessions whose run is gone go too. Returns how many run files were (or would be)
        deleted."""
        cutoff = (time.time() if now is None else now) - retention
        removed = 0
        for run_id in self.run_ids():
            head = self._head(run_id)
            if head is None:
                continue
            meta, done, mtime = head
            if not done:
                if not dry_run and not instance.alive(meta.get("owner")):
                    self.close_interrupted(run_id)
                continue
            if mtime >= cutoff:
                continue
            removed += 1
            if not dry_run:
                self._delete(run_id)
        if not dry_run:
            self._sweep_sessions()
        return removed

    def _delete(self, run_id: str) -> None:
        """Delete run ``run_id``'s files: its log, its request file, its answers."""
        answers = list(self.root.glob(f"{run_id}.*.answer*"))
        for p in (self.path(run_id), self._requests_path(run_id), *answers):
            if p is None:
                continue
            try:
                p.unlink()
            except FileNotFoundError:
                pass

    def _sweep_sessions(self) -> None:
        """Delete the index files of sessions whose run is gone."""
        with self._sessions_lock:
            for entry in os.scandir(self.root / "sessions"):
                indexed = _read_small(Path(entry.path))
                path = self.path(indexed) if indexed is not None else None
                if path is None or not path.exists():
                    try:
                        os.unlink(entry.path)
                    except OSError:      # not a file (a damaged data dir): left, logged
                        log.warning("run-events/sessions/%s is not a file; left as is",
                                    entry.name)

    # -- sessions: busy across processes ------------------------------------------------------
    def claim_session(self, session_key: str, run_id: str, owner: str,
                      local_busy=None) -> str | None:
        """Record ``run_id`` as the active run of ``session_key`` unless another run is
        active on it in any process: returns that run's id instead (nothing recorded). A
        recorded run that is terminal, gone, of another session (a damaged index; its id is
        never answered) or whose owner is dead does not hold the session
        (a dead owner's run is closed here, :meth:`close_interrupted`). ``owner``: the
        caller's owner id; ``local_busy(run_id)`` (optional): the caller's own view of a run
        it owns (True: still active)."""
        index = self._index_path(session_key)
        with self._sessions_lock:
            current = _read_small(index)
            if current and current != run_id and valid_run_id(current):
                head = self._head(current)
                if head is not None and head[0].get("session_key") != session_key:
                    head = None      # a damaged index names another session's run: not ours
                if head is not None and not head[1]:
                    if head[0].get("owner") == owner:
                        if local_busy is None or local_busy(current):
                            return current
                    elif instance.alive(head[0].get("owner")):
                        return current
                    else:
                        self.close_interrupted(current)
            tmp = index.with_name(f".{index.name}.{os.getpid()}.tmp")
            try:
                tmp.write_text(run_id)
                os.replace(tmp, index)
            except BaseException:      # a full disk: nothing half-written left behind
                tmp.unlink(missing_ok=True)
                raise
        return None

    # -- exactly one answer per question -------------------------------------------------------
    def claim(self, run_id: str, question_id: str, answer: dict) -> dict | None:
        """Claim the answer to a question of a run: None when ``answer`` is now its answer,
        else the answer that won before (every process on the data dir sees the same
        winner). The file is written whole under a temp name and linked to its name
        (``link(2)`` fails with ``EEXIST`` if it exists), so a reader never sees half of
        it. Raises ValueError for an id the service never issues, OSError (disk)."""
        path = self._claim_path(run_id, question_id)
        if path is None:
            raise ValueError(f"not a question of a run: {question_id!r}")
        tmp = path.with_name(f"{path.name}.{os.getpid()}.{time.monotonic_ns()}.tmp")
        fd = _open_file(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL)
        try:
            os.write(fd, _line(answer))
            os.fsync(fd)
        finally:
            os.close(fd)
        try:
            os.link(tmp, path)
            self._fsync_dir()
            return None
        except FileExistsError:
            return self.claimed(run_id, question_id) or {"value": None, "resolved_by": None}
        finally:
            tmp.unlink(missing_ok=True)

    def claimed(self, run_id: str, question_id: str) -> dict | None:
        """The answer that won a question (:meth:`claim`), or None when none has."""
        path = self._claim_path(run_id, question_id)
        text = _read_small(path, 64 * 1024) if path is not None else None
        try:
            won = json.loads(text) if text else None
        except ValueError:
            return None
        return won if isinstance(won, dict) else None

    # -- requests to the owner ----------------------------------------------------------------
    def request(self, run_id: str, op: dict) -> None:
        """Append a request for the run's owner (abort, an answer); one ``O_APPEND`` write."""
        path = self._requests_path(run_id)
        if path is None:
            raise OSError(errno.EINVAL, "not a run id the service issues", run_id)
        fd = _open_file(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
        try:
            os.write(fd, _line(op))    # other processes append here too: never cut back
        except OSError:                # a full disk: no empty request file left behind
            if os.fstat(fd).st_size == 0:
                path.unlink(missing_ok=True)
            raise
        finally:
            os.close(fd)

    def requests_since(self, run_id: str, offset: int) -> tuple[list[dict], int]:
        """The requests appended after byte ``offset`` and the new offset."""
        path = self._requests_path(run_id)
        try:
            fd = _open_file(path, os.O_RDONLY)
        except (OSError, TypeError):
            return [], offset
        try:
            if os.fstat(fd).st_size <= offset:
                return [], offset
            os.lseek(fd, offset, os.SEEK_SET)
            data = _read_all(fd)
        finally:
            os.close(fd)
        ops, end = _parse_lines(data)
        return ops, offset + end

    def requests_size(self, run_id: str) -> int:
        path = self._requests_path(run_id)
        try:
            return os.stat(path).st_size if path is not None else 0
        except OSError:
            return 0


def _line(obj: dict) -> bytes:
    """One JSON line, UTF-8; an object whose strings hold a lone surrogate (a streamed delta
    may), which UTF-8 cannot carry, with ``\\uXXXX`` escapes instead (it reads back the same)."""
    text = json.dumps(obj, ensure_ascii=False, separators=(",", ":"))
    try:
        return text.encode() + b"\n"
    except UnicodeEncodeError:
        return json.dumps(obj, separators=(",", ":")).encode() + b"\n"


def _open_file(path, flags: int) -> int:
    """Open a file of this folder (``flags`` plus never through a symlink, never blocking, not
    inherited; created 0600). Only a regular file is used: a FIFO, folder, socket or device
    found under the name (a damaged or tampered data dir) raises OSError like a missing file,
    so no request or start ever waits on it."""
    fd = os.open(path, flags | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, 0o600)
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise OSError(errno.EINVAL, "not a regular file", str(path))
    return fd


def _read_all(fd: int) -> bytes:
    chunks: list[bytes] = []
    while True:
        chunk = os.read(fd, 1 << 20)
        if not chunk:
            return b"".join(chunks)
        chunks.append(chunk)


def _read_small(path: Path, limit: int = 200) -> str | None:
    """The text of a small regular file (an index entry, an answer), at most ``limit``
    bytes, or None (missing, not a regular file, not UTF-8)."""
    try:
        fd = _open_file(path, os.O_RDONLY)
    except OSError:
        return None
    try:
        return os.read(fd, limit).decode().strip() or None
    except (OSError, UnicodeDecodeError):
        return None
    finally:
        os.close(fd)


def _last_line(fd: int, size: int, chunk: int = 65536) -> dict | None:
    """The JSON object of the file's last complete line (read backwards from ``size``; a torn
    tail after the last ``\\n`` is ignored), or None."""
    buf, pos = b"", size
    while pos > 0:
        step = min(chunk, pos)
        pos -= step
        buf = os.pread(fd, step, pos) + buf
        end = buf.rfind(b"\n")
        if end < 0:
            continue
        start = buf.rfind(b"\n", 0, end)
        if start < 0 and pos > 0:
            continue
        try:
            obj = json.loads(buf[start + 1:end])
        except (ValueError, RecursionError):
            return None
        return obj if isinstance(obj, dict) else None
    return None

