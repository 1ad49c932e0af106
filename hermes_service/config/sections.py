"""The core's sections of config.yaml (docs/configuring.md; each key's meaning in config.yaml):
one frozen settings class per section, each key declared once — its default and its schema —
by :func:`~hermes_service.config_fields.key`. :data:`SCHEMA` and :data:`DEFAULTS` are read off
the classes. Lists are tuples and mappings read-only; values keep the type YAML gave them (an
int stays an int, so messages print ``300``, not ``300.0``). Each service object takes its
section when it is built and again in its ``configure(section)`` on reload
(:meth:`hermes_service.services.Services.apply`)."""
from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from types import MappingProxyType

from .. import sandbox
from ..config_fields import (
    OPT_POS_INT,
    POS_INT,
    POS_NUM,
    STR_LIST,
    defaults_of,
    derived,
    key,
    object_schema,
    schema_of,
    section,
)

#: API key scopes (docs/configuring.md §API keys): which route families a key may call.
SCOPES = ("v1", "client", "execute", "metrics", "openai")
#: Scopes of a key that lists none. v1.3.0 let every key call every route; /api/v1/execute can
#: read any user's transcripts (``sessions export``), so it must be granted explicitly.
DEFAULT_SCOPES = ("v1", "client")
# service.node_id: the tag new v1 session ids carry (``<node_id>.<uuid>``) so a proxy in
# front of several nodes routes a session to the node that owns it (docs/scaling.md).
NODE_ID_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_-]{0,31}$"
#: ``<count><unit>``, unit s, m, h, d or w (``30d``): ``retention.sessions_older_than``,
#: ``gc --older-than``.
DURATION_PATTERN = r"^[0-9]{1,6}[smhdw]$"
_UNIT_SECONDS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}
_ENV_NAME = "^[A-Za-z_][A-Za-z0-9_]*$"
_BOOL = {"type": "boolean"}


def parse_duration(text: str) -> float:
    """Seconds of a :data:`DURATION_PATTERN` duration (``"30d"`` → 2592000.0); ValueError if
    the text is not one."""
    if not isinstance(text, str) or not re.fullmatch(DURATION_PATTERN, text):
        raise ValueError(f"{text!r} is not a duration like 30d, 12h, 90m (units s m h d w)")
    return float(int(text[:-1]) * _UNIT_SECONDS[text[-1]])


@dataclass(frozen=True)
class ApiKey:
    """One accepted API key. Only the SHA-256 digest is kept in memory."""
    sha256: str
    description: str | None
    expires_at: datetime | None
    actor_id: str | None
    capability_scope: tuple[str, ...] | None
    scopes: frozenset[str] = frozenset(DEFAULT_SCOPES)
    #: a trusted front end (e.g. Open WebUI's server): it may name the user of each request
    #: on the OpenAI-compatible routes (docs/openai-api.md §Who the user is)
    trusted_frontend: bool = False


API_KEY_ENTRY = object_schema({
    "key": {"type": "string", "minLength": 16},
    "key_sha256": {"type": "string", "pattern": "^[0-9a-f]{64}$"},
    "key_env": {"type": "string", "pattern": _ENV_NAME},
    "description": {"type": ["string", "null"]},
    "expires_at": {"type": ["string", "null"]},
    "actor_id": {"type": ["string", "null"]},
    # the same binding under the name the OpenAI-compatible routes' docs use; one of the two
    "user_id": {"type": ["string", "null"]},
    "trusted_frontend": _BOOL,
    "capability_scope": {"type": ["array", "null"], "items": {"type": "string"}},
    "scopes": {"type": "array", "uniqueItems": True, "items": {"enum": list(SCOPES)}},
}, oneOf=[{"required": ["key"]}, {"required": ["key_sha256"]}, {"required": ["key_env"]}])


@dataclass(frozen=True, slots=True)
class SecuritySettings:
    """``security.*``; ``allowed_networks`` are ``allowed_ips`` parsed
    (:func:`~hermes_service.config.parse_network`), ``api_keys`` the resolved
    :class:`ApiKey` entries (digests only)."""
    enable_ip_check: bool = key(True, _BOOL)
    allowed_ips: tuple[str, ...] = key(("127.0.0.1", "::1"), STR_LIST)
    enable_api_key: bool = key(True, _BOOL)
    auth_method: str = key("header", {"enum": ["header", "bearer"]})   # "header" | "bearer"
    api_key_header: str = key("X-API-Key", {"type": "string", "pattern": r"^[A-Za-z0-9-]+$"})
    health_requires_api_key: bool = key(False, _BOOL)
    docs_requires_api_key: bool = key(True, _BOOL)
    api_keys: tuple[ApiKey, ...] = key((), {"type": "array", "items": API_KEY_ENTRY})
    allowed_networks: tuple = derived(())
    #: how many entries ``api_keys`` lists in the file (``api_keys`` leaves out those an
    #: operator command without keys skips: ``key_env`` unset)
    key_entries: int = derived(0)

    @property
    def bearer(self) -> bool:
        """Keys come as ``Authorization: Bearer <key>``, not in :attr:`api_key_header`."""
        return self.auth_method == "bearer"


@dataclass(frozen=True, slots=True)
class NginxSettings:
    """``nginx.*``; ``trusted_proxies`` parsed into networks."""
    trusted_proxies: tuple = key((), STR_LIST)
    enable_real_ip: bool = key(False, _BOOL)


@dataclass(frozen=True, slots=True)
class ServiceSettings:
    """``service.*`` (seconds, bytes, counts as config.yaml documents them)."""
    host: str = key("127.0.0.1", {"type": "string"})
    port: int = key(9123, {"type": "integer", "minimum": 0, "maximum": 65535})
    log_level: str = key("info", {"enum": ["debug", "info", "warning", "error"]})
    log_format: str = key("text", {"enum": ["text", "json"]})
    threads: int = key(None, OPT_POS_INT)      # null: derived (config/sizing.py)
    max_body_bytes: int = key(1048576, POS_INT)
    connection_limit: int = key(None, OPT_POS_INT)   # null: derived
    idle_timeout_seconds: int = key(20, POS_INT)
    drain_seconds: float = key(60, {"type": "number", "minimum": 0})
    node_id: str | None = key(None, {"type": ["string", "null"], "pattern": NODE_ID_PATTERN})
    idempotency_ttl_seconds: float = key(86400, POS_NUM)
    idempotency_max_records_per_key: int = key(100_000, POS_INT)


@dataclass(frozen=True, slots=True)
class CorsSettings:
    """``cors.*`` (CORS is off while ``allow_origins`` is empty)."""
    allow_origins: tuple[str, ...] = key((), STR_LIST)
    allow_credentials: bool = key(False, _BOOL)
    allow_methods: tuple[str, ...] = key(("GET", "POST", "DELETE"), STR_LIST)
    allow_headers: tuple[str, ...] = key(("*",), STR_LIST)


@dataclass(frozen=True, slots=True)
class AcpSettings:
    """``hermes.acp.*``: the warm ``hermes acp`` pool."""
    idle_seconds: float = key(600, POS_NUM)
    max_processes: int = key(None, OPT_POS_INT)   # null: derived from the memory
    min_available_mb: int = key(None, OPT_POS_INT)  # null: derived from the memory
    recycle_after_sessions: int = key(100, POS_INT)
    max_rss_mb: float = key(300, POS_NUM)
    start_timeout_seconds: float = key(60, POS_NUM)


@dataclass(frozen=True, slots=True)
class ApprovalSettings:
    """``hermes.approvals.*``."""
    mode: str = key("ask", {"enum": ["ask", "deny"]})          # "ask" | "deny"
    timeout_seconds: float = key(120, POS_NUM)
    allow_always: bool = key(True, _BOOL)
    #: route family -> what a command Hermes flags does where nobody can approve it:
    #: ``deny`` (the default for every family not named) | ``run`` (inside the sandbox)
    unattended: Mapping[str, str] = key(MappingProxyType({}), {
        "type": "object", "additionalProperties": {"enum": ["deny", "run"]}})


@dataclass(frozen=True, slots=True)
class ModelSettings:
    """``hermes.model.*``: the provider every user's Hermes home is given."""
    provider: str = key("custom", {"type": "string"})
    base_url: str | None = key(None, {"type": ["string", "null"]})
    default: str | None = key(None, {"type": ["string", "null"]})
    api_key_env: str | None = key("HERMES_PROVIDER_API_KEY",
                                  {"type": ["string", "null"], "pattern": _ENV_NAME})
    context_length: int = key(128000, POS_INT)


@dataclass(frozen=True, slots=True)
class UsageLimits:
    """``hermes.limits.*``: what one user may spend. ``daily_tokens``: model tokens (prompt +
    completion) per UTC day through the pass-through, None for no limit."""
    daily_tokens: int | None = key(None, {"type": ["integer", "null"], "minimum": 1})


@dataclass(frozen=True, slots=True)
class ExecuteSettings:
    """``hermes.execute.*``: ``allowed`` is a tuple of argv prefixes (tuples of words)."""
    allowed: tuple[tuple[str, ...], ...] = key(
        (("version",), ("status",), ("sessions", "list"), ("sessions", "export", "-"),
         ("skills", "list")),
        {"type": "array", "items": {**STR_LIST, "minItems": 1}})
    timeout_seconds: float = key(60, POS_NUM)
    max_output_bytes: int = key(65536, POS_INT)


@dataclass(frozen=True, slots=True)
class HermesSettings:
    """``hermes.*``, with the sizes derived from it (:attr:`cli_slots`,
    :attr:`admission_places`, :attr:`longest_turn_seconds`)."""
    command: str = key("hermes", {"type": "string", "minLength": 1})
    runner: str = key("cli", {"enum": ["cli", "acp"]})   # the v1 API's runner
    acp: AcpSettings = section(AcpSettings)
    timeout_seconds: float = key(300, POS_NUM)
    stall_timeout_seconds: float = key(240, POS_NUM)
    approvals: ApprovalSettings = section(ApprovalSettings)
    max_concurrent_runs: int = key(None, OPT_POS_INT)   # null: the cores
    queue_wait_seconds: float = key(30, {"type": "number", "minimum": 0})
    max_waiting_requests: int = key(4, {"type": "integer", "minimum": 0})
    max_message_bytes: int = key(122880, {"type": "integer", "minimum": 1, "maximum": 126976})
    toolsets: tuple[str, ...] = key(("terminal", "file", "code_execution", "todo", "memory"),
                                    STR_LIST)
    sandbox: sandbox.Settings = section(sandbox.Settings)
    extra_env: Mapping[str, str] = key(MappingProxyType({}), {   # read-only
        "type": "object", "additionalProperties": {"type": "string"}})
    limits: UsageLimits = section(UsageLimits)
    model: ModelSettings = section(ModelSettings)
    execute: ExecuteSettings = section(ExecuteSettings)

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
    """``paths.*``, resolved against the config file's folder (absolute; the defaults are the
    file's relative ones). ``homes_dir``: where the users' homes, their run folders and the
    service's own home live (everything a sandbox can write: docs/sandbox.md §Disk); the data
    dir when ``paths.homes_dir`` is null."""
    data_dir: Path = key("data", {"type": "string"})
    users_template: Path = key("users_template", {"type": "string"})
    homes_dir: Path | None = key(None, {"type": ["string", "null"]})

    @property
    def homes(self) -> Path:
        return self.homes_dir if self.homes_dir is not None else self.data_dir


@dataclass(frozen=True, slots=True)
class StorageSettings:
    """``storage.*``: the PostgreSQL several nodes share (docs/scaling.md §Shared storage).
    ``url`` null: this node keeps everything on its own disk (the single-node default) and the
    other keys are not used. Seconds and milliseconds as config.yaml documents them."""
    #: a libpq URL without a password (checked by ``storage_url`` in config/checks.py, which
    #: never repeats it: it may hold one)
    url: str | None = key(None, {"type": ["string", "null"], "minLength": 1})
    password_env: str | None = key(None, {"type": ["string", "null"], "pattern": _ENV_NAME})
    #: the lease holder's name; null: ``<hostname>:<service.port>``
    node_id: str | None = key(None, {"type": ["string", "null"], "minLength": 1,
                                     "maxLength": 128})
    lease_ttl_seconds: float = key(15, {"type": "number", "minimum": 2, "maximum": 600})
    pool_size: int = key(8, {"type": "integer", "minimum": 1, "maximum": 100})
    statement_timeout_ms: int = key(10000, {"type": "integer", "minimum": 100})
    #: a user's lease is released after this many seconds without a request (its home stays
    #: on this node's disk as a cache, checked against the snapshot's number on the next take)
    idle_release_seconds: float = key(120, POS_NUM)

    @property
    def enabled(self) -> bool:
        return self.url is not None


@dataclass(frozen=True, slots=True)
class RetentionSettings:
    """``retention.*``."""
    interval_seconds: float = key(3600, {"type": "number", "minimum": 0})
    #: a duration (:data:`DURATION_PATTERN`)
    sessions_older_than: str | None = key(None, {"type": ["string", "null"],
                                                 "pattern": DURATION_PATTERN})
    purge_transcripts: bool = key(False, _BOOL)
    idempotency_window_seconds: float = key(86400, POS_NUM)

    @property
    def sessions_older_than_seconds(self) -> float | None:
        """:attr:`sessions_older_than` in seconds (None: keep every session mapping)."""
        return parse_duration(self.sessions_older_than) if self.sessions_older_than else None


#: the core's sections, in config.yaml's order (:class:`~hermes_service.config.Config`'s
#: fields of the same names)
CORE = {"security": SecuritySettings, "nginx": NginxSettings, "service": ServiceSettings,
        "cors": CorsSettings, "hermes": HermesSettings, "paths": PathsSettings,
        "storage": StorageSettings, "retention": RetentionSettings}
#: the jsonschema of the core's part of a config file, read off the section classes
SCHEMA = object_schema({name: schema_of(cls) for name, cls in CORE.items()})
#: every default of the core's part of a config file, as the file writes it
DEFAULTS: dict = {name: defaults_of(cls) for name, cls in CORE.items()}
#: the core's sections (:attr:`Config`'s fields of the same names)
CORE_SECTIONS = tuple(CORE)
#: the core's sections that come after the extensions' (in the schema, and so in the
#: unknown-key hints, as config.yaml orders them): retention cleans up after all of them
TAIL_SECTIONS = ("retention",)

#: The core's settings fixed for the life of the process: the listening socket and waitress
#: (threads, connections, body size), the data dir and the node id tagging its sessions, the
#: log format (handlers are set up at start), CORS (installed at start), the v1 API's runner.
#: Everything else applies to new requests on reload. An extension's section names its own
#: (:attr:`ConfigSection.restart_only`; all of them: :attr:`Config.restart_only_keys`).
RESTART_ONLY = (("service", "host"), ("service", "port"), ("service", "threads"),
                ("service", "connection_limit"), ("service", "idle_timeout_seconds"),
                ("service", "max_body_bytes"), ("service", "log_format"), ("service", "node_id"),
                ("paths", "data_dir"), ("paths", "homes_dir"), ("cors", None), ("storage", None),
                ("hermes", "runner"))
