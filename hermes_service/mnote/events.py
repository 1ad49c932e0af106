"""The client proxy's run events as JSON schemas (contract hermes-client-proxy-contract-v1 §2
GET /events; docs/mnote-client.md, Events).

:mod:`hermes_service.mnote.runs.manager` emits them (its module doc lists the payloads) and
:func:`~hermes_service.mnote.client_codes.public_event` gives ``run.failed`` its contract code;
these schemas are how ``GET /openapi.json`` shows them (``#/components/schemas/RunEvent`` and one
component per event), each ``data:`` line of ``GET /events/{run_id}`` (``RunEventFrame``, the
schema its ``text/event-stream`` response names) and each item of an abort's ``events``.
``reasoning.delta``, ``approval.*``, ``suggestion.created``, ``tool.*``'s ``preview`` and
``run.completed``'s ``finish_reason`` and ``notice`` are additions to the contract. Fields
beyond these may be added later; clients ignore what they do not know.
"""
from __future__ import annotations

from ..runner import FINISH_REASON
from .client_codes import CODE_MAP, EXTRA_CODES, client_code

_STR = {"type": "string"}
_NULLABLE = {"type": ["string", "null"]}
_TOKENS = {"type": "integer", "minimum": 0}
#: docs/mnote-client.md §Tool events
_TOOL_NAME = {"type": ["string", "null"], "pattern": r"^[A-Za-z0-9_][A-Za-z0-9_.-]*$",
              "description": "the tool's own name, never with its arguments: Hermes's tools by "
                             "Hermes's name (`terminal`, `read_file`, `patch`…), mnote's by "
                             "their contract name (`mnote.page.get`, as GET /tools lists them); "
                             "the transcript's `toolName` is the same; null when unknown",
              "examples": ["terminal", "read_file", "mnote.page.get"]}
_PREVIEW = {"type": ["string", "null"],
            "description": "added: what the call does, for people — the command of `terminal`, "
                           "the path of a file tool, the page of an mnote tool… — with secrets "
                           "redacted as Hermes redacts commands; null when there is nothing to "
                           "show",
            "examples": ["ls -la notes/", "/home/hermes/notes.txt", "doc_1"]}
#: contract codes a ``run.failed`` may carry (every core code the client maps, and the fallback)
RUN_FAILED_CODES = sorted({client_code(c) for c in (*CODE_MAP, *EXTRA_CODES)}
                          | {client_code(None)})


def _event(name: str, description: str, required: tuple[str, ...] = (),
           properties: dict | None = None, session: bool = True) -> dict:
    return {"type": "object", "description": description,
            "required": ["event", "run_id", *(["session_id"] if session else []), *required],
            "properties": {"event": {"const": name}, "run_id": _STR, "session_id": _STR,
                           **(properties or {})}}


#: event name → (component name, schema)
EVENTS = {
    "run.started": ("RunStartedEvent", _event(
        "run.started", "Hermes started the turn (a run still queued for a slot has no events)")),
    "reasoning.delta": ("ReasoningDeltaEvent", _event(
        "reasoning.delta", "added: a piece of the model's reasoning, never part of the answer",
        ("delta",), {"delta": _STR})),
    "message.delta": ("MessageDeltaEvent", _event(
        "message.delta", "a piece of the answer (the CLI runner: the whole answer at once)",
        ("delta",), {"delta": _STR})),
    "tool.started": ("ToolStartedEvent", _event(
        "tool.started", "the model called a tool", ("tool_call_id", "tool_name"),
        {"tool_call_id": _NULLABLE, "tool_name": _TOOL_NAME, "preview": _PREVIEW})),
    "tool.completed": ("ToolCompletedEvent", _event(
        "tool.completed", "a tool call ended", ("tool_call_id", "tool_name", "ok", "error_code"),
        {"tool_call_id": _NULLABLE, "tool_name": _TOOL_NAME, "preview": _PREVIEW,
         "ok": {"type": ["boolean", "null"]},
         "error_code": _NULLABLE})),
    "suggestion.created": ("SuggestionCreatedEvent", _event(
        "suggestion.created", "added (docs/mnote-client.md §Suggestions): the agent proposed "
        "block edits (mnote.block.propose); list them on GET /suggestions, accept or reject "
        "on POST /suggestions/{id}/accept or /reject",
        ("suggestion_id", "tool_call_id", "document_id"),
        {"suggestion_id": _STR, "tool_call_id": _NULLABLE, "document_id": _NULLABLE})),
    "run.completed": ("RunCompletedEvent", _event(
        "run.completed", "the run answered (ends the stream)", ("output", "usage"),
        {"output": {"type": "string", "description": "the answer Hermes recorded: everything "
                    "the model wrote in the turn; the run's message.delta texts add up to it"},
         "finish_reason": {**FINISH_REASON, "description": "added: "
                           + FINISH_REASON["description"]},
         "usage": {"type": "object", "required": ["input_tokens", "output_tokens", "total_tokens"],
                   "properties": {"input_tokens": _TOKENS, "output_tokens": _TOKENS,
                                  "total_tokens": _TOKENS}},
         "notice": {"type": "string", "description": "added: the old Hermes conversation was "
                                                     "gone and a new one was started"}})),
    "run.failed": ("RunFailedEvent", _event(
        "run.failed", "the run failed (ends the stream)", ("code", "error"),
        {"code": {"enum": RUN_FAILED_CODES}, "error": _STR})),
    "abort.started": ("AbortStartedEvent", _event(
        "abort.started", "an abort was asked for (no session_id in the abort response)",
        session=False)),
    "run.cancelled": ("RunCancelledEvent", _event(
        "run.cancelled", "the run was aborted (ends the stream)")),
    "approval.request": ("ApprovalRequestEvent", _event(
        "approval.request", "added (docs/mnote-client.md §Approvals): Hermes asks the user "
        "before a dangerous command or a file edit; answer on POST /runs/{runId}/approval. "
        "The run's status is waiting_for_approval until every question is resolved",
        ("approval_id", "kind", "title", "detail", "choices"),
        {"approval_id": _STR,
         "kind": {"type": "string", "description": "command | edit | other"},
         "title": _STR,
         "detail": {"type": "string", "description": "the description and `$ <command>` (secrets "
                                                     "redacted by Hermes), or the file and a diff"},
         "choices": {"type": "array", "items": {"enum": ["once", "session", "always", "deny"]},
                     "description": "what Hermes offers for this question; always only with "
                                    "hermes.approvals.allow_always"}})),
    "approval.responded": ("ApprovalRespondedEvent", _event(
        "approval.responded", "added: a question was resolved", ("approval_id", "choice",
                                                                  "resolved_by"),
        {"approval_id": _STR, "choice": {"enum": ["once", "session", "always", "deny"]},
         "resolved_by": {"enum": ["user", "timeout", "abort"]}})),
    "clarify.request": ("ClarifyRequestEvent", _event(
        "clarify.request", "added (docs/mnote-client.md §Approvals): Hermes's clarify tool "
        "asks the user a question; answer on POST /runs/{runId}/clarify. The run's status is "
        "waiting_for_answer meanwhile", ("clarify_id", "question", "choices"),
        {"clarify_id": _STR, "question": _STR,
         "choices": {"type": ["array", "null"], "items": _STR,
                     "description": "suggested answers (at most 4), or null: an open question; "
                                    "any text is an answer"}})),
    "clarify.responded": ("ClarifyRespondedEvent", _event(
        "clarify.responded", "added: a clarifying question was resolved (timeout, abort: "
        "unanswered)", ("clarify_id", "resolved_by"),
        {"clarify_id": _STR, "resolved_by": {"enum": ["user", "timeout", "abort"]}})),
}
#: any one event
RUN_EVENT = {"oneOf": [{"$ref": f"#/components/schemas/{name}"} for name, _ in EVENTS.values()],
             "discriminator": {"propertyName": "event", "mapping": {
                 event: f"#/components/schemas/{name}" for event, (name, _) in EVENTS.items()}}}
#: one Server-Sent Event of ``GET /events/{run_id}`` as the stream frames it: ``id:`` and
#: ``data:``, a JSON :data:`RUN_EVENT` (``contentSchema``, which schemathesis checks)
RUN_EVENT_FRAME = {
    "type": "object", "required": ["id", "data"],
    "description": "one Server-Sent Event: `id: <seq>` and `data: <a JSON RunEvent>`",
    "properties": {
        "id": {"type": "string", "pattern": "^[0-9]+$",
               "description": "the event's sequence number in its run (Last-Event-ID)"},
        "data": {"type": "string", "contentMediaType": "application/json",
                 "contentSchema": {"$ref": "#/components/schemas/RunEvent"},
                 "description": "a JSON RunEvent: one of "
                                + ", ".join(f"{name} (`{event}`)"
                                            for event, (name, _) in EVENTS.items())}},
    "examples": [{"id": "1", "data": '{"event": "run.started", "run_id": "run_123", '
                                     '"session_id": "mnote_doc_1_trace_1"}'}]}
#: the document's components: ``RunEvent``, one per event, and the stream's frame
COMPONENTS = {"RunEvent": RUN_EVENT, "RunEventFrame": RUN_EVENT_FRAME,
              **{name: schema for name, schema in EVENTS.values()}}
