"""The panel's review of the agent's suggestions (``mnote.block.propose``) on the client
routes (docs/mnote-client.md §Suggestions; an addition to client-proxy contract v1):

* ``GET /suggestions?workspaceId=&documentId=`` — the page's open suggestions, newest first;
* ``POST /suggestions/{id}/accept`` — applied as ``baseRevision`` would, or 409
  ``hermes_client_page_conflict`` whose message names the blocks that changed;
* ``POST /suggestions/{id}/reject``.

Each is one call of a panel tool (``mnote.suggestion.list`` / ``accept`` / ``reject``,
docs/mnote-tools.md §Suggestions) through the tool executor, so the page store decides —
the embedded one or mnote's kernel — with the panel's user (``X-Mnote-Actor-Id``) as the
envelope's actor. Auth and error shapes are the other client routes'.
"""
from __future__ import annotations

from flask import request

from ..errors import ID_SCHEMA, BadRequest, ServiceError, check_id
from ..web import tokens
from ..web.helpers import Param, Reply, documented, json_body, services
from .client import actor_id, bp, idempotent_client, ok, trace_id
from .client_schemas import (
    COMMON,
    IDEMPOTENCY_KEY,
    IDEMPOTENT,
    PARAMS,
    SUGGESTION_ANSWER,
    SUGGESTION_DECIDED,
    SUGGESTION_LIST,
)
from .objects import mnote_of

#: what the panel's envelopes carry where a run's carry its ids
PANEL_RUN = "panel"
PANEL_SCOPE = ["page.read", "page.write"]
#: a panel tool's failure code → (core code, HTTP status); any other code (a kernel's own,
#: an internal error) is 503 ``kernel_unavailable``
FAILURES = {
    "mnote_tool_permission_denied": ("page_forbidden", 403),
    "mnote_tool_not_found": ("suggestion_not_found", 404),
    "mnote_tool_suggestion_closed": ("suggestion_closed", 409),
    "mnote_tool_conflict": ("page_conflict", 409),
    "mnote_tool_bad_request": ("invalid_request", 400),
}
_ERRORS = {**COMMON, 400: ("invalid_id", "invalid_request"), 403: ("page_forbidden",),
           503: ("kernel_unavailable",)}


def panel_call(tool: str, workspace_id: str, document_id: str, args: dict) -> dict:
    """Run the panel tool ``tool`` for the acting user on the page; its ``result``, or the
    ServiceError of :data:`FAILURES`."""
    call_id = "panel_" + tokens.hex16()
    out = mnote_of(services()).tools.executor.invoke({
        "toolName": tool, "workspaceId": workspace_id, "documentId": document_id,
        "actorId": actor_id(), "sessionId": PANEL_RUN, "runId": PANEL_RUN,
        "toolCallId": call_id, "traceId": trace_id(), "idempotencyKey": call_id,
        "dryRun": False, "capabilityScope": PANEL_SCOPE, "args": args})
    if out.get("ok"):
        return out["result"]
    error = out.get("error") or {}
    code, status = FAILURES.get(str(error.get("code")), ("kernel_unavailable", 503))
    raise ServiceError(str(error.get("message") or "the page store gave no answer"),
                       code=code, status=status)


def _page(values) -> tuple[str, str]:
    ws, doc = values.get("workspaceId"), values.get("documentId")
    if ws is None or doc is None:
        raise BadRequest("workspaceId and documentId are required", code="invalid_request")
    return check_id(ws, "workspaceId"), check_id(doc, "documentId")


@bp.get("/suggestions")
@documented(summary="The open suggestions of a page", tags=("client",),
            params=(*PARAMS,
                    Param("workspaceId", "query", ID_SCHEMA, "the page's workspace",
                          required=True),
                    Param("documentId", "query", ID_SCHEMA, "the page", required=True)),
            replies={200: Reply("open suggestions, newest first", SUGGESTION_LIST)},
            errors=_ERRORS,
            links={verb.capitalize(): (f"mnote_client.{verb}", {
                "suggestion_id": "$response.body#/suggestions/0/suggestionId"})
                for verb in ("accept", "reject")})
def list_suggestions():
    """The page's open suggestions (any member of its workspace), newest first."""
    ws, doc = _page(request.args)
    found = panel_call("mnote.suggestion.list", ws, doc, {}).get("suggestions")
    if not (isinstance(found, list) and all(isinstance(s, dict) for s in found)):
        # a kernel's answer is checked as an envelope, not per tool: this one is not a list
        raise ServiceError("the page store's list of suggestions is not a list of objects",
                           code="kernel_unavailable", status=503)
    return ok(suggestions=found)


def _decide(suggestion_id: str, verb: str):
    check_id(suggestion_id, "suggestionId")
    ws, doc = _page(json_body())
    done = panel_call(f"mnote.suggestion.{verb}", ws, doc, {"suggestionId": suggestion_id})
    return ok(**{k: done[k] for k in ("suggestionId", "status", "revision", "blocks", "ops")
                 if k in done})


_DECIDE_ERRORS = {**_ERRORS, 400: (*_ERRORS[400], *IDEMPOTENT[400]),
                  404: ("suggestion_not_found",),
                  409: ("suggestion_closed", "page_conflict", *IDEMPOTENT[409]),
                  503: (*_ERRORS[503], *IDEMPOTENT[503])}
_ID_PARAM = Param("suggestion_id", "path", ID_SCHEMA, "the suggestion")


@bp.post("/suggestions/<suggestion_id>/accept")
@documented(summary="Accept a suggestion: its edits are applied", tags=("client",),
            params=(_ID_PARAM, *PARAMS, IDEMPOTENCY_KEY), body=SUGGESTION_ANSWER,
            replies={200: Reply("applied: the page's new revision and the blocks touched",
                                SUGGESTION_DECIDED)},
            errors=_DECIDE_ERRORS)
@idempotent_client()
def accept(suggestion_id):
    """Apply the suggestion as ``baseRevision`` would (a member who may write the page);
    409 ``hermes_client_page_conflict`` naming the blocks that changed since it was made
    (it stays open), 409 ``hermes_client_suggestion_closed`` once accepted or rejected."""
    return _decide(suggestion_id, "accept")


@bp.post("/suggestions/<suggestion_id>/reject")
@documented(summary="Reject a suggestion", tags=("client",),
            params=(_ID_PARAM, *PARAMS, IDEMPOTENCY_KEY), body=SUGGESTION_ANSWER,
            replies={200: Reply("rejected: the page is unchanged", SUGGESTION_DECIDED)},
            errors=_DECIDE_ERRORS)
@idempotent_client()
def reject(suggestion_id):
    """Close the suggestion unapplied (a member who may write the page); 409
    ``hermes_client_suggestion_closed`` once accepted or rejected."""
    return _decide(suggestion_id, "reject")
