"""Route families: who may call a route, with what, and how its errors look — one record per
family, declared by the blueprint that serves it (docs/architecture.md, docs/configuring.md §API
keys).

A :class:`RouteFamily` names

* ``paths`` — where the family lives: ``/a/b/`` (trailing slash) owns ``/a/b`` and everything
  under it, ``/a`` only that path. They place the requests that match no route (404, 405);
  a route's own rule must lie under a family of its blueprint (:func:`problems`);
* ``auth`` — :data:`KEY` (allowed address + API key), :data:`OPEN_UNLESS` (allowed address; an
  API key only when the ``security.<key_setting>`` flag is true: ``/health``, the API
  description) or :data:`RUN_TOKEN` (loopback peers without proxy headers; the route checks
  its run token itself: the mnote tool endpoint);
* ``scope`` — the ``security.api_keys[].scopes`` entry a key needs (None: any valid key);
* ``bearer`` — its clients send the key as ``Authorization: Bearer`` whatever
  ``security.auth_method`` says (the OpenAI-compatible routes: every OpenAI client does);
* ``errors`` — its :class:`ErrorFamily`: the error body's schema for the API document and the
  renderer the app answers errors with.

Readers: the request hooks (:mod:`hermes_service.web.hooks`: address, key, scope), the error
responses (:func:`hermes_service.web.helpers.render_error`) and the API document
(:mod:`hermes_service.web.openapi`: security, scope, error shapes). A request of no family (a path
no family owns, e.g. ``/``) needs an API key of any scope and gets the v1 error shape.

:func:`declare` attaches families to a blueprint when it is created; registering the blueprint
adds them to the app, so an extension's families come and go with its blueprints.
:func:`current` is the request's family: the matched endpoint's, computed once per endpoint
and cached, or for a request that matched no route the family owning its path.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from flask import Blueprint, Flask, current_app, request
from flask.sansio.app import App
from werkzeug.routing import Rule

from ..config import SecuritySettings
from ..errors import ServiceError

KEY, OPEN_UNLESS, RUN_TOKEN = "key", "open_unless", "run_token"
_EXTENSION = "route_families"


def _same(code: str) -> str:
    return code


@dataclass(frozen=True)
class ErrorFamily:
    """How one route family answers errors: the JSON schema of its error body (component
    ``name`` in the document), ``code``, the function mapping a core error code
    (:mod:`hermes_service.errors`) to the code its contract shows, ``code_path``, where
    the code is in the body, and ``render``, the body of a :class:`~.errors.ServiceError`
    (a dict, JSON-ready)."""
    name: str
    schema: dict
    code: Callable[[str], str] = _same
    description: str = ""
    code_path: tuple[str, ...] = ("code",)
    render: Callable[[ServiceError], dict] | None = None


@dataclass(frozen=True, eq=False)
class RouteFamily:
    """One route family's policy (module doc). Raises ValueError when ``auth`` and
    ``key_setting`` do not fit (``key_setting`` is for :data:`OPEN_UNLESS` only) or the error
    family has no renderer."""
    name: str
    paths: tuple[str, ...]
    errors: ErrorFamily
    auth: str = KEY
    scope: str | None = None
    key_setting: str | None = None
    bearer: bool = False

    def __post_init__(self):
        if self.auth not in (KEY, OPEN_UNLESS, RUN_TOKEN):
            raise ValueError(f"{self.name}: unknown auth {self.auth!r}")
        if (self.auth == OPEN_UNLESS) != (self.key_setting is not None):
            raise ValueError(f"{self.name}: key_setting goes with auth {OPEN_UNLESS!r} only")
        if self.errors.render is None:
            raise ValueError(f"{self.name}: error family {self.errors.name} has no renderer")
        if not self.paths or not all(p.startswith("/") for p in self.paths):
            raise ValueError(f"{self.name}: paths must be absolute")

    def owns(self, path: str) -> int:
        """How closely the family owns ``path``: the length of its longest entry owning it,
        0 when none does (the longest owner wins among families)."""
        best = 0
        for entry in self.paths:
            if entry.endswith("/") and entry != "/":     # "/" itself: that path only
                hit = path.startswith(entry) or path == entry[:-1]
            else:
                hit = path == entry
            if hit and len(entry) > best:
                best = len(entry)
        return best

    def needs_key(self, security: SecuritySettings) -> bool:
        """Does a request of this family present an API key (when ``security.enable_api_key``
        is on)? ``security``: the config's ``security`` section."""
        if self.auth == OPEN_UNLESS:
            return bool(getattr(security, str(self.key_setting)))
        return self.auth == KEY


def declare(bp: Blueprint, *families: RouteFamily) -> Blueprint:
    """Attach ``families`` to ``bp`` (its routes belong to them) and make registering ``bp``
    add them to the app. Returns ``bp``::

        bp = declare(Blueprint("api_v1", __name__), V1, EXECUTE, HEALTH)
    """
    bp.route_families = families  # type: ignore[attr-defined]
    bp.record_once(lambda state: _table(state.app).add(families))
    return bp


class _Table:
    """An app's families and the family of each endpoint (filled on first use)."""

    def __init__(self):
        self.families: list[RouteFamily] = []
        self.by_endpoint: dict[str, RouteFamily | None] = {}

    def add(self, families) -> None:
        self.families.extend(f for f in families if f not in self.families)
        self.by_endpoint.clear()

    def for_path(self, path: str) -> RouteFamily | None:
        best, depth = None, 0
        for family in self.families:
            n = family.owns(path)
            if n > depth:
                best, depth = family, n
        return best

    def for_rule(self, app: Flask, rule: Rule) -> RouteFamily | None:
        try:
            return self.by_endpoint[rule.endpoint]
        except KeyError:
            pass
        family = self.for_path(rule.rule)
        if family is not None and family not in _declared(app, rule.endpoint):
            family = None
        self.by_endpoint[rule.endpoint] = family
        return family


def _table(app: App) -> _Table:
    table = app.extensions.get(_EXTENSION)
    if table is None:
        table = app.extensions[_EXTENSION] = _Table()
    return table


def _declared(app: Flask, endpoint: str) -> tuple[RouteFamily, ...]:
    """The families the blueprint of ``endpoint`` declared (none for an app-level route)."""
    name = endpoint.rpartition(".")[0]
    bp = app.blueprints.get(name) if name else None
    return getattr(bp, "route_families", ())


def family_of(app: Flask, rule: Rule) -> RouteFamily | None:
    """The family of the route ``rule`` of ``app``: the family of its blueprint that owns its
    rule — None when there is none, which :func:`problems` reports at start-up."""
    return _table(app).for_rule(app, rule)


def registered(app: Flask) -> tuple[RouteFamily, ...]:
    """Every family the blueprints registered on ``app`` declared, in registration order."""
    return tuple(_table(app).families)


def family_for_path(app: Flask, path: str) -> RouteFamily | None:
    """The family owning ``path`` among ``app``'s (the longest entry wins), None: no family."""
    return _table(app).for_path(path)


def current() -> RouteFamily | None:
    """The family of the request being handled: its route's, or for a request that matched
    no route (404/405) the family owning its path; None: no family."""
    app = current_app._get_current_object()  # type: ignore[attr-defined]
    table = _table(app)
    rule = request.url_rule
    if rule is not None:
        return table.for_rule(app, rule)
    return table.for_path(request.path)


def problems(app: Flask) -> list[str]:
    """Routes of ``app`` in no family of their blueprint, or whose path another family owns
    more closely (a request beside the route would be answered by another family): one
    ``METHODS rule (endpoint): problem`` line each."""
    table = _table(app)
    out = []
    for rule in app.url_map.iter_rules():
        declared = _declared(app, rule.endpoint)
        where = f"{','.join(sorted(rule.methods or ()))} {rule.rule} ({rule.endpoint})"
        owner = table.for_path(rule.rule)
        if not declared:
            out.append(f"{where}: its blueprint declares no route family (routing.declare)")
        elif owner is None or owner not in declared:
            out.append(f"{where}: not under a family of its blueprint "
                       f"({', '.join(f.name for f in declared)}); "
                       f"its path is {owner.name if owner else 'in no family'}'s")
    return out
