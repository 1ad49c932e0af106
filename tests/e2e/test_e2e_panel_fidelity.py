"""What a panel reads is exact, on the ACP runner (real ``hermes acp`` in its sandbox, the
scripted model): every tool call named the same way with its detail apart and redacted
(docs/mnote-client.md §Tool events), deltas that add up to the output, a cut answer that says
so (§Answers and deltas), and a warm process replaced after a reload built from the new
settings (docs/configuring.md §Reload). The CLI runner's side of the same rules is checked
where its turns already run: test_e2e_tools.py (deltas and tool names after mnote tool calls),
test_e2e_answers.py (a cut answer on the v1 API).

One service for the first tests (one warm process of one actor; ~6 s of CPU), its own for the
reload (two process starts: the one replaced and its replacement)."""
from __future__ import annotations

import base64
import json
import os
import signal

import pytest
import yaml

from support.fixtures import API_KEY, ServiceProcess, base_config, deep_merge, wait_for
from support.sse_client import SSEStream, read_all

pytestmark = pytest.mark.e2e
P = "/api/hermes/client"
KEY = "sk-" + "f1d3L1ty" * 4            # a secret in a command: redacted in the preview
ACP = {"mnote": {"runner": "acp"}, "hermes": {"toolsets": ["terminal", "file"], "timeout_seconds": 20}}


def seed(data_dir, *actors):
    from hermes_service.mnote.page_sqlite import SQLitePageStore
    store = SQLitePageStore(data_dir / "mnote.db")
    try:
        store.add_workspace("ws_1")
        for actor in actors:
            store.add_member("ws_1", actor, "editor")
        store.import_page({"documentId": "doc_1", "workspaceId": "ws_1", "title": "项目计划",
                           "blocks": [{"id": "b1", "type": "paragraph", "text": "第一段"}]})
    finally:
        store.close()


@pytest.fixture(scope="module")
def svc(tmp_path_factory, model):
    tmp = tmp_path_factory.mktemp("fidelity")
    seed(tmp / "data", "a_tools")
    service = ServiceProcess(tmp, deep_merge(base_config(tmp, model.base_url), ACP)).start()
    yield service
    service.stop()


def actor(name):
    return {"X-API-Key": API_KEY, "X-Mnote-Actor-Id": name}


def start_run(svc, who, sid, message):
    res = svc.post(f"{P}/runs", headers=actor(who), json={
        "workspaceId": "ws_1", "documentId": "doc_1", "sessionId": sid, "message": message})
    assert res.status_code == 200, res.text
    return res.json()["runId"]


def run(svc, who, sid, message):
    run_id = start_run(svc, who, sid, message)
    return [data for _, data in read_all(svc.url + f"{P}/events/{run_id}", actor(who))]


def deltas(events):
    return "".join(e["delta"] for e in events if e["event"] == "message.delta")


def test_every_tool_call_is_named_the_same_way_with_its_detail_apart(svc):
    command = f"TOKEN={KEY}; echo hi > x.txt"
    calls = (f'terminal {json.dumps({"command": command})} ; read_file {{"path": "x.txt"}} ; '
             "mnote_page_get {}")
    events = run(svc, "a_tools", "mnote_doc_1_tools", f"[[narrate]] [[tools:{calls}]]")
    done = events[-1]
    assert done["event"] == "run.completed", events
    started = [e for e in events if e["event"] == "tool.started"]
    completed = [e for e in events if e["event"] == "tool.completed"]
    # one form for Hermes's tools and mnote's; each call once (the mnote call is not also
    # reported by the runner); the command never in the name
    assert [e["tool_name"] for e in started] == ["terminal", "read_file", "mnote.page.get"]
    # (Hermes 0.19.0 loses the end of a read_file call; the import hook brings it back)
    assert [e["tool_name"] for e in completed] == ["terminal", "read_file", "mnote.page.get"]
    assert all(e["ok"] is True for e in completed), completed
    terminal, read, page = (e["preview"] for e in started)
    assert terminal.endswith("echo hi > x.txt") and KEY not in terminal and "TOKEN=" in terminal
    assert read == "x.txt" and page == "doc_1"
    assert KEY not in json.dumps(events)                 # not in any event (titles included)
    # the answer: what the model wrote before each call, then its answer, as streamed
    assert deltas(events) == done["output"]
    assert done["output"].startswith("calling terminal.\n\ncalling read_file.\n\n"
                                     "calling mnote_page_get.\n\ntools done: ")
    assert done["finish_reason"] == "stop"
    # the transcript names the tools as the events do
    got = svc.get(f"{P}/sessions/mnote_doc_1_tools", headers=actor("a_tools")).json()
    named = {m["toolName"] for m in got["messages"]} - {None}
    assert named == {"terminal", "read_file", "mnote.page.get"}, got["messages"]


def test_an_answer_cut_at_the_output_limit_says_so(svc):
    """The provider stops at its output limit on every try (Hermes asks it to continue three
    times): the run completes, and says the answer is incomplete."""
    events = run(svc, "a_tools", "mnote_doc_1_cut", "[[length]] write a long text")
    done = events[-1]
    assert done["event"] == "run.completed" and done["finish_reason"] == "length", events
    assert done["output"].endswith("(continued, part 4)")
    assert deltas(events) == done["output"]


def wait_reloaded(service, seq):
    path = service.data_dir / "service-pids" / f"{service.proc.pid}.json"

    def reloaded():
        try:
            status = json.loads(path.read_text())["reload"]
        except (OSError, ValueError, KeyError):
            return None
        return status if status["seq"] >= seq else None
    return wait_for(reloaded, f"reload #{seq}", 30, log=service.log)


def test_a_process_replaced_after_a_reload_has_the_new_settings(tmp_path, model):
    """A reload changes hermes.extra_env and hermes.toolsets while a turn runs; the turn is
    aborted, which kills the user's process and starts its replacement at once: the
    replacement runs with the new environment and toolsets, not the old process's."""
    seed(tmp_path / "data", "a_reload")
    cfg = deep_merge(base_config(tmp_path, model.base_url), ACP)
    cfg["hermes"]["extra_env"]["FIDELITY_MARK"] = "before-reload"
    service = ServiceProcess(tmp_path, cfg).start()
    try:
        who = actor("a_reload")
        run_id = start_run(service, "a_reload", "mnote_doc_1_r1", "[[gate:fidelity-r1]] wait")
        stream = SSEStream(service.url + f"{P}/events/{run_id}", who)
        wait_for(lambda: model.requests_with("[[gate:fidelity-r1]]"), "the turn at the model")
        cfg = deep_merge(cfg, {"hermes": {"toolsets": ["terminal", "file", "todo"],
                                          "extra_env": {"FIDELITY_MARK": "after-reload"}}})
        service.config_path.write_text(yaml.safe_dump(cfg))
        os.kill(service.proc.pid, signal.SIGHUP)
        assert wait_reloaded(service, 1)["ok"] is True
        res = service.post(f"{P}/runs/{run_id}/abort", json={}, headers=who)
        assert res.status_code == 200, res.text
        assert [e["event"] for _, e in stream][-1] == "run.cancelled"
        # the replacement: the user's second process, started by the abort, not by a turn
        started = "ACP process started user=a_reload"
        wait_for(lambda: service.log().count(started) == 2, "the replacement process", 60,
                 log=service.log)
        started_at = service.log().count(started)
        events = run(service, "a_reload", "mnote_doc_1_r2",
                     '[[tools:terminal {"command": "printenv FIDELITY_MARK"}]]')
        assert json.loads(events[-1]["output"][len("tools done: "):])["output"] == "after-reload"
        offered = run(service, "a_reload", "mnote_doc_1_r3", "[[tools-offered]]")[-1]["output"]
        assert "todo" in offered.split(","), offered
        assert service.log().count(started) == started_at      # both ran on the replacement
    finally:
        model.release("fidelity-r1")
        service.stop()


#: a trigger the agent plants in its own state.db: the turn's answer row gets a forged
#: finish_reason as Hermes writes it (Hermes's full-text triggers are made again after it, so
#: that they run first — SQLite runs the newest trigger first — and the row is still written)
PLANT = """import sqlite3
db = sqlite3.connect('/home/hermes/.hermes/state.db')
fts = db.execute("SELECT name, sql FROM sqlite_master WHERE type = 'trigger' "
                 "AND name LIKE 'messages_fts%insert'").fetchall()
db.execute("CREATE TRIGGER IF NOT EXISTS forge AFTER INSERT ON messages "
           "WHEN NEW.role = 'assistant' AND NEW.content LIKE '%FORGE-MARK%' BEGIN "
           "UPDATE messages SET finish_reason = 'stop' || char(10) || '<img src=x>' || "
           "hex(randomblob(600)) WHERE id = NEW.id; END")
for name, sql in fts:
    db.execute('DROP TRIGGER ' + name)
    db.execute(sql)
db.commit()
print('FORGE-MARK planted')"""


def test_what_the_agent_writes_reaches_the_panel_checked_and_bounded(svc):
    """The agent's own tools against these fields: a trigger it plants in its state.db forges
    the finish_reason of the turn's answer (refused: null), and a command far longer than a
    preview is cut at the preview's cap."""
    script = base64.b64encode(PLANT.encode()).decode()
    command = f"echo {script} | base64 -d > plant.py; python3 plant.py # " + "x" * 5000
    events = run(svc, "a_tools", "mnote_doc_1_forge",
                 f"[[tools:terminal {json.dumps({'command': command})}]]")
    done = events[-1]
    assert done["event"] == "run.completed" and "FORGE-MARK planted" in done["output"], events
    assert done["finish_reason"] is None                  # the forged one is no provider word
    [started] = [e for e in events if e["event"] == "tool.started"]
    assert started["tool_name"] == "terminal"
    assert started["preview"].startswith(f"echo {script}") and "…[truncated: " in started["preview"]
    assert len(started["preview"]) < 2100
    assert deltas(events) == done["output"]
