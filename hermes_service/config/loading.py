"""Loading a config file (docs/configuring.md): read and parse the YAML, validate it against
the core's schema and the extensions' (jsonschema; an unknown key refused with a hint),
resolve the valid keys over the defaults into a :class:`~.model.Config` (paths absolute,
networks parsed, keys digested), and run the cross-key checks (:mod:`.checks`) — every
problem in one pass, as ``file:dotted.key: problem`` lines. A value the schema refuses is
left out (its default stands in) and a check that reads it is skipped (:func:`is_invalid`).

Two kinds of findings: **problems** (:class:`~.model.ConfigError`: the service refuses to
start and a reload keeps the running config) and **warnings** (:attr:`Config.warnings`: an
expired key, or no usable model provider — :attr:`Config.provider_issues`: the service starts
and answers turns with 503 ``hermes_unconfigured``)."""
from __future__ import annotations

import copy
import difflib
import os
from collections.abc import Iterable, Mapping
from dataclasses import replace
from datetime import date, datetime
from pathlib import Path
from types import MappingProxyType
from typing import Any

import jsonschema
import yaml

from .. import sandbox
from ..errors import schema_error
from ..machine import Machine, probe
from .checks import run_checks
from .model import Config, ConfigError, ConfigSection
from .resolve import Resolver, provider_issues, resolve
from .sections import DEFAULTS, SCHEMA, TAIL_SECTIONS
from .sizing import size_rest

ENV_CONFIG = "HERMES_SERVICE_CONFIG"


def _properties(err: jsonschema.ValidationError) -> Mapping:
    """The ``properties`` of the schema an error is about (empty when it names none)."""
    schema = err.schema
    return schema.get("properties", {}) if isinstance(schema, Mapping) else {}


def _refused_keys(err: jsonschema.ValidationError) -> list[str]:
    """The dotted keys a schema error refuses: the value at its path, or for unknown keys
    those keys alone (their known siblings are fine)."""
    path = [str(p) for p in err.absolute_path]
    if err.validator == "additionalProperties" and isinstance(err.instance, dict):
        known = _properties(err)
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
    if err.validator == "additionalProperties" and isinstance(err.instance, dict):
        known = list(_properties(err))
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


def build_config(raw_file: dict | None, source: str = "<dict>", base_dir: Path | None = None,
                 need_keys: bool = True, overlay=None,
                 sections: Iterable[ConfigSection] = (), machine: Machine | None = None) -> Config:
    """Validate a parsed config mapping and resolve it into a :class:`Config`.

    The limits the file leaves null are derived for ``machine`` (default: the one this
    process runs on; :mod:`.sizing`, docs/scaling.md §Sizing a node).

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
    res = Resolver(source, invalid)
    config = Config(**resolve(raw, source, base_dir or Path.cwd(), res, need_keys,
                              machine or probe()),
                    extensions=MappingProxyType({s.name: s.build(raw[s.name], res.ok)
                                                 for s in sections}),
                    extension_sections=sections, overlay=overlay, invalid=invalid)
    config = size_rest(config, raw["service"])
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
