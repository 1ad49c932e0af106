"""What a user's agent can spend is bounded (docs/sandbox.md §What the pass-through forwards;
docs/data-and-durability.md §What a hostile state.db costs the service): the real service,
real ``hermes`` on both runners, real bubblewrap, the scripted model driving Hermes's real
terminal tool.

The agent takes its own process's pass-through credential from inside its sandbox and tries
everything a hostile agent would in one script: another model, other paths, a big body,
credential headers of its own, fields that bill more, a stream without usage, a stream it
drops early, image/file parts and search tools, a body costly to parse; then spends past the
daily budget. And a user's ``state.db`` rebuilt with a
40 MiB generated column, or claiming a 1 GB value, or holding a value of a type Hermes never
writes, read by several transcript requests at once, costs the service nothing but a 409 while
another user is served; rows costly to post-process (4 MiB of merged-summary headers) are
served within the read's bounds.
"""
from __future__ import annotations

import json
import re
import sqlite3
import threading

import pytest

from hermes_service.model_proxy.usage import read_usage, usage_db_path
from support.fixtures import API_KEY, wait_for

pytestmark = [pytest.mark.e2e,
              pytest.mark.sandbox]


def terminal(command: str) -> str:
    return "[[tools:terminal " + json.dumps({"command": command}) + "]]"


def checks(answer: str) -> dict[str, str]:
    text = answer.replace("\\n", "\n")
    return {m.group(1): m.group(2).strip()
            for m in re.finditer(r'CHECK (\w+)=([^\n\\"]*)', text)}


#: run by the agent's terminal tool: its own credential, then every misuse of it
SPEND = r"""
import http.client, json, os, socket
from urllib.parse import urlsplit
cred = url = None
for pid in os.listdir("/proc"):
    try:
        env = open(f"/proc/{pid}/environ", "rb").read().split(b"\0")
    except OSError:
        continue
    for kv in env:
        if kv.startswith(b"HERMES_SERVICE_MODEL_KEY=") and len(kv) > 30:
            cred = kv.split(b"=", 1)[1].decode()
        if kv.startswith(b"HERMES_SERVICE_MODEL_URL=") and len(kv) > 30:
            url = kv.split(b"=", 1)[1].decode()
print(f"CHECK found={bool(cred and url)}")
u = urlsplit(url)
def call(method, path, body=None, headers=None, read=True):
    c = http.client.HTTPConnection(u.hostname, u.port, timeout=60)
    h = {"Authorization": f"Bearer {cred}", "Content-Type": "application/json", **(headers or {})}
    try:
        c.request(method, path, body if isinstance(body, (bytes, type(None))) else json.dumps(body), h)
    except OSError:       # refused before the body was read: the answer is waiting
        pass
    r = c.getresponse()
    if not read:
        first = r.read1(64)
        c.sock.shutdown(socket.SHUT_RDWR)
        c.close()
        return r.status, first
    data = r.read()
    try:
        code = json.loads(data)["error"]["code"]
    except Exception:
        code = "-"
    return r.status, code, data
chat = lambda text, **kw: {"model": "scripted-model", "stream": True,
                           "messages": [{"role": "user", "content": text}], **kw}
print("CHECK other_model=%s:%s" % call("POST", "/v1/chat/completions",
                                      chat("x", model="gpt-expensive-4"))[:2])
for name, m, p in (("files", "GET", "/v1/files"), ("tuning", "POST", "/v1/fine_tuning/jobs"),
                   ("admin", "GET", "/v1/organization/admin_api_keys"),
                   ("embeddings", "POST", "/v1/embeddings"), ("responses", "POST", "/v1/responses"),
                   ("escape", "GET", "/v1/../admin"), ("query", "GET", "/v1/models?after=x")):
    print(f"CHECK {name}=%s:%s" % call(m, p, {} if m == "POST" else None)[:2])
print("CHECK big=%s:%s" % call("POST", "/v1/chat/completions",
                               chat("y" * (8 << 20)))[:2])
print("CHECK n=%s:%s" % call("POST", "/v1/chat/completions", chat("x", n=20))[:2])
print("CHECK tier=%s:%s" % call("POST", "/v1/chat/completions",
                                chat("x", service_tier="priority"))[:2])
status, code, data = call("POST", "/v1/chat/completions", chat("spoofed-headers"),
                          {"x-api-key": "sk-mine", "api-key": "sk-mine", "X-Forwarded-For": "1.2.3.4",
                           "Forwarded": "for=1.2.3.4", "OpenAI-Organization": "org-x",
                           "Cookie": "a=b"})
print(f"CHECK headers={status}")
status, code, data = call("POST", "/v1/chat/completions", chat("no usage asked"))
print(f"CHECK no_usage={status}:{b'completion_tokens' in data}")
status, first = call("POST", "/v1/chat/completions",
                     chat("dropped [[slow:3:30]] [[usage:77777]]"), read=False)
print(f"CHECK dropped={status}")
# inside the body: parts a provider would fetch, tools it would run, keys it might read
for name, body in (
        ("image", chat([{"type": "image_url", "image_url": {"url": "http://10.0.0.1/x.png"}}])),
        ("file", chat([{"type": "file", "file": {"file_id": "file-abc"}}])),
        ("search", chat("x", tools=[{"type": "web_search_preview"}])),
        ("smuggle", chat("x", stream_options={"include_usage": True, "x_smuggled": 1})),
        ("max_tokens", chat("x", max_tokens=10 ** 30))):
    print(f"CHECK {name}=%s:%s" % call("POST", "/v1/chat/completions", body)[:2])
# a body costly to parse: checked in a worker process, refused; a costly valid one forwarded
lists = b",".join([b"[]"] * 100_000)
print("CHECK costly=%s:%s" % call("POST", "/v1/chat/completions",
      b'{"model": "scripted-model", "messages": [' + lists + b"]}")[:2])
print("CHECK costly_ok=%s:%s" % call("POST", "/v1/chat/completions",
      b'{"model": "scripted-model", "messages": [{"role": "user", "content": "ok"}], "tools": '
      b'[{"type": "function", "function": {"name": "f", "parameters": [' + lists + b"]}}]}")[:2])
"""


@pytest.mark.parametrize("runner", ["cli", "acp"])
def test_an_agent_with_its_credential_uses_the_account_only_for_the_configured_model(
        start_service, tmp_path, model, runner):
    svc = start_service({"hermes": {"runner": runner, "toolsets": ["terminal"],
                                    "sandbox": {"mode": "bwrap"},
                                    "limits": {"daily_tokens": 400_000}}})
    sid = svc.post("/api/v1/sessions", json={"user_id": "mallory"}).json()["session_id"]
    home = tmp_path / "data" / "users" / "mallory"          # (made at its first turn)
    home.mkdir(parents=True)
    (home / "spend.py").write_text(SPEND)
    seen = len(model.requests)
    res = svc.post(f"/api/v1/sessions/{sid}/messages", json={"message": terminal("python spend.py")})
    assert res.status_code == 200, res.text
    got = checks(res.json()["response"])
    assert got["found"] == "True", got
    assert got["other_model"] == "404:model_not_found", got
    for name in ("files", "tuning", "admin", "embeddings", "responses", "escape", "query"):
        assert got[name] == "404:not_found", (name, got)
    assert got["big"] == "413:request_too_large" and got["n"] == "400:unsupported_parameter", \
        res.json()["response"][-1500:]
    assert got["tier"] == "400:unsupported_parameter", got
    assert got["headers"] == "200" and got["no_usage"] == "200:False" and got["dropped"] == "200"
    for name in ("image", "file", "search", "smuggle"):
        assert got[name] == "400:unsupported_parameter", (name, got)
    assert got["max_tokens"] == "400:invalid_request_body", got
    assert got["costly"] == "400:invalid_request_body" and got["costly_ok"] == "200:-", got
    # what reached the provider: only the configured model, never the agent's headers
    mine = model.requests[seen:]
    assert {r["model"] for r in mine} == {"scripted-model"}
    assert all(len(json.dumps(r)) < 5 * 1024 * 1024 for r in mine)
    for h in model.request_headers[seen:]:
        lower = {k.lower() for k in h}
        assert not lower & {"x-api-key", "api-key", "x-forwarded-for", "forwarded",
                            "openai-organization", "cookie"}, h
    assert all(r.get("stream_options") == {"include_usage": True}
               for r in mine if r.get("stream"))
    # every token counted: the stream without usage asked; the dropped one as the provider
    # reports it (its answer read to its usage after the caller hung up)
    db = usage_db_path(tmp_path / "data")

    def row():
        rows = [r for r in read_usage(db, user_id="mallory")]
        return rows and rows[0].prompt_tokens >= 77777 and rows[0]
    counted = wait_for(row, "the dropped stream counted", 30)
    assert counted.completion_tokens > 0
    # the budget: spent by one big request, the next turn is refused before Hermes starts
    (home / "big.py").write_text(
        SPEND.split('print("CHECK other_model')[0] +
        'print("CHECK big_spend=%s:%s" % call("POST", "/v1/chat/completions", '
        'chat("spend [[usage:500000]]"))[:2])\n'
        'print("CHECK after=%s:%s" % call("POST", "/v1/chat/completions", chat("x"))[:2])\n')
    spent = svc.post(f"/api/v1/sessions/{sid}/messages", json={"message": terminal("python big.py")})
    if spent.status_code == 200:          # the turn's own last request may already be refused
        assert checks(spent.json()["response"])["after"] == "429:token_budget_exceeded"
    else:
        assert spent.json()["code"] == "token_budget_exceeded", spent.text
    before = len(model.requests)
    refused = svc.post(f"/api/v1/sessions/{sid}/messages", json={"message": "more"})
    assert (refused.status_code, refused.json()["code"]) == (429, "token_budget_exceeded")
    assert int(refused.headers["Retry-After"]) > 0 and len(model.requests) == before
    if runner == "cli":       # another user is served (one runner is enough)
        other = svc.post("/api/v1/sessions", json={"user_id": "polite"}).json()["session_id"]
        assert svc.post(f"/api/v1/sessions/{other}/messages",
                        json={"message": "fine"}).status_code == 200
    metrics = svc.get("/metrics").text
    assert 'hermes_service_model_requests_total{outcome="refused"}' in metrics
    assert 'outcome="provider_error"' not in metrics or \
        re.search(r'outcome="provider_error"} 0\.0', metrics)


def test_a_hostile_state_db_costs_the_service_a_409_while_others_are_served(start_service,
                                                                          tmp_path):
    from unit.homes.test_state_db import claim_huge
    svc = start_service()
    made = {}
    for actor in ("tamper", "calm"):
        h = {"X-API-Key": API_KEY, "X-Mnote-Actor-Id": actor}
        sid = svc.post("/api/hermes/client/sessions", headers=h,
                       json={"workspaceId": "ws", "documentId": "doc"}).json()["sessionId"]
        svc.post("/api/hermes/client/runs", headers=h, json={
            "workspaceId": "ws", "documentId": "doc", "sessionId": sid, "message": "hello",
            "model": "hermes-agent", "pageContext": {"title": "t", "outline": []},
            "selectedBlockId": None, "selectedText": None})
        made[actor] = (h, f"/api/hermes/client/sessions/{sid}?workspaceId=ws&documentId=doc")
    for actor, (h, url) in made.items():
        wait_for(lambda: svc.get(url, headers=h).json().get("messages"), f"{actor}'s turn", 120)
    db = tmp_path / "data" / "users" / "tamper" / ".hermes" / "state.db"

    def read_at_once(n: int) -> list:
        answers = []

        def read(actor):
            h, url = made[actor]
            answers.append((actor, svc.get(url, headers=h)))
        threads = [threading.Thread(target=read, args=("tamper",)) for _ in range(n)]
        threads.append(threading.Thread(target=read, args=("calm",)))
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert len(answers) == n + 1
        for actor, res in answers:
            if actor == "calm":
                assert res.status_code == 200 and res.json()["messages"], res.text
            else:
                assert res.status_code == 409, (res.status_code, res.text)
                assert res.json()["code"] == "hermes_client_home_tampered"
        return answers

    with sqlite3.connect(db) as c:        # a value of a type Hermes never writes: 409, not 500
        c.execute("UPDATE messages SET timestamp = 'x' WHERE id = (SELECT min(id) FROM messages)")
    read_at_once(1)
    from hermes_service.homes.transcript import MERGED_DELIMITER, MERGED_HEADER
    with sqlite3.connect(db) as c:        # rows costly to post-process: served, in bounds
        c.execute("UPDATE messages SET timestamp = 1.0")
        sid, = c.execute("SELECT session_id FROM messages LIMIT 1").fetchone()
        n = (4 * 1024 * 1024 - 200) // len(MERGED_HEADER.encode())
        for _ in range(2):
            c.execute("INSERT INTO messages (session_id, role, content, timestamp, active) "
                      "VALUES (?, 'assistant', ?, 1.0, 1)", (sid, MERGED_HEADER * n + MERGED_DELIMITER))
    h, url = made["tamper"]
    assert svc.get(url, headers=h).status_code == 200
    with sqlite3.connect(db) as c:        # what the agent can do to its own record
        c.execute("DELETE FROM messages WHERE length(content) > 1000000")
        c.executescript("ALTER TABLE messages RENAME COLUMN content TO real_content;"
                        "ALTER TABLE messages ADD COLUMN content TEXT GENERATED ALWAYS AS "
                        "(printf('%.*c', 41943040, 'x')) VIRTUAL;")
    read_at_once(3)
    with sqlite3.connect(db) as c:        # then: a record claiming a 1 GB value
        c.executescript("ALTER TABLE messages DROP COLUMN content;"
                        "ALTER TABLE messages RENAME COLUMN real_content TO content;"
                        "DELETE FROM messages WHERE id <> (SELECT min(id) FROM messages);")
    claim_huge(db, 999_000_000)
    read_at_once(3)
    assert svc.get("/health").json()["status"] == "healthy"
