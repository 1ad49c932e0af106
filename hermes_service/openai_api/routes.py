"""The OpenAI-compatible routes (docs/openai-api.md): ``GET /v1/models``,
``GET /v1/models/{model}`` and ``POST /v1/chat/completions``, each user's turns in that
user's home and sandbox like any other turn (the turn slots, admission places, limits and the
model pass-through's daily budget all apply).

The route family ``openai`` (:data:`OPENAI`): an allowed address and an API key with the
``openai`` scope, sent as ``Authorization: Bearer`` (what every OpenAI client sends; the
configured ``api_key_header`` works too); errors in OpenAI's shape (:mod:`.errors`)."""
from __future__ import annotations

import logging
import threading
import time
import uuid
from contextlib import ExitStack

from flask import Blueprint, Response, jsonify, request, stream_with_context

from ..conversations import SendRequest
from ..errors import BadRequest, NotFound, TooLarge, check_id, schema_error
from ..homes.hermes_state import token_counts, tokens_used
from ..web.api_v1 import new_session_id
from ..web.helpers import (
    Param,
    Reply,
    documented,
    first_schema_error,
    json_body,
    schema_problem,
    services,
    validator_for,
)
from ..web.routing import RouteFamily, declare
from . import tasks
from .conversation import history_digest, plan, read_messages
from .errors import ERRORS
from .identity import JWT_HEADER, user_of_request
from .schemas import (
    CHAT_COMPLETION,
    CHAT_REQUEST,
    EVENT_STREAM,
    MODEL,
    MODEL_ID,
    MODEL_LIST,
    SESSION_HEADER,
    SESSION_ID,
)
from .settings import NAME, OpenAISettings
from .stream import Chunks, completion
from .turn import Feed, stream_frames, whole
from .usage import PassThroughCount

log = logging.getLogger("hermes_service.openai")

#: the OpenAI-compatible routes: an allowed address, an API key with the ``openai`` scope
#: (as a bearer token or in the configured header); errors in OpenAI's shape
OPENAI = RouteFamily(NAME, ("/v1/",), ERRORS, scope=NAME, bearer=True)
bp = declare(Blueprint("openai_api", __name__), OPENAI)
TAG = "openai"
#: the models' ``created`` (Unix seconds): when this process loaded the routes
CREATED = int(time.time())
#: opt-in: the turn's tool calls as SSE comments in a stream (docs/openai-api.md §Streams)
TOOL_EVENTS_HEADER = "X-Hermes-Tool-Events"
_USER_PARAMS = (Param(JWT_HEADER, "header", {"type": "string"},
                      "a trusted front end's signed user token (openai.jwt_secret_env)"),
                Param(TOOL_EVENTS_HEADER, "header", {"enum": ["comments"]},
                      "`comments`: a stream carries the turn's tool calls as "
                      "`: hermes.tool {json}` SSE comments"))


def _settings() -> OpenAISettings:
    return services().config.section(NAME)


def _model_entry(model_id: str, created: int) -> dict:
    return {"id": model_id, "object": "model", "created": created, "owned_by": "hermes-service"}


@bp.get("/v1/models")
@documented(summary="The models (OpenAI: List models)", tags=(TAG,),
            replies={200: Reply("the models this service answers as", MODEL_LIST)})
def list_models():
    """``{"object": "list", "data": [{"id", "object": "model", "created", "owned_by"}]}``:
    the ids of ``openai.models``; each is the user's own sandboxed Hermes (the provider model
    is ``hermes.model.default``)."""
    return jsonify(object="list", data=[_model_entry(m, CREATED) for m in _settings().models])


@bp.get("/v1/models/<model_id>")
@documented(summary="A model (OpenAI: Retrieve model)", tags=(TAG,),
            params=(Param("model_id", "path", MODEL_ID, "a model id"),),
            replies={200: Reply("the model", MODEL)},
            errors={404: ("model_not_found",)})
def get_model(model_id):
    """One entry of ``GET /v1/models``; 404 ``model_not_found`` for another id."""
    if model_id not in _settings().models:
        raise NotFound(f"the model {model_id} does not exist", code="model_not_found",
                       extra={"param": "model"})
    return jsonify(_model_entry(model_id, CREATED))


def _body() -> dict:
    """The request body checked against :data:`CHAT_REQUEST`; a schema error names the
    field at fault in ``param``."""
    body = json_body({})
    err = first_schema_error(validator_for(CHAT_REQUEST), body)
    if err is not None:
        path, _ = schema_error(err)        # a missing field is named in the path
        where = ".".join(path)
        raise BadRequest(schema_problem(err), code="invalid_request",
                         extra={"param": where or None})
    return body


def _refuse_unsupported(body: dict, cfg: OpenAISettings) -> None:
    """400 for what the routes do not do (docs/openai-api.md §What is not supported); 404
    ``model_not_found`` for a model not in ``openai.models``."""
    if body["model"] not in cfg.models:
        raise NotFound(f"the model {body['model']} does not exist (GET /v1/models lists "
                       "them)", code="model_not_found", extra={"param": "model"})
    if (body.get("n") or 1) > 1:
        raise BadRequest("n > 1 is not supported: each answer is one Hermes turn",
                         code="unsupported_parameter", extra={"param": "n"})
    for field in ("tools", "functions"):
        if body.get(field):
            raise BadRequest("the client's own tools are not supported: Hermes calls its own "
                             "tools inside the user's sandbox", code="tools_unsupported",
                             extra={"param": field})


@bp.post("/v1/chat/completions")
@documented(summary="A chat completion: one turn of the user's Hermes (OpenAI: Create chat "
                    "completion)", tags=(TAG,), body=CHAT_REQUEST,
            params=(SESSION_ID, *_USER_PARAMS),
            replies={200: Reply("the answer (a `chat.completion`), or with `stream: true` "
                                "its chunks as Server-Sent Events", CHAT_COMPLETION,
                                media={"application/json": {"schema": CHAT_COMPLETION},
                                       **EVENT_STREAM},
                                headers=(SESSION_HEADER,))},
            errors={400: ("invalid_id", "unsupported_parameter", "unsupported_content",
                          "tools_unsupported"),
                    401: ("invalid_user_token",),
                    403: ("user_required",),
                    404: ("model_not_found", "session_not_found"),
                    409: ("session_busy",),
                    413: ("message_too_large", "history_too_long"),
                    429: ("too_many_runs",),
                    502: ("hermes_failed", "upstream_empty_answer"),
                    503: ("hermes_unavailable", "hermes_unconfigured", "service_draining",
                          "service_stopping"),
                    504: ("run_timeout",)})
def chat_completions():
    """One turn of the user's own Hermes (docs/openai-api.md): the user comes from the key
    (§Who the user is), the conversation from ``X-Hermes-Session-Id`` or the history
    (§Conversations; the id is returned in ``X-Hermes-Session-Id`` on every answer). With
    ``stream: true`` the answer streams as ``chat.completion.chunk`` Server-Sent Events
    (§Streams; ``stream_options.include_usage`` adds the usage chunk); a client that
    disconnects before its answer stops the turn, streamed or not. ``usage`` is what the
    provider reported through the model pass-through for this turn. A front end's chore (a
    title, tags) is answered at once without a turn (§Front-end chores)."""
    svc = services()
    cfg = _settings()
    user = user_of_request(cfg)
    body = _body()
    _refuse_unsupported(body, cfg)
    if len(body["messages"]) > cfg.max_history_messages:
        raise TooLarge(f"messages holds more than openai.max_history_messages "
                       f"({cfg.max_history_messages})", code="history_too_long",
                       extra={"param": "messages"})
    pairs = read_messages(body["messages"])
    stream = bool(body.get("stream"))
    usage_asked = bool((body.get("stream_options") or {}).get("include_usage"))
    cid, created, model = f"chatcmpl-{uuid.uuid4().hex}", int(time.time()), body["model"]
    if cfg.task_mode == "local" and tasks.task_of(body, pairs[-1][1]):
        return _answer_locally(cid, created, model, tasks.answer(pairs[-1][1]), stream,
                               usage_asked)
    named_id = request.headers.get(SESSION_HEADER)
    named = svc.conversations.get(check_id(named_id, SESSION_HEADER), owner=user, kind=NAME) \
        if named_id else None
    sessions = [] if named else svc.conversations.list(user, kind=NAME)
    where = plan(sessions, pairs, named)
    svc.conversations.check_message(where.message)         # 413 message_too_large
    svc.check_accepting()             # 503 service_draining
    svc.require_provider()            # 503 hermes_unconfigured, before any turn
    held = ExitStack()
    held.enter_context(svc.admission(f"openai completion {cid}"))   # 429 too_many_runs
    try:
        sid = where.session_id or svc.conversations.create(
            user, new_session_id(svc.config.service.node_id), kind=NAME)["session_id"]
    except BaseException:
        held.close()
        raise
    turn = Turn(user, sid, where.message, pairs, cid)
    headers = {SESSION_HEADER: sid}
    disconnected = request.environ.get("waitress.client_disconnected")
    if not stream:
        result, tokens = whole(turn, held, disconnected)
        resp = jsonify(completion(cid, created, model, result.answer, result.finish_reason,
                                  tokens))
        resp.headers.update(headers)
        return resp
    frames = stream_frames(Chunks(cid, created, model), turn, held, usage_asked, disconnected,
                           tools=request.headers.get(TOOL_EVENTS_HEADER) == "comments")
    return Response(stream_with_context(frames), mimetype="text/event-stream",
                    headers={**headers, "Cache-Control": "no-cache",
                             "X-Accel-Buffering": "no"})


class Turn:
    """One request's Hermes turn: ``message`` on session ``session_id`` of ``user``; after
    the answer, the session's history digest is that of ``pairs`` and the answer
    (:func:`.conversation.history_digest`)."""

    def __init__(self, user: str, session_id: str, message: str, pairs: list, cid: str):
        self.user, self.session_id, self.message, self.pairs = user, session_id, message, pairs
        self.cid = cid
        self.svc = services()

    def run(self, listener: Feed | None, cancel: threading.Event | None):
        """Run the turn (in the caller's thread): ``(TurnResult, tokens)``, ``tokens`` as
        :func:`~hermes_service.hermes_state.tokens_used`. Raises the turn's ServiceError."""
        svc = self.svc
        home = svc.homes.ensure(self.user).hermes_home
        known = svc.conversations.get(self.session_id, kind=NAME).get("hermes_session_id")
        before = token_counts(home, known) if known else None
        counted = PassThroughCount(svc.model_proxy.usage, self.user)
        _, result = svc.conversations.send(SendRequest(
            self.session_id, self.message, owner=self.user, kind=NAME, listener=listener,
            cancel=cancel, log_ctx={"completion": self.cid}))
        # the pass-through's count of the turn's calls (docs/runners.md §One usage truth);
        # without one (no pass-through), Hermes's agent-writable counters, capped at it
        tokens = result.usage or counted.bound(
            tokens_used(before, token_counts(home, result.hermes_session_id)))
        svc.conversations.store.update(
            self.session_id,
            history_sha256=history_digest([*self.pairs, ("assistant", result.answer)]))
        return result, tokens


def _answer_locally(cid: str, created: int, model: str, text: str, stream: bool,
                    usage_asked: bool):
    """A chore's answer (:mod:`.tasks`): no turn, no session, no tokens."""
    none = {"input_tokens": 0, "output_tokens": 0, "total_tokens": 0}
    if not stream:
        return jsonify(completion(cid, created, model, text, "stop", none))
    chunks = Chunks(cid, created, model)
    out = [chunks.role(), chunks.content(text), chunks.finish("stop")]
    if usage_asked:
        out.append(chunks.usage(none))
    return Response("".join([*out, "data: [DONE]\n\n"]), mimetype="text/event-stream",
                    headers={"Cache-Control": "no-cache"})

