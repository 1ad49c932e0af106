"""The ``mnote`` section of config.yaml: its schema, defaults, typed settings and checks.

:data:`SECTION` is what the extension brings to the core's config
(:meth:`~.extension.MnoteExtension.config_section`; docs/configuring.md §Extension sections):
:func:`hermes_service.config.build_config` validates the section with the core's (the same
``file:key: problem`` lines, unknown keys refused with a hint), merges it over
:data:`DEFAULTS` (config.yaml documents the same values: tests/unit/test_config_defaults.py),
builds :class:`MnoteSettings` and runs :func:`default_model_listed` after the core's checks.
The section is validated even while ``mnote.enabled`` is false, and its event streams count
in the threads the service needs all the same (``service.threads``).

Kept free of the extension's other modules (only :mod:`hermes_service.config` is imported),
so that every module of the extension may read it (tests/unit/test_layers_imports.py).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from ..config import (POS_INT, POS_NUM, STR_LIST, Check, Config, ConfigSection, ThreadNeed,
                      object_schema, settings_from)

#: the extension's name: its config section (:meth:`Config.section`), its key in
#: ``services.extensions`` and its route family
NAME = "mnote"

DEFAULTS = {
    "enabled": True,
    "default_model": "hermes-agent",
    "models": [{"id": "hermes-agent", "label": "Hermes Agent", "provider": "hermes"}],
    "events_retention_seconds": 3600,
    "keepalive_seconds": 15,
    "max_event_streams": 12,
    "default_capability_scope": ["page.read", "page.write", "artifact.write"],
    "service_url": None,
    "runner": "acp",
}

SCHEMA = object_schema({
    "enabled": {"type": "boolean"},
    "default_model": {"type": "string"},
    "models": {"type": "array", "minItems": 1, "items": object_schema({
        "id": {"type": "string"}, "label": {"type": "string"}, "provider": {"type": "string"},
        "hermes_model": {"type": ["string", "null"]},
    }, required=["id"])},
    "events_retention_seconds": POS_NUM,
    "keepalive_seconds": POS_NUM,
    "max_event_streams": POS_INT,
    "default_capability_scope": STR_LIST,
    "service_url": {"type": ["string", "null"]},
    "runner": {"enum": ["cli", "acp"]},
})


@dataclass(frozen=True, slots=True)
class MnoteModel:
    """One entry of ``mnote.models``."""
    id: str
    label: str | None = None
    provider: str | None = None
    hermes_model: str | None = None


@dataclass(frozen=True, slots=True)
class MnoteSettings:
    """``mnote.*``: the client routes, their runs and event streams, the tool endpoint."""
    enabled: bool                    # the mnote extension on (false: none of its routes)
    default_model: str
    models: tuple[MnoteModel, ...]
    events_retention_seconds: float
    keepalive_seconds: float
    max_event_streams: int
    default_capability_scope: tuple[str, ...]
    service_url: str | None
    runner: str                      # the client routes' runner: "cli" | "acp"

    @property
    def model_ids(self) -> list[str]:
        return [m.id for m in self.models]


def build(mapping: dict, valid: Callable[[str], bool]) -> MnoteSettings:
    """:class:`MnoteSettings` of the merged, validated ``mnote`` mapping."""
    # a refused entry stays in the list (its index names it); only a partial config has one
    models = tuple(MnoteModel(**m) for i, m in enumerate(mapping["models"])
                   if valid(f"mnote.models.{i}"))
    return settings_from(MnoteSettings, mapping, models=models)


def default_model_listed(cfg: Config) -> list[str]:
    m = cfg.section(NAME)
    if m.default_model not in m.model_ids:
        return [f"{cfg.source}:mnote.default_model: '{m.default_model}' "
                f"is not one of mnote.models ({', '.join(m.model_ids)})"]
    return []


SECTION = ConfigSection(
    NAME, SCHEMA, DEFAULTS, build,
    checks=(Check("default_model_listed", ("mnote.models", "mnote.default_model"),
                  default_model_listed),),
    # fixed for the life of the process: the tool callback URL handed to runs, the runner
    # and whether the extension is on (its routes are registered at start)
    restart_only=("service_url", "runner", "enabled"),
    # every open event stream holds a waitress thread
    threads=(ThreadNeed("mnote.max_event_streams", "event streams",
                        lambda m: m.max_event_streams),))
