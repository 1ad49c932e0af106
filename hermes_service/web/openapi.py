"""The service describes itself: ``GET /openapi.json`` (OpenAPI 3.1) and ``GET /docs``
(docs/api-description.md).

The document is assembled with apispec from the app's own URL map. Every route declares its
contract next to it (:func:`hermes_service.web.helpers.documented`): parameters, the request
schema — the very dict :func:`~hermes_service.web.helpers.json_body` validates the request
with — and its responses. The builder adds what every route of a kind can answer (key and
address errors, strict-JSON and size errors for routes with a body, ``internal_error``), maps
core error codes to each route family's codes with the family's own mapping
(:attr:`~hermes_service.web.helpers.ErrorFamily.code`, e.g. the client proxy's) and writes the
codes of each status as an ``enum`` of the error body, so a response with an undocumented code
fails its schema.

What depends on the config is read from it when the document is served: the API-key scheme
(``security.auth_method``, ``api_key_header``, ``enable_api_key``), whether ``/health`` and the
documentation need a key (``health_requires_api_key``, ``docs_requires_api_key``), what a
contract's ``body_for_config`` reads (e.g. the model ids a run may name). A reload changes the
document with the config.

A route without a contract, or a contract whose path parameters differ from its rule, is a
programming error: :func:`build_document` raises :class:`UndocumentedRoute`, and the app
factory builds the document once so such an app does not start.

``GET /docs`` serves Swagger UI from the ``flask-swagger-ui`` package's files (served locally:
no CDN, no ``https://`` asset reference; its validator badge, which would send the document to
an outside service, is off) under a Content-Security-Policy that allows this origin only.
"""
from __future__ import annotations

import inspect
import re
from importlib.util import find_spec
from pathlib import Path

from apispec import APISpec
from flask import Blueprint, Flask, Response, current_app, jsonify, send_from_directory
from werkzeug.routing import Rule

from ..errors import ID_PATTERN, NotFound
from . import routing
from .helpers import V1_ERRORS, Contract, Param, Reply, contract_of, documented, services
from .routing import OPEN_UNLESS, RUN_TOKEN, ErrorFamily, RouteFamily, declare

OPENAPI_VERSION = "3.1.0"
API_VERSION = "1.3.0"
AUTOMATIC_METHODS = {"HEAD", "OPTIONS"}      # Flask answers these for every rule itself

#: response headers a :class:`~hermes_service.web.helpers.Reply` may name (X-Request-Id is on all);
#: an extension adds its own (:func:`~hermes_service.web.helpers.register_response_headers`)
RESPONSE_HEADERS = {
    "X-Request-Id": {"description": "the request id (the caller's X-Request-Id when it is "
                                    "[A-Za-z0-9_.:-]{1,64}, else a new one); logged with the "
                                    "request", "schema": {"type": "string"}},
    "Retry-After": {"description": "seconds to wait before retrying",
                    "schema": {"type": "string", "pattern": "^[0-9]+$"}},
    "WWW-Authenticate": {"description": "the Bearer challenge (auth_method: bearer)",
                         "schema": {"type": "string"}},
    "Cache-Control": {"description": "no-cache / no-store", "schema": {"type": "string"}},
    "X-Accel-Buffering": {"description": "`no`: nginx must not buffer the stream",
                          "schema": {"const": "no"}},
    "Content-Security-Policy": {"description": "this origin only", "schema": {"type": "string"}},
    "Location": {"description": "where the resource is, relative to this URL",
                 "schema": {"type": "string"}},
    "Idempotency-Replayed": {"description": "`true`: this is the recorded outcome of the first "
                                            "request with this Idempotency-Key (docs/v1-api.md "
                                            "§Idempotent retries); absent otherwise",
                             "schema": {"type": "string", "enum": ["true"]}},
}
#: a request header that makes a route answer :data:`IDEMPOTENT_REPLY_HEADER` on replays
IDEMPOTENCY_PARAM = "Idempotency-Key"
IDEMPOTENT_REPLY_HEADER = "Idempotency-Replayed"
#: the core's tags; an extension adds its own after them
#: (:func:`~hermes_service.web.helpers.register_tags`)
TAGS = [
    {"name": "v1", "description": "The v1 REST API (spec hermes-service-api-v1.3.0; "
                                  "docs/v1-api.md). Errors: `{detail, code, requestId}`."},
    {"name": "health", "description": "Liveness (docs/v1-api.md §Health)."},
    {"name": "operations", "description": "Metrics (docs/operations.md)."},
    {"name": "docs", "description": "This document and its page (docs/api-description.md)."},
]
#: the document's description; ``{serves}`` and ``{errors}`` list the v1 API's and then each
#: extension's routes and error shapes (:func:`~hermes_service.web.helpers.register_description`)
DESCRIPTION = """\
The Hermes Agent CLI behind a REST API: {serves}.

**Authentication.** Every route needs an allowed client address (`security.allowed_ips`; 403)
and, except routes that take a run token and — per config — `/health` and this document, an
API key (the `ApiKey` scheme; 401). A key may call only the route families its `scopes` name
(403 `insufficient_scope`): each operation says which scope it needs.

**Errors** come in the shape of the route's family, each code listed under its status:
{errors}. A body larger than `service.max_body_bytes` is
refused by the HTTP server itself with a plain-text 413. Every response carries `X-Request-Id`.

This document is generated from the routes and the schemas the service validates requests
with, for this node's configuration (docs/api-description.md).
"""


class UndocumentedRoute(RuntimeError):
    """A route has no contract (:func:`~hermes_service.web.helpers.documented`), or its contract
    does
    not match its rule."""


def openapi_path(rule: str) -> str:
    """``/a/<x>/b/<path:y>`` → ``/a/{x}/b/{y}``."""
    return re.sub(r"<(?:[^:<>]+:)?([^<>]+)>", r"{\1}", rule)


def _methods(rule: Rule) -> list[str]:
    """The methods ``rule`` answers that the document describes (not HEAD, OPTIONS)."""
    return sorted((rule.methods or set()) - AUTOMATIC_METHODS)


def _operation_ids(app: Flask) -> dict[tuple[str, str], str]:
    """(endpoint, method) → operationId: the endpoint's name, plus the method when one
    endpoint answers several."""
    ids = {}
    for rule in app.url_map.iter_rules():
        methods = _methods(rule)
        for method in methods:
            base = rule.endpoint.replace(".", "_")
            ids[(rule.endpoint, method)] = f"{base}_{method.lower()}" if len(methods) > 1 else base
    return ids


def _mentions_id(schema) -> bool:
    """True if an id field (errors.ID_SCHEMA) is anywhere in ``schema``."""
    if isinstance(schema, dict):
        return schema.get("pattern") == ID_PATTERN or any(_mentions_id(v) for v in schema.values())
    if isinstance(schema, list):
        return any(_mentions_id(v) for v in schema)
    return False


def _common_errors(contract: Contract, family: RouteFamily, config) -> dict[int, list[str]]:
    """Core codes every route of this family may answer besides its own."""
    sec = config.security
    out: dict[int, list[str]] = {}
    needs_key = sec.enable_api_key and family.needs_key(sec)
    if family.auth != RUN_TOKEN:
        if needs_key:
            out[401] = ["missing_api_key", "invalid_api_key", "api_key_expired"]
        forbidden = ["ip_not_allowed"] if sec.enable_ip_check else []
        if needs_key and family.scope:
            forbidden.append("insufficient_scope")
        if forbidden:
            out[403] = forbidden
    # any request: ambiguous body framing, refused before the app (web/framing.py)
    out[400] = ["bad_request_framing"]
    if contract.body is not None:
        out.setdefault(400, []).extend(["invalid_json", "invalid_request"])
        if _mentions_id(contract.body):
            out[400].append("invalid_id")
        out[413] = ["payload_too_large"]
    out[500] = ["internal_error"]
    return out


def _code_schema(family, codes: list[str]) -> dict:
    """The family's error body with ``code`` (at the family's place) limited to ``codes``."""
    inner: dict = {"enum": codes}
    for key in reversed(family.code_path):
        inner = {"properties": {key: inner}}
    return {"allOf": [{"$ref": f"#/components/schemas/{family.name}"}, inner]}


def response_headers(app: Flask) -> dict[str, dict]:
    """The response headers ``app``'s replies may name: :data:`RESPONSE_HEADERS` and those its
    extensions registered (:func:`~hermes_service.web.helpers.register_response_headers`).
    ValueError
    when an extension's names one of the core's."""
    theirs = app.extensions.get("openapi_response_headers", {})
    taken = sorted(set(theirs) & set(RESPONSE_HEADERS))
    if taken:
        raise ValueError(f"response headers already described by the core: {', '.join(taken)}")
    return {**RESPONSE_HEADERS, **theirs}


def _headers(names, status: int, bearer: bool, idempotent: bool = False,
             known: dict = RESPONSE_HEADERS) -> dict:
    # every answer of the service carries X-Request-Id; waitress's own 413 does not
    out: dict[str, dict] = {
        "X-Request-Id": {**RESPONSE_HEADERS["X-Request-Id"], "required": status != 413}}
    if idempotent and status < 500 and status != 429:    # an outcome that may be replayed
        names = (*names, IDEMPOTENT_REPLY_HEADER)
    for name in names:
        out[name] = known[name]
    if status in (429, 503):
        out["Retry-After"] = RESPONSE_HEADERS["Retry-After"]
    if status == 401 and bearer:
        out["WWW-Authenticate"] = RESPONSE_HEADERS["WWW-Authenticate"]
    return out


def _param(p: Param) -> dict:
    out = {"name": p.name, "in": p.where, "schema": p.schema,
           "required": True if p.where == "path" else p.required}
    if p.description:
        out["description"] = p.description
    return out


def _operation(app, rule, method: str, contract: Contract, family: RouteFamily, config, op_ids,
               view) -> dict:
    path = rule.rule
    sec = config.security
    bearer = sec.auth_method == "bearer"
    declared = {p.name for p in contract.params if p.where == "path"}
    if declared != set(rule.arguments):
        raise UndocumentedRoute(f"{method} {path}: path parameters {sorted(rule.arguments)} "
                                f"but the contract declares {sorted(declared)}")
    description = inspect.cleandoc(view.__doc__ or "")
    if family.auth == routing.KEY and sec.enable_api_key and family.scope:
        description += f"\n\n**Scope:** `{family.scope}`."
    op: dict = {"operationId": op_ids[(rule.endpoint, method)], "summary": contract.summary,
                "description": description.strip(), "tags": list(contract.tags),
                "parameters": [_param(p) for p in contract.params]
                + ["RequestId"]}
    if contract.deprecated:
        op["deprecated"] = True
    needs_key = sec.enable_api_key and family.needs_key(sec)
    op["security"] = ([{"RunToken": []}] if family.auth == RUN_TOKEN
                      else [{"ApiKey": []}] if needs_key else [])
    if contract.body is not None:
        body = contract.body
        if contract.body_for_config is not None:
            body = contract.body_for_config(body, config)
        op["requestBody"] = {"required": contract.body_required,
                             "content": {"application/json": {"schema": body}}}
    responses: dict = {}
    idempotent = any(p.name == IDEMPOTENCY_PARAM for p in contract.params)
    for status, reply in sorted(contract.replies.items()):
        responses[str(status)] = _success(reply, status, bearer, contract, op_ids, idempotent,
                                          response_headers(app))
    errors = _common_errors(contract, family, config)
    shape = family.errors
    for status, codes in contract.errors.items():
        errors.setdefault(status, []).extend(codes)
    both = set(errors) & set(contract.replies)
    if both:
        raise UndocumentedRoute(f"{method} {path}: status {sorted(both)} is both a reply and an "
                                "error of the contract")
    for status in sorted(errors):
        mapped = list(dict.fromkeys(shape.code(c) for c in errors[status]))
        content = {"application/json": {"schema": _code_schema(shape, mapped)}}
        if status == 413:
            content["text/plain"] = {"schema": {"type": "string", "description":
                                                "waitress's own answer to a body over "
                                                "service.max_body_bytes"}}
        responses[str(status)] = {"description": ", ".join(f"`{c}`" for c in mapped),
                                  "headers": _headers((), status, bearer, idempotent),
                                  "content": content}
    op["responses"] = responses
    return op


def _success(reply: Reply, status: int, bearer: bool, contract: Contract, op_ids,
             idempotent: bool = False, known: dict = RESPONSE_HEADERS) -> dict:
    out: dict = {"description": reply.description,
                 "headers": _headers(reply.headers, status, bearer, idempotent, known)}
    if reply.media is not None:
        out["content"] = reply.media
    elif reply.schema is not None:
        out["content"] = {"application/json": {"schema": reply.schema}}
    if contract.links and status == 200:
        links = {}
        for name, (endpoint, params) in contract.links.items():
            target = [v for (ep, _), v in op_ids.items() if ep == endpoint]
            if len(target) != 1:
                raise UndocumentedRoute(f"link {name}: no single operation for {endpoint}")
            links[name] = {"operationId": target[0], "parameters": params}
        out["links"] = links
    return out


def _description(app) -> str:
    """:data:`DESCRIPTION` with the v1 API's and the extensions' routes and error shapes
    (:func:`~hermes_service.web.helpers.register_description`)."""
    parts = [("the v1 API", "v1 `{detail, code, requestId}`"),
             *app.extensions.get("openapi_description", [])]
    serves = [s for s, _ in parts]
    serves = serves[0] if len(serves) == 1 else ", ".join(serves[:-1]) + " and " + serves[-1]
    return DESCRIPTION.format(serves=serves, errors="; ".join(e for _, e in parts))


def build_document(app: Flask, config) -> dict:
    """The OpenAPI 3.1 document of ``app``'s routes for ``config`` (a dict, JSON-ready).

    Raises :class:`UndocumentedRoute` naming every route without a contract, and every route
    outside the route families of its blueprint (:func:`hermes_service.web.routing.problems`).
    """
    sec = config.security
    spec = APISpec(title="hermes-service", version=API_VERSION, openapi_version=OPENAPI_VERSION,
                   info={"description": _description(app)},
                   tags=[*TAGS, *app.extensions.get("openapi_tags", [])])
    if sec.auth_method == "bearer":
        spec.components.security_scheme("ApiKey", {
            "type": "http", "scheme": "bearer",
            "description": "an API key as `Authorization: Bearer <key>` (security.api_keys)"})
    else:
        spec.components.security_scheme("ApiKey", {
            "type": "apiKey", "in": "header", "name": sec.api_key_header,
            "description": "an API key (security.api_keys)"})
    if any(f.auth == RUN_TOKEN for f in routing.registered(app)):
        spec.components.security_scheme("RunToken", {
            "type": "http", "scheme": "bearer",
            "description": "the run token of a running run (its run file; never an API key)"})
    spec.components.parameter("RequestId", "header", {
        "name": "X-Request-Id", "schema": {"type": "string"},
        "description": "a request id to keep (when it is [A-Za-z0-9_.:-]{1,64}; otherwise a "
                       "new one is made, never an error)"})
    for name, schema in sorted(app.extensions.get("openapi_components", {}).items()):
        spec.components.schema(name, schema)

    op_ids = _operation_ids(app)
    families: dict[str, ErrorFamily] = {}
    paths: dict[str, dict] = {}
    missing: list[str] = []
    outside = routing.problems(app)
    for rule in sorted(app.url_map.iter_rules(), key=lambda r: r.rule):
        view = app.view_functions[rule.endpoint]
        contract = contract_of(view)
        if contract is None:
            missing.append(f"{','.join(_methods(rule))} {rule.rule} "
                           f"({rule.endpoint})")
            continue
        family = routing.family_of(app, rule)
        if family is None:
            continue                               # in ``outside``
        families[family.errors.name] = family.errors
        ops = paths.setdefault(openapi_path(rule.rule), {})
        for method in _methods(rule):
            ops[method.lower()] = _operation(app, rule, method, contract, family, config, op_ids,
                                             view)
    if missing or outside:
        raise UndocumentedRoute("; ".join(
            ([f"routes without a contract (hermes_service.web.helpers.documented): "
              f"{'; '.join(missing)}"]
             if missing else [])
            + ([f"routes outside a route family: {'; '.join(outside)}"] if outside else [])))
    for name, errors in sorted(families.items()):
        spec.components.schema(name, {**errors.schema, "description": errors.description})
    for path, ops in paths.items():
        spec.path(path=path, operations=ops)
    return spec.to_dict()


def document() -> dict:
    """The document for the running config (rebuilt after a reload)."""
    config = services().config
    cached = current_app.extensions.get("openapi_document")
    if cached is None or cached[0] is not config:
        cached = current_app.extensions["openapi_document"] = (config, build_document(
            current_app, config))
    return cached[1]


# -- the routes ------------------------------------------------------------------------------
#: the API description's family: an allowed address, and an API key (any scope) unless
#: ``security.docs_requires_api_key`` is false
DOCS = RouteFamily("docs", ("/openapi.json", "/docs/"), V1_ERRORS, auth=OPEN_UNLESS,
                   key_setting="docs_requires_api_key")
bp = declare(Blueprint("docs", __name__), DOCS)


def _package_dir(name: str) -> Path:
    spec = find_spec(name)
    if spec is None or spec.origin is None:
        raise ImportError(f"{name} is not installed")
    return Path(spec.origin).parent


SWAGGER_UI_DIR = _package_dir("flask_swagger_ui") / "dist"
#: the Swagger UI files /docs uses (from the flask-swagger-ui package), and our start script
DOCS_ASSETS = ("swagger-ui.css", "swagger-ui-bundle.js", "favicon-32x32.png",
               "favicon-16x16.png", "docs.js")
DOCS_CSP = ("default-src 'self'; img-src 'self' data:; style-src 'self' 'unsafe-inline'; "
            "script-src 'self'; connect-src 'self'; object-src 'none'; base-uri 'none'; "
            "frame-ancestors 'none'")
DOCS_HTML = """<!DOCTYPE html>
<html lang="en">
<head>
  <meta charset="utf-8">
  <title>hermes-service API</title>
  <link rel="stylesheet" href="docs/swagger-ui.css">
  <link rel="icon" type="image/png" href="docs/favicon-32x32.png" sizes="32x32">
  <link rel="icon" type="image/png" href="docs/favicon-16x16.png" sizes="16x16">
</head>
<body>
  <noscript>The API description is <a href="openapi.json">openapi.json</a>.</noscript>
  <div id="swagger-ui"></div>
  <script src="docs/swagger-ui-bundle.js"></script>
  <script src="docs/docs.js"></script>
</body>
</html>
"""
# relative URLs: /docs → openapi.json = /openapi.json, also behind a path-prefixing proxy
DOCS_JS = """window.addEventListener("load", function () {
  window.ui = SwaggerUIBundle({
    url: "openapi.json", dom_id: "#swagger-ui", deepLinking: true,
    presets: [SwaggerUIBundle.presets.apis], layout: "BaseLayout",
    validatorUrl: null, withCredentials: false, displayRequestDuration: true
  });
});
"""
_DOCS = {"tags": ("docs",)}
_HTML = {"text/html": {"schema": {"type": "string"}}}


@bp.get("/openapi.json")
@documented(summary="This document", **_DOCS,
            replies={200: Reply("the OpenAPI 3.1 document",
                                {"type": "object", "required": ["openapi", "info", "paths"]})})
def openapi_json():
    """The service's OpenAPI 3.1 description, for this node's configuration. Needs an API key
    unless ``security.docs_requires_api_key`` is false (any valid key; no scope)."""
    return jsonify(document())


@bp.get("/docs")
@documented(summary="The API's page (Swagger UI)", **_DOCS,
            replies={200: Reply("a page that reads openapi.json", media=_HTML,
                                headers=("Content-Security-Policy",))})
def docs_page():
    """A readable page of this document (Swagger UI, served from this service: no outside
    address is used). Needs an API key unless ``security.docs_requires_api_key`` is false."""
    return Response(DOCS_HTML, mimetype="text/html", headers={"Content-Security-Policy": DOCS_CSP})


@bp.get("/docs/")
@documented(summary="The API's page, addressed with a trailing slash", **_DOCS,
            replies={308: Reply("the page is at `/docs` (`Location: ../docs`)",
                                headers=("Location",))})
def docs_slash():
    """Redirects to ``/docs`` (308; the same key rule as the page). The ``Location`` is
    relative (``../docs``), so the redirect also works behind a proxy that serves the service
    under a path prefix (RFC 9110 §10.2.2: a relative reference, resolved against the request
    URL)."""
    return Response(status=308, headers={"Location": "../docs"})


_ASSET_TYPES = {".css": "text/css", ".js": "text/javascript", ".png": "image/png"}


@bp.get("/docs/<asset>")
@documented(summary="A file of the API's page", **_DOCS,
            params=(Param("asset", "path", {"enum": list(DOCS_ASSETS)}, "the file"),),
            replies={200: Reply("the file", media={t: {"schema": {"type": "string"}}
                                                   for t in sorted(set(_ASSET_TYPES.values()))},
                                headers=("Cache-Control",))},
            errors={404: ("not_found",)})
def docs_asset(asset):
    """Swagger UI's files (from the ``flask-swagger-ui`` package) and the page's start script."""
    if asset not in DOCS_ASSETS:
        raise NotFound(f"no such file: {asset}", code="not_found")
    if asset == "docs.js":
        resp = Response(DOCS_JS, mimetype="text/javascript")
    else:
        resp = send_from_directory(SWAGGER_UI_DIR, asset, max_age=3600,
                                   mimetype=_ASSET_TYPES[Path(asset).suffix])
    resp.headers["Cache-Control"] = "public, max-age=3600"
    return resp
