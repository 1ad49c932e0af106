"""The ``mnote`` operator commands (click), added to the service's command line by the
extension (:meth:`~.extension.MnoteExtension.init_cli`): ``add-workspace``, ``add-member``,
``import-page``, ``export-page`` on the embedded page store (``data/mnote.db``).

Exit 2 on a config problem, a refused input or ``mnote.enabled: false``, 3 if the page store
cannot be opened.
"""
from __future__ import annotations

import sys

import click

from .objects import settings


@click.group()
@click.pass_context
def mnote(ctx):
    """Operator commands for the embedded mnote page store (data/mnote.db)."""
    config = ctx.obj["load_config"](ctx)     # the core's loader (Extension.init_cli)
    if not settings(config).enabled:
        click.echo(f"{config.source}:mnote.enabled: false: the mnote extension is off; "
                   "set it to true to use these commands", err=True)
        sys.exit(2)
    from .page_store import PageStoreUnusable, SQLitePageStore
    config.data_dir.mkdir(parents=True, exist_ok=True)
    try:
        ctx.obj["store"] = SQLitePageStore(config.data_dir / "mnote.db")
    except PageStoreUnusable as exc:
        click.echo(f"refusing to run: {exc}", err=True)
        sys.exit(3)


def _store_call(fn, *args):
    from .page_store import StoreInputError
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
