"""Hermes plugin ``mnote``: the mnote tools and the page context of mnote runs.

Runs inside the Hermes CLI or ``hermes acp`` (standard library only). The tool definitions
are in ``tools.json`` next to this file, generated from hermes_service.mnote.tools (a test
keeps them in sync).

Everything a run binds (tool URL, run token, actor/workspace/document/session/run/trace
ids, capability scope, page context) is its run binding, which hermes-service hands to this
Hermes process and its import hook keeps in memory only — never in a file, where another
run's tool processes could read the token (``run_binding.binding(task_id)``, from the
service's ``hermes_site`` folder on the path; Hermes passes the ACP session id to hooks and
tools as ``task_id``; docs/mnote-tools.md §Run binding).

* Tools: each call builds the tool contract's input envelope from the run binding plus the
  model's arguments and POSTs it to the service with the run token; the service checks,
  executes and audits it. Hermes never writes the page store itself. The call goes
  straight to the service (never through HTTP_PROXY/HTTPS_PROXY: the token stays local).
* Page context (``pre_llm_call``): the run's page context is returned as hook context,
  which Hermes appends to the API copy of the current user message only — the stored
  message stays what the user typed. Earlier turns' page contexts are dropped from the
  request (Hermes would otherwise replay them from its ``api_content`` sidecar): a run's
  page context reaches the model on that run only.
"""
import hashlib
import json
import os
import urllib.error
import urllib.parse
import urllib.request
import uuid
from pathlib import Path

TIMEOUT_SECONDS = 60
#: First line of the page-context block (hermes-service writes the block; see mnote/client.py).
CONTEXT_HEAD = "[mnote page context for this message only"
# The tool URL is the service itself: never through HTTP_PROXY/HTTPS_PROXY (an admin sets
# those for the provider), which would carry the run token to the proxy.
_DIRECT = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def _run(task_id=None) -> dict:
    """The run's binding ({} when this is not an mnote run, or not a process of the
    service's)."""
    try:
        import run_binding  # hermes-service's hermes_site (PYTHONPATH)
    except ImportError:
        return {}
    return run_binding.binding(task_id)


def _reachable(url):
    """``url`` with its origin replaced by ``$HERMES_SERVICE_URL`` when the service sets one
    (a sandbox with a network of its own reaches the service on its own loopback port)."""
    origin = os.environ.get("HERMES_SERVICE_URL")
    if not url or not origin:
        return url
    parts = urllib.parse.urlsplit(url)
    return origin.rstrip("/") + urllib.parse.urlunsplit(("", "", parts.path, parts.query, ""))


def _tool_call_id():
    """Hermes's own id of the tool call being dispatched (so audit rows and events match the
    transcript); a fresh id if this Hermes version does not expose it."""
    try:
        from tools.approval import _approval_tool_call_id  # set around every dispatch (0.19.0)
        current = _approval_tool_call_id.get()
    except Exception:  # noqa: BLE001 - not exposed by this Hermes version
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


def _error(tool, call_id, code, message, envelope=None, trace_id=None):
    envelope = envelope or {}
    return json.dumps({"ok": False, "toolName": tool, "toolCallId": call_id,
                       "traceId": trace_id, "result": None,
                       "audit": {"effect": "none", "commandId": None,
                                 "workspaceId": envelope.get("workspaceId"),
                                 "documentId": envelope.get("documentId")},
                       "error": {"code": code, "message": message}}, ensure_ascii=False)


def _default_key(envelope) -> str:
    """The idempotency key of a write the model gave none: ``<runId>:<toolCallId>:<digest>``,
    the digest over the tool, page and arguments. Some providers reuse a tool call id within
    a turn (``call_0`` in every response); with the id alone, the run's second, different
    write under that id was refused as an idempotency conflict (and an identical one is still
    a replay, as a retry of the same call would be)."""
    what = [envelope["toolName"], envelope["workspaceId"], envelope["documentId"],
            envelope.get("dryRun"), envelope["args"]]
    digest = hashlib.sha256(json.dumps(what, sort_keys=True, ensure_ascii=False)
                            .encode("utf-8", "surrogatepass")).hexdigest()[:16]
    key = f"{envelope['runId']}:{envelope['toolCallId']}:{digest}"
    if len(key) > 256:        # the envelope's limit (a provider's very long call id)
        hashed = hashlib.sha256(key.encode("utf-8", "surrogatepass")).hexdigest()
        key = f"{envelope['runId']}:{hashed}"
    return key


def _handler(definition):
    tool = definition["contractName"]
    writes = "dryRun" in definition["parameters"]["properties"]

    def handle(args, task_id=None, **_kw):
        call_id = _tool_call_id()
        run = _run(task_id)
        url, token = _reachable(run.get("toolUrl")), run.get("runToken")
        if not url or not token:
            return _error(tool, call_id, "mnote_tool_unavailable",
                          "mnote tools are only available in runs started by mnote")
        args = dict(args or {})
        envelope = {
            "toolName": tool,
            "workspaceId": args.pop("workspaceId", None) or run.get("workspaceId"),
            "documentId": args.pop("documentId", None) or run.get("documentId"),
            "actorId": run.get("actorId"),
            "sessionId": run.get("sessionId"),
            "runId": run.get("runId"),
            "toolCallId": call_id,
            "traceId": run.get("traceId"),
            "capabilityScope": list(run.get("capabilityScope") or []),
        }
        dry_run, key = args.pop("dryRun", False), args.pop("idempotencyKey", None)
        envelope["args"] = args
        if writes:
            # as given (null: absent): the service refuses a non-boolean, never guesses one
            envelope["dryRun"] = False if dry_run is None else dry_run
            envelope["idempotencyKey"] = key or _default_key(envelope)
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
                return _error(tool, call_id, "mnote_tool_unavailable",
                              f"service answered {exc.code}", envelope, run.get("traceId"))
        except (urllib.error.URLError, OSError) as exc:
            return _error(tool, call_id, "mnote_tool_unavailable", f"service unreachable: {exc}",
                          envelope, run.get("traceId"))

    return handle


def _page_context(task_id=None, conversation_history=None, **_kw):
    """``pre_llm_call``: this run's page context, for the API copy of this turn's message."""
    for message in conversation_history or []:
        sidecar = message.get("api_content") if isinstance(message, dict) else None
        if message.get("role") == "user" and isinstance(sidecar, str) and CONTEXT_HEAD in sidecar:
            message.pop("api_content", None)     # an earlier run's context: not re-sent
    context = _run(task_id).get("pageContext")
    return {"context": context} if isinstance(context, str) and context else None


def register(ctx):
    definitions = json.loads((Path(__file__).with_name("tools.json")).read_text("utf-8"))
    for d in definitions:
        ctx.register_tool(name=d["name"], toolset=d["toolset"],
                          schema={"name": d["name"], "description": d["description"],
                                  "parameters": d["parameters"]},
                          handler=_handler(d), description=d["description"])
    ctx.register_hook("pre_llm_call", _page_context)
