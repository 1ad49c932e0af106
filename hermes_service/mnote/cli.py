"""The ``mnote`` operator commands (click), added to the service's command line by the
extension (:meth:`~.extension.MnoteExtension.init_cli`):

* ``add-workspace``, ``add-member``, ``import-page``, ``export-page`` on the embedded page store
  (``<data_dir>/mnote.db``, or ``--db FILE``);
* ``serve-kernel`` and ``kernel-command``: the reference kernel (:mod:`.kernel_reference`), that
  store over the kernel adapter's HTTP and command protocol;
* ``check-kernel``: the contract's cases against a kernel (:mod:`.kernel_check`).

The config is read when a command needs it (the store's default path, the configured kernel):
exit 2 on a config problem, a refused input or ``mnote.enabled: false``, 3 if the page store
cannot be opened; ``check-kernel`` exits 1 when a case failed.
"""
from __future__ import annotations

import os
import secrets
import shlex
import sys

import click

from .objects import settings
from .settings import DEFAULTS


@click.group()
@click.option("--db", "db", default=None, metavar="FILE",
              help="The embedded page store file (default: <data_dir>/mnote.db).")
@click.pass_context
def mnote(ctx, db):
    """The embedded mnote page store (data/mnote.db), the reference kernel and the kernel
    conformance check."""
    ctx.obj["db"] = db


def _config(ctx):
    """The config (loaded once); exits 2 when it has a problem or the extension is off."""
    if "config" not in ctx.obj:
        config = ctx.obj["load_config"](ctx)     # the core's loader (Extension.init_cli)
        if not settings(config).enabled:
            click.echo(f"{config.source}:mnote.enabled: false: the mnote extension is off; "
                       "set it to true to use these commands", err=True)
            sys.exit(2)
        ctx.obj["config"] = config
    return ctx.obj["config"]


def _db_path(ctx):
    if ctx.obj.get("db"):
        return ctx.obj["db"]
    config = _config(ctx)
    config.data_dir.mkdir(parents=True, exist_ok=True)
    return config.data_dir / "mnote.db"


def _opened(ctx, make):
    """``make(path)`` of the page store file; exits 3 if it cannot be opened."""
    from .page_store import PageStoreUnusable
    try:
        return make(_db_path(ctx))
    except PageStoreUnusable as exc:
        click.echo(f"refusing to run: {exc}", err=True)
        sys.exit(3)


def _store(ctx):
    if "store" not in ctx.obj:
        from .page_sqlite import SQLitePageStore
        if not ctx.obj.get("db"):
            kind = settings(_config(ctx)).page_store.kind
            if kind != "embedded":
                click.echo(f"note: mnote.page_store.kind is {kind}: the service reads its pages "
                           "from mnote's kernel, not from this file", err=True)
        ctx.obj["store"] = _opened(ctx, SQLitePageStore)
    return ctx.obj["store"]


def _store_call(ctx, name, *args):
    from .page_store import StoreInputError
    try:
        return getattr(_store(ctx), name)(*args)
    except StoreInputError as exc:
        click.echo(f"error: {exc}", err=True)
        sys.exit(2)


@mnote.command("add-workspace")
@click.argument("workspace_id")
@click.option("--name", default=None, help="Display name.")
@click.pass_context
def add_workspace(ctx, workspace_id, name):
    """Create (or rename) a workspace."""
    _store_call(ctx, "add_workspace", workspace_id, name)
    click.echo(f"workspace {workspace_id} ready")


@mnote.command("add-member")
@click.argument("workspace_id")
@click.argument("actor_id")
@click.argument("role", type=click.Choice(["owner", "editor", "viewer"]))
@click.pass_context
def add_member(ctx, workspace_id, actor_id, role):
    """Add ACTOR_ID (the X-Mnote-Actor-Id of mnote users) to a workspace with ROLE."""
    _store_call(ctx, "add_member", workspace_id, actor_id, role)
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
    out = _store_call(ctx, "import_page", page)
    click.echo(json.dumps(out, ensure_ascii=False))


@mnote.command("export-page")
@click.argument("document_id")
@click.pass_context
def export_page(ctx, document_id):
    """Print a page (with its artifacts) as JSON."""
    import json
    click.echo(json.dumps(_store_call(ctx, "export_page", document_id),
                          ensure_ascii=False, indent=2))


def _credential(ctx, name):
    """The value of the variable ``name`` (exit 2 when it is unset)."""
    value = os.environ.get(name)
    if not value:
        click.echo(f"error: --credential-env {name}: the variable is not set", err=True)
        sys.exit(2)
    return value


@mnote.command("serve-kernel")
@click.option("--host", default="127.0.0.1", show_default=True)
@click.option("--port", type=int, default=9124, show_default=True, help="0: a free port.")
@click.option("--credential-env", default=None, metavar="NAME",
              help="The variable holding the credential callers must send (Authorization: "
                   "Bearer); default: mnote.page_store.credential_env.")
@click.option("--no-credential", is_flag=True,
              help="Answer any caller (only for a kernel nobody else can reach).")
@click.pass_context
def serve_kernel(ctx, host, port, credential_env, no_credential):
    """The reference kernel over HTTP: the embedded page store answering the tool contract's
    envelopes (docs/mnote-tools.md §The reference kernel). Prints its URL, serves until
    interrupted."""
    from .kernel.reference import ReferenceKernel
    if not credential_env and not no_credential:
        credential_env = settings(_config(ctx)).page_store.credential_env
        if not credential_env:
            click.echo("error: name the credential's variable (--credential-env NAME, or "
                       "mnote.page_store.credential_env), or pass --no-credential", err=True)
            sys.exit(2)
    credential = None if no_credential else _credential(ctx, credential_env)
    kernel = _opened(ctx, lambda path: ReferenceKernel(path, credential))

    def ready(url):
        auth = "any caller" if credential is None else f"Bearer ${credential_env}"
        click.echo(f"mnote reference kernel: {kernel.store.path} at {url} ({auth})")
        sys.stdout.flush()
    try:
        kernel.serve(host, port, ready)
    except KeyboardInterrupt:
        pass


@mnote.command("kernel-command")
@click.pass_context
def kernel_command(ctx):
    """The reference kernel as a command: one tool envelope on standard input, its answer on
    standard output (mnote.page_store.command; docs/mnote-tools.md §The reference kernel)."""
    from .kernel.reference import ReferenceKernel
    kernel = _opened(ctx, ReferenceKernel)
    sys.exit(kernel.command(sys.stdin.buffer, sys.stdout.buffer))


@mnote.command("check-kernel")
@click.option("--url", default=None, help="The kernel's URL (HTTP).")
@click.option("--command", "command", default=None, metavar="ARGV",
              help="The kernel's command, split like a shell would (never run by one).")
@click.option("--credential-env", default=None, metavar="NAME",
              help="The variable holding the credential "
                   "(default: mnote.page_store.credential_env).")
@click.option("--ca-file", default=None, help="CA bundle for an https kernel.")
@click.option("--timeout", type=float, default=None, help="Seconds per call (default: "
              "mnote.page_store.timeout_seconds).")
@click.option("--workspace", default="ws_1", show_default=True)
@click.option("--document", default="doc_1", show_default=True,
              help="A page the actor may write: the check appends marked blocks to it.")
@click.option("--actor", default="user_1", show_default=True)
@click.option("--outsider", default=None, help="An actor who is no member of the workspace "
              "(default: a fresh random id).")
@click.pass_context
def check_kernel(ctx, url, command, credential_env, ca_file, timeout, workspace, document, actor,
                 outsider):
    """Run the tool contract's cases against a kernel (--url or --command; without either:
    the one mnote.page_store names, with its credential, CA file and timeout): one line per
    case and a summary; exit 1 if a case failed (docs/mnote-tools.md §Conformance check)."""
    from .kernel import check as kernel_check
    from .kernel.command import CommandKernel
    from .kernel.over_http import HttpKernel
    if url and command:
        click.echo("error: give --url or --command, not both", err=True)
        sys.exit(2)
    if not url and not command:             # the configured kernel, with its settings
        ps = settings(_config(ctx)).page_store
        if ps.kind == "embedded":
            click.echo("error: give --url or --command (mnote.page_store.kind is embedded: no "
                       "kernel is configured)", err=True)
            sys.exit(2)
        url, command = (ps.url, None) if ps.kind == "http" else (None, list(ps.command or ()))
        credential_env = credential_env or ps.credential_env
        ca_file = ca_file or ps.ca_file
        timeout = timeout or ps.timeout_seconds
    timeout = timeout or DEFAULTS["page_store"]["timeout_seconds"]
    if credential_env:
        _credential(ctx, credential_env)
    argv = shlex.split(command) if isinstance(command, str) else command
    try:
        transport = HttpKernel(url, credential_env=credential_env or None, ca_file=ca_file) \
            if url else CommandKernel(argv, credential_env=credential_env or None)
    except (ValueError, OSError) as exc:
        click.echo(f"error: {exc}", err=True)
        sys.exit(2)
    target = kernel_check.Target(workspace, document, actor,
                                 outsider or f"check_outsider_{secrets.token_hex(4)}")
    failed = kernel_check.run(transport, target, timeout, click.echo)
    transport.close()
    sys.exit(1 if failed else 0)
