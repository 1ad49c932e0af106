"""``make demo`` as a newcomer runs it (README "Try it without a provider: make demo").

The real target (``make demo``: the development key, ``.hermes-venv/bin`` on PATH,
``main.py --demo``) serves the shipped config.yaml and users template (as git has them:
tests/support/shipped.py) on a free port, with no provider key in the environment; the real waitress
service runs real ``hermes acp`` processes against the demo model (hermes_service/mnote/demo.py over
hermes_service/scripted_model/). The README's client walk-through, verbatim in its bodies:
a session, a run whose answer streams in pieces and whose mnote tool calls change the page,
the page afterwards (``main.py --demo mnote export-page``), and an abort.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import requests

from support.fixtures import ROOT, free_port, wait_for
from support.shipped import shipped_text, shipped_tree
from support.sse_client import SSEStream

P = "/api/hermes/client"
# the walk-through's bodies (docs/mnote-client.md, steps 2 and 3)
SESSION = {"workspaceId": "ws_1", "documentId": "doc_1", "traceId": "trace_1", "title": "当前页问答"}
RUN = {"workspaceId": "ws_1", "documentId": "doc_1", "sessionId": "mnote_doc_1_trace_1",
       "message": "概括当前页面标题和第一段，并在页尾追加一句总结", "model": "hermes-agent",
       "pageContext": {"title": "项目计划", "outline": [], "pageOptions": {"wideLayout": True}},
       "traceId": "trace_1"}


@pytest.fixture
def demo(tmp_path):
    """``make demo`` on the shipped config in ``tmp_path`` (data dir tmp/data): yields
    ``(url, api_key, config_path, log)``."""
    (tmp_path / "config.yaml").write_text(shipped_text("config.yaml"))
    shipped_tree("users_template", tmp_path / "users_template")
    key_file, log_path = tmp_path / "data" / "dev-api-key", tmp_path / "demo.log"
    port = free_port()
    env = {k: v for k, v in os.environ.items()
           if k not in ("HERMES_SERVICE_API_KEY", "HERMES_PROVIDER_API_KEY")}
    env["HERMES_SERVICE_CONFIG"] = str(tmp_path / "config.yaml")
    with open(log_path, "ab") as out:
        # the venvs are set up already (-o: never reinstall them from a test)
        proc = subprocess.Popen(
            ["make", "-s", "-o", ".venv/.installed", "-o", ".hermes-venv/.installed", "demo",
             f"DEV_KEY={key_file}", f"DEMO_ARGS=--port {port}"],
            cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"

    def log() -> str:
        return log_path.read_text(errors="replace")

    def up():
        assert proc.poll() is None, f"make demo exited rc={proc.returncode}:\n{log()}"
        try:
            return requests.get(url + "/health", timeout=1).status_code == 200
        except requests.ConnectionError:
            return False
    try:
        wait_for(up, "the demo serves", 60, log)
        yield url, key_file.read_text().strip(), tmp_path / "config.yaml", log
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(5)


def events(url: str, headers: dict, run_id: str, on_frame=None) -> list[dict]:
    out = []
    stream = SSEStream(f"{url}{P}/events/{run_id}?sessionId={RUN['sessionId']}", headers, timeout=120)
    try:
        for _id, data in stream:
            out.append(data)
            if on_frame:
                on_frame(data)
    finally:
        stream.close()
    return out


def export_page(config: Path) -> dict:
    res = subprocess.run([sys.executable, str(ROOT / "main.py"), "--config", str(config), "--demo",
                          "mnote", "export-page", "doc_1"], cwd=ROOT, capture_output=True,
                         text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    return json.loads(res.stdout)


@pytest.mark.e2e
def test_make_demo_walks_through_the_panel_with_no_provider(demo, tmp_path):
    url, key, config, log = demo
    # the start line (logged before the port answers, written just after): wait for it
    def started():
        text = log()
        return text if " serving on " in text else ""
    lines = wait_for(started, "the start line", 30, log).splitlines()
    [warning] = [l for l in lines if "the demo model is answering, not a real provider" in l]
    assert " WARNING " in warning and "[demo model]" in warning
    data = tmp_path / "data" / "demo"
    [start] = [l for l in lines if "serving on" in l]
    assert f"serving on http://127.0.0.1:{url.rsplit(':', 1)[1]} " in start
    assert "runner acp (panel acp) (openai acp), model demo-model at 127.0.0.1:" in start and f"data dir {data}" in start
    assert not any("no model provider" in l for l in lines)      # the demo needs none
    assert export_page(config)["title"] == "项目计划"               # seeded: examples/page.json

    h = {"X-API-Key": key, "X-Mnote-Actor-Id": "user_1"}
    res = requests.post(f"{url}{P}/sessions", headers=h, json=SESSION, timeout=60)
    assert res.status_code == 200 and res.json()["sessionId"] == "mnote_doc_1_trace_1", res.text
    res = requests.post(f"{url}{P}/runs", headers=h, json=RUN, timeout=60)
    assert res.status_code == 200, res.text
    frames = events(url, h, res.json()["runId"])
    names = [f["event"] for f in frames]
    assert names[0] == "run.started" and names[-1] == "run.completed", (frames, log())
    tools = [(f["tool_name"], f["ok"]) for f in frames if f["event"] == "tool.completed"]
    assert [n for n, _ in tools] == ["mnote.page.get", "mnote.page.save"], tools
    assert all(ok for _, ok in tools), frames
    deltas = [f["delta"] for f in frames if f["event"] == "message.delta"]
    assert len(deltas) >= 3, frames                          # streamed in pieces
    answer = "".join(deltas)    # exactly the output (no blank line Hermes put after its tools)
    assert answer.startswith("[demo model] Done: I called mnote_page_get, mnote_page_save")
    assert frames[-1]["output"] == answer and frames[-1]["finish_reason"] == "stop"
    blocks = export_page(config)["blocks"]
    assert blocks[-1]["text"].startswith("[demo model] summary: “项目计划”"), blocks[-1]
    assert len(blocks) == 5

    res = requests.post(f"{url}{P}/runs", headers=h, timeout=60,
                        json={**RUN, "message": "Tell me a long story", "traceId": "trace_2"})
    assert res.status_code == 200, res.text
    run_id = res.json()["runId"]
    aborted = []

    def abort_on_first_delta(frame):
        if frame["event"] == "message.delta" and not aborted:
            aborted.append(requests.post(f"{url}{P}/runs/{run_id}/abort", headers=h, timeout=30,
                                         json={"sessionId": RUN["sessionId"]}))
    frames = events(url, h, run_id, abort_on_first_delta)
    assert aborted and aborted[0].status_code == 200, aborted and aborted[0].text
    assert [f["event"] for f in frames][-2:] == ["abort.started", "run.cancelled"], frames
    seen = "".join(f["delta"] for f in frames if f["event"] == "message.delta").strip()
    assert seen and "[demo model] You said: Tell me a long story.".startswith(seen[:40]), seen
    assert not (tmp_path / "data" / "mnote.db").exists()      # nothing outside data/demo/
