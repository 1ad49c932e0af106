"""bubblewrap's argument list read back as what it builds: the mounts of the sandbox in
order (which path is writable, from which host source), the namespaces unshared, the
privileges dropped (bwrap(1): each option's arity and effect).

Tests of the launcher's *meaning* use it (tests/unit/sandbox/test_args_meaning.py): a rule
such as "the Hermes venv is never writable" reads ``view.writable("/opt/venv/lib/x")``,
so a slip made together with an update of a copied argument list is still caught."""
from __future__ import annotations

from dataclasses import dataclass, field

#: options without a value
FLAGS = {"--unshare-user", "--unshare-user-try", "--unshare-pid", "--unshare-ipc",
         "--unshare-uts", "--unshare-cgroup", "--unshare-cgroup-try", "--unshare-net",
         "--unshare-all", "--share-net", "--disable-userns", "--assert-userns-disabled",
         "--die-with-parent", "--new-session", "--as-pid-1", "--clearenv"}
#: options with one value
ONE = {"--uid", "--gid", "--hostname", "--cap-drop", "--cap-add", "--proc", "--dev",
       "--tmpfs", "--mqueue", "--remount-ro", "--chdir", "--seccomp", "--add-seccomp-fd",
       "--args", "--size", "--perms", "--dir", "--unsetenv", "--lock-file", "--sync-fd",
       "--info-fd", "--json-status-fd", "--block-fd", "--userns-block-fd", "--userns",
       "--userns2", "--pidns", "--exec-label", "--file-label", "--argv0", "--level-prefix"}
#: options with two values
TWO = {"--bind", "--ro-bind", "--dev-bind", "--bind-try", "--ro-bind-try", "--dev-bind-try",
       "--symlink", "--setenv", "--file", "--bind-data", "--ro-bind-data", "--chmod",
       "--bind-fd", "--ro-bind-fd"}
WRITABLE_BINDS = {"--bind", "--dev-bind", "--bind-try", "--dev-bind-try", "--bind-fd"}
READ_ONLY_BINDS = {"--ro-bind", "--ro-bind-try", "--ro-bind-fd"}


@dataclass
class Mount:
    dest: str
    kind: str            # "bind", "tmpfs", "proc", "dev", "root"
    writable: bool
    source: str | None = None
    size: str | None = None   # --size given right before a tmpfs


@dataclass
class View:
    mounts: list[Mount] = field(default_factory=list)
    flags: set[str] = field(default_factory=set)
    values: dict[str, list[str]] = field(default_factory=dict)
    unknown: list[str] = field(default_factory=list)

    def mount_of(self, path: str) -> Mount:
        """The mount a path inside the sandbox lies on: the last one made at the longest
        prefix of ``path``."""
        best = self.mounts[0]
        for m in self.mounts:
            if _under(path, m.dest) and len(m.dest) >= len(best.dest):
                best = m
        return best

    def writable(self, path: str) -> bool:
        return self.mount_of(path).writable

    def writable_mounts(self) -> list[Mount]:
        """Every mount still writable once all options apply (the last at each path)."""
        last: dict[str, Mount] = {}
        for m in self.mounts:
            last[m.dest] = m
        return [m for m in last.values() if m.writable and m.kind != "proc"]

    def namespaces(self) -> set[str]:
        return {f.removeprefix("--unshare-").removesuffix("-try")
                for f in self.flags if f.startswith("--unshare-")}


def _under(path: str, dest: str) -> bool:
    return dest == "/" or path == dest or path.startswith(dest.rstrip("/") + "/")


def read(args: list[str]) -> View:
    """The :class:`View` of a bubblewrap option list (what ``--args`` holds). An option the
    reader does not know is listed in ``unknown`` (a test fails on it rather than guess)."""
    view = View(mounts=[Mount("/", "root", True)])
    size = None
    i = 0
    while i < len(args):
        opt = args[i]
        if opt in FLAGS:
            view.flags.add(opt)
            i += 1
            continue
        if opt in ONE:
            value = args[i + 1]
            view.values.setdefault(opt, []).append(value)
            if opt == "--size":
                size = value
            elif opt == "--tmpfs":
                view.mounts.append(Mount(value, "tmpfs", True, size=size))
            elif opt in ("--proc", "--dev"):
                view.mounts.append(Mount(value, opt[2:], opt == "--dev"))
            elif opt == "--remount-ro":
                hit = [m for m in view.mounts if m.dest == value]
                if not hit:
                    view.unknown.append(f"--remount-ro {value}: no mount there")
                else:
                    hit[-1].writable = False
            if opt not in ("--size", "--perms"):
                size = None
            i += 2
            continue
        if opt in TWO:
            src, dest = args[i + 1], args[i + 2]
            view.values.setdefault(opt, []).append(f"{src} {dest}")
            if opt in WRITABLE_BINDS | READ_ONLY_BINDS:
                view.mounts.append(Mount(dest, "bind", opt in WRITABLE_BINDS, source=src))
            size = None
            i += 3
            continue
        view.unknown.append(opt)
        i += 1
    return view
