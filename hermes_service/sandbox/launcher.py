"""The launcher of every Hermes process (docs/sandbox.md): a :class:`Launch` of one process,
sandboxed (bubblewrap, its cgroup, its rlimits, its network) or not, prepared by
:class:`Sandbox` from the settings in force; the model pass-through's credential per
process."""
from __future__ import annotations

import functools
import logging
import os
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol
from urllib.parse import urlsplit

from . import args as sandbox_args
from . import hermes_policy, seccomp_filter
from .args import HOME, RUN_DIR, SANDBOX_UID, SITE_DIR, base_args, map_paths, repair_policy
from .cgroups import Cgroup, CgroupBase
from .net import sockets as sandbox_net
from .probe import Probe, fallback_warnings, probe, warnings
from .settings import MODEL_KEY_ENV, MODEL_URL_ENV, Settings, host_toolsets
from .trees import tree_cpu_seconds

log = logging.getLogger("hermes_service.sandbox")


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
    #: a limit the disk watcher found passed ("home_quota" | "disk"; hermes_service/disk/quota.py)
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

    def on_close(self, fn) -> None:
        """Call ``fn()`` when the process ended and its launch is closed (:meth:`close`)."""
        self._on_close.append(fn)

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
    (:class:`~hermes_service.model_proxy.proxy.ModelProxy`): a credential per process."""
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
        egress = settings.egress
        self.net.configure(egress.policy(), sandbox_net.Caps(
            egress=egress.max_connections, lookups=egress.max_lookups,
            lookup_timeout=egress.lookup_timeout))

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
        routes, from the app factory; :mod:`hermes_service.sandbox.net.service_gate`)."""
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
        :class:`~hermes_service.homes.users.UserHome`). ``env`` is the process's whole
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
        env = {k: map_paths(v, mapping) for k, v in env.items()}
        env["TMPDIR"] = "/tmp"
        env["USER"] = env["LOGNAME"] = "hermes"
        passwd, group = self._identity_files
        tmp_bytes = str(lim.tmp_mb * 1024 * 1024)
        # the private /tmp first: a runtime under /tmp (a checkout there) is bound over it
        bargs = [*base_args(), "--size", tmp_bytes, "--tmpfs", "/tmp",
                 "--ro-bind", str(passwd), "/etc/passwd", "--ro-bind", str(group), "/etc/group"]
        for root in sandbox_args.runtime_roots(command_path):
            bargs += ["--ro-bind", root, root]
        bargs += ["--ro-bind", str(self.site_dir), SITE_DIR,
                  # /dev/shm is memory too, capped like /tmp; the rest of /dev read-only
                  "--size", tmp_bytes, "--tmpfs", "/dev/shm", "--remount-ro", "/dev",
                  "--bind", str(home.root), HOME]
        if os.path.isdir(home.hermes_home) and not os.path.islink(home.hermes_home):
            # a mount point of its own: the agent cannot rename or replace HERMES_HOME, so
            # the service's no-follow reads of state.db there cannot be raced (homefs.py)
            bargs += ["--bind", str(home.hermes_home), f"{HOME}/.hermes"]
            repair_policy(home)
        # Hermes's policy surface (sandbox/hermes_policy.py): the service's config.yaml and plugins/
        # read-only, the env files, active_profile, profiles/ … read empty
        bargs += hermes_policy.bind_args(str(home.root), HOME, str(self._empty_dir))
        if run_dir is not None:
            bargs += ["--bind", str(run_dir), RUN_DIR]
        if net is not None:
            # a network namespace of its own: only its loopback, and the service's sockets
            # for this sandbox; /etc/hosts names the pass-through (sandbox/net/sockets.py)
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
        # the seccomp filter (sandbox/seccomp_filter.py): loaded by bwrap right before the
        # command runs
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
                map_paths(os.path.realpath(command_path), mapping), *args]
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
