"""Which service process is this, and is another one still alive (docs: docs/operations.md
§Process lifetime, docs/data-and-durability.md).

Several service processes may serve one data dir (a rolling restart, two processes behind
nginx) and records in it name the process that owns them — a running turn, an event log, an
idempotency record. An owner is named by :func:`current`: ``"<pid>-<start>"``, the pid and
its start time in clock ticks since boot (``/proc/<pid>/stat`` field 22), so a pid reused by
another process after a crash is never taken for the owner. Liveness is for processes on
this host (the data dir is local, not shared between hosts).
"""
from __future__ import annotations

import os
from functools import cache
from pathlib import Path


def proc_start(pid) -> str | None:
    """Start time (clock ticks since boot) of a live, non-zombie process; None otherwise."""
    try:
        stat = Path(f"/proc/{int(pid)}/stat").read_text()
    except (OSError, TypeError, ValueError):
        return None
    fields = stat.rsplit(")", 1)[1].split()   # after "(comm)": state, ppid, ...
    return None if fields[0] in ("Z", "X") else fields[19]


def alive_pid(pid, started: str | None) -> bool:
    """Is process ``pid`` running and (``started`` given) the same process that started at
    ``started``?"""
    now = proc_start(pid)
    return now is not None and (started is None or now == started)


@cache
def _current(pid: int) -> str:
    return f"{pid}-{proc_start(pid)}"


def current() -> str:
    """This process's owner id, ``"<pid>-<start>"`` (stable for the process's life; a forked
    child gets its own)."""
    return _current(os.getpid())


def alive(owner: str | None) -> bool:
    """Is the process named by an owner id from :func:`current` still running? False for a
    malformed id (``None``, no ``-``), a dead pid, or a pid now used by another process."""
    if not owner or "-" not in owner:
        return False
    pid, _, started = owner.partition("-")
    return pid.isdigit() and started != "None" and alive_pid(int(pid), started)
