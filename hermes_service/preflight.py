"""Checks of the world a config points at (docs/configuring.md, docs/v1-api.md §Health).

:mod:`.config` judges the file; these judge what it names: the Hermes command, the users
template, the data dir, the session registry and the file-descriptor limit the connection
limit needs. Every finding is a ``file:key: problem`` line, like the config's own.

* ``check-config`` prints :func:`load_and_check`'s problems (exit 2 on any): the file's own
  and these, in one run, for every key that validated — and the config's warnings;
* ``serve`` refuses to start on any of them (same lines, exit 2);
* a live reload refuses a new config with any of them (also listed with the file's own);
* ``/health`` runs the cheap ones on every call (:func:`health_checks`).
"""
from __future__ import annotations

import os
import resource
import shutil
from pathlib import Path

import yaml

from .config import Config, ConfigError, is_invalid, load_config

#: File descriptors beyond one per connection: CLI pipes, SQLite files, logs, pid records.
SPARE_FDS = 200


def command_problem(config: Config) -> str | None:
    """``hermes.command`` must name an executable (on PATH or a path)."""
    cmd = config.hermes.command
    found = shutil.which(cmd)
    if not found:
        return (f"{config.source}:hermes.command: '{cmd}' was not found or is not executable "
                "(PATH or a path to the hermes CLI; `make run` puts .hermes-venv/bin on PATH)")
    return None


def template_problem(config: Config, parse: bool = True) -> str | None:
    """``paths.users_template`` must hold a readable ``config.yaml`` (a mapping when parsed)."""
    path = config.paths.users_template / "config.yaml"
    where = f"{config.source}:paths.users_template"
    if not path.is_file() or not os.access(path, os.R_OK):
        return f"{where}: {path} does not exist or is not readable"
    if parse:
        try:
            data = yaml.safe_load(path.read_text("utf-8"))
        except (OSError, UnicodeError, yaml.YAMLError) as exc:
            return f"{where}: {path} is not valid YAML ({exc})"
        if data is not None and not isinstance(data, dict):
            return f"{where}: {path} must be a mapping"
    return None


def data_dir_problem(config: Config) -> str | None:
    """``paths.data_dir`` must be a writable directory (or creatable: its nearest existing
    parent is writable)."""
    path = config.data_dir
    where = f"{config.source}:paths.data_dir"
    probe = path
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    if not probe.is_dir():
        return f"{where}: {probe} is not a directory"
    if not os.access(probe, os.W_OK | os.X_OK):
        return f"{where}: {probe} is not writable"
    return None


def disk_problem(config: Config) -> str | None:
    """``hermes.sandbox.quota: btrfs`` where it cannot hold; a ``paths.homes_dir`` apart from
    the data dir while the homes are still in the data dir (:meth:`Disk.problems`)."""
    from .disk.quota import Disk
    found = Disk(config.hermes.sandbox, config.data_dir, config.paths.homes,
                 config.storage.enabled).problems(config.source)
    return "; ".join(found) if found else None


def store_problem(config: Config) -> str | None:
    """The session registry must open: its layout file and a legacy ``sessions.json`` still to
    migrate, when present, must parse (checked without writing; a damaged user shard stops
    only that user and is reported by ``gc``)."""
    from .session_store import SessionStore
    found = SessionStore.check(config.data_dir)
    return "; ".join(found) if found else None


def storage_problem(config: Config) -> str | None:
    """With ``storage.url``: one connection to the shared PostgreSQL must be made, or why
    not (refused, unknown role, bad password …; docs/scaling.md §Shared storage)."""
    if not config.storage.enabled:
        return None
    from .storage.engine import Engine, password_from
    st = config.storage
    why = Engine(str(st.url), password=password_from(st.password_env)).reach()
    return None if why is None else (f"{config.source}:storage.url: cannot connect to the "
                                     f"shared PostgreSQL: {why}")


def fds_needed(config: Config) -> int:
    """File descriptors the service may need: one per connection plus :data:`SPARE_FDS`."""
    return config.service.connection_limit + SPARE_FDS


def fd_problem(config: Config) -> str | None:
    """The hard RLIMIT_NOFILE must allow :func:`fds_needed` (serve raises the soft limit)."""
    need = fds_needed(config)
    _soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < need:
        return (f"{config.source}:service.connection_limit: "
                f"{config.service.connection_limit} connections need about {need} file "
                f"descriptors, but the limit of this process is {hard} (ulimit -Hn); lower "
                "connection_limit or raise the limit")
    return None


def raise_fd_limit(config: Config) -> None:
    """Raise the soft RLIMIT_NOFILE to :func:`fds_needed` (within the hard limit)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    need = fds_needed(config)
    if soft != resource.RLIM_INFINITY and soft < need:
        target = need if hard == resource.RLIM_INFINITY else min(need, hard)
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))


#: each check and the config key it judges (skipped when that key did not validate)
_CHECKS = ((command_problem, "hermes.command"), (template_problem, "paths.users_template"),
           (data_dir_problem, "paths.data_dir"), (fd_problem, "service.connection_limit"),
           (disk_problem, "hermes.sandbox"))


def problems(config: Config, store: bool = True, invalid: frozenset = frozenset()) -> list[str]:
    """Every finding that stops ``serve`` and fails ``check-config`` and a reload.

    ``store=False`` skips the session registry (``serve`` reports one it cannot open itself,
    with exit 3). ``invalid``: keys of a :attr:`ConfigError.partial` config that did not
    validate; the checks of those are skipped (the file's own problem names them)."""
    checks = [(check, key) for check, key in _CHECKS]
    if store:
        checks += [(store_problem, "paths.data_dir"), (storage_problem, "storage")]
    return [p for p in (check(config) for check, key in checks if not is_invalid(key, invalid))
            if p]


def load_and_check(path, store: bool = True, need_keys: bool = True,
                   overlay=None, sections=()) -> tuple[Config | None, list[str]]:
    """Every problem of the config file at ``path`` in one run: the file's own (YAML, schema,
    cross-field: :func:`~hermes_service.config.load_config`) and, for the keys that
    validated, what they name (:func:`problems`). Returns ``(config, problems)``: the config
    when there is no problem, else the :attr:`ConfigError.partial` one (its warnings still
    say something; None when the file could not be read or parsed). ``overlay`` and
    ``sections`` (the installed extensions' config sections): as
    :func:`~hermes_service.config.load_config` takes them."""
    try:
        config = load_config(path, need_keys=need_keys, overlay=overlay, sections=sections)
    except ConfigError as exc:
        if exc.partial is None:
            return None, list(exc.problems)
        return exc.partial, exc.problems + problems(exc.partial, store, exc.invalid)
    return config, problems(config, store)


def health_checks(config: Config) -> dict[str, str | None]:
    """The cheap checks of ``/health`` (a few stat calls, nothing parsed or spawned):
    ``{"hermes_command", "users_template", "data_dir", "provider"}`` → None when fine, else a
    short reason without paths (the details go to the log)."""
    data_ok = config.data_dir.is_dir() and os.access(config.data_dir, os.W_OK | os.X_OK)
    return {
        "hermes_command": "not found" if command_problem(config) else None,
        "users_template": "unreadable" if template_problem(config, parse=False) else None,
        "data_dir": None if data_ok else "not writable",
        "provider": "unconfigured" if config.provider_issues else None,
    }


def describe(config: Config) -> list[str]:
    """The ``file:key: problem`` lines behind :func:`health_checks` (for the log)."""
    lines = [command_problem(config), template_problem(config, parse=False),
             None if Path(config.data_dir).is_dir() and os.access(config.data_dir, os.W_OK)
             else f"{config.source}:paths.data_dir: {config.data_dir} is not a writable directory"]
    from .sandbox import warnings
    return [line for line in lines if line] + list(config.provider_issues) + \
        warnings(config.hermes.sandbox, config.source)
