"""The resolved configuration (docs/configuring.md): :class:`Config`, one typed, frozen
settings object per section — the core's (:mod:`.sections`) and the installed extensions'
(:class:`ConfigSection`) —, the sizes the service derives from it, and :class:`ConfigError`
with every problem found. An extension brings its section as a :class:`ConfigSection` with
its named cross-key checks (:class:`Check`) and the threads it holds (:class:`ThreadNeed`)."""
from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from types import MappingProxyType
from typing import Any

from .sections import (
    CORE_SECTIONS,
    RESTART_ONLY,
    CorsSettings,
    HermesSettings,
    NginxSettings,
    PathsSettings,
    RetentionSettings,
    SecuritySettings,
    ServiceSettings,
    StorageSettings,
)

#: Connections beyond those that hold a thread (idle keep-alive, queued requests).
SPARE_CONNECTIONS = 100


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
    storage: StorageSettings
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
    #: the machine the limits the file left null were derived for, and those keys
    #: (:class:`~.sizing.Sizing`; docs/scaling.md §Sizing a node)
    sizing: Any = None

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
        return sum(n for _need, n in self.thread_needs) + self.core_threads_needed

    @property
    def core_threads_needed(self) -> int:
        """The part of :attr:`threads_needed` the core's limits hold: every v1 turn (running
        and waiting) and the tool calls of running turns."""
        h = self.hermes
        return 2 * h.max_concurrent_runs + h.max_waiting_requests + 4

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
        return with_sections(self, {section: replace(self.section(section), **{key: value})},
                              overrides=MappingProxyType({(section, key): old,
                                                         **self.overrides}))


def with_sections(cfg: Config, sections: dict, **changes) -> Config:
    """``cfg`` with the settings of ``sections`` (section name → settings; the core's or the
    extensions') replaced, and its other fields by ``changes``."""
    ext = {name: value for name, value in sections.items() if name in cfg.extensions}
    if ext:
        changes["extensions"] = MappingProxyType({**cfg.extensions, **ext})
    return replace(cfg, **{n: v for n, v in sections.items() if n not in ext}, **changes)


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
      documents the same values: tests/unit/config/test_defaults.py);
    * ``build(mapping, valid)`` — its frozen settings object from the merged mapping (lists
      and mappings as the file gave them; :func:`settings_from` helps); ``valid(dotted_key)``
      is False for a key the schema refused, whose default stands in — only while building a
      :attr:`ConfigError.partial` config;
    * ``checks`` — its cross-field checks (:class:`Check`), run after the core's;
    * ``restart_only`` — its keys a reload cannot apply (None: the whole section), after the
      core's :data:`RESTART_ONLY`;
    * ``threads`` — the waitress threads its settings hold (:class:`ThreadNeed`);
    * ``size(config, settings)`` — its settings with the limits the file left null derived
      from ``config``'s (the core's already sized: :mod:`.sizing`), and the dotted keys
      derived; ``explain(config, derived_keys)`` — check-config's lines saying how.
    """
    name: str
    schema: dict
    defaults: dict
    build: Callable[[dict, Callable[[str], bool]], Any]
    checks: tuple[Check, ...] = ()
    restart_only: tuple[str | None, ...] = ()
    threads: tuple[ThreadNeed, ...] = ()
    size: Callable[[Config, Any], tuple[Any, list[str]]] | None = None
    explain: Callable[[Config, set[str]], list[str]] | None = None
