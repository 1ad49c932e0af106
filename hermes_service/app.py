"""Flask app factory: service objects, request hooks, error handlers, blueprints
(docs/architecture.md).

Data flows one way: blueprint → service objects (:mod:`hermes_service.services`) → runner/store.
Extensions (:mod:`hermes_service.installed`) add their objects and blueprints here.
"""
from __future__ import annotations

import logging
import types

from flask import Flask
from werkzeug.exceptions import HTTPException

from . import installed
from .config import Config
from .errors import ServiceError, StorageFull, TooLarge, storage_full
from .services import build_services
from .web import hooks, openapi, ops, routing
from .web.api_v1 import bp as v1
from .web.helpers import render_error

log = logging.getLogger("hermes_service")


class ServiceFlask(Flask):
    """:class:`flask.Flask` that asks once per function whether it is a coroutine function.

    Flask calls :meth:`~flask.Flask.ensure_sync` for every request hook and view of every
    request (its documented override point), and the stock one inspects the function each
    time (``inspect.iscoroutinefunction``, ~2 µs; five calls per request here: the three
    before-request hooks, the view, the access log — docs/benchmarks.md, request cost).
    Plain functions are remembered; anything else (bound methods, partials, async functions)
    goes to the stock method as before."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._sync_functions: set = set()

    def ensure_sync(self, func):
        if type(func) is not types.FunctionType:
            return super().ensure_sync(func)
        if func not in self._sync_functions:
            made = super().ensure_sync(func)
            if made is not func:
                return made                 # an async def: wrapped each time, as stock
            self._sync_functions.add(func)
        return func


def create_app(config: Config, service_url: str | None = None) -> Flask:
    """Build the WSGI app for ``config``.

    ``service_url`` is where Hermes processes reach this service (the serve command's
    address; an extension may prefer one of its config). Every extension ``config`` enables
    registers its routes here (:meth:`~hermes_service.extensions.Extension.init_app`).

    Raises :class:`~hermes_service.session_store.CorruptStore` if the session
    registry cannot be opened (the service must not start), and
    :class:`~hermes_service.web.openapi.UndocumentedRoute` if a route declares no contract.
    """
    app = ServiceFlask(__name__, static_folder=None)   # no /static route: every route is documented
    app.config["MAX_CONTENT_LENGTH"] = config.service.max_body_bytes
    app.json.ensure_ascii = False  # type: ignore[attr-defined]
    app.json.sort_keys = False  # type: ignore[attr-defined]
    svc = app.extensions["hermes_service"] = build_services(config, service_url)

    cors = config.cors
    if cors.allow_origins:
        from flask_cors import CORS
        CORS(app, origins=list(cors.allow_origins), supports_credentials=cors.allow_credentials,
             methods=list(cors.allow_methods), allow_headers=list(cors.allow_headers),
             expose_headers=["X-Request-Id", "Retry-After", "Idempotency-Replayed"])

    hooks.install(app)

    @app.errorhandler(ServiceError)
    def on_service_error(err):
        return render_error(err)

    @app.errorhandler(HTTPException)
    def on_http_error(err):
        if err.code == 413:
            return render_error(TooLarge(f"request body exceeds {app.config['MAX_CONTENT_LENGTH']} "
                                         "bytes", code="payload_too_large"))
        codes = {404: "not_found", 405: "method_not_allowed", 400: "invalid_request"}
        # keep what the exception says besides its body: a 405 must name the methods the
        # route answers (Allow, RFC 9110 §15.5.6)
        headers = {k: v for k, v in err.get_headers() if k.lower() != "content-type"}
        return render_error(ServiceError(err.description or err.name,
                                         code=codes.get(err.code, "http_error"), status=err.code,
                                         headers=headers))

    @app.errorhandler(Exception)
    def on_unexpected(err):
        from flask import g
        if storage_full(err):      # a full disk is expected, never a 500 (docs/sandbox.md §Disk)
            log.error("a write failed for want of space rid=%s: %s", g.get("request_id"), err)
            return render_error(StorageFull("the service's disk is full; retry when an "
                                            "operator has freed space",
                                            headers={"Retry-After": "60"}))
        log.exception("unhandled error rid=%s", g.get("request_id"))
        return render_error(ServiceError("internal error", code="internal_error"))

    app.register_blueprint(v1)
    app.register_blueprint(ops.bp)
    for ext in installed.enabled(config):
        ext.init_app(app, svc)
    app.register_blueprint(openapi.bp)
    # what a sandbox may call here through its own socket: the routes that take a run token
    svc.sandbox.sandbox_routes(path for family in routing.registered(app)
                               if family.auth == routing.RUN_TOKEN for path in family.paths)
    # every route must declare its contract: an undocumented one stops the app here
    # (UndocumentedRoute), so no test and no start passes with it (docs/api-description.md)
    openapi.build_document(app, config)
    return app
