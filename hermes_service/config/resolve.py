"""Resolving a config file's values (docs/configuring.md): networks parsed, API keys digested
(their expiry and their variables read), paths made absolute, the sections built; and what
makes a model provider unusable in this environment (warnings, not problems)."""
from __future__ import annotations

import hashlib
import ipaddress
import os
from dataclasses import replace
from datetime import UTC, datetime
from pathlib import Path

from ..config_fields import read_only, settings_from
from ..machine import Machine
from .model import is_invalid
from .sections import (
    DEFAULT_SCOPES,
    ApiKey,
    CorsSettings,
    HermesSettings,
    ModelSettings,
    NginxSettings,
    PathsSettings,
    RetentionSettings,
    SecuritySettings,
    ServiceSettings,
    StorageSettings,
)
from .sizing import Sizing, size_hermes

#: The example provider shipped in early versions of config.yaml: not a provider.
PLACEHOLDER_PROVIDERS = {("http://127.0.0.1:8000/v1", "gpt-4o-mini")}
#: The development API key: ``make run`` exports :data:`DEV_KEY_ENV` (the key variable of the
#: shipped config.yaml) from :data:`DEV_KEY_FILE`, which it generates once, when the variable
#: is unset (the Makefile's ``DEV_KEY``; README, Quick start).
DEV_KEY_ENV = "HERMES_SERVICE_API_KEY"
DEV_KEY_FILE = "data/dev-api-key"


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


class Resolver:
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
            digest = entry.get("key_sha256") or hashlib.sha256((plain or "").encode()).hexdigest()
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
            if entry.get("actor_id") and entry.get("user_id"):
                self.problems.append(f"{where}: actor_id and user_id are the same binding; "
                                     "give one")
                continue
            keys.append(ApiKey(digest, entry.get("description"), expires,
                               entry.get("actor_id") or entry.get("user_id"),
                               tuple(scope) if scope is not None else None,
                               frozenset(DEFAULT_SCOPES if scopes is None else scopes),
                               bool(entry.get("trusted_frontend"))))
        return tuple(keys)


def resolve(raw: dict, source: str, base_dir: Path, res: Resolver,
             need_keys: bool, m: Machine) -> dict:
    """The section objects of the merged mapping ``raw`` (keyword arguments of :class:`Config`);
    the ``hermes`` limits it leaves null derived for the machine ``m`` (:mod:`.sizing`)."""
    def path(p: str) -> Path:
        found = Path(os.path.expanduser(p))
        return (found if found.is_absolute() else base_dir / found).resolve()

    sec = raw["security"]
    security = settings_from(
        SecuritySettings, sec,
        allowed_networks=res.networks("security.allowed_ips", sec["allowed_ips"]),
        api_keys=(), key_entries=len(sec["api_keys"]))
    nginx = settings_from(NginxSettings, raw["nginx"],
                          trusted_proxies=res.networks("nginx.trusted_proxies",
                                                       raw["nginx"]["trusted_proxies"]))
    security = replace(security, api_keys=res.api_keys(sec["api_keys"], need_keys))
    hermes_raw, auto = size_hermes(raw["hermes"], m)
    hermes = settings_from(HermesSettings, hermes_raw,
                           extra_env=read_only(raw["hermes"]["extra_env"]))
    return dict(
        source=source, security=security, nginx=nginx,
        service=settings_from(ServiceSettings, raw["service"]),
        cors=settings_from(CorsSettings, raw["cors"]), hermes=hermes,
        paths=PathsSettings(path(raw["paths"]["data_dir"]), path(raw["paths"]["users_template"]),
                            path(raw["paths"]["homes_dir"]) if raw["paths"]["homes_dir"]
                            else None),
        storage=settings_from(StorageSettings, raw["storage"]),
        retention=settings_from(RetentionSettings, raw["retention"]),
        sizing=Sizing(m, tuple(auto)))


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
