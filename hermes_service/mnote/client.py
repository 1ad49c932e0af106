"""mnote client-proxy routes ``/api/hermes/client/*`` (contract: hermes-client-proxy-contract-v1).

Caller: mnote-web's server, with its API key (core auth). The end user is
named by ``X-Mnote-Actor-Id``; it is the service's ``user_id`` and so picks
the Hermes home. A key bound to an actor (``api_keys[].actor_id``) accepts
that header only if it matches (or is absent).

Every response carries ``traceId`` (body ``traceId``, query ``traceId``,
header ``X-Trace-Id``, or generated). Errors are exactly
``{"ok": false, "code", "message", "traceId", "requestId"}``; codes are the
contract's six (§3) plus the documented additions in :data:`EXTRA_CODES`.

Each route declares its contract (:func:`~hermes_service.web.documented`): the request schemas
here are what :func:`~hermes_service.web.json_body` validates with and what ``GET
/openapi.json`` shows; the event payloads are in :mod:`.events` (docs/api-description.md).
"""
from __future__ import annotations

import hashlib
import json
import re
from datetime import datetime

from flask import Blueprint, Response, g, jsonify, request, stream_with_context

from .. import logs, tokens
from ..errors import (
    ID_PATTERN,
    ID_RULE,
    ID_SCHEMA,
    NO_NUL,
    BadRequest,
    NotFound,
    ServiceError,
    Unauthorized,
    check_id,
)
from ..hermes_state import session_summary, token_counts, transcript
from ..idempotency import HEADER as IDEMPOTENCY_HEADER
from ..idempotency import KEY_SCHEMA
from ..routing import ErrorFamily, RouteFamily, declare
from ..security import acting_user
from ..web import Param, Reply, documented, has_body, idempotent, json_body, parse_json, services
from . import event_bounds
from .objects import mnote_of, settings
from .tools import SCHEMA_VERSION, TOOLS, TOOLS_BY_WIRE_NAME

PREFIX = "/api/hermes/client"
LEGACY_PREFIX = "/api/ai-agent"

ACTOR_HEADER = "X-Mnote-Actor-Id"
MNOTE_TOOLSET = "mnote"
PREVIEW_CHARS = 200
EVENT_ID = re.compile(r"[0-9]{1,18}")     # Server-Sent Events ids: the run's sequence numbers

# core code -> contract code (§3 stable codes first, then our documented additions)
CODE_MAP = {
    "missing_api_key": "hermes_client_unauthorized",
    "invalid_api_key": "hermes_client_unauthorized",
    "api_key_expired": "hermes_client_unauthorized",
    "actor_mismatch": "hermes_client_unauthorized",
    "missing_actor": "hermes_client_unauthorized",
    "hermes_unavailable": "hermes_client_unconfigured",
    "hermes_unconfigured": "hermes_client_unconfigured",
    "invalid_json": "hermes_client_bad_request",
    "invalid_request": "hermes_client_bad_request",
    "invalid_id": "hermes_client_bad_request",
    "message_too_large": "hermes_client_bad_request",
    "payload_too_large": "hermes_client_bad_request",
    "bad_request_framing": "hermes_client_bad_request",     # ambiguous body framing (framing.py)
    "invalid_idempotency_key": "hermes_client_bad_request",  # docs/v1-api.md §Idempotent retries
    "upstream_unauthorized": "hermes_client_upstream_unauthorized",
    "upstream_rate_limited": "hermes_client_upstream_rate_limited",
    "upstream_unavailable": "hermes_client_upstream_unavailable",
}
EXTRA_CODES = {   # cases the contract does not cover
    "ip_not_allowed": "hermes_client_forbidden",              # 403
    "insufficient_scope": "hermes_client_forbidden",          # 403 key without the client scope
    "session_not_found": "hermes_client_not_found",           # 404 (also another actor's)
    "run_not_found": "hermes_client_not_found",               # 404
    "not_found": "hermes_client_not_found",                   # 404 unknown route
    "method_not_allowed": "hermes_client_bad_request",        # 405
    "session_busy": "hermes_client_session_busy",             # 409 a run is active
    "approval_not_pending": "hermes_client_approval_not_pending",  # 409 no such question pending
    "clarify_not_pending": "hermes_client_clarify_not_pending",    # 409 no such question pending
    "session_exists": "hermes_client_session_busy",           # 409
    "too_many_runs": "hermes_client_busy",                    # 429 all run slots taken
    "too_many_streams": "hermes_client_busy",                 # 429 mnote.max_event_streams open
    "run_timeout": "hermes_client_run_timeout",               # run.failed: hard limit
    "run_stalled": "hermes_client_run_stalled",               # run.failed: stall watchdog
    "hermes_failed": "hermes_client_upstream_unavailable",    # CLI failed otherwise
    "upstream_empty_answer": "hermes_client_upstream_empty_answer",  # run.failed: no answer
    "service_stopping": "hermes_client_service_stopping",     # run.failed: service shut down
    "run_interrupted": "hermes_client_run_interrupted",       # run.failed: its process died
    "service_draining": "hermes_client_service_draining",     # 503 stopping: no new runs
    "run_limit_exceeded": "hermes_client_run_limit_exceeded",  # run.failed: a sandbox limit
    "home_quota_exceeded": "hermes_client_home_quota_exceeded",  # run.failed: home over its cap
    "storage_full": "hermes_client_storage_full",             # 507 / run.failed: disk full
    "token_budget_exceeded": "hermes_client_token_budget_exceeded",  # 429 / run.failed
    "home_tampered": "hermes_client_home_tampered",           # 409 / run.failed: planted entry
    "home_busy": "hermes_client_busy",                        # 503 the user's state.db locked
    "legacy_endpoint_gone": "hermes_client_legacy_endpoint_gone",  # 410 /api/ai-agent/run
    # 409 Idempotency-Key reused for another request / its first request still in progress
    "idempotency_key_conflict": "hermes_client_idempotency_conflict",
    "idempotency_key_in_progress": "hermes_client_idempotency_in_progress",
    # 503 the Idempotency-Key record store is locked or damaged: nothing ran, retry later
    "idempotency_unavailable": "hermes_client_idempotency_unavailable",
}


def client_code(code: str | None) -> str:
    """The contract code for a core error code (``hermes_client_internal_error`` if unmapped)."""
    return CODE_MAP.get(code) or EXTRA_CODES.get(code) or "hermes_client_internal_error"


def public_event(event: dict) -> dict:
    """An event of the run log as the contract shows it: ``run.failed`` carries the contract
    code of the core code the run recorded."""
    if event.get("event") == "run.failed":
        return {**event, "code": client_code(event.get("code"))}
    return event


def _status(err: ServiceError) -> int:
    """The proxy answers a provider 429 with 429, and an actor the key is not bound to as the
    contract's 401 ``hermes_client_unauthorized`` (core: 403 ``actor_mismatch``)."""
    return {"upstream_rate_limited": 429, "actor_mismatch": 401}.get(err.code, err.status)


def trace_id() -> str:
    """traceId of this request: the first of body ``traceId``, query ``traceId`` and header
    ``X-Trace-Id`` that is given, else a generated one. Every one given must be an id (400
    ``invalid_id`` otherwise, even when an earlier one is used); empty counts as not given."""
    ctx = g._get_current_object()
    if "trace_id" not in ctx:
        req = request._get_current_object()  # type: ignore[attr-defined]
        try:
            # the body as json_body() reads it: with or without a JSON Content-Type
            body = parse_json(req.get_data()) if has_body() else None
        except Exception:  # noqa: BLE001 - oversized or malformed: the route reports it
            body = None
        # (no query string: no query argument, and werkzeug's parse of it is skipped)
        given = [v for v in ((body.get("traceId") if isinstance(body, dict) else None),
                             req.args.get("traceId") if req.environ.get("QUERY_STRING") else None,
                             req.headers.get("X-Trace-Id"))
                 if v not in (None, "")]
        ctx.trace_id = "trace_" + tokens.hex16()
        ctx.trace_given = bool(given)
        for value in given:
            check_id(value, "traceId")
        if given:
            ctx.trace_id = given[0]
    return ctx.trace_id


def adopt_trace_id(value: str) -> str:
    """Make ``value`` (a run's traceId) this request's traceId — its access line, its error
    bodies — unless the caller gave one (:func:`trace_id`); returns the request's traceId."""
    trace_id()
    ctx = g._get_current_object()
    if not ctx.trace_given:
        ctx.trace_id = value
    logs.bind(trace_id=ctx.trace_id)
    return ctx.trace_id


def render_error_body(err: ServiceError) -> dict:
    """Contract §3 error body for a core error (the shape of :data:`CLIENT` and :data:`LEGACY`):
    ``{"ok": false, "code", "message", "traceId", "requestId"}`` plus the error's own fields
    (``err.extra``, never replacing these five), e.g. ``runId`` of 409
    ``hermes_client_session_busy``: the session's active run, to follow on ``GET
    /events/{runId}`` or abort."""
    err.status = _status(err)     # the proxy answers a provider 429 with 429
    try:
        tid = trace_id()
    except ServiceError:
        tid = g.get("trace_id") or "trace_" + tokens.hex16()
    body = {"ok": False, "code": client_code(err.code), "message": err.detail, "traceId": tid,
            "requestId": g.get("request_id")}
    for key, value in err.extra.items():
        body.setdefault(key, value)
    return body



def actor_id(required: bool = True) -> str | None:
    """The acting mnote user (``X-Mnote-Actor-Id``, or the key's bound actor). 401
    ``missing_actor`` if invalid, or missing while ``required``; 401 ``actor_mismatch`` for
    another actor than the key's. ``required=False`` (routes whose answer is the same for
    every actor, ``/models`` and ``/tools``): None when no actor is named."""
    header = request.headers.get(ACTOR_HEADER)
    if header is not None:
        try:
            check_id(header, ACTOR_HEADER)
        except BadRequest:
            raise Unauthorized(f"{ACTOR_HEADER} is not a valid actor id",
                               code="missing_actor") from None
    actor = acting_user(g.get("api_key"), header)     # the key's actor when bound (401 below)
    if actor is None and required:
        raise Unauthorized(f"{ACTOR_HEADER} is required", code="missing_actor")
    return actor


def ok(**fields):
    return jsonify({"ok": True, "traceId": trace_id(), **fields})


# -- the routes' contracts (docs/api-description.md) --------------------------------------
#: contract §3 error body
CLIENT_ERROR = {"type": "object", "required": ["ok", "code", "message", "traceId", "requestId"],
                "properties": {"ok": {"const": False}, "code": {"type": "string"},
                               "message": {"type": "string"}, "traceId": {"type": "string"},
                               "requestId": {"type": "string"},
                               "runId": {"type": "string", "description":
                                         "409 hermes_client_session_busy only: the run active "
                                         "on the session (follow it on GET /events/{runId}, "
                                         "or abort it)"}}}
ERRORS = ErrorFamily("ClientError", CLIENT_ERROR, client_code,
                     "client proxy error (contract §3; codes: docs/mnote-client.md, error table)",
                     render=render_error_body)
#: the client routes and the retired legacy one: an allowed address and an API key with the
#: ``client`` scope; errors in the contract's §3 shape
CLIENT = RouteFamily("client", (PREFIX + "/",), ERRORS, scope="client")
LEGACY = RouteFamily("legacy", (LEGACY_PREFIX + "/",), ERRORS, scope="client")
bp = declare(Blueprint("mnote_client", __name__, url_prefix=PREFIX), CLIENT)
legacy_bp = declare(Blueprint("mnote_legacy", __name__), LEGACY)
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
_PARAMS = (_ACTOR, *_TRACE)
#: docs/v1-api.md §Idempotent retries
_IDEMPOTENCY_KEY = Param(IDEMPOTENCY_HEADER, "header", KEY_SCHEMA,
                         "retry safely: the same key with the same request (body, query, "
                         "X-Trace-Id) from the same actor returns the first outcome "
                         "(`Idempotency-Replayed: true`); with another request 409 "
                         "(docs/v1-api.md §Idempotent retries)")
_IDEMPOTENT = {400: ("invalid_idempotency_key",),
               409: ("idempotency_key_conflict", "idempotency_key_in_progress"),
               503: ("idempotency_unavailable",)}


def _idempotent():
    """The client routes' :func:`~hermes_service.web.idempotent`: a key belongs to the
    API key and the actor; the given ``X-Trace-Id`` is part of the request."""
    return idempotent("client", actor_id, extra=lambda: (request.headers.get("X-Trace-Id"),))
#: /models and /tools answer the same for every actor: the header is optional there (checked
#: when given)
_ANY_ACTOR = Param(ACTOR_HEADER, "header", ID_SCHEMA, "optional: the answer is the same for "
                   "every actor; when given it must be an id (and the key's actor when bound)",
                   required=False)
_OPEN_PARAMS = (_ANY_ACTOR, *_TRACE)
#: a request body's traceId: an id, or null (= not given)
_TRACE_BODY = {**ID_SCHEMA, "type": ["string", "null"]}
#: what every client route may answer: a bad trace id; a missing, invalid or foreign actor
_COMMON = {400: ("invalid_id",), 401: ("missing_actor", "actor_mismatch")}
_OK = {"ok": {"const": True}, "traceId": {"type": "string"}}


def _ok(required: list[str], properties: dict) -> dict:
    """A contract §2 success body: ``{"ok": true, "traceId", …}``."""
    return {"type": "object", "required": ["ok", "traceId", *required],
            "properties": {**_OK, **properties}}


_NULLABLE = {"type": ["string", "null"]}
SESSIONS_PAGE = _ok(["sessions"], {"sessions": {"type": "array", "items": {
    "type": "object",
    "required": ["sessionId", "title", "preview", "messageCount", "toolCallCount", "updatedAt",
                 "model"],
    "properties": {"sessionId": {"type": "string"}, "title": _NULLABLE, "preview": _NULLABLE,
                   "messageCount": {"type": "integer", "minimum": 0},
                   "toolCallCount": {"type": "integer", "minimum": 0},
                   "updatedAt": {"type": "integer", "description": "unix seconds"},
                   "model": {"type": "string"}}}}})
SESSION_CREATED = _ok(["sessionId", "persistence"], {
    "sessionId": {"type": "string"}, "persistence": {"const": "hermes_on_first_run"}})
_TOKENS = {"type": "integer", "minimum": 0}
TRANSCRIPT = _ok(["sessionId", "messages", "usage"], {
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
RUN_STARTED = _ok(["sessionId", "runId", "messageId", "events"], {
    "sessionId": {"type": "string"}, "runId": {"type": "string"}, "messageId": {"type": "null"},
    "events": {**_EVENT_LIST, "maxItems": 0, "description": "always empty: the events are on "
                                                            "GET /events/{runId}"}})
ABORTED = _ok(["runId", "sessionId", "events"], {
    "runId": {"type": "string"}, "sessionId": {"type": "string"},
    "events": {**_EVENT_LIST, "description": "abort.started, or the final event of a run that "
                                             "had already ended"}})
MODELS = _ok(["defaultModel", "models"], {
    "defaultModel": {"type": "string"},
    "models": {"type": "array", "items": {
        "type": "object", "required": ["id", "label", "provider"],
        "properties": {"id": {"type": "string"}, "label": {"type": "string"},
                       "provider": {"type": "string"}}}}})
TOOL_LIST = _ok(["tools"], {"tools": {"type": "array", "items": {
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


MAX_SESSION_ID = 115    # + "." + 12 hex of the actor = a 128-char store key


def session_key(actor: str, session_id: str) -> str:
    """The ``sessions.json`` key of an actor's mnote session.

    Session ids are chosen by clients (``mnote_<documentId>_<traceId>``), so two actors may
    use the same one; the key adds a digest of the actor so neither can take or see the
    other's. Raises BadRequest for an unsafe or too long id.
    """
    check_id(session_id, "sessionId")
    if len(session_id) > MAX_SESSION_ID:
        raise BadRequest(f"sessionId must be at most {MAX_SESSION_ID} characters",
                         code="invalid_id")
    # "." before the digest; "_" after an id ending in "." (a traceId may end so), since
    # ".." is never an id. Neither key can equal another's: the digest is always 12 hex.
    sep = "_" if session_id.endswith(".") else "."
    return f"{session_id}{sep}{hashlib.sha256(actor.encode()).hexdigest()[:12]}"


def _own_session(session_id: str, actor: str) -> dict:
    try:
        return services().conversations.get(session_key(actor, session_id), owner=actor,
                                            kind="mnote")
    except NotFound:
        raise NotFound(f"session {session_id} not found", code="session_not_found") from None


def _check_page_args(rec: dict, workspace_id: str | None, document_id: str | None) -> None:
    if (workspace_id is not None and workspace_id != rec.get("workspace_id")) or \
            (document_id is not None and document_id != rec.get("document_id")):
        raise NotFound(f"session {rec['mnote_session_id']} not found", code="session_not_found")


# -- sessions ------------------------------------------------------------
@bp.get("/sessions")
@documented(summary="The actor's sessions of a page", tags=("client",),
            params=(*_PARAMS,
                    Param("workspaceId", "query", ID_SCHEMA, "only sessions of this workspace"),
                    Param("documentId", "query", ID_SCHEMA, "only sessions of this page"),
                    Param("limit", "query", {"type": "integer", "minimum": 1, "maximum": 100,
                                             "default": 20}, "at most this many")),
            replies={200: Reply("newest first; titles and counts from Hermes's record",
                                SESSIONS_PAGE)},
            errors={**_COMMON, 400: ("invalid_id", "invalid_request")})
def list_sessions():
    """§2 GET /sessions: the actor's sessions of one page, newest first (titles, counts from
    state.db)."""
    actor = actor_id()
    ws, doc = request.args.get("workspaceId"), request.args.get("documentId")
    for name, value in (("workspaceId", ws), ("documentId", doc)):
        if value is not None:
            check_id(value, name)
    try:
        limit = int(request.args.get("limit", 20))
    except ValueError:
        raise BadRequest("limit must be an integer", code="invalid_request") from None
    if not 1 <= limit <= 100:
        raise BadRequest("limit must be between 1 and 100", code="invalid_request")
    svc = services()
    match = {"kind": "mnote", **({"workspace_id": ws} if ws else {}),
             **({"document_id": doc} if doc else {})}
    home = svc.homes.path(actor)
    out = []
    for rec in svc.conversations.list(actor, **match):
        summary = session_summary(home.hermes_home, rec.get("hermes_session_id")) or {}
        out.append({"sessionId": rec["mnote_session_id"],
                    "title": summary.get("title") or rec.get("title"),
                    "preview":
                        (strip_context(summary.get("preview")) or "")[:PREVIEW_CHARS] or None,
                    "messageCount": summary.get("messageCount", 0),
                    "toolCallCount": summary.get("toolCallCount", 0),
                    "updatedAt": summary.get("updatedAt") or _unix(rec["updated_at"]),
                    "model": rec.get("model") or settings(svc.config).default_model})
    out.sort(key=lambda s: s["updatedAt"], reverse=True)
    return ok(sessions=out[:limit])


def _unix(iso: str) -> int:
    return int(datetime.fromisoformat(iso).timestamp())


CREATE_SESSION = {"type": "object", "required": ["workspaceId", "documentId"],
                  "additionalProperties": False,
                  "properties": {"workspaceId": ID_SCHEMA, "documentId": ID_SCHEMA,
                                 "traceId": _TRACE_BODY,
                                 "title": {"type": ["string", "null"], "maxLength": 200}},
                  "description": f"the session id is mnote_<documentId>_<traceId>: at most "
                                 f"{MAX_SESSION_ID} characters together (else 400)",
                  "examples": [{"workspaceId": "ws_1", "documentId": "doc_1",
                                "traceId": "trace_1", "title": "当前页问答"}]}


@bp.post("/sessions")
@documented(summary="Create (or find) the session of a page", tags=("client",),
            params=(*_PARAMS, _IDEMPOTENCY_KEY), body=CREATE_SESSION,
            replies={200: Reply("the session (idempotent for the same traceId)",
                                SESSION_CREATED)},
            errors={**_COMMON, 400: ("invalid_id", "invalid_request", "invalid_idempotency_key"),
                    404: ("session_not_found",), 409: _IDEMPOTENT[409],
                    503: _IDEMPOTENT[503]},
            links={"GetSession": ("mnote_client.get_session",
                                  {"session_id": "$response.body#/sessionId"})})
@_idempotent()
def create_session():
    """§2 POST /sessions → ``mnote_<documentId>_<traceId>``; the same call again returns the
    same session (idempotent). Chat history is persisted by Hermes on the first run.

    ``Idempotency-Key`` (docs/v1-api.md §Idempotent retries): a retry gets the first answer, byte
    for byte, with ``Idempotency-Replayed: true``; 409 ``hermes_client_idempotency_conflict`` for
    the same key with another body, query or ``X-Trace-Id``."""
    actor = actor_id()
    body = json_body()
    tid = trace_id()
    ws = check_id(body["workspaceId"], "workspaceId")
    doc = check_id(body["documentId"], "documentId")
    sid = f"mnote_{doc}_{tid}"
    if len(sid) > MAX_SESSION_ID:
        raise BadRequest(f"documentId and traceId are too long together: the session id "
                         f"mnote_<documentId>_<traceId> may have at most {MAX_SESSION_ID} "
                         "characters",
                         code="invalid_request")
    _ensure_session(sid, actor, ws, doc, body.get("title"))
    try:
        services().conversations.prewarm(actor, "mnote", [MNOTE_TOOLSET])
    except ServiceError:           # nothing to warm (e.g. no hermes command): runs will say so
        pass
    return ok(sessionId=sid, persistence="hermes_on_first_run")


def _ensure_session(sid: str, actor: str, ws: str, doc: str, title: str | None = None) -> dict:
    """The actor's session ``sid`` on page ws/doc, created if new (idempotent)."""
    conv = services().conversations
    try:
        rec = _own_session(sid, actor)
    except NotFound:
        try:
            rec = conv.create(actor, session_key(actor, sid), kind="mnote", mnote_session_id=sid,
                              workspace_id=ws, document_id=doc, title=title,
                              trace_id=g.get("trace_id"))
        except ServiceError as err:
            if err.code != "session_exists":      # created by a concurrent request: fine
                raise
            rec = _own_session(sid, actor)
    _check_page_args(rec, ws, doc)
    return rec


@bp.get("/sessions/<session_id>")
@documented(summary="A session's messages and usage", tags=("client",),
            params=(Param("session_id", "path", {**ID_SCHEMA, "maxLength": MAX_SESSION_ID},
                          "the session id"), *_PARAMS,
                    Param("workspaceId", "query", {"type": "string"},
                          "404 unless the session is on this workspace"),
                    Param("documentId", "query", {"type": "string"},
                          "404 unless the session is on this page")),
            replies={200: Reply("the newest 1000 messages, from Hermes's record", TRANSCRIPT)},
            errors={**_COMMON, 400: ("invalid_id",), 404: ("session_not_found",)})
def get_session(session_id):
    """§2 GET /sessions/{id}: messages and usage from Hermes's state.db; 404 for another actor."""
    actor = actor_id()
    rec = _own_session(session_id, actor)
    _check_page_args(rec, request.args.get("workspaceId"), request.args.get("documentId"))
    home = services().homes.path(actor).hermes_home
    summary = session_summary(home, rec.get("hermes_session_id")) or {}
    inp, outp = summary.get("inputTokens", 0), summary.get("outputTokens", 0)
    messages = transcript(home, rec.get("hermes_session_id"))
    for m in messages:
        if m["role"] == "user":
            m["content"] = strip_context(m["content"])   # sessions from before run files
        m["toolName"] = tool_name(m["toolName"])
    return ok(sessionId=session_id, messages=messages,
              usage={"inputTokens": inp, "outputTokens": outp, "totalTokens": inp + outp})


# -- runs --------------------------------------------------------------------
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
        "traceId": _TRACE_BODY,
        "pageContext": {"type": ["object", "null"], "properties": {
            "title": {"type": ["string", "null"]},
            "outline": {"type": ["array", "null"], "items": {}},
            "pageOptions": {"type": ["object", "null"]}}},
        "selectedBlockId": {"type": ["string", "null"]},
        "selectedText": {"type": ["string", "null"]},
    },
}
CONTEXT_BUDGET = 8192   # bytes of the page-context block
CONTEXT_HEAD = ("[mnote page context for this message only; use the mnote tools to read or change "
                "the page]")
CONTEXT_END = "\n[end of mnote page context]"
_LEGACY_END = "\n[end of mnote page context]\n\n"


def page_context(body: dict) -> str:
    """The run's page-context block: a delimited JSON object of the page's ids, ``title``,
    ``pageOptions``, ``outline``, ``selectedBlockId`` and ``selectedText`` (client-proxy
    contract §1: pageContext is run input, not session truth).

    The mnote plugin hands it to Hermes as ``pre_llm_call`` context, so it is appended to the
    API copy of this run's message only (docs/mnote-client.md). At most
    ``CONTEXT_BUDGET`` bytes: the outline is cut first, then long texts, then whole fields.
    """
    ctx = {"workspaceId": body["workspaceId"], "documentId": body["documentId"]}
    page = body.get("pageContext") or {}
    for key in ("title", "pageOptions", "outline"):
        if page.get(key) not in (None, [], {}):
            ctx[key] = page[key]
    for key in ("selectedBlockId", "selectedText"):
        if body.get(key):
            ctx[key] = body[key]

    def size() -> int:
        return len(json.dumps(ctx, ensure_ascii=False).encode())
    while size() > CONTEXT_BUDGET and ctx.get("outline"):  # 1. the outline, halving
        ctx["outline"] = ctx["outline"][: len(ctx["outline"]) // 2]
    for key in ("selectedText", "title"):                  # 2. long texts, shortened
        while size() > CONTEXT_BUDGET and len(ctx.get(key) or "") > 64:
            ctx[key] = ctx[key][: len(ctx[key]) // 2] + "…"
    for key in ("pageOptions", "outline", "selectedText", "title", "selectedBlockId"):
        if size() > CONTEXT_BUDGET:                        # 3. whole fields, dropped
            ctx.pop(key, None)
    return f"{CONTEXT_HEAD}\n{json.dumps(ctx, ensure_ascii=False)}{CONTEXT_END}"


def strip_context(content: str | None) -> str | None:
    """A user message stored before page context moved to run files (the block used to be
    put before the message): what the user typed."""
    if content and content.startswith(CONTEXT_HEAD) and _LEGACY_END in content:
        return content.split(_LEGACY_END, 1)[1]
    return content


def _configured_models(schema: dict, config) -> dict:
    """RUN as the document shows it for ``config``: ``model`` is one of ``mnote.models``."""
    ids = settings(config).model_ids
    # an enum with null and no type list: client generators make it one nullable enum type
    model = {k: v for k, v in schema["properties"]["model"].items() if k != "type"}
    model["enum"] = [*ids, None]
    return {**schema, "properties": {**schema["properties"], "model": model}}


@bp.post("/runs")
@documented(summary="Start a run (returns at once)", tags=("client",),
            params=(*_PARAMS, _IDEMPOTENCY_KEY), body=RUN, body_for_config=_configured_models,
            replies={200: Reply("the run was started; follow it on GET /events/{runId}",
                                RUN_STARTED)},
            errors={**_COMMON, 400: ("invalid_id", "invalid_request", "invalid_idempotency_key"),
                    404: ("session_not_found",), 409: ("session_busy", *_IDEMPOTENT[409]),
                    413: ("message_too_large",), 429: ("too_many_runs",),
                    503: ("hermes_unavailable", "hermes_unconfigured", "service_draining",
                          *_IDEMPOTENT[503])},
            links={"Events": ("mnote_client.events", {"run_id": "$response.body#/runId"}),
                   "Abort": ("mnote_client.abort", {"run_id": "$response.body#/runId"})})
@_idempotent()
def start_run():
    """§2 POST /runs: start a run in the background, return at once with ``runId``.

    Unknown ``sessionId`` of this actor: the session is created on this first run
    (``persistence: hermes_on_first_run``). 409 ``hermes_client_session_busy`` while a run
    is active on the session, its error body naming that run in ``runId`` (to attach to it on
    ``GET /events/{runId}``); 429 ``hermes_client_busy`` when every run slot is queued.

    Every POST without ``Idempotency-Key`` starts a new run: a repeated ``traceId`` is a trace
    id, not a retry. With the header (docs/v1-api.md §Idempotent retries) a retry of the same body
    from the same actor gets the first answer — the same ``runId``, at once, while that run goes on
    or after it ended — and Hermes runs once; 409 ``hermes_client_idempotency_conflict`` for the
    same key with another body.
    """
    actor = actor_id()
    body = json_body()
    tid = trace_id()
    svc = services()
    svc.check_accepting()            # 503 hermes_client_service_draining: stopping gracefully
    svc.processes.command_path()     # 503 hermes_client_unconfigured before a run is accepted
    svc.require_provider()           # (no provider, the shipped example, or no key variable)
    mcfg = settings(svc.config)
    model_id = body.get("model") or mcfg.default_model
    models = {m.id: m for m in mcfg.models}
    if model_id not in models:
        raise BadRequest(f"model must be one of {', '.join(models)}", code="invalid_request")
    ws = check_id(body["workspaceId"], "workspaceId")
    doc = check_id(body["documentId"], "documentId")
    sid = body["sessionId"]
    svc.conversations.check_message(body["message"])
    context = page_context(body)
    key = _ensure_session(sid, actor, ws, doc)["session_id"]
    hermes_model = models[model_id].hermes_model
    scope = _capability_scope(svc)
    # Hermes's questions go to the panel (ACP runner only; the CLI runner denies them)
    asking = svc.config.hermes.approvals.mode == "ask"

    def execute(run):
        # run token + ids for the plugin
        binding = mnote_of(svc).tools.run_binding(run, ws, doc, scope)
        binding["pageContext"] = context
        # the home brought up to date and repaired first, as every turn does (homes.ensure):
        # a FIFO or a folder planted at state.db is removed before anything reads it
        home = svc.homes.ensure(actor).hermes_home
        try:
            known = svc.conversations.get(key, kind="mnote").get("hermes_session_id")
            before = token_counts(home, known) or {}     # (not the transcript: first token)
            _, result = svc.conversations.send(
                key, body["message"], owner=actor, kind="mnote", wait=0, model=hermes_model,
                toolsets=[MNOTE_TOOLSET], plugin_run=binding, listener=run.listener(),
                log_ctx={"run": run.run_id},
                cancel=run.cancel, record={"model": model_id},
                approvals=run if asking else None)
        finally:
            mnote_of(svc).tools.end_run(run)
        after = session_summary(home, result.hermes_session_id) or {}
        closing = []
        if not result.streamed:      # the CLI runner: the answer arrives whole, at the end
            if result.reasoning:
                closing.append(("reasoning.delta", {"delta": result.reasoning}))
            closing += [("message.delta", {"delta": piece}) for piece in _pieces(result.answer)]
        completed = {"output": result.answer, "finish_reason": result.finish_reason,
                     "usage": _usage_delta(before, after, result.usage)}
        if result.notice:
            completed["notice"] = result.notice
        run.finish([*closing, ("run.completed", completed)])

    run = mnote_of(svc).runs.start(key, sid, actor, tid, execute)
    return ok(sessionId=sid, runId=run.run_id, messageId=None, events=[])


def tool_name(hermes_name):
    """A tool's name as the events give it (docs/mnote-client.md §Tool events) from the name
    Hermes records: an mnote tool's contract name for its function name (``mnote_page_get``
    → ``mnote.page.get``), any other name as it is."""
    spec = TOOLS_BY_WIRE_NAME.get(hermes_name) if isinstance(hermes_name, str) else None
    return spec.name if spec is not None else hermes_name


def _pieces(text: str) -> list[str]:
    """``text`` as ``message.delta`` texts of at most a delta's cap each (docs/mnote-client.md
    §Sizes of events), so that they add up to it whole."""
    cap = event_bounds.FIELD_CHARS["delta"]
    return [text[i:i + cap] for i in range(0, len(text), cap)]


def _usage_delta(before: dict, after: dict, reported: dict | None = None) -> dict:
    """Tokens this run used: the growth of Hermes's own per-session counters, or what the
    runner reported when the counters did not move."""
    inp = max(0, after.get("inputTokens", 0) - before.get("inputTokens", 0))
    out = max(0, after.get("outputTokens", 0) - before.get("outputTokens", 0))
    if not inp and not out and reported:
        inp, out = reported.get("input_tokens", 0), reported.get("output_tokens", 0)
    return {"input_tokens": inp, "output_tokens": out, "total_tokens": inp + out}


def _capability_scope(svc) -> list[str]:
    key_scope = getattr(g.get("api_key"), "capability_scope", None)
    if key_scope is None:
        key_scope = settings(svc.config).default_capability_scope
    return list(key_scope)


@bp.get("/events/<run_id>")
@documented(summary="A run's events (Server-Sent Events)", tags=("client",),
            params=(Param("run_id", "path", ID_SCHEMA, "the run"), *_PARAMS,
                    Param("sessionId", "query", {"type": "string"},
                          "404 unless the run is on this session"),
                    Param("Last-Event-ID", "header", {"type": "integer"},
                          "replay every event after this id"),
                    Param("lastEventId", "query", {"type": "string"},
                          "as Last-Event-ID, when that header is absent or empty: then it must "
                          "be an integer (400 otherwise)")),
            replies={200: Reply("the run's events, replayed and then live, until its last",
                                media=EVENT_STREAM,
                                headers=("Cache-Control", "X-Accel-Buffering", "X-Trace-Id")),
                     204: Reply("Last-Event-ID is the last event of a finished run: nothing "
                                "follows (an EventSource stops reconnecting)")},
            errors={**_COMMON, 400: ("invalid_id", "invalid_request"), 404: ("run_not_found",),
                    429: ("too_many_streams",)})
def events(run_id):
    """§2 GET /events/{run_id}: Server-Sent Events (docs/mnote-client.md §Events).

    Frames: ``id: <seq>`` + ``data: <json>``; ``: keepalive`` comments every
    ``mnote.keepalive_seconds``. ``Last-Event-ID`` (header, or ``lastEventId`` query)
    replays every event after that id. The stream ends after the terminal event. Any service
    process on the data dir serves any run, from its durable log (docs/data-and-durability.md
    §Runs and their events); a run whose process died is closed first (``run.failed``
    ``hermes_client_run_interrupted``).

    * ``Last-Event-ID`` above the run's last id (never issued): 400 ``hermes_client_bad_request``
      naming the run's last id; not an integer (or negative): 400 too;
    * ``Last-Event-ID`` = the last id of a finished run (a reconnect after the terminal event):
      204 No Content, which tells a browser EventSource to stop reconnecting;
    * 429 ``hermes_client_busy`` when ``mnote.max_event_streams`` streams are open; a client
      that disconnects frees its slot within ~1 s (:class:`~hermes_service.mnote.runs.ClientWatch`).
    """
    actor = actor_id()
    check_id(run_id, "runId")
    trace_id()           # each traceId given must be an id (400), as on every client route
    svc = services()
    run = mnote_of(svc).runs.get(run_id, actor)
    sid = request.args.get("sessionId")
    if sid is not None and sid != run.session_id:
        raise NotFound(f"run {run_id} not found", code="run_not_found")
    # the request is the run's from here: logged under its traceId (unless one was given),
    # and every answer, an error too, names the run's in X-Trace-Id
    adopt_trace_id(run.trace_id)
    named = {"X-Trace-Id": run.trace_id}
    try:
        after = _last_event_id()
    except BadRequest as err:
        err.headers.update(named)
        raise
    last, done = run.position()
    if after > last:
        raise BadRequest(
            f"Last-Event-ID {after} was never issued by run {run_id}: its last event id is "
            f"{last}{' (the run has ended)' if done else ' so far'}; reconnect without "
            "Last-Event-ID to replay the run from its first event", code="invalid_request",
            headers=named)
    headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no", **named}
    if done and after == last:      # the client has the terminal event: nothing will follow
        resp = Response(status=204, headers=headers)
        del resp.headers["Content-Type"]       # no body, so no media type (RFC 9110 §8.3)
        return resp
    keepalive = float(settings(svc.config).keepalive_seconds)
    # 429 when mnote.max_event_streams are open; waitress tells when the client goes away
    sub = mnote_of(svc).runs.subscribe(run, request.environ.get("waitress.client_disconnected"))

    def stream():
        yield ": stream open\n\n"     # the first byte leaves at once (proxies, clients)
        for batch in sub.events(after, keepalive):
            if not batch:
                yield ": keepalive\n\n"
            else:      # everything that arrived since the last write, in one write
                yield "".join(f"id: {seq}\ndata: {_sse_json(public_event(event))}\n\n"
                              for seq, event in batch)

    resp = Response(stream_with_context(stream()), mimetype="text/event-stream", headers=headers)
    resp.call_on_close(sub.close)   # also for HEAD and for clients that disconnect
    return resp


def _sse_json(event: dict) -> str:
    """An event's ``data:`` JSON: UTF-8 text as is, unless a string holds a lone surrogate
    (e.g. a streamed delta), which UTF-8 cannot carry: then that event is written with
    ``\\uXXXX`` escapes (JSON.parse gives the same string) instead of breaking the stream."""
    text = json.dumps(event, ensure_ascii=False)
    try:
        text.encode()
    except UnicodeEncodeError:
        text = json.dumps(event)
    return text


def _last_event_id() -> int:
    """The ``Last-Event-ID`` header (or ``lastEventId`` query) as an event id; 0 when absent.
    400 unless it is a non-negative integer."""
    text = request.headers.get("Last-Event-ID") or request.args.get("lastEventId") or "0"
    if not EVENT_ID.fullmatch(text):
        raise BadRequest("Last-Event-ID must be an event id (a non-negative integer)",
                         code="invalid_request")
    return int(text)


ABORT = {"type": "object", "additionalProperties": False,
         "properties": {"workspaceId": {"type": "string",
                                        "description": "404 unless the run is on this workspace"},
                        "documentId": {"type": "string",
                                       "description": "404 unless the run is on this page"},
                        "sessionId": {"type": "string",
                                      "description": "404 unless the run is on this session"},
                        "traceId": _TRACE_BODY},
         "examples": [{"workspaceId": "ws_1", "documentId": "doc_1",
                       "sessionId": "mnote_doc_1_trace_1", "traceId": "trace_1"}]}


def _own_run(run_id: str, body: dict):
    """The run ``run_id`` as abort and approval authorise it: the acting actor's run (the
    key's scope and actor checks come first), on the body's ``sessionId`` / ``workspaceId``
    / ``documentId`` when given (the run's page is its session's: POST /runs checks that).
    404 ``run_not_found`` otherwise, the same for every mismatch."""
    actor = actor_id()
    check_id(run_id, "runId")
    run = mnote_of(services()).runs.get(run_id, actor)
    if body.get("sessionId") not in (None, run.session_id):
        raise NotFound(f"run {run_id} not found", code="run_not_found")
    if body.get("workspaceId") is not None or body.get("documentId") is not None:
        try:
            _check_page_args(_own_session(run.session_id, actor), body.get("workspaceId"),
                             body.get("documentId"))
        except NotFound:
            raise NotFound(f"run {run_id} not found", code="run_not_found") from None
    return run


@bp.post("/runs/<run_id>/abort")
@documented(summary="Abort a run", tags=("client",),
            params=(Param("run_id", "path", ID_SCHEMA, "the run"), *_PARAMS), body=ABORT,
            body_required=False,
            replies={200: Reply("abort.started (run.cancelled follows on the stream), or the "
                                "final event of a finished run", ABORTED)},
            errors={**_COMMON, 400: ("invalid_id", "invalid_request"), 404: ("run_not_found",)})
def abort(run_id):
    """§2 POST /runs/{id}/abort: returns at once with ``abort.started``; the worker kills the
    run's process group and emits ``run.cancelled``. A finished run returns its final event.
    A run of another live process on the data dir gets the abort through its request file
    (applied within ~50 ms: docs/data-and-durability.md §Runs and their events)."""
    actor_id()
    body = json_body() if has_body() else {}
    svc = services()
    run = _own_run(run_id, body)
    events_out = mnote_of(svc).runs.abort(run)
    # no tool call of an aborted run gets through, from now on
    mnote_of(svc).tools.end_run(run)
    return ok(runId=run.run_id, sessionId=run.session_id,
              events=[public_event(e) for e in events_out])


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
                           "traceId": _TRACE_BODY},
            "examples": [{"sessionId": "mnote_doc_1_trace_1", "approvalId": "apr_0123456789ab",
                          "choice": "once", "traceId": "trace_1"}]}
APPROVED = _ok(["runId", "approvalId", "choice"], {
    "runId": {"type": "string"}, "approvalId": {"type": "string"},
    "choice": {"enum": list(CHOICES)}})


@bp.post("/runs/<run_id>/approval")
@documented(summary="Answer a question of the run (approval.request)", tags=("client",),
            params=(Param("run_id", "path", ID_SCHEMA, "the run"), *_PARAMS),
            body=APPROVAL,
            replies={200: Reply("the answer was handed to Hermes; approval.responded follows "
                                "on the stream", APPROVED)},
            errors={**_COMMON, 400: ("invalid_id", "invalid_request"), 404: ("run_not_found",),
                    409: ("approval_not_pending",)})
def approval(run_id):
    """POST /runs/{id}/approval (docs/mnote-client.md §Approvals): answer the run's pending question
    ``approvalId`` with ``choice`` (``once`` | ``session`` | ``always`` | ``deny``, one of
    the question's ``choices``). Authorised exactly like abort (:func:`_own_run`: another
    actor's run, another session or page → 404). 400 ``hermes_client_bad_request`` for a
    choice the question does not offer (``always`` when ``hermes.approvals.allow_always`` is
    false); 409 ``hermes_client_approval_not_pending`` when ``approvalId`` is not pending
    (never asked, answered, timed out, or the run ended). Emits ``approval.responded``
    ``{approval_id, choice, resolved_by: "user"}``."""
    actor_id()
    body = json_body()
    run = _own_run(run_id, body)
    choice = run.answer(check_id(body["approvalId"], "approvalId"), body["choice"], "user")
    return ok(runId=run.run_id, approvalId=body["approvalId"], choice=choice)


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
                          "traceId": _TRACE_BODY},
           "examples": [{"sessionId": "mnote_doc_1_trace_1", "clarifyId": "clq_0123456789ab",
                         "answer": "staging", "traceId": "trace_1"}]}
CLARIFIED = _ok(["runId", "clarifyId"], {"runId": {"type": "string"},
                                         "clarifyId": {"type": "string"}})


@bp.post("/runs/<run_id>/clarify")
@documented(summary="Answer a clarifying question of the run (clarify.request)",
            tags=("client",),
            params=(Param("run_id", "path", ID_SCHEMA, "the run"), *_PARAMS), body=CLARIFY,
            replies={200: Reply("the answer was handed to Hermes; clarify.responded follows "
                                "on the stream", CLARIFIED)},
            errors={**_COMMON, 400: ("invalid_id", "invalid_request"), 404: ("run_not_found",),
                    409: ("clarify_not_pending",)})
def clarify(run_id):
    """POST /runs/{id}/clarify (docs/mnote-client.md §Approvals → Clarifying questions): answer the
    run's pending clarifying question ``clarifyId`` with ``answer`` (a suggested choice or any text,
    1-4000 characters). Authorised exactly like abort (:func:`_own_run`: 404). 409
    ``hermes_client_clarify_not_pending`` when ``clarifyId`` is not pending (never asked, answered,
    timed out, the run ended). Emits ``clarify.responded`` ``{clarify_id, resolved_by: "user"}``."""
    actor_id()
    body = json_body()
    run = _own_run(run_id, body)
    run.answer_clarify(check_id(body["clarifyId"], "clarifyId"), body["answer"], "user")
    return ok(runId=run.run_id, clarifyId=body["clarifyId"])


@bp.get("/models")
@documented(summary="Models the panel may choose", tags=("client",),
            params=_OPEN_PARAMS, replies={200: Reply("mnote.models", MODELS)}, errors=_COMMON)
def models():
    """§2 GET /models: from ``mnote.models`` with ``defaultModel``; the actor header is
    optional (the list is the same for everyone)."""
    actor_id(required=False)
    mcfg = settings(services().config)
    return ok(defaultModel=mcfg.default_model,
              models=[{"id": m.id, "label": m.id if m.label is None else m.label,
                       "provider": "hermes" if m.provider is None else m.provider}
                      for m in mcfg.models])


@bp.get("/tools")
@documented(summary="The mnote tools", tags=("client",), params=_OPEN_PARAMS,
            replies={200: Reply("the tool registry", TOOL_LIST)}, errors=_COMMON)
def tools():
    """§2 GET /tools: the mnote tool registry (name, scope, schemaVersion); the actor header
    is optional (the registry is the same for everyone)."""
    actor_id(required=False)
    return ok(tools=[{"name": t.name, "scope": t.scope, "schemaVersion": SCHEMA_VERSION}
                     for t in TOOLS])



@legacy_bp.route("/api/ai-agent/run", methods=["GET", "POST"])
@documented(summary="Retired legacy endpoint", tags=("client",), replies={},
            errors={410: ("legacy_endpoint_gone",)}, deprecated=True)
def legacy_run():
    """Contract §4: the legacy endpoint is gone; answers 410 pointing at the new routes."""
    raise ServiceError("the legacy /api/ai-agent/run endpoint is retired; use "
                       f"POST {PREFIX}/runs and GET {PREFIX}/events/{{run_id}}",
                       code="legacy_endpoint_gone", status=410)

