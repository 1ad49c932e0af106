"""One cgroup per sandbox (docs/sandbox.md §Limits): where this process may make them (a
delegated cgroup v2 subtree, or writable cgroup v1 hierarchies), their memory and process
limits, the events that say a limit was hit, their CPU time, and their removal."""
from __future__ import annotations

import functools
import os
import time
import uuid
from pathlib import Path

from .settings import Limits


class CgroupBase:
    """Where this process may make one cgroup per sandbox: ``kind`` ``"v2"`` (a cgroup v2
    subtree delegated to the service with the memory and pids controllers) or ``"v1"``
    (writable cgroup v1 ``memory`` and ``pids`` hierarchies, e.g. as root)."""

    def __init__(self, kind: str, dirs: dict[str, Path]):
        self.kind, self.dirs = kind, dirs

    def describe(self) -> str:
        where = ", ".join(f"{k} {v}" for k, v in self.dirs.items())
        return f"cgroup {self.kind} ({where}) for memory and processes"

    @staticmethod
    def why_not() -> str:
        return ("no cgroup is delegated to the service (systemd Delegate=yes gives one): "
                "rlimits only (per process: address space, processes of the service's user)")

    @classmethod
    @functools.lru_cache(maxsize=1)
    def find(cls) -> CgroupBase | None:
        try:
            lines = Path("/proc/self/cgroup").read_text().splitlines()
        except OSError:
            return None
        v1: dict[str, str] = {}
        v2 = None
        for line in lines:
            num, _, rest = line.partition(":")
            ctrls, _, path = rest.partition(":")
            if num == "0" and ctrls == "":
                v2 = path
            for c in ctrls.split(","):
                v1[c] = path
        if v2 is not None:
            found = cls._v2(Path("/sys/fs/cgroup") / v2.lstrip("/"))
            if found:
                return found
        dirs: dict[str, Path] = {}
        for ctrl in ("memory", "pids"):
            if ctrl not in v1:
                return None
            base = Path("/sys/fs/cgroup") / ctrl / v1[ctrl].lstrip("/")
            if not (base / "cgroup.procs").exists() or not os.access(base, os.W_OK):
                return None
            dirs[ctrl] = base
        if "cpuacct" in v1:       # optional: CPU time of the whole sandbox
            base = Path("/sys/fs/cgroup") / "cpuacct" / v1["cpuacct"].lstrip("/")
            if (base / "cgroup.procs").exists() and os.access(base, os.W_OK):
                dirs["cpuacct"] = base
        return cls("v1", dirs)

    @classmethod
    def _v2(cls, own: Path) -> CgroupBase | None:
        """A delegated v2 cgroup: ``own`` is writable and offers memory and pids. Processes
        may not sit in a cgroup whose children use controllers, so the service moves itself
        into a ``service`` leaf first and sandboxes go beside it."""
        try:
            if not (own / "cgroup.controllers").exists() or not os.access(own, os.W_OK):
                return None
            offered = (own / "cgroup.controllers").read_text().split()
            if "memory" not in offered or "pids" not in offered:
                return None
            enabled = (own / "cgroup.subtree_control").read_text().split()
            if not {"memory", "pids"} <= set(enabled):
                leaf = own / "service"
                leaf.mkdir(exist_ok=True)
                for pid in (own / "cgroup.procs").read_text().split():
                    try:
                        (leaf / "cgroup.procs").write_text(pid)
                    except OSError:
                        pass
                (own / "cgroup.subtree_control").write_text("+memory +pids")
            return cls("v2", {"memory": own, "pids": own})
        except OSError:
            return None

    def create(self, limits: Limits) -> Cgroup:
        name = f"hermes-sandbox-{uuid.uuid4().hex[:16]}"
        made: list[Path] = []
        try:
            for d in dict.fromkeys(self.dirs.values()):
                (d / name).mkdir()
                made.append(d / name)
            cg = Cgroup(self.kind, made, {k: v / name for k, v in self.dirs.items()})
            cg.set_limits(limits)
            return cg
        except OSError:
            for d in made:
                try:
                    d.rmdir()
                except OSError:
                    pass
            raise


class Cgroup:
    """One sandbox's cgroup(s): limits, counters, removal."""

    def __init__(self, kind: str, made: list[Path], by_ctrl: dict[str, Path]):
        self.kind, self.made, self.by = kind, made, by_ctrl

    @property
    def procs_files(self) -> list[str]:
        return [str(d / "cgroup.procs") for d in self.made]

    def set_limits(self, limits: Limits) -> None:
        mem = str(limits.memory_mb * 1024 * 1024)
        if self.kind == "v2":
            (self.by["memory"] / "memory.max").write_text(mem)
            for name, value in (("memory.swap.max", "0"), ("memory.oom.group", "1")):
                try:
                    (self.by["memory"] / name).write_text(value)
                except OSError:
                    pass
        else:
            (self.by["memory"] / "memory.limit_in_bytes").write_text(mem)
        (self.by["pids"] / "pids.max").write_text(str(limits.processes))

    def events(self) -> dict[str, int]:
        """``{"memory": oom kills, "processes": forks refused at pids.max}``."""
        out = {"memory": 0, "processes": 0}
        mem_file = "memory.events" if self.kind == "v2" else "memory.oom_control"
        for key, path, name in (("memory", self.by["memory"] / mem_file, "oom_kill"),
                                ("processes", self.by["pids"] / "pids.events", "max")):
            try:
                for line in path.read_text().splitlines():
                    k, _, v = line.partition(" ")
                    if k == name:
                        out[key] = int(v)
            except (OSError, ValueError):
                pass
        return out

    def cpu_seconds(self) -> float | None:
        """CPU time of every process that ran in the sandbox (exited ones too), seconds."""
        try:
            if self.kind == "v2":
                for line in (self.by["memory"] / "cpu.stat").read_text().splitlines():
                    if line.startswith("usage_usec "):
                        return int(line.split()[1]) / 1e6
            elif "cpuacct" in self.by:
                return int((self.by["cpuacct"] / "cpuacct.usage").read_text()) / 1e9
        except (OSError, ValueError):
            pass
        return None


    def remove(self) -> None:
        """Kill what is left (v2 ``cgroup.kill``) and remove the cgroup(s)."""
        for d in self.made:
            if self.kind == "v2":
                try:
                    (d / "cgroup.kill").write_text("1")
                except OSError:
                    pass
            for _ in range(50):
                try:
                    d.rmdir()
                    break
                except FileNotFoundError:
                    break
                except OSError:
                    time.sleep(0.02)
