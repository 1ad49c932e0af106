"""The one launcher of every Hermes process: CLI turns, warm ``hermes acp`` processes and
their pre-warm, ``/api/v1/execute``, ``hermes --version`` and ``gc``'s transcript deletion
(docs: docs/sandbox.md).

**Modes** (``hermes.sandbox.mode``):

* ``bwrap`` — every Hermes process runs in a bubblewrap sandbox; a host where bubblewrap
  cannot start one is a problem at ``check-config`` and start (:func:`problems`).
* ``auto`` (default) — the sandbox whenever bubblewrap works here; otherwise processes run
  unconfined, which ``check-config``, the start log and ``/health`` say (never silently),
  and host-reaching toolsets are refused exactly as under ``none``.
* ``none`` — unconfined (the service's own OS account, the whole host visible); toolsets
  that reach the host (:data:`HOST_TOOLSETS`) need ``hermes.sandbox.allow_host_tools: true``.

**What a sandboxed process sees** (:meth:`Sandbox.prepare`): its home read-write at
:data:`HOME` (the same path for every user), with the service-written ``config.yaml`` and
``plugins/`` read-only over it; its run folder (``<data>/runs/<user_id>``) read-write at
:data:`RUN_DIR`; the runtime read-only (``/usr`` and the merged ``/bin``/``/lib``…, the
Hermes venv and its base interpreter at their own paths — venv scripts name them —, the
service's ``hermes_site`` at :data:`SITE_DIR`, CA certificates, ``resolv.conf``, ``hosts``,
a one-user ``passwd``/``group``); a private size-capped ``/tmp``; a minimal ``/dev``; its own
user, PID, IPC, UTS and cgroup namespaces (``/proc`` lists only its own processes), no
capabilities, no nested user namespaces, ``--die-with-parent``, ``--new-session``, a seccomp
filter (:mod:`hermes_service.seccomp_filter`), and Hermes itself as the sandbox's PID 1
(``--as-pid-1``: no bubblewrap init holding the service's pipes beside it; Hermes makes
itself non-dumpable and its streams private at start, hermes_site/sitecustomize.py), so no
tool process reaches Hermes's memory or descriptors, nor a process that holds them; the
policy files of the home read-only or empty (:mod:`hermes_service.hermes_policy`). The
network is the sandbox's own or the host's (``hermes.sandbox.network``; docs/sandbox.md
§Network). bwrap's own arguments (the host paths it binds) reach it through a memfd
(``--args``), never its command line; ``/proc/1/cmdline`` inside is Hermes's, which names
the Hermes venv by its host path (bound read-only at that same path) and, on the CLI
runner, holds the message. bwrap is started with the sandbox's own clean environment, so
no process there holds anything of the service's environment.

**Limits** (``hermes.sandbox.limits``): rlimits set inside the sandbox by util-linux
``prlimit`` for every process there (CPU seconds, largest file, open files, no core
files; processes and address space too when no cgroup takes them), and — where this
process may create cgroups (cgroup v2 delegated to the service, e.g. systemd
``Delegate=yes``, or a writable cgroup v1 ``memory``/``pids`` hierarchy) — one cgroup per
sandbox for memory and processes, whose ``oom_kill`` / ``pids`` ``max`` events
:meth:`Launch.limit_hit` reports so the runner ends the turn with ``run_limit_exceeded``.
"""
from __future__ import annotations

import functools
import logging
import os
import shutil
import signal
import subprocess
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol
from urllib.parse import urlsplit

from . import hermes_policy, homefs, sandbox_net, seccomp_filter
from .egress_policy import Policy, Rule

log = logging.getLogger("hermes_service.sandbox")

#: The environment variables a Hermes home's config.yaml names for the model: the
#: pass-through endpoint's URL and this process's credential there (user_homes.py).
MODEL_URL_ENV = "HERMES_SERVICE_MODEL_URL"
MODEL_KEY_ENV = "HERMES_SERVICE_MODEL_KEY"

MODES = ("auto", "bwrap", "none")
#: ``hermes.sandbox.network``: ``isolated`` — a network namespace of its own per sandbox,
#: the service reached over Unix sockets (:mod:`hermes_service.sandbox_net`); ``host`` — the
#: host's network, as an unconfined process has.
NETWORKS = ("isolated", "host")
#: Paths inside the sandbox (the same for every user: nothing in a transcript or a tool's
#: output tells one user's home from another's or where the data dir is).
HOME = "/home/hermes"
RUN_DIR = "/run/hermes-service"
SITE_DIR = "/opt/hermes-service/site"
SANDBOX_UID = 1000
#: Toolsets whose tools reach the host (processes, files, browsers, other agents, cron):
#: unconfined they see every user's home and the service's files (Hermes 0.19.0
#: toolsets/; docs/hermes-cli-notes.md).
HOST_TOOLSETS = frozenset({
    "terminal", "file", "code_execution", "browser", "computer_use", "delegation", "cronjob",
    "coding", "debugging", "project", "vision", "video", "image_gen", "tts", "homeassistant",
    "all", "*"})
#: ... and every platform bundle (``hermes-cli``, ``hermes-acp``, ``hermes-telegram``, …),
#: which include the terminal and file tools.
HOST_TOOLSET_PREFIX = "hermes-"
#: Runtime folders bound read-only when they exist (symlinks, as in merged-/usr systems,
#: are recreated as symlinks).
RUNTIME_DIRS = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")
RUNTIME_ETC = ("/etc/ssl", "/etc/ca-certificates", "/etc/pki", "/etc/alternatives",
               "/etc/ld.so.cache", "/etc/ld.so.conf", "/etc/ld.so.conf.d", "/etc/localtime",
               "/etc/nsswitch.conf", "/etc/hosts", "/etc/host.conf", "/etc/gai.conf",
               "/etc/mime.types", "/etc/resolv.conf")
@dataclass(frozen=True)
class Limits:
    """``hermes.sandbox.limits``: ``memory_mb`` (MiB, the whole sandbox with a cgroup, else
    address space per process ×2), ``processes`` (processes and threads), ``cpu_seconds``
    (per process; a warm ACP process is recycled at half of it), ``file_size_mb`` (largest
    file a process may write), ``open_files`` (per process), ``tmp_mb`` (``/tmp``)."""
    memory_mb: int = 2048
    processes: int = 256
    cpu_seconds: int = 600
    file_size_mb: int = 512
    open_files: int = 1024
    tmp_mb: int = 256


@dataclass(frozen=True)
class Egress:
    """``hermes.sandbox.egress``: ``allow``/``deny`` destinations of the egress proxy
    (:mod:`hermes_service.egress_policy`; empty ``allow``: no internet) and
    ``max_connections`` one sandbox may hold open through it."""
    allow: tuple[str, ...] = ()
    deny: tuple[str, ...] = ()
    max_connections: int = 64

    def policy(self) -> Policy:
        """Raises ValueError for an entry the policy cannot read (config checks it first)."""
        return Policy.from_lists(self.allow, self.deny)


@dataclass(frozen=True)
class Settings:
    """``hermes.sandbox``: see config.yaml for each key."""
    mode: str = "auto"
    allow_host_tools: bool = False
    max_home_mb: float = 2048
    bwrap: str = "bwrap"
    limits: Limits = field(default_factory=Limits)
    quota: str = "auto"              # how max_home_mb holds during a turn (disk.py)
    min_free_mb: float = 512         # the free-space floor of the data and homes file systems
    network: str = "isolated"
    allow_host_network: bool = False
    egress: Egress = field(default_factory=Egress)

    @classmethod
    def from_config(cls, section: dict) -> Settings:
        eg = section["egress"]
        return cls(mode=section["mode"], allow_host_tools=section["allow_host_tools"],
                   max_home_mb=section["max_home_mb"], bwrap=section["bwrap"],
                   limits=Limits(**section["limits"]), network=section["network"],
                   allow_host_network=section["allow_host_network"],
                   egress=Egress(tuple(eg["allow"]), tuple(eg["deny"]),
                                 eg["max_connections"]),
                   quota=section["quota"], min_free_mb=section["min_free_mb"])


# ---------------------------------------------------------------------------------------
# probing the host


@dataclass(frozen=True)
class Probe:
    """What this host offers: ``bwrap`` (its path, or None), ``reason`` (why no sandbox can
    start, None when one can) and ``cgroup`` (``"v2"`` | ``"v1"`` | None) with ``cgroup_why``."""
    bwrap: str | None
    reason: str | None
    cgroup: str | None
    cgroup_why: str

    @property
    def usable(self) -> bool:
        return self.bwrap is not None and self.reason is None


@functools.lru_cache(maxsize=8)
def probe(bwrap: str = "bwrap") -> Probe:
    """Try bubblewrap once (cached per command): start ``true`` in a sandbox with the same
    namespaces the service uses (a network namespace included). ~10 ms."""
    path = shutil.which(bwrap)
    groups = CgroupBase.find()
    cg, why = (groups.kind, groups.describe()) if groups else (None, CgroupBase.why_not())
    if not path:
        return Probe(None, f"bubblewrap ('{bwrap}') is not installed: install the 'bubblewrap' "
                     "package (apt-get install bubblewrap; `make setup-service` does it as root)",
                     cg, why)
    if not Path("/usr/bin/prlimit").exists():
        return Probe(path, "util-linux's prlimit (/usr/bin/prlimit) is missing: install "
                     "util-linux", cg, why)
    no_filter = seccomp_filter.problem()
    if no_filter:
        return Probe(path, no_filter, cg, why)
    fd = seccomp_filter.memfd()
    argv = [path, *_base_args(), "--unshare-net", "--seccomp", str(fd), "--", "/usr/bin/true"]
    try:
        out = subprocess.run(argv, capture_output=True, timeout=20, env={"PATH": "/usr/bin:/bin"},
                             pass_fds=(fd,))
    except (OSError, subprocess.TimeoutExpired) as exc:
        return Probe(path, f"bubblewrap cannot start: {exc}", cg, why)
    finally:
        os.close(fd)
    if out.returncode != 0:
        text = out.stderr.decode("utf-8", "replace").strip().splitlines()
        detail = text[-1] if text else f"exit code {out.returncode}"
        hint = ""
        if "namespace" in detail.lower() or "permission" in detail.lower():
            hint = (" (user namespaces: enable them, e.g. sysctl kernel.unprivileged_userns_clone=1"
                    " or user.max_user_namespaces > 0, or an AppArmor profile allowing bwrap)")
        return Probe(path, f"bubblewrap cannot start a sandbox here: {detail}{hint}", cg, why)
    return Probe(path, None, cg, why)


def _base_args() -> list[str]:
    """The namespace and privilege arguments of every sandbox."""
    return ["--unshare-user", "--uid", str(SANDBOX_UID), "--gid", str(SANDBOX_UID),
            "--disable-userns", "--unshare-pid", "--unshare-ipc", "--unshare-uts",
            "--unshare-cgroup-try", "--hostname", "hermes", "--cap-drop", "ALL",
            "--die-with-parent", "--new-session", "--as-pid-1",
            *_runtime_args(), "--proc", "/proc", *_proc_covers(), "--dev", "/dev"]


#: Kernel settings under the sandbox's /proc that a process owning them could change:
#: when the service runs as root, the sandbox's user *is* the host's uid 0 (without
#: capabilities), and files such as /proc/sys/kernel/core_pattern check only their owner.
#: /proc/sys is the host's, read-only (its values are the kernel's either way); the rest is
#: covered by an empty read-only folder or /dev/null.
PROC_READ_ONLY = ("/proc/sys",)
PROC_HIDDEN_DIRS = ("/proc/irq", "/proc/bus", "/proc/fs", "/proc/pressure")
PROC_HIDDEN_FILES = ("/proc/sysrq-trigger", "/proc/mtrr", "/proc/kcore", "/proc/timer_list")


@functools.lru_cache(maxsize=1)
def _proc_covers() -> tuple[str, ...]:
    args: list[str] = []
    for path in PROC_READ_ONLY:
        args += ["--ro-bind", path, path]
    for path in PROC_HIDDEN_DIRS:
        if os.path.isdir(path):
            args += ["--tmpfs", path, "--remount-ro", path]
    for path in PROC_HIDDEN_FILES:
        if os.path.exists(path):
            args += ["--ro-bind", "/dev/null", path]
    return tuple(args)


@functools.lru_cache(maxsize=1)
def _runtime_args() -> tuple[str, ...]:
    args: list[str] = []
    for d in RUNTIME_DIRS:
        p = Path(d)
        if p.is_symlink():
            args += ["--symlink", os.readlink(p), d]
        elif p.is_dir():
            args += ["--ro-bind", d, d]
    for e in RUNTIME_ETC:
        real = os.path.realpath(e)
        if os.path.exists(real):
            args += ["--ro-bind", real, e]
    return tuple(args)


@functools.lru_cache(maxsize=8)
def runtime_roots(command_path: str) -> tuple[str, ...]:
    """Folders the Hermes command needs read-only besides /usr: its venv and the venv's base
    interpreter prefix (``pyvenv.cfg`` ``home``; the venv's ``bin/python`` links there)."""
    cmd = Path(command_path).resolve()
    roots: list[Path] = []
    venv = cmd.parent.parent
    cfg = venv / "pyvenv.cfg"
    if cfg.is_file():
        roots.append(venv)
        for line in cfg.read_text(errors="replace").splitlines():
            key, _, value = line.partition("=")
            if key.strip() == "home" and value.strip():
                roots.append(Path(value.strip()).resolve().parent)
        py = venv / "bin" / "python"
        if py.exists():
            roots.append(py.resolve().parent.parent)
    else:
        roots.append(cmd.parent)
    out: list[str] = []
    for r in roots:
        s = str(r)
        if s.startswith(("/usr/", "/bin", "/lib")) or s in out or s == "/":
            continue
        out.append(s)
    return tuple(out)


def host_toolsets(toolsets) -> list[str]:
    """The names in ``toolsets`` that reach the host when unconfined."""
    return [t for t in toolsets if t in HOST_TOOLSETS or t.startswith(HOST_TOOLSET_PREFIX)]


# ---------------------------------------------------------------------------------------
# cgroups


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

    def memory_bytes(self) -> int | None:
        name = "memory.current" if self.kind == "v2" else "memory.usage_in_bytes"
        try:
            return int((self.by["memory"] / name).read_text())
        except (OSError, ValueError):
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


# ---------------------------------------------------------------------------------------
# the launcher


@dataclass
class Launch:
    """One prepared process: ``argv``/``env``/``cwd``/``pass_fds`` for Popen or asyncio.
    :meth:`started` after the spawn closes the parent's copies of the memfd; :meth:`close`
    after the process ended revokes its model credential and removes its cgroup."""
    argv: list[str]
    env: dict
    cwd: str
    pass_fds: tuple = ()
    sandboxed: bool = False
    cgroup: Cgroup | None = None
    cpu_limit: float | None = None      # seconds per turn (hermes.sandbox.limits.cpu_seconds)
    pid: int | None = None              # the launched process (set by the runner)
    #: a limit the disk watcher found passed ("home_quota" | "disk"; hermes_service/disk.py)
    over: str | None = None
    net: sandbox_net.Attachment | None = None   # its sockets (network: isolated)
    _fds: list = field(default_factory=list)
    _on_close: list = field(default_factory=list)
    _baseline: dict = field(default_factory=dict)
    _cpu_start: float = 0.0

    def started(self) -> None:
        for fd in self._fds:
            try:
                os.close(fd)
            except OSError:
                pass
        self._fds.clear()
        if self.cgroup is not None and not self._baseline:
            self._baseline = self.cgroup.events()

    def cpu_seconds(self) -> float:
        """CPU time used in the sandbox so far: its cgroup's (exited processes included), else
        the live process tree's."""
        used = self.cgroup.cpu_seconds() if self.cgroup is not None else None
        if used is None and self.pid is not None:
            used = tree_cpu_seconds(self.pid)
        return used or 0.0

    def limit_hit(self) -> str | None:
        """``"memory"`` or ``"processes"`` when the sandbox hit its cgroup limit, ``"cpu"``
        when the turn used more than :attr:`cpu_limit` seconds of CPU since :meth:`mark`;
        None otherwise (only the CPU budget without a cgroup). ``"home_quota"`` or ``"disk"``
        when the disk watcher ended it (:attr:`over`)."""
        if self.over is not None:
            return self.over
        if self.cgroup is not None:
            now = self.cgroup.events()
            for key in ("memory", "processes"):
                if now[key] > self._baseline.get(key, 0):
                    return key
        if self.cpu_limit is not None and self.cpu_seconds() - self._cpu_start > self.cpu_limit:
            return "cpu"
        return None

    def mark(self) -> None:
        """A new turn starts in this (warm) process: its CPU budget starts now."""
        self._cpu_start = self.cpu_seconds()

    def close(self) -> None:
        self.started()
        for fn in self._on_close:
            try:
                fn()
            except Exception:  # cleanup must go on
                log.exception("sandbox cleanup failed")
        self._on_close.clear()
        if self.cgroup is not None:
            # the kernel frees a cgroup a moment after its last process: off the turn's path
            threading.Thread(target=self.cgroup.remove, name="cgroup-remove", daemon=True).start()
            self.cgroup = None


class Credentials(Protocol):
    """What the launcher needs of the model pass-through
    (:class:`~hermes_service.model_proxy.ModelProxy`): a credential per process."""
    @property
    def base_url(self) -> str: ...
    @property
    def port(self) -> int: ...

    def start(self) -> object: ...
    def issue(self, user_id: str) -> str: ...
    def revoke(self, token: str) -> None: ...
    def check_budget(self, user_id: str) -> None: ...


class Sandbox:
    """The launcher (see the module doc). ``credentials``: the model pass-through
    (:class:`Credentials`), or None when Hermes talks to the provider directly."""

    def __init__(self, settings: Settings, data_dir: Path, site_dir: Path):
        self.data_dir = Path(data_dir)
        self.site_dir = Path(site_dir)
        self.credentials: Credentials | None = None
        self._lock = threading.Lock()
        #: every isolated sandbox's sockets (the pass-through, this service, the egress proxy)
        self.net = sandbox_net.SandboxNet(self.data_dir / "sandbox" / "net",
                                          on_egress=sandbox_net.report_egress)
        self.configure(settings)

    @property
    def _probed(self) -> Probe:
        """The bwrap probe (made by :meth:`configure` unless the mode is ``none``)."""
        if self.probe is None:
            raise RuntimeError("hermes.sandbox.mode is none: bwrap was not probed")
        return self.probe

    def configure(self, settings: Settings) -> None:
        """Take a (reloaded) ``hermes.sandbox`` section for new processes."""
        self.settings = settings
        self.probe = probe(settings.bwrap) if settings.mode != "none" else None
        self.active = self.probe is not None and self.probe.usable
        self.cgroups = CgroupBase.find() if self.active else None
        self.net.configure(settings.egress.policy(),
                           sandbox_net.Caps(egress=settings.egress.max_connections))

    @property
    def isolated(self) -> bool:
        """Do new Hermes processes get a network namespace of their own?"""
        return self.active and self.settings.network == "isolated"

    def serve_back(self, url: str) -> None:
        """Where an isolated sandbox's service port leads: ``url`` (``http://host:port``,
        this service as the host reaches it)."""
        parts = urlsplit(url)
        self.net.set_target("service", parts.hostname or "127.0.0.1",
                            parts.port or (443 if parts.scheme == "https" else 80))

    def sandbox_routes(self, paths) -> None:
        """The path prefixes a sandbox may call through its service port (the run-token
        routes, from the app factory; :mod:`hermes_service.service_gate`)."""
        self.net.service_paths = tuple(paths)

    def allowed_toolsets(self, toolsets) -> list[str]:
        """``toolsets`` without those that reach the host when ``auto`` found no sandbox (the
        fallback keeps none: :func:`warnings` says so)."""
        if self.settings.mode == "auto" and not self.active:
            risky = set(host_toolsets(toolsets))
            return [t for t in toolsets if t not in risky]
        return list(toolsets)

    def close(self) -> None:
        """The service stops: close every sandbox's sockets."""
        self.net.close()

    # -- what the admin is told ------------------------------------------------
    def describe(self) -> str:
        """One phrase for the start/reload log line and ``check-config``."""
        s = self.settings
        if self.active:
            limits = self.cgroups.describe() if self.cgroups else CgroupBase.why_not()
            net = ("a network namespace each, egress " +
                   (f"to {len(s.egress.allow)} allowed destination(s)" if s.egress.allow
                    else "none") if self.isolated else "the host's network")
            return f"bwrap ({self._probed.bwrap}; limits: {limits}; network: {net})"
        if s.mode == "none":
            return "none (unconfined: every Hermes process sees the whole host)"
        return f"auto -> unconfined ({self._probed.reason})"

    def warnings(self) -> list[str]:
        """What ``check-config`` and the start log warn of (:func:`warnings`)."""
        return warnings(self.settings)

    def health(self) -> str | None:
        """``/health``'s ``sandbox`` check: the ``auto`` fallback; None when sandboxed or
        deliberately ``none``."""
        w = fallback_warnings(self.settings)
        return w[0] if w else None

    # -- paths -------------------------------------------------------------------
    def home_path(self, home) -> str:
        """The home's path as its Hermes process sees it (cwd, ACP ``session/new``)."""
        return HOME if self.active else str(home.root)

    def prepare(self, args: list[str], env: dict, home, run_dir: Path | None,
                command_path: str, fsize_bytes: int | None = None) -> Launch:
        """A :class:`Launch` of ``<command_path> <args>`` for ``home`` (a
        :class:`~hermes_service.user_homes.UserHome`). ``env`` is the process's whole
        environment with host paths; in a sandbox they are mapped to the sandbox's
        (:data:`HOME`, :data:`RUN_DIR`, :data:`SITE_DIR`). ``fsize_bytes``: the largest file
        (``RLIMIT_FSIZE``) instead of ``limits.file_size_mb`` (what is left of the home's
        quota). Raises OSError when a cgroup cannot be made."""
        env = {**env, **hermes_policy.HERMES_ENV}
        args = [*hermes_policy.HERMES_ARGS, *args]
        on_close = []
        if self.credentials is not None and MODEL_KEY_ENV in env:
            credentials = self.credentials
            with self._lock:
                credentials.start()       # idempotent: the first process starts it
            token = credentials.issue(home.user_id)
            env[MODEL_KEY_ENV] = token
            env[MODEL_URL_ENV] = credentials.base_url
            on_close.append(lambda: credentials.revoke(token))
        if not self.active:
            return Launch([command_path, *args], env, str(home.root), _on_close=on_close)
        net = None
        if self.isolated:
            if self.credentials is not None:
                self.net.set_target("model", "127.0.0.1", self.credentials.port)
            net = self.net.attach(home.user_id)
            on_close.append(lambda: self.net.detach(net))
            env.update(sandbox_net.inside_env(MODEL_URL_ENV if MODEL_URL_ENV in env else None,
                                              bool(self.settings.egress.allow)))
        try:
            launch = self._bwrap(args, env, home, run_dir, command_path, on_close, net,
                                 fsize_bytes)
        except BaseException:
            for fn in on_close:
                fn()
            raise
        launch.net = net
        return launch

    def _bwrap(self, args, env, home, run_dir, command_path, on_close, net,
               fsize_bytes=None) -> Launch:
        # bwrap follows a symlink given as a bind source: never bind one a user's agent could
        # have planted (the home, its run folder; homefs repairs them before a turn)
        for path in (home.root, run_dir):
            if path is not None and (os.path.islink(path) or not os.path.isdir(path)):
                raise OSError(f"{path.name}: not a plain folder (a planted symlink?)")
        lim = self.settings.limits
        mapping = [(str(home.root), HOME), (str(self.site_dir), SITE_DIR)]
        if run_dir is not None:
            mapping.insert(0, (str(run_dir), RUN_DIR))
        env = {k: _map_paths(v, mapping) for k, v in env.items()}
        env["TMPDIR"] = "/tmp"
        env["USER"] = env["LOGNAME"] = "hermes"
        passwd, group = self._identity_files
        tmp_bytes = str(lim.tmp_mb * 1024 * 1024)
        # the private /tmp first: a runtime under /tmp (a checkout there) is bound over it
        bargs = [*_base_args(), "--size", tmp_bytes, "--tmpfs", "/tmp",
                 "--ro-bind", str(passwd), "/etc/passwd", "--ro-bind", str(group), "/etc/group"]
        for root in runtime_roots(command_path):
            bargs += ["--ro-bind", root, root]
        bargs += ["--ro-bind", str(self.site_dir), SITE_DIR,
                  # /dev/shm is memory too, capped like /tmp; the rest of /dev read-only
                  "--size", tmp_bytes, "--tmpfs", "/dev/shm", "--remount-ro", "/dev",
                  "--bind", str(home.root), HOME]
        if os.path.isdir(home.hermes_home) and not os.path.islink(home.hermes_home):
            # a mount point of its own: the agent cannot rename or replace HERMES_HOME, so
            # the service's no-follow reads of state.db there cannot be raced (homefs.py)
            bargs += ["--bind", str(home.hermes_home), f"{HOME}/.hermes"]
            _repair_policy(home)
        # Hermes's policy surface (hermes_policy.py): the service's config.yaml and plugins/
        # read-only, the env files, active_profile, profiles/ … read empty
        bargs += hermes_policy.bind_args(str(home.root), HOME, str(self._empty_dir))
        if run_dir is not None:
            bargs += ["--bind", str(run_dir), RUN_DIR]
        if net is not None:
            # a network namespace of its own: only its loopback, and the service's sockets
            # for this sandbox; /etc/hosts names the pass-through (sandbox_net.py)
            bargs += ["--unshare-net", "--ro-bind", str(net.folder), sandbox_net.INSIDE_DIR,
                      "--ro-bind", str(sandbox_net.hosts_file(self.data_dir / "sandbox")),
                      "/etc/hosts"]
        # nothing outside the binds above is writable: the sandbox's own root and /etc (a
        # tmpfs bubblewrap made) would otherwise take an /etc/hermes/config.yaml, Hermes's
        # managed settings, over the home's (the mounts made writable stay so)
        bargs += ["--remount-ro", "/", "--chdir", HOME]
        cgroup = self.cgroups.create(lim) if self.cgroups else None
        rlimits = [f"--cpu={lim.cpu_seconds + 5}:{lim.cpu_seconds + 10}",
                   f"--fsize={fsize_bytes or lim.file_size_mb * 1024 * 1024}",
                   f"--nofile={lim.open_files}", "--core=0"]
        if cgroup is None:
            rlimits += [f"--nproc={lim.processes}", f"--as={lim.memory_mb * 2 * 1024 * 1024}"]
        # the seccomp filter (seccomp_filter.py): loaded by bwrap right before the command runs
        filter_fd = seccomp_filter.memfd()
        bargs += ["--seccomp", str(filter_fd)]
        fd = os.memfd_create("bwrap-args", 0)
        os.write(fd, b"".join(a.encode() + b"\0" for a in bargs))
        os.lseek(fd, 0, os.SEEK_SET)
        # the options (host paths) through the memfd; the command (runtime paths the sandbox
        # sees anyway, and the user's own message) on the command line
        # the command by its real path: the sandbox binds the resolved venv (runtime_roots), so
        # a command reached through a symlinked folder would not exist inside it
        argv = [self._probed.bwrap, "--args", str(fd), "--", "/usr/bin/prlimit", *rlimits, "--",
                _map_paths(os.path.realpath(command_path), mapping), *args]
        if cgroup is not None:
            # join the cgroup(s) before bwrap starts, so nothing it forks escapes them
            argv = ["/bin/sh", "-c", 'for f; do shift; [ "$f" = -- ] && break; '
                    'echo $$ > "$f" || exit 125; done; exec "$@"', "sh",
                    *cgroup.procs_files, "--", *argv]
        return Launch(argv, env, "/", pass_fds=(fd, filter_fd), sandboxed=True, cgroup=cgroup,
                      _fds=[fd, filter_fd],
                      _on_close=on_close, cpu_limit=float(lim.cpu_seconds))

    @functools.cached_property
    def _empty_dir(self) -> Path:
        """A service-owned empty folder, bound read-only where the sandbox must see one."""
        d = self.data_dir / "sandbox" / "empty"
        d.mkdir(parents=True, exist_ok=True)
        d.chmod(0o555)      # (the data dir is the service's: no agent reaches it)
        return d

    @functools.cached_property
    def _identity_files(self) -> tuple[Path, Path]:
        d = self.data_dir / "sandbox"
        d.mkdir(parents=True, exist_ok=True)
        passwd, group = d / "passwd", d / "group"
        passwd.write_text(f"hermes:x:{SANDBOX_UID}:{SANDBOX_UID}:hermes:{HOME}:/bin/sh\n"
                          "nobody:x:65534:65534:nobody:/nonexistent:/usr/sbin/nologin\n")
        group.write_text(f"hermes:x:{SANDBOX_UID}:\nnogroup:x:65534:\n")
        return passwd, group


def _repair_policy(home) -> None:
    """Remove what the agent planted where the sandbox binds Hermes's policy files
    (:func:`hermes_policy.repair`); a home whose ``.hermes`` cannot be opened is left to the
    launch (it fails) and to the next refresh."""
    try:
        fd = homefs.open_dirs(home.root.parent, home.root.name, ".hermes")
    except (OSError, homefs.HomeTampered):
        return
    try:
        removed = hermes_policy.repair(fd)
    finally:
        os.close(fd)
    if removed:
        log.warning("home of user=%s: removed planted %s", home.user_id, ", ".join(removed))


def _map_paths(value: str, mapping: list[tuple[str, str]]) -> str:
    """``value`` with every host path prefix in ``mapping`` replaced by its sandbox path
    (also inside ``:``-separated lists such as PYTHONPATH)."""
    parts = value.split(os.pathsep)
    out = []
    for part in parts:
        for host, inside in mapping:
            if part == host or part.startswith(host + "/"):
                part = inside + part[len(host):]
                break
        out.append(part)
    return os.pathsep.join(out)


# ---------------------------------------------------------------------------------------
# process trees (a sandbox's processes are not in the launcher's process group)


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
    strays = [p for p in descendants(main) if _state(p) not in ("Z", None)]
    for p in strays:
        try:
            os.kill(p, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    return len(strays)


def _state(pid: int) -> str | None:
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


def warnings(settings: Settings, source: str | None = None) -> list[str]:
    """Warning lines for ``check-config`` and the start log: the ``auto`` fallback
    (:func:`fallback_warnings`, also ``/health``'s), and a service running as root."""
    where = f"{source}:" if source else ""
    out = fallback_warnings(settings, source)
    if settings.mode != "none" and os.geteuid() == 0:
        out.append(f"{where}hermes.sandbox: the service runs as root, so each sandbox's user "
                   "is the host's uid 0 (without capabilities, its kernel settings read-only "
                   "to it); run the service as an unprivileged account (deploy/systemd does) "
                   "so that no sandbox is ever the host's root")
    return out


def fallback_warnings(settings: Settings, source: str | None = None) -> list[str]:
    """The ``auto`` fallback as a warning line (``check-config``, the start log, ``/health``);
    empty when sandboxed or deliberately ``none``."""
    if settings.mode != "auto":
        return []
    pr = probe(settings.bwrap)
    if pr.usable:
        return []
    where = f"{source}:" if source else ""
    return [f"{where}hermes.sandbox.mode: auto found no usable sandbox, so Hermes processes run "
            f"unconfined (they see the whole host) and no toolset that reaches the host is "
            f"offered (terminal, file, code_execution, … are left out): {pr.reason}"]


def problems(settings: Settings, toolsets, source: str) -> list[str]:
    """``check-config``/start problems: ``bwrap`` on a host without a working bubblewrap;
    host-reaching toolsets unconfined (``none``) unless ``allow_host_tools`` (the ``auto``
    fallback leaves them out instead: :meth:`Sandbox.allowed_toolsets`), or with the host's
    network (``network: host``) unless ``allow_host_network``; egress entries the policy
    cannot read."""
    out = []
    pr = probe(settings.bwrap) if settings.mode != "none" else None
    if settings.mode == "bwrap" and pr is not None and not pr.usable:
        out.append(f"{source}:hermes.sandbox.mode: bwrap, but {pr.reason}")
    risky = host_toolsets(toolsets)
    if settings.mode == "none" and risky and not settings.allow_host_tools:
        out.append(f"{source}:hermes.toolsets: {', '.join(risky)} reach the host, and "
                   "hermes.sandbox.mode is none: every user's agent could read other users' "
                   "homes and the service's files. Use the sandbox (hermes.sandbox.mode: auto "
                   "or bwrap, with bubblewrap installed), or set "
                   "hermes.sandbox.allow_host_tools: true if every user is trusted with the "
                   "whole server")
    if settings.mode != "none" and settings.network == "host" and risky and \
            not settings.allow_host_network:
        out.append(f"{source}:hermes.sandbox.network: host gives every agent with "
                   f"{', '.join(risky)} the host's network: its loopback services, this "
                   "service's port, the private network and the cloud metadata endpoint. Use "
                   "network: isolated (the default; the internet through "
                   "hermes.sandbox.egress.allow), or set hermes.sandbox.allow_host_network: "
                   "true if every user is trusted with the host's network")
    for key in ("allow", "deny"):
        for entry in getattr(settings.egress, key):
            try:
                Rule.parse(entry)
            except ValueError as exc:
                out.append(f"{source}:hermes.sandbox.egress.{key}: {exc}")
    return out


#: What one file or folder counts at least toward ``max_home_mb`` (its inode): 200 000 empty
#: files are not free.
MIN_ENTRY_BYTES = 4096


def home_size_mb(root: Path, stop_above: float | None = None) -> float:
    """Disk use of a home in MiB: allocated blocks, each entry at least
    :data:`MIN_ENTRY_BYTES`; symlinks not followed; hard-linked files counted once; walked
    by folder descriptors (``os.fwalk``), so paths too long to name still count. Stops
    counting once above ``stop_above``."""
    seen: set = set()
    total = 0
    limit = None if stop_above is None else stop_above * 1024 * 1024
    try:
        walk = os.fwalk(str(root), follow_symlinks=False)
        for _dirpath, dirnames, filenames, dirfd in walk:
            for name in (*dirnames, *filenames):
                try:
                    st = os.stat(name, dir_fd=dirfd, follow_symlinks=False)
                except OSError:
                    continue
                if st.st_nlink > 1 and not dirnames.count(name):
                    if (st.st_dev, st.st_ino) in seen:
                        continue
                    seen.add((st.st_dev, st.st_ino))
                total += max(st.st_blocks * 512, MIN_ENTRY_BYTES)
                if limit is not None and total > limit:
                    walk.close()  # type: ignore[attr-defined]
                    return total / 1024 / 1024
    except OSError:
        pass
    return total / 1024 / 1024


__all__ = [
    "HOME",
    "HOST_TOOLSETS",
    "RUN_DIR",
    "SITE_DIR",
    "Launch",
    "Limits",
    "Sandbox",
    "Settings",
    "descendants",
    "home_size_mb",
    "host_toolsets",
    "limit_signal",
    "probe",
    "problems",
    "signal_tree",
    "tree_cpu_seconds",
    "tree_rss_mb",
]
