"""Operations routes: ``GET /metrics`` (docs/operations.md §Metrics).

The instruments are :mod:`hermes_service.metrics`; this blueprint only serves their
exposition. Allowlist and API key like every route, and the key's ``scopes``
(``security.api_keys[].scopes``; ``[v1, client]`` when it lists none) must include ``metrics``
(403 ``insufficient_scope``).
"""
from __future__ import annotations

from flask import Blueprint, Response, request
from prometheus_client.exposition import choose_encoder

from ..metrics import REGISTRY
from .helpers import V1_ERRORS, Reply, documented
from .routing import RouteFamily, declare

#: ``/metrics``: an allowed address and an API key with the ``metrics`` scope
#: (the request hooks check it, before the view)
METRICS = RouteFamily("metrics", ("/metrics/",), V1_ERRORS, scope="metrics")
bp = declare(Blueprint("metrics", __name__), METRICS)

_EXPOSITION = {"text/plain": {"schema": {"type": "string",
                                         "description": "Prometheus text format 0.0.4"}},
               "application/openmetrics-text": {"schema": {
                   "type": "string", "description": "OpenMetrics 1.0 (when Accept asks for it)"}}}


@bp.get("/metrics")
@documented(summary="Prometheus metrics", tags=("operations",),
            replies={200: Reply("this process's metrics (docs/operations.md §Metrics)",
                                media=_EXPOSITION, headers=("Cache-Control",))},
            errors={403: ("insufficient_scope",)})
def metrics():
    """Prometheus text format (OpenMetrics when the scraper asks for it).

    Needs what every route needs (allowlist, API key); the key's scopes must include
    ``metrics`` (a key that lists none has ``[v1, client]``), else 403 ``insufficient_scope``.
    """
    encoder, content_type = choose_encoder(request.headers.get("Accept", ""))
    return Response(encoder(REGISTRY), content_type=content_type,
                    headers={"Cache-Control": "no-store"})
