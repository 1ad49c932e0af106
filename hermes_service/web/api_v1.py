"""The v1 REST API (spec: hermes-service-api-v1.3.0 §API 端点清单).

Error body: ``{"detail": str, "code": str, "requestId": str}`` with the
HTTP status of the :class:`~hermes_service.errors.ServiceError` raised.

Each route declares its contract (:func:`~hermes_service.web.helpers.documented`): the request
schemas below are what :func:`~hermes_service.web.helpers.json_body` validates with, and, with the
response schemas, what ``GET /openapi.json`` shows (docs/api-description.md).
"""
from __future__ import annotations

import logging
import re
import time
import uuid

from flask import Blueprint, g, jsonify, request

from ..conversations import SendRequest
from ..errors import ID_SCHEMA, NO_NUL, BadRequest, Forbidden, ServiceError, check_id
from ..idempotency import HEADER as IDEMPOTENCY_HEADER
from ..idempotency import KEY_SCHEMA
from ..preflight import describe, health_checks
from ..runner import FINISH_REASON, classify_failure
from ..security import acting_user
from .helpers import (
    V1_ERRORS,
    Param,
    Reply,
    documented,
    has_body,
    idempotent,
    json_body,
    parse_json,
    services,
)
from .routing import OPEN_UNLESS, RouteFamily, declare

log = logging.getLogger("hermes_service")

# the route families of this blueprint (docs/configuring.md §API keys): the v1 API, its execute
# route (a scope of its own: it reads any user's data), and /health (a key only when
# security.health_requires_api_key)
V1 = RouteFamily("v1", ("/api/v1/",), V1_ERRORS, scope="v1")
EXECUTE = RouteFamily("execute", ("/api/v1/execute/",), V1_ERRORS, scope="execute")
HEALTH = RouteFamily("health", ("/health",), V1_ERRORS, auth=OPEN_UNLESS,
                     key_setting="health_requires_api_key")
bp = declare(Blueprint("api_v1", __name__), V1, EXECUTE, HEALTH)

# -- request schemas (spec §3-§5) ---------------------------------------------------------
# optional fields may also be sent as null (= absent), as initial_message may
_USER_CONTEXT = {"type": ["object", "null"],
                 "properties": {"user_id": {**ID_SCHEMA, "type": ["string", "null"]}},
                 "description": "the user the request acts for (`user_id`); null: none"}
CREATE_SESSION = {"type": "object", "required": ["user_id"], "additionalProperties": False,
                  "properties": {"user_id": ID_SCHEMA,
                                 "initial_message": {"type": ["string", "null"],
                                                     "description": "accepted, unused (spec)"}},
                  "examples": [{"user_id": "user123"}]}
SEND_MESSAGE = {"type": "object", "required": ["message"], "additionalProperties": False,
                "properties": {"message": {"type": "string", "minLength": 1, "pattern": NO_NUL,
                                           "description": "at most hermes.max_message_bytes "
                                                          "(UTF-8; else 413), no NUL"},
                               "user_context": _USER_CONTEXT},
                "examples": [{"message": "What is Python?"}]}
#: the shortest ``timeout`` of /api/v1/execute, seconds: enough to start a process (a shorter
#: one could only end in 504 ``run_timeout`` before the command ran; docs/v1-api.md)
MIN_EXECUTE_TIMEOUT = 1
EXECUTE_BODY = {"type": "object", "required": ["command"], "additionalProperties": False,
           "properties": {"command": {"type": "array", "minItems": 1,
                                      "items": {"type": "string", "minLength": 1},
                                      "description": "hermes argv; must start with an entry of "
                                                     "hermes.execute.allowed"},
                          "user_context": _USER_CONTEXT,
                          "timeout": {"type": ["number", "null"],
                                      "minimum": MIN_EXECUTE_TIMEOUT,
                                      "description": f"seconds, at least {MIN_EXECUTE_TIMEOUT} "
                                                     "(less is 400 invalid_request); null: the "
                                                     "cap, hermes.execute.timeout_seconds"}},
           "examples": [{"command": ["sessions", "list", "--source", "tool"],
                         "user_context": {"user_id": "user123"}}]}

# -- response schemas --------------------------------------------------------------------
_HEALTH_CHECKS = {"type": "object", "description": "each part: `ok` or a short reason",
                  "properties": {k: {"type": "string"} for k in
                                 ("hermes_command", "users_template", "data_dir", "provider",
                                  "sandbox")}}
HEALTH_BODY = {"type": "object", "required": ["status", "service", "multi_user"],
          "properties": {"status": {"enum": ["healthy", "degraded", "draining", "stopping"]},
                         "service": {"const": "hermes-service"},
                         "multi_user": {"const": True}, "checks": _HEALTH_CHECKS}}
STATUS = {"type": "object", "required": ["status", "version"],
          "properties": {"status": {"const": "running"},
                         "version": {"type": "string", "description": "first line of "
                                                                      "`hermes --version`"}}}
SESSION_CREATED = {"type": "object", "required": ["session_id", "user_id", "hermes_path", "status"],
                   "properties": {"session_id": {"type": "string"}, "user_id": {"type": "string"},
                                  "hermes_path": {"type": "string"},
                                  "status": {"const": "created"}}}
SESSION = {"type": "object",
           "required": ["user_id", "local_session_id", "created_at", "status", "updated_at",
                        "message_count", "hermes_session_id"],
           "properties": {"user_id": {"type": "string"}, "local_session_id": {"type": "string"},
                          "created_at": {"type": "string", "description": "ISO 8601"},
                          "status": {"type": "string"},
                          "updated_at": {"type": ["string", "null"]},
                          "message_count": {"type": "integer", "minimum": 0},
                          "hermes_session_id": {"type": ["string", "null"]}}}
SESSION_LIST = {"type": "object", "required": ["user_id", "sessions"],
                "properties": {"user_id": {"type": "string"},
                               "sessions": {"type": "array", "items": SESSION}}}
SESSION_DELETED = {"type": "object", "required": ["session_id", "status"],
                   "properties": {"session_id": {"type": "string"},
                                  "status": {"const": "deleted"}}}
MESSAGE_REPLY = {"type": "object",
                 "required": ["session_id", "response", "success", "hermes_session_id", "resumed",
                              "reasoning", "finish_reason"],
                 "properties": {"session_id": {"type": "string"},
                                "response": {"type": "string",
                                             "description": "the answer Hermes recorded: "
                                             "everything the model wrote in the turn"},
                                "finish_reason": FINISH_REASON,
                                "success": {"const": True},
                                "hermes_session_id": {"type": ["string", "null"]},
                                "resumed": {"type": "boolean"},
                                "reasoning": {"type": ["string", "null"]},
                                "notice": {"type": "string", "description": "set when a new "
                                           "Hermes conversation had to be started"}}}
EXECUTE_RESULT = {"type": "object",
                  "required": ["success", "stdout", "stderr", "returncode", "truncated"],
                  "properties": {"success": {"type": "boolean"}, "stdout": {"type": "string"},
                                 "stderr": {"type": "string"},
                                 "returncode": {"type": ["integer", "null"]},
                                 "truncated": {"type": "boolean"}}}

_SESSION_ID = Param("session_id", "path", ID_SCHEMA, "a v1 session id")
# what a turn may answer (docs/v1-api.md, error table)
_TURN_ERRORS = {409: ("session_busy",), 422: ("run_limit_exceeded",),
                429: ("too_many_runs", "token_budget_exceeded"),
                502: ("upstream_unauthorized", "upstream_empty_answer", "upstream_unavailable",
                      "hermes_failed"),
                503: ("upstream_rate_limited", "hermes_unavailable", "hermes_unconfigured",
                      "service_draining", "service_stopping"),
                504: ("run_timeout", "run_stalled"), 507: ("home_quota_exceeded", "storage_full")}
_NEW_SESSION = {"session_id": "$response.body#/session_id"}
#: docs/v1-api.md §Idempotent retries
IDEMPOTENCY_KEY = Param(IDEMPOTENCY_HEADER, "header", KEY_SCHEMA,
                        "retry safely: the same key with the same request returns the first "
                        "outcome (`Idempotency-Replayed: true`); with another request 409 "
                        "(docs/v1-api.md §Idempotent retries)")
_IDEMPOTENCY_ERRORS = {400: ("invalid_idempotency_key",),
                       409: ("idempotency_key_conflict", "idempotency_key_in_progress"),
                       503: ("idempotency_unavailable",)}


def _merge(*tables: dict) -> dict:
    """Error tables (status -> codes) joined."""
    out: dict = {}
    for table in tables:
        for status, codes in table.items():
            out[status] = tuple(dict.fromkeys((*out.get(status, ()), *codes)))
    return out


def _requested_user(*path: str) -> str | None:
    """Whose idempotency key this is (:func:`~hermes_service.web.helpers.idempotent`): the key's
    bound actor, else the user the body names at ``path`` — read as sent, never raising (the
    route reports a bad body itself)."""
    bound = getattr(g.get("api_key"), "actor_id", None)
    if bound:
        return bound
    try:
        value = parse_json(request.get_data()) if has_body() else None
    except ServiceError:
        return None
    for step in path:
        value = value.get(step) if isinstance(value, dict) else None
    return value if isinstance(value, str) else None
# Extra arguments after an allowed subcommand: plain words and --options only,
# never a path (so e.g. `sessions export <file>` cannot write anywhere).
_SAFE_ARG = re.compile(r"^[A-Za-z0-9_.:=,@+-]{1,200}$")


def _user(user_id: str | None) -> str | None:
    """The user a request may act for (:func:`~hermes_service.security.acting_user`): a key
    bound to an actor (``api_keys[].actor_id``) acts only for that user — another ``user_id``
    is 403 ``actor_mismatch``."""
    return acting_user(g.get("api_key"), check_id(user_id, "user_id") if user_id else None)


def _public(rec: dict) -> dict:
    """v1 session shape (spec §6) plus the mapping fields callers need."""
    return {"user_id": rec["user_id"], "local_session_id": rec["session_id"],
            "created_at": rec["created_at"], "status": rec["status"],
            "updated_at": rec.get("updated_at"), "message_count": rec.get("message_count", 0),
            "hermes_session_id": rec.get("hermes_session_id")}


_last_health: list = [None]    # the last reported problems, so a change is logged once
#: /health runs its checks at most once per this many seconds (docs/v1-api.md §Health)
HEALTH_CHECKS_MAX_AGE = 1.0
_health_checked: list = [None]  # (config, time.monotonic(), checks) of the last run


@bp.get("/health")
@documented(summary="Liveness and readiness", tags=("health",),
            replies={200: Reply("healthy, or degraded without a usable model provider",
                                HEALTH_BODY),
                     503: Reply("degraded (the node cannot work), draining or stopping",
                                HEALTH_BODY)})
def health():
    """Spec §1: ``{"status": "healthy", "service", "multi_user"}`` (200) — a cheap liveness
    answer (a few stat calls). When the node cannot work (``hermes_command``,
    ``users_template`` or ``data_dir`` unusable) it answers 503 with ``"status": "degraded"``
    and ``checks`` naming what failed; without a usable model provider it answers 200 with
    ``"status": "degraded"`` and ``checks`` (the node serves everything but turns, exactly as
    well as any other node of the same config: no reason for a load balancer to take it out),
    and likewise (``checks.sandbox``) when ``hermes.sandbox.mode: auto`` found no usable
    bubblewrap, so Hermes processes run unconfined (docs/sandbox.md);
    ``"status": "draining"`` (503, the rest of the body as it would be) while a stop lets
    running turns finish, ``"status": "stopping"`` (503) after. Exempt from the API key unless
    ``security.health_requires_api_key``. docs/v1-api.md §Health."""
    svc = services()
    if svc.processes.stopping:
        return jsonify(status="stopping", service="hermes-service", multi_user=True), 503
    body, code = _health(svc)
    if svc.draining:           # new work goes elsewhere; the rest of the answer stays
        return jsonify({**body, "status": "draining"}), 503
    return jsonify(body), code


def _checks(svc) -> dict[str, str | None]:
    """The checks of :func:`health` (:func:`~hermes_service.preflight.health_checks` and the
    sandbox's), at most :data:`HEALTH_CHECKS_MAX_AGE` seconds old: they are 7 ``stat``/
    ``access`` calls, each giving up the GIL, so under load running them on every probe cost
    a thread hand-off apiece (docs/benchmarks.md, request cost). A reloaded config is checked
    at once (the cache holds the config it checked)."""
    config, now, last = svc.config, time.monotonic(), _health_checked[0]
    if last is not None and last[0] is config and 0 <= now - last[1] < HEALTH_CHECKS_MAX_AGE:
        return dict(last[2])
    checks = health_checks(config)
    checks["sandbox"] = "unconfined (hermes.sandbox.mode auto found no usable sandbox)" \
        if svc.sandbox is not None and svc.sandbox.health() else None
    checks["disk"] = svc.disk.health() if svc.disk is not None else None
    checks["quota"] = "watched only (hermes.sandbox.quota auto found no quota the kernel " \
        "holds)" if svc.disk is not None and svc.disk.quota_warning() else None
    if svc.shared is not None:         # several nodes: the shared PostgreSQL
        checks["storage"] = svc.shared.health()
    _health_checked[0] = (config, now, checks)
    return dict(checks)


def _health(svc) -> tuple[dict, int]:
    """The answer of :func:`health` while the service is neither draining nor stopping."""
    checks = _checks(svc)
    failed = {k: v for k, v in checks.items() if v}
    if failed != _last_health[0]:
        _last_health[0] = failed
        if failed:
            log.warning("health: degraded: %s", "; ".join(describe(svc.config)))
        else:
            log.info("health: healthy")
    if failed:
        node_broken = any(k not in ("provider", "sandbox", "quota") for k in failed)
        return {"status": "degraded", "service": "hermes-service", "multi_user": True,
                "checks": {k: v or "ok" for k, v in checks.items()}}, 503 if node_broken else 200
    return {"status": "healthy", "service": "hermes-service", "multi_user": True}, 200


@bp.get("/api/v1/status")
@documented(summary="Hermes version", tags=("v1",),
            replies={200: Reply("the service runs", STATUS)},
            errors={429: ("too_many_runs",), 502: ("hermes_failed",),
                    503: ("hermes_unavailable", "hermes_unconfigured", "service_stopping")})
def status():
    """Spec §2: ``{"status": "running", "version": "<hermes --version first line>"}``."""
    svc = services()
    home = svc.homes.ensure_system()
    env = svc.homes.cli_env(home, svc.processes.command_path())
    return jsonify(status="running", version=svc.processes.version(env, home))


def new_session_id(node_id: str | None) -> str:
    """A new v1 session id: a UUID4, prefixed ``<service.node_id>.`` when the node has an id
    (a proxy in front of several nodes routes the session to its node; docs/scaling.md)."""
    return f"{node_id}.{uuid.uuid4()}" if node_id else str(uuid.uuid4())


@bp.post("/api/v1/sessions")
@documented(summary="Create a session", tags=("v1",), body=CREATE_SESSION,
            params=(IDEMPOTENCY_KEY,),
            replies={200: Reply("created", SESSION_CREATED)},
            errors=_merge({403: ("actor_mismatch",), 409: ("session_exists",),
                           503: ("hermes_unconfigured",)}, _IDEMPOTENCY_ERRORS),
            links={"GetSession": ("api_v1.get_session", _NEW_SESSION),
                   "SendMessage": ("api_v1.send_message", _NEW_SESSION),
                   "DeleteSession": ("api_v1.delete_session", _NEW_SESSION)})
@idempotent("v1", lambda: _requested_user("user_id"))
def create_session():
    """Spec §3. Creates the user's home on first use. ``initial_message`` is accepted, unused.

    With ``Idempotency-Key``, a retry gets the session the first request created (docs/v1-api.md
    §Idempotent retries)."""
    body = json_body()
    svc = services()
    user = _user(body["user_id"])
    assert user is not None                     # the body schema requires user_id
    rec = svc.conversations.create(user, new_session_id(svc.config.service.node_id), kind="v1")
    home = svc.homes.path(rec["user_id"])
    return jsonify(session_id=rec["session_id"], user_id=rec["user_id"],
                   hermes_path=str(home.hermes_home), status="created")


@bp.get("/api/v1/sessions")
@documented(summary="A user's sessions", tags=("v1",),
            params=(Param("user_id", "query", ID_SCHEMA, "the user", required=True),),
            replies={200: Reply("the user's v1 sessions, oldest first", SESSION_LIST)},
            errors={400: ("invalid_request", "invalid_id"), 403: ("actor_mismatch",)})
def list_sessions():
    """``?user_id=`` (required): ``{"user_id", "sessions": [<session>...]}``, oldest first."""
    user_id = request.args.get("user_id")
    if not user_id:
        raise BadRequest("query parameter user_id is required", code="invalid_request")
    recs = services().conversations.list(_user(user_id), kind="v1")
    return jsonify(user_id=user_id, sessions=[_public(r) for r in recs])


@bp.get("/api/v1/sessions/<session_id>")
@documented(summary="A session", tags=("v1",), params=(_SESSION_ID,),
            replies={200: Reply("the session", SESSION)},
            errors={400: ("invalid_id",), 404: ("session_not_found",)})
def get_session(session_id):
    """Spec §6: ``{user_id, local_session_id, created_at, status, ...}``; 404 if unknown."""
    return jsonify(_public(services().conversations.get(session_id, owner=_user(None), kind="v1")))


@bp.delete("/api/v1/sessions/<session_id>")
@documented(summary="Forget a session", tags=("v1",), params=(_SESSION_ID,),
            replies={200: Reply("deleted (the transcript stays in the user's state.db)",
                                SESSION_DELETED)},
            errors={400: ("invalid_id",), 404: ("session_not_found",), 409: ("session_busy",),
                    429: ("too_many_runs",)})
def delete_session(session_id):
    """Forget the session mapping (waits for a running turn). The Hermes transcript stays."""
    svc = services()
    with svc.admission(f"v1 delete of session {session_id}"):   # may wait for a running turn
        rec = svc.conversations.delete(session_id, owner=_user(None), kind="v1")
    return jsonify(session_id=rec["session_id"], status="deleted")


@bp.post("/api/v1/sessions/<session_id>/messages")
@documented(summary="Send a message (one Hermes turn)", tags=("v1",),
            params=(_SESSION_ID, IDEMPOTENCY_KEY), body=SEND_MESSAGE,
            replies={200: Reply("Hermes's answer", MESSAGE_REPLY)},
            errors=_merge({400: ("invalid_id", "invalid_request"), 403: ("actor_mismatch",),
                           404: ("session_not_found",), 413: ("message_too_large",)},
                          _TURN_ERRORS, _IDEMPOTENCY_ERRORS))
@idempotent("v1", lambda: _requested_user("user_context", "user_id"),
            wait=lambda: services().admission())
def send_message(session_id):
    """Spec §5: ``{"session_id", "response", "success": true}`` plus ``hermes_session_id``,
    ``resumed``, ``reasoning`` (the model's reasoning, or null; never part of ``response``),
    ``finish_reason`` (why the answer ended: ``length`` = cut at the provider's output limit;
    :data:`FINISH_REASON`) and, when an unknown Hermes session had to be replaced,
    ``notice``. ``response`` is the answer Hermes recorded for this turn (everything the model
    wrote in it, docs/v1-api.md).

    Errors: 400/404/409 ``session_busy``/413 ``message_too_large``/429/502 (incl.
    ``upstream_empty_answer``)/503/504.

    With ``Idempotency-Key`` (docs/v1-api.md §Idempotent retries): a retry gets the first answer
    (``Idempotency-Replayed: true``) and Hermes runs once; a retry while the first turn runs
    waits for it (holding an admission place, so 429 when none is free); 409
    ``idempotency_key_conflict`` for the same key with another message or session.
    """
    check_id(session_id, "session_id")
    body = json_body()
    ctx_user = (body.get("user_context") or {}).get("user_id")
    owner = _user(ctx_user)           # a bound key naming another user: 403 actor_mismatch
    svc = services()
    svc.conversations.get(session_id, owner=owner, kind="v1")   # 404 first
    svc.check_accepting()         # 503 service_draining: the service is stopping gracefully
    svc.require_provider()        # 503 hermes_unconfigured at once, no CLI run
    with svc.admission(f"v1 message on session {session_id}"):
        rec, result = svc.conversations.send(
            SendRequest(session_id, body["message"], owner=owner, kind="v1"))
    out = {"session_id": rec["session_id"], "response": result.answer, "success": True,
           "hermes_session_id": rec.get("hermes_session_id"), "resumed": result.resumed,
           "reasoning": result.reasoning, "finish_reason": result.finish_reason}
    if result.notice:
        out["notice"] = result.notice
    return jsonify(out)


def _allowed(argv: list[str], allowlist: tuple[tuple[str, ...], ...]) -> bool:
    for prefix in allowlist:
        if tuple(argv[:len(prefix)]) == prefix \
                and all(_SAFE_ARG.match(a) for a in argv[len(prefix):]):
            return True
    return False


@bp.post("/api/v1/execute")
@documented(summary="Run an allowed hermes command", tags=("v1",), body=EXECUTE_BODY,
            replies={200: Reply("the command ran (success false: it exited non-zero)",
                                EXECUTE_RESULT)},
            errors={403: ("command_not_allowed", "actor_mismatch"), 429: ("too_many_runs",),
                    502: ("hermes_failed",),
                    503: ("hermes_unavailable", "hermes_unconfigured", "service_draining",
                          "service_stopping"),
                    504: ("run_timeout",)})
def execute():
    """Spec §4, restricted: only argv matching ``hermes.execute.allowed`` runs (no shell).

    Response ``{"success", "stdout", "stderr", "returncode", "truncated"}`` (200 even when the
    command exits non-zero — that is the command's result). 403 ``command_not_allowed``;
    504 ``run_timeout``; ``timeout`` (seconds) at least :data:`MIN_EXECUTE_TIMEOUT` (400
    ``invalid_request`` naming the minimum) and capped at ``hermes.execute.timeout_seconds``.
    """
    body = json_body()
    svc = services()
    svc.check_accepting()         # 503 service_draining: the service is stopping gracefully
    ex = svc.config.hermes.execute
    argv = body["command"]
    if not _allowed(argv, ex.allowed):
        raise Forbidden(f"command not allowed: {' '.join(argv[:3])}", code="command_not_allowed")
    user_id = _user((body.get("user_context") or {}).get("user_id"))
    home = svc.homes.ensure(user_id) if user_id else svc.homes.ensure_system()
    env = svc.homes.cli_env(home, svc.processes.command_path())
    # capped before float(): a JSON integer may be too large for one (OverflowError)
    timeout = float(min(body.get("timeout") or ex.timeout_seconds, ex.timeout_seconds))
    with svc.admission(f"v1 execute {' '.join(argv[:2])}"), svc.processes.slot():
        outcome = svc.processes.spawn(argv, env, home, ex.max_output_bytes).wait(timeout)
    if outcome.killed == "timeout":
        raise classify_failure(outcome)
    return jsonify(success=outcome.returncode == 0, stdout=outcome.stdout, stderr=outcome.stderr,
                   returncode=outcome.returncode, truncated=outcome.truncated)

