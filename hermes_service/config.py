"""Service configuration: load ``config.yaml``, validate it, resolve defaults.

The file layout follows the spec's example config (hermes-service-api-v1.3.0
§配置文件) plus the keys added by issue #2 (``hermes.*``, ``paths.*``,
``key_sha256``) and #3 (``mnote.*``). Validation uses jsonschema; every
problem is reported as ``file:dotted.key: problem`` so ``check-config`` can
print it and a bad file never starts a half-working server.
"""
from __future__ import annotations

import copy
import difflib
import hashlib
import ipaddress
import os
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import jsonschema
import yaml

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
    },
    "nginx": {"trusted_proxies": [], "enable_real_ip": False},
    "service": {"host": "127.0.0.1", "port": 9123, "log_level": "info", "log_format": "text",
                "threads": 32, "max_body_bytes": 1048576, "node_id": None},
    "cors": {"allow_origins": [], "allow_credentials": False,
             "allow_methods": ["GET", "POST", "DELETE"], "allow_headers": ["*"]},
    "hermes": {
        "command": "hermes",
        "timeout_seconds": 300,
        "stall_timeout_seconds": 240,
        "max_concurrent_runs": 2,
        "queue_wait_seconds": 30,
        "max_waiting_requests": 4,
        "max_message_bytes": 122880,
        "toolsets": [],
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
        "default_model": "hermes-agent",
        "models": [{"id": "hermes-agent", "label": "Hermes Agent", "provider": "hermes"}],
        "events_retention_seconds": 3600,
        "keepalive_seconds": 15,
        "max_event_streams": 12,
        "default_capability_scope": ["page.read", "page.write", "artifact.write"],
        "service_url": None,
    },
}

# service.node_id: the tag new v1 session ids carry (``<node_id>.<uuid>``) so a proxy in
# front of several nodes routes a session to the node that owns it (docs/scaling.md).
NODE_ID_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_-]{0,31}$"

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
        "api_keys": {"type": "array", "items": _obj({
            "key": {"type": "string", "minLength": 16},
            "key_sha256": {"type": "string", "pattern": "^[0-9a-f]{64}$"},
            "key_env": {"type": "string", "pattern": "^[A-Za-z_][A-Za-z0-9_]*$"},
            "description": {"type": ["string", "null"]},
            "expires_at": {"type": ["string", "null"]},
            "actor_id": {"type": ["string", "null"]},
            "capability_scope": {"type": ["array", "null"], "items": {"type": "string"}},
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
        "node_id": {"type": ["string", "null"], "pattern": NODE_ID_PATTERN},
    }),
    "cors": _obj({"allow_origins": _STR_LIST, "allow_credentials": {"type": "boolean"},
                  "allow_methods": _STR_LIST, "allow_headers": _STR_LIST}),
    "hermes": _obj({
        "command": {"type": "string", "minLength": 1},
        "timeout_seconds": _POS_NUM,
        "stall_timeout_seconds": _POS_NUM,
        "max_concurrent_runs": _POS_INT,
        "queue_wait_seconds": {"type": "number", "minimum": 0},
        "max_waiting_requests": {"type": "integer", "minimum": 0},
        "max_message_bytes": {"type": "integer", "minimum": 1, "maximum": 126976},
        "toolsets": _STR_LIST,
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
    }),
})


class ConfigError(Exception):
    """Raised with every problem found; ``problems`` are ``file:key: problem`` lines."""

    def __init__(self, problems: list[str]):
        super().__init__("\n".join(problems))
        self.problems = problems


@dataclass(frozen=True)
class ApiKey:
    """One accepted API key. Only the SHA-256 digest is kept in memory."""
    sha256: str
    description: str | None
    expires_at: datetime | None
    actor_id: str | None
    capability_scope: tuple[str, ...] | None


@dataclass
class Config:
    """The validated configuration.

    ``raw`` is the merged dict (defaults + file); the typed fields are the
    resolved values the service objects use. Paths are absolute.
    """
    raw: dict
    source: str
    data_dir: Path
    users_template: Path
    allowed_networks: tuple
    trusted_proxies: tuple
    api_keys: tuple[ApiKey, ...]

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
    return f"{_dotted(err.absolute_path)}: {err.message}"


def parse_network(text: str):
    """Parse one IP or CIDR (IPv4 or IPv6) with :mod:`ipaddress`; ValueError if bad."""
    return ipaddress.ip_network(text.strip(), strict=False)


def _parse_time(text: str) -> datetime:
    value = datetime.fromisoformat(text.replace("Z", "+00:00"))
    return value if value.tzinfo else value.replace(tzinfo=timezone.utc)


def build_config(raw_file: dict | None, source: str = "<dict>", base_dir: Path | None = None,
                 need_keys: bool = True) -> Config:
    """Validate a parsed config mapping and resolve it into a :class:`Config`.

    ``need_keys=False`` (operator commands that serve nothing, e.g. ``mnote``) skips keys
    whose ``key_env`` variable is unset instead of failing. Raises :class:`ConfigError`
    listing every problem found.
    """
    if raw_file is None:
        raw_file = {}
    if not isinstance(raw_file, dict):
        raise ConfigError([f"{source}: the top level must be a mapping"])
    problems = [f"{source}:{_schema_problem(e)}" for e in
                sorted(jsonschema.Draft202012Validator(SCHEMA).iter_errors(raw_file),
                       key=lambda e: list(map(str, e.absolute_path)))]
    if problems:
        raise ConfigError(problems)
    raw = _merge(DEFAULTS, raw_file)
    base_dir = base_dir or Path.cwd()

    def nets(key_path: str, values: list[str]):
        out = []
        for i, text in enumerate(values):
            try:
                out.append(parse_network(text))
            except ValueError as exc:
                problems.append(f"{source}:{key_path}.{i}: {exc}")
        return tuple(out)

    allowed = nets("security.allowed_ips", raw["security"]["allowed_ips"])
    proxies = nets("nginx.trusted_proxies", raw["nginx"]["trusted_proxies"])
    keys = []
    for i, entry in enumerate(raw["security"]["api_keys"]):
        plain = entry.get("key")
        if entry.get("key_env"):
            plain = os.environ.get(entry["key_env"])
            if not plain or len(plain) < 16:
                if not need_keys:
                    continue
                problems.append(f"{source}:security.api_keys.{i}.key_env: environment variable "
                                f"{entry['key_env']} is unset or shorter than 16 characters")
                continue
        digest = entry.get("key_sha256") or hashlib.sha256(plain.encode()).hexdigest()
        expires = None
        if entry.get("expires_at"):
            try:
                expires = _parse_time(entry["expires_at"])
            except ValueError:
                problems.append(f"{source}:security.api_keys.{i}.expires_at: not an ISO 8601 time")
        scope = entry.get("capability_scope")
        keys.append(ApiKey(digest, entry.get("description"), expires, entry.get("actor_id"),
                           tuple(scope) if scope is not None else None))
    if raw["security"]["enable_api_key"] and not raw["security"]["api_keys"]:
        problems.append(f"{source}:security.api_keys: enable_api_key is true but no key is "
                        "configured (run `.venv/bin/python main.py keygen`)")
    cors = raw["cors"]
    if cors["allow_credentials"] and "*" in cors["allow_origins"]:
        problems.append(f"{source}:cors.allow_origins: '*' cannot be combined with "
                        "allow_credentials: true; list the origins")
    model_ids = [m["id"] for m in raw["mnote"]["models"]]
    if raw["mnote"]["default_model"] not in model_ids:
        problems.append(f"{source}:mnote.default_model: '{raw['mnote']['default_model']}' "
                        f"is not one of mnote.models ({', '.join(model_ids)})")
    h = raw["hermes"]
    needed = raw["mnote"]["max_event_streams"] + 2 * h["max_concurrent_runs"] + \
        h["max_waiting_requests"] + 4
    if raw["service"]["threads"] < needed:
        problems.append(f"{source}:service.threads: {raw['service']['threads']} is too few; event "
                        "streams, v1 turns (running and waiting) and tool calls each hold a thread "
                        f"(need >= {needed} = mnote.max_event_streams + 2 * hermes.max_concurrent_runs"
                        " + hermes.max_waiting_requests + 4)")
    for i, argv in enumerate(raw["hermes"]["execute"]["allowed"]):
        if argv and argv[0] == "chat":
            problems.append(f"{source}:hermes.execute.allowed.{i}: 'chat' is not allowed here; "
                            "use the sessions API")
    if problems:
        raise ConfigError(problems)

    def resolve(p: str) -> Path:
        path = Path(os.path.expanduser(p))
        return (path if path.is_absolute() else base_dir / path).resolve()

    return Config(raw=raw, source=source, data_dir=resolve(raw["paths"]["data_dir"]),
                  users_template=resolve(raw["paths"]["users_template"]),
                  allowed_networks=allowed, trusted_proxies=proxies, api_keys=tuple(keys))


def provider_problem(config: Config, environ=None) -> str | None:
    """Why the model provider cannot answer yet, or None if it looks set up.

    Checks ``hermes.model``: ``base_url`` and ``default`` set, and the variable named by
    ``api_key_env`` present and non-empty in ``environ`` (default ``os.environ``; a
    provider without a key sets ``api_key_env: null``). Returns one sentence naming the
    keys to set (README, first screen).
    """
    model = config["hermes"]["model"]
    environ = os.environ if environ is None else environ
    keys = [f"hermes.model.{k}" for k in ("base_url", "default") if not (model.get(k) or "").strip()]
    parts = [f"{' and '.join(keys)} in {config.source}"] if keys else []
    key_env = model.get("api_key_env")
    if key_env and not environ.get(key_env, "").strip():
        parts.append(f"the environment variable {key_env} (the provider's key)")
    if not parts:
        return None
    return "no model provider is configured: set " + ", and ".join(parts)


def load_config(path: str | os.PathLike | None = None, need_keys: bool = True) -> Config:
    """Read and validate a config file.

    ``path`` defaults to ``$HERMES_SERVICE_CONFIG`` or ``./config.yaml``.
    Relative ``paths.*`` resolve against the file's folder.
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
    return build_config(data, source=str(path), base_dir=path.resolve().parent, need_keys=need_keys)

