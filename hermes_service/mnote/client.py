"""mnote client-proxy routes ``/api/hermes/client/*`` (contract: hermes-client-proxy-contract-v1;
docs/mnote-client.md): the blueprint and its route families, what every route reads of a
request (the actor, the traceId), the error body, and the routes of sessions, models and
tools. The run routes are :mod:`.client_runs`; the contracts :mod:`.client_schemas`; the
codes :mod:`.client_codes`.

Caller: mnote-web's server, with its API key (core auth). The end user is named by
``X-Mnote-Actor-Id``; it is the service's ``user_id`` and so picks the Hermes home. A key
bound to an actor (``api_keys[].actor_id``) accepts that header only if it matches (or is
absent). Every response carries ``traceId`` (body ``traceId``, query ``traceId``, header
``X-Trace-Id``, or generated). Errors are exactly ``{"ok": false, "code", "message",
"traceId", "requestId"}``.
"""
from __future__ import annotations

import hashlib
from datetime import datetime
from typing import overload

from flask import Blueprint, g, jsonify, request

from .. import logs
from ..errors import ID_SCHEMA, BadRequest, NotFound, ServiceError, Unauthorized, check_id
from ..homes.hermes_state import session_summary, transcript
from ..security import acting_user
from ..web import tokens
from ..web.helpers import (
    Param,
    Reply,
    documented,
    has_body,
    idempotent,
    json_body,
    parse_json,
    services,
)
from ..web.routing import ErrorFamily, RouteFamily, declare
from .client_codes import client_code, status_for
from .client_schemas import (
    ACTOR_HEADER,
    CLIENT_ERROR,
    COMMON,
    CREATE_SESSION,
    IDEMPOTENCY_KEY,
    IDEMPOTENT,
    MAX_SESSION_ID,
    MODELS,
    OPEN_PARAMS,
    PARAMS,
    SESSION_CREATED,
    SESSIONS_PAGE,
    TOOL_LIST,
    TRANSCRIPT,
)
from .objects import settings
from .page_context import strip_context
from .tools import SCHEMA_VERSION, TOOLS, TOOLS_BY_WIRE_NAME

PREFIX = "/api/hermes/client"
LEGACY_PREFIX = "/api/ai-agent"

MNOTE_TOOLSET = "mnote"
PREVIEW_CHARS = 200


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
    err.status = status_for(err)     # the proxy answers a provider 429 with 429
    try:
        tid = trace_id()
    except ServiceError:
        tid = g.get("trace_id") or "trace_" + tokens.hex16()
    body = {"ok": False, "code": client_code(err.code), "message": err.detail, "traceId": tid,
            "requestId": g.get("request_id")}
    for key, value in err.extra.items():
        body.setdefault(key, value)
    return body



@overload
def actor_id() -> str: ...
@overload
def actor_id(required: bool) -> str | None: ...


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


ERRORS = ErrorFamily("ClientError", CLIENT_ERROR, client_code,
                     "client proxy error (contract §3; codes: docs/mnote-client.md, error table)",
                     render=render_error_body)
#: the client routes and the retired legacy one: an allowed address and an API key with the
#: ``client`` scope; errors in the contract's §3 shape
CLIENT = RouteFamily("client", (PREFIX + "/",), ERRORS, scope="client")
LEGACY = RouteFamily("legacy", (LEGACY_PREFIX + "/",), ERRORS, scope="client")
bp = declare(Blueprint("mnote_client", __name__, url_prefix=PREFIX), CLIENT)
legacy_bp = declare(Blueprint("mnote_legacy", __name__), LEGACY)


def idempotent_client():
    """The client routes' :func:`~hermes_service.web.helpers.idempotent`: a key belongs to the
    API key and the actor; the given ``X-Trace-Id`` is part of the request."""
    return idempotent("client", actor_id, extra=lambda: (request.headers.get("X-Trace-Id"),))


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


def own_session(session_id: str, actor: str) -> dict:
    try:
        return services().conversations.get(session_key(actor, session_id), owner=actor,
                                            kind="mnote")
    except NotFound:
        raise NotFound(f"session {session_id} not found", code="session_not_found") from None


def check_page_args(rec: dict, workspace_id: str | None, document_id: str | None) -> None:
    if (workspace_id is not None and workspace_id != rec.get("workspace_id")) or \
            (document_id is not None and document_id != rec.get("document_id")):
        raise NotFound(f"session {rec['mnote_session_id']} not found", code="session_not_found")


# -- sessions ------------------------------------------------------------
@bp.get("/sessions")
@documented(summary="The actor's sessions of a page", tags=("client",),
            params=(*PARAMS,
                    Param("workspaceId", "query", ID_SCHEMA, "only sessions of this workspace"),
                    Param("documentId", "query", ID_SCHEMA, "only sessions of this page"),
                    Param("limit", "query", {"type": "integer", "minimum": 1, "maximum": 100,
                                             "default": 20}, "at most this many")),
            replies={200: Reply("newest first; titles and counts from Hermes's record",
                                SESSIONS_PAGE)},
            errors={**COMMON, 400: ("invalid_id", "invalid_request")})
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
    home = svc.homes.present(actor)
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


@bp.post("/sessions")
@documented(summary="Create (or find) the session of a page", tags=("client",),
            params=(*PARAMS, IDEMPOTENCY_KEY), body=CREATE_SESSION,
            replies={200: Reply("the session (idempotent for the same traceId)",
                                SESSION_CREATED)},
            errors={**COMMON, 400: ("invalid_id", "invalid_request", "invalid_idempotency_key"),
                    404: ("session_not_found",), 409: IDEMPOTENT[409],
                    503: IDEMPOTENT[503]},
            links={"GetSession": ("mnote_client.get_session",
                                  {"session_id": "$response.body#/sessionId"})})
@idempotent_client()
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
    ensure_session(sid, actor, ws, doc, body.get("title"))
    try:
        services().conversations.prewarm(actor, "mnote", [MNOTE_TOOLSET])
    except ServiceError:           # nothing to warm (e.g. no hermes command): runs will say so
        pass
    return ok(sessionId=sid, persistence="hermes_on_first_run")


def ensure_session(sid: str, actor: str, ws: str, doc: str, title: str | None = None) -> dict:
    """The actor's session ``sid`` on page ws/doc, created if new (idempotent)."""
    conv = services().conversations
    try:
        rec = own_session(sid, actor)
    except NotFound:
        try:
            rec = conv.create(actor, session_key(actor, sid), kind="mnote", mnote_session_id=sid,
                              workspace_id=ws, document_id=doc, title=title,
                              trace_id=g.get("trace_id"))
        except ServiceError as err:
            if err.code != "session_exists":      # created by a concurrent request: fine
                raise
            rec = own_session(sid, actor)
    check_page_args(rec, ws, doc)
    return rec


@bp.get("/sessions/<session_id>")
@documented(summary="A session's messages and usage", tags=("client",),
            params=(Param("session_id", "path", {**ID_SCHEMA, "maxLength": MAX_SESSION_ID},
                          "the session id"), *PARAMS,
                    Param("workspaceId", "query", {"type": "string"},
                          "404 unless the session is on this workspace"),
                    Param("documentId", "query", {"type": "string"},
                          "404 unless the session is on this page")),
            replies={200: Reply("the newest 1000 messages, from Hermes's record", TRANSCRIPT)},
            errors={**COMMON, 400: ("invalid_id",), 404: ("session_not_found",)})
def get_session(session_id):
    """§2 GET /sessions/{id}: messages and usage from Hermes's state.db; 404 for another actor."""
    actor = actor_id()
    rec = own_session(session_id, actor)
    check_page_args(rec, request.args.get("workspaceId"), request.args.get("documentId"))
    home = services().homes.present(actor).hermes_home
    summary = session_summary(home, rec.get("hermes_session_id")) or {}
    inp, outp = summary.get("inputTokens", 0), summary.get("outputTokens", 0)
    messages = transcript(home, rec.get("hermes_session_id"))
    for m in messages:
        if m["role"] == "user":
            m["content"] = strip_context(m["content"])   # sessions from before run files
        m["toolName"] = tool_name(m["toolName"])
    return ok(sessionId=session_id, messages=messages,
              usage={"inputTokens": inp, "outputTokens": outp, "totalTokens": inp + outp})


def tool_name(hermes_name):
    """A tool's name as the events give it (docs/mnote-client.md §Tool events) from the name
    Hermes records: an mnote tool's contract name for its function name (``mnote_page_get``
    → ``mnote.page.get``), any other name as it is."""
    spec = TOOLS_BY_WIRE_NAME.get(hermes_name) if isinstance(hermes_name, str) else None
    return spec.name if spec is not None else hermes_name


@bp.get("/models")
@documented(summary="Models the panel may choose", tags=("client",),
            params=OPEN_PARAMS, replies={200: Reply("mnote.models", MODELS)}, errors=COMMON)
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
@documented(summary="The mnote tools", tags=("client",), params=OPEN_PARAMS,
            replies={200: Reply("the tool registry", TOOL_LIST)}, errors=COMMON)
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
