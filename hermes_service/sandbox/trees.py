"""A sandbox's process tree (docs/sandbox.md): a sandbox's processes are not in the
launcher's process group, so they are found through ``/proc``: their memory and CPU, a signal
to each, the processes a turn left behind, and the rlimit that ended a process."""
from __future__ import annotations

import os
import signal
from pathlib import Path


def descendants(pid: int) -> list[int]:
    """Every descendant of ``pid`` (via ``/proc/<pid>/task/*/children``), parents first."""
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        try:
            tasks = os.listdir(f"/proc/{p}/task")
        except OSError:
            continue
        for t in tasks:
            try:
                kids = Path(f"/proc/{p}/task/{t}/children").read_text().split()
            except OSError:
                continue
            for k in kids:
                out.append(int(k))
                todo.append(int(k))
    return out


def tree_rss_mb(pid: int) -> float:
    """Resident memory of ``pid`` and all its descendants, in MiB."""
    total = 0
    for p in [pid, *descendants(pid)]:
        try:
            for line in Path(f"/proc/{p}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1])
                    break
        except (OSError, ValueError):
            continue
    return total / 1024


def tree_cpu_seconds(pid: int) -> float:
    """CPU time (user + system) of ``pid`` and its live descendants, in seconds."""
    tick = os.sysconf("SC_CLK_TCK")
    total = 0
    for p in [pid, *descendants(pid)]:
        try:
            fields = Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()
            total += int(fields[11]) + int(fields[12])
        except (OSError, ValueError, IndexError):
            continue
    return total / tick


def signal_tree(pid: int, sig: int) -> None:
    """Send ``sig`` to every descendant of ``pid`` (the processes inside a sandbox)."""
    for p in descendants(pid):
        try:
            os.kill(p, sig)
        except (ProcessLookupError, PermissionError):
            pass


def kill_strays(leader: int) -> int:
    """SIGKILL every process in the sandbox led by ``leader`` (its outer bwrap) except the
    command it started — Hermes, the sandbox's PID 1 (``--as-pid-1``): what tool commands
    left running, daemonized or not (orphans are re-parented to PID 1, so every one is a
    descendant of Hermes). Call it only while no turn runs there. Returns how many were
    killed."""
    try:
        main = int(Path(f"/proc/{leader}/task/{leader}/children").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 0
    strays = [p for p in descendants(main) if state(p) not in ("Z", None)]
    for p in strays:
        try:
            os.kill(p, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    return len(strays)


def zombies(leader: int) -> int:
    """How many zombies the sandbox led by ``leader`` holds: processes that ended under
    Hermes (its PID 1), which never reaps the orphans re-parented to it. Each takes a place
    of ``limits.processes`` until the Hermes process ends."""
    try:
        main = int(Path(f"/proc/{leader}/task/{leader}/children").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 0
    return sum(1 for p in descendants(main) if state(p) == "Z")


def state(pid: int) -> str | None:
    """A process's state letter (``Z``: a zombie, which PID 1 — Hermes — never reaps)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return None


def limit_signal(returncode: int | None) -> str | None:
    """Which rlimit ended a process, from its exit status (negative: the signal; a shell or
    bwrap reports 128 + signal): ``"cpu"`` (SIGXCPU), ``"file_size"`` (SIGXFSZ)."""
    if returncode is None:
        return None
    sig = -returncode if returncode < 0 else returncode - 128 if returncode > 128 else 0
    return {int(signal.SIGXCPU): "cpu", int(signal.SIGXFSZ): "file_size"}.get(sig)
