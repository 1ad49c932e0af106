"""Service configuration: load ``config.yaml``, validate it, resolve defaults.

The file layout follows the spec's example config (hermes-service-api-v1.3.0
§配置文件) plus the keys added by issue #2 (``hermes.*``, ``paths.*``,
``key_sha256``), #3 (``mnote.*``), #8 (``service.connection_limit``,
``service.idle_timeout_seconds``, ``api_keys[].scopes``) and #9 (``retention.*``). Validation uses jsonschema plus
the cross-field checks below; every problem is reported as ``file:dotted.key: problem`` so
``check-config`` can print it and a bad file never starts a half-working server.

Every problem is found in one pass: a value the schema refuses is left out (its default
stands in) and the cross-field checks run on the keys that validated, skipping a check that
reads a refused one (:func:`is_invalid`), so that it never reports a value the file does not
have. :class:`ConfigError` carries that ``partial`` config and the ``invalid`` keys, and
:func:`hermes_service.preflight.load_and_check` checks what the valid keys name as well.

Two kinds of findings (README §Configuring):

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
from dataclasses import dataclass, field
from datetime import date, datetime, timezone
from pathlib import Path
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
        "toolsets": [],
        "sandbox": {"mode": "auto", "allow_host_tools": False, "max_home_mb": 2048,
                    "bwrap": "bwrap",
                    "limits": {"memory_mb": 2048, "processes": 256, "cpu_seconds": 600,
                               "file_size_mb": 512, "open_files": 1024, "tmp_mb": 256}},
        "extra_env": {},
        "model": {"provider": "custom", "base_url": None, "default": None,
                  "api_key_env": "HERMES_PROVIDER_API_KEY", "context_length": 128000},
        "execute": {
            "allowed": [["version"], ["status"], ["sessions", "list"],
                        ["sessions", "export", "-"], ["skills", "list"]],
            "timeout_seconds": 60,
            "max_output_bytes": 65536,
        },
    },
    "paths": {"data_dir": "data", "users_template": "users_template"},
    "mnote": {
        "enabled": True,
        "default_model": "hermes-agent",
        "models": [{"id": "hermes-agent", "label": "Hermes Agent", "provider": "hermes"}],
        "events_retention_seconds": 3600,
        "keepalive_seconds": 15,
        "max_event_streams": 12,
        "default_capability_scope": ["page.read", "page.write", "artifact.write"],
        "service_url": None,
        "runner": "acp",
    },
    "retention": {
        "interval_seconds": 3600,
        "sessions_older_than": None,
        "purge_transcripts": False,
        "idempotency_window_seconds": 86400,
    },
}

#: API key scopes (README §API keys): which route families a key may call.
SCOPES = ("v1", "client", "execute", "metrics")
#: Scopes of a key that lists none. v1.3.0 let every key call every route; /api/v1/execute can
#: read any user's transcripts (``sessions export``), so it must be granted explicitly.
DEFAULT_SCOPES = ("v1", "client")
#: Hermes refuses a context window below this (agent/model_metadata.py MINIMUM_CONTEXT_LENGTH).
HERMES_MIN_CONTEXT_LENGTH = 64000
#: The example provider shipped in config.yaml before issue #8: not a provider.
PLACEHOLDER_PROVIDERS = {("http://127.0.0.1:8000/v1", "gpt-4o-mini")}
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

_STR_LIST = {"type": "array", "items": {"type": "string"}}
_POS_INT = {"type": "integer", "minimum": 1}
_POS_NUM = {"type": "number", "exclusiveMinimum": 0}


def _obj(props: dict, **extra) -> dict:
    return {"type": "object", "properties": props, "additionalProperties": False, **extra}


SCHEMA = _obj({
    "security": _obj({
        "enable_ip_check": {"type": "boolean"},
        "allowed_ips": _STR_LIST,
        "enable_api_key": {"type": "boolean"},
        "auth_method": {"enum": ["header", "bearer"]},
        "api_key_header": {"type": "string", "pattern": r"^[A-Za-z0-9-]+$"},
        "health_requires_api_key": {"type": "boolean"},
        "docs_requires_api_key": {"type": "boolean"},
        "api_keys": {"type": "array", "items": _obj({
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
    "nginx": _obj({"trusted_proxies": _STR_LIST, "enable_real_ip": {"type": "boolean"}}),
    "service": _obj({
        "host": {"type": "string"},
        "port": {"type": "integer", "minimum": 0, "maximum": 65535},
        "log_level": {"enum": ["debug", "info", "warning", "error"]},
        "log_format": {"enum": ["text", "json"]},
        "threads": _POS_INT,
        "max_body_bytes": _POS_INT,
        "connection_limit": _POS_INT,
        "idle_timeout_seconds": _POS_INT,
        "drain_seconds": {"type": "number", "minimum": 0},
        "node_id": {"type": ["string", "null"], "pattern": NODE_ID_PATTERN},
        "idempotency_ttl_seconds": _POS_NUM,
    }),
    "cors": _obj({"allow_origins": _STR_LIST, "allow_credentials": {"type": "boolean"},
                  "allow_methods": _STR_LIST, "allow_headers": _STR_LIST}),
    "hermes": _obj({
        "command": {"type": "string", "minLength": 1},
        "runner": {"enum": ["cli", "acp"]},
        "acp": _obj({
            "idle_seconds": _POS_NUM,
            "max_processes": _POS_INT,
            "recycle_after_sessions": _POS_INT,
            "max_rss_mb": _POS_NUM,
            "start_timeout_seconds": _POS_NUM,
        }),
        "timeout_seconds": _POS_NUM,
        "stall_timeout_seconds": _POS_NUM,
        "approvals": _obj({
            "mode": {"enum": ["ask", "deny"]},
            "timeout_seconds": _POS_NUM,
            "allow_always": {"type": "boolean"},
        }),
        "max_concurrent_runs": _POS_INT,
        "queue_wait_seconds": {"type": "number", "minimum": 0},
        "max_waiting_requests": {"type": "integer", "minimum": 0},
        "max_message_bytes": {"type": "integer", "minimum": 1, "maximum": 126976},
        "toolsets": _STR_LIST,
        "sandbox": _obj({
            "mode": {"enum": ["auto", "bwrap", "none"]},
            "allow_host_tools": {"type": "boolean"},
            "max_home_mb": _POS_NUM,
            "bwrap": {"type": "string", "minLength": 1},
            "limits": _obj({
                "memory_mb": {"type": "integer", "minimum": 256},
                "processes": {"type": "integer", "minimum": 32},
                "cpu_seconds": {"type": "integer", "minimum": 10},
                "file_size_mb": _POS_INT,
                "open_files": {"type": "integer", "minimum": 64},
                "tmp_mb": _POS_INT,
            }),
        }),
        "extra_env": {"type": "object", "additionalProperties": {"type": "string"}},
        "model": _obj({
            "provider": {"type": "string"},
            "base_url": {"type": ["string", "null"]},
            "default": {"type": ["string", "null"]},
            "api_key_env": {"type": ["string", "null"], "pattern": "^[A-Za-z_][A-Za-z0-9_]*$"},
            "context_length": _POS_INT,
        }),
        "execute": _obj({
            "allowed": {"type": "array", "items": {**_STR_LIST, "minItems": 1}},
            "timeout_seconds": _POS_NUM,
            "max_output_bytes": _POS_INT,
        }),
    }),
    "paths": _obj({"data_dir": {"type": "string"}, "users_template": {"type": "string"}}),
    "mnote": _obj({
        "enabled": {"type": "boolean"},
        "default_model": {"type": "string"},
        "models": {"type": "array", "minItems": 1, "items": _obj({
            "id": {"type": "string"}, "label": {"type": "string"}, "provider": {"type": "string"},
            "hermes_model": {"type": ["string", "null"]},
        }, required=["id"])},
        "events_retention_seconds": _POS_NUM,
        "keepalive_seconds": _POS_NUM,
        "max_event_streams": _POS_INT,
        "default_capability_scope": _STR_LIST,
        "service_url": {"type": ["string", "null"]},
        "runner": {"enum": ["cli", "acp"]},
    }),
    "retention": _obj({
        "interval_seconds": {"type": "number", "minimum": 0},
        "sessions_older_than": {"type": ["string", "null"], "pattern": DURATION_PATTERN},
        "purge_transcripts": {"type": "boolean"},
        "idempotency_window_seconds": _POS_NUM,
    }),
})


class ConfigError(Exception):
    """Raised with every problem found; ``problems`` are ``file:key: problem`` lines.

    ``partial``: when the file parsed, the :class:`Config` of its valid keys with defaults for
    the ``invalid`` ones (dotted keys, e.g. ``"service.port"``, ``"security.api_keys.0"``) —
    only for checking what the valid keys name (:func:`hermes_service.preflight.problems`);
    never served. None when the file could not be read or parsed."""

    def __init__(self, problems: list[str], partial: "Config | None" = None,
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
        return [".".join(path + [k]) for k in err.instance if k not in known]
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
            out[key] = [_without(v, invalid, (*prefix, str(key), str(i))) for i, v in enumerate(value)]
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


@dataclass
class Config:
    """The validated configuration.

    ``raw`` is the merged dict (defaults + file); the typed fields are the
    resolved values the service objects use. Paths are absolute.
    ``provider_issues`` say why no model turn can work (empty when the provider is usable);
    ``warnings`` are every finding that does not stop the service (provider issues included),
    as ``file:key: problem`` lines.
    """
    raw: dict
    source: str
    data_dir: Path
    users_template: Path
    allowed_networks: tuple
    trusted_proxies: tuple
    api_keys: tuple[ApiKey, ...]
    provider_issues: tuple[str, ...] = ()
    warnings: tuple[str, ...] = ()
    #: restart-only settings a command-line option replaced (``--threads``): (section, key)
    #: -> the file's value, which reloads compare the file with (``raw`` has the running one)
    overrides: dict = field(default_factory=dict)
    #: what a command-line option puts over the file's mapping before it is validated
    #: (``--demo``: :func:`hermes_service.mnote.demo.overlay`); reloads apply it to the new file too
    overlay: object = None

    def __getitem__(self, section: str) -> dict:
        return self.raw[section]


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
    return value if value.tzinfo else value.replace(tzinfo=timezone.utc)


def build_config(raw_file: dict | None, source: str = "<dict>", base_dir: Path | None = None,
                 need_keys: bool = True) -> Config:
    """Validate a parsed config mapping and resolve it into a :class:`Config`.

    ``need_keys=False`` (operator commands that serve nothing, e.g. ``mnote``) skips keys
    whose ``key_env`` variable is unset instead of failing. Raises :class:`ConfigError`
    listing every problem found: the schema's and the cross-field checks' of the keys that
    validated, in one pass (the module doc).
    """
    if raw_file is None:
        raw_file = {}
    if not isinstance(raw_file, dict):
        raise ConfigError([f"{source}: the top level must be a mapping"])
    errors = sorted(jsonschema.Draft202012Validator(SCHEMA).iter_errors(raw_file),
                    key=lambda e: list(map(str, e.absolute_path)))
    problems = [f"{source}:{_schema_problem(e)}" for e in errors]
    invalid = frozenset(k for e in errors for k in _refused_keys(e))

    def ok(*keys: str) -> bool:          # may a check read these keys?
        return not any(is_invalid(k, invalid) for k in keys)
    raw = _merge(DEFAULTS, _without(raw_file, invalid))
    base_dir = base_dir or Path.cwd()

    def nets(key_path: str, values: list[str]):
        out = []
        for i, text in enumerate(values):
            if not ok(f"{key_path}.{i}"):
                continue
            try:
                out.append(parse_network(text))
            except ValueError as exc:
                problems.append(f"{source}:{key_path}.{i}: {exc}")
        return tuple(out)

    allowed = nets("security.allowed_ips", raw["security"]["allowed_ips"])
    proxies = nets("nginx.trusted_proxies", raw["nginx"]["trusted_proxies"])
    warnings: list[str] = []
    keys = []
    now = datetime.now(timezone.utc)
    for i, entry in enumerate(raw["security"]["api_keys"]):
        where = f"{source}:security.api_keys.{i}"
        if not ok(f"security.api_keys.{i}"):
            continue
        plain = entry.get("key")
        if entry.get("key_env"):
            plain = os.environ.get(entry["key_env"])
            if not plain or len(plain) < 16:
                if not need_keys:
                    continue
                problems.append(f"{where}.key_env: environment variable "
                                f"{entry['key_env']} is unset or shorter than 16 characters")
                continue
        if plain is not None and plain != plain.strip():
            what = f"the value of {entry['key_env']}" if entry.get("key_env") else "key"
            problems.append(f"{where}.{'key_env' if entry.get('key_env') else 'key'}: {what} has "
                            "leading or trailing whitespace, which no HTTP header carries: this "
                            "key could never match")
            continue
        digest = entry.get("key_sha256") or hashlib.sha256(plain.encode()).hexdigest()
        expires = None
        if entry.get("expires_at"):
            try:
                expires = _parse_time(entry["expires_at"])
            except ValueError:
                problems.append(f"{where}.expires_at: not an ISO 8601 time")
            else:
                if expires <= now:
                    warnings.append(f"{where}.expires_at: {entry['expires_at']} is in the past: "
                                    "this key is refused (401 api_key_expired); remove it")
        scope = entry.get("capability_scope")
        scopes = entry.get("scopes")
        keys.append(ApiKey(digest, entry.get("description"), expires, entry.get("actor_id"),
                           tuple(scope) if scope is not None else None,
                           frozenset(DEFAULT_SCOPES if scopes is None else scopes)))
    if ok("security.enable_api_key", "security.api_keys") and \
            raw["security"]["enable_api_key"] and not raw["security"]["api_keys"]:
        problems.append(f"{source}:security.api_keys: enable_api_key is true but no key is "
                        "configured (run `.venv/bin/python main.py keygen`)")
    cors = raw["cors"]
    if ok("cors.allow_credentials", "cors.allow_origins") and \
            cors["allow_credentials"] and "*" in cors["allow_origins"]:
        problems.append(f"{source}:cors.allow_origins: '*' cannot be combined with "
                        "allow_credentials: true; list the origins")
    model_ids = [m["id"] for m in raw["mnote"]["models"]] if ok("mnote.models") else []
    if ok("mnote.models", "mnote.default_model") and \
            raw["mnote"]["default_model"] not in model_ids:
        problems.append(f"{source}:mnote.default_model: '{raw['mnote']['default_model']}' "
                        f"is not one of mnote.models ({', '.join(model_ids)})")
    h = raw["hermes"]
    needed = raw["mnote"]["max_event_streams"] + 2 * h["max_concurrent_runs"] + \
        h["max_waiting_requests"] + 4
    threads = raw["service"]["threads"]
    if ok("service.threads", "mnote.max_event_streams", "hermes.max_concurrent_runs",
          "hermes.max_waiting_requests") and threads < needed:
        problems.append(f"{source}:service.threads: {threads} is too few; event "
                        "streams, v1 turns (running and waiting) and tool calls each hold a thread "
                        f"(need >= {needed} = mnote.max_event_streams + 2 * hermes.max_concurrent_runs"
                        " + hermes.max_waiting_requests + 4)")
    limit = raw["service"]["connection_limit"]
    if ok("service.connection_limit", "service.threads") and limit < threads + SPARE_CONNECTIONS:
        problems.append(f"{source}:service.connection_limit: {limit} is too few; every thread "
                        f"(service.threads: {threads}, which includes the "
                        f"{raw['mnote']['max_event_streams']} of mnote.max_event_streams) can hold "
                        f"one, and idle or queued connections need room beyond them (need >= "
                        f"{threads + SPARE_CONNECTIONS} = service.threads + {SPARE_CONNECTIONS})")
    ctx_len = h["model"]["context_length"]
    if ok("hermes.model.context_length") and ctx_len < HERMES_MIN_CONTEXT_LENGTH:
        problems.append(f"{source}:hermes.model.context_length: {ctx_len} is below Hermes's minimum "
                        f"of {HERMES_MIN_CONTEXT_LENGTH} tokens (Hermes refuses to run with less: "
                        "every turn would fail)")
    ret = raw["retention"]
    if ok("retention.interval_seconds") and 0 < ret["interval_seconds"] < 60:
        problems.append(f"{source}:retention.interval_seconds: {ret['interval_seconds']} is too "
                        "short; use 0 (no periodic cleanup) or at least 60")
    older = ret["sessions_older_than"]
    if ok("retention.sessions_older_than") and older and \
            parse_duration(older) < MIN_SESSION_AGE_SECONDS:
        problems.append(f"{source}:retention.sessions_older_than: must be at least 1h (a mapping "
                        "used within the last hour is never removed)")
    if ok("retention.idempotency_window_seconds", "hermes.timeout_seconds") and \
            ret["idempotency_window_seconds"] < h["timeout_seconds"]:
        problems.append(f"{source}:retention.idempotency_window_seconds: must be at least "
                        f"hermes.timeout_seconds ({h['timeout_seconds']}): a run's retries must "
                        "find their first response")
    ttl = raw["service"]["idempotency_ttl_seconds"]
    if ok("service.idempotency_ttl_seconds", "hermes.timeout_seconds",
          "hermes.queue_wait_seconds") and ttl < h["timeout_seconds"] + h["queue_wait_seconds"]:
        problems.append(f"{source}:service.idempotency_ttl_seconds: must be at least "
                        f"hermes.queue_wait_seconds + hermes.timeout_seconds "
                        f"({h['queue_wait_seconds'] + h['timeout_seconds']}): a retry must find "
                        "the outcome of a turn that took as long as a turn may (README "
                        "§Idempotent retries)")
    if ok("hermes.sandbox", "hermes.toolsets"):
        problems += sandbox.problems(sandbox.Settings.from_config(h["sandbox"]), h["toolsets"],
                                     source)
    for i, argv in enumerate(raw["hermes"]["execute"]["allowed"]):
        if ok(f"hermes.execute.allowed.{i}") and argv and argv[0] == "chat":
            problems.append(f"{source}:hermes.execute.allowed.{i}: 'chat' is not allowed here; "
                            "use the sessions API")
    issues = provider_issues(raw["hermes"]["model"], source) if ok("hermes.model") else []
    if ok("hermes.sandbox"):
        warnings += sandbox.warnings(sandbox.Settings.from_config(h["sandbox"]), source)

    def resolve(p: str) -> Path:
        path = Path(os.path.expanduser(p))
        return (path if path.is_absolute() else base_dir / path).resolve()

    config = Config(raw=raw, source=source, data_dir=resolve(raw["paths"]["data_dir"]),
                    users_template=resolve(raw["paths"]["users_template"]),
                    allowed_networks=allowed, trusted_proxies=proxies, api_keys=tuple(keys),
                    provider_issues=tuple(issues), warnings=tuple(warnings + issues))
    if problems:
        raise ConfigError(problems, partial=config, invalid=invalid)
    return config


def provider_issues(model: dict, source: str = "<dict>") -> list[str]:
    """Why no model turn can work with ``hermes.model`` in this environment (empty: usable).

    * no ``base_url`` / ``default`` (the shipped config has none), or the example pair
      shipped before (``http://127.0.0.1:8000/v1`` + ``gpt-4o-mini``);
    * ``api_key_env`` names a variable that is unset or empty in the service's environment
      (Hermes would send the literal text ``${NAME}`` as the key).
    """
    out = []
    base_url, name = model.get("base_url"), model.get("default")
    if not base_url or not name:
        missing = " and ".join(k for k, v in (("hermes.model.base_url", base_url),
                                              ("hermes.model.default", name)) if not v)
        out.append(f"{source}:hermes.model.base_url: no model provider is configured: set "
                   f"{missing} (your provider's OpenAI-compatible /v1 URL and its model name)")
    elif (base_url.rstrip("/"), name) in PLACEHOLDER_PROVIDERS:
        out.append(f"{source}:hermes.model.base_url: {base_url} with model {name} is the example "
                   "shipped in config.yaml, not a provider: set hermes.model.base_url and "
                   "hermes.model.default")
    key_env = model.get("api_key_env")
    if key_env and not os.environ.get(key_env):
        out.append(f"{source}:hermes.model.api_key_env: {key_env} is not set in the service's "
                   f"environment: export {key_env}=<your provider key> (or set "
                   "hermes.model.api_key_env: null for a provider without keys)")
    return out


def restart_only(running: Config, new: Config) -> list[str]:
    """Dotted keys whose new value a live reload cannot apply (README §Reload). A key a
    command-line option overrode is compared with the file's value it was started with."""
    def value(cfg: Config, section: str, key: str | None):
        if (section, key) in cfg.overrides:
            return cfg.overrides[(section, key)]
        return cfg.raw[section].get(key) if key else cfg.raw[section]
    return [f"{section}.{key}" if key else section for section, key in RESTART_ONLY
            if value(running, section, key) != value(new, section, key)]


#: Settings fixed for the life of the process: the listening socket and waitress
#: (threads, connections, body size), the data dir and the node id tagging its sessions, the
#: log format (handlers are set up at start), CORS (installed at start), the tool callback URL
#: handed to runs, the runner and whether the mnote extension is on (its routes are registered
#: at start). Everything else applies to new requests on reload.
RESTART_ONLY = (("service", "host"), ("service", "port"), ("service", "threads"),
                ("service", "connection_limit"), ("service", "idle_timeout_seconds"),
                ("service", "max_body_bytes"), ("service", "log_format"), ("service", "node_id"),
                ("paths", "data_dir"), ("cors", None), ("mnote", "service_url"),
                ("hermes", "runner"), ("mnote", "runner"), ("mnote", "enabled"))


def load_config(path: str | os.PathLike | None = None, need_keys: bool = True,
                overlay=None) -> Config:
    """Read and validate a config file.

    ``path`` defaults to ``$HERMES_SERVICE_CONFIG`` or ``./config.yaml``.
    Relative ``paths.*`` resolve against the file's folder. ``overlay`` (a function of the
    parsed mapping returning the one to validate, e.g. :func:`hermes_service.mnote.demo.overlay`)
    is kept on the config (and on a :class:`ConfigError`'s partial one).
    Raises :class:`ConfigError` (missing file, YAML syntax, schema problems).
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
    try:
        config = build_config(data, source=str(path), base_dir=path.resolve().parent,
                              need_keys=need_keys)
    except ConfigError as exc:
        if exc.partial is not None:
            exc.partial.overlay = overlay
        raise
    config.overlay = overlay
    return config

