"""The quick start a newcomer follows (README, first screen), with the shipped config.yaml
and users template (as git has them: tests/support/shipped.py).

Without a provider the service serves and says at start what to set; with the two config lines
of the README's first screen and the key variable set, the first message gets a real answer
(the real CLI against the scripted model). The files README.md and docs/ name are in the repository.
"""
from __future__ import annotations

import json
import os
import re
import subprocess
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner

from hermes_service.cli import cli
from support.fixtures import API_KEY, ROOT, ServiceProcess, base_config, hermes_bin
from support.shipped import shipped_text, shipped_tree

README = ROOT / "README.md"
FIRST_SCREEN_LINES = 45


def first_screen() -> str:
    return "\n".join(README.read_text().splitlines()[:FIRST_SCREEN_LINES])


def shipped_config(tmp_path, model_url: str | None = None) -> str:
    """config.yaml as shipped, beside the shipped users template and a fresh data dir in
    ``tmp_path``, with the README's two provider lines applied when ``model_url`` is given."""
    text = shipped_text("config.yaml")
    assert 'data_dir: "data"' in text and 'users_template: "users_template"' in text
    if not (tmp_path / "users_template").exists():
        shipped_tree("users_template", tmp_path / "users_template")
    if model_url:
        for key, value in (("base_url", model_url), ("default", "scripted-model")):
            readme_line = re.search(rf"^#?\s*({key}:\s*\"[^\"]+\")", first_screen(), re.M)
            assert readme_line, f"the README's first screen shows the {key}: line to set"
            new = re.sub(r'"[^"]+"', f'"{value}"', readme_line.group(1))
            text, n = re.subn(rf"^(\s+){key}: null\b", rf"\g<1>{new}", text, flags=re.M)
            assert n == 1, f"config.yaml ships `{key}: null` under hermes.model"
    path = tmp_path / "config.yaml"
    path.write_text(text)
    return str(path)


def shipped_service(tmp_path, config_path: str, env: dict) -> ServiceProcess:
    """``main.py --config <config_path>`` (the file as given, not conftest's test config)."""
    svc = ServiceProcess(tmp_path, {"paths": {"data_dir": str(tmp_path / "data")}}, env)
    svc.config_path = Path(config_path)
    return svc.start()


@pytest.mark.e2e
def test_the_shipped_config_serves_says_what_to_set_then_answers(tmp_path, model):
    screen = first_screen()
    for needed in ("base_url:", "default:", "export HERMES_PROVIDER_API_KEY=", "make run"):
        assert needed in screen, needed
    # what `make run` does: .hermes-venv/bin first on PATH, a development API key
    env = {"HERMES_SERVICE_API_KEY": API_KEY, "HERMES_PROVIDER_API_KEY": "",
           "PATH": os.pathsep.join([str(Path(hermes_bin()).parent), os.environ["PATH"]])}

    bare = shipped_service(tmp_path, shipped_config(tmp_path), env)
    try:
        assert bare.get("/health", key=None).status_code == 200
        warning = next(l for l in bare.wait_log("no model provider").splitlines()
                       if "no model provider" in l)
        for named in ("hermes.model.base_url", "hermes.model.default", "HERMES_PROVIDER_API_KEY",
                      "503 hermes_unconfigured"):
            assert named in warning, named
        res = bare.post("/api/hermes/client/runs", headers={"X-Mnote-Actor-Id": "me"}, json={
            "workspaceId": "ws_1", "documentId": "doc_1", "sessionId": "s", "message": "hi"})
        assert res.status_code == 503 and res.json()["code"] == "hermes_client_unconfigured"
    finally:
        bare.stop()

    env["HERMES_PROVIDER_API_KEY"] = "sk-from-the-newcomer"
    ready = shipped_service(tmp_path, shipped_config(tmp_path, model.base_url), env)
    try:
        created = ready.post("/api/v1/sessions", json={"user_id": "me"})
        assert "no model provider" not in ready.log_through(created)   # the start said nothing
        sid = created.json()["session_id"]
        res = ready.post(f"/api/v1/sessions/{sid}/messages", json={"message": "Hello!"})
        assert res.status_code == 200, res.text
        assert res.json()["response"] == "echo #1: Hello!"
    finally:
        ready.stop()


def test_the_example_page_imports_and_exports(tmp_path, monkeypatch):
    """docs/mnote-client.md's walk-through, operator part: workspace, member, examples/page.json."""
    monkeypatch.delenv("HERMES_SERVICE_API_KEY", raising=False)
    config = shipped_config(tmp_path)
    run = CliRunner().invoke
    for args in (["add-workspace", "ws_1", "--name", "Team"], ["add-member", "ws_1", "user_1", "editor"],
                 ["import-page", str(ROOT / "examples" / "page.json")]):
        res = run(cli, ["--config", config, "mnote", *args])
        assert res.exit_code == 0, res.output
    res = run(cli, ["--config", config, "mnote", "export-page", "doc_1"])
    page = json.loads(res.output)
    assert page["title"] == "项目计划" and page["workspaceId"] == "ws_1"
    assert [b["type"] for b in page["blocks"]][:2] == ["heading", "paragraph"]


def test_docs_name_no_file_outside_the_repository_and_the_right_interpreter():
    docs = {str(p.relative_to(ROOT)): p.read_text() for p in [
        README, *ROOT.glob("docs/*.md"), *ROOT.glob("deploy/**/*.conf"),
        *ROOT.glob("deploy/**/*.service")]}
    docs["config.yaml"] = shipped_text("config.yaml")      # the operator's edits are theirs
    for name, text in docs.items():
        assert "shared/" not in text, f"{name} names a file outside the repository"
        assert not re.search(r"(?<![./\w])python3 main\.py", text), \
            f"{name}: the system python3 lacks the dependencies; say .venv/bin/python"
    for page in (README, *ROOT.glob("docs/*.md")):
        for named in re.findall(r"`((?:docs|deploy|examples|bench)/[\w./-]+)`", page.read_text()):
            assert (ROOT / named).exists(), f"{page.name} names {named}, which does not exist"


def test_make_run_installs_only_what_the_service_needs():
    dry = subprocess.run(["make", "-n", "-B", "run"], cwd=ROOT, capture_output=True, text=True,
                         timeout=60)
    assert dry.returncode == 0, dry.stderr
    assert "requirements.txt" in dry.stdout and "requirements-hermes.txt" in dry.stdout
    assert "requirements-dev.txt" not in dry.stdout and "nginx" not in dry.stdout
    # the system packages `make run` may install (as root), for the sandbox: bubblewrap and
    # libseccomp (its seccomp filter); for the disk quota: e2fsprogs (home images)
    assert set(re.findall(r"--no-install-recommends (\w+)", dry.stdout)) == {
        "bubblewrap", "libseccomp2", "e2fsprogs"}
    test = subprocess.run(["make", "-n", "-B", "test"], cwd=ROOT, capture_output=True, text=True,
                          timeout=60)
    assert "requirements-dev.txt" in test.stdout and "nginx" in test.stdout


def test_make_prints_the_development_key_only_when_it_generates_it(tmp_path):
    """`make check-config` (and `make run`, the same set-up) without HERMES_SERVICE_API_KEY:
    the first run generates data/dev-api-key and prints the key; later runs say where it is."""
    cfg = base_config(tmp_path)
    cfg["security"]["api_keys"] = [{"key_env": "HERMES_SERVICE_API_KEY"}]
    config = tmp_path / "config.yaml"
    config.write_text(yaml.safe_dump(cfg))
    key_file = tmp_path / "dev" / "dev-api-key"
    env = {k: v for k, v in os.environ.items() if k != "HERMES_SERVICE_API_KEY"}
    env["HERMES_SERVICE_CONFIG"] = str(config)

    def check_config():
        # the venvs are set up already (-o: never reinstall them from a test)
        res = subprocess.run(["make", "-s", "-o", ".venv/.installed", "-o", ".hermes-venv/.installed",
                              "check-config", f"DEV_KEY={key_file}"], cwd=ROOT, env=env,
                             capture_output=True, text=True, timeout=120)
        assert res.returncode == 0, res.stdout + res.stderr
        return res.stdout

    first = check_config()
    key = key_file.read_text().strip()
    assert len(key) >= 32 and oct(key_file.stat().st_mode & 0o777) == "0o600"
    assert f"development API key generated into {key_file}: {key}" in first
    for _ in range(2):
        later = check_config()
        assert key not in later and f"development API key: in {key_file}" in later
        assert key_file.read_text().strip() == key                  # the same key, kept


def test_the_shipped_config_streams_the_panel_on_acp_and_keeps_v1_on_the_cli():
    """The client routes and the OpenAI-compatible routes use the warm ACP runner out of the
    box (their answers stream as they are written); the v1 API keeps ``hermes chat -q …
    --source tool`` (docs/runners.md)."""
    from hermes_service.installed import build_config, route_families
    from hermes_service.runner import acp_families
    raw = yaml.safe_load(shipped_text("config.yaml"))
    raw["security"]["api_keys"] = [{"key": "k" * 20}]
    assert acp_families(route_families(build_config(raw))) == {"mnote", "openai"}
    assert acp_families(route_families(build_config({"security": {"api_keys": [{"key": "k" * 20}]}}))) == {"mnote", "openai"}
