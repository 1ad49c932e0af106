"""``POST /api/hermes/tools/invoke``: where the mnote Hermes plugin sends tool calls (issue #4).

Authenticated by the run-scoped bearer token (not the API key) and reachable
only from loopback (the CLI runs on this machine) without proxy headers (a
request relayed by a same-host reverse proxy is refused). Body: the tool contract's
input envelope (§2); response: its output envelope (§3), HTTP 200 for every
executed call (``ok`` tells success), 401 ``mnote_tool_unauthorized`` for a
missing/unknown/expired token, 403 ``mnote_tool_permission_denied`` for an
envelope naming another actor, session or run.
"""
from __future__ import annotations

from flask import Blueprint, jsonify, request

from .app import parse_json, services
from .errors import ServiceError
from .tool_gateway import ToolRefused

bp = Blueprint("mnote_tools", __name__)


@bp.post("/api/hermes/tools/invoke")
def invoke():
    gateway = services().tools
    try:
        envelope = parse_json(request.get_data())
    except ServiceError:
        envelope = None
    try:
        return jsonify(gateway.invoke(request.headers.get("Authorization"), envelope))
    except ToolRefused as exc:
        body = envelope if isinstance(envelope, dict) else {}
        resp = jsonify({"ok": False, "toolName": body.get("toolName"),
                        "toolCallId": body.get("toolCallId"), "traceId": body.get("traceId"),
                        "result": None, "audit": {"effect": "none", "commandId": None,
                                                  "workspaceId": body.get("workspaceId"),
                                                  "documentId": body.get("documentId")},
                        "error": {"code": exc.code, "message": exc.message}})
        resp.status_code = exc.status
        return resp
