"""How the OpenAI-compatible routes wire themselves into the core
(:mod:`hermes_service.extensions`; docs/openai-api.md).

:class:`OpenAIExtension` brings the ``openai`` config section (:mod:`.settings`), declares the
``openai`` turn family (its runner: ``openai.runner``; its own warm ACP processes; Hermes's
questions are denied — an OpenAI client cannot answer them) and registers the blueprint
(:mod:`.routes`) with its error shape, the ``X-Hermes-Session-Id`` response header, its tag
and its part of the document's description. ``openai.enabled: false`` removes it.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from ..extensions import Extension, Family
from .settings import NAME, SECTION

if TYPE_CHECKING:
    from ..config import Config, ConfigSection
    from ..service_objects import ServiceObjects

TAGS = [{"name": "openai", "description": "OpenAI-compatible routes: each user's own "
                                          "sandboxed Hermes (docs/openai-api.md). Errors: "
                                          "`{error: {message, type, code, param}}`."}]


class OpenAIExtension(Extension):
    """The OpenAI-compatible routes' hooks (module doc)."""
    name = NAME

    def config_section(self) -> ConfigSection:
        return SECTION

    def enabled(self, config: Config) -> bool:
        """``openai.enabled`` (default true; a key still needs the ``openai`` scope)."""
        return NAME in config.extensions and bool(config.section(NAME).enabled)

    def families(self, config: Config) -> list[Family]:
        return [Family(NAME, config.section(NAME).runner, label="openai")]

    def init_app(self, app, services: ServiceObjects) -> None:
        from ..web.helpers import register_description, register_response_headers, register_tags
        from . import routes
        from .schemas import RESPONSE_HEADERS
        app.register_blueprint(routes.bp)
        register_response_headers(app, RESPONSE_HEADERS)
        register_tags(app, TAGS)
        register_description(app, "the OpenAI-compatible routes (`/v1/models`, "
                             "`/v1/chat/completions`)", "OpenAI `{error: {message, type, "
                             "code, param}}`")

