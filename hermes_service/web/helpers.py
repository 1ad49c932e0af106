"""Request helpers shared by the app factory and every blueprint (docs/architecture.md).

* :func:`services` — the :class:`~hermes_service.services.Services` of the current app;
* :func:`parse_json` / :func:`json_body` / :func:`has_body` — strict JSON request bodies (read
  whatever their Content-Type), validated with jsonschema;
* :func:`schema_problem` — a request body's jsonschema error as ``path: message``;
* :func:`render_error` — a :class:`~hermes_service.errors.ServiceError` in the shape of the
  request's route family (:func:`hermes_service.web.routing.current`; v1 API and requests of no
  family: ``{"detail", "code", "requestId"}``);
* :func:`idempotent` — a view honouring ``Idempotency-Key`` (the rules and the record store:
  :mod:`hermes_service.idempotency`);
* :func:`documented` — a route's contract (parameters, request schema, responses, error codes),
  declared next to the route; :mod:`hermes_service.web.openapi` builds ``GET /openapi.json`` from
  these and refuses a route without one (docs/api-description.md). :func:`json_body` validates
  with the schema the contract declares, so the document and the check share one dict.

Blueprints import from here, never from ``app.py``; ``app.py`` imports the blueprints.
"""
from __future__ import annotations

import functools
import json
import logging
import math
import sqlite3
import time
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import jsonschema
from flask import current_app, g, jsonify, make_response, request

from ..errors import ID_PATTERN, ID_RULE, BadRequest, ServiceError, schema_error
from ..idempotency import (
    HEADER,
    POLL_SECONDS,
    WAIT_MARGIN_SECONDS,
    IdempotencyStore,
    Outcome,
    api_key_of,
    check_key,
    fingerprint,
    recordable,
    scope_of,
)
from . import routing
from .routing import ErrorFamily

if TYPE_CHECKING:
    # the shape of hermes_service.services.Services: the services build the extensions, whose
    # blueprints use these helpers, so importing it would close a cycle (type-only imports
    # count: tests/unit/test_layers_imports.py)
    from ..service_objects import ServiceObjects
    from ..storage.idempotency import PgIdempotencyStore

log = logging.getLogger("hermes_service")


def services() -> ServiceObjects:
    """The service objects of the app handling this request."""
    return current_app.extensions["hermes_service"]


def _no_constant(name):
    raise ValueError(f"{name} is not valid JSON")


def _finite(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):        # e.g. 1e400
        raise ValueError(f"{text} is out of range")
    return value


def parse_json(raw: bytes):
    """Strict JSON: UTF-8, no NaN/Infinity (literal or overflowing), no lone surrogates,
    bounded nesting. Returns the decoded value.

    Raises BadRequest ``invalid_json``.
    """
    try:
        data = json.loads(raw.decode("utf-8"), parse_constant=_no_constant, parse_float=_finite)
        json.dumps(data, ensure_ascii=False).encode("utf-8")   # rejects lone surrogates
    except (ValueError, RecursionError, UnicodeError):
        raise BadRequest("the request body is not valid JSON (UTF-8, no NaN, no lone "
                         "surrogates)", code="invalid_json") from None
    return data


def schema_problem(err: jsonschema.ValidationError, limit: int = 300) -> str:
    """A request body's schema error as ``a/b/0: message``
    (:func:`~hermes_service.errors.schema_error`)."""
    path, reason = schema_error(err, limit)
    return f"{'/'.join(path)}: {reason}" if path else reason


def first_schema_error(validator: jsonschema.protocols.Validator,
                       instance) -> jsonschema.ValidationError | None:
    """The most relevant error of ``instance`` against ``validator`` (None when valid)."""
    return jsonschema.exceptions.best_match(validator.iter_errors(instance))


_VALIDATORS: dict[int, tuple[dict, jsonschema.Draft202012Validator]] = {}


def validator_for(schema: dict) -> jsonschema.Draft202012Validator:
    """A cached Draft 2020-12 validator for a (module-level) schema dict."""
    entry = _VALIDATORS.get(id(schema))
    if entry is None or entry[0] is not schema:
        entry = _VALIDATORS[id(schema)] = (schema, jsonschema.Draft202012Validator(schema))
    return entry[1]


def has_body() -> bool:
    """Does the request carry a body? Read raw, whatever its ``Content-Type``
    (``request.data`` is empty for a body labelled as a form, as ``curl -d`` sends it).
    A request with neither ``Content-Length`` nor ``Transfer-Encoding`` has none (RFC 9112
    §6.3: its body length is zero; waitress turns a chunked body into a ``Content-Length``),
    so it is not read: reading an empty body through werkzeug's stream wrappers cost every
    GET on a client route ~13 µs (docs/benchmarks.md, request cost)."""
    req = request._get_current_object()  # type: ignore[attr-defined]
    if "CONTENT_LENGTH" not in req.environ and "HTTP_TRANSFER_ENCODING" not in req.environ:
        return False
    return bool(req.content_length or req.get_data())


def json_body(schema: dict | None = None) -> dict:
    """The request's JSON object, validated with ``schema`` (jsonschema, Draft 2020-12); by
    default the ``body`` of the route's :func:`documented` contract — the schema
    ``/openapi.json`` shows for the route.

    Raises BadRequest ``invalid_json`` (not strict JSON / not an object), ``invalid_id`` (a
    field of :data:`~hermes_service.errors.ID_SCHEMA` that is not an id) or
    ``invalid_request`` naming the offending field (:func:`schema_problem`).
    """
    if schema is None:
        contract = contract_of(current_app.view_functions.get(request.endpoint or ""))
        schema = contract.body if contract is not None else None
    data = parse_json(request.get_data()) if has_body() else None
    if not isinstance(data, dict):
        raise BadRequest("the request body must be a JSON object", code="invalid_json")
    if schema:
        err = first_schema_error(validator_for(schema), data)
        if err is not None:
            if err.validator == "pattern" and err.validator_value == ID_PATTERN:
                # an id field (errors.ID_SCHEMA): the same answer as errors.check_id
                where = "/".join(str(p) for p in err.absolute_path)
                raise BadRequest(f"{where} must be {ID_RULE}", code="invalid_id")
            raise BadRequest(schema_problem(err), code="invalid_request")
    return data


# -- route contracts (the OpenAPI document) -------------------------------------------------
@dataclass(frozen=True)
class Param:
    """One documented request parameter: ``where`` is ``path``, ``query`` or ``header``;
    ``schema`` is JSON Schema (Draft 2020-12) of its value."""
    name: str
    where: str
    schema: dict
    description: str = ""
    required: bool = False


@dataclass(frozen=True)
class Reply:
    """One documented success response: ``schema`` of its JSON body, or ``media``: content
    type → OpenAPI Media Type Object (``{"schema": …}``); ``headers`` names response headers
    from :data:`hermes_service.web.openapi.RESPONSE_HEADERS` or those an extension registered
    (:func:`register_response_headers`)."""
    description: str
    schema: dict | None = None
    media: dict | None = None
    headers: tuple[str, ...] = ()


@dataclass(frozen=True)
class Contract:
    """A route's documented contract (docs/api-description.md).

    Who may call the route and its error shape are its route family's
    (:class:`~hermes_service.web.routing.RouteFamily`, declared by its blueprint), not the
    contract's. ``body``: the request schema :func:`json_body` validates with
    (``body_required`` False: an empty body is allowed; ``body_for_config(body, config)``: the
    body as the document shows it when a rule depends on the config); ``params``;
    ``replies``: status → :class:`Reply`; ``errors``: status → core error codes this route
    raises itself (the authentication, body and internal errors every route of its kind can
    answer are added by the document builder). ``links``: OpenAPI links of the 200 reply,
    ``name → (endpoint, {parameter: runtime expression})``.
    """
    summary: str
    replies: dict
    tags: tuple[str, ...] = ()
    body: dict | None = None
    body_required: bool = True
    body_for_config: Callable | None = None
    params: tuple[Param, ...] = ()
    errors: dict = field(default_factory=dict)
    links: dict = field(default_factory=dict)
    deprecated: bool = False


def documented(**contract) -> Callable:
    """Declare a route's :class:`Contract` next to it (below the route decorator)::

        @bp.post("/api/v1/sessions")
        @documented(summary="Create a session", body=CREATE_SESSION, ...)
        def create_session(): ...

    The view's docstring becomes the operation's description.
    """
    made = Contract(**contract)

    def attach(view: Callable) -> Callable:
        view.__contract__ = made  # type: ignore[attr-defined]
        return view
    return attach


def contract_of(view: Callable | None) -> Contract | None:
    """The :class:`Contract` declared for a view function (None: undocumented)."""
    return getattr(view, "__contract__", None)


def v1_error(err: ServiceError) -> dict:
    """The v1 API's error body (spec hermes-service-api-v1.3.0 has none; docs/v1-api.md)."""
    return {"detail": err.detail, "code": err.code, "requestId": g.get("request_id"), **err.extra}


#: the v1 API's error body (docs/v1-api.md); ``err.extra`` may add fields
V1_ERROR = {"type": "object", "required": ["detail", "code", "requestId"],
            "properties": {"detail": {"type": "string"}, "code": {"type": "string"},
                           "requestId": {"type": "string"}}}
#: the error shape of the v1 API and the core routes (health, docs, metrics)
V1_ERRORS = ErrorFamily("V1Error", V1_ERROR, description="v1 API error", render=v1_error)


def register_components(app, schemas: dict[str, dict]) -> None:
    """Named schemas for the OpenAPI document (``#/components/schemas/<name>``), e.g. the
    event payloads a route's contract refers to with ``{"$ref": …}``."""
    app.extensions.setdefault("openapi_components", {}).update(schemas)


def register_response_headers(app, headers: dict[str, dict]) -> None:
    """Response headers an extension's replies name (:attr:`Reply.headers`): header name →
    OpenAPI Header Object (``{"description", "schema"}``), beside the core's
    (:data:`hermes_service.web.openapi.RESPONSE_HEADERS`; naming one of those is refused when the
    document is built). ValueError for a name another extension already registered."""
    known = app.extensions.setdefault("openapi_response_headers", {})
    taken = sorted(set(headers) & set(known))
    if taken:
        raise ValueError(f"response headers already described: {', '.join(taken)}")
    known.update(headers)


def register_tags(app, tags: list[dict]) -> None:
    """OpenAPI tags (``{"name", "description"}``) of an extension's routes, listed after the
    core's in the document."""
    app.extensions.setdefault("openapi_tags", []).extend(tags)


def register_description(app, serves: str, errors: str) -> None:
    """An extension's part of the document's description: ``serves`` names its routes (e.g.
    ``"the mnote client proxy"``), ``errors`` their error shapes (e.g. ``"client proxy `{ok:
    false, …}`"``); both are listed after the v1 API's."""
    app.extensions.setdefault("openapi_description", []).append((serves, errors))


def render_error(err: ServiceError):
    """The JSON response for ``err`` in the shape of the request's route family
    (:func:`hermes_service.web.routing.current`; the v1 shape for a request of no family)."""
    family = routing.current()
    render = family.errors.render if family is not None else None
    resp = jsonify((render or v1_error)(err))
    resp.status_code = err.status
    for k, v in err.headers.items():
        resp.headers[k] = v
    return resp


# -- idempotent routes ------------------------------------------------------------------------
def _claim(store: IdempotencyStore | PgIdempotencyStore, scope: str, key: str, fp: str,
           api_key: str) -> Outcome | str | None:
    """:meth:`IdempotencyStore.claim`; a store that cannot answer — locked by another process
    beyond the busy timeout, damaged, unwritable — is 503 ``idempotency_unavailable`` with
    ``Retry-After`` (nothing ran: the retry is safe), logged."""
    try:
        return store.claim(scope, key, fp, api_key)
    except sqlite3.Error as err:
        log.error("idempotency record store %s unusable (%s): keyed requests are refused",
                  getattr(store, "path", "?"), err)
        raise ServiceError(f"the {HEADER} record store is unavailable (locked or damaged); "
                           "nothing was done, retry later", code="idempotency_unavailable",
                           status=503, headers={"Retry-After": "5"}) from None


def idempotent(family: str, user: Callable[[], str | None], *,
               extra: Callable[[], tuple] = tuple, wait: Callable | None = None):
    """Make a view honour ``Idempotency-Key`` (the rules: :mod:`hermes_service.idempotency`).
    ``family`` and ``user()`` (the acting user; may raise the route's own 400/401/403 first)
    name the key's scope; ``extra()`` adds request parts to the fingerprint; ``wait()`` is a
    context manager held while a retry waits for the first request (e.g. a v1 admission
    place)."""
    def wrap(view):
        @functools.wraps(view)
        def inner(**kwargs):
            key = check_key(request.headers.get(HEADER))
            if key is None:
                return view(**kwargs)
            svc = services()
            store = svc.idempotency
            scope = scope_of(family, user())
            fp = fingerprint(request.get_data(), extra())
            with ExitStack() as waiting:   # held while this retry waits for the first request
                got = _claim_or_wait(svc, scope, key, fp, wait, waiting)
                if got is not None:
                    log.info("idempotent replay of %s %s (status %d)", request.method,
                             request.path, got.status)
                    return got.response()
            return _run_recorded(view, kwargs, store, scope, key)
        return inner
    return wrap


def _claim_or_wait(svc, scope: str, key: str, fp: str, wait: Callable | None,
                   waiting: ExitStack) -> Outcome | None:
    """Claim ``key`` in ``scope`` for this request (None), or the first request's
    :class:`Outcome` to replay; while the first is running, wait for it (entering ``wait()``
    into ``waiting`` first; it may raise 429 with nothing claimed) up to the longest turn,
    then 409 ``idempotency_key_in_progress``."""
    store = svc.idempotency
    deadline = None
    while True:
        got = _claim(store, scope, key, fp, api_key_of())
        if got is None or isinstance(got, Outcome):
            return got
        if deadline is None:   # "running": wait for the first request's outcome
            deadline = time.monotonic() + \
                float(svc.config.hermes.longest_turn_seconds) + WAIT_MARGIN_SECONDS
            if wait is not None:
                waiting.enter_context(wait())   # may raise 429: nothing claimed
        if time.monotonic() >= deadline:
            raise ServiceError(f"the first request with this {HEADER} is still "
                               "in progress; retry later",
                               code="idempotency_key_in_progress", status=409,
                               headers={"Retry-After": "5"})
        store.wait(POLL_SECONDS)


def _run_recorded(view, kwargs: dict, store, scope: str, key: str):
    """Run ``view`` for the request that claimed ``key``, record its answer for retries (or
    release the key when it is not recordable), and return it."""
    try:
        try:
            resp = make_response(view(**kwargs))
            code = None
        except ServiceError as err:
            resp, code = render_error(err), err.code
    except BaseException:
        store.release(scope, key)     # e.g. 413 or an internal error: not replayed
        raise
    try:
        if recordable(resp.status_code, code) and not resp.is_streamed:
            store.finish(scope, key, Outcome(resp.status_code, resp.content_type,
                                             resp.get_data()))
        else:
            store.release(scope, key)
    except sqlite3.Error:
        # the work is done and its answer goes out; a record left "running" would hold
        # the key until this process ends, so it is dropped (a retry runs again)
        log.exception("idempotency record of %s %s not written", request.method,
                      request.path)
        try:
            store.release(scope, key)
        except sqlite3.Error:
            pass
    return resp
