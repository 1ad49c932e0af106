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
#: block tools (docs/mnote-tools.md §Block tools): the most ops in one batch or suggestion
MAX_OPS = 100
#: the longest text of a block an op writes (characters)
MAX_BLOCK_TEXT = 65536
#: the longest ``reason`` of a suggestion (characters)
MAX_REASON = 500
#: hex digits of a block hash (:func:`hermes_service.mnote.blocks.block_hash`)
HASH_DIGITS = 16

_DRAFT = "https://json-schema.org/draft/2020-12/schema"
_REF = {"type": "string", "minLength": 1, "maxLength": 256}
#: page-store ids (workspace, document, block): the service's one id rule (errors.is_id)
_ID = {"type": "string", "pattern": ID_PATTERN}
_BOOL = {"type": "boolean"}

#: a block's type
_TYPE = {"type": "string", "minLength": 1, "maxLength": 64}

BLOCK_SCHEMA = {
    "type": "object",
    "required": ["type", "text"],
    "properties": {
        "id": _ID,
        "type": _TYPE,
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

#: block ops (docs/mnote-tools.md §Block tools): bounds as :mod:`.blocks` declares them
_HASH = {"type": "string", "pattern": "^[0-9a-f]{%d}$" % HASH_DIGITS,
         "description": "the block's hash from mnote.page.get"}
_AFTER = {"type": ["string", "null"], "pattern": ID_PATTERN,
          "description": "the block to put it after; null: at the top"}
_TEXT = {"type": "string", "maxLength": MAX_BLOCK_TEXT}


def _op(name: str, required: list[str], **props) -> dict:
    return {"if": {"properties": {"op": {"const": name}}, "required": ["op"]},
            "then": {"required": ["op", *required], "additionalProperties": False,
                     "properties": {"op": {"const": name}, **props}}}


BLOCK_OP_SCHEMA: dict = {
    "type": "object", "required": ["op"],
    "properties": {"op": {"enum": ["insert", "update", "delete", "move"]}},
    "description": "insert {after, block: {type, text}} | update {blockId, expectHash, "
                   "block: {type?, text}} | delete {blockId, expectHash} | move {blockId, after}",
    "allOf": [
        _op("insert", ["after", "block"], after=_AFTER, block={
            "type": "object", "required": ["type", "text"], "additionalProperties": False,
            "properties": {"type": _TYPE, "text": _TEXT}}),
        _op("update", ["blockId", "expectHash", "block"], blockId=_ID, expectHash=_HASH,
            block={"type": "object", "required": ["text"], "additionalProperties": False,
                   "properties": {"type": _TYPE, "text": _TEXT}}),
        _op("delete", ["blockId", "expectHash"], blockId=_ID, expectHash=_HASH),
        _op("move", ["blockId", "after"], blockId=_ID, after=_AFTER, expectHash=_HASH),
    ],
}
_OPS = {"type": "array", "minItems": 1, "maxItems": MAX_OPS, "items": BLOCK_OP_SCHEMA}
#: what the model sees of an op: one plain object (some providers take no ``if``/``then`` or
#: combinators in a function's parameters; Hermes strips them for others); the input schema
#: checks each op kind's own fields (:data:`BLOCK_OP_SCHEMA`)
_MODEL_OPS = {"type": "array", "minItems": 1, "maxItems": MAX_OPS, "items": {
    "type": "object", "required": ["op"], "additionalProperties": False,
    "description": BLOCK_OP_SCHEMA["description"],
    "properties": {"op": BLOCK_OP_SCHEMA["properties"]["op"], "blockId": _ID, "after": _AFTER,
                   "expectHash": _HASH,
                   "block": {"type": "object", "required": ["text"],
                             "additionalProperties": False,
                             "properties": {"type": _TYPE, "text": _TEXT}}}}}
_REVISION = {"type": "integer", "minimum": 0}
_REQUIRED_REVISION = {**_REVISION, "description": "Refuse (mnote_tool_conflict) if the page "
                                                  "changed at all since this revision."}
_BASE_REVISION_MERGE = {**_REVISION, "description": "Apply on top of later changes unless a "
                                                    "block the ops touch changed (then "
                                                    "mnote_tool_conflict naming it)."}
#: exactly one of requiredRevision | baseRevision (in the input schema, not the model's
#: parameters: some providers refuse a combinator at the top of a function's parameters)
_ONE_REVISION = {"oneOf": [{"required": ["requiredRevision"]}, {"required": ["baseRevision"]}]}
_SUGGESTION_ID = {**_ID, "description": "the suggestion's id"}

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
    "mnote.block.batch": _params({
        "ops": _MODEL_OPS, "requiredRevision": _REQUIRED_REVISION,
        "baseRevision": _BASE_REVISION_MERGE,
    }, ["ops"]),
    "mnote.block.propose": _params({
        "ops": _MODEL_OPS, "requiredRevision": _REQUIRED_REVISION,
        "baseRevision": _BASE_REVISION_MERGE,
        "reason": {"type": "string", "minLength": 1, "maxLength": MAX_REASON, "pattern": r"\S",
                   "description": "Why, in a sentence, for the person who reviews it."},
    }, ["ops", "reason"]),
    # the panel's review of suggestions (never offered to the model)
    "mnote.suggestion.list": _params({}),
    "mnote.suggestion.accept": _params({"suggestionId": _SUGGESTION_ID}, ["suggestionId"]),
    "mnote.suggestion.reject": _params({"suggestionId": _SUGGESTION_ID}, ["suggestionId"]),
}
#: tools whose input needs exactly one of requiredRevision and baseRevision
_REVISIONED = ("mnote.block.batch", "mnote.block.propose")
#: the reads among the tools (everything else writes)
READ_TOOLS = ("mnote.page.get", "mnote.suggestion.list")

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
    **{t: _input(t, _READ_REQUIRED) for t in READ_TOOLS},
    **{t: _input(t, _WRITE_REQUIRED) for t in MODEL_PARAMETERS if t not in READ_TOOLS},
}
for _tool in _REVISIONED:
    TOOL_INPUT_SCHEMAS[_tool].update(_ONE_REVISION)
    TOOL_INPUT_SCHEMAS[_tool]["properties"] = {**TOOL_INPUT_SCHEMAS[_tool]["properties"],
                                               "ops": _OPS}

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
