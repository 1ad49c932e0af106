"""Hermes plugin ``mnote``: the six mnote tools, forwarded to hermes-service.

Runs inside the Hermes CLI (standard library only). The tool definitions are in
``tools.json`` next to this file, generated from hermes_service.mnote.tools
(a test keeps them in sync). Each call builds the tool contract's input
envelope from the run's environment (set by hermes-service for this run only:
MNOTE_TOOL_URL, MNOTE_RUN_TOKEN, MNOTE_* ids) plus the model's arguments, and
POSTs it to the service with the run token; the service checks, executes and
audits it. Hermes never writes the page store itself.
"""
import json
import os
import urllib.error
import urllib.request
import uuid
from pathlib import Path

_ENVELOPE_KEYS = ("workspaceId", "documentId", "dryRun", "idempotencyKey")
TIMEOUT_SECONDS = 60
# The tool URL is the service itself: never through HTTP_PROXY/HTTPS_PROXY (an admin sets
# those for the provider), which would carry the run token to the proxy.
_DIRECT = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def _tool_call_id():
    """Hermes's own id of the tool call being dispatched (so audit rows and events match the
    transcript); a fresh id if this Hermes version does not expose it."""
    try:
        from tools.approval import _approval_tool_call_id   # set around every dispatch (0.19.0)
        current = _approval_tool_call_id.get()
    except Exception:
        current = ""
    return current or "call_" + uuid.uuid4().hex[:16]


def _for_hermes(body: str) -> str:
    """The result text Hermes sees. Hermes 0.19.0 counts a tool result whose text mentions
    "error" as a failure (and warns the model to stop looping), so a success envelope is
    handed over without its ``"error": null``."""
    try:
        data = json.loads(body)
    except ValueError:
        return body
    if isinstance(data, dict) and data.get("ok") is True and data.get("error") is None:
        data.pop("error", None)
        return json.dumps(data, ensure_ascii=False)
    return body


def _error(tool, call_id, code, message, envelope=None):
    envelope = envelope or {}
    return json.dumps({"ok": False, "toolName": tool, "toolCallId": call_id,
                       "traceId": os.environ.get("MNOTE_TRACE_ID"), "result": None,
                       "audit": {"effect": "none", "commandId": None,
                                 "workspaceId": envelope.get("workspaceId"),
                                 "documentId": envelope.get("documentId")},
                       "error": {"code": code, "message": message}}, ensure_ascii=False)


def _handler(definition):
    tool = definition["contractName"]
    writes = "dryRun" in definition["parameters"]["properties"]

    def handle(args, **_kw):
        call_id = _tool_call_id()
        url, token = os.environ.get("MNOTE_TOOL_URL"), os.environ.get("MNOTE_RUN_TOKEN")
        if not url or not token:
            return _error(tool, call_id, "mnote_tool_unavailable",
                          "mnote tools are only available in runs started by mnote")
        args = dict(args or {})
        envelope = {
            "toolName": tool,
            "workspaceId": args.pop("workspaceId", None) or os.environ.get("MNOTE_WORKSPACE_ID"),
            "documentId": args.pop("documentId", None) or os.environ.get("MNOTE_DOCUMENT_ID"),
            "actorId": os.environ.get("MNOTE_ACTOR_ID"),
            "sessionId": os.environ.get("MNOTE_SESSION_ID"),
            "runId": os.environ.get("MNOTE_RUN_ID"),
            "toolCallId": call_id,
            "traceId": os.environ.get("MNOTE_TRACE_ID"),
            "capabilityScope": [s for s in os.environ.get("MNOTE_CAPABILITY_SCOPE", "").split(",") if s],
        }
        dry_run, key = args.pop("dryRun", False), args.pop("idempotencyKey", None)
        if writes:
            envelope["dryRun"] = bool(dry_run)
            envelope["idempotencyKey"] = key or f"{envelope['runId']}:{call_id}"
        envelope["args"] = args
        request = urllib.request.Request(
            url, data=json.dumps(envelope).encode(), method="POST",
            headers={"Content-Type": "application/json", "Authorization": f"Bearer {token}"})
        try:
            with _DIRECT.open(request, timeout=TIMEOUT_SECONDS) as resp:
                return _for_hermes(resp.read().decode("utf-8"))
        except urllib.error.HTTPError as exc:
            body = exc.read().decode("utf-8", "replace")
            try:
                json.loads(body)
                return body
            except ValueError:
                return _error(tool, call_id, "mnote_tool_unavailable", f"service answered {exc.code}",
                              envelope)
        except (urllib.error.URLError, OSError) as exc:
            return _error(tool, call_id, "mnote_tool_unavailable", f"service unreachable: {exc}",
                          envelope)

    return handle


def register(ctx):
    definitions = json.loads((Path(__file__).with_name("tools.json")).read_text("utf-8"))
    for d in definitions:
        ctx.register_tool(name=d["name"], toolset=d["toolset"],
                          schema={"name": d["name"], "description": d["description"],
                                  "parameters": d["parameters"]},
                          handler=_handler(d), description=d["description"])
