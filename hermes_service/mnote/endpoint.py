"""``POST /api/hermes/tools/invoke``: where the mnote Hermes plugin sends tool calls (issue #4).

Authenticated by the run-scoped bearer token (not the API key) and reachable
only from loopback (the CLI runs on this machine) without proxy headers (a
request relayed by a same-host reverse proxy is refused). Body: the tool
contract's input envelope (§2); response: its output envelope (§3), HTTP 200
for every executed call (``ok`` tells success), 401 ``mnote_tool_unauthorized``
for a missing/unknown/expired token (403 with that code for a non-local caller), 403
``mnote_tool_permission_denied`` for an envelope naming another actor, session
or run, 400/413 ``mnote_tool_bad_request`` for a body that is not a JSON object
or is too large. Every answer, errors included, is an output envelope.
"""
from __future__ import annotations

from flask import Blueprint, jsonify, request

from .. import metrics
from ..web import parse_json, services
from ..errors import ServiceError
from .gateway import ToolRefused

PREFIX = "/api/hermes/tools"
bp = Blueprint("mnote_tools", __name__)

_CODES = {"ip_not_allowed": "mnote_tool_unauthorized", "payload_too_large": "mnote_tool_bad_request",
          "invalid_json": "mnote_tool_bad_request", "not_found": "mnote_tool_bad_request",
          "method_not_allowed": "mnote_tool_bad_request"}


def failure_envelope(code: str, message: str, body: dict | None = None) -> dict:
    """Contract §3 failure envelope, echoing what the caller sent."""
    body = body if isinstance(body, dict) else {}
    return {"ok": False, "toolName": body.get("toolName"), "toolCallId": body.get("toolCallId"),
            "traceId": body.get("traceId"), "result": None,
            "audit": {"effect": "none", "commandId": None, "workspaceId": body.get("workspaceId"),
                      "documentId": body.get("documentId")},
            "error": {"code": code, "message": message}}


def render_error_body(err: ServiceError) -> dict:
    """Errors under this prefix are output envelopes too (registered by :func:`..register`)."""
    return failure_envelope(_CODES.get(err.code, "mnote_tool_internal_error"), err.detail)


@bp.post(f"{PREFIX}/invoke")
def invoke():
    gateway = services().tools
    try:
        envelope = parse_json(request.get_data())
    except ServiceError:
        envelope = None
    tool = envelope.get("toolName") if isinstance(envelope, dict) else None
    try:
        out = gateway.invoke(request.headers.get("Authorization"), envelope)
        metrics.tool_call(tool, (out.get("error") or {}).get("code"))
        return jsonify(out)
    except ToolRefused as exc:
        metrics.tool_call(tool, exc.code)
        resp = jsonify(failure_envelope(exc.code, exc.message, envelope))
        resp.status_code = exc.status
        return resp
