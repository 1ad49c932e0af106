"""Hermes's policy surface in a user's home, and how the service keeps it (docs/sandbox.md
§Hermes's policy surface; re-checked against Hermes's own code on every ``hermes-agent`` pin
bump — today 0.19.0).

Everything Hermes reads that could change what it does — which approvals it asks, which
code it loads or runs, which environment it runs with, which provider and model it calls —
is either the service's (given on the command line or in the environment, bound read-only,
read empty, neutralised by the service's import hook, removed before every start, or
read by something the service's config turns off) or the agent's own data, which can only
steer the model, never turn a check off. :data:`SURFACE` is that list, made from Hermes's
code (every read of a path under HERMES_HOME, HOME, the cwd or an absolute path) and an
``strace`` of a ``hermes chat`` and a ``hermes acp`` turn in the sandbox. The launcher
(:mod:`hermes_service.sandbox`) applies its ``ro`` and ``empty`` entries as read-only bind
mounts, which hold against an agent writing at the same time from another of its processes
(a CLI turn beside a warm ACP process): inside every sandbox of the user each such name is
a mount point, which no process there can unlink, rename or write (``EBUSY``/``EROFS``).
Before a sandbox starts, :func:`repair` removes what the agent planted under those names
while no sandbox of the user held them (a symlink, or a folder where a file is bound, which
bubblewrap would follow or refuse), and every ``hook`` and ``removed`` entry.

How each entry is kept (``how``):

* ``arg`` / ``env`` — given by the service to every Hermes process (:data:`HERMES_ARGS`,
  :data:`HERMES_ENV`), whatever any file says;
* ``ro`` — the service's file or folder (written from ``users_template/``), read-only in
  the sandbox;
* ``empty`` — reads as an empty file (``/dev/null``) or an empty read-only folder in the
  sandbox, whatever the agent wrote there (a path starting with ``/`` is the sandbox's
  own, not the home's);
* ``hook`` — the service's import hook (``hermes_site/sitecustomize.py``) makes Hermes
  ignore it (a file of that name :func:`repair` also removes: its mere existence would
  change Hermes);
* ``removed`` — :func:`repair` removes it before every sandbox starts: its mere existence
  changes Hermes, and an empty file in its place would too;
* ``config`` — the reader is off in the service's ``config.yaml`` (``ro``), named in ``why``;
* ``runtime`` — outside the home, in the sandbox's read-only root and runtime;
* ``harmless`` — the agent's own data: text for the model, its records, or read only by
  parts of Hermes the service never runs (``why`` says which).
"""
from __future__ import annotations

import os
import stat
from dataclasses import dataclass

from .. import homefs

#: On every Hermes command line, first: Hermes's own explicit profile selection. With it
#: ``hermes_cli.main._apply_profile_override`` never reads ``active_profile`` (nor follows
#: ``profiles/<name>/``), so HERMES_HOME stays the home the service made.
HERMES_ARGS = ("--profile", "default")
#: Hermes's managed scope (``hermes_cli/managed_scope.py``): a folder whose ``config.yaml``
#: and ``.env`` win over the user's, re-read at every config load. Named explicitly and
#: bound as an empty read-only folder in the sandbox (:data:`SURFACE`), so nothing the agent
#: writes anywhere is ever that scope.
MANAGED_DIR = "/etc/hermes"
#: Added to every Hermes process's environment: no user site-packages (``~/.local/lib/
#: python3.11/site-packages``: ``.pth`` files and ``usercustomize`` would run at every
#: Python start; the Hermes venv already ignores them, this keeps it so for any venv).
#: ``HERMES_SERVICE_GUARD``: the service's import hook (hermes_site/sitecustomize.py) makes
#: the process non-dumpable and gives it private standard streams (docs/sandbox.md §What a
#: tool process cannot reach); it takes the variable out, so Hermes's children never see it.
HERMES_ENV = {"PYTHONNOUSERSITE": "1", "HERMES_SERVICE_GUARD": "1",
              "HERMES_MANAGED_DIR": MANAGED_DIR}


@dataclass(frozen=True)
class Entry:
    """One entry of the surface: ``path`` relative to the home (HOME, the cwd) or, starting
    with ``/``, a path of the sandbox; ``kind`` ``file`` | ``dir`` | ``setting`` |
    ``paths`` (several names, in the text); ``how`` (module doc) and why."""
    path: str
    kind: str
    how: str
    why: str


SURFACE = (
    # -- given by the service ------------------------------------------------------------
    Entry("--profile default", "setting", "arg",
          "hermes_cli/main.py _apply_profile_override: an explicit profile; active_profile "
          "and profiles/ are never consulted"),
    Entry("HOME, HERMES_HOME, PATH, PYTHONPATH, …", "setting", "env",
          "the whole environment is built by the service (user_homes.cli_env); nothing of "
          "the agent's reaches it but through the env files below"),
    Entry("PYTHONNOUSERSITE", "setting", "env",
          "Python's user site (.pth, usercustomize) is off"),
    Entry("HERMES_MANAGED_DIR", "setting", "env",
          f"hermes_cli/managed_scope.py get_managed_dir: the managed scope is {MANAGED_DIR}, "
          "an empty read-only folder (below)"),
    # -- bound read-only ---------------------------------------------------------------
    Entry(".hermes/config.yaml", "file", "ro",
          "every setting: approvals, toolsets, hooks:, mcp_servers:, plugins.enabled, "
          "secrets:, model, terminal back-end, skills.inline_shell, agent.coding_context"),
    Entry(".hermes/plugins", "dir", "ro",
          "user plugins, model-provider, memory, context-engine and cron-provider plugins: "
          "Python code loaded at start (project plugins, <cwd>/.hermes/plugins, are the "
          "same folder and off without HERMES_ENABLE_PROJECT_PLUGINS)"),
    # -- read empty ----------------------------------------------------------------------
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
    Entry(".hermes/SOUL.md", "file", "empty",
          "agent/prompt_builder.py load_soul_md: the identity slot of the system prompt, "
          "re-read every message; empty, Hermes uses its built-in identity (the same text "
          "as its default SOUL.md), so an injected instruction cannot make itself the "
          "agent's identity"),
    Entry(MANAGED_DIR, "dir", "empty",
          "the managed scope's config.yaml and .env (HERMES_MANAGED_DIR names it): win "
          "over the user's config, re-read at every load_config"),
    # -- neutralised or removed before every start ----------------------------------------
    Entry(".hermes/.container-mode", "file", "hook",
          "hermes_cli/config.py get_container_exec_info: when it exists (even empty) Hermes "
          "execs '<backend> exec … <hermes_bin>' named in it instead of itself"),
    Entry(".hermes/.managed", "file", "removed",
          "hermes_cli/config.py is_managed: package-manager mode (Hermes then refuses to "
          "start unless cron/, sessions/, logs/, memories/ exist)"),
    # -- turned off in the service's config ---------------------------------------------
    Entry("sessions row of .hermes/state.db: model, model_config (provider, base_url, "
          "api_mode, cwd), billing_provider, billing_base_url", "paths", "hook",
          "acp_adapter/session.py restores an ACP session with the row's model, provider, "
          "endpoint and API mode: the hook makes it use the config's (SessionManager."
          "_make_agent); the service's session/load replaces the row's cwd"),
    Entry("<cwd>/.git (its config: core.fsmonitor, …), project markers (package.json, …)",
          "paths", "config",
          "agent/coding_context.py runs git in a code workspace at start; "
          "agent.coding_context: off"),
    Entry(".hermes/skills/*/SKILL.md !`command` snippets", "paths", "config",
          "agent/skill_preprocessing.py runs them when a skill is loaded; "
          "skills.inline_shell: false"),
    # -- outside the home ----------------------------------------------------------------
    Entry("/etc (ld.so.preload, profile, bash.bashrc, gitconfig, magic, …), /.dockerenv, "
          "/run/.containerenv, markers at / and /home", "paths", "runtime",
          "read by the dynamic loader, the tool shell, is_container and the coding posture: "
          "the sandbox's root and runtime are read-only"),
    Entry("/tmp, /dev/shm (private to the sandbox), /run/hermes-service (the user's run "
          "folder)", "paths", "harmless",
          "Hermes's temporary files and its tool shell's environment snapshots "
          "(/tmp/hermes-snap-*: sourced by the agent's own commands only); the run folder "
          "holds a CLI turn's marker (its Hermes session id), never a run's token or "
          "binding (docs/mnote-tools.md §Run binding)"),
    # -- the agent's own --------------------------------------------------------------------
    Entry(".hermes/memories/, skills/, skill-bundles/, .no-bundled-skills, "
          ".skills_prompt_snapshot.json", "paths", "harmless",
          "memory and skills: text for the model (it may carry an instruction from one "
          "turn to the next: docs/sandbox.md)"),
    Entry("AGENTS.md, agents.md, CLAUDE.md, claude.md, HERMES.md, .hermes.md, .cursorrules, "
          ".cursor/rules", "paths", "harmless",
          "context files of the cwd (the home): text for the model, as above"),
    Entry(".hermes/state.db (messages, system prompt snapshot, state_meta), sessions/, "
          "logs/, checkpoints/, kanban/", "paths", "harmless",
          "the agent's own records (goals in state_meta run only in interactive chat; "
          "checkpoints are off); the service reads state.db bounded and never follows what "
          "is planted there (docs/data-and-durability.md)"),
    Entry(".hermes/auth.json, .anthropic_oauth.json; ~/.codex, ~/.claude, ~/.qwen, "
          "~/.minimax, ~/.config/github-copilot", "paths", "harmless",
          "credentials of providers and pools: config.yaml pins the provider and its URL "
          "(the pass-through, which sets the real key) and declares no custom pool"),
    Entry(".hermes/context_length_cache.yaml, models_dev_cache.json, "
          "provider_models_cache.json, ollama_cloud_models_cache.json, cache/",
          "paths", "harmless",
          "model metadata for the pinned endpoint; config.yaml pins the context length"),
    Entry(".hermes/.update_check, .install_method, hermes-agent/, skins/", "paths",
          "harmless", "update and install hints (an update check is one request to "
          "pypi.org, which an isolated sandbox's Hermes cannot reach), display only"),
    Entry(".hermes/cron/, scripts/", "paths", "harmless",
          "cron jobs: run by the gateway's ticker (never started by the service) or the "
          "cronjob toolset (an admin's choice; approvals.cron_mode: deny)"),
    Entry(".hermes/hooks/, pairing/, gateway*, channel_directory.json, processes.json, "
          "platform tokens (slack_tokens.json, whatsapp/, feishu_*)", "paths", "harmless",
          "read by `hermes gateway` only, which the service never runs"),
    Entry(".hermes/honcho.json, mem0.json, hindsight/, memory_store.db; ~/.honcho, "
          "~/.hindsight", "paths", "harmless",
          "memory providers: used only when config.yaml's memory.provider names one"),
    Entry(".hermes/sandboxes/, home/, node/, node_modules/; ~/.modal.toml, ~/.ssh, "
          "~/.local/bin", "paths", "harmless",
          "other terminal back-ends (config.yaml: local) and what the agent's own tool "
          "processes use (their HOME, PATH)"),
    Entry("~/.profile, ~/.bash_profile, ~/.bashrc", "paths", "harmless",
          "sourced by the terminal tool's login shell before the agent's commands, in its "
          "own tool processes: code the agent can run anyway; it carries from one turn to "
          "the next, and approvals are a filter on a command's text, not a boundary "
          "(docs/sandbox.md §What approvals are)"),
    Entry("~/.netrc, ~/.magic, ~/.gitconfig", "paths", "harmless",
          "HTTP credentials for hosts without a key (Hermes's model requests carry one), "
          "libmagic's rules for the `file` Hermes runs on its own interpreter, git's "
          "settings for the agent's own git commands (Hermes's checkpoints ignore it and "
          "are off)"),
)

#: The entries bound in every sandbox: ``(path under the home or of the sandbox, kind, how)``.
BOUND = tuple((e.path, e.kind, e.how) for e in SURFACE if e.how in ("ro", "empty"))
#: Names under HERMES_HOME removed before every sandbox starts, whatever they are.
REMOVED = tuple(e.path.split("/", 1)[1] for e in SURFACE
                if e.how in ("hook", "removed") and e.kind in ("file", "dir")
                and e.path.startswith(".hermes/"))


def bind_args(home_root: str, inside: str, empty_dir: str) -> list[str]:
    """bubblewrap arguments binding :data:`BOUND` of the home at ``home_root`` (host) into
    the sandbox's home ``inside`` (an entry starting with ``/``: at that path of the
    sandbox): the service's own entries read-only over themselves, the ``empty`` ones over
    ``/dev/null`` or the read-only empty folder ``empty_dir``. A service entry that is not
    there (or not plain: :func:`repair` ran first) is skipped."""
    args: list[str] = []
    for rel, kind, how in BOUND:
        dest = rel if rel.startswith("/") else f"{inside}/{rel}"
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
    """Remove from the HERMES_HOME open at ``hermes_dir_fd`` every name of :data:`REMOVED`
    (whatever it is), and every ``empty`` entry of :data:`BOUND` that is not what its mount
    needs (a symlink; a folder, FIFO … where a file is bound; anything but a folder where a
    folder is): bubblewrap follows a symlink given as a mount point and cannot bind a file
    over a folder. Never follows anything (:mod:`hermes_service.homefs`). Returns the names
    removed."""
    removed = [name for name in REMOVED if homefs.remove(hermes_dir_fd, name)]
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
