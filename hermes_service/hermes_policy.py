"""Hermes's policy surface in a user's home, and how the service keeps it (docs/sandbox.md
§Hermes's policy surface; re-checked against Hermes's own code on every ``hermes-agent`` pin
bump — today 0.19.0).

Everything Hermes reads at start that could change what it does — which approvals it asks,
which code it loads, which environment it runs with — is either the service's (given on the
command line or in the environment, bound read-only, or read empty in every sandbox) or the
agent's own data, which can only steer the model, never turn a check off. :data:`SURFACE`
is that list; the launcher (:mod:`hermes_service.sandbox`) applies its ``ro`` and ``empty``
entries as read-only bind mounts, which hold against an agent writing at the same time
from another of its processes (a CLI turn beside a warm ACP process): inside every sandbox
of the user each such name is a mount point, which no process there can unlink, rename or
write (``EBUSY``/``EROFS``). Before a sandbox starts, :func:`repair` removes what the agent
planted under those names while no sandbox of the user held them (a symlink, or a folder
where a file is bound, which bubblewrap would follow or refuse).

How each entry is kept (``how``):

* ``arg`` / ``env`` — given by the service to every Hermes process (:data:`HERMES_ARGS`,
  :data:`HERMES_ENV`), whatever any file says;
* ``ro`` — the service's file or folder (written from ``users_template/``), read-only in
  the sandbox;
* ``empty`` — reads as an empty file (``/dev/null``) or an empty read-only folder in the
  sandbox, whatever the agent wrote there;
* ``harmless`` — the agent's own data (the model reads it; nothing in it turns an
  approval, a plugin or an environment variable on).
"""
from __future__ import annotations

import os
import stat
from dataclasses import dataclass

from . import homefs

#: On every Hermes command line, first: Hermes's own explicit profile selection. With it
#: ``hermes_cli.main._apply_profile_override`` never reads ``active_profile`` (nor follows
#: ``profiles/<name>/``), so HERMES_HOME stays the home the service made.
HERMES_ARGS = ("--profile", "default")
#: Added to every Hermes process's environment: no user site-packages (``~/.local/lib/
#: python3.11/site-packages``: ``.pth`` files and ``usercustomize`` would run at every
#: Python start; the Hermes venv already ignores them, this keeps it so for any venv).
#: ``HERMES_SERVICE_GUARD``: the service's import hook (hermes_site/sitecustomize.py) makes
#: the process non-dumpable and gives it private standard streams (docs/sandbox.md §What a
#: tool process cannot reach); it takes the variable out, so Hermes's children never see it.
HERMES_ENV = {"PYTHONNOUSERSITE": "1", "HERMES_SERVICE_GUARD": "1"}


@dataclass(frozen=True)
class Entry:
    """One entry of the surface: ``path`` relative to the home (HOME, the cwd), ``kind``
    ``file`` | ``dir`` | ``setting``, ``how`` (module doc) and what Hermes does with it."""
    path: str
    kind: str
    how: str
    why: str


SURFACE = (
    Entry("--profile default", "setting", "arg",
          "hermes_cli/main.py _apply_profile_override: an explicit profile; active_profile "
          "and profiles/ are never consulted"),
    Entry("HOME, HERMES_HOME, PATH, PYTHONPATH, …", "setting", "env",
          "the whole environment is built by the service (user_homes.cli_env); nothing of "
          "the agent's reaches it but through the env files below"),
    Entry("PYTHONNOUSERSITE", "setting", "env",
          "Python's user site (.pth, usercustomize) is off"),
    Entry(".hermes/config.yaml", "file", "ro",
          "every setting: approvals, toolsets, hooks:, mcp_servers:, plugins.enabled, "
          "model, secret sources"),
    Entry(".hermes/plugins", "dir", "ro",
          "user plugins: Python code loaded at start (project plugins, <cwd>/.hermes/plugins, "
          "are the same folder and off without HERMES_ENABLE_PROJECT_PLUGINS)"),
    Entry(".hermes/.env", "file", "empty",
          "hermes_cli/env_loader.py: loaded over the environment (HERMES_YOLO_MODE=1 there "
          "would run dangerous commands unasked)"),
    Entry(".hermes/.op.env", "file", "empty", "env_loader.py: loaded after .env"),
    Entry(".hermes/active_profile", "file", "empty",
          "the sticky profile (also ignored: --profile default)"),
    Entry(".hermes/profiles", "dir", "empty",
          "named profiles: a config.yaml, .env and plugins/ of their own each"),
    Entry(".hermes/shell-hooks-allowlist.json", "file", "empty",
          "agent/shell_hooks.py: consent to the config's hooks: (the config has none)"),
    Entry(".hermes/SOUL.md, memories/, skills/, skill-bundles/, .no-bundled-skills",
          "file", "harmless", "persona, memory and skills: text for the model"),
    Entry("AGENTS.md, CLAUDE.md, HERMES.md, .hermes.md, .cursorrules, .cursor/rules",
          "file", "harmless", "context files of the cwd (the home): text for the model"),
    Entry(".hermes/state.db, sessions/, logs/, checkpoints/, kanban/", "file", "harmless",
          "the agent's own records; the service reads state.db bounded and never follows "
          "what is planted there (docs/data-and-durability.md)"),
    Entry(".hermes/auth.json, .anthropic_oauth.json, context_length_cache.yaml, "
          "models_dev_cache.json, cache/", "file", "harmless",
          "credentials and model metadata: config.yaml pins the provider, its URL (the "
          "pass-through, which sets the real key) and the context length"),
    Entry(".hermes/.managed, .install_method, .update_check, hermes-agent/, sandboxes/",
          "file", "harmless", "install and update hints, other terminal back-ends"),
    Entry("~/.local/bin, ~/.ssh, ~/.netrc, … (looked up)", "file", "harmless",
          "anything Hermes runs from the home runs inside the sandbox, as a tool command does"),
)

#: The entries bound in every sandbox: ``(path under the home, kind, how)``.
BOUND = tuple((e.path, e.kind, e.how) for e in SURFACE if e.how in ("ro", "empty"))


def bind_args(home_root: str, inside: str, empty_dir: str) -> list[str]:
    """bubblewrap arguments binding :data:`BOUND` of the home at ``home_root`` (host) into
    the sandbox's home ``inside``: the service's own entries read-only over themselves,
    the ``empty`` ones over ``/dev/null`` or the read-only empty folder ``empty_dir``. A
    service entry that is not there (or not plain: :func:`repair` ran first) is skipped."""
    args: list[str] = []
    for rel, kind, how in BOUND:
        dest = f"{inside}/{rel}"
        if how == "ro":
            src = os.path.join(home_root, rel)
            if _plain(src, kind):
                args += ["--ro-bind", src, dest]
        else:
            args += ["--ro-bind", "/dev/null" if kind == "file" else empty_dir, dest]
    return args


def _plain(path: str, kind: str) -> bool:
    try:
        st = os.lstat(path)
        parent = os.lstat(os.path.dirname(path))
    except OSError:
        return False
    if not stat.S_ISDIR(parent.st_mode):
        return False
    return stat.S_ISDIR(st.st_mode) if kind == "dir" else stat.S_ISREG(st.st_mode)


def repair(hermes_dir_fd: int) -> list[str]:
    """Remove from the HERMES_HOME open at ``hermes_dir_fd`` every ``empty`` entry of
    :data:`BOUND` that is not what its mount needs (a symlink; a folder, FIFO … where a
    file is bound; anything but a folder where a folder is): bubblewrap follows a symlink
    given as a mount point and cannot bind a file over a folder. Never follows anything
    (:mod:`hermes_service.homefs`). Returns the names removed."""
    removed = []
    for rel, kind, how in BOUND:
        if how != "empty" or not rel.startswith(".hermes/"):
            continue
        name = rel.split("/", 1)[1]
        st = homefs.lstat(hermes_dir_fd, name)
        if st is None:
            continue
        ok = stat.S_ISDIR(st.st_mode) if kind == "dir" else stat.S_ISREG(st.st_mode)
        if not ok and homefs.remove(hermes_dir_fd, name):
            removed.append(name)
    return removed
