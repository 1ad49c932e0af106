"""The ``storage`` section (hermes_service/config/sections.py StorageSettings; docs/configuring.md
§Shared storage): off by default, a libpq URL without a password, restart-only."""
from __future__ import annotations

import pytest

from hermes_service import config


def build(storage: dict):
    return config.build_config({"security": {"enable_api_key": False}, "storage": storage})


def test_without_a_url_the_node_is_a_single_node():
    cfg = config.build_config({"security": {"enable_api_key": False}})
    assert cfg.storage.url is None and not cfg.storage.enabled
    assert ("storage", None) in cfg.restart_only_keys


def test_a_url_with_its_password_env_is_taken():
    cfg = build({"url": "postgresql://hermes@db.internal:5432/hermes",
                 "password_env": "HERMES_STORAGE_PASSWORD", "lease_ttl_seconds": 5})
    assert cfg.storage.enabled and cfg.storage.lease_ttl_seconds == 5


@pytest.mark.parametrize("storage", [
    {"url": "postgresql://hermes:secret@db/hermes"},       # a password in the file
    {"url": "mysql://db/hermes"},
    {"url": "postgresql://db/h", "password_env": "NOT A NAME"},
    {"url": "postgresql://db/h", "lease_ttl_seconds": 1},
])
def test_what_is_refused(storage):
    with pytest.raises(config.ConfigError) as err:
        build(storage)
    assert any("storage." in p for p in err.value.problems)
    assert all("secret" not in p for p in err.value.problems)
