"""The shipped config.yaml and the code's defaults say the same.

config.yaml documents every key with its default ("the values below are the defaults unless
marked otherwise"); the code holds the same defaults: the core's in
:data:`hermes_service.config.DEFAULTS`, each installed extension's in its config section
(:attr:`~hermes_service.config.ConfigSection.defaults`, e.g. ``mnote/settings.py``), together
:func:`hermes_service.config.defaults` of :func:`hermes_service.installed.config_sections`.
Nothing but this test keeps the two in step: every key is in both, and every value agrees
except the few keys config.yaml ships with a value of its own, listed with the reason in
:data:`DIFFERS_FROM_DEFAULT` (config.yaml's comment on each says so). The shipped file is read
from git (:mod:`support.shipped`), never the operator's working copy.
"""
from __future__ import annotations

import json
from dataclasses import asdict

import yaml

from hermes_service import config, installed, sandbox
from hermes_service.config import DEFAULTS
from hermes_service.installed import build_config
from hermes_service.machine import Machine
from support.shipped import shipped_text

#: dotted key -> why config.yaml ships a value that is not the code's default
DIFFERS_FROM_DEFAULT = {
    "security.api_keys": "the default is no key (a problem while enable_api_key is true); "
                         "the shipped file names the operator key from HERMES_SERVICE_API_KEY, "
                         "which `make run` generates",
    "nginx.trusted_proxies": "the default trusts no proxy; the shipped file trusts nginx on "
                             "this machine (deploy/nginx), still off while enable_real_ip is false",
    "hermes.extra_env": "the default is no extra environment; the shipped HERMES_STREAM_RETRIES=0 "
                        "(no mid-stream reconnects to the provider) is a recommendation to keep",
}

#: mappings whose keys are data, not config keys (compared as one value)
VALUE_MAPPINGS = {"hermes.extra_env"}


def leaves(tree: dict, prefix: str = "") -> dict:
    """``{"service.port": 9123, ...}``: every key that holds a value (a list, a scalar, an
    empty mapping or one of :data:`VALUE_MAPPINGS`)."""
    out = {}
    for key, value in tree.items():
        dotted = f"{prefix}{key}"
        if isinstance(value, dict) and value and dotted not in VALUE_MAPPINGS:
            out.update(leaves(value, dotted + "."))
        else:
            out[dotted] = value
    return out


def shipped() -> dict:
    return leaves(yaml.safe_load(shipped_text("config.yaml")))


def code_defaults() -> dict:
    """The core's defaults with every installed extension's section."""
    return config.defaults(installed.config_sections())


def test_the_code_defaults_hold_every_installed_extension_section():
    sections = installed.config_sections()
    assert [s.name for s in sections] == ["mnote", "openai"]
    assert "mnote" not in DEFAULTS and "openai" not in DEFAULTS   # the core holds none of it
    for section in sections:
        assert code_defaults()[section.name] == section.defaults
        assert set(section.defaults) == set(section.schema["properties"]), \
            f"{section.name}: every key of its schema has a default, and no other"


def test_config_yaml_documents_every_key_the_code_knows_and_no_other():
    ours, theirs = set(leaves(code_defaults())), set(shipped())
    assert sorted(ours - theirs) == [], "keys with a default that config.yaml does not show"
    assert sorted(theirs - ours) == [], "keys in config.yaml without a default in the code"


def test_config_yaml_values_are_the_code_defaults_except_the_listed_ones():
    defaults, yaml_values = leaves(code_defaults()), shipped()
    differ = {key for key in defaults if defaults[key] != yaml_values.get(key)}
    assert {k: (yaml_values.get(k), defaults[k]) for k in differ - set(DIFFERS_FROM_DEFAULT)} \
        == {}, "config.yaml's value and the code's default disagree (fix one, or list the key " \
               "in DIFFERS_FROM_DEFAULT with the reason)"
    assert sorted(set(DIFFERS_FROM_DEFAULT) - differ) == [], \
        "listed as differing, but config.yaml ships the default: drop it from the list"


def test_the_sandbox_settings_defaults_are_the_config_defaults():
    """``sandbox.Settings()`` (used where no config is at hand) has defaults of its own."""
    as_lists = json.loads(json.dumps(asdict(sandbox.Settings())))      # tuples -> lists
    assert as_lists == DEFAULTS["hermes"]["sandbox"]


def test_an_empty_file_resolves_to_the_defaults():
    cfg = build_config({"security": {"enable_api_key": False}}, machine=Machine(2, 24576))
    assert cfg.service.port == DEFAULTS["service"]["port"]
    assert cfg.hermes.execute.allowed == tuple(map(tuple, DEFAULTS["hermes"]["execute"]["allowed"]))
    # the limits left null are sized for the machine (docs/scaling.md §Sizing a node)
    assert cfg.hermes.max_concurrent_runs == 2 and cfg.hermes.admission_places == 2 + 4
    assert cfg.hermes.acp.min_available_mb == 24576 // 16
    assert cfg.hermes.acp.max_processes == (24576 - 256 - 2 * 200 - 1536) // 150
    streams = cfg.hermes.acp.max_processes + 4 * 2     # one per active client run
    assert cfg.section("mnote").max_event_streams == streams
    assert cfg.service.threads == cfg.threads_needed == streams + 2 * 2 + 4 + 4
    assert cfg.service.connection_limit == 500


def test_an_empty_file_resolves_each_extension_section_to_its_defaults():
    """Each installed extension's settings of an empty file hold its defaults (lists as
    tuples, list entries as typed records whose other fields are unset)."""
    cfg = build_config({"security": {"enable_api_key": False}})
    for section in installed.config_sections():
        got = asdict(cfg.section(section.name))
        assert set(got) == set(section.defaults), section.name
        derived = {k for k in got if f"{section.name}.{k}" in cfg.sizing.auto}
        assert all(section.defaults[k] is None for k in derived)   # null: sized
        expected = {k: v for k, v in section.defaults.items() if k not in derived}
        assert _holds(got, expected), (section.name, got, expected)
    from hermes_service.mnote.settings import DEFAULTS as MNOTE
    assert [asdict(m) for m in cfg.section("mnote").models] == \
        [{"hermes_model": None, **m} for m in MNOTE["models"]]


def _holds(got, default) -> bool:
    """Does the resolved value ``got`` hold ``default``: equal, a sequence of the same items,
    or a record with (at least) those fields?"""
    if isinstance(default, dict):
        return isinstance(got, dict) and all(k in got and _holds(got[k], v)
                                             for k, v in default.items())
    if isinstance(default, list):
        return isinstance(got, (list, tuple)) and len(got) == len(default) and \
            all(_holds(g, d) for g, d in zip(got, default, strict=True))
    return got == default


def test_a_core_config_alone_has_no_extension_section():
    """The core's builder without sections knows no extension: a file naming one is refused
    (unknown key), and an empty file's config has no extension settings."""
    cfg = config.build_config({"security": {"enable_api_key": False}})
    assert dict(cfg.extensions) == {} and cfg.restart_only_keys == config.RESTART_ONLY
    assert cfg.threads_needed == 2 * 2 + 4 + 4
    try:
        config.build_config({"security": {"enable_api_key": False}, "mnote": {}})
    except config.ConfigError as exc:
        assert exc.problems == ["<dict>:(top): unknown key 'mnote' (known: security, nginx, "
                                "service, cors, hermes, paths, storage, retention)"]
    else:
        raise AssertionError("an extension section was accepted without its extension")


def test_no_module_reads_the_config_as_a_mapping():
    """Settings are read as typed fields (``config.hermes.timeout_seconds``); the YAML's
    mapping stays inside the config package (a ``config["hermes"]`` would fail only when
    reached)."""
    import re
    from pathlib import Path

    import hermes_service
    pattern = re.compile(r"""(?<!app\.)(?<!current_app\.)\bconfig\[["']""")
    found = [f"{path.name}:{n}: {line.strip()}"
             for path in Path(hermes_service.__file__).parent.rglob("*.py")
             if path.parent.name != "config"
             for n, line in enumerate(path.read_text("utf-8").splitlines(), 1)
             if pattern.search(line)]
    assert found == []
