"""A Hermes home pointed at the scripted model (docs/testing.md §The scripted model): its
``config.yaml``, written with the settings that keep failures fast, and a clean environment to
run the CLI with."""
from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

# The project's own CLI venv (`make setup`), found from this file, never from one checkout's
# absolute path; tests that need the CLI take conftest.hermes_bin(), which also honours
# $HERMES_BIN and PATH and fails (never skips) when no CLI is installed.
DEFAULT_HERMES_BIN = str(Path(__file__).resolve().parents[2] / ".hermes-venv" / "bin" / "hermes")


def _deep_merge(base: dict, extra: dict) -> dict:
    for k, v in extra.items():
        if isinstance(v, dict) and isinstance(base.get(k), dict):
            _deep_merge(base[k], v)
        else:
            base[k] = v
    return base


_PLAIN_KEY_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_-]*$")


def _yaml(obj: Any, indent: int = 0) -> str:
    """Tiny YAML emitter: block mappings/lists, JSON-quoted scalars."""
    pad = "  " * indent
    lines = []
    if isinstance(obj, dict):
        for k, v in obj.items():
            key = str(k) if _PLAIN_KEY_RE.match(str(k)) else json.dumps(str(k))
            if isinstance(v, (dict, list)) and v:
                lines.append(f"{pad}{key}:\n{_yaml(v, indent + 1)}")
            else:
                lines.append(f"{pad}{key}: {_scalar(v)}")
    elif isinstance(obj, list):
        for v in obj:
            if isinstance(v, (dict, list)) and v:
                lines.append(f"{pad}-\n{_yaml(v, indent + 1)}")
            else:
                lines.append(f"{pad}- {_scalar(v)}")
    return "\n".join(lines)


def _scalar(v: Any) -> str:
    if isinstance(v, dict):
        return "{}"
    if isinstance(v, list):
        return "[]"
    return json.dumps(v)  # strings double-quoted, true/false/null, numbers


def hermes_config(base_url: str, model: str, api_key_env: str, extra: dict | None = None) -> dict:
    """The config dict written by :func:`write_hermes_config` (*extra* deep-merged).

    Key names as read by hermes-agent 0.19.0 (src paths in site-packages):

    * ``model.provider: custom`` + ``base_url`` + ``default`` + ``api_key``
      (``${VAR}`` expanded from the environment); ``model.context_length``
      skips probing the endpoint for its context size.
    * ``agent.api_max_retries`` (agent/agent_init.py; default 3, min 1 = a
      single attempt): with 1, a 401/429/500 fails after one request, in the
      time of a normal turn (~6-7 s) instead of ~15 s.
    * ``security.tirith_enabled: false`` (else it tries to download a scanner
      and warns on STDOUT), ``security.allow_lazy_installs: false``.
    * ``agent.environment_probe: false`` (agent/agent_init.py, tools/env_probe.py): no
      five python/pip subprocesses at start (~1.1 s of CPU) for a system-prompt line.
    * ``memory.nudge_interval: 0`` and ``skills.creation_nudge_interval: 0``
      (agent/agent_init.py): no background memory/skill review agent (an
      extra model conversation every 10 user turns / 10 tool iterations).

    Not set here, documented for callers (pass via *extra*):

    * ``providers.custom.request_timeout_seconds: N`` (hermes_cli/timeouts.py,
      provider id ``custom``): connect/read timeout of each model call.
      Without it a local base_url gets 1800 s (``HERMES_API_TIMEOUT``) and the
      stream stale detector 900 s (``agent.local_stream_stale_timeout`` /
      ``HERMES_LOCAL_STREAM_STALE_TIMEOUT``), so a hung model keeps the CLI
      waiting ~15 min - i.e. a hang stays a hang until you kill it.  With
      N=3 a hung model failed after 17 s (timeout, one hard-coded "primary
      recovery" retry ~4 s later, timeout again), rc 1.
    * ``providers.custom.stale_timeout_seconds`` likewise for the stale
      detector.
    """
    cfg: dict[str, Any] = {
        "model": {
            "provider": "custom",
            "base_url": base_url,
            "default": model,
            "api_key": "${%s}" % api_key_env,
            "context_length": 128000,
        },
        "agent": {"api_max_retries": 1, "environment_probe": False},
        "memory": {"nudge_interval": 0},
        "skills": {"creation_nudge_interval": 0},
        "security": {"tirith_enabled": False, "allow_lazy_installs": False},
    }
    if extra:
        _deep_merge(cfg, extra)
    return cfg


def write_hermes_config(
    home: Path | str,
    base_url: str,
    model: str,
    api_key_env: str,
    extra: dict | None = None,
) -> Path:
    """Write ``<home>/config.yaml`` pointing Hermes at *base_url*.

    *extra* is deep-merged into the config (e.g. ``{"plugins": {"enabled":
    ["x"]}}``).  Returns the path written.
    """
    home = Path(home)
    home.mkdir(parents=True, exist_ok=True)
    path = home / "config.yaml"
    text = _yaml(hermes_config(base_url, model, api_key_env, extra))
    path.write_text(text + "\n", encoding="utf-8")
    return path


def hermes_env(
    home: Path | str,
    api_key_env: str,
    api_key: str = "sk-scripted-test-key",
    extra: dict | None = None,
) -> dict[str, str]:
    """A clean environment for running ``hermes`` against the scripted model.

    PATH, HOME=HERMES_HOME=*home*, LANG=C.UTF-8, the API key variable, and
    ``HERMES_STREAM_RETRIES=0`` (agent/chat_completion_helpers.py, default 2:
    mid-stream reconnect attempts).  *extra* is added last.
    """
    home = str(home)
    env = {
        "PATH": os.environ.get("PATH", "/usr/local/bin:/usr/bin:/bin"),
        "HOME": home,
        "HERMES_HOME": home,
        "LANG": "C.UTF-8",
        api_key_env: api_key,
        "HERMES_STREAM_RETRIES": "0",  # no mid-stream reconnect attempts
    }
    if extra:
        env.update(extra)
    return env
