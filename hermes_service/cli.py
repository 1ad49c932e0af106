"""Operator commands (click): serve (default), ``check-config``, ``keygen``.

``.venv/bin/python main.py [--config PATH] [--host H] [--port P] [--threads N]`` serves
with waitress. A bad config or a corrupt ``sessions.json`` exits non-zero
before anything listens.
"""
from __future__ import annotations

import hashlib
import logging
import secrets
import signal
import sys

import click

from .config import ENV_CONFIG, ConfigError, load_config, provider_problem
from .session_store import CorruptStore


def _load(path, need_keys: bool = True):
    try:
        return load_config(path, need_keys=need_keys)
    except ConfigError as exc:
        for line in exc.problems:
            click.echo(line, err=True)
        sys.exit(2)


@click.group(invoke_without_command=True)
@click.option("--config", "config_path", envvar=ENV_CONFIG, default="config.yaml", show_default=True,
              help=f"Config file (env {ENV_CONFIG}).")
@click.option("--host", default=None, help="Override service.host.")
@click.option("--port", type=int, default=None, help="Override service.port.")
@click.option("--threads", type=int, default=None, help="Override service.threads (waitress).")
@click.pass_context
def cli(ctx, config_path, host, port, threads):
    """hermes-service: the Hermes Agent CLI as a REST API. Without a command: serve."""
    ctx.ensure_object(dict)
    ctx.obj["config_path"] = config_path
    if ctx.invoked_subcommand is None:
        serve(config_path, host, port, threads)


def serve(config_path, host=None, port=None, threads=None):
    config = _load(config_path)
    svc_cfg = config["service"]
    from .logs import configure
    configure(svc_cfg["log_level"], svc_cfg["log_format"])
    from .app import create_app
    from .services import default_service_url
    host = host or svc_cfg["host"]
    port = svc_cfg["port"] if port is None else port
    try:
        app = create_app(config, service_url=default_service_url(config, host, port))
    except CorruptStore as exc:
        click.echo(f"refusing to start: {exc}", err=True)
        sys.exit(3)
    from waitress import serve as waitress_serve
    runner = app.extensions["hermes_service"].runner
    reaped = runner.reap_orphans()
    if reaped:
        logging.getLogger("hermes_service").warning(
            "killed %d Hermes CLI process group(s) left by a service that died", reaped)

    def stop(signum, _frame):
        killed = runner.kill_all()   # first, so no caller waits for waitress's own shutdown
        logging.getLogger("hermes_service").info("signal %d: killed %d running CLI process(es)",
                                                 signum, killed)
        raise SystemExit(128 + signum)
    signal.signal(signal.SIGTERM, stop)
    problem = provider_problem(config)
    if problem:    # serve anyway: health, sessions and the operator routes work without it
        logging.getLogger("hermes_service").warning(
            "%s — until then every message gets 503 hermes_unconfigured (README, first screen)",
            problem)
    logging.getLogger("hermes_service").info("serving on http://%s:%s", host, port)
    # X-Forwarded-For is judged by security.Guard (nginx.trusted_proxies); waitress must
    # pass it through instead of dropping it.
    try:
        waitress_serve(app, host=host, port=port, threads=threads or svc_cfg["threads"],
                       ident="hermes-service", channel_timeout=3600,
                       clear_untrusted_proxy_headers=False)
    finally:   # SIGTERM, Ctrl-C: no CLI run outlives the service
        killed = runner.kill_all()
        logging.getLogger("hermes_service").info("stopped; killed %d running CLI process(es)",
                                                 killed)


@cli.command("check-config")
@click.pass_context
def check_config(ctx):
    """Validate the config; print ``file:key: problem`` lines and exit 2 if any."""
    config = _load(ctx.obj["config_path"])
    from .runner import HermesRunner
    from .errors import Unconfigured
    problems = []
    try:
        HermesRunner(config["hermes"]).command_path()
    except Unconfigured as exc:
        problems.append(f"{config.source}:hermes.command: {exc.detail}")
    if not (config.users_template / "config.yaml").is_file():
        problems.append(f"{config.source}:paths.users_template: {config.users_template}/config.yaml "
                        "does not exist")
    try:
        from .session_store import SessionStore
        if (config.data_dir / "sessions.json").exists():
            SessionStore(config.data_dir / "sessions.json")
    except CorruptStore as exc:
        problems.append(str(exc))
    for line in problems:
        click.echo(line, err=True)
    if problems:
        sys.exit(2)
    problem = provider_problem(config)
    if problem:
        click.echo(f"warning: {config.source}:hermes.model: {problem}; until then every message "
                   "gets 503 hermes_unconfigured", err=True)
    click.echo(f"{config.source}: OK")


@cli.command()
def keygen():
    """Print a new random API key and its sha256 (put the digest in config.yaml as key_sha256)."""
    key = secrets.token_urlsafe(32)
    click.echo(f"key:        {key}")
    click.echo(f"key_sha256: {hashlib.sha256(key.encode()).hexdigest()}")


@cli.group()
@click.pass_context
def mnote(ctx):
    """Operator commands for the embedded mnote page store (data/mnote.db)."""
    config = _load(ctx.obj["config_path"], need_keys=False)
    from .mnote.page_store import SQLitePageStore
    config.data_dir.mkdir(parents=True, exist_ok=True)
    ctx.obj["store"] = SQLitePageStore(config.data_dir / "mnote.db")


def _store_call(fn, *args):
    from .mnote.page_store import StoreInputError
    try:
        return fn(*args)
    except StoreInputError as exc:
        click.echo(f"error: {exc}", err=True)
        sys.exit(2)


@mnote.command("add-workspace")
@click.argument("workspace_id")
@click.option("--name", default=None, help="Display name.")
@click.pass_context
def add_workspace(ctx, workspace_id, name):
    """Create (or rename) a workspace."""
    _store_call(ctx.obj["store"].add_workspace, workspace_id, name)
    click.echo(f"workspace {workspace_id} ready")


@mnote.command("add-member")
@click.argument("workspace_id")
@click.argument("actor_id")
@click.argument("role", type=click.Choice(["owner", "editor", "viewer"]))
@click.pass_context
def add_member(ctx, workspace_id, actor_id, role):
    """Add ACTOR_ID (the X-Mnote-Actor-Id of mnote users) to a workspace with ROLE."""
    _store_call(ctx.obj["store"].add_member, workspace_id, actor_id, role)
    click.echo(f"{actor_id} is {role} of {workspace_id}")


@mnote.command("import-page")
@click.argument("file", type=click.File("r", encoding="utf-8"))
@click.pass_context
def import_page(ctx, file):
    """Create or overwrite a page from FILE.json ({documentId, workspaceId, title, blocks?,
    pageOptions?}; '-' reads standard input)."""
    import json
    try:
        page = json.load(file)
    except ValueError as exc:
        click.echo(f"error: {file.name}: not JSON ({exc})", err=True)
        sys.exit(2)
    out = _store_call(ctx.obj["store"].import_page, page)
    click.echo(json.dumps(out, ensure_ascii=False))


@mnote.command("export-page")
@click.argument("document_id")
@click.pass_context
def export_page(ctx, document_id):
    """Print a page (with its artifacts) as JSON."""
    import json
    click.echo(json.dumps(_store_call(ctx.obj["store"].export_page, document_id),
                          ensure_ascii=False, indent=2))
