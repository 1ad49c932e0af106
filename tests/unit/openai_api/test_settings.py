"""The ``openai`` config section and the key fields it reads (openai_api/settings.py,
config/resolve.py)."""
import pytest

from hermes_service.config import ConfigError


def problems(make_config, overrides) -> str:
    with pytest.raises(ConfigError) as caught:
        make_config(overrides)
    return str(caught.value)


def test_a_jwt_secret_must_be_set_long_and_its_own(make_config, monkeypatch):
    monkeypatch.delenv("OWUI_SECRET", raising=False)
    assert "OWUI_SECRET is not set" in problems(make_config,
                                                {"openai": {"jwt_secret_env": "OWUI_SECRET"}})
    monkeypatch.setenv("OWUI_SECRET", "short")
    assert "shorter than 32 bytes" in problems(make_config,
                                               {"openai": {"jwt_secret_env": "OWUI_SECRET"}})
    assert "also given to every Hermes process" in problems(
        make_config, {"openai": {"jwt_secret_env": "SCRIPTED_PROVIDER_KEY"}})
    monkeypatch.setenv("OWUI_SECRET", "x" * 32)
    assert make_config({"openai": {"jwt_secret_env": "OWUI_SECRET"}}).section("openai") \
        .jwt_secret_env == "OWUI_SECRET"


def test_user_id_binds_a_key_and_never_beside_actor_id(make_config):
    entry = {"key": "k" * 20, "user_id": "alice", "trusted_frontend": True,
             "scopes": ["openai"]}
    (key,) = make_config({"security": {"api_keys": [entry]}}).security.api_keys
    assert key.actor_id == "alice" and key.trusted_frontend and key.scopes == {"openai"}
    assert "actor_id and user_id are the same binding" in problems(
        make_config, {"security": {"api_keys": [{**entry, "actor_id": "bob"}]}})


def test_unknown_keys_and_models_are_refused(make_config):
    assert "unknown key" in problems(make_config, {"openai": {"modles": ["x"]}})
    assert "openai.models" in problems(make_config, {"openai": {"models": ["../x"]}})
