"""The service's import hook in a real Hermes Python (hermes_service/hermes_site/
sitecustomize.py; docs/sandbox.md §Hermes's policy surface, docs/mnote-tools.md §Run
binding): no container mode whatever ``.container-mode`` says; a CLI turn's run binding
out of the environment before any child exists; an ACP prompt's binding held for its
session while it runs, from the request's ``_meta``."""
from __future__ import annotations

import json
import subprocess
from pathlib import Path

from hermes_service.hermes_site import run_binding
from hermes_service.homes.users import HERMES_SITE
from support.fixtures import hermes_bin


def hermes_python(code: str, home: Path, hook: bool = True, env: dict | None = None) -> dict:
    """Run ``code`` in the Hermes venv's Python with HOME/HERMES_HOME at ``home`` (and the
    import hook unless ``hook`` is false); its last output line, as JSON."""
    python = Path(hermes_bin()).parent / "python"
    full = {"HOME": str(home), "HERMES_HOME": str(home / ".hermes"), "PATH": "/usr/bin:/bin",
            **({"PYTHONPATH": str(HERMES_SITE)} if hook else {}), **(env or {})}
    out = subprocess.run([str(python), "-c", code], env=full, capture_output=True, text=True,
                         timeout=60, cwd=str(home))
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


CONTAINER = """
import json, hermes_constants
hermes_constants._container_detected = False     # as in the sandbox (no /.dockerenv there)
from hermes_cli.config import get_container_exec_info
print(json.dumps(get_container_exec_info()))
"""


def test_a_planted_container_mode_file_never_replaces_hermes(tmp_path):
    (tmp_path / ".hermes").mkdir()
    (tmp_path / ".hermes" / ".container-mode").write_text(
        "backend=/home/hermes/evil.sh\nhermes_bin=/home/hermes/evil\n")
    # without the hook Hermes would exec the planted backend: the premise holds
    assert hermes_python(CONTAINER, tmp_path, hook=False)["backend"] == "/home/hermes/evil.sh"
    assert hermes_python(CONTAINER, tmp_path) is None


def test_a_cli_turns_binding_is_out_of_the_environment_and_in_memory(tmp_path):
    code = """
import json, os, subprocess, run_binding
child = subprocess.run(["env"], capture_output=True, text=True).stdout
print(json.dumps({"env": run_binding.ENV in os.environ, "child": run_binding.ENV in child,
                  "binding": run_binding.binding("task-1")}))
"""
    got = hermes_python(code, tmp_path, env={run_binding.ENV: run_binding.encode(
        {"runToken": "secret-token", "documentId": "doc_A"})})
    assert got == {"env": False, "child": False,
                   "binding": {"runToken": "secret-token", "documentId": "doc_A"}}


def test_an_acp_prompts_binding_is_held_for_its_session_while_it_runs(tmp_path):
    code = f"""
import asyncio, json, run_binding
from acp import text_block
from acp_adapter.server import HermesACPAgent
seen = []
class Sessions:
    def get_session(self, sid):          # called by the prompt as it starts
        seen.append([run_binding.binding(sid), run_binding.binding("other")])
        return None
agent = HermesACPAgent.__new__(HermesACPAgent)
agent.session_manager = Sessions()
meta = {{{run_binding.META!r}: {{"runToken": "acp-token"}}}}
asyncio.run(HermesACPAgent.prompt(agent, prompt=[text_block("hi")], session_id="s1", **meta))
print(json.dumps({{"seen": seen, "after": run_binding.binding("s1")}}))
"""
    got = hermes_python(code, tmp_path)
    assert got == {"seen": [[{"runToken": "acp-token"}, {}]], "after": {}}


def test_a_restored_acp_session_gets_the_configs_model_not_its_rows(tmp_path):
    code = """
import json, sys, types
made = []
class AIAgent:
    def __init__(self, **kw):
        made.append({k: kw.get(k) for k in ("model", "provider", "base_url", "api_mode")})
sys.modules["run_agent"] = types.SimpleNamespace(AIAgent=AIAgent)
import hermes_cli.config, hermes_cli.runtime_provider
hermes_cli.config.load_config = lambda: {"model": {"default": "service-model",
                                                   "provider": "custom"}}
hermes_cli.runtime_provider.resolve_runtime_provider = lambda requested=None: {
    "provider": requested, "api_mode": "chat_completions",
    "base_url": "http://pass-through/v1", "api_key": "k"}
from acp_adapter.session import SessionManager
SessionManager()._make_agent(session_id="s1", cwd="/home/hermes", model="evil-model",
                             requested_provider="openrouter", base_url="http://evil/v1",
                             api_mode="codex_responses")
print(json.dumps(made))
"""
    assert hermes_python(code, tmp_path) == [{
        "model": "service-model", "provider": "custom", "base_url": "http://pass-through/v1",
        "api_mode": "chat_completions"}]
