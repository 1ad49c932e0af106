"""JSON schemas of the mnote Hermes tool contract v1 (Draft 2020-12).

Source of truth: ``mnote-hermes-plugin-tool-contract-v1.md``.

* :data:`ENVELOPE_SCHEMA` – the unified input (contract §2), types only.
* :data:`TOOL_INPUT_SCHEMAS` – the per-tool input (contract §4): envelope
  fields merged with ``args``; ``required`` lists are the contract's.
* :data:`MODEL_PARAMETERS` – what the model may put in ``args`` (the tool
  fields of §4 plus ``baseRevision``); ``additionalProperties: false``.
* :data:`OUTPUT_ENVELOPE_SCHEMA` – the unified output (contract §3).
* :data:`PAGE_IMPORT_SCHEMA` – the operator import/export page document.

Tightenings beyond the contract (documented, never loosenings): ids are
non-empty strings of at most 256 chars (workspace, document and block ids follow the
service's one id rule, :func:`hermes_service.errors.is_id`), blocks are objects with string
``type``/``text`` (optional ``id`` matching :data:`ID_PATTERN`), ``title``
must contain a non-space character (max 500 chars), ``options`` needs at
least one key, ``summary``/ai-note ``content`` must be non-empty.
"""
from __future__ import annotations

from ..errors import ID_PATTERN  # one id pattern for the whole service

PAGE_OPTION_KEYS = ("wideLayout", "smallText", "showToc", "protectEditing")

_DRAFT = "https://json-schema.org/draft/2020-12/schema"
_REF = {"type": "string", "minLength": 1, "maxLength": 256}
#: page-store ids (workspace, document, block): the service's one id rule (errors.is_id)
_ID = {"type": "string", "pattern": ID_PATTERN}
_BOOL = {"type": "boolean"}

BLOCK_SCHEMA = {
    "type": "object",
    "required": ["type", "text"],
    "properties": {
        "id": _ID,
        "type": {"type": "string", "minLength": 1, "maxLength": 64},
        "text": {"type": "string"},
    },
}

PAGE_OPTIONS_SCHEMA = {
    "type": "object",
    "properties": {k: _BOOL for k in PAGE_OPTION_KEYS},
    "additionalProperties": False,
}

_BASE_REVISION = {"type": "integer", "minimum": 0,
                  "description": "Page revision you last read; stale -> mnote_tool_conflict."}

#: contract §2 unified input; per-tool ``required`` is enforced by TOOL_INPUT_SCHEMAS.
ENVELOPE_SCHEMA: dict = {
    "$schema": _DRAFT,
    "type": "object",
    "required": ["toolName"],
    "additionalProperties": False,
    "properties": {
        "toolName": {"type": "string", "minLength": 1, "maxLength": 128},
        "workspaceId": _ID, "documentId": _ID,
        # empty/absent → permission_denied (未登录)
        "actorId": {"type": "string", "maxLength": 256},
        "sessionId": _REF, "runId": _REF, "toolCallId": _REF, "traceId": _REF,
        "idempotencyKey": _REF,
        "dryRun": _BOOL,
        "capabilityScope": {"type": "array", "items": {"type": "string"}, "maxItems": 32},
        "args": {"type": "object"},
    },
}

#: Envelope fields that are merged with ``args`` to form the tool input.
INPUT_ENVELOPE_FIELDS = ("workspaceId", "documentId", "sessionId", "runId",
                         "toolCallId", "traceId", "idempotencyKey", "dryRun")


def _params(properties: dict, required: list[str] | tuple[()] = ()) -> dict:
    return {"type": "object", "properties": properties, "required": list(required),
            "additionalProperties": False}


#: contract §4, tool fields only (the ``args`` object / the model's function parameters).
MODEL_PARAMETERS = {
    "mnote.page.get": _params({
        "includeBody": {"type": "boolean", "default": True},
        "includeOptions": {"type": "boolean", "default": True},
        "includeBlocks": {"type": "boolean", "default": True},
    }),
    "mnote.page.save": _params({
        "content": {"type": "array", "items": BLOCK_SCHEMA,
                    "description": "Blocks {type, text, id?}; a block without id gets a "
                                   "generated one."},
        "mode": {"type": "string", "enum": ["replace", "append"], "default": "append"},
        "baseRevision": _BASE_REVISION,
    }, ["content"]),
    "mnote.page.update_title": _params({
        "title": {"type": "string", "minLength": 1, "maxLength": 500, "pattern": r"\S"},
        "baseRevision": _BASE_REVISION,
    }, ["title"]),
    "mnote.page.update_options": _params({
        "options": {**PAGE_OPTIONS_SCHEMA, "minProperties": 1},
        "baseRevision": _BASE_REVISION,
    }, ["options"]),
    "mnote.artifact.create_summary": _params({
        "summary": {"type": "string", "minLength": 1},
    }, ["summary"]),
    "mnote.artifact.create_ai_note": _params({
        "content": {"type": "string", "minLength": 1},
    }, ["content"]),
}

_READ_REQUIRED = ["workspaceId", "documentId", "sessionId", "runId", "toolCallId", "traceId"]
_WRITE_REQUIRED = [*_READ_REQUIRED, "idempotencyKey", "dryRun"]
_ENVELOPE_PROPS = {k: ENVELOPE_SCHEMA["properties"][k] for k in INPUT_ENVELOPE_FIELDS}


def _input(tool: str, required: list[str]) -> dict:
    params = MODEL_PARAMETERS[tool]
    return {"$schema": _DRAFT, "type": "object",
            "required": required + params["required"],
            "properties": {**_ENVELOPE_PROPS, **params["properties"]}}


#: contract §4 input schemas (envelope fields merged with args).
TOOL_INPUT_SCHEMAS = {
    "mnote.page.get": _input("mnote.page.get", _READ_REQUIRED),
    **{t: _input(t, _WRITE_REQUIRED) for t in MODEL_PARAMETERS if t != "mnote.page.get"},
}

_NULLABLE_STR = {"type": ["string", "null"]}

#: contract §3 unified output; every executor response validates against it.
OUTPUT_ENVELOPE_SCHEMA: dict = {
    "$schema": _DRAFT,
    "type": "object",
    "required": ["ok", "toolName", "toolCallId", "traceId", "result", "audit", "error"],
    "additionalProperties": False,
    "properties": {
        "ok": _BOOL,
        "toolName": _NULLABLE_STR, "toolCallId": _NULLABLE_STR, "traceId": _NULLABLE_STR,
        "result": {"type": ["object", "null"]},
        "audit": {
            "type": "object",
            "required": ["effect", "commandId", "workspaceId", "documentId"],
            "additionalProperties": False,
            "properties": {
                "effect": {"enum": ["read", "write", "dry_run", "none"]},
                "commandId": _NULLABLE_STR, "workspaceId": _NULLABLE_STR,
                "documentId": _NULLABLE_STR,
            },
        },
        "error": {
            "oneOf": [
                {"type": "null"},
                {"type": "object", "required": ["code", "message"], "additionalProperties": False,
                 "properties": {"code": {"type": "string"}, "message": {"type": "string"}}},
            ],
        },
    },
    "if": {"properties": {"ok": {"const": True}}},
    "then": {"properties": {"error": {"type": "null"}, "result": {"type": "object"}}},
    "else": {"properties": {"error": {"type": "object"}, "result": {"type": "null"},
                            "audit": {"properties": {"effect": {"const": "none"},
                                                     "commandId": {"type": "null"}}}}},
}

#: Operator page document (``import_page`` input / ``export_page`` output).
PAGE_IMPORT_SCHEMA = {
    "$schema": _DRAFT,
    "type": "object",
    "required": ["documentId", "workspaceId", "title"],
    "additionalProperties": False,
    "properties": {
        "documentId": _ID,
        "workspaceId": _ID,
        "title": {"type": "string", "maxLength": 500},
        "blocks": {"type": "array", "items": BLOCK_SCHEMA},
        "pageOptions": PAGE_OPTIONS_SCHEMA,
        # export-only fields, ignored on import:
        "revision": {"type": "integer"},
        "updatedAt": {"type": "string"},
        "artifacts": {"type": "array"},
    },
}
