"""The ``mnote`` section of config.yaml: its schema, defaults, typed settings and checks.

:data:`SECTION` is what the extension brings to the core's config
(:meth:`~.extension.MnoteExtension.config_section`; docs/configuring.md §Extension sections):
:func:`hermes_service.config.build_config` validates the section with the core's (the same
``file:key: problem`` lines, unknown keys refused with a hint), merges it over
:data:`DEFAULTS` (config.yaml documents the same values: tests/unit/config/test_defaults.py),
builds :class:`MnoteSettings` and runs :func:`default_model_listed` after the core's checks.
The section is validated even while ``mnote.enabled`` is false, and its event streams count
in the threads the service needs all the same (``service.threads``).

Kept free of the extension's other modules (only :mod:`hermes_service.config` is imported),
so that every module of the extension may read it (tests/unit/test_layers_imports.py).
"""
from __future__ import annotations

import ipaddress
import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass, replace
from urllib.parse import urlsplit

from ..config import Check, Config, ConfigSection, ThreadNeed, env_unset
from ..config_fields import (
    OPT_POS_INT,
    POS_NUM,
    STR_LIST,
    defaults_of,
    key,
    object_schema,
    schema_of,
    section,
    settings_from,
)

#: the extension's name: its config section (:meth:`Config.section`), its key in
#: ``services.extensions`` and its route family
NAME = "mnote"

#: ``mnote.page_store.kind``: the service's own SQLite store, or mnote's kernel spoken to in
#: the tool contract's envelopes (docs/mnote-tools.md §The kernel adapter)
PAGE_STORE_KINDS = ("embedded", "command", "http")
#: the longest ``mnote.page_store.timeout_seconds``: the mnote Hermes plugin waits 60 s for the
#: tool endpoint (users_template/plugins/mnote), which must answer first
MAX_KERNEL_TIMEOUT_SECONDS = 50
_ENV_NAME = {"type": ["string", "null"], "pattern": "^[A-Za-z_][A-Za-z0-9_]*$"}

@dataclass(frozen=True, slots=True)
class PageStoreSettings:
    """``mnote.page_store.*``: where the tools' pages live (docs/mnote-tools.md §The kernel
    adapter). ``command``: an argv (never a shell); ``credential_env``: the name of the
    variable holding the kernel credential (its value is read from the service's environment
    at each call, never stored)."""
    kind: str = key("embedded", {"enum": list(PAGE_STORE_KINDS)})
    url: str | None = key(None, {"type": ["string", "null"]})
    command: tuple[str, ...] | None = key(None, {"type": ["array", "null"], "minItems": 1,
                                                 "items": {"type": "string", "minLength": 1}})
    credential_env: str | None = key(None, _ENV_NAME)
    ca_file: str | None = key(None, {"type": ["string", "null"]})
    #: one tool call's kernel budget, retries included
    timeout_seconds: float = key(15, {**POS_NUM, "maximum": MAX_KERNEL_TIMEOUT_SECONDS})


@dataclass(frozen=True, slots=True)
class MnoteModel:
    """One entry of ``mnote.models``."""
    id: str
    label: str | None = None
    provider: str | None = None
    hermes_model: str | None = None


_MODEL_ENTRY = object_schema({
    "id": {"type": "string"}, "label": {"type": "string"}, "provider": {"type": "string"},
    "hermes_model": {"type": ["string", "null"]},
}, required=["id"])


@dataclass(frozen=True, slots=True)
class MnoteSettings:
    """``mnote.*``: the client routes, their runs and event streams, the tool endpoint."""
    #: the mnote extension on (false: none of its routes)
    enabled: bool = key(True, {"type": "boolean"})
    default_model: str = key("hermes-agent", {"type": "string"})
    models: tuple[MnoteModel, ...] = key(
        (MnoteModel("hermes-agent", "Hermes Agent", "hermes"),),
        {"type": "array", "minItems": 1, "items": _MODEL_ENTRY})
    events_retention_seconds: float = key(3600, POS_NUM)
    keepalive_seconds: float = key(15, POS_NUM)
    max_event_streams: int = key(None, OPT_POS_INT)     # null: derived (:func:`size`)
    #: open event streams one actor may hold (null: a quarter of max_event_streams, >= 2)
    max_streams_per_actor: int | None = key(None, {"type": ["integer", "null"], "minimum": 1})
    default_capability_scope: tuple[str, ...] = key(
        ("page.read", "page.write", "page.suggest", "artifact.write"), STR_LIST)
    service_url: str | None = key(None, {"type": ["string", "null"]})
    #: the client routes' runner: "cli" | "acp"
    runner: str = key("acp", {"enum": ["cli", "acp"]})
    page_store: PageStoreSettings = section(PageStoreSettings)

    @property
    def model_ids(self) -> list[str]:
        return [m.id for m in self.models]


#: the section's jsonschema and every key's default, read off :class:`MnoteSettings`
SCHEMA = schema_of(MnoteSettings)
DEFAULTS: dict = defaults_of(MnoteSettings)


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


def _loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _http_problems(ps, where: str) -> list[str]:
    """kind http: the URL (http(s)://host/path, no user info, https when a credential would
    leave this host) and the CA file."""
    out = []
    parts = urlsplit(ps.url or "")
    try:
        parts.port  # noqa: B018 - reading it checks it
    except ValueError as exc:
        out.append(f"{where}.url: {exc}")
    if not ps.url:
        out.append(f"{where}.url: kind http needs the kernel's URL (https://host/path)")
    elif parts.scheme not in ("http", "https") or not parts.hostname:
        out.append(f"{where}.url: not an http(s)://host/path URL")
    elif parts.username is not None or parts.password is not None:
        out.append(f"{where}.url: no user or password in the URL: name the variable "
                   "holding the credential in mnote.page_store.credential_env")
    elif parts.scheme == "http" and ps.credential_env and not _loopback(parts.hostname):
        out.append(f"{where}.url: the credential would cross the network in clear: use "
                   "https:// for a kernel on another host")
    if ps.ca_file and not os.access(ps.ca_file, os.R_OK):
        out.append(f"{where}.ca_file: {ps.ca_file} cannot be read")
    return out


def _command_problems(ps, where: str) -> list[str]:
    """kind command: an argv whose program is found."""
    if not ps.command:
        return [f"{where}.command: kind command needs the kernel command as an argv "
                "list, e.g. [\"mnote-cli\", \"hermes-tool\", \"--json\"]"]
    if shutil.which(ps.command[0]) is None:
        return [f"{where}.command: {ps.command[0]!r} is not an executable found on PATH "
                "or at that path"]
    return []


def _credential_problems(cfg: Config, ps, where: str) -> list[str]:
    """``credential_env``: set, one header-safe token, a variable no Hermes process gets."""
    name = ps.credential_env
    if not name:
        return []
    out = []
    value = os.environ.get(name)
    hermes = cfg.hermes
    if not value:
        out.append(f"{where}.credential_env: {env_unset(name)}")
    elif not (value.isascii() and value.isprintable() and " " not in value):
        out.append(f"{where}.credential_env: the value of {name} is not one header-safe "
                   "token (visible ASCII, no spaces)")
    if name == hermes.model.api_key_env or name in hermes.extra_env:
        out.append(f"{where}.credential_env: {name} is also given to every Hermes process "
                   "(hermes.model.api_key_env / hermes.extra_env): use a variable of its own")
    return out


def page_store_usable(cfg: Config) -> list[str]:
    """``mnote.page_store``: a kind's address is complete and safe to use. http: an
    ``http(s)://host[:port]/path`` URL without user info (a credential never sits in
    config.yaml), https whenever a credential would leave this host; command: an argv whose
    program is found (on ``PATH`` or as a path); ``credential_env``: set, one header-safe
    token, and never a variable a Hermes process gets (``hermes.model.api_key_env``,
    ``hermes.extra_env``); ``timeout_seconds`` below ``hermes.stall_timeout_seconds``."""
    ps, where = cfg.section(NAME).page_store, f"{cfg.source}:mnote.page_store"
    if ps.kind == "embedded":
        return []
    out = _http_problems(ps, where) if ps.kind == "http" else []
    if ps.kind == "command":
        out += _command_problems(ps, where)
    out += _credential_problems(cfg, ps, where)
    if ps.timeout_seconds >= cfg.hermes.stall_timeout_seconds:
        out.append(f"{where}.timeout_seconds: {ps.timeout_seconds:g} must be below "
                   f"hermes.stall_timeout_seconds ({cfg.hermes.stall_timeout_seconds:g}): a slow "
                   "kernel would otherwise end the run as stalled")
    return out


#: client runs queued or running at once per turn slot (``hermes.max_concurrent_runs``),
#: beyond one per warm process (docs/scaling.md §Sizing a node)
ACTIVE_RUNS_PER_SLOT = 4


#: the fewest event streams a derived ``mnote.max_event_streams`` allows (reconnects, a few
#: tabs on one run)
MIN_EVENT_STREAMS = 12


def max_active_runs(cfg: Config) -> int:
    """Client runs queued or running at once on this node (more: 429 ``hermes_client_busy``):
    one per warm process when the client routes run on ``acp`` (``hermes.acp.max_processes``:
    a warm turn waits on the provider), plus :data:`ACTIVE_RUNS_PER_SLOT` per turn slot
    (CLI turns, and the runs waiting for one)."""
    h = cfg.hermes
    warm = h.acp.max_processes if cfg.section(NAME).runner == "acp" else 0
    return warm + ACTIVE_RUNS_PER_SLOT * h.max_concurrent_runs


def size(cfg: Config, m: MnoteSettings) -> tuple[MnoteSettings, list[str]]:
    """``mnote.max_event_streams`` left null: one per active client run
    (:func:`max_active_runs`), at least :data:`MIN_EVENT_STREAMS`: every panel user can follow
    its run — within the threads left when the file sets ``service.threads`` (each stream holds
    one)."""
    if m.max_event_streams is not None:
        return m, []
    streams = max(MIN_EVENT_STREAMS, max_active_runs(cfg))
    if cfg.service.threads is not None:     # set in the file: the streams fit in what the
        # other holders leave (they count this section's null as none yet)
        streams = max(1, min(streams, cfg.service.threads - cfg.threads_needed))
    return replace(m, max_event_streams=streams), ["mnote.max_event_streams"]


def explain(cfg: Config, derived: set[str]) -> list[str]:
    """check-config's lines on the client runs' limits (docs/scaling.md §Sizing a node)."""
    m, h = cfg.section(NAME), cfg.hermes
    warm = f"{h.acp.max_processes} warm + " if m.runner == "acp" else ""
    how = "derived" if "mnote.max_event_streams" in derived else "set in the file"
    return [f"client runs active at once: {max_active_runs(cfg)} (rule: {warm}"
            f"{ACTIVE_RUNS_PER_SLOT} × {h.max_concurrent_runs} turn slots)",
            f"mnote.max_event_streams: {m.max_event_streams} ({how}; rule: one per active "
            f"client run, at least {MIN_EVENT_STREAMS})"]


SECTION = ConfigSection(
    NAME, SCHEMA, DEFAULTS, build,
    checks=(Check("default_model_listed", ("mnote.models", "mnote.default_model"),
                  default_model_listed),
            Check("page_store_usable", ("mnote.page_store", "hermes.model", "hermes.extra_env",
                                        "hermes.stall_timeout_seconds"), page_store_usable)),
    # fixed for the life of the process: the tool callback URL handed to runs, the runner,
    # whether the extension is on (its routes are registered at start) and the page store
    # the tool gateway was built with
    restart_only=("service_url", "runner", "enabled", "page_store"),
    # every open event stream holds a waitress thread
    threads=(ThreadNeed("mnote.max_event_streams", "event streams",
                        lambda m: m.max_event_streams or 0),),
    size=size, explain=explain)
