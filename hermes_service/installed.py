"""The installed extensions: the one composition point, the one place the core names an
extension (docs/architecture.md; the seam itself: :mod:`hermes_service.extensions`).

It sits above the core — only the app factory, the services' builder, the command line and the
modules that need the route families (conversations, lifecycle) import it — so an extension
importing core modules closes no import cycle (tests/unit/test_layers_imports.py,
tests/unit/test_layers.py).

It also gives the config of this installation: :func:`build_config` and :func:`load_config`
are :mod:`hermes_service.config`'s with the installed extensions' config sections
(:func:`config_sections`); the config module itself knows only the core's.
"""
from __future__ import annotations

import os
from typing import TYPE_CHECKING

from . import config as _config
from .extensions import Family

if TYPE_CHECKING:
    from .config import Config, ConfigSection
    from .extensions import Extension


def extensions() -> tuple[Extension, ...]:
    """The installed extensions, in order: the composition point (the one place the core
    names an extension)."""
    from .mnote import extension as mnote
    from .openai_api import extension as openai_api
    return (mnote, openai_api)


def config_sections() -> tuple[ConfigSection, ...]:
    """The config sections of the installed extensions, in order
    (:meth:`~hermes_service.extensions.Extension.config_section`): each is validated whether
    its extension is enabled or not."""
    return tuple(section for ext in extensions()
                 if (section := ext.config_section()) is not None)


def build_config(raw_file: dict | None, **options) -> Config:
    """:func:`hermes_service.config.build_config` of ``raw_file`` with the installed
    extensions' sections (``options``: its other keyword arguments). Raises its
    :class:`~hermes_service.config.ConfigError`."""
    return _config.build_config(raw_file, sections=config_sections(), **options)


def load_config(path: str | os.PathLike | None = None, **options) -> Config:
    """:func:`hermes_service.config.load_config` of ``path`` with the installed extensions'
    sections (``options``: its other keyword arguments). Raises its
    :class:`~hermes_service.config.ConfigError`."""
    return _config.load_config(path, sections=config_sections(), **options)


def enabled(config: Config) -> tuple[Extension, ...]:
    """The installed extensions ``config`` switches on."""
    return tuple(ext for ext in extensions() if ext.enabled(config))


def route_families(config: Config) -> list[Family]:
    """Every route family of ``config``: the v1 API's (``hermes.runner``) first, then the
    enabled extensions'."""
    return [Family("v1", config.hermes.runner),
            *(f for ext in enabled(config) for f in ext.families(config))]


def model_names(config: Config) -> list[str]:
    """The model names the enabled extensions' turns may ask for
    (:meth:`~hermes_service.extensions.Extension.model_names`), besides the core's."""
    return [name for ext in enabled(config) for name in ext.model_names(config)]


def demo():
    """The demo module of the first installed extension offering one, or None."""
    return next((ext.demo for ext in extensions() if ext.demo is not None), None)
