"""The run routes of the client proxy (client-proxy contract §2; docs/mnote-client.md): start a
run in the background (:func:`start_turn` is its work), follow its events as Server-Sent
Events, abort it, answer its questions."""
from __future__ import annotations

import functools
import json
import re
from dataclasses import dataclass

from flask import Response, g, request, stream_with_context

from ..conversations import SendRequest
from ..errors import ID_SCHEMA, BadRequest, NotFound, check_id
from ..homes.hermes_state import session_summary, token_counts, tokens_used
from ..web.helpers import Param, Reply, documented, has_body, json_body, services
from . import event_bounds
from .client import (
    MNOTE_TOOLSET,
    actor_id,
    adopt_trace_id,
    bp,
    check_page_args,
    ensure_session,
    idempotent_client,
    ok,
    own_session,
    trace_id,
)
from .client_codes import public_event
from .client_schemas import (
    ABORT,
    ABORTED,
    APPROVAL,
    APPROVED,
    CLARIFIED,
    CLARIFY,
    COMMON,
    EVENT_STREAM,
    IDEMPOTENCY_KEY,
    IDEMPOTENT,
    PARAMS,
    RUN,
    RUN_STARTED,
    configured_models,
)
from .objects import mnote_of, settings
from .page_context import page_context

EVENT_ID = re.compile(r"[0-9]{1,18}")     # Server-Sent Events ids: the run's sequence numbers


@bp.post("/runs")
@documented(summary="Start a run (returns at once)", tags=("client",),
            params=(*PARAMS, IDEMPOTENCY_KEY), body=RUN, body_for_config=configured_models,
            replies={200: Reply("the run was started; follow it on GET /events/{runId}",
                                RUN_STARTED)},
            errors={**COMMON, 400: ("invalid_id", "invalid_request", "invalid_idempotency_key"),
                    404: ("session_not_found",), 409: ("session_busy", *IDEMPOTENT[409]),
                    413: ("message_too_large",), 429: ("too_many_runs",),
                    503: ("hermes_unavailable", "hermes_unconfigured", "service_draining",
                          *IDEMPOTENT[503])},
            links={"Events": ("mnote_client.events", {"run_id": "$response.body#/runId"}),
                   "Abort": ("mnote_client.abort", {"run_id": "$response.body#/runId"})})
@idempotent_client()
def start_run():
    """§2 POST /runs: start a run in the background, return at once with ``runId``.

    Unknown ``sessionId`` of this actor: the session is created on this first run
    (``persistence: hermes_on_first_run``). 409 ``hermes_client_session_busy`` while a run
    is active on the session, its error body naming that run in ``runId`` (to attach to it on
    ``GET /events/{runId}``); 429 ``hermes_client_busy`` when every run slot is queued.

    Every POST without ``Idempotency-Key`` starts a new run: a repeated ``traceId`` is a trace
    id, not a retry. With the header (docs/v1-api.md §Idempotent retries) a retry of the same body
    from the same actor gets the first answer — the same ``runId``, at once, while that run goes on
    or after it ended — and Hermes runs once; 409 ``hermes_client_idempotency_conflict`` for the
    same key with another body.
    """
    actor = actor_id()
    body = json_body()
    tid = trace_id()
    svc = services()
    svc.check_accepting()            # 503 hermes_client_service_draining: stopping gracefully
    svc.processes.command_path()     # 503 hermes_client_unconfigured before a run is accepted
    svc.require_provider()           # (no provider, the shipped example, or no key variable)
    mcfg = settings(svc.config)
    model_id = body.get("model") or mcfg.default_model
    models = {m.id: m for m in mcfg.models}
    if model_id not in models:
        raise BadRequest(f"model must be one of {', '.join(models)}", code="invalid_request")
    ws = check_id(body["workspaceId"], "workspaceId")
    doc = check_id(body["documentId"], "documentId")
    sid = body["sessionId"]
    svc.conversations.check_message(body["message"])
    context = page_context(body)
    turn = Turn(session_key=ensure_session(sid, actor, ws, doc)["session_id"], actor=actor,
                workspace_id=ws, document_id=doc, message=body["message"], context=context,
                model_id=model_id, hermes_model=models[model_id].hermes_model,
                scope=capability_scope(svc),
                # Hermes's questions go to the panel (ACP runner only; the CLI runner denies them)
                asking=svc.config.hermes.approvals.mode == "ask")
    run = mnote_of(svc).runs.start(turn.session_key, sid, actor, tid,
                                   functools.partial(run_turn, svc, turn))
    return ok(sessionId=sid, runId=run.run_id, messageId=None, events=[])


@dataclass(frozen=True)
class Turn:
    """What a run started by POST /runs does, settled when the request was accepted."""
    session_key: str           # the session's sessions.json key (:func:`.client.session_key`)
    actor: str
    workspace_id: str
    document_id: str
    message: str
    context: str               # the page-context block (:func:`.page_context.page_context`)
    model_id: str              # the panel's model id (mnote.models)
    hermes_model: str | None   # the provider model Hermes is asked for (None: the default)
    scope: list[str]           # the run's capability scope (the key's, or the default)
    asking: bool               # Hermes's questions go to the panel


def run_turn(svc, turn: Turn, run) -> None:
    """The work of a run, on a run worker (:meth:`~.runs.RunManager.start`): the turn through
    the service's conversations with the run's binding, listener and cancel event, then the
    run's closing events (the answer as deltas when it did not stream) and ``run.completed``
    with the tokens the turn used."""
    # run token + ids for the plugin
    binding = mnote_of(svc).tools.run_binding(run, turn.workspace_id, turn.document_id,
                                              turn.scope)
    binding["pageContext"] = turn.context
    # the home brought up to date and repaired first, as every turn does (homes.ensure):
    # a FIFO or a folder planted at state.db is removed before anything reads it
    home = svc.homes.ensure(turn.actor).hermes_home
    try:
        known = svc.conversations.get(turn.session_key, kind="mnote").get("hermes_session_id")
        before = token_counts(home, known) or {}     # (not the transcript: first token)
        _, result = svc.conversations.send(SendRequest(
            turn.session_key, turn.message, owner=turn.actor, kind="mnote", wait=0,
            model=turn.hermes_model, toolsets=[MNOTE_TOOLSET], plugin_run=binding,
            listener=run.listener(), log_ctx={"run": run.run_id}, cancel=run.cancel,
            record={"model": turn.model_id}, approvals=run if turn.asking else None))
    finally:
        mnote_of(svc).tools.end_run(run)
    closing = []
    if not result.streamed:      # the CLI runner: the answer arrives whole, at the end
        if result.reasoning:
            closing.append(("reasoning.delta", {"delta": result.reasoning}))
        closing += [("message.delta", {"delta": piece}) for piece in _pieces(result.answer)]
    completed = {"output": result.answer, "finish_reason": result.finish_reason,
                 "usage": result.usage or {
                     **tokens_used(before, session_summary(home, result.hermes_session_id)),
                     "estimated": False}}
    if result.notice:
        completed["notice"] = result.notice
    run.finish([*closing, ("run.completed", completed)])


def _pieces(text: str) -> list[str]:
    """``text`` as ``message.delta`` texts of at most a delta's cap each (docs/mnote-client.md
    §Sizes of events), so that they add up to it whole."""
    cap = event_bounds.FIELD_CHARS["delta"]
    return [text[i:i + cap] for i in range(0, len(text), cap)]


def capability_scope(svc) -> list[str]:
    key_scope = getattr(g.get("api_key"), "capability_scope", None)
    if key_scope is None:
        key_scope = settings(svc.config).default_capability_scope
    return list(key_scope)


@bp.get("/events/<run_id>")
@documented(summary="A run's events (Server-Sent Events)", tags=("client",),
            params=(Param("run_id", "path", ID_SCHEMA, "the run"), *PARAMS,
                    Param("sessionId", "query", {"type": "string"},
                          "404 unless the run is on this session"),
                    Param("Last-Event-ID", "header", {"type": "integer"},
                          "replay every event after this id"),
                    Param("lastEventId", "query", {"type": "string"},
                          "as Last-Event-ID, when that header is absent or empty: then it must "
                          "be an integer (400 otherwise)")),
            replies={200: Reply("the run's events, replayed and then live, until its last",
                                media=EVENT_STREAM,
                                headers=("Cache-Control", "X-Accel-Buffering", "X-Trace-Id")),
                     204: Reply("Last-Event-ID is the last event of a finished run: nothing "
                                "follows (an EventSource stops reconnecting)")},
            errors={**COMMON, 400: ("invalid_id", "invalid_request"), 404: ("run_not_found",),
                    429: ("too_many_streams",)})
def events(run_id):
    """§2 GET /events/{run_id}: Server-Sent Events (docs/mnote-client.md §Events).

    Frames: ``id: <seq>`` + ``data: <json>``; ``: keepalive`` comments every
    ``mnote.keepalive_seconds``. ``Last-Event-ID`` (header, or ``lastEventId`` query)
    replays every event after that id. The stream ends after the terminal event. Any service
    process on the data dir serves any run, from its durable log (docs/data-and-durability.md
    §Runs and their events); a run whose process died is closed first (``run.failed``
    ``hermes_client_run_interrupted``).

    * ``Last-Event-ID`` above the run's last id (never issued): 400 ``hermes_client_bad_request``
      naming the run's last id; not an integer (or negative): 400 too;
    * ``Last-Event-ID`` = the last id of a finished run (a reconnect after the terminal event):
      204 No Content, which tells a browser EventSource to stop reconnecting;
    * 429 ``hermes_client_busy`` when ``mnote.max_event_streams`` streams are open; a client
      that disconnects frees its slot within ~1 s
      (:class:`~hermes_service.mnote.runs.manager.ClientWatch`).
    """
    actor = actor_id()
    check_id(run_id, "runId")
    trace_id()           # each traceId given must be an id (400), as on every client route
    svc = services()
    run = mnote_of(svc).runs.get(run_id, actor)
    sid = request.args.get("sessionId")
    if sid is not None and sid != run.session_id:
        raise NotFound(f"run {run_id} not found", code="run_not_found")
    # the request is the run's from here: logged under its traceId (unless one was given),
    # and every answer, an error too, names the run's in X-Trace-Id
    adopt_trace_id(run.trace_id)
    named = {"X-Trace-Id": run.trace_id}
    try:
        after = _last_event_id()
    except BadRequest as err:
        err.headers.update(named)
        raise
    last, done = run.position()
    if after > last:
        raise BadRequest(
            f"Last-Event-ID {after} was never issued by run {run_id}: its last event id is "
            f"{last}{' (the run has ended)' if done else ' so far'}; reconnect without "
            "Last-Event-ID to replay the run from its first event", code="invalid_request",
            headers=named)
    headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no", **named}
    if done and after == last:      # the client has the terminal event: nothing will follow
        resp = Response(status=204, headers=headers)
        del resp.headers["Content-Type"]       # no body, so no media type (RFC 9110 §8.3)
        return resp
    keepalive = float(settings(svc.config).keepalive_seconds)
    # 429 when mnote.max_event_streams are open; waitress tells when the client goes away
    sub = mnote_of(svc).runs.subscribe(run, request.environ.get("waitress.client_disconnected"))

    def stream():
        yield ": stream open\n\n"     # the first byte leaves at once (proxies, clients)
        for batch in sub.events(after, keepalive):
            if not batch:
                yield ": keepalive\n\n"
            else:      # everything that arrived since the last write, in one write
                yield "".join(f"id: {seq}\ndata: {_sse_json(public_event(event))}\n\n"
                              for seq, event in batch)

    resp = Response(stream_with_context(stream()), mimetype="text/event-stream", headers=headers)
    resp.call_on_close(sub.close)   # also for HEAD and for clients that disconnect
    return resp


def _sse_json(event: dict) -> str:
    """An event's ``data:`` JSON: UTF-8 text as is, unless a string holds a lone surrogate
    (e.g. a streamed delta), which UTF-8 cannot carry: then that event is written with
    ``\\uXXXX`` escapes (JSON.parse gives the same string) instead of breaking the stream."""
    text = json.dumps(event, ensure_ascii=False)
    try:
        text.encode()
    except UnicodeEncodeError:
        text = json.dumps(event)
    return text


def _last_event_id() -> int:
    """The ``Last-Event-ID`` header (or ``lastEventId`` query) as an event id; 0 when absent.
    400 unless it is a non-negative integer."""
    text = request.headers.get("Last-Event-ID") or request.args.get("lastEventId") or "0"
    if not EVENT_ID.fullmatch(text):
        raise BadRequest("Last-Event-ID must be an event id (a non-negative integer)",
                         code="invalid_request")
    return int(text)


def own_run(run_id: str, body: dict):
    """The run ``run_id`` as abort and approval authorise it: the acting actor's run (the
    key's scope and actor checks come first), on the body's ``sessionId`` / ``workspaceId``
    / ``documentId`` when given (the run's page is its session's: POST /runs checks that).
    404 ``run_not_found`` otherwise, the same for every mismatch."""
    actor = actor_id()
    check_id(run_id, "runId")
    run = mnote_of(services()).runs.get(run_id, actor)
    if body.get("sessionId") not in (None, run.session_id):
        raise NotFound(f"run {run_id} not found", code="run_not_found")
    if body.get("workspaceId") is not None or body.get("documentId") is not None:
        try:
            check_page_args(own_session(run.session_id, actor), body.get("workspaceId"),
                             body.get("documentId"))
        except NotFound:
            raise NotFound(f"run {run_id} not found", code="run_not_found") from None
    return run


@bp.post("/runs/<run_id>/abort")
@documented(summary="Abort a run", tags=("client",),
            params=(Param("run_id", "path", ID_SCHEMA, "the run"), *PARAMS), body=ABORT,
            body_required=False,
            replies={200: Reply("abort.started (run.cancelled follows on the stream), or the "
                                "final event of a finished run", ABORTED)},
            errors={**COMMON, 400: ("invalid_id", "invalid_request"), 404: ("run_not_found",)})
def abort(run_id):
    """§2 POST /runs/{id}/abort: returns at once with ``abort.started``; the worker kills the
    run's process group and emits ``run.cancelled``. A finished run returns its final event.
    A run of another live process on the data dir gets the abort through its request file
    (applied within ~50 ms: docs/data-and-durability.md §Runs and their events)."""
    actor_id()
    body = json_body() if has_body() else {}
    svc = services()
    run = own_run(run_id, body)
    events_out = mnote_of(svc).runs.abort(run)
    # no tool call of an aborted run gets through, from now on
    mnote_of(svc).tools.end_run(run)
    return ok(runId=run.run_id, sessionId=run.session_id,
              events=[public_event(e) for e in events_out])


@bp.post("/runs/<run_id>/approval")
@documented(summary="Answer a question of the run (approval.request)", tags=("client",),
            params=(Param("run_id", "path", ID_SCHEMA, "the run"), *PARAMS),
            body=APPROVAL,
            replies={200: Reply("the answer was handed to Hermes; approval.responded follows "
                                "on the stream", APPROVED)},
            errors={**COMMON, 400: ("invalid_id", "invalid_request"), 404: ("run_not_found",),
                    409: ("approval_not_pending",)})
def approval(run_id):
    """POST /runs/{id}/approval (docs/mnote-client.md §Approvals): answer the run's pending question
    ``approvalId`` with ``choice`` (``once`` | ``session`` | ``always`` | ``deny``, one of
    the question's ``choices``). Authorised exactly like abort (:func:`own_run`: another
    actor's run, another session or page → 404). 400 ``hermes_client_bad_request`` for a
    choice the question does not offer (``always`` when ``hermes.approvals.allow_always`` is
    false); 409 ``hermes_client_approval_not_pending`` when ``approvalId`` is not pending
    (never asked, answered, timed out, or the run ended). Emits ``approval.responded``
    ``{approval_id, choice, resolved_by: "user"}``."""
    actor_id()
    body = json_body()
    run = own_run(run_id, body)
    choice = run.answer(check_id(body["approvalId"], "approvalId"), body["choice"], "user")
    return ok(runId=run.run_id, approvalId=body["approvalId"], choice=choice)


@bp.post("/runs/<run_id>/clarify")
@documented(summary="Answer a clarifying question of the run (clarify.request)",
            tags=("client",),
            params=(Param("run_id", "path", ID_SCHEMA, "the run"), *PARAMS), body=CLARIFY,
            replies={200: Reply("the answer was handed to Hermes; clarify.responded follows "
                                "on the stream", CLARIFIED)},
            errors={**COMMON, 400: ("invalid_id", "invalid_request"), 404: ("run_not_found",),
                    409: ("clarify_not_pending",)})
def clarify(run_id):
    """POST /runs/{id}/clarify (docs/mnote-client.md §Approvals → Clarifying questions): answer the
    run's pending clarifying question ``clarifyId`` with ``answer`` (a suggested choice or any text,
    1-4000 characters). Authorised exactly like abort (:func:`own_run`: 404). 409
    ``hermes_client_clarify_not_pending`` when ``clarifyId`` is not pending (never asked, answered,
    timed out, the run ended). Emits ``clarify.responded`` ``{clarify_id, resolved_by: "user"}``."""
    actor_id()
    body = json_body()
    run = own_run(run_id, body)
    run.answer_clarify(check_id(body["clarifyId"], "clarifyId"), body["answer"], "user")
    return ok(runId=run.run_id, clarifyId=body["clarifyId"])
