"""The mnote outer blueprint (contracts: hermes-client-proxy-contract-v1,
mnote-hermes-plugin-tool-contract-v1).

* :mod:`.client` — ``/api/hermes/client/*``, the page AI panel's routes (runs, events, abort);
* :mod:`.endpoint` + :mod:`.gateway` — ``POST /api/hermes/tools/invoke`` and run tokens;
* :mod:`.tools` + :mod:`.schemas` — the six ``mnote.*`` tools: registry, schemas, executor;
* :mod:`.page_store` — the page store interface and its SQLite adapter;
* :mod:`.events` — the run events as JSON schemas (the OpenAPI document).
"""
from __future__ import annotations

from flask import Flask


def register(app: Flask) -> None:
    """Register the mnote blueprints (with their route families: auth, scopes, error shapes;
    :mod:`hermes_service.routing`) on ``app``."""
    from ..web import register_components
    from . import client, endpoint, events
    app.register_blueprint(client.bp)
    app.register_blueprint(client.legacy_bp)
    app.register_blueprint(endpoint.bp)
    register_components(app, events.COMPONENTS)     # the run events in /openapi.json
    register_components(app, endpoint.COMPONENTS)   # the tool envelope
