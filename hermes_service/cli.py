"""Operator commands (click): serve (default), ``check-config``, ``reload``, ``keygen``, ``gc``,
``usage``, and each installed extension's command group
(:meth:`~hermes_service.extensions.Extension.init_cli`).

``.venv/bin/python main.py [--config PATH] [--host H] [--port P] [--threads N] [--demo]``
serves with waitress (``--demo``: the stand-in model of the installed demo,
:func:`hermes_service.installed.demo`, for ``make demo``; with a command, that command works
on the demo's data dir). A config with any problem ``check-config`` reports (exit 2), or a
session registry or an extension's store that cannot be opened (exit 3: its layout file, a
legacy ``sessions.json`` to migrate, :class:`~hermes_service.extensions.StoreUnusable`),
exits non-zero before anything listens.
"""
from __future__ import annotations

import hashlib
import logging
import os
import secrets
import sys
from pathlib import Path

import click

from . import installed
from .config import ENV_CONFIG, ConfigError
from .extensions import StoreUnusable
from .session_store import CorruptStore

log = logging.getLogger("hermes_service")


def _demo():
    """The installed demo module (:func:`hermes_service.installed.demo`); exits 2 if none."""
    found = installed.demo()
    if found is None:
        click.echo("--demo: no installed extension offers a demo", err=True)
        sys.exit(2)
    return found


def _overlay(ctx):
    """``--demo``'s config overlay for a command that serves nothing (its data dir is what
    matters; the model address is a placeholder), else None."""
    if not ctx.obj.get("demo"):
        return None
    return _demo().overlay("http://127.0.0.1:9/v1")


def _load(path, need_keys: bool = True, overlay=None):
    try:
        return installed.load_config(path, need_keys=need_keys, overlay=overlay)
    except ConfigError as exc:
        for line in exc.problems:
            click.echo(line, err=True)
        sys.exit(2)


def load_for_command(ctx):
    """The config of a command that serves nothing (API keys not required; ``--demo``: the
    demo's data dir). Exits 2 with ``file:key: problem`` lines on any problem."""
    return _load(ctx.obj["config_path"], need_keys=False, overlay=_overlay(ctx))


@click.group(invoke_without_command=True)
@click.option("--config", "config_path", envvar=ENV_CONFIG, default="config.yaml",
              show_default=True, help=f"Config file (env {ENV_CONFIG}).")
@click.option("--host", default=None, help="Override service.host.")
@click.option("--port", type=int, default=None, help="Override service.port.")
@click.option("--threads", type=int, default=None, help="Override service.threads (waitress).")
@click.option("--demo", is_flag=True,
              help="Demo: a scripted stand-in model on loopback instead of the provider, the ACP "
                   "runner, data in <data_dir>/demo (make demo; README \"Try it without a "
                   "provider\"). With a command: that command on the demo's data dir.")
@click.pass_context
def cli(ctx, config_path, host, port, threads, demo):
    """hermes-service: the Hermes Agent CLI as a REST API. Without a command: serve."""
    ctx.ensure_object(dict)
    ctx.obj["config_path"] = config_path
    ctx.obj["demo"] = demo
    ctx.obj["load_config"] = load_for_command      # for extensions' commands (Extension.init_cli)
    if ctx.invoked_subcommand is None:
        serve(config_path, host, port, threads, demo=demo)


def serve(config_path, host=None, port=None, threads=None, demo=False):
    """Serve until SIGTERM/SIGINT (docs/operations.md §Process lifetime); SIGHUP reloads
    (docs/configuring.md §Reload).

    Exits 2 with ``file:key: problem`` lines on any problem ``check-config`` reports (all of
    them at once), 3 on a session registry that cannot be opened. Warnings (no usable
    provider, expired keys) are logged and the service starts. ``demo``: the stand-in model
    (:func:`hermes_service.installed.demo`) answers, in this process, and the demo's data is
    seeded (:func:`serve_demo`).
    """
    if demo:
        serve_demo(config_path, host, port, threads)
    else:
        _serve(_checked_config(config_path), config_path, host, port, threads)


def serve_demo(config_path, host=None, port=None, threads=None):
    """:func:`serve` with the installed demo: its stand-in model started in this process (and
    stopped when serving ends), its overlay over the config, its data seeded. Exits 2 when no
    enabled extension offers the demo, 3 when its data cannot be seeded."""
    demo_mod = _demo()
    demo_model = demo_mod.start_model()
    try:
        config = _checked_config(config_path, overlay=demo_mod.overlay(demo_model.base_url))
        if not any(ext.demo is demo_mod for ext in installed.enabled(config)):
            click.echo(f"refusing to start: --demo: {config.source}: the extension offering the "
                       "demo is switched off (its `enabled: false`)", err=True)
            sys.exit(2)
        try:
            demo_mod.seed(config)
        except (StoreUnusable, OSError) as exc:
            click.echo(f"refusing to start: {exc}", err=True)
            sys.exit(3)
        _serve(config, config_path, host, port, threads,
               notice=demo_mod.warning(demo_model, config))
    finally:
        demo_model.stop()


def _checked_config(config_path, overlay=None):
    """The config ``check-config`` finds no problem in; else its problems printed, exit 2."""
    from . import preflight
    config, problems = preflight.load_and_check(config_path, store=False, overlay=overlay,
                                                sections=installed.config_sections())
    if problems or config is None:
        for line in problems:
            click.echo(line, err=True)
        click.echo("refusing to start: fix the problems above "
                   "(.venv/bin/python main.py check-config)", err=True)
        sys.exit(2)
    return config


def _log_start(config, notice=None) -> None:
    """The log set up from ``config``, and the start lines: ``notice`` (the demo's), the
    config's warnings, the limits, a missing provider."""
    from .logs import configure
    configure(config.service.log_level, config.service.log_format)
    if notice:
        log.warning("%s", notice)
    for line in config.warnings:
        if line not in config.provider_issues:
            log.warning("config: %s", line)
    from .config.sizing import summary
    log.info("limits: %s", summary(config))
    from .lifecycle import no_provider
    if config.provider_issues:     # one line: what to set, and what happens until then
        log.warning("%s", no_provider(config))


def _start_services(svc, config):
    """What serving starts beside the app: orphans of a dead service reaped, the extensions
    told, the periodic retention job (returned, to stop)."""
    reaped = svc.processes.reap_orphans()
    if reaped:
        log.warning("killed %d Hermes process group(s) left by a service that died", reaped)
    for ext in installed.enabled(config):
        ext.on_serve(svc)
    from .retention import RetentionJob
    retention = RetentionJob(svc)
    if retention.start():
        log.info("retention: a cleanup pass every %g s (session mappings: %s)",
                 retention.interval, config.retention.sessions_older_than or "kept")
    else:
        log.info("retention: no periodic cleanup (retention.interval_seconds: 0)")
    return retention


def _serve(config, config_path, host, port, threads, notice=None):
    """Serve ``config`` (checked) until the process is told to stop."""
    from . import preflight
    if threads:      # --threads: what waitress really runs with (reloads are checked against it)
        config = config.override("service", "threads", threads)
    _log_start(config, notice)
    from waitress.channel import HTTPChannel
    from waitress.server import create_server

    from .app import create_app
    from .lifecycle import Lifecycle, ServiceRecord, running, waitress_options
    from .services import default_service_url
    from .web import framing
    host = host or config.service.host
    port = config.service.port if port is None else port
    try:
        app = create_app(config, service_url=default_service_url(config, host, port))
    except (CorruptStore, StoreUnusable) as exc:
        click.echo(f"refusing to start: {exc}", err=True)
        sys.exit(3)
    svc = app.extensions["hermes_service"]
    retention = _start_services(svc, config)
    preflight.raise_fd_limit(config)
    socket_map: dict = {}
    server = create_server(app, map=socket_map, host=host, port=port,
                           **waitress_options(config))
    # ambiguous body framing is refused in waitress's parser, before the app (RFC 9112 §6.1)
    framing.install(server, socket_map, framing.app_renderer(app))
    record = ServiceRecord(config.data_dir, config_path, f"http://{host}:{port}")
    lifecycle = Lifecycle(svc, config_path, record,
                          lambda: [c for c in list(socket_map.values())
                                   if isinstance(c, HTTPChannel)])
    lifecycle.install()
    record.write()
    log.info("serving on %s (pid %d): %s", record.data["url"], record.data["pid"],
             running(config, svc.sandbox))
    log.info("disk: %s", svc.disk.describe())
    if svc.disk.quota_warning():
        log.warning("disk: %s", svc.disk.quota_warning())
    try:
        server.run()
    finally:   # however the loop ends, no Hermes process outlives the service
        retention.stop()
        killed = svc.shutdown()
        record.remove()
        try:      # the last process on the data dir unmounts the home images
            for point in svc.disk.release():
                log.info("disk: unmounted %s", point)
        except Exception:  # the stop goes on; the next start uses them as they are
            log.exception("disk: home images not unmounted")
        if killed:
            log.info("stopped; killed %d Hermes process group(s)", killed)
        from . import logs
        logs.flush()     # the log writer's queue (atexit flushes again: logging.shutdown)


@cli.command("check-config")
@click.pass_context
def check_config(ctx):
    """Validate the config and what it names (command, template, data dir, session registry);
    print ``file:key: problem`` lines and exit 2 if any. Every problem it can find is printed
    in one run: the file's (schema and cross-field checks) and, for the keys that validated,
    what they name. Warnings (``warning: file:key: …``: expired keys, no usable provider) are
    printed too but do not fail. Then the sandbox, the disk and the sizing of the limits
    (``sizing: …`` lines: the machine, each limit, and the rule and numbers of those the file
    left null; docs/scaling.md §Sizing a node)."""
    from . import preflight
    config, problems = preflight.load_and_check(ctx.obj["config_path"], overlay=_overlay(ctx),
                                                sections=installed.config_sections())
    for line in problems:
        click.echo(line, err=True)
    for line in config.warnings if config is not None else ():
        click.echo(f"warning: {line}", err=True)
    if problems or config is None:
        sys.exit(2)
    from .disk.quota import Disk
    from .homes.users import HERMES_SITE
    from .sandbox import Sandbox
    box = Sandbox(config.hermes.sandbox, config.data_dir, HERMES_SITE)
    click.echo(f"sandbox: {box.describe()}")
    disk = Disk(config.hermes.sandbox, config.data_dir, config.paths.homes,
                config.storage.enabled)
    click.echo(f"disk: {disk.describe()}")
    if disk.quota_warning():
        click.echo(f"warning: {config.source}:{disk.quota_warning()}", err=True)
    from .config.sizing import explain
    for line in explain(config):      # the sizing rule with its numbers (docs/scaling.md)
        click.echo(f"sizing: {line}")
    click.echo(f"{config.source}: OK" + (f" ({len(config.warnings)} warning(s))"
                                         if config.warnings else ""))


@cli.command()
@click.option("--timeout", type=float, default=15.0, show_default=True,
              help="Seconds to wait for each service's answer.")
@click.pass_context
def reload(ctx, timeout):
    """Make the running service(s) on this config's data dir re-read the config (SIGHUP).

    Prints each service's outcome: applied (with notes: settings that need a restart,
    warnings) or refused (the problems; the running config stays). A file with problems is
    signalled all the same, so that the service's log says ``reload refused: file:key:
    problem`` too; the services are then found through the data dir the file names
    (``paths.data_dir``, when it can be read from the broken file) or else, among those of
    ``data/`` beside the file, the ones serving this very file. Exit 0 applied, 2 refused (or
    the file is invalid and no service runs), 1 no running service / no answer. docs/configuring.md
    §Reload.
    """
    from .lifecycle import request_reload
    path = ctx.obj["config_path"]
    try:
        config = installed.load_config(path, need_keys=False, overlay=_overlay(ctx))
    except ConfigError as exc:
        problems = exc.problems
        data_dir, guessed = _data_dir_named_by(path)
        if ctx.obj.get("demo"):
            data_dir = data_dir / _demo().DATA_SUBDIR
    else:
        problems, data_dir, guessed = [], config.data_dir, False
    results = request_reload(data_dir, timeout, config_path=path if guessed else None)
    if not results or all(status is None for _pid, status in results):
        for line in problems:      # no service says it: the command does
            click.echo(line, err=True)
    if not results:
        click.echo(f"no running service found for data dir {data_dir}"
                   + (f" serving {Path(path).resolve()}" if guessed else ""), err=True)
        sys.exit(2 if problems else 1)
    code = 0
    for pid, status in results:
        if status is None:
            click.echo(f"pid {pid}: no answer within {timeout:g} s", err=True)
            code = max(code, 1)
            continue
        outcome = "reloaded" if status["ok"] else "refused; the running config stays"
        click.echo(f"pid {pid}: {outcome}", err=not status["ok"])
        for line in status["lines"]:
            click.echo(f"  {line}", err=not status["ok"])
        if not status["ok"]:
            code = 2
    sys.exit(code)


def _data_dir_named_by(path) -> tuple[Path, bool]:
    """The data dir a config file that does not validate names: its ``paths.data_dir`` when
    that can be read (resolved like :func:`~hermes_service.config.load_config` does), else the
    default ``data`` beside the file; and whether it is that guess."""
    import os

    import yaml

    from .config import DEFAULTS
    folder = Path(path).resolve().parent
    try:
        named = yaml.safe_load(Path(path).read_text("utf-8"))["paths"]["data_dir"]
    except Exception:       # noqa: BLE001 - unreadable, no YAML, no such key: guess
        named = None
    if isinstance(named, str) and named:
        return folder / os.path.expanduser(named), False
    return folder / DEFAULTS["paths"]["data_dir"], True


@cli.command()
def keygen():
    """Print a new random API key and its sha256 (put the digest in config.yaml as key_sha256)."""
    key = secrets.token_urlsafe(32)
    click.echo(f"key:        {key}")
    click.echo(f"key_sha256: {hashlib.sha256(key.encode()).hexdigest()}")


@cli.command()
@click.option("--older-than", default="30d", show_default=True,
              help="Remove session mappings unused this long: a duration like 30d, 12h, 2w "
                   "(units s m h d w; at least 1h).")
@click.option("--dry-run", is_flag=True, help="Print what would be removed; remove nothing.")
@click.option("--purge-transcripts", is_flag=True,
              help="Also delete the removed sessions' Hermes transcripts (`hermes sessions "
                   "delete` in the user's home).")
@click.pass_context
def gc(ctx, older_than, dry_run, purge_transcripts):
    """Remove stale session mappings, lock files nobody holds, leftovers of killed writes,
    page-store idempotency records past their retry window and expired Idempotency-Key
    records (``service.idempotency_ttl_seconds``); print each removal.

    Never touches a session whose turn lock is held. Exit 0; 1 if something was skipped (a
    damaged shard, a failed purge); 3 if the registry or an extension's store (e.g.
    data/mnote.db) cannot be opened.
    docs/data-and-durability.md §Retention and cleanup."""
    from .config import MIN_SESSION_AGE_SECONDS, parse_duration
    try:
        seconds = parse_duration(older_than)
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="--older-than") from None
    if seconds < MIN_SESSION_AGE_SECONDS:
        raise click.BadParameter("must be at least 1h (a mapping used within the last hour is "
                                 "never removed)", param_hint="--older-than")
    config = _load(ctx.obj["config_path"], need_keys=False, overlay=_overlay(ctx))
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s %(message)s")
    from .retention import collect
    from .services import build_services
    try:
        services = build_services(config)
    except (CorruptStore, StoreUnusable) as exc:
        click.echo(f"refusing to run: {exc}", err=True)
        sys.exit(3)
    try:
        report = collect(services, older_than=seconds, dry_run=dry_run,
                         purge_transcripts=purge_transcripts)
    finally:     # home images it mounted, unless a serving process uses them
        services.disk.release()
    for line in report.lines:
        click.echo(line)
    click.echo(report.summary())
    sys.exit(1 if report.problems else 0)


@cli.command("home-trim")
@click.argument("user_id")
@click.argument("paths", nargs=-1)
@click.pass_context
def home_trim(ctx, user_id, paths):
    """The way out of a home at its quota (507 home_quota_exceeded): without PATHS, print
    what the home uses and its largest entries; with PATHS (inside the home, e.g.
    ``big.bin`` or ``build/``), remove them — never following a symlink, never Hermes's
    ``.hermes`` — and print the use after. Safe while the service runs. Exit 2 for a bad
    user id or path. docs/sandbox.md §A home at its quota."""
    from .disk.quota import Disk
    from .disk.use import usage
    from .errors import ServiceError
    from .homes import trim
    from .homes.users import UserHomes
    config = _load(ctx.obj["config_path"], need_keys=False, overlay=_overlay(ctx))
    disk = Disk(config.hermes.sandbox, config.data_dir, config.paths.homes,
                config.storage.enabled)
    try:
        home = UserHomes(config.paths, config.hermes).path(user_id)
        if not os.path.isdir(home.root):
            raise click.UsageError(f"{user_id} has no home in {home.root.parent}")
        disk.make_folder(home.root, 0o777)        # its image mounted, when it has one
        for path in paths:
            gone = trim.remove(home.root, path)
            click.echo(f"{'removed' if gone else 'not found'}: {path}")
        used = usage(home.root, config.paths.homes / "runs" / user_id)
        click.echo(f"{user_id}: files {used.files_mb:.1f} MiB of {disk.files_cap_mb:g}, "
                   f"whole home {used.total_mb:.1f} MiB of {disk.max_home_mb:g} "
                   f"(hermes.sandbox.max_home_mb)")
        if not paths:
            for entry in trim.largest(home.root):
                click.echo(f"{entry.mb:10.1f} MiB  {entry.path}")
    except (trim.BadPath, ServiceError) as exc:
        click.echo(f"home-trim: {exc}", err=True)
        sys.exit(2)
    finally:
        disk.release()


@cli.command()
@click.option("--user", "user_id", default=None, help="Only this user id.")
@click.option("--days", type=click.IntRange(min=1), default=30, show_default=True,
              help="The last N UTC days, today included.")
@click.option("--daily", is_flag=True, help="One row per user and day instead of per user.")
@click.pass_context
def usage(ctx, user_id, days, daily):
    """Print model token usage per user, as the provider reported it in its own ``usage``
    fields on the model pass-through endpoint (data/model_usage.db): requests, prompt and
    completion tokens, with a total line; ``estimated``: the requests whose tokens the
    pass-through estimated (the provider reported none: docs/sandbox.md §Token usage).
    Exit 0 (also when nothing is recorded yet); 3 if the usage db cannot be read."""
    import sqlite3

    from .model_proxy.usage import read_usage, usage_db_path
    config = _load(ctx.obj["config_path"], need_keys=False, overlay=_overlay(ctx))
    path = usage_db_path(config.data_dir)
    try:
        rows = read_usage(path, user_id=user_id, days=days, daily=daily)
    except sqlite3.Error as exc:
        click.echo(f"refusing to run: {path}: {exc}", err=True)
        sys.exit(3)
    span = "today (UTC)" if days == 1 else f"the last {days} days (UTC, today included)"
    if not rows:
        click.echo(f"no model usage recorded in {span}" + (f" for {user_id}" if user_id else ""))
        return
    head = ["user", *(["day"] if daily else []), "requests", "prompt_tokens",
            "completion_tokens", "total_tokens", "estimated"]
    table = [[r.user_id, *([r.day] if daily else []), str(r.requests), str(r.prompt_tokens),
              str(r.completion_tokens), str(r.prompt_tokens + r.completion_tokens),
              str(r.estimated_requests)] for r in rows]
    if len(rows) > 1:
        tot = [sum(getattr(r, k) for r in rows)
               for k in ("requests", "prompt_tokens", "completion_tokens")]
        table.append(["(total)", *([""] if daily else []), *map(str, tot), str(tot[1] + tot[2]),
                      str(sum(r.estimated_requests for r in rows))])
    widths = [max(len(x) for x in col) for col in zip(head, *table, strict=True)]
    nums = len(head) - 5

    def line(cells):
        return "  ".join(c.ljust(w) if i < nums else c.rjust(w)
                         for i, (c, w) in enumerate(zip(cells, widths, strict=True))).rstrip()
    click.echo(f"model usage, {span}:")
    click.echo(line(head))
    for cells in table:
        click.echo(line(cells))


# every installed extension's command group (hermes_service/extensions.py)
for _ext in installed.extensions():
    _ext.init_cli(cli)
