"""mnote Hermes tools: registry and executor (contract ``mnote-hermes-plugin-tool-contract-v1``).

:data:`TOOLS` lists the tools the model is offered: the six of contract §4 and this
service's block tools (``mnote.block.batch``, ``mnote.block.propose``: docs/mnote-tools.md
§Block tools); :data:`PANEL_TOOLS` the panel's review of suggestions, which only the client
routes call.  :class:`ToolExecutor` turns a unified input envelope (§2) into a unified
output envelope (§3):

    {"ok", "toolName", "toolCallId", "traceId", "result",
     "audit": {"effect", "commandId", "workspaceId", "documentId"}, "error"}

``invoke`` never raises.  Failure codes: ``mnote_tool_bad_request`` (envelope
or input fails the schema, oversized field; message starts with the JSON
pointer, e.g. ``/args/content/0/type``), ``mnote_tool_unknown_tool``,
``mnote_tool_permission_denied``, ``mnote_tool_conflict``,
``mnote_tool_idempotency_conflict``, ``mnote_tool_unsupported_option``,
``mnote_tool_internal_error`` (unexpected failure; generic message) and, with mnote's kernel
as the page store, ``mnote_tool_kernel_unavailable`` and any code the kernel answers.

The executor's backend runs the validated call: :class:`StoreBackend` against a
:class:`PageStore` (the embedded SQLite store), or :class:`~.kernel_adapter.KernelBackend`
against mnote's kernel (docs/mnote-tools.md §The kernel adapter).
"""
from __future__ import annotations

import json
import logging
import re
from collections.abc import Callable, Collection
from dataclasses import dataclass
from typing import Any, Protocol

from jsonschema import Draft202012Validator
from jsonschema.exceptions import ValidationError, best_match

from ..errors import json_pointer, schema_error
from .block_store import (
    CMD_ACCEPT,
    CMD_BLOCK_BATCH,
    CMD_PROPOSE,
    CMD_REJECT,
    BlockCommands,
    LimitExceeded,
    NotFoundTool,
    SuggestionClosed,
)
from .blocks import with_hashes
from .kernel.wire import KERNEL_UNAVAILABLE
from .page_store import (
    CMD_AI_NOTE,
    CMD_PAGE_SAVE,
    CMD_SUMMARY,
    CMD_UPDATE_OPTIONS,
    CMD_UPDATE_TITLE,
    MSG_NO_ACTOR,
    BadToolInput,
    CommandContext,
    CommandResult,
    PageStore,
    PermissionDenied,
    ToolError,
)
from .schemas import ENVELOPE_SCHEMA, INPUT_ENVELOPE_FIELDS, MODEL_PARAMETERS, TOOL_INPUT_SCHEMAS

log = logging.getLogger(__name__)

SCHEMA_VERSION = "mnote.hermes_tool.v1"
DEFAULT_MAX_CONTENT_BYTES = 256 * 1024
BODY_SUMMARY_CHARS = 200
CODE_UNKNOWN_TOOL = "mnote_tool_unknown_tool"
CODE_INTERNAL = "mnote_tool_internal_error"
#: every error code this service gives a tool call (docs/mnote-tools.md); a kernel's own
#: codes pass through as well
ERROR_CODES = frozenset({
    "mnote_tool_bad_request", CODE_UNKNOWN_TOOL, "mnote_tool_permission_denied",
    "mnote_tool_conflict", "mnote_tool_idempotency_conflict", "mnote_tool_unsupported_option",
    CODE_INTERNAL, "mnote_tool_unauthorized", KERNEL_UNAVAILABLE, NotFoundTool.code,
    SuggestionClosed.code, LimitExceeded.code})


class _UnknownTool(ToolError):
    code = CODE_UNKNOWN_TOOL


@dataclass(frozen=True)
class ToolSpec:
    """One tool: contract name, function-safe ``wire_name``, required capability ``scope``,
    kernel ``command_name`` (None for reads), contract input ``schema`` (envelope fields
    merged with args) and ``model_parameters`` (the JSON schema of ``args``)."""
    name: str
    wire_name: str
    scope: str
    command_name: str | None
    schema: dict
    model_parameters: dict
    description: str

    @property
    def writes(self) -> bool:
        return self.command_name is not None


def _spec(name: str, scope: str, command: str | None, description: str) -> ToolSpec:
    return ToolSpec(name, name.replace(".", "_"), scope, command, TOOL_INPUT_SCHEMAS[name],
                    MODEL_PARAMETERS[name], description)


TOOLS: list[ToolSpec] = [
    _spec("mnote.page.get", "page.read", None,
          "Read the current mnote page: title, a short bodySummary, pageOptions, the blocks "
          "({id, type, text, hash}) and its revision."),
    _spec("mnote.page.save", "page.write", CMD_PAGE_SAVE,
          "Fallback for rewriting a page: mode 'append' (default) adds blocks at the end, "
          "'replace' replaces the whole body. For changes to a few blocks use "
          "mnote.block.batch instead. Pass baseRevision from mnote.page.get to avoid "
          "overwriting concurrent edits."),
    _spec("mnote.page.update_title", "page.write", CMD_UPDATE_TITLE, "Set the page title."),
    _spec("mnote.page.update_options", "page.write", CMD_UPDATE_OPTIONS,
          "Change page layout options wideLayout, smallText, showToc. protectEditing cannot be "
          "changed by AI."),
    _spec("mnote.artifact.create_summary", "artifact.write", CMD_SUMMARY,
          "Create or replace the page's single summary (a separate artifact linked to the page)."),
    _spec("mnote.artifact.create_ai_note", "artifact.write", CMD_AI_NOTE,
          "Attach a new AI note (a separate artifact linked to the page); each call adds one."),
    _spec("mnote.block.batch", "page.write", CMD_BLOCK_BATCH,
          "Preferred way to change a page: edit only the blocks you mean to, all ops or none. "
          "ops: insert {after: blockId|null, block: {type, text}}, update {blockId, "
          "expectHash, block: {type?, text}}, delete {blockId, expectHash}, move {blockId, "
          "after}; ids and hashes from mnote.page.get. Pass baseRevision (the page.get "
          "revision: others' edits of other blocks are kept) or requiredRevision (refuse if "
          "anything changed). A conflict names the blocks that changed: read the page again."),
    _spec("mnote.block.propose", "page.suggest", CMD_PROPOSE,
          "Propose block ops (same ops and revision fields as mnote.block.batch) plus a short "
          "reason, for the user to review and accept; nothing changes until they do. Use it "
          "instead of mnote.block.batch when the user asked for suggestions or to review "
          "changes first."),
]
#: the panel's review of suggestions: sent by the client routes, never offered to the model
#: and refused from a run token (docs/mnote-tools.md §Suggestions)
PANEL_TOOLS: list[ToolSpec] = [
    _spec("mnote.suggestion.list", "page.read", None, "The page's open suggestions."),
    _spec("mnote.suggestion.accept", "page.write", CMD_ACCEPT, "Accept a suggestion."),
    _spec("mnote.suggestion.reject", "page.write", CMD_REJECT, "Reject a suggestion."),
]
TOOLS_BY_NAME = {t.name: t for t in TOOLS}
TOOLS_BY_WIRE_NAME = {t.wire_name: t for t in TOOLS}
#: every tool the executor knows (the model's and the panel's)
ALL_TOOLS = {t.name: t for t in (*TOOLS, *PANEL_TOOLS)}

_ENVELOPE_VALIDATOR = Draft202012Validator(ENVELOPE_SCHEMA)
_ARGS_VALIDATORS = {n: Draft202012Validator(t.model_parameters) for n, t in ALL_TOOLS.items()}
_INPUT_VALIDATORS = {n: Draft202012Validator(t.schema) for n, t in ALL_TOOLS.items()}


def _first_error(validator: Draft202012Validator, instance: Any,
                 prefix: Callable[[list], list]) -> None:
    """Raise BadToolInput naming the JSON pointer of the most relevant schema error."""
    err: ValidationError | None = best_match(validator.iter_errors(instance))
    if err is None:
        return
    path, reason = schema_error(err, limit=200)
    raise BadToolInput(f"{json_pointer(prefix(path))}: {reason}")


def _unflatten(spec: ToolSpec, env: dict) -> dict:
    """The §2 form of an envelope (``env``: top-level nulls already dropped).

    Contract §4 writes each tool's input as one object, envelope and tool fields side by
    side; §2 puts the tool fields under ``args``. Both are accepted: a tool field at the top
    level moves into ``args``; an envelope field repeated inside ``args`` is dropped when it
    equals the envelope's (otherwise it stays, and the ``args`` schema refuses it, so
    ``args`` can never name another page than the envelope the run binding was checked
    against); top-level ``null`` args count as absent. Raises :class:`BadToolInput` when a
    field is given in both places with different values. Anything that is not an object
    is left for the schemas to refuse."""
    args = env.get("args", {})
    if not isinstance(args, dict):
        return env
    args = {k: v for k, v in args.items() if v is not None}
    fields = spec.model_parameters["properties"]
    moved = {k: v for k, v in env.items() if k in fields and k not in ENVELOPE_SCHEMA["properties"]}
    for key, value in moved.items():
        if key in args and args[key] != value:
            raise BadToolInput(f"{json_pointer([key])}: also given as "
                               f"{json_pointer(['args', key])} with another value")
    args.update(moved)
    for key in INPUT_ENVELOPE_FIELDS:
        if key in args and key in env and args[key] == env[key] and key not in fields:
            del args[key]
    return {**{k: v for k, v in env.items() if k not in moved}, "args": args}


def echo_fields(envelope) -> dict:
    """What an output envelope echoes of the caller's input: ``toolName``, ``toolCallId``,
    ``traceId``, ``workspaceId``, ``documentId`` when each is a string of at most 256
    characters, else None (contract §3 types them string | null; a failure envelope must
    never carry an object or a huge string back)."""
    raw = envelope if isinstance(envelope, dict) else {}
    return {k: v if isinstance(v, str) and len(v) <= 256 else None
            for k in ("toolName", "toolCallId", "traceId", "workspaceId", "documentId")
            for v in [raw.get(k)]}


def body_summary(blocks: list[dict], limit: int = BODY_SUMMARY_CHARS) -> str:
    """The blocks' text, whitespace-collapsed, cut to ``limit`` chars (+ "…")."""
    text = re.sub(r"\s+", " ", " ".join(str(b.get("text", "")) for b in blocks)).strip()
    return text if len(text) <= limit else text[:limit].rstrip() + "…"


class Backend(Protocol):
    """Runs one validated call: ``run(spec, env, args)`` → :class:`CommandResult`, or raises
    :class:`ToolError` (``env``: the envelope in the §2 form with the run's fields, ``args``
    the validated tool fields)."""

    def run(self, spec: ToolSpec, env: dict, args: dict) -> CommandResult: ...


class StoreBackend:
    """The tools against a :class:`PageStore` (the embedded store): its commands, and the
    contract's page.get result shaped from the page (:meth:`shape_page`)."""

    def __init__(self, store: PageStore):
        self.store = store
        blocks = BlockCommands(store)   # type: ignore[arg-type]  # the SQLite store
        self._handlers: dict[str, Callable[[CommandContext, dict], CommandResult]] = {
            "mnote.page.get": lambda ctx, a: store.page_get(ctx),
            "mnote.page.save": lambda ctx, a: store.page_save(
                ctx, content=a["content"], mode=a.get("mode", "append"),
                base_revision=a.get("baseRevision")),
            "mnote.page.update_title": lambda ctx, a: store.update_title(
                ctx, title=a["title"], base_revision=a.get("baseRevision")),
            "mnote.page.update_options": lambda ctx, a: store.update_options(
                ctx, options=a["options"], base_revision=a.get("baseRevision")),
            "mnote.artifact.create_summary": lambda ctx, a: store.create_summary(
                ctx, summary=a["summary"]),
            "mnote.artifact.create_ai_note": lambda ctx, a: store.create_ai_note(
                ctx, content=a["content"]),
            "mnote.block.batch": lambda ctx, a: blocks.block_batch(
                ctx, ops=a["ops"], required_revision=a.get("requiredRevision"),
                base_revision=a.get("baseRevision")),
            "mnote.block.propose": lambda ctx, a: blocks.block_propose(
                ctx, ops=a["ops"], reason=a["reason"],
                required_revision=a.get("requiredRevision"), base_revision=a.get("baseRevision")),
            "mnote.suggestion.list": lambda ctx, a: blocks.suggestions(ctx),
            "mnote.suggestion.accept": lambda ctx, a: blocks.accept(
                ctx, suggestion_id=a["suggestionId"]),
            "mnote.suggestion.reject": lambda ctx, a: blocks.reject(
                ctx, suggestion_id=a["suggestionId"]),
        }

    def run(self, spec: ToolSpec, env: dict, args: dict) -> CommandResult:
        ctx = CommandContext(
            actor_id=env["actorId"], workspace_id=env["workspaceId"], document_id=env["documentId"],
            tool_name=spec.name, session_id=env["sessionId"], run_id=env["runId"],
            tool_call_id=env["toolCallId"], trace_id=env["traceId"],
            idempotency_key=env.get("idempotencyKey"),
            dry_run=spec.writes and env.get("dryRun", False))
        res = self._handlers[spec.name](ctx, args)
        if spec.name == "mnote.page.get":
            res = CommandResult(self.shape_page(res.result, args), res.effect)
        return res

    @staticmethod
    def shape_page(page: dict, args: dict) -> dict:
        """contract §4 page.get result; includeBody/includeOptions/includeBlocks drop
        bodySummary/pageOptions/blocks.  ``revision`` is added for ``baseRevision``, and each
        block's ``hash`` (:func:`~.blocks.block_hash`) for the block tools' ``expectHash``."""
        out = {k: page[k] for k in ("documentId", "workspaceId", "title", "revision")}
        if args.get("includeBody", True):
            out["bodySummary"] = body_summary(page["blocks"])
        if args.get("includeOptions", True):
            out["pageOptions"] = page["pageOptions"]
        if args.get("includeBlocks", True):
            out["blocks"] = with_hashes(page["blocks"])
        return out


class ToolExecutor:
    """Executes contract §4 tools against a :class:`PageStore` (``store``) or another
    :class:`Backend` (``backend``: mnote's kernel).

    Checks, in order: envelope schema (§2) → known tool → field sizes → ``args``
    schema (unknown fields rejected) → merged tool input schema (§4 ``required``) →
    actor present → ``capabilityScope`` contains the tool scope → the backend: the store's
    member / page read / page write / artifact write checks, idempotency and dryRun, or the
    kernel's.
    """

    def __init__(self, store: PageStore | None = None, *, backend: Backend | None = None,
                 max_content_bytes: int = DEFAULT_MAX_CONTENT_BYTES):
        if store is not None and backend is None:
            backend = StoreBackend(store)
        elif (store is None) == (backend is None):
            raise TypeError("ToolExecutor needs a store or a backend")
        assert backend is not None
        self.store = store
        self.backend = backend
        self.max_content_bytes = max_content_bytes

    def invoke(self, envelope: dict, tools: Collection[str] | None = None) -> dict:
        """Run one tool call (contract §2 in, §3 out). Never raises. ``tools``: the tool
        names this caller may call (None: every tool of :data:`ALL_TOOLS`; any other is
        ``mnote_tool_unknown_tool``).

        Success: ``ok: true``, ``result`` per tool, ``audit.effect`` read | write | dry_run and
        ``audit.commandId`` (writes only).  A replayed idempotent call returns the stored
        result and audit (commandId) of the first call, with this call's toolCallId/traceId.
        Envelope fields and top-level ``args`` fields with value ``null`` count as absent;
        unknown envelope fields are rejected.  Failure: ``ok: false``, ``result: null``,
        ``audit.effect: "none"``, ``error: {code, message}``; messages never carry page
        title, body or artifact text.
        """
        echo = self._echo(envelope)
        try:
            spec, env, args = self._validate(envelope, ALL_TOOLS if tools is None else
                                             {n: ALL_TOOLS[n] for n in tools})
            echo["toolName"] = spec.name
            if not env.get("actorId"):
                raise PermissionDenied(MSG_NO_ACTOR)
            if spec.scope not in env.get("capabilityScope", ()):
                raise PermissionDenied(f"capabilityScope 未授予 {spec.scope}")
            res = self.backend.run(spec, env, args)
        except ToolError as exc:
            return self._envelope(echo, None, error={"code": exc.code, "message": exc.message})
        except Exception:  # the contract wants an envelope, never a 500
            log.exception("mnote tool %s failed", echo["toolName"])
            return self._envelope(echo, None, error={
                "code": CODE_INTERNAL, "message": "工具执行失败（内部错误），请稍后重试"})
        return self._envelope(echo, res)

    def _validate(self, envelope: Any,
                  known: dict[str, ToolSpec]) -> tuple[ToolSpec, dict, dict]:
        if not isinstance(envelope, dict):
            raise BadToolInput("/: envelope must be a JSON object")
        env = {k: v for k, v in envelope.items() if v is not None}  # null ≡ absent
        name = env.get("toolName")
        if isinstance(name, str) and name in known:
            env = _unflatten(known[name], env)
        elif isinstance(name, str) and 0 < len(name) <= 128:
            # an unknown tool is unknown in either form (§4's flat fields would otherwise be
            # reported as fields the envelope does not allow)
            raise _UnknownTool(f"未知工具 {name!r}")
        _first_error(_ENVELOPE_VALIDATOR, env, lambda p: p)
        spec = known.get(env["toolName"])
        if spec is None:
            raise _UnknownTool(f"未知工具 {env['toolName']!r}")
        args = env.get("args", {})
        for key, value in args.items():
            text = value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)
            size = len(text.encode())
            if size > self.max_content_bytes:
                raise BadToolInput(f"{json_pointer(['args', key])}: {size} bytes exceeds the "
                                   f"limit of {self.max_content_bytes} bytes")
        _first_error(_ARGS_VALIDATORS[spec.name], args, lambda p: ["args", *p])
        merged = {**{k: env[k] for k in INPUT_ENVELOPE_FIELDS if k in env}, **args}
        _first_error(_INPUT_VALIDATORS[spec.name], merged,
                     lambda p: ["args", *p] if p and p[0] in args else p)
        return spec, env, args

    def denied(self, envelope: dict, message: str) -> dict:
        """A ``mnote_tool_permission_denied`` envelope for a call refused before the store."""
        return self._envelope(self._echo(envelope), None,
                              error={"code": PermissionDenied.code, "message": message})

    @staticmethod
    def _echo(envelope) -> dict:
        return echo_fields(envelope)

    @staticmethod
    def _envelope(echo: dict, res: CommandResult | None, error: dict | None = None) -> dict:
        return {
            "ok": res is not None,
            "toolName": echo["toolName"],
            "toolCallId": echo["toolCallId"],
            "traceId": echo["traceId"],
            "result": res.result if res else None,
            "audit": {"effect": res.effect if res else "none",
                      "commandId": res.command_id if res else None,
                      "workspaceId": echo["workspaceId"], "documentId": echo["documentId"]},
            "error": error,
        }


#: Envelope fields the model may set itself (everything else comes from the run).
_MODEL_ENVELOPE_FIELDS = {
    "workspaceId": {"type": "string", "description": "Defaults to the page of this run."},
    "documentId": {"type": "string", "description": "Defaults to the page of this run."},
}
_MODEL_WRITE_FIELDS = {
    "dryRun": {"type": "boolean", "default": False,
               "description": "Only plan: return the diff, change nothing."},
    "idempotencyKey": {"type": "string", "maxLength": 256,
                       "description": "Retrying with the same key never writes twice."},
}


def plugin_tool_definitions() -> list[dict]:
    """The tools as the ``mnote`` Hermes plugin registers them (users_template/plugins/mnote/
    tools.json): ``{name: <wire name>, contractName, toolset, description, parameters}`` where
    ``parameters`` = the tool's args plus the envelope fields the model may set (contract §1:
    the model never supplies actorId, sessionId, runId, toolCallId, traceId or capabilityScope).
    """
    out = []
    for spec in TOOLS:
        params = json.loads(json.dumps(spec.model_parameters))
        params.pop("$schema", None)
        params["properties"] = {**params["properties"], **_MODEL_ENVELOPE_FIELDS,
                                **(_MODEL_WRITE_FIELDS if spec.writes else {})}
        out.append({"name": spec.wire_name, "contractName": spec.name, "toolset": "mnote",
                    "description": spec.description, "parameters": params})
    return out


# .venv/bin/python -m hermes_service.mnote.tools > users_template/plugins/mnote/tools.json
if __name__ == "__main__":
    print(json.dumps(plugin_tool_definitions(), indent=1, ensure_ascii=False))
