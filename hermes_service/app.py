"""Flask app factory: wires the service objects, auth, request ids, access log and errors.

Data flows one way: blueprint → service objects (``Services``) → runner/store.
"""
from __future__ import annotations

import ipaddress
import json
import logging
import math
import re
import secrets
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING
from urllib.parse import quote

import jsonschema
from flask import Flask, current_app, g, jsonify, request
from werkzeug.exceptions import HTTPException

from .config import Config
from .conversations import Conversations
from .errors import BadRequest, Forbidden, ServiceError, TooLarge, TooManyRuns
from .runner import HermesRunner
from .security import Guard
from .session_store import SessionStore
from .user_homes import UserHomes

if TYPE_CHECKING:
    from .runs import RunManager
    from .tool_gateway import ToolGateway

access_log = logging.getLogger("hermes_service.access")
log = logging.getLogger("hermes_service")
_REQ_ID = re.compile(r"^[A-Za-z0-9_.:-]{1,64}$")

# Paths that authenticate themselves (a run-scoped token) instead of an API key.
SELF_AUTH_PREFIXES = ("/api/hermes/tools/",)
PROXY_HEADERS = ("X-Forwarded-For", "X-Real-IP", "Forwarded", "X-Forwarded-Host")


@dataclass
class Services:
    """The service objects shared by the blueprints (one set per app)."""
    config: Config
    guard: Guard
    store: SessionStore
    homes: UserHomes
    runner: HermesRunner
    conversations: Conversations
    runs: "RunManager | None" = None       # background runs + events (mnote client)
    tools: "ToolGateway | None" = None     # run tokens + tool calls (mnote tools)
    _admitted: threading.BoundedSemaphore | None = None

    @contextmanager
    def admission(self):
        """Hold one of the ``max_concurrent_runs + max_waiting_requests`` places for a
        synchronous v1 turn (running or waiting), so waiting requests can never take every
        waitress thread. Raises TooManyRuns (429) when none is free."""
        if not self._admitted.acquire(blocking=False):
            raise TooManyRuns("too many requests are waiting for Hermes; retry later",
                              headers={"Retry-After": "5"})
        try:
            yield
        finally:
            self._admitted.release()


def _is_loopback(addr: str | None) -> bool:
    try:
        return ipaddress.ip_address((addr or "").split("%")[0]).is_loopback
    except ValueError:
        return False


def services() -> Services:
    return current_app.extensions["hermes_service"]


def _no_constant(name):
    raise ValueError(f"{name} is not valid JSON")


def _finite(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):        # e.g. 1e400
        raise ValueError(f"{text} is out of range")
    return value


def parse_json(raw: bytes):
    """Strict JSON: UTF-8, no NaN/Infinity (literal or overflowing), no lone surrogates,
    bounded nesting.

    Raises BadRequest ``invalid_json``.
    """
    try:
        data = json.loads(raw.decode("utf-8"), parse_constant=_no_constant, parse_float=_finite)
        json.dumps(data, ensure_ascii=False).encode("utf-8")   # rejects lone surrogates
    except (ValueError, RecursionError, UnicodeError):
        raise BadRequest("the request body is not valid JSON (UTF-8, no NaN, no lone "
                         "surrogates)", code="invalid_json") from None
    return data


def json_body(schema: dict | None = None) -> dict:
    """The request's JSON object, validated with ``schema`` (jsonschema).

    Raises BadRequest ``invalid_json`` (not strict JSON / not an object) or
    ``invalid_request`` naming the offending field.
    """
    data = parse_json(request.get_data()) if request.content_length or request.data else None
    if not isinstance(data, dict):
        raise BadRequest("the request body must be a JSON object", code="invalid_json")
    if schema:
        err = jsonschema.exceptions.best_match(
            jsonschema.Draft202012Validator(schema).iter_errors(data))
        if err is not None:
            where = "/".join(str(p) for p in err.absolute_path)
            message = err.message if len(err.message) <= 300 else err.message[:300] + "…"
            raise BadRequest(f"{where}: {message}" if where else message, code="invalid_request")
    return data


def _v1_error(err: ServiceError):
    body = {"detail": err.detail, "code": err.code, "requestId": g.get("request_id"), **err.extra}
    return body


# Blueprints may register a renderer for their own error shape, by URL prefix.
ERROR_RENDERERS: list[tuple[str, callable]] = []


def render_error(err: ServiceError):
    renderer = _v1_error
    for prefix, fn in ERROR_RENDERERS:
        if request.path.startswith(prefix):
            renderer = fn
    resp = jsonify(renderer(err))
    resp.status_code = err.status
    for k, v in err.headers.items():
        resp.headers[k] = v
    return resp


def create_app(config: Config, service_url: str | None = None) -> Flask:
    """Build the WSGI app for ``config``.

    ``service_url`` is where the Hermes CLI reaches this service for tool calls
    (default ``mnote.service_url`` or ``http://127.0.0.1:<service.port>``).

    Raises :class:`~hermes_service.session_store.CorruptStore` if
    ``sessions.json`` is unreadable (the service must not start).
    """
    app = Flask(__name__)
    app.config["MAX_CONTENT_LENGTH"] = config["service"]["max_body_bytes"]
    app.json.ensure_ascii = False
    app.json.sort_keys = False
    config.data_dir.mkdir(parents=True, exist_ok=True)
    store = SessionStore(config.data_dir / "sessions.json")
    homes = UserHomes(config)
    runner = HermesRunner(config["hermes"], pid_dir=config.data_dir / "pids")
    reaped = runner.reap_orphans()
    if reaped:
        log.warning("killed %d Hermes CLI process group(s) left by a service that died", reaped)
    svc = Services(config, Guard(config), store, homes, runner,
                   Conversations(config, store, homes, runner))
    svc._admitted = threading.BoundedSemaphore(config["hermes"]["max_concurrent_runs"]
                                               + config["hermes"]["max_waiting_requests"])
    app.extensions["hermes_service"] = svc

    cors = config["cors"]
    if cors["allow_origins"]:
        from flask_cors import CORS
        CORS(app, origins=cors["allow_origins"], supports_credentials=cors["allow_credentials"],
             methods=cors["allow_methods"], allow_headers=cors["allow_headers"],
             expose_headers=["X-Request-Id", "Retry-After"])

    health_needs_key = config["security"]["health_requires_api_key"]

    @app.before_request
    def authenticate():
        g.start = time.perf_counter()
        incoming = request.headers.get("X-Request-Id", "")
        g.request_id = incoming if _REQ_ID.match(incoming) else "req_" + secrets.token_hex(8)
        g.client_ip = svc.guard.client_ip(request.remote_addr,
                                          request.headers.get("X-Forwarded-For"))
        if request.path.startswith(SELF_AUTH_PREFIXES):
            # tool calls come from the local CLI with a run token: loopback peers only, and
            # never through a (same-host) reverse proxy, whose requests also come from loopback
            proxied = any(h in request.headers for h in PROXY_HEADERS)
            if proxied or not _is_loopback(request.remote_addr):
                raise Forbidden("tool calls are accepted from the local CLI only",
                                code="ip_not_allowed")
            return None
        svc.guard.check_ip(g.client_ip)
        if request.method == "OPTIONS" and cors["allow_origins"]:
            return None    # CORS preflight carries no credentials
        if request.path == "/health" and not health_needs_key:
            return None
        g.api_key = svc.guard.check_key(request.headers)
        return None

    @app.after_request
    def access(resp):
        resp.headers["X-Request-Id"] = g.get("request_id", "")
        started = g.get("start")
        access_log.info("rid=%s ip=%s %s %s %s %.1fms", g.get("request_id"), g.get("client_ip"),
                        request.method, quote(request.path, safe="/@:+,;=-._~!$&'()*"),
                        resp.status_code,
                        (time.perf_counter() - started) * 1000 if started else 0.0)
        return resp

    @app.errorhandler(ServiceError)
    def on_service_error(err):
        return render_error(err)

    @app.errorhandler(HTTPException)
    def on_http_error(err):
        if err.code == 413:
            return render_error(TooLarge(f"request body exceeds {app.config['MAX_CONTENT_LENGTH']} "
                                         "bytes", code="payload_too_large"))
        codes = {404: "not_found", 405: "method_not_allowed", 400: "invalid_request"}
        return render_error(ServiceError(err.description or err.name,
                                         code=codes.get(err.code, "http_error"), status=err.code))

    @app.errorhandler(Exception)
    def on_unexpected(err):
        log.exception("unhandled error rid=%s", g.get("request_id"))
        return render_error(ServiceError("internal error", code="internal_error"))

    from .runs import RunManager
    from .mnote_client import bp as mnote_client, client_code, legacy_bp
    hermes = config["hermes"]
    svc.runs = RunManager(config["mnote"]["events_retention_seconds"],
                          max_active=hermes["max_concurrent_runs"] * 4, code_for=client_code,
                          max_streams=config["mnote"]["max_event_streams"])
    from .page_store import SQLitePageStore
    from .tool_gateway import ToolGateway
    url = service_url or config["mnote"]["service_url"] or \
        f"http://127.0.0.1:{config['service']['port']}"
    svc.tools = ToolGateway(SQLitePageStore(config.data_dir / "mnote.db"), url)
    from .api_v1 import bp as v1
    from .tool_endpoint import bp as tool_endpoint
    app.register_blueprint(v1)
    app.register_blueprint(mnote_client)
    app.register_blueprint(legacy_bp)
    app.register_blueprint(tool_endpoint)
    return app
