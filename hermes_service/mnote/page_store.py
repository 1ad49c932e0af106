"""Page store: the commands behind the mnote Hermes tools, as an interface.

:class:`PageStore` is the command interface (contract §4/§5): every tool
command takes a :class:`CommandContext` (who, where, which Hermes run,
idempotency key, dryRun) and returns a :class:`CommandResult`, or raises a
:class:`ToolError` whose ``code`` is a contract error code.  The store owns
permissions, idempotency, dryRun and the audit log, so another adapter
(e.g. one forwarding to mnote's own kernel) can implement the same
commands.  :class:`~.page_sqlite.SQLitePageStore` is the only implementation.
"""
from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Protocol, runtime_checkable

from ..extensions import StoreUnusable
from .schemas import PAGE_OPTION_KEYS

ROLES = ("owner", "editor", "viewer")
WRITER_ROLES = ("owner", "editor")
DEFAULT_PAGE_OPTIONS = {k: False for k in PAGE_OPTION_KEYS}
#: Per-option runtime support; only "wired" options may be changed by AI (contract §4
#update_options).
OPTION_RUNTIME_SUPPORT = {"wideLayout": "wired", "smallText": "wired", "showToc": "wired",
                          "protectEditing": "not_wired"}

# Command names (contract §4 names the page ones; the artifact ones are ours).
CMD_PAGE_SAVE = "page.body.save"
CMD_UPDATE_TITLE = "page.head.updateTitle"
CMD_UPDATE_OPTIONS = "page.layout.updateOptions"
CMD_SUMMARY = "artifact.summary.upsert"
CMD_AI_NOTE = "artifact.aiNote.create"

# Permission messages.  "Cannot read" is one message for a missing page, a
# foreign workspace and a non-member, so an unknown page looks exactly like
# an unreadable one (contract §5).
MSG_NO_ACTOR = "未登录：缺少 actorId"
MSG_NO_READ = "无页面读取权限"
MSG_NO_WRITE = "无页面写权限"
MSG_PROTECTED = "页面已开启编辑保护，AI 不可写入"
MSG_NO_ARTIFACT_WRITE = "无 artifact 写权限"
MSG_CONFLICT = "页面版本冲突，需要刷新后重试"   # contract §4 page.save business failure, verbatim


# --------------------------------------------------------------------------- errors
class ToolError(Exception):
    """A tool failure with a stable contract ``code`` and a leak-free ``message``."""
    code = "mnote_tool_error"

    def __init__(self, message: str):
        super().__init__(message)
        self.message = message


class PermissionDenied(ToolError):
    code = "mnote_tool_permission_denied"


class Conflict(ToolError):
    code = "mnote_tool_conflict"


class IdempotencyConflict(ToolError):
    code = "mnote_tool_idempotency_conflict"


class UnsupportedOption(ToolError):
    """A page option whose runtimeSupport is not "wired" (code added by this service)."""
    code = "mnote_tool_unsupported_option"


class BadToolInput(ToolError):
    code = "mnote_tool_bad_request"


class PageStoreUnusable(StoreUnusable):
    """``data/mnote.db`` cannot be opened (not an SQLite database, unreadable, a folder).
    The message names the file and the reason; the file is never overwritten. The service
    and the operator commands refuse to run (exit 3)."""


class StoreInputError(ValueError):
    """Invalid operator input (bad id, unknown role, page owned by another workspace…)."""


class NotFoundError(StoreInputError, LookupError):
    """Operator lookup of a workspace/page that does not exist."""


# --------------------------------------------------------------------------- command types
@dataclass(frozen=True)
class CommandContext:
    """Who runs a command, on which page, from which Hermes run (contract §2 envelope)."""
    actor_id: str | None
    workspace_id: str
    document_id: str
    tool_name: str = ""
    session_id: str | None = None
    run_id: str | None = None
    tool_call_id: str | None = None
    trace_id: str | None = None
    idempotency_key: str | None = None
    dry_run: bool = False


@dataclass(frozen=True)
class CommandResult:
    """``result`` is the tool result object; ``effect`` is read | write | dry_run."""
    result: dict
    effect: str
    command_id: str | None = None
    replayed: bool = False


@runtime_checkable
class PageStore(Protocol):
    """The commands of the mnote tools plus operator functions.

    Tool commands raise :class:`ToolError` subclasses; operator functions raise
    :class:`StoreInputError` / :class:`NotFoundError`.
    """

    def page_get(self, ctx: CommandContext) -> CommandResult:
        """Read → result {documentId, workspaceId, title, revision, pageOptions, blocks}."""

    def page_save(self, ctx: CommandContext, *, content: list[dict], mode: str = "append",
                  base_revision: int | None = None) -> CommandResult:
        """``page.body.save`` → {commandName, revision}; dryRun → {dryRun, diff}."""

    def update_title(self, ctx: CommandContext, *, title: str,
                     base_revision: int | None = None) -> CommandResult:
        """``page.head.updateTitle`` → {commandName, revision}."""

    def update_options(self, ctx: CommandContext, *, options: dict[str, bool],
                       base_revision: int | None = None) -> CommandResult:
        """``page.layout.updateOptions`` → {commandName, revision}; dryRun adds warnings."""

    def create_summary(self, ctx: CommandContext, *, summary: str) -> CommandResult:
        """Upsert the page's single summary artifact and its reference edge."""

    def create_ai_note(self, ctx: CommandContext, *, content: str) -> CommandResult:
        """Create a new ai_note artifact and its reference edge."""

    def add_workspace(self, workspace_id: str, name: str | None = None) -> None: ...

    def add_member(self, workspace_id: str, actor_id: str, role: str) -> None: ...

    def import_page(self, page: dict) -> dict: ...

    def export_page(self, document_id: str) -> dict: ...

    def prune_idempotency(self, before: datetime, dry_run: bool = False) -> int: ...
