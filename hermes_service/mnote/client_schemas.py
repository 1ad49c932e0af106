"""The client routes' contracts (client-proxy contract §2; docs/api-description.md): the
request bodies :func:`~hermes_service.web.helpers.json_body` validates with, the parameters, the
success bodies and the event stream ``GET /openapi.json`` shows. The run events themselves
are :mod:`.events`; the error codes :mod:`.client_codes`."""
from __future__ import annotations

from ..errors import ID_PATTERN, ID_RULE, ID_SCHEMA, NO_NUL
from ..idempotency import HEADER as IDEMPOTENCY_HEADER
from ..idempotency import KEY_SCHEMA
from ..web.helpers import Param
from .objects import settings

ACTOR_HEADER = "X-Mnote-Actor-Id"
MAX_SESSION_ID = 115    # + "." + 12 hex of the actor = a 128-char store key

#: contract §3 error body
CLIENT_ERROR = {"type": "object", "required": ["ok", "code", "message", "traceId", "requestId"],
                "properties": {"ok": {"const": False}, "code": {"type": "string"},
                               "message": {"type": "string"}, "traceId": {"type": "string"},
                               "requestId": {"type": "string"},
                               "runId": {"type": "string", "description":
                                         "409 hermes_client_session_busy only: the run active "
                                         "on the session (follow it on GET /events/{runId}, "
                                         "or abort it)"}}}

_ACTOR = Param(ACTOR_HEADER, "header", ID_SCHEMA, "the mnote user acting (the service's "
               "user_id); may be left out only when the API key is bound to an actor",
               required=True)
#: the response headers its replies name beside the core's (web.register_response_headers)
RESPONSE_HEADERS = {
    "X-Trace-Id": {"description": "the run's traceId", "schema": {"type": "string"}},
}
# the first given of body traceId, ?traceId= and X-Trace-Id is the request's traceId; each
# one given must be an id (trace_id())
# (one plain string schema, the id pattern made optional: header parameters must be plain
# strings for client generators such as openapi-python-client)
_TRACE_ID = {"type": "string", "maxLength": 128, "pattern": f"^(?:{ID_PATTERN[1:-1]})?$",
             "description": f"an id ({ID_RULE}), or empty (none)"}
_TRACE = (Param("X-Trace-Id", "header", _TRACE_ID,
                "the request's traceId unless the body or the query names one"),
          Param("traceId", "query", _TRACE_ID,
                "the request's traceId unless the body names one"))
PARAMS = (_ACTOR, *_TRACE)
#: docs/v1-api.md §Idempotent retries
IDEMPOTENCY_KEY = Param(IDEMPOTENCY_HEADER, "header", KEY_SCHEMA,
                         "retry safely: the same key with the same request (body, query, "
                         "X-Trace-Id) from the same actor returns the first outcome "
                         "(`Idempotency-Replayed: true`); with another request 409 "
                         "(docs/v1-api.md §Idempotent retries)")
IDEMPOTENT = {400: ("invalid_idempotency_key",),
               409: ("idempotency_key_conflict", "idempotency_key_in_progress"),
               503: ("idempotency_unavailable",)}

#: /models and /tools answer the same for every actor: the header is optional there (checked
#: when given)
_ANY_ACTOR = Param(ACTOR_HEADER, "header", ID_SCHEMA, "optional: the answer is the same for "
                   "every actor; when given it must be an id (and the key's actor when bound)",
                   required=False)
OPEN_PARAMS = (_ANY_ACTOR, *_TRACE)
#: a request body's traceId: an id, or null (= not given)
TRACE_BODY = {**ID_SCHEMA, "type": ["string", "null"]}
#: what every client route may answer: a bad trace id; a missing, invalid or foreign actor
COMMON = {400: ("invalid_id",), 401: ("missing_actor", "actor_mismatch")}
_OK = {"ok": {"const": True}, "traceId": {"type": "string"}}


def ok_body(required: list[str], properties: dict) -> dict:
    """A contract §2 success body: ``{"ok": true, "traceId", …}``."""
    return {"type": "object", "required": ["ok", "traceId", *required],
            "properties": {**_OK, **properties}}


_NULLABLE = {"type": ["string", "null"]}
SESSIONS_PAGE = ok_body(["sessions"], {"sessions": {"type": "array", "items": {
    "type": "object",
    "required": ["sessionId", "title", "preview", "messageCount", "toolCallCount", "updatedAt",
                 "model"],
    "properties": {"sessionId": {"type": "string"}, "title": _NULLABLE, "preview": _NULLABLE,
                   "messageCount": {"type": "integer", "minimum": 0},
                   "toolCallCount": {"type": "integer", "minimum": 0},
                   "updatedAt": {"type": "integer", "description": "unix seconds"},
                   "model": {"type": "string"}}}}})
SESSION_CREATED = ok_body(["sessionId", "persistence"], {
    "sessionId": {"type": "string"}, "persistence": {"const": "hermes_on_first_run"}})
_TOKENS = {"type": "integer", "minimum": 0}
TRANSCRIPT = ok_body(["sessionId", "messages", "usage"], {
    "sessionId": {"type": "string"},
    "messages": {"type": "array", "items": {
        "type": "object",
        "required": ["messageId", "role", "content", "toolCallId", "toolName", "timestamp",
                     "reasoning"],
        "properties": {"messageId": {"type": "string"}, "role": {"type": "string"},
                       "content": _NULLABLE, "toolCallId": _NULLABLE,
                       "toolName": {**_NULLABLE, "description": "the tool's name as the run's "
                                    "tool.* events give it (`terminal`, `mnote.page.get`)"},
                       "timestamp": {"type": "integer", "description": "unix seconds"},
                       "reasoning": _NULLABLE}}},
    "usage": {"type": "object", "required": ["inputTokens", "outputTokens", "totalTokens"],
              "properties": {"inputTokens": _TOKENS, "outputTokens": _TOKENS,
                             "totalTokens": _TOKENS}}})
_EVENT_LIST = {"type": "array", "items": {"$ref": "#/components/schemas/RunEvent"}}
RUN_STARTED = ok_body(["sessionId", "runId", "messageId", "events"], {
    "sessionId": {"type": "string"}, "runId": {"type": "string"}, "messageId": {"type": "null"},
    "events": {**_EVENT_LIST, "maxItems": 0, "description": "always empty: the events are on "
                                                            "GET /events/{runId}"}})
ABORTED = ok_body(["runId", "sessionId", "events"], {
    "runId": {"type": "string"}, "sessionId": {"type": "string"},
    "events": {**_EVENT_LIST, "description": "abort.started, or the final event of a run that "
                                             "had already ended"}})
MODELS = ok_body(["defaultModel", "models"], {
    "defaultModel": {"type": "string"},
    "models": {"type": "array", "items": {
        "type": "object", "required": ["id", "label", "provider"],
        "properties": {"id": {"type": "string"}, "label": {"type": "string"},
                       "provider": {"type": "string"}}}}})
TOOL_LIST = ok_body(["tools"], {"tools": {"type": "array", "items": {
    "type": "object", "required": ["name", "scope", "schemaVersion"],
    "properties": {"name": {"type": "string"}, "scope": {"type": "string"},
                   "schemaVersion": {"type": "string"}}}}})
#: GET /events. OpenAPI 3.1 has no model of a stream, and its two readings of a stream's
#: schema are both given (``anyOf``): each event (as OpenAPI 3.2's ``itemSchema``, and as
#: schemathesis reads a 3.1 stream schema) — ``RunEventFrame``, its ``id:`` and its ``data:``, a
#: JSON ``RunEvent`` (``contentSchema``) — or the whole body as text (what a generated client
#: that reads the response at once gets, e.g. openapi-python-client's ``str``)
EVENT_STREAM = {"text/event-stream": {
    "schema": {"anyOf": [{"$ref": "#/components/schemas/RunEventFrame"},
                         {"type": "string", "description": "the whole stream as text (frames "
                                                           "separated by a blank line)"}],
               "description": (
        "Server-Sent Events, one RunEventFrame each, its data a JSON RunEvent "
        "(hermes_service/mnote/events.py). The stream opens with the comment `: stream open`, "
        "sends `: keepalive` every mnote.keepalive_seconds, and ends after run.completed, "
        "run.failed or run.cancelled")}}}

CREATE_SESSION = {"type": "object", "required": ["workspaceId", "documentId"],
                  "additionalProperties": False,
                  "properties": {"workspaceId": ID_SCHEMA, "documentId": ID_SCHEMA,
                                 "traceId": TRACE_BODY,
                                 "title": {"type": ["string", "null"], "maxLength": 200}},
                  "description": f"the session id is mnote_<documentId>_<traceId>: at most "
                                 f"{MAX_SESSION_ID} characters together (else 400)",
                  "examples": [{"workspaceId": "ws_1", "documentId": "doc_1",
                                "traceId": "trace_1", "title": "当前页问答"}]}


RUN = {
    "type": "object", "required": ["workspaceId", "documentId", "sessionId", "message"],
    "additionalProperties": False,
    "examples": [{"workspaceId": "ws_1", "documentId": "doc_1", "sessionId": "mnote_doc_1_trace_1",
                  "message": "概括当前页面标题和第一段", "model": "hermes-agent",
                  "pageContext": {"title": "项目计划", "outline": [],
                                  "pageOptions": {"wideLayout": True}},
                  "selectedBlockId": None, "selectedText": None, "traceId": "trace_1"}],
    "properties": {
        "workspaceId": ID_SCHEMA, "documentId": ID_SCHEMA,
        "sessionId": {**ID_SCHEMA, "maxLength": MAX_SESSION_ID},
        "message": {"type": "string", "minLength": 1, "pattern": NO_NUL,
                    "description": "at most hermes.max_message_bytes (UTF-8; else 413), no NUL"},
        "model": {"type": ["string", "null"], "description": "an id of mnote.models "
                  "(GET /models); null: mnote.default_model"},
        "traceId": TRACE_BODY,
        "pageContext": {"type": ["object", "null"], "properties": {
            "title": {"type": ["string", "null"]},
            "outline": {"type": ["array", "null"], "items": {}},
            "pageOptions": {"type": ["object", "null"]}}},
        "selectedBlockId": {"type": ["string", "null"]},
        "selectedText": {"type": ["string", "null"]},
    },
}


def configured_models(schema: dict, config) -> dict:
    """RUN as the document shows it for ``config``: ``model`` is one of ``mnote.models``."""
    ids = settings(config).model_ids
    # an enum with null and no type list: client generators make it one nullable enum type
    model = {k: v for k, v in schema["properties"]["model"].items() if k != "type"}
    model["enum"] = [*ids, None]
    return {**schema, "properties": {**schema["properties"], "model": model}}


ABORT = {"type": "object", "additionalProperties": False,
         "properties": {"workspaceId": {"type": "string",
                                        "description": "404 unless the run is on this workspace"},
                        "documentId": {"type": "string",
                                       "description": "404 unless the run is on this page"},
                        "sessionId": {"type": "string",
                                      "description": "404 unless the run is on this session"},
                        "traceId": TRACE_BODY},
         "examples": [{"workspaceId": "ws_1", "documentId": "doc_1",
                       "sessionId": "mnote_doc_1_trace_1", "traceId": "trace_1"}]}


CHOICES = ("once", "session", "always", "deny")
APPROVAL = {"type": "object", "required": ["sessionId", "approvalId", "choice"],
            "additionalProperties": False,
            "properties": {"sessionId": {"type": "string",
                                         "description": "404 unless the run is on this session"},
                           "approvalId": {**ID_SCHEMA, "description":
                                          "approval.request's approval_id"},
                           "choice": {"enum": list(CHOICES), "description":
                                      "one of approval.request's choices (else 400)"},
                           "workspaceId": {"type": "string",
                                           "description":
                                               "404 unless the run is on this workspace"},
                           "documentId": {"type": "string",
                                          "description": "404 unless the run is on this page"},
                           "traceId": TRACE_BODY},
            "examples": [{"sessionId": "mnote_doc_1_trace_1", "approvalId": "apr_0123456789ab",
                          "choice": "once", "traceId": "trace_1"}]}
APPROVED = ok_body(["runId", "approvalId", "choice"], {
    "runId": {"type": "string"}, "approvalId": {"type": "string"},
    "choice": {"enum": list(CHOICES)}})


CLARIFY = {"type": "object", "required": ["sessionId", "clarifyId", "answer"],
           "additionalProperties": False,
           "properties": {"sessionId": {"type": "string",
                                        "description": "404 unless the run is on this session"},
                          "clarifyId": {**ID_SCHEMA, "description":
                                        "clarify.request's clarify_id"},
                          "answer": {"type": "string", "minLength": 1, "maxLength": 4000,
                                     "pattern": NO_NUL, "description":
                                     "one of clarify.request's choices, or any text"},
                          "workspaceId": {"type": "string",
                                          "description": "404 unless the run is on this workspace"},
                          "documentId": {"type": "string",
                                         "description": "404 unless the run is on this page"},
                          "traceId": TRACE_BODY},
           "examples": [{"sessionId": "mnote_doc_1_trace_1", "clarifyId": "clq_0123456789ab",
                         "answer": "staging", "traceId": "trace_1"}]}
CLARIFIED = ok_body(["runId", "clarifyId"], {"runId": {"type": "string"},
                                         "clarifyId": {"type": "string"}})


# -- suggestions (docs/mnote-client.md §Suggestions) ------------------------------------
_OP = {"type": "object", "required": ["op"], "description": "a block op of mnote.block.batch "
       "(docs/mnote-tools.md §Block tools)"}
SUGGESTION = {"type": "object",
              "required": ["suggestionId", "workspaceId", "documentId", "ops", "reason",
                           "baseRevision", "actorId", "status", "createdAt"],
              "properties": {"suggestionId": {"type": "string"},
                             "workspaceId": {"type": "string"},
                             "documentId": {"type": "string"},
                             "ops": {"type": "array", "items": _OP},
                             "reason": {"type": "string"},
                             "baseRevision": {"type": "integer"},
                             "actorId": _NULLABLE, "sessionId": _NULLABLE, "runId": _NULLABLE,
                             "status": {"const": "open"},
                             "createdAt": {"type": "string"}}}
SUGGESTION_LIST = ok_body(["suggestions"], {"suggestions": {"type": "array",
                                                            "items": SUGGESTION}})
SUGGESTION_ANSWER = {"type": "object", "required": ["workspaceId", "documentId"],
                     "additionalProperties": False,
                     "properties": {"workspaceId": ID_SCHEMA, "documentId": ID_SCHEMA,
                                    "traceId": TRACE_BODY},
                     "examples": [{"workspaceId": "ws_1", "documentId": "doc_1"}]}
SUGGESTION_DECIDED = ok_body(["suggestionId", "status", "revision"], {
    "suggestionId": {"type": "string"}, "status": {"enum": ["accepted", "rejected"]},
    "revision": {"type": "integer", "description": "the page's revision now"},
    "blocks": {"type": "array", "description": "accepted: each block inserted, updated or "
               "moved, with its new hash", "items": {
                   "type": "object", "required": ["id", "hash"],
                   "properties": {"id": {"type": "string"}, "hash": {"type": "string"}}}},
    "ops": {"type": "array", "description": "accepted: what each op did",
            "items": {"type": "object"}}})
