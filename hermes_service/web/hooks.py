"""Request hooks, one job each (docs/architecture.md, docs/configuring.md):

1. :func:`assign_request_id` — ``g.request_id`` (a safe incoming ``X-Request-Id`` or a new one),
   which also starts the log context (request id, route template; :mod:`hermes_service.logs`);
2. :func:`resolve_client` — ``g.client_ip`` (TCP peer, or the X-Forwarded-For hop of a
   trusted proxy, see :meth:`~hermes_service.security.Guard.client_ip`);
3. :func:`authenticate` — what the request's route family
   (:func:`hermes_service.web.routing.current`) asks: IP allowlist, API key (``g.api_key``) and
   the family's key scope; a run-token family (the tool endpoint, which checks its token
   itself) admits loopback peers without proxy headers only; an open-unless-configured family
   (``/health``, the API description) needs a key only when its ``security.*`` flag says so;
4. :func:`access_log` — one line per request (client, method, path; request id, trace id, run
   id, route template, status, duration) and the request's metrics
   (:func:`hermes_service.metrics.http_request`).
"""
from __future__ import annotations

import ipaddress
import logging
import re
import time
from urllib.parse import quote

from flask import Flask, g, request

from .. import logs, metrics
from ..errors import ID_PATTERN, Forbidden
from . import routing, tokens
from .helpers import services

access_logger = logging.getLogger("hermes_service.access")
_REQ_ID = re.compile(r"^[A-Za-z0-9_.:-]{1,64}$")
_ID = re.compile(ID_PATTERN)
# the access line's path: percent-encoded except these; a path of only these (and letters,
# digits) is logged as it is, as quote() would leave it
_PATH_SAFE = "/@:+,;=-._~!$&'()*"
_PLAIN_PATH = re.compile(r"[A-Za-z0-9/@:+,;=\-._~!$&'()*]*")

# headers a (same-host) reverse proxy adds: a run-token family refuses requests carrying any
PROXY_HEADERS = ("X-Forwarded-For", "X-Real-IP", "Forwarded", "X-Forwarded-Host")


def is_loopback(addr: str | None) -> bool:
    """True for 127.0.0.0/8 and ::1 (a scope id like ``%lo`` is ignored)."""
    try:
        return ipaddress.ip_address((addr or "").split("%")[0]).is_loopback
    except ValueError:
        return False


def assign_request_id() -> None:
    ctx = g._get_current_object()
    req = request._get_current_object()  # type: ignore[attr-defined]
    ctx.start = time.perf_counter()
    incoming = req.headers.get("X-Request-Id", "")
    ctx.request_id = incoming if _REQ_ID.fullmatch(incoming) else "req_" + tokens.hex16()
    logs.start(request_id=ctx.request_id,
               route=route_template(req))


def route_template(req) -> str | None:
    """The rule ``req`` matched (e.g. ``/api/v1/sessions/<session_id>``), None before routing
    matched anything; never the raw path (metrics labels, logs)."""
    return req.url_rule.rule if req.url_rule is not None else None


def resolve_client() -> None:
    req = request._get_current_object()  # type: ignore[attr-defined]
    g.client_ip = services().guard.client_ip(req.remote_addr, req.headers.get("X-Forwarded-For"))


def authenticate() -> None:
    """Raise Forbidden (``ip_not_allowed``, ``insufficient_scope``) or Unauthorized (key
    codes) unless the request may pass; sets ``g.api_key`` (None when keys are disabled or not
    needed)."""
    svc, ctx = services(), g._get_current_object()
    req = request._get_current_object()  # type: ignore[attr-defined]
    ctx.api_key = None
    family = routing.current()
    if family is not None and family.auth == routing.RUN_TOKEN:
        # tool calls come from the local CLI with a run token: loopback peers only, and
        # never through a (same-host) reverse proxy, whose requests also come from loopback
        proxied = any(h in req.headers for h in PROXY_HEADERS)
        if proxied or not is_loopback(req.remote_addr):
            raise Forbidden("tool calls are accepted from the local CLI only",
                            code="ip_not_allowed")
        return
    svc.guard.check_ip(ctx.client_ip)
    if req.method == "OPTIONS" and svc.config.cors.allow_origins:
        return    # CORS preflight carries no credentials
    if family is not None and not family.needs_key(svc.config.security):
        return
    ctx.api_key = key = svc.guard.check_key(req.headers,
                                            bearer=family is not None and family.bearer)
    scope = family.scope if family is not None else None
    if key is not None and scope and scope not in key.scopes:
        raise Forbidden(f"this API key is not granted the '{scope}' scope (security.api_keys[]."
                        "scopes)", code="insufficient_scope")


def access_log(resp):
    # one lookup each
    ctx = g._get_current_object()
    req = request._get_current_object()  # type: ignore[attr-defined]
    request_id = ctx.get("request_id")
    resp.headers["X-Request-Id"] = request_id if request_id is not None else ""
    started = ctx.get("start")
    seconds = time.perf_counter() - started if started else 0.0
    route = route_template(req)
    run_id = logs.field("run_id") or (req.view_args or {}).get("run_id")
    path, method, client_ip, status = req.path, req.method, ctx.get("client_ip"), resp.status_code
    access_logger.info("%s %s %s", client_ip, method,
                       path if _PLAIN_PATH.fullmatch(path) else quote(path, safe=_PATH_SAFE),
                       extra={"request_id": request_id, "trace_id": ctx.get("trace_id"),
                              "run_id": run_id if isinstance(run_id, str) and _ID.fullmatch(run_id)
                              else None,
                              "route": route, "status": status,
                              "duration_ms": round(seconds * 1000, 1),
                              "method": method, "client_ip": client_ip})
    metrics.http_request(route, method, status, seconds)
    return resp


def install(app: Flask) -> None:
    """Register the hooks on ``app`` in order."""
    app.before_request(assign_request_id)
    app.before_request(resolve_client)
    app.before_request(authenticate)
    app.after_request(access_log)
