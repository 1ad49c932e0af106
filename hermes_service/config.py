"""Service configuration: load ``config.yaml``, validate it, resolve defaults.

The file layout follows the spec's example config (hermes-service-api-v1.3.0
§配置文件) plus the service's own keys (``hermes.*``, ``paths.*``,
``key_sha256``, ``service.connection_limit``, ``service.idle_timeout_seconds``,
``api_keys[].scopes``, ``retention.*``; docs/configuring.md) and the sections the installed
extensions bring (:class:`ConfigSection`). Validation uses jsonschema plus
the cross-field checks below; every problem is reported as ``file:dotted.key: problem`` so
``check-config`` can print it and a bad file never starts a half-working server.

**Extension sections.** This module knows the core's sections only. An extension brings its
own as a :class:`ConfigSection` (schema, defaults, a builder of its typed settings, named
checks, restart-only keys, the threads it holds; its
:meth:`~hermes_service.extensions.Extension.config_section`), and :func:`build_config` /
:func:`load_config` take them as ``sections``: validated in the same pass and with the same
lines as the core's, whether the extension is enabled or not. The installed ones are passed by
the composition point, :mod:`hermes_service.installed` (its ``build_config`` and
``load_config``), which sits above this module: this module imports no extension.

Every problem is found in one pass: a value the schema refuses is left out (its default
stands in) and the cross-field checks run on the keys that validated, skipping a check that
reads a refused one (:func:`is_invalid`), so that it never reports a value the file does not
have. :class:`ConfigError` carries that ``partial`` config and the ``invalid`` keys, and
:func:`hermes_service.preflight.load_and_check` checks what the valid keys name as well.

The result is a frozen :class:`Config` of typed section objects (:class:`ServiceSettings`,
:class:`HermesSettings`, :class:`SecuritySettings`, ..., and the extensions' by name:
:meth:`Config.section`), resolved once:
paths absolute, networks parsed, keys digested, the sizes the service derives from them
(admission places, CLI slots, threads and connections needed) as their properties. Nothing
outside this module reads the YAML's mapping (an extension section's builder is handed its own
part); each service object takes its section when it is
built and in its ``configure`` on reload (:meth:`hermes_service.services.Services.apply`).
The cross-field checks are the named entries of :data:`CHECKS` (then the extension
sections' own).

Two kinds of findings (docs/configuring.md):

* **problems** (:class:`ConfigError`): the file is wrong; the service refuses to start and a
  reload keeps the running config;
* **warnings** (:attr:`Config.warnings`): the file is valid but something needs the admin —
  an expired key, or no usable model provider (:attr:`Config.provider_issues`: the service
  starts and answers turns with 503 ``hermes_unconfigured`` without running the CLI).
"""
from __future__ import annotations

import copy
import difflib
import hashlib
import ipaddress
import os
import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field, fields, replace
from datetime import UTC, date, datetime
from pathlib import Path
from types import MappingProxyType
from typing import Any

import jsonschema
import yaml

from . import sandbox
from .errors import schema_error

ENV_CONFIG = "HERMES_SERVICE_CONFIG"

DEFAULTS: dict[str, Any] = {
    "security": {
        "enable_ip_check": True,
        "allowed_ips": ["127.0.0.1", "::1"],
        "enable_api_key": True,
        "auth_method": "header",
        "api_key_header": "X-API-Key",
        "api_keys": [],
        "health_requires_api_key": False,
        "docs_requires_api_key": True,
    },
    "nginx": {"trusted_proxies": [], "enable_real_ip": False},
    "service": {"host": "127.0.0.1", "port": 9123, "log_level": "info", "log_format": "text",
                "threads": 32, "max_body_bytes": 1048576, "connection_limit": 500,
                "idle_timeout_seconds": 20, "drain_seconds": 60, "node_id": None,
                "idempotency_ttl_seconds": 86400},
    "cors": {"allow_origins": [], "allow_credentials": False,
             "allow_methods": ["GET", "POST", "DELETE"], "allow_headers": ["*"]},
    "hermes": {
        "command": "hermes",
        "runner": "cli",
        "acp": {"idle_seconds": 600, "max_processes": 8, "recycle_after_sessions": 100,
                "max_rss_mb": 300, "start_timeout_seconds": 60},
        "timeout_seconds": 300,
        "stall_timeout_seconds": 240,
        "approvals": {"mode": "ask", "timeout_seconds": 120, "allow_always": True},
        "max_concurrent_runs": 2,
        "queue_wait_seconds": 30,
        "max_waiting_requests": 4,
        "max_message_bytes": 122880,
        "toolsets": ["terminal", "file", "code_execution", "todo", "memory"],
        "sandbox": {"mode": "auto", "allow_host_tools": False, "max_home_mb": 2048,
                    "quota": "auto", "min_free_mb": 512, "bwrap": "bwrap",
                    "limits": {"memory_mb": 2048, "processes": 256, "cpu_seconds": 600,
                               "file_size_mb": 512, "open_files": 1024, "tmp_mb": 256},
                    "network": "isolated", "allow_host_network": False,
                    "egress": {"allow": [], "deny": [], "max_connections": 64}},
        "extra_env": {},
        "limits": {"daily_tokens": None},
        "model": {"provider": "custom", "base_url": None, "default": None,
                  "api_key_env": "HERMES_PROVIDER_API_KEY", "context_length": 128000},
        "execute": {
            "allowed": [["version"], ["status"], ["sessions", "list"],
                        ["sessions", "export", "-"], ["skills", "list"]],
            "timeout_seconds": 60,
            "max_output_bytes": 65536,
        },
    },
    "paths": {"data_dir": "data", "users_template": "users_template", "homes_dir": None},
    "retention": {
        "interval_seconds": 3600,
        "sessions_older_than": None,
        "purge_transcripts": False,
        "idempotency_window_seconds": 86400,
    },
}

#: API key scopes (docs/configuring.md §API keys): which route families a key may call.
SCOPES = ("v1", "client", "execute", "metrics")
#: Scopes of a key that lists none. v1.3.0 let every key call every route; /api/v1/execute can
#: read any user's transcripts (``sessions export``), so it must be granted explicitly.
DEFAULT_SCOPES = ("v1", "client")
#: Hermes refuses a context window below this (agent/model_metadata.py MINIMUM_CONTEXT_LENGTH).
HERMES_MIN_CONTEXT_LENGTH = 64000
#: The example provider shipped in early versions of config.yaml: not a provider.
PLACEHOLDER_PROVIDERS = {("http://127.0.0.1:8000/v1", "gpt-4o-mini")}
#: The development API key: ``make run`` exports :data:`DEV_KEY_ENV` (the key variable of the
#: shipped config.yaml) from :data:`DEV_KEY_FILE`, which it generates once, when the variable
#: is unset (the Makefile's ``DEV_KEY``; README, Quick start).
DEV_KEY_ENV = "HERMES_SERVICE_API_KEY"
DEV_KEY_FILE = "data/dev-api-key"
#: Connections beyond those that hold a thread (idle keep-alive, queued requests).
SPARE_CONNECTIONS = 100
# service.node_id: the tag new v1 session ids carry (``<node_id>.<uuid>``) so a proxy in
# front of several nodes routes a session to the node that owns it (docs/scaling.md).
NODE_ID_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_-]{0,31}$"

#: ``<count><unit>``, unit s, m, h, d or w (``30d``): ``retention.sessions_older_than``,
#: ``gc --older-than``.
DURATION_PATTERN = r"^[0-9]{1,6}[smhdw]$"
_UNIT_SECONDS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}
#: A session mapping used within the last hour is never removed by retention.
MIN_SESSION_AGE_SECONDS = 3600


def parse_duration(text: str) -> float:
    """Seconds of a :data:`DURATION_PATTERN` duration (``"30d"`` → 2592000.0); ValueError if
    the text is not one."""
    if not isinstance(text, str) or not re.fullmatch(DURATION_PATTERN, text):
        raise ValueError(f"{text!r} is not a duration like 30d, 12h, 90m (units s m h d w)")
    return float(int(text[:-1]) * _UNIT_SECONDS[text[-1]])

STR_LIST = {"type": "array", "items": {"type": "string"}}
POS_INT = {"type": "integer", "minimum": 1}
POS_NUM = {"type": "number", "exclusiveMinimum": 0}


def object_schema(props: dict, **extra) -> dict:
    """A mapping of the named ``props`` only: another key is refused with a hint (the section
    schemas' building block, an extension's too)."""
    return {"type": "object", "properties": props, "additionalProperties": False, **extra}


SCHEMA = object_schema({
    "security": object_schema({
        "enable_ip_check": {"type": "boolean"},
        "allowed_ips": STR_LIST,
        "enable_api_key": {"type": "boolean"},
        "auth_method": {"enum": ["header", "bearer"]},
        "api_key_header": {"type": "string", "pattern": r"^[A-Za-z0-9-]+$"},
        "health_requires_api_key": {"type": "boolean"},
        "docs_requires_api_key": {"type": "boolean"},
        "api_keys": {"type": "array", "items": object_schema({
            "key": {"type": "string", "minLength": 16},
            "key_sha256": {"type": "string", "pattern": "^[0-9a-f]{64}$"},
            "key_env": {"type": "string", "pattern": "^[A-Za-z_][A-Za-z0-9_]*$"},
            "description": {"type": ["string", "null"]},
            "expires_at": {"type": ["string", "null"]},
            "actor_id": {"type": ["string", "null"]},
            "capability_scope": {"type": ["array", "null"], "items": {"type": "string"}},
            "scopes": {"type": "array", "uniqueItems": True, "items": {"enum": list(SCOPES)}},
        }, oneOf=[{"required": ["key"]}, {"required": ["key_sha256"]}, {"required": ["key_env"]}])},
    }),
    "nginx": object_schema({"trusted_proxies": STR_LIST, "enable_real_ip": {"type": "boolean"}}),
    "service": object_schema({
        "host": {"type": "string"},
        "port": {"type": "integer", "minimum": 0, "maximum": 65535},
        "log_level": {"enum": ["debug", "info", "warning", "error"]},
        "log_format": {"enum": ["text", "json"]},
        "threads": POS_INT,
        "max_body_bytes": POS_INT,
        "connection_limit": POS_INT,
        "idle_timeout_seconds": POS_INT,
        "drain_seconds": {"type": "number", "minimum": 0},
        "node_id": {"type": ["string", "null"], "pattern": NODE_ID_PATTERN},
        "idempotency_ttl_seconds": POS_NUM,
    }),
    "cors": object_schema({"allow_origins": STR_LIST, "allow_credentials": {"type": "boolean"},
                  "allow_methods": STR_LIST, "allow_headers": STR_LIST}),
    "hermes": object_schema({
        "command": {"type": "string", "minLength": 1},
        "runner": {"enum": ["cli", "acp"]},
        "acp": object_schema({
            "idle_seconds": POS_NUM,
            "max_processes": POS_INT,
            "recycle_after_sessions": POS_INT,
            "max_rss_mb": POS_NUM,
            "start_timeout_seconds": POS_NUM,
        }),
        "timeout_seconds": POS_NUM,
        "stall_timeout_seconds": POS_NUM,
        "approvals": object_schema({
            "mode": {"enum": ["ask", "deny"]},
            "timeout_seconds": POS_NUM,
            "allow_always": {"type": "boolean"},
        }),
        "max_concurrent_runs": POS_INT,
        "queue_wait_seconds": {"type": "number", "minimum": 0},
        "max_waiting_requests": {"type": "integer", "minimum": 0},
        "max_message_bytes": {"type": "integer", "minimum": 1, "maximum": 126976},
        "toolsets": STR_LIST,
        "sandbox": object_schema({
            "mode": {"enum": ["auto", "bwrap", "none"]},
            "allow_host_tools": {"type": "boolean"},
            "max_home_mb": POS_NUM,
            "quota": {"enum": ["auto", "btrfs", "watch"]},
            "min_free_mb": {"type": "number", "minimum": 0},
            "bwrap": {"type": "string", "minLength": 1},
            "limits": object_schema({
                "memory_mb": {"type": "integer", "minimum": 256},
                "processes": {"type": "integer", "minimum": 32},
                "cpu_seconds": {"type": "integer", "minimum": 10},
                "file_size_mb": POS_INT,
                "open_files": {"type": "integer", "minimum": 64},
                "tmp_mb": POS_INT,
            }),
            "network": {"enum": list(sandbox.NETWORKS)},
            "allow_host_network": {"type": "boolean"},
            "egress": object_schema({
                "allow": STR_LIST,
                "deny": STR_LIST,
                "max_connections": {"type": "integer", "minimum": 1, "maximum": 4096},
            }),
        }),
        "extra_env": {"type": "object", "additionalProperties": {"type": "string"}},
        "limits": object_schema({"daily_tokens": {"type": ["integer", "null"], "minimum": 1}}),
        "model": object_schema({
            "provider": {"type": "string"},
            "base_url": {"type": ["string", "null"]},
            "default": {"type": ["string", "null"]},
            "api_key_env": {"type": ["string", "null"], "pattern": "^[A-Za-z_][A-Za-z0-9_]*$"},
            "context_length": POS_INT,
        }),
        "execute": object_schema({
            "allowed": {"type": "array", "items": {**STR_LIST, "minItems": 1}},
            "timeout_seconds": POS_NUM,
            "max_output_bytes": POS_INT,
        }),
    }),
    "paths": object_schema({"data_dir": {"type": "string"}, "users_template": {"type": "string"},
                            "homes_dir": {"type": ["string", "null"]}}),
    "retention": object_schema({
        "interval_seconds": {"type": "number", "minimum": 0},
        "sessions_older_than": {"type": ["string", "null"], "pattern": DURATION_PATTERN},
        "purge_transcripts": {"type": "boolean"},
        "idempotency_window_seconds": POS_NUM,
    }),
})


#: the core's sections (:attr:`Config`'s fields of the same names)
CORE_SECTIONS = tuple(SCHEMA["properties"])
#: the core's sections that come after the extensions' (in :func:`schema`, and so in the
#: unknown-key hints, as config.yaml orders them): retention cleans up after all of them
TAIL_SECTIONS = ("retention",)


class ConfigError(Exception):
    """Raised with every problem found; ``problems`` are ``file:key: problem`` lines.

    ``partial``: when the file parsed, the :class:`Config` of its valid keys with defaults for
    the ``invalid`` ones (dotted keys, e.g. ``"service.port"``, ``"security.api_keys.0"``) —
    only for checking what the valid keys name (:func:`hermes_service.preflight.problems`);
    never served. None when the file could not be read or parsed."""

    def __init__(self, problems: list[str], partial: Config | None = None,
                 invalid: frozenset = frozenset()):
        super().__init__("\n".join(problems))
        self.problems = problems
        self.partial = partial
        self.invalid = invalid


def is_invalid(key: str, invalid) -> bool:
    """Does the dotted ``key`` touch a key of ``invalid``: is it one, inside one, or does it
    hold one (``security.api_keys`` holds ``security.api_keys.0.scopes``)?"""
    parts = key.split(".")
    for bad in invalid:
        other = bad.split(".")
        n = min(len(parts), len(other))
        if parts[:n] == other[:n]:
            return True
    return False


def _refused_keys(err: jsonschema.ValidationError) -> list[str]:
    """The dotted keys a schema error refuses: the value at its path, or for unknown keys
    those keys alone (their known siblings are fine)."""
    path = [str(p) for p in err.absolute_path]
    if err.validator == "additionalProperties" and isinstance(err.instance, dict):
        known = err.schema.get("properties", {})
        return [".".join([*path, k]) for k in err.instance if k not in known]
    return [".".join(path)]


def _without(data: Any, invalid: frozenset, prefix: tuple = ()) -> Any:
    """``data`` without the mapping entries at ``invalid`` keys (list items stay: their
    indexes name them in problems, and the checks skip them)."""
    if not isinstance(data, dict):
        return copy.deepcopy(data)
    out = {}
    for key, value in data.items():
        dotted = ".".join((*prefix, str(key)))
        if dotted in invalid:
            continue
        if isinstance(value, list):
            out[key] = [_without(v, invalid, (*prefix, str(key), str(i)))
                        for i, v in enumerate(value)]
        else:
            out[key] = _without(value, invalid, (*prefix, str(key)))
    return out


@dataclass(frozen=True)
class ApiKey:
    """One accepted API key. Only the SHA-256 digest is kept in memory."""
    sha256: str
    description: str | None
    expires_at: datetime | None
    actor_id: str | None
    capability_scope: tuple[str, ...] | None
    scopes: frozenset[str] = frozenset(DEFAULT_SCOPES)


# -- the typed settings ------------------------------------------------------------------
# One frozen object per section of config.yaml, built once by :func:`build_config` from the
# file merged over :data:`DEFAULTS` (the one place the code holds defaults). Lists become
# tuples and mappings read-only; values keep the type YAML gave them (an int stays an int, so
# messages print ``300``, not ``300.0``). Each service object takes its section when it is
# built and again in its ``configure(section)`` on reload (:meth:`Services.apply`).

@dataclass(frozen=True, slots=True)
class SecuritySettings:
    """``security.*``; ``allowed_networks`` are ``allowed_ips`` parsed (:func:`parse_network`),
    ``api_keys`` the resolved :class:`ApiKey` entries (digests only)."""
    enable_ip_check: bool
    allowed_ips: tuple[str, ...]
    enable_api_key: bool
    auth_method: str                # "header" | "bearer"
    api_key_header: str
    health_requires_api_key: bool
    docs_requires_api_key: bool
    api_keys: tuple[ApiKey, ...]
    allowed_networks: tuple
    #: how many entries ``api_keys`` lists in the file (``api_keys`` leaves out those an
    #: operator command without keys skips: ``key_env`` unset)
    key_entries: int

    @property
    def bearer(self) -> bool:
        """Keys come as ``Authorization: Bearer <key>``, not in :attr:`api_key_header`."""
        return self.auth_method == "bearer"


@dataclass(frozen=True, slots=True)
class NginxSettings:
    """``nginx.*``; ``trusted_proxies`` parsed into networks."""
    trusted_proxies: tuple
    enable_real_ip: bool


@dataclass(frozen=True, slots=True)
class ServiceSettings:
    """``service.*`` (seconds, bytes, counts as config.yaml documents them)."""
    host: str
    port: int
    log_level: str
    log_format: str
    threads: int
    max_body_bytes: int
    connection_limit: int
    idle_timeout_seconds: int
    drain_seconds: float
    node_id: str | None
    idempotency_ttl_seconds: float


@dataclass(frozen=True, slots=True)
class CorsSettings:
    """``cors.*`` (CORS is off while ``allow_origins`` is empty)."""
    allow_origins: tuple[str, ...]
    allow_credentials: bool
    allow_methods: tuple[str, ...]
    allow_headers: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class AcpSettings:
    """``hermes.acp.*``: the warm ``hermes acp`` pool."""
    idle_seconds: float
    max_processes: int
    recycle_after_sessions: int
    max_rss_mb: float
    start_timeout_seconds: float


@dataclass(frozen=True, slots=True)
class ApprovalSettings:
    """``hermes.approvals.*``."""
    mode: str                        # "ask" | "deny"
    timeout_seconds: float
    allow_always: bool


@dataclass(frozen=True, slots=True)
class ModelSettings:
    """``hermes.model.*``: the provider every user's Hermes home is given."""
    provider: str
    base_url: str | None
    default: str | None
    api_key_env: str | None
    context_length: int


@dataclass(frozen=True, slots=True)
class UsageLimits:
    """``hermes.limits.*``: what one user may spend. ``daily_tokens``: model tokens (prompt +
    completion) per UTC day through the pass-through, None for no limit."""
    daily_tokens: int | None


@dataclass(frozen=True, slots=True)
class ExecuteSettings:
    """``hermes.execute.*``: ``allowed`` is a tuple of argv prefixes (tuples of words)."""
    allowed: tuple[tuple[str, ...], ...]
    timeout_seconds: float
    max_output_bytes: int


@dataclass(frozen=True, slots=True)
class HermesSettings:
    """``hermes.*``, with the sizes derived from it (:attr:`cli_slots`,
    :attr:`admission_places`, :attr:`longest_turn_seconds`)."""
    command: str
    runner: str                      # the v1 API's runner: "cli" | "acp"
    acp: AcpSettings
    timeout_seconds: float
    stall_timeout_seconds: float
    approvals: ApprovalSettings
    max_concurrent_runs: int
    queue_wait_seconds: float
    max_waiting_requests: int
    max_message_bytes: int
    toolsets: tuple[str, ...]
    sandbox: sandbox.Settings
    extra_env: Mapping[str, str]     # read-only
    limits: UsageLimits
    model: ModelSettings
    execute: ExecuteSettings

    @property
    def cli_slots(self) -> int:
        """Turn slots, shared by both runners and ``/api/v1/execute``."""
        return self.max_concurrent_runs

    @property
    def admission_places(self) -> int:
        """Synchronous v1 requests let in at once, running or waiting for a slot (more: 429)."""
        return self.max_concurrent_runs + self.max_waiting_requests

    @property
    def longest_turn_seconds(self) -> float:
        """How long one turn may take, from its request to its end: the wait for a slot plus
        the turn's hard limit."""
        return self.queue_wait_seconds + self.timeout_seconds


@dataclass(frozen=True, slots=True)
class PathsSettings:
    """``paths.*``, resolved against the config file's folder (absolute). ``homes_dir``: where
    the users' homes, their run folders and the service's own home live (everything a
    sandbox can write: docs/sandbox.md §Disk); the data dir when ``paths.homes_dir`` is
    null."""
    data_dir: Path
    users_template: Path
    homes_dir: Path | None = None

    @property
    def homes(self) -> Path:
        return self.homes_dir if self.homes_dir is not None else self.data_dir


@dataclass(frozen=True, slots=True)
class RetentionSettings:
    """``retention.*``."""
    interval_seconds: float
    sessions_older_than: str | None  # a duration (:data:`DURATION_PATTERN`)
    purge_transcripts: bool
    idempotency_window_seconds: float

    @property
    def sessions_older_than_seconds(self) -> float | None:
        """:attr:`sessions_older_than` in seconds (None: keep every session mapping)."""
        return parse_duration(self.sessions_older_than) if self.sessions_older_than else None


@dataclass(frozen=True, slots=True)
class Config:
    """The validated configuration: one typed, frozen section object per config.yaml
    section, resolved once (paths absolute, networks parsed, keys digested).

    ``provider_issues`` say why no model turn can work (empty when the provider is usable);
    ``warnings`` are every finding that does not stop the service (provider issues included),
    as ``file:key: problem`` lines. ``invalid``: the dotted keys the file had refused (their
    defaults stand in) — only in a :attr:`ConfigError.partial` config, never served. A
    reload builds a new one (:meth:`Services.apply` hands its sections to the objects).

    The installed extensions' sections (:class:`ConfigSection`, those it was built with:
    :attr:`extension_sections`) are in :attr:`extensions`, by name; :meth:`section` reads any
    section by its name, the core's and theirs alike.
    """
    source: str
    security: SecuritySettings
    nginx: NginxSettings
    service: ServiceSettings
    cors: CorsSettings
    hermes: HermesSettings
    paths: PathsSettings
    retention: RetentionSettings
    #: the extensions' settings, by section name (each :attr:`ConfigSection.build`'s object)
    extensions: Mapping[str, Any] = field(default_factory=lambda: MappingProxyType({}))
    #: the extensions' sections this config was built with (a reload builds with the same)
    extension_sections: tuple[ConfigSection, ...] = ()
    provider_issues: tuple[str, ...] = ()
    warnings: tuple[str, ...] = ()
    #: restart-only settings a command-line option replaced (``--threads``): (section, key)
    #: -> the file's value, which reloads compare the file with (:meth:`override`)
    overrides: Mapping = field(default_factory=lambda: MappingProxyType({}))
    #: what a command-line option puts over the file's mapping before it is validated
    #: (``--demo``: the installed demo's overlay); reloads apply it to the new file too
    overlay: object = None
    invalid: frozenset = frozenset()

    # -- derived sizes (one place; config.yaml's comments and check-config name them) --
    @property
    def data_dir(self) -> Path:
        return self.paths.data_dir

    def section(self, name: str):
        """The settings of section ``name``: the core's (``section("service")`` is
        :attr:`service`) or an extension's (``section("mnote")``). KeyError for neither."""
        if name in self.extensions:
            return self.extensions[name]
        if name in CORE_SECTIONS:
            return getattr(self, name)
        raise KeyError(name)

    @property
    def thread_needs(self) -> list[tuple[ThreadNeed, int]]:
        """What the extensions' settings add to :attr:`threads_needed`: each
        :class:`ThreadNeed` with its count, in the order of :attr:`extension_sections`."""
        return [(need, need.count(self.extensions[s.name]))
                for s in self.extension_sections for need in s.threads]

    @property
    def threads_needed(self) -> int:
        """Waitress threads the limits need: what the extensions' settings hold (e.g. every
        event stream: :attr:`thread_needs`), every v1 turn (running and waiting) and the tool
        calls of running turns each hold one."""
        h = self.hermes
        return sum(n for _need, n in self.thread_needs) + 2 * h.max_concurrent_runs + \
            h.max_waiting_requests + 4

    @property
    def connections_needed(self) -> int:
        """Open connections the threads need, plus room for idle or queued ones."""
        return self.service.threads + SPARE_CONNECTIONS

    @property
    def restart_only_keys(self) -> tuple[tuple[str, str | None], ...]:
        """(section, key) of every setting fixed for the life of the process: the core's
        (:data:`RESTART_ONLY`), then each extension section's
        (:attr:`ConfigSection.restart_only`); key None: the whole section."""
        return RESTART_ONLY + tuple((s.name, key) for s in self.extension_sections
                                    for key in s.restart_only)

    def valid(self, *keys: str) -> bool:
        """Did the file give these dotted keys validly (or leave them to their defaults)?
        A check reading a refused key is skipped (the module doc)."""
        return not any(is_invalid(k, self.invalid) for k in keys)

    def override(self, section: str, key: str, value) -> Config:
        """This config with ``section.key`` replaced by a command-line option's ``value``
        (``--threads``); the file's value is kept in :attr:`overrides` for reloads."""
        old = getattr(self.section(section), key)
        return _with_sections(self, {section: replace(self.section(section), **{key: value})},
                              overrides=MappingProxyType({(section, key): old,
                                                         **self.overrides}))


def _with_sections(cfg: Config, sections: dict, **changes) -> Config:
    """``cfg`` with the settings of ``sections`` (section name → settings; the core's or the
    extensions') replaced, and its other fields by ``changes``."""
    ext = {name: value for name, value in sections.items() if name in cfg.extensions}
    if ext:
        changes["extensions"] = MappingProxyType({**cfg.extensions, **ext})
    return replace(cfg, **{n: v for n, v in sections.items() if n not in ext}, **changes)


def _merge(base: dict, override: dict) -> dict:
    out = copy.deepcopy(base)
    for key, value in (override or {}).items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def _dotted(path) -> str:
    return ".".join(str(p) for p in path) or "(top)"


def _schema_problem(err: jsonschema.ValidationError) -> str:
    if err.validator == "type" and isinstance(err.instance, (date, datetime)):
        text = err.instance.isoformat()
        return (f"{_dotted(err.absolute_path)}: YAML reads the unquoted {text} as a date, not "
                f"text; quote it: \"{text}\"")
    if err.validator == "additionalProperties":
        known = list(err.schema.get("properties", {}))
        extra = sorted(set(err.instance) - set(known))
        parts = []
        for name in extra:
            hint = difflib.get_close_matches(name, known, n=1)
            parts.append(f"unknown key '{name}'" + (f" (did you mean '{hint[0]}'?)" if hint
                                                     else f" (known: {', '.join(known)})"))
        return f"{_dotted(err.absolute_path)}: " + "; ".join(parts)
    if err.validator == "oneOf" and isinstance(err.instance, dict):
        return f"{_dotted(err.absolute_path)}: give exactly one of 'key', 'key_sha256' or 'key_env'"
    path, reason = schema_error(err)
    return f"{_dotted(path)}: {reason}"


def parse_network(text: str):
    """Parse one IP or CIDR (IPv4 or IPv6) with :mod:`ipaddress`.

    Raises ValueError if it is not one, or if a CIDR has host bits set (``10.0.0.1/8`` is
    ambiguous: the network ``10.0.0.0/8`` or the one address ``10.0.0.1``?).
    """
    text = text.strip()
    try:
        return ipaddress.ip_network(text)
    except ValueError:
        net = ipaddress.ip_network(text, strict=False)   # raises for what is no address at all
        raise ValueError(f"{text} has host bits set: write {net} for the network, or "
                         f"{text.split('/')[0]} for the one address") from None


def _parse_time(text: str) -> datetime:
    value = datetime.fromisoformat(text.replace("Z", "+00:00"))
    return value if value.tzinfo else value.replace(tzinfo=UTC)


def _tuple(value):
    """Lists (and lists of lists) as tuples; anything else as it is."""
    return tuple(_tuple(v) for v in value) if isinstance(value, list) else value


def settings_from(cls, mapping: dict, **resolved):
    """``cls`` from the keys of ``mapping`` it names (lists as tuples), ``resolved`` over them."""
    names = [f.name for f in fields(cls)]
    return cls(**{n: _tuple(mapping[n]) for n in names if n not in resolved}, **resolved)


class _Resolver:
    """What resolving one file collects: its ``problems`` and ``warnings`` lines, and which
    keys it may read (:meth:`ok`: not refused by the schema)."""

    def __init__(self, source: str, invalid: frozenset):
        self.source, self.invalid = source, invalid
        self.problems: list[str] = []
        self.warnings: list[str] = []

    def ok(self, *keys: str) -> bool:
        return not any(is_invalid(k, self.invalid) for k in keys)

    def networks(self, key_path: str, values: list[str]) -> tuple:
        out = []
        for i, text in enumerate(values):
            if not self.ok(f"{key_path}.{i}"):
                continue
            try:
                out.append(parse_network(text))
            except ValueError as exc:
                self.problems.append(f"{self.source}:{key_path}.{i}: {exc}")
        return tuple(out)

    def api_keys(self, entries: list[dict], need_keys: bool) -> tuple[ApiKey, ...]:
        keys = []
        now = datetime.now(UTC)
        for i, entry in enumerate(entries):
            where = f"{self.source}:security.api_keys.{i}"
            if not self.ok(f"security.api_keys.{i}"):
                continue
            plain = entry.get("key")
            if entry.get("key_env"):
                plain = os.environ.get(entry["key_env"])
                if not plain or len(plain) < 16:
                    if not need_keys:
                        continue
                    self.problems.append(f"{where}.key_env: environment variable "
                                         f"{entry['key_env']} is unset or shorter than 16 "
                                         "characters" + dev_key_hint(entry["key_env"]))
                    continue
            if plain is not None and plain != plain.strip():
                what = f"the value of {entry['key_env']}" if entry.get("key_env") else "key"
                self.problems.append(
                    f"{where}.{'key_env' if entry.get('key_env') else 'key'}: {what} has "
                    "leading or trailing whitespace, which no HTTP header carries: this "
                    "key could never match")
                continue
            digest = entry.get("key_sha256") or hashlib.sha256(plain.encode()).hexdigest()
            expires = None
            if entry.get("expires_at"):
                try:
                    expires = _parse_time(entry["expires_at"])
                except ValueError:
                    self.problems.append(f"{where}.expires_at: not an ISO 8601 time")
                else:
                    if expires <= now:
                        self.warnings.append(
                            f"{where}.expires_at: {entry['expires_at']} is in the past: "
                            "this key is refused (401 api_key_expired); remove it")
            scope = entry.get("capability_scope")
            scopes = entry.get("scopes")
            keys.append(ApiKey(digest, entry.get("description"), expires, entry.get("actor_id"),
                               tuple(scope) if scope is not None else None,
                               frozenset(DEFAULT_SCOPES if scopes is None else scopes)))
        return tuple(keys)


def _resolve(raw: dict, source: str, base_dir: Path, res: _Resolver,
             need_keys: bool) -> dict:
    """The section objects of the merged mapping ``raw`` (keyword arguments of :class:`Config`)."""
    def path(p: str) -> Path:
        found = Path(os.path.expanduser(p))
        return (found if found.is_absolute() else base_dir / found).resolve()

    sec, h = raw["security"], raw["hermes"]
    security = settings_from(
        SecuritySettings, sec,
        allowed_networks=res.networks("security.allowed_ips", sec["allowed_ips"]),
        api_keys=(), key_entries=len(sec["api_keys"]))
    nginx = settings_from(NginxSettings, raw["nginx"],
                          trusted_proxies=res.networks("nginx.trusted_proxies",
                                                       raw["nginx"]["trusted_proxies"]))
    security = replace(security, api_keys=res.api_keys(sec["api_keys"], need_keys))
    hermes = settings_from(
        HermesSettings, h, acp=settings_from(AcpSettings, h["acp"]),
        approvals=settings_from(ApprovalSettings, h["approvals"]),
        sandbox=sandbox.Settings.from_config(h["sandbox"]),
        extra_env=MappingProxyType(dict(h["extra_env"])),
        limits=settings_from(UsageLimits, h["limits"]),
        model=settings_from(ModelSettings, h["model"]),
        execute=settings_from(ExecuteSettings, h["execute"]))
    return dict(
        source=source, security=security, nginx=nginx,
        service=settings_from(ServiceSettings, raw["service"]),
        cors=settings_from(CorsSettings, raw["cors"]), hermes=hermes,
        paths=PathsSettings(path(raw["paths"]["data_dir"]), path(raw["paths"]["users_template"]),
                            path(raw["paths"]["homes_dir"]) if raw["paths"]["homes_dir"]
                            else None),
        retention=settings_from(RetentionSettings, raw["retention"]))


# -- cross-field checks --------------------------------------------------------------------
# Each reads a resolved :class:`Config` and returns its ``file:key: problem`` lines; it is
# skipped when the file gave one of the keys it ``reads`` invalidly (the module doc). They
# run in this order, after the schema's problems and those of resolving the values; then the
# extensions' (:attr:`ConfigSection.checks`).

@dataclass(frozen=True)
class Check:
    """One cross-field check: ``run(config) -> problems``, skipped unless every dotted key in
    ``reads`` validated."""
    name: str
    reads: tuple[str, ...]
    run: Callable[[Config], list[str]]


@dataclass(frozen=True)
class ThreadNeed:
    """Waitress threads an extension's settings may hold at once: ``count(settings)`` (e.g.
    its open event streams), part of :attr:`Config.threads_needed`. ``key``: the dotted key
    giving it and ``what``: what holds the threads (``"event streams"``), both named in the
    thread and connection checks' lines; the thread check is skipped when ``key`` is refused."""
    key: str
    what: str
    count: Callable[[Any], int]


@dataclass(frozen=True)
class ConfigSection:
    """A section of config.yaml an extension brings
    (:meth:`hermes_service.extensions.Extension.config_section`; docs/configuring.md
    §Extension sections). The core validates and resolves it with its own sections, in the
    same pass and with the same ``file:key: problem`` lines.

    * ``name`` — its top-level key, and its name in :meth:`Config.section`;
    * ``schema`` — the jsonschema of its mapping (:func:`object_schema`: an unknown key is
      refused with a hint, like the core's);
    * ``defaults`` — every key's default, the file's mapping merged over it (config.yaml
      documents the same values: tests/unit/test_config_defaults.py);
    * ``build(mapping, valid)`` — its frozen settings object from the merged mapping (lists
      and mappings as the file gave them; :func:`settings_from` helps); ``valid(dotted_key)``
      is False for a key the schema refused, whose default stands in — only while building a
      :attr:`ConfigError.partial` config;
    * ``checks`` — its cross-field checks (:class:`Check`), run after the core's;
    * ``restart_only`` — its keys a reload cannot apply (None: the whole section), after the
      core's :data:`RESTART_ONLY`;
    * ``threads`` — the waitress threads its settings hold (:class:`ThreadNeed`).
    """
    name: str
    schema: dict
    defaults: dict
    build: Callable[[dict, Callable[[str], bool]], Any]
    checks: tuple[Check, ...] = ()
    restart_only: tuple[str | None, ...] = ()
    threads: tuple[ThreadNeed, ...] = ()


CHECKS: list[Check] = []


def _check(*reads: str):
    def register(fn):
        CHECKS.append(Check(fn.__name__, reads, fn))
        return fn
    return register


@_check("security.enable_api_key", "security.api_keys")
def api_keys_configured(cfg: Config) -> list[str]:
    if cfg.security.enable_api_key and not cfg.security.key_entries:
        return [f"{cfg.source}:security.api_keys: enable_api_key is true but no key is "
                "configured (run `.venv/bin/python main.py keygen`)"]
    return []


@_check("cors.allow_credentials", "cors.allow_origins")
def cors_credentials(cfg: Config) -> list[str]:
    if cfg.cors.allow_credentials and "*" in cfg.cors.allow_origins:
        return [f"{cfg.source}:cors.allow_origins: '*' cannot be combined with "
                "allow_credentials: true; list the origins"]
    return []


@_check("service.threads", "hermes.max_concurrent_runs", "hermes.max_waiting_requests")
def enough_threads(cfg: Config) -> list[str]:
    needs = [need for need, _n in cfg.thread_needs]
    if not cfg.valid(*(need.key for need in needs)):
        return []
    threads, needed = cfg.service.threads, cfg.threads_needed
    if threads < needed:
        holders = [need.what for need in needs] + ["v1 turns (running and waiting)", "tool calls"]
        terms = [need.key for need in needs] + ["2 * hermes.max_concurrent_runs",
                                                "hermes.max_waiting_requests", "4"]
        return [f"{cfg.source}:service.threads: {threads} is too few; "
                f"{', '.join(holders[:-1])} and {holders[-1]} each hold a thread "
                f"(need >= {needed} = {' + '.join(terms)})"]
    return []


@_check("service.connection_limit", "service.threads")
def enough_connections(cfg: Config) -> list[str]:
    limit, threads = cfg.service.connection_limit, cfg.service.threads
    if limit < cfg.connections_needed:
        held = " and ".join(f"the {n} of {need.key}" for need, n in cfg.thread_needs)
        return [f"{cfg.source}:service.connection_limit: {limit} is too few; every thread "
                f"(service.threads: {threads}{', which includes ' + held if held else ''}) "
                "can hold one, and idle or queued connections need room beyond them (need >= "
                f"{cfg.connections_needed} = service.threads + {SPARE_CONNECTIONS})"]
    return []


@_check("hermes.model.context_length")
def context_length(cfg: Config) -> list[str]:
    ctx_len = cfg.hermes.model.context_length
    if ctx_len < HERMES_MIN_CONTEXT_LENGTH:
        return [f"{cfg.source}:hermes.model.context_length: {ctx_len} is below Hermes's minimum "
                f"of {HERMES_MIN_CONTEXT_LENGTH} tokens (Hermes refuses to run with less: "
                "every turn would fail)"]
    return []


@_check("retention.interval_seconds")
def retention_interval(cfg: Config) -> list[str]:
    interval = cfg.retention.interval_seconds
    if 0 < interval < 60:
        return [f"{cfg.source}:retention.interval_seconds: {interval} is too "
                "short; use 0 (no periodic cleanup) or at least 60"]
    return []


@_check("retention.sessions_older_than")
def session_age(cfg: Config) -> list[str]:
    older = cfg.retention.sessions_older_than_seconds
    if older is not None and older < MIN_SESSION_AGE_SECONDS:
        return [f"{cfg.source}:retention.sessions_older_than: must be at least 1h (a mapping "
                "used within the last hour is never removed)"]
    return []


@_check("retention.idempotency_window_seconds", "hermes.timeout_seconds")
def tool_retry_window(cfg: Config) -> list[str]:
    timeout = cfg.hermes.timeout_seconds
    if cfg.retention.idempotency_window_seconds < timeout:
        return [f"{cfg.source}:retention.idempotency_window_seconds: must be at least "
                f"hermes.timeout_seconds ({timeout}): a run's retries must "
                "find their first response"]
    return []


@_check("service.idempotency_ttl_seconds", "hermes.timeout_seconds", "hermes.queue_wait_seconds")
def idempotency_ttl(cfg: Config) -> list[str]:
    longest = cfg.hermes.longest_turn_seconds
    if cfg.service.idempotency_ttl_seconds < longest:
        return [f"{cfg.source}:service.idempotency_ttl_seconds: must be at least "
                f"hermes.queue_wait_seconds + hermes.timeout_seconds "
                f"({longest}): a retry must find "
                "the outcome of a turn that took as long as a turn may (docs/v1-api.md "
                "§Idempotent retries)"]
    return []


@_check("hermes.sandbox", "hermes.toolsets")
def sandbox_toolsets(cfg: Config) -> list[str]:
    return sandbox.problems(cfg.hermes.sandbox, list(cfg.hermes.toolsets), cfg.source)


@_check()
def execute_not_chat(cfg: Config) -> list[str]:
    return [f"{cfg.source}:hermes.execute.allowed.{i}: 'chat' is not allowed here; "
            "use the sessions API"
            for i, argv in enumerate(cfg.hermes.execute.allowed)
            if cfg.valid(f"hermes.execute.allowed.{i}") and argv and argv[0] == "chat"]


def run_checks(cfg: Config) -> list[str]:
    """The problems of every :data:`CHECKS` entry whose keys validated, in order, then of the
    checks of ``cfg``'s extension sections (:attr:`ConfigSection.checks`)."""
    checks = [*CHECKS, *(c for s in cfg.extension_sections for c in s.checks)]
    return [p for check in checks if cfg.valid(*check.reads) for p in check.run(cfg)]


def build_config(raw_file: dict | None, source: str = "<dict>", base_dir: Path | None = None,
                 need_keys: bool = True, overlay=None,
                 sections: Iterable[ConfigSection] = ()) -> Config:
    """Validate a parsed config mapping and resolve it into a :class:`Config`.

    ``sections``: the extensions' config sections, validated and resolved with the core's
    (:func:`hermes_service.installed.build_config` passes the installed ones; without them a
    file naming an extension's section is refused: unknown key). ``need_keys=False``
    (operator commands that serve nothing) skips keys whose ``key_env`` variable is unset
    instead of failing. ``overlay`` is only kept on the result (:attr:`Config.overlay`).
    Raises :class:`ConfigError` listing every problem found: the schema's, resolving the
    values' (networks, keys) and :func:`run_checks`' of the keys that validated, in one pass
    (the module doc); ValueError if two sections share a name.
    """
    sections = tuple(sections)
    if raw_file is None:
        raw_file = {}
    if not isinstance(raw_file, dict):
        raise ConfigError([f"{source}: the top level must be a mapping"])
    errors = sorted(jsonschema.Draft202012Validator(schema(sections)).iter_errors(raw_file),
                    key=lambda e: list(map(str, e.absolute_path)))
    invalid = frozenset(k for e in errors for k in _refused_keys(e))
    raw = _merge(defaults(sections), _without(raw_file, invalid))
    res = _Resolver(source, invalid)
    config = Config(**_resolve(raw, source, base_dir or Path.cwd(), res, need_keys),
                    extensions=MappingProxyType({s.name: s.build(raw[s.name], res.ok)
                                                 for s in sections}),
                    extension_sections=sections, overlay=overlay, invalid=invalid)
    problems = [f"{source}:{_schema_problem(e)}" for e in errors] + res.problems + \
        run_checks(config)
    issues = provider_issues(config.hermes.model, source) if res.ok("hermes.model") else []
    if res.ok("hermes.sandbox"):
        res.warnings += sandbox.warnings(config.hermes.sandbox, source)
    config = replace(config, provider_issues=tuple(issues),
                     warnings=tuple(res.warnings + issues))
    if problems:
        raise ConfigError(problems, partial=config, invalid=invalid)
    return config


def _with_extensions(core: dict, sections: tuple[ConfigSection, ...], part) -> dict:
    """``core`` (section name → value) with ``part(section)`` of each extension section
    inserted before :data:`TAIL_SECTIONS` (config.yaml's order). ValueError if two sections
    share a name."""
    names = [*core, *(s.name for s in sections)]
    if len(set(names)) != len(names):
        raise ValueError(f"config sections share a name: {names}")
    head = {k: v for k, v in core.items() if k not in TAIL_SECTIONS}
    tail = {k: v for k, v in core.items() if k in TAIL_SECTIONS}
    return {**head, **{s.name: part(s) for s in sections}, **tail}


def schema(sections: Iterable[ConfigSection] = ()) -> dict:
    """The jsonschema of a config file with the extension ``sections``: :data:`SCHEMA` with
    each one's :attr:`~ConfigSection.schema` (the order of unknown-key hints)."""
    return {**SCHEMA, "properties": _with_extensions(SCHEMA["properties"], tuple(sections),
                                                     lambda s: s.schema)}


def defaults(sections: Iterable[ConfigSection] = ()) -> dict:
    """Every default of a config file with the extension ``sections``: :data:`DEFAULTS` with
    each one's :attr:`~ConfigSection.defaults` (the file is merged over it)."""
    return _with_extensions(DEFAULTS, tuple(sections), lambda s: s.defaults)


def provider_issues(model: ModelSettings, source: str = "<dict>") -> list[str]:
    """Why no model turn can work with ``hermes.model`` in this environment (empty: usable).

    * no ``base_url`` / ``default`` (the shipped config has none), or the example pair
      shipped before (``http://127.0.0.1:8000/v1`` + ``gpt-4o-mini``);
    * ``api_key_env`` names a variable that is unset or empty in the service's environment
      (Hermes would send the literal text ``${NAME}`` as the key).
    """
    out = []
    base_url, name = model.base_url, model.default
    if not base_url or not name:
        missing = " and ".join(k for k, v in (("hermes.model.base_url", base_url),
                                              ("hermes.model.default", name)) if not v)
        out.append(f"{source}:hermes.model.base_url: no model provider is configured: set "
                   f"{missing} (your provider's OpenAI-compatible /v1 URL and its model name)")
    elif (base_url.rstrip("/"), name) in PLACEHOLDER_PROVIDERS:
        out.append(f"{source}:hermes.model.base_url: {base_url} with model {name} is the example "
                   "shipped in config.yaml, not a provider: set hermes.model.base_url and "
                   "hermes.model.default")
    key_env = model.api_key_env
    if key_env and not os.environ.get(key_env):
        out.append(f"{source}:hermes.model.api_key_env: {env_unset(key_env)}: export "
                   f"{key_env}=<your provider key> where the service is started (or set "
                   "hermes.model.api_key_env: null for a provider without keys)")
    return out


def dev_key_hint(name: str) -> str:
    """What to add to "``name`` is unset" when ``name`` is the development key's variable:
    where ``make run`` takes it from, and how to do the same without make."""
    if name != DEV_KEY_ENV:
        return ""
    return (f" (`make run` sets it from {DEV_KEY_FILE}, a development key it generates once; "
            f"without make: export {DEV_KEY_ENV}=\"$(cat {DEV_KEY_FILE})\", or a key of your own)")


def env_unset(name: str) -> str:
    """How a problem line says the variable ``name`` is unset: the environment read is the
    one of the process reading the config — the service at start or reload, but
    ``check-config`` reads the shell it runs in, which may not be the service's
    (docs/configuring.md; ``GET /health`` ``checks`` reports the running service's)."""
    return (f"{name} is not set in the environment of this process (check-config reads "
            "the shell it runs in, not the running service's: GET /health shows the service's)")


def _value(cfg: Config, section: str, key: str | None):
    """The running value of ``section.key`` (the whole section when ``key`` is None); one a
    command-line option overrode is the file's value it was started with."""
    if (section, key) in cfg.overrides:
        return cfg.overrides[(section, key)]
    return getattr(cfg.section(section), key) if key else cfg.section(section)


def restart_only(running: Config, new: Config) -> list[str]:
    """Dotted keys whose new value a live reload cannot apply (docs/configuring.md §Reload;
    :attr:`Config.restart_only_keys`). A key a command-line option overrode is compared with
    the file's value it was started with."""
    return [f"{section}.{key}" if key else section for section, key in running.restart_only_keys
            if _value(running, section, key) != _value(new, section, key)]


def keep_running(running: Config, new: Config) -> Config:
    """``new`` with the running values of the restart-only settings
    (:attr:`Config.restart_only_keys`, and the running command-line overrides and overlay), as
    a reload applies it (docs/configuring.md §Reload).

    Raises :class:`ConfigError` with the :func:`run_checks` problems of the result: the new
    limits must fit the running threads and connections."""
    sections = {}
    for section, key in running.restart_only_keys:
        value = running.section(section)
        if key is not None:
            value = replace(sections.get(section, new.section(section)),
                            **{key: getattr(value, key)})
        sections[section] = value
    kept = _with_sections(new, sections, overrides=running.overrides, overlay=running.overlay)
    problems = run_checks(kept)
    if problems:
        raise ConfigError(problems)
    return kept


#: The core's settings fixed for the life of the process: the listening socket and waitress
#: (threads, connections, body size), the data dir and the node id tagging its sessions, the
#: log format (handlers are set up at start), CORS (installed at start), the v1 API's runner.
#: Everything else applies to new requests on reload. An extension's section names its own
#: (:attr:`ConfigSection.restart_only`; all of them: :attr:`Config.restart_only_keys`).
RESTART_ONLY = (("service", "host"), ("service", "port"), ("service", "threads"),
                ("service", "connection_limit"), ("service", "idle_timeout_seconds"),
                ("service", "max_body_bytes"), ("service", "log_format"), ("service", "node_id"),
                ("paths", "data_dir"), ("paths", "homes_dir"), ("cors", None),
                ("hermes", "runner"))


def load_config(path: str | os.PathLike | None = None, need_keys: bool = True,
                overlay=None, sections: Iterable[ConfigSection] = ()) -> Config:
    """Read and validate a config file.

    ``path`` defaults to ``$HERMES_SERVICE_CONFIG`` or ``./config.yaml``.
    Relative ``paths.*`` resolve against the file's folder. ``overlay`` (a function of the
    parsed mapping returning the one to validate, e.g. a demo's) is kept on the config (and on
    a :class:`ConfigError`'s partial one). ``sections``: the extensions' config sections, as
    :func:`build_config` takes them (:func:`hermes_service.installed.load_config` passes the
    installed ones). Raises :class:`ConfigError` (missing file, YAML syntax, schema problems).
    """
    path = Path(path or os.environ.get(ENV_CONFIG) or "config.yaml")
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError([f"{path}: cannot read: {exc.strerror}"]) from exc
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"{path}:{mark.line + 1}" if mark else str(path)
        raise ConfigError([f"{where}: YAML syntax error: {getattr(exc, 'problem', exc)}"]) from exc
    if overlay is not None:
        data = overlay(data)
    return build_config(data, source=str(path), base_dir=path.resolve().parent,
                        need_keys=need_keys, overlay=overlay, sections=sections)
