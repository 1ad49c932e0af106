"""What the machine the service runs on offers (docs/scaling.md §Sizing a node): its cores and
memory as this process may use them — the CPU affinity and the cgroup v2 ``cpu.max`` quota;
``MemTotal`` and every ``memory.max`` from the process's cgroup up to the root — and the
memory available right now (``MemAvailable``, and what is left under each cgroup limit).

Read from ``/proc`` and ``/sys/fs/cgroup`` on each call (a few small files); a file that
cannot be read counts as no limit. Kept free of the rest of the service (the config and the
runners read it)."""
from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path

PROC = Path("/proc")
CGROUP_ROOT = Path("/sys/fs/cgroup")
MIB = 1024 * 1024


@dataclass(frozen=True)
class Machine:
    """``cores``: CPUs this process may run on (affinity, capped by the cgroup's ``cpu.max``);
    ``memory_mb``: memory it may use (MiB: ``MemTotal``, capped by the cgroups'
    ``memory.max``); ``memory_source``: ``meminfo`` or the cgroup whose limit is lower."""
    cores: int
    memory_mb: int
    memory_source: str = "meminfo"


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except OSError:
        return None


def meminfo(proc: Path = PROC) -> dict[str, int]:
    """``/proc/meminfo`` in MiB by field name (``MemTotal``, ``MemAvailable``, …)."""
    out: dict[str, int] = {}
    for line in (_read(proc / "meminfo") or "").splitlines():
        name, _, rest = line.partition(":")
        words = rest.split()
        if words and words[0].isdigit():
            out[name] = int(words[0]) // 1024          # kB
    return out


def cgroup_dirs(proc: Path = PROC, root: Path = CGROUP_ROOT) -> list[Path]:
    """This process's cgroup v2 folder and its ancestors up to (not including) the root,
    innermost first; empty without cgroup v2."""
    text = _read(proc / "self" / "cgroup") or ""
    rel = next((line[3:] for line in text.splitlines() if line.startswith("0::")), None)
    if rel is None:
        return []
    here = root / rel.lstrip("/")
    out = []
    while here != root and root in here.parents:
        out.append(here)
        here = here.parent
    return out


def _limit_mb(folder: Path) -> int | None:
    text = _read(folder / "memory.max")
    return int(text) // MIB if text and text.isdigit() else None


def cpu_quota(dirs: list[Path]) -> float | None:
    """The lowest ``cpu.max`` quota among ``dirs`` in CPUs (None: no quota)."""
    quotas = []
    for folder in dirs:
        words = (_read(folder / "cpu.max") or "").split()
        if len(words) == 2 and words[0].isdigit() and words[1].isdigit() and int(words[1]):
            quotas.append(int(words[0]) / int(words[1]))
    return min(quotas) if quotas else None


def probe(proc: Path = PROC, root: Path = CGROUP_ROOT) -> Machine:
    """The :class:`Machine` this process runs on."""
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cores = os.cpu_count() or 1
    dirs = cgroup_dirs(proc, root)
    quota = cpu_quota(dirs)
    if quota is not None:
        cores = max(1, min(cores, math.ceil(quota)))
    memory = meminfo(proc).get("MemTotal") or 1024
    source = "meminfo"
    for folder in dirs:
        limit = _limit_mb(folder)
        if limit is not None and limit < memory:
            memory, source = limit, f"cgroup {folder}"
    return Machine(cores=max(1, cores), memory_mb=memory, memory_source=source)


def available_mb(proc: Path = PROC, root: Path = CGROUP_ROOT) -> int | None:
    """Memory that can be had now (MiB): ``MemAvailable``, or less when a cgroup of this
    process is closer to its ``memory.max`` (limit − ``memory.current``). None when neither
    can be read."""
    found = meminfo(proc).get("MemAvailable")
    for folder in cgroup_dirs(proc, root):
        limit = _limit_mb(folder)
        current = _read(folder / "memory.current")
        if limit is not None and current and current.isdigit():
            left = max(0, limit - int(current) // MIB)
            found = left if found is None else min(found, left)
    return found
