"""Request helpers shared by the app factory and every blueprint (README §Architecture).

* :func:`services` — the :class:`~hermes_service.services.Services` of the current app;
* :func:`parse_json` / :func:`json_body` — strict JSON request bodies, validated with jsonschema;
* :func:`schema_problem` — a request body's jsonschema error as ``path: message``;
* :func:`register_error_shape` / :func:`render_error` — each route family renders a
  :class:`~hermes_service.errors.ServiceError` in its own contract's shape, chosen by URL prefix
  (v1 API: ``{"detail", "code", "requestId"}``; the mnote blueprints register theirs).

Blueprints import from here, never from ``app.py``; ``app.py`` imports the blueprints.
"""
from __future__ import annotations

import json
import math
from typing import TYPE_CHECKING, Callable

import jsonschema
from flask import current_app, g, jsonify, request

from .errors import BadRequest, ServiceError, schema_error

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


def json_body(schema: dict | None = None) -> dict:
    """The request's JSON object, validated with ``schema`` (jsonschema, Draft 2020-12).

    Raises BadRequest ``invalid_json`` (not strict JSON / not an object) or
    ``invalid_request`` naming the offending field (:func:`schema_problem`).
    """
    data = parse_json(request.get_data()) if request.content_length or request.data else None
    if not isinstance(data, dict):
        raise BadRequest("the request body must be a JSON object", code="invalid_json")
    if schema:
        err = first_schema_error(validator_for(schema), data)
        if err is not None:
            raise BadRequest(schema_problem(err), code="invalid_request")
    return data


def v1_error(err: ServiceError) -> dict:
    """The v1 API's error body (spec hermes-service-api-v1.3.0 has none; README §The v1 API)."""
    return {"detail": err.detail, "code": err.code, "requestId": g.get("request_id"), **err.extra}


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
