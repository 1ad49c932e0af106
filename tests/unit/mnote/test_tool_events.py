"""Tool events with one shape (docs/mnote-client.md §Tool events): the name a tool call
carries, from the import hook inside Hermes (hermes_service/hermes_site/toolcalls.py, run by
Hermes's own Python here: it needs Hermes's modules) to the runner (runner/acp/client.py
``tool_identity``) and the transcript (mnote/client.py ``tool_name``)."""
import json
import subprocess
from pathlib import Path
from types import SimpleNamespace

import pytest

from hermes_service.homes.users import HERMES_SITE
from hermes_service.mnote.client import tool_name
from hermes_service.runner.acp import tool_identity
from support.fixtures import hermes_bin

KEY = "sk-" + "a1B2c3D4e5" * 4

HOOK_PROBE = r"""
import json, sys
import acp_adapter.tools as tools, acp_adapter.events as events, acp_adapter.server as server
assert events.build_tool_start is tools.build_tool_start is server.build_tool_start
out = []
for name, args in json.loads(sys.argv[1]):
    update = tools.build_tool_start("tc-1", name, args)
    out.append([update.title, json.loads(update.model_dump_json(by_alias=True))["_meta"]])
print(json.dumps(out))
"""


def hook(calls):
    python = Path(hermes_bin()).with_name("python")
    res = subprocess.run([str(python), "-c", HOOK_PROBE, json.dumps(calls)], capture_output=True,
                         text=True, timeout=120, env={"PYTHONPATH": str(HERMES_SITE),
                                                      "PATH": "/usr/bin:/bin"})
    assert res.returncode == 0, res.stderr
    return json.loads(res.stdout)


def test_every_tool_call_names_its_tool_and_what_it_does_redacted():
    command = f"cd /tmp && export OPENAI_API_KEY={KEY} && curl -H 'Authorization: Bearer {KEY}' x"
    got = hook([["terminal", {"command": command}],
                ["read_file", {"path": "/home/hermes/notes/a.txt", "offset": 3}],
                ["write_file", {"path": "/home/hermes/b.txt", "content": "x"}],
                ["mnote_page_get", {"documentId": "doc_1"}],
                ["todo", {"todos": [{"id": 1}]}],
                ["terminal", {"command": "x" * 10000}],
                ["terminal", "not an object"]])
    (title, meta), *rest = got
    assert title.startswith("terminal: cd /tmp && export OPENAI_API_KEY=sk-")   # Hermes's title
    ours = meta["hermesService"]
    assert ours["toolName"] == "terminal" and KEY not in ours["preview"]
    assert ours["preview"].startswith("cd /tmp && export OPENAI_API_KEY=")      # whole, not summed up
    names = [m["hermesService"]["toolName"] for _, m in rest]
    previews = [m["hermesService"]["preview"] for _, m in rest]
    assert names == ["read_file", "write_file", "mnote_page_get", "todo", "terminal", "terminal"]
    assert previews[:4] == ["/home/hermes/notes/a.txt", "/home/hermes/b.txt", None,
                            "planning 1 task(s)"]
    assert len(previews[4]) == 4096 and previews[5] is None


END_PROBE = r"""
import json
import acp_adapter.tools as tools, acp_adapter.events as events
assert events.build_tool_complete is tools.build_tool_complete
read = json.dumps({"content": "1|hi", "total_lines": 1, "file_size": 3, "truncated": False})
out = []
for result, args in ((read, '{"path": "x.txt"}'), (read, "not json"),
                     ('{"error": "no such file"}', '{"path": 5}')):
    out.append(tools.build_tool_complete("tc-1", "read_file", result=result,
                                         function_args=args).status)
print(json.dumps(out))
"""


def test_the_end_of_every_call_is_reported():
    """Hermes 0.19.0 hands its step callback the arguments as JSON text, and its read_file
    formatter fails on that: the call's end was never sent. With the hook it is."""
    python = Path(hermes_bin()).with_name("python")
    res = subprocess.run([str(python), "-c", END_PROBE], capture_output=True, text=True,
                         timeout=120, env={"PYTHONPATH": str(HERMES_SITE), "PATH": "/usr/bin:/bin"})
    assert res.returncode == 0, res.stderr
    assert json.loads(res.stdout) == ["completed", "completed", "failed"]


def test_a_call_hermes_never_ended_is_ended_when_the_prompt_is():
    from hermes_service.runner.acp.sink import Sink
    seen = []
    listener = SimpleNamespace(tool=lambda *a: seen.append(a))
    sink = Sink(listener)
    sink.tools_running = {"tc-1": ("terminal", "sleep 99"), "tc-2": None}   # tc-2: a family's
    sink.close_tools()
    assert seen == [("tool.completed", "tc-1", "terminal", None, "sleep 99")]
    sink.close_tools()
    assert len(seen) == 1


def update(title, meta=None):
    return SimpleNamespace(title=title, field_meta=meta)


@pytest.mark.parametrize("u, expected", [
    (update("terminal: rm -rf x", {"hermesService": {"toolName": "terminal", "preview": "rm -rf x"}}),
     ("terminal", "rm -rf x")),
    (update("read: /a", {"hermesService": {"toolName": "read_file", "preview": ""}}),
     ("read_file", None)),
    # forged or broken fields from inside the sandbox: no name a panel would take for a tool
    (update("x", {"hermesService": {"toolName": "terminal: rm -rf /", "preview": 5}}), (None, None)),
    (update("x", {"hermesService": {"toolName": "a" * 65}}), (None, None)),
    (update("terminal: ls", {"hermesService": "terminal"}), (None, None)),
    # no hook: a bare title is the name (Hermes titles other tools so); a command title is not
    (update("mnote_page_get"), ("mnote_page_get", None)),
    (update("terminal: export K=sk-secret"), (None, None)),
    (update(None), (None, None)),
])
def test_the_runner_takes_only_a_tool_name_and_text(u, expected):
    assert tool_identity(u) == expected


def test_the_transcript_names_tools_as_the_events_do():
    assert tool_name("mnote_page_get") == "mnote.page.get"
    assert tool_name("mnote_artifact_create_ai_note") == "mnote.artifact.create_ai_note"
    assert tool_name("terminal") == "terminal" and tool_name(None) is None
