"""How a settings class declares its keys of config.yaml, each once (docs/configuring.md
§Extension sections).

A section's settings are a frozen dataclass. Each field that is a key of the file is a
:func:`key`: its default (the dataclass's own, and what config.yaml documents:
tests/unit/config/test_defaults.py) and its JSON schema. A nested section is a
:func:`section` of its own class; a value the service derives from the file (parsed
networks, digested keys) is a :func:`derived` field, no key of the file. The section's
schema and defaults are read off the class (:func:`schema_of`, :func:`defaults_of`), and
:func:`settings_from` builds it from the file's mapping merged over those defaults. The core's
sections (:mod:`hermes_service.config.sections`), the launcher's
(:mod:`hermes_service.sandbox.settings`) and an extension's (e.g. ``mnote/settings.py``) are
declared this way.

Kept free of the rest of the service (the launcher's settings import it, and the config
package imports the launcher's settings).
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import MISSING, Field, field, fields, is_dataclass
from types import MappingProxyType
from typing import Any

SCHEMA = "config_schema"
SECTION = "config_section"
DERIVED = "config_derived"

STR_LIST = {"type": "array", "items": {"type": "string"}}
POS_INT = {"type": "integer", "minimum": 1}
#: a count, or null: derived from the machine the service starts on (config/sizing.py)
OPT_POS_INT = {"type": ["integer", "null"], "minimum": 1}
POS_NUM = {"type": "number", "exclusiveMinimum": 0}


def object_schema(props: dict, **extra) -> dict:
    """A mapping of the named ``props`` only: another key is refused with a hint (the section
    schemas' building block, an extension's too)."""
    return {"type": "object", "properties": props, "additionalProperties": False, **extra}


def key(default: Any, schema: dict) -> Any:
    """A field that is one key of the file: its ``default`` and its JSON ``schema``. Lists are
    given as tuples and mappings as read-only mappings (the settings are frozen); the file and
    :func:`defaults_of` show them as lists and mappings."""
    metadata = {SCHEMA: schema}
    try:
        hash(default)
    except TypeError:          # a read-only mapping: one object, shared by every instance
        return field(default_factory=lambda: default, metadata=metadata)
    return field(default=default, metadata=metadata)


def section(cls: type, **schema_extra) -> Any:
    """A field holding a nested section of class ``cls`` (its own fields declare its keys);
    ``schema_extra``: more of its mapping's schema (e.g. ``required``)."""
    return field(default_factory=cls, metadata={SECTION: cls, "extra": schema_extra})


def derived(default: Any = None) -> Any:
    """A field the service derives from the file (no key of its own: not in the schema, not
    in the defaults); ``default`` until it is set."""
    return field(default=default, metadata={DERIVED: True})


def _keys(cls: type) -> list[Field]:
    return [f for f in fields(cls) if SCHEMA in f.metadata or SECTION in f.metadata]


def schema_of(cls: type, **extra) -> dict:
    """The JSON schema of a section's mapping, from its class's fields (their order is the
    order an unknown key's hint names the known ones)."""
    props = {}
    for f in _keys(cls):
        if SECTION in f.metadata:
            props[f.name] = schema_of(f.metadata[SECTION], **f.metadata["extra"])
        else:
            props[f.name] = f.metadata[SCHEMA]
    return object_schema(props, **extra)


def defaults_of(cls: type) -> dict:
    """Every key's default of a section, as the file would write it (lists, mappings)."""
    out = {}
    for f in _keys(cls):
        if SECTION in f.metadata:
            out[f.name] = defaults_of(f.metadata[SECTION])
        else:
            if f.default is not MISSING:
                out[f.name] = as_file_value(f.default)
            elif f.default_factory is not MISSING:
                out[f.name] = as_file_value(f.default_factory())
    return out


def as_file_value(value: Any) -> Any:
    """``value`` as config.yaml writes it: tuples as lists, mappings as dicts, a record (a
    dataclass) as the mapping of its fields that differ from their defaults."""
    if isinstance(value, tuple):
        return [as_file_value(v) for v in value]
    if isinstance(value, Mapping):
        return {k: as_file_value(v) for k, v in value.items()}
    if is_dataclass(value) and not isinstance(value, type):
        return {f.name: as_file_value(getattr(value, f.name)) for f in fields(value)
                if f.default is MISSING or getattr(value, f.name) != f.default}
    return value


def _tuple(value):
    """Lists (and lists of lists) as tuples; anything else as it is."""
    return tuple(_tuple(v) for v in value) if isinstance(value, list) else value


def settings_from(cls, mapping: dict, **resolved):
    """``cls`` from the keys of ``mapping`` it names (lists as tuples; a nested section built
    the same way from its own mapping), ``resolved`` over them. A derived field not in
    ``resolved`` keeps its default."""
    values = {}
    for f in fields(cls):
        if f.name in resolved or DERIVED in f.metadata or f.name not in mapping:
            continue
        if SECTION in f.metadata:
            values[f.name] = settings_from(f.metadata[SECTION], mapping[f.name])
        else:
            values[f.name] = _tuple(mapping[f.name])
    return cls(**values, **resolved)


def read_only(mapping: Mapping) -> Mapping:
    """A read-only copy of ``mapping`` (a settings field that is a mapping of data)."""
    return MappingProxyType(dict(mapping))
