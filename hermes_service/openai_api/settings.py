"""The ``openai`` section of config.yaml: the OpenAI-compatible routes (docs/openai-api.md).

:data:`SECTION` is what the extension brings to the core's config
(:meth:`~.extension.OpenAIExtension.config_section`; docs/configuring.md §Extension sections).
Kept free of the extension's other modules (only :mod:`hermes_service.config` is imported).
"""
from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass

from ..config import Check, Config, ConfigSection, env_unset
from ..config_fields import POS_INT, defaults_of, key, schema_of, settings_from

#: the extension's name: its config section, its key in ``services.extensions``, its route
#: family, the ``kind`` of its sessions and its key scope
NAME = "openai"
#: ``openai.task_mode``: how a front end's chore (title, tags, follow-ups) is answered
#: (docs/openai-api.md §Front-end chores)
TASK_MODES = ("local", "agent")
#: a model id the routes list and accept: what ``/v1/models`` shows
MODEL_ID = {"type": "string", "pattern": "^[A-Za-z0-9][A-Za-z0-9_.:/-]{0,63}$"}
_HEADER = {"type": ["string", "null"], "pattern": "^[A-Za-z0-9-]{1,64}$"}
_ENV_NAME = {"type": ["string", "null"], "pattern": "^[A-Za-z_][A-Za-z0-9_]*$"}
#: the shortest HS256 secret accepted for the forwarded user's token (RFC 7518 §3.2: a key of
#: at least the hash's size, 256 bits)
MIN_SECRET_BYTES = 32


@dataclass(frozen=True, slots=True)
class OpenAISettings:
    """``openai.*`` (docs/openai-api.md; each key's meaning in config.yaml)."""
    enabled: bool = key(True, {"type": "boolean"})
    runner: str = key("acp", {"enum": ["cli", "acp"]})
    models: tuple[str, ...] = key(("hermes",), {"type": "array", "minItems": 1,
                                                "uniqueItems": True, "items": MODEL_ID})
    user_header: str | None = key("X-OpenWebUI-User-Id", _HEADER)
    jwt_secret_env: str | None = key(None, _ENV_NAME)
    task_mode: str = key("local", {"enum": list(TASK_MODES)})
    max_history_messages: int = key(200, POS_INT)


SCHEMA = schema_of(OpenAISettings)
DEFAULTS: dict = defaults_of(OpenAISettings)


def build(mapping: dict, valid: Callable[[str], bool]) -> OpenAISettings:
    """:class:`OpenAISettings` of the merged, validated ``openai`` mapping."""
    return settings_from(OpenAISettings, mapping)


def jwt_secret_usable(cfg: Config) -> list[str]:
    """``openai.jwt_secret_env`` names a set variable of at least :data:`MIN_SECRET_BYTES`
    bytes, never one a Hermes process gets (``hermes.model.api_key_env``,
    ``hermes.extra_env``)."""
    name = cfg.section(NAME).jwt_secret_env
    if not name:
        return []
    where, value = f"{cfg.source}:openai.jwt_secret_env", os.environ.get(name)
    out = []
    if not value:
        out.append(f"{where}: {env_unset(name)}")
    elif len(value.encode()) < MIN_SECRET_BYTES:
        out.append(f"{where}: the value of {name} is shorter than {MIN_SECRET_BYTES} bytes "
                   "(an HS256 secret: RFC 7518 §3.2)")
    if name == cfg.hermes.model.api_key_env or name in cfg.hermes.extra_env:
        out.append(f"{where}: {name} is also given to every Hermes process "
                   "(hermes.model.api_key_env / hermes.extra_env): use a variable of its own")
    return out


SECTION = ConfigSection(
    NAME, SCHEMA, DEFAULTS, build,
    checks=(Check("jwt_secret_usable", ("openai.jwt_secret_env", "hermes.model",
                                        "hermes.extra_env"), jwt_secret_usable),),
    # the routes are registered and the runner chosen at start
    restart_only=("enabled", "runner"))
