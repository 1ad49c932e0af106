"""Request helpers shared by the app factory and every blueprint (README §Architecture).

* :func:`services` — the :class:`~hermes_service.services.Services` of the current app;
* :func:`parse_json` / :func:`json_body` / :func:`has_body` — strict JSON request bodies (read
  whatever their Content-Type), validated with jsonschema;
* :func:`schema_problem` — a request body's jsonschema error as ``path: message``;
* :func:`register_error_shape` / :func:`render_error` — each route family renders a
  :class:`~hermes_service.errors.ServiceError` in its own contract's shape, chosen by URL prefix
  (v1 API: ``{"detail", "code", "requestId"}``; an extension's blueprints register theirs);
* :func:`documented` — a route's contract (parameters, request schema, responses, error codes),
  declared next to the route; :mod:`hermes_service.openapi` builds ``GET /openapi.json`` from
  these and refuses a route without one (README §API description). :func:`json_body` validates
  with the schema the contract declares, so the document and the check share one dict.

Blueprints import from here, never from ``app.py``; ``app.py`` imports the blueprints.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable

import jsonschema
from flask import current_app, g, jsonify, request

from .errors import ID_PATTERN, ID_RULE, BadRequest, ServiceError, schema_error

if TYPE_CHECKING:
    from .services import Services

ErrorRenderer = Callable[[ServiceError], dict]


def services() -> "Services":
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
    """A request body's schema error as ``a/b/0: message`` (:func:`~hermes_service.errors.schema_error`)."""
    path, reason = schema_error(err, limit)
    return f"{'/'.join(path)}: {reason}" if path else reason


def first_schema_error(validator: jsonschema.protocols.Validator, instance) -> jsonschema.ValidationError | None:
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
    (``request.data`` is empty for a body labelled as a form, as ``curl -d`` sends it)."""
    return bool(request.content_length or request.get_data())


def json_body(schema: dict | None = None) -> dict:
    """The request's JSON object, validated with ``schema`` (jsonschema, Draft 2020-12); by
    default the ``body`` of the route's :func:`documented` contract — the schema
    ``/openapi.json`` shows for the route.

    Raises BadRequest ``invalid_json`` (not strict JSON / not an object), ``invalid_id`` (a
    field of :data:`~hermes_service.errors.ID_SCHEMA` that is not an id) or
    ``invalid_request`` naming the offending field (:func:`schema_problem`).
    """
    if schema is None:
        contract = contract_of(current_app.view_functions.get(request.endpoint))
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
def _same(code: str) -> str:
    return code


@dataclass(frozen=True)
class ErrorFamily:
    """How one route family answers errors: the JSON schema of its error body (component
    ``name`` in the document), ``code``, the function mapping a core error code
    (:mod:`hermes_service.errors`) to the code its contract shows, and ``code_path``, where
    the code is in the body."""
    name: str
    schema: dict
    code: Callable[[str], str] = _same
    description: str = ""
    code_path: tuple[str, ...] = ("code",)


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
    from :data:`hermes_service.openapi.RESPONSE_HEADERS`."""
    description: str
    schema: dict | None = None
    media: dict | None = None
    headers: tuple[str, ...] = ()


@dataclass(frozen=True)
class Contract:
    """A route's documented contract (README §API description).

    ``family``: its error shape; ``auth``: ``key`` (API key and scope), ``health``/``docs``
    (API key only when ``security.health_requires_api_key``/``docs_requires_api_key``) or
    ``run_token`` (the tool endpoint); ``body``: the request schema :func:`json_body`
    validates with (``body_required`` False: an empty body is allowed;
    ``body_for_config(body, config)``: the body as the document shows it when a rule depends on
    the config); ``params``;
    ``replies``: status → :class:`Reply`; ``errors``: status → core error codes this route
    raises itself (the authentication, body and internal errors every route of its kind can
    answer are added by the document builder). ``links``: OpenAPI links of the 200 reply,
    ``name → (endpoint, {parameter: runtime expression})``.
    """
    summary: str
    family: ErrorFamily
    replies: dict
    auth: str = "key"
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
        @documented(summary="Create a session", family=V1_ERRORS, body=CREATE_SESSION, ...)
        def create_session(): ...

    The view's docstring becomes the operation's description.
    """
    made = Contract(**contract)

    def attach(view: Callable) -> Callable:
        view.__contract__ = made
        return view
    return attach


def contract_of(view: Callable | None) -> Contract | None:
    """The :class:`Contract` declared for a view function (None: undocumented)."""
    return getattr(view, "__contract__", None)


#: the v1 API's error body (README §The v1 API); ``err.extra`` may add fields
V1_ERROR = {"type": "object", "required": ["detail", "code", "requestId"],
            "properties": {"detail": {"type": "string"}, "code": {"type": "string"},
                           "requestId": {"type": "string"}}}
V1_ERRORS = ErrorFamily("V1Error", V1_ERROR, description="v1 API error")


def v1_error(err: ServiceError) -> dict:
    """The v1 API's error body (spec hermes-service-api-v1.3.0 has none; README §The v1 API)."""
    return {"detail": err.detail, "code": err.code, "requestId": g.get("request_id"), **err.extra}


def register_components(app, schemas: dict[str, dict]) -> None:
    """Named schemas for the OpenAPI document (``#/components/schemas/<name>``), e.g. the
    event payloads a route's contract refers to with ``{"$ref": …}``."""
    app.extensions.setdefault("openapi_components", {}).update(schemas)


def register_tags(app, tags: list[dict]) -> None:
    """OpenAPI tags (``{"name", "description"}``) of an extension's routes, listed after the
    core's in the document."""
    app.extensions.setdefault("openapi_tags", []).extend(tags)


def register_error_shape(app, prefix: str, renderer: ErrorRenderer) -> None:
    """Render errors of requests under ``prefix`` with ``renderer`` (longest prefix wins)."""
    app.extensions.setdefault("error_shapes", []).append((prefix, renderer))


def render_error(err: ServiceError):
    """The JSON response for ``err`` in the shape of the request's route family."""
    renderer, best = v1_error, ""
    for prefix, fn in current_app.extensions.get("error_shapes", []):
        if request.path.startswith(prefix) and len(prefix) > len(best):
            renderer, best = fn, prefix
    resp = jsonify(renderer(err))
    resp.status_code = err.status
    for k, v in err.headers.items():
        resp.headers[k] = v
    return resp
