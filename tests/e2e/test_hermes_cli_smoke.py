"""Smoke test: the real `hermes` CLI talks to the scripted model server.

Three CLI turns (~7 s each on 2 cores): a new session, a resume of it, and a
resume with every builtin toolset disabled (`-t context_engine`, a valid
toolset with no tools).  Hermes binary: conftest.hermes_bin() ($HERMES_BIN, the project's
.hermes-venv, or PATH); a missing CLI fails the test instead of skipping it.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hermes_service.scripted_model import ScriptedModel, hermes_env, write_hermes_config
from support.fixtures import hermes_bin

API_KEY_ENV = "SCRIPTED_MODEL_API_KEY"
API_KEY = "sk-smoke-test-key"
SESSION_RE = re.compile(r"^session_id: (\d{8}_\d{6}_[0-9a-f]{6})$")

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def model():
    m = ScriptedModel("smoke-model").start()
    yield m
    m.stop()


@pytest.fixture(scope="module")
def hermes_home(tmp_path_factory, model):
    home = tmp_path_factory.mktemp("hermes-home")
    write_hermes_config(home, model.base_url, model.model_id, API_KEY_ENV)
    return home


def run_hermes(home: Path, query: str, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [hermes_bin(), "chat", f"--query={query}", "-Q", "--source", "tool", *extra],
        env=hermes_env(home, API_KEY_ENV, API_KEY),
        cwd=home,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=180,
    )


def session_id_of(proc: subprocess.CompletedProcess) -> str:
    lines = proc.stderr.rstrip("\n").splitlines()
    assert lines, f"empty stderr; stdout={proc.stdout!r}"
    m = SESSION_RE.match(lines[-1])
    assert m, f"last stderr line is not a session id: {proc.stderr!r}"
    return m.group(1)


def test_new_session_then_resume(model, hermes_home):
    first = run_hermes(hermes_home, "hello")
    assert first.returncode == 0, (first.stdout, first.stderr)
    assert first.stdout == "echo #1: hello\n"
    sid = session_id_of(first)

    (req,) = model.main_requests()
    assert req["stream"] is True and req["model"] == "smoke-model"
    assert req["stream_options"] == {"include_usage": True}
    assert [m["role"] for m in req["messages"]] == ["system", "user"]
    assert req["messages"][-1]["content"] == "hello"
    assert model.request_headers[0].get("Authorization") == f"Bearer {API_KEY}"
    assert len(req.get("tools") or []) > 0  # builtin tools are offered by default

    second = run_hermes(hermes_home, "second message", "--resume", sid)
    assert second.returncode == 0, (second.stdout, second.stderr)
    assert second.stdout == "echo #2: second message\n"
    assert session_id_of(second) == sid
    req2 = model.main_requests()[-1]
    assert [m["role"] for m in req2["messages"]] == ["system", "user", "assistant", "user"]
    assert req2["messages"][2]["content"] == "echo #1: hello"

    # -t with a valid but empty toolset: the model is offered no tools at all
    third = run_hermes(hermes_home, "[[tools-offered]]", "--resume", sid, "-t", "context_engine")
    assert third.returncode == 0, (third.stdout, third.stderr)
    assert third.stdout == "(none)\n"
    assert session_id_of(third) == sid
    assert not model.main_requests()[-1].get("tools")
    assert model.aux_requests() == []  # `chat -Q` makes no side calls
