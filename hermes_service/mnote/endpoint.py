"""``POST /api/hermes/tools/invoke``: where the mnote Hermes plugin sends tool calls (tool contract
§1-§5).

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

from ..errors import ServiceError
from ..web.helpers import Reply, documented, parse_json, services
from ..web.routing import RUN_TOKEN, ErrorFamily, RouteFamily, declare
from . import metrics
from .gateway import ToolRefused
from .objects import mnote_of
from .schemas import ENVELOPE_SCHEMA, OUTPUT_ENVELOPE_SCHEMA
from .tools import echo_fields

PREFIX = "/api/hermes/tools"

_CODES = {"ip_not_allowed": "mnote_tool_unauthorized",
          "payload_too_large": "mnote_tool_bad_request",
          "invalid_json": "mnote_tool_bad_request", "not_found": "mnote_tool_bad_request",
          "method_not_allowed": "mnote_tool_bad_request",
          "bad_request_framing": "mnote_tool_bad_request"}


def failure_envelope(code: str, message: str, body: dict | None = None) -> dict:
    """Contract §3 failure envelope, echoing what the caller sent the way the executor does
    (:func:`~.tools.echo_fields`: strings of at most 256 characters, else null)."""
    echo = echo_fields(body)
    return {"ok": False, "toolName": echo["toolName"], "toolCallId": echo["toolCallId"],
            "traceId": echo["traceId"], "result": None,
            "audit": {"effect": "none", "commandId": None, "workspaceId": echo["workspaceId"],
                      "documentId": echo["documentId"]},
            "error": {"code": code, "message": message}}


def tool_code(code: str) -> str:
    """The envelope code for a core error code raised before a call reached the gateway (an
    envelope code stays as it is)."""
    if code.startswith("mnote_tool_"):
        return code
    return _CODES.get(code, "mnote_tool_internal_error")


def render_error_body(err: ServiceError) -> dict:
    """Errors of the tool family are output envelopes too (:data:`TOOLS`)."""
    return failure_envelope(tool_code(err.code), err.detail)


def _schema(schema: dict) -> dict:
    """A contract schema as an OpenAPI 3.1 schema object (its ``$schema`` names the dialect the
    document already uses)."""
    return {k: v for k, v in schema.items() if k != "$schema"}


_OUT = OUTPUT_ENVELOPE_SCHEMA["properties"]
#: an answer that is not an executed call (HTTP 4xx/5xx, :func:`failure_envelope`): the §3
#: output envelope's failure branch (``ok`` false, ``error`` set, ``result`` null, ``audit``
#: effect none) as one plain object, so that client generators can add each status's codes to
#: it (the whole envelope's nullable ``error`` they cannot merge)
FAILURE_ENVELOPE = {
    "type": "object", "required": OUTPUT_ENVELOPE_SCHEMA["required"],
    "additionalProperties": False,
    "properties": {
        **_OUT, "ok": {"const": False}, "result": {"type": "null"},
        "audit": {**_OUT["audit"], "properties": {
            **_OUT["audit"]["properties"], "effect": {"const": "none"},
            "commandId": {"type": "null"}}},
        "error": next(s for s in _OUT["error"]["oneOf"] if s.get("type") == "object")}}
#: every answer of the endpoint, errors included, is a contract §3 output envelope: an error
#: is a ``ToolFailure``, an executed call (200) a ``ToolEnvelope``
ERRORS = ErrorFamily("ToolFailure", FAILURE_ENVELOPE, tool_code,
                     "tool contract §3 output envelope of a call that was not executed",
                     code_path=("error", "code"), render=render_error_body)
#: the tool endpoint: loopback peers without proxy headers, a run token instead of an API key
#: (checked by the route: the gateway); errors are output envelopes too
TOOLS = RouteFamily("tools", (PREFIX + "/",), ERRORS, auth=RUN_TOKEN)
bp = declare(Blueprint("mnote_tools", __name__), TOOLS)
#: the document's components besides the family's (the extension registers them)
COMPONENTS = {"ToolEnvelope": {**_schema(OUTPUT_ENVELOPE_SCHEMA),
                               "description": "tool contract §3 output envelope"}}
#: failure codes of an executed call (HTTP 200, ``ok: false``; tools.py, page_store.py, and
#: with mnote's kernel as the page store kernel_wire.py — a kernel may answer codes of its own)
CALL_FAILURES = ("mnote_tool_bad_request", "mnote_tool_unknown_tool",
                 "mnote_tool_permission_denied", "mnote_tool_conflict",
                 "mnote_tool_idempotency_conflict", "mnote_tool_unsupported_option",
                 "mnote_tool_internal_error", "mnote_tool_kernel_unavailable",
                 "mnote_tool_limit_exceeded")


@bp.post(f"{PREFIX}/invoke")
@documented(summary="Invoke an mnote tool (the Hermes plugin, loopback only)",
            tags=("tools",), body=_schema(ENVELOPE_SCHEMA),
            replies={200: Reply("the call was executed: ok true, or ok false with the reason",
                                {"allOf": [{"$ref": "#/components/schemas/ToolEnvelope"},
                                           {"properties": {"error": {"oneOf": [
                                               {"type": "null"},
                                               {"type": "object", "properties": {
                                                   "code": {"enum": list(CALL_FAILURES)}}}]}}}]})},
            errors={400: ("mnote_tool_bad_request",),
                    401: ("mnote_tool_unauthorized",),
                    403: ("mnote_tool_unauthorized", "mnote_tool_permission_denied")})
def invoke():
    """Contract §2 input envelope in (§4's flat form, tool fields beside the envelope's, is
    accepted too: ``tools._unflatten``), §3 output envelope out. The run token (``Authorization:
    Bearer``) is the run's, from its run binding; only loopback peers without proxy headers
    (else 403 ``mnote_tool_unauthorized``). An envelope naming another actor, session or run
    is 403 ``mnote_tool_permission_denied``; anything the executor refuses (schema, unknown
    tool, permissions, conflicts) is HTTP 200 with ``ok: false`` (docs/mnote-tools.md)."""
    gateway = mnote_of(services()).tools
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
