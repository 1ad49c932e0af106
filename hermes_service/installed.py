"""The installed extensions: the one composition point, the one place the core names an
extension (docs/architecture.md; the seam itself: :mod:`hermes_service.extensions`).

It sits above the core — only the app factory, the services' builder, the command line and the
modules that need the route families (conversations, lifecycle) import it — so an extension importing core modules
closes no import cycle (tests/unit/test_layers_imports.py, tests/unit/test_layers.py).
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from .extensions import Family

if TYPE_CHECKING:
    from .config import Config
    from .extensions import Extension


def extensions() -> tuple["Extension", ...]:
    """The installed extensions, in order: the composition point (the one place the core
    names an extension)."""
    from .mnote import extension as mnote
    return (mnote,)


def enabled(config: "Config") -> tuple["Extension", ...]:
    """The installed extensions ``config`` switches on."""
    return tuple(ext for ext in extensions() if ext.enabled(config))


def route_families(config: "Config") -> list["Family"]:
    """Every route family of ``config``: the v1 API's (``hermes.runner``) first, then the
    enabled extensions'."""
    return [Family("v1", config.hermes.runner),
            *(f for ext in enabled(config) for f in ext.families(config))]


def demo():
    """The demo module of the first installed extension offering one, or None."""
    return next((ext.demo for ext in extensions() if ext.demo is not None), None)
