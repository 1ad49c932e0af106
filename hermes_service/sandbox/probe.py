"""Probing the host and checking the settings (docs/sandbox.md): whether bubblewrap can start
a sandbox here, and the problems and warnings ``check-config``, the start log and
``/health`` report."""
from __future__ import annotations

import functools
import os
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

from . import seccomp_filter
from .args import base_args
from .cgroups import CgroupBase
from .net.egress_policy import Rule
from .settings import Settings, host_toolsets


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
    argv = [path, *base_args(), "--unshare-net", "--seccomp", str(fd), "--", "/usr/bin/true"]
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
