"""The real hermes CLI through the model endpoint (the endpoint itself:
tests/unit/model_proxy/test_proxy.py)."""
from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from hermes_service.model_proxy.usage import read_usage
from hermes_service.runner import classify_text
from support.fixtures import ROOT, free_port, hermes_bin, wait_for
from unit.model_proxy.test_proxy import (  # noqa: F401  (make_proxy, provider_key, scripted: fixtures)
    REAL_KEY,
    make_proxy,
    outcome_count,
    provider_key,
    scripted,
    tokens,
)


# -- the real hermes CLI through the endpoint -----------------------------------------------
def hermes_home(tmp_path: Path, base_url: str) -> Path:
    """A Hermes home like the service's: users_template's security/agent/approvals/display/
    memory/skills settings (no plugins), ``model:`` naming the proxy and ``${HSM_CRED}``."""
    home = tmp_path / "home"
    home.mkdir()
    template = yaml.safe_load((ROOT / "users_template" / "config.yaml").read_text())
    cfg = {k: v for k, v in template.items() if k not in ("plugins", "_config_version")}
    cfg["model"] = {"provider": "custom", "base_url": base_url, "default": "scripted-model",
                    "api_key": "${HSM_CRED}", "context_length": 128000}
    (home / "config.yaml").write_text(yaml.safe_dump(cfg))
    shutil.copy(ROOT / "users_template" / ".update_check", home / ".update_check")
    return home


def run_hermes(home: Path, credential: str, query: str) -> subprocess.CompletedProcess:
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(home),
           "HERMES_HOME": str(home), "LANG": "C.UTF-8", "HSM_CRED": credential,
           "HERMES_STREAM_RETRIES": "0"}                      # no provider key in here
    return subprocess.run([hermes_bin(), "chat", f"--query={query}", "-Q", "--source", "tool",
                           "-t", "context_engine"], env=env, cwd=home, stdin=subprocess.DEVNULL,
                          capture_output=True, text=True, timeout=180)


@pytest.mark.e2e
def test_hermes_chat_answers_through_the_endpoint(scripted, make_proxy, tmp_path):
    proxy = make_proxy(scripted.base_url)
    cred = proxy.issue("dave")
    p0 = tokens("prompt")
    errors0, refused0 = outcome_count("provider_error"), outcome_count("refused")
    res = run_hermes(hermes_home(tmp_path, proxy.base_url), cred, "hi")
    assert res.returncode == 0, (res.stdout, res.stderr)
    # Hermes's local-server probes (GET /v1/props …) are answered by the endpoint: nothing
    # counts as a provider error or a refusal on a healthy turn
    assert (outcome_count("provider_error"), outcome_count("refused")) == (errors0, refused0)
    assert res.stdout == "echo #1: hi\n"
    [req] = scripted.main_requests()
    assert req["stream"] is True and req["stream_options"] == {"include_usage": True}
    assert all(h["Authorization"] == f"Bearer {REAL_KEY}" for h in scripted.request_headers)
    wait_for(lambda: proxy.usage.flush() and [r.completion_tokens > 0 for r in
                                               read_usage(proxy.usage.path)] == [True],
             what="the turn's usage")
    [row] = read_usage(proxy.usage.path)
    # every request counts (Hermes also asks GET /v1/models…); tokens come from the turn
    assert row.user_id == "dave" and row.requests >= len(scripted.requests) == 1
    assert row.prompt_tokens > 0
    assert tokens("prompt") - p0 == row.prompt_tokens


@pytest.mark.e2e
def test_hermes_reports_an_unreachable_provider_as_upstream_unavailable(make_proxy, tmp_path):
    proxy = make_proxy(f"http://127.0.0.1:{free_port()}/v1")
    res = run_hermes(hermes_home(tmp_path, proxy.base_url), proxy.issue("erin"), "hi")
    assert classify_text(res.stdout + "\n" + res.stderr).code == "upstream_unavailable", \
        (res.returncode, res.stdout, res.stderr)
