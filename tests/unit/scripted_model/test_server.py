"""Fast unit tests of hermes_service/scripted_model/ (no hermes involved)."""

from __future__ import annotations

import json
import socket
import sys
import threading
import time
import uuid
from pathlib import Path

import pytest
import requests

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from hermes_service.scripted_model import (
    AUX_REPLY,
    ScriptedModel,
    hermes_env,
    is_auxiliary,
    parse_tool_directive,
    write_hermes_config,
)
from support.fixtures import wait_for

SYSTEM = {"role": "system", "content": "You are Hermes Agent, a test."}
TITLE_SYSTEM = {
    "role": "system",
    "content": "Generate a short, descriptive title (3-7 words) for a conversation ...",
}


def tool_def(name: str) -> dict:
    return {
        "type": "function",
        "function": {"name": name, "description": name, "parameters": {"type": "object", "properties": {}}},
    }


@pytest.fixture(scope="module")
def model():
    m = ScriptedModel("unit-model").start()
    yield m
    m.stop()


def chat(model, messages, *, stream=True, include_usage=True, tools=None, timeout=10, **extra):
    body = {"model": model.model_id, "messages": messages, "stream": stream, **extra}
    if stream and include_usage:
        body["stream_options"] = {"include_usage": True}
    if tools is not None:
        body["tools"] = tools
    return requests.post(model.base_url + "/chat/completions", json=body, timeout=timeout)


def sse_frames(resp) -> list:
    """Parse an SSE body into a list of decoded JSON frames (+ the string "[DONE]")."""
    assert resp.status_code == 200, resp.text
    assert resp.headers["Content-Type"].startswith("text/event-stream")
    frames = []
    for block in resp.text.split("\n\n"):
        if not block.strip():
            continue
        assert block.startswith("data: "), block
        data = block[len("data: "):]
        frames.append("[DONE]" if data == "[DONE]" else json.loads(data))
    return frames


def assemble(frames) -> dict:
    """Rebuild text, tool calls, finish reason and usage from stream frames."""
    text, calls, finish, usage, roles = "", {}, None, None, []
    for f in frames:
        if f == "[DONE]":
            continue
        assert f["object"] == "chat.completion.chunk"
        if f.get("usage"):
            usage = f["usage"]
        for ch in f["choices"]:
            d = ch["delta"]
            if "role" in d:
                roles.append(d["role"])
            text += d.get("content") or ""
            for tc in d.get("tool_calls") or []:
                c = calls.setdefault(tc["index"], {"id": None, "name": "", "arguments": ""})
                if tc.get("id"):
                    c["id"] = tc["id"]
                fn = tc.get("function") or {}
                c["name"] += fn.get("name") or ""
                c["arguments"] += fn.get("arguments") or ""
            if ch.get("finish_reason"):
                finish = ch["finish_reason"]
    return {"text": text, "calls": [calls[i] for i in sorted(calls)], "finish": finish, "usage": usage, "roles": roles}


def stream_reply(model, messages, **kw) -> dict:
    frames = sse_frames(chat(model, messages, **kw))
    assert frames[-1] == "[DONE]"
    return assemble(frames)


# -- models / routing -------------------------------------------------------


def test_models_endpoints(model):
    r = requests.get(model.base_url + "/models", timeout=5)
    assert r.status_code == 200
    assert [m["id"] for m in r.json()["data"]] == ["unit-model"]
    r = requests.get(model.base_url + "/models/unit-model", timeout=5)
    assert r.status_code == 200 and r.json()["id"] == "unit-model"
    r = requests.get(model.base_url + "/models/other", timeout=5)
    assert r.status_code == 404 and "error" in r.json()


@pytest.mark.parametrize("method,path", [("GET", "/v1/nothing"), ("POST", "/api/show"), ("POST", "/v1/completions")])
def test_unknown_paths_404_json(model, method, path):
    root = model.base_url[: -len("/v1")]
    r = requests.request(method, root + path, json={}, timeout=5)
    assert r.status_code == 404
    assert r.json()["error"]["message"]


def test_invalid_json_is_400(model):
    r = requests.post(model.base_url + "/chat/completions", data=b"{nope", timeout=5,
                      headers={"Content-Type": "application/json"})
    assert r.status_code == 400
    assert "error" in r.json()


def test_base_url_and_start_stop_idempotent():
    m = ScriptedModel()
    assert m.start() is m
    assert m.start() is m
    assert m.base_url.startswith("http://127.0.0.1:") and m.base_url.endswith("/v1")
    assert m.model_id == "scripted-model"
    m.stop()
    m.stop()
    with pytest.raises(requests.ConnectionError):
        requests.get(m.base_url + "/models", timeout=2)


# -- echo / recall --------------------------------------------------------------


def test_stream_echo_frames(model):
    frames = sse_frames(chat(model, [SYSTEM, {"role": "user", "content": "hello"}]))
    assert frames[-1] == "[DONE]"
    first = frames[0]
    assert first["choices"][0]["delta"]["role"] == "assistant"
    ids = {f["id"] for f in frames[:-1]}
    assert len(ids) == 1 and next(iter(ids)).startswith("chatcmpl-")
    # the usage chunk comes last, with empty choices
    assert frames[-2]["choices"] == [] and frames[-2]["usage"]["total_tokens"] > 0
    got = assemble(frames)
    assert got["text"] == "echo #1: hello"
    assert got["finish"] == "stop"
    assert got["roles"] == ["assistant"]
    assert sum(1 for f in frames[:-1] if f["choices"] and f["choices"][0]["delta"].get("content")) >= 2


def test_stream_without_include_usage_has_no_usage_chunk(model):
    frames = sse_frames(chat(model, [{"role": "user", "content": "x"}], include_usage=False))
    assert all("usage" not in f for f in frames if f != "[DONE]")
    assert assemble(frames)["text"] == "echo #1: x"


def test_echo_counts_user_turns(model):
    msgs = [
        SYSTEM,
        {"role": "user", "content": "one"},
        {"role": "assistant", "content": "echo #1: one"},
        {"role": "user", "content": [{"type": "text", "text": "two "}, {"type": "text", "text": "parts"}]},
        {"role": "assistant", "content": "echo #2: two parts"},
        {"role": "user", "content": "three ünïcode ✓"},
    ]
    assert stream_reply(model, msgs)["text"] == "echo #3: three ünïcode ✓"


def test_recall(model):
    msgs = [
        SYSTEM,
        {"role": "user", "content": "alpha"},
        {"role": "assistant", "content": "a"},
        {"role": "user", "content": "beta"},
        {"role": "assistant", "content": "b"},
        {"role": "user", "content": "[[recall]] now"},
    ]
    assert stream_reply(model, msgs)["text"] == "alpha | beta"


def test_non_stream_json_completion(model):
    r = chat(model, [SYSTEM, {"role": "user", "content": "plain"}], stream=False)
    assert r.status_code == 200
    body = r.json()
    assert body["object"] == "chat.completion"
    assert body["choices"][0]["message"] == {"role": "assistant", "content": "echo #1: plain"}
    assert body["choices"][0]["finish_reason"] == "stop"
    assert body["usage"]["total_tokens"] > 0
    # without the Hermes system prompt a non-streamed request counts as auxiliary
    r = chat(model, [{"role": "user", "content": "plain"}], stream=False)
    assert r.json()["choices"][0]["message"]["content"] == AUX_REPLY
    # ... unless explicitly marked as a main request
    r = chat(model, [{"role": "user", "content": "plain"}], stream=False, scripted_main=True)
    assert r.json()["choices"][0]["message"]["content"] == "echo #1: plain"


def test_length_cuts_every_try_of_the_message(model):
    """[[length]]: the reply ends at the provider's output limit, and so does every
    continuation Hermes asks for with its own [System: …] nudge; a later question is whole."""
    asked = {"role": "user", "content": "[[length]] write a lot"}
    assert stream_reply(model, [SYSTEM, asked])["finish"] == "length"
    nudge = {"role": "user", "content": "[System: Your previous response was truncated by the "
                                        "output length limit. Continue exactly where you left off.]"}
    again = [SYSTEM, asked, {"role": "assistant", "content": "echo #1: [[length]]"}, nudge]
    assert stream_reply(model, again)["finish"] == "length"
    r = chat(model, again, stream=False)
    assert r.json()["choices"][0]["finish_reason"] == "length"
    later = [*again, {"role": "assistant", "content": "x"}, {"role": "user", "content": "next"}]
    assert stream_reply(model, later)["finish"] == "stop"


# -- errors / hang / slow ---------------------------------------------------------


@pytest.mark.parametrize("code", [401, 429, 500, 503])
@pytest.mark.parametrize("stream", [True, False])
def test_status_directive(model, code, stream):
    r = chat(model, [SYSTEM, {"role": "user", "content": f"x [[status:{code}]] y"}], stream=stream)
    assert r.status_code == code
    err = r.json()["error"]
    assert set(err) >= {"message", "type", "param", "code"}
    assert (r.headers.get("Retry-After") == "1") == (code == 429)


def test_hang_until_client_gives_up_and_handler_exits(model):
    t0 = time.monotonic()
    with pytest.raises(requests.ReadTimeout):
        chat(model, [SYSTEM, {"role": "user", "content": "[[hang]] please"}], timeout=0.5)
    assert time.monotonic() - t0 < 3
    # the handler notices the closed client and releases its connection
    deadline = time.monotonic() + 3
    while time.monotonic() < deadline:
        with model._lock:
            if not model._conns:
                break
        time.sleep(0.05)
    # (other tests' keep-alive connections are closed by requests immediately)
    with model._lock:
        assert not model._conns


def test_stop_releases_hanging_request():
    m = ScriptedModel().start()
    result = {}

    def call():
        t = time.monotonic()
        try:
            chat(m, [SYSTEM, {"role": "user", "content": "[[hang]]"}], timeout=30)
            result["outcome"] = "answered"
        except requests.RequestException as e:
            result["outcome"] = type(e).__name__
        result["elapsed"] = time.monotonic() - t

    th = threading.Thread(target=call)
    th.start()
    deadline = time.monotonic() + 5
    while not m.requests and time.monotonic() < deadline:
        time.sleep(0.02)
    assert len(m.requests) == 1
    time.sleep(0.3)
    assert th.is_alive()  # still hanging
    t_stop = time.monotonic()
    m.stop()
    assert time.monotonic() - t_stop < 3
    th.join(5)
    assert not th.is_alive()
    assert result["outcome"] != "answered"


def test_gate_holds_the_reply_until_released(model):
    """``[[gate:NAME]]`` answers only after ``release(NAME)``, as without the directive."""
    gate = "g-" + uuid.uuid4().hex[:8]
    got = {}
    th = threading.Thread(target=lambda: got.update(reply=stream_reply(
        model, [SYSTEM, {"role": "user", "content": f"[[gate:{gate}]] held"}], timeout=30)))
    th.start()
    wait_for(lambda: model.requests_with(f"[[gate:{gate}]]"), "the gated request")
    th.join(0.3)
    assert th.is_alive() and not got       # held (a moment: no reply without the release)
    model.release(gate)
    th.join(10)
    assert got["reply"]["text"] == f"echo #1: [[gate:{gate}]] held"


def test_slow_stream_spreads_chunks(model):
    t0 = time.monotonic()
    frames = sse_frames(chat(model, [SYSTEM, {"role": "user", "content": "[[slow:1]] take your time"}]))
    elapsed = time.monotonic() - t0
    assert 0.8 <= elapsed < 4
    got = assemble(frames)
    assert got["text"] == "echo #1: [[slow:1]] take your time"
    assert sum(1 for f in frames[:-1] if f["choices"] and f["choices"][0]["delta"].get("content")) >= 4


# -- tools ---------------------------------------------------------------------------


def test_parse_tool_directive():
    assert parse_tool_directive("no directive") is None
    assert parse_tool_directive('[[tools:a {"x": 1}]]') == [("a", {"x": 1})]
    assert parse_tool_directive("pre [[tools:a ; b_c-d.e]] post") == [("a", {}), ("b_c-d.e", {})]
    assert parse_tool_directive('[[tools: t1 {"s": "a;b]]c", "n": {"k": [1, 2]}} ;t2{"q":"}"} ]]') == [
        ("t1", {"s": "a;b]]c", "n": {"k": [1, 2]}}),
        ("t2", {"q": "}"}),
    ]
    assert parse_tool_directive('[[tools:a {"x": }]]') is None  # bad JSON
    assert parse_tool_directive("[[tools:a [1] ]]") is None  # args must be an object
    assert parse_tool_directive("[[tools:a") is None  # unterminated


def test_tool_call_sequence(model):
    tools = [tool_def("read_file"), tool_def("terminal")]
    user = {"role": "user", "content": 'go [[tools:read_file {"path": "/x;y]]"} ; terminal {"command": "ls"}]]'}
    msgs = [SYSTEM, {"role": "user", "content": "earlier"}, {"role": "assistant", "content": "ok"},
            {"role": "tool", "tool_call_id": "old", "content": "from an earlier turn"}, user]

    step1 = stream_reply(model, msgs, tools=tools)
    assert step1["finish"] == "tool_calls" and step1["text"] == ""
    (c1,) = step1["calls"]
    assert c1["name"] == "read_file" and json.loads(c1["arguments"]) == {"path": "/x;y]]"}
    assert c1["id"].startswith("call_")

    msgs += [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": c1["id"], "type": "function", "function": {"name": "read_file", "arguments": c1["arguments"]}}]},
        {"role": "tool", "tool_call_id": c1["id"], "content": "RESULT-1"},
    ]
    step2 = stream_reply(model, msgs, tools=tools)
    (c2,) = step2["calls"]
    assert step2["finish"] == "tool_calls"
    assert c2["name"] == "terminal" and json.loads(c2["arguments"]) == {"command": "ls"}
    assert c2["id"] != c1["id"]

    msgs += [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": c2["id"], "type": "function", "function": {"name": "terminal", "arguments": c2["arguments"]}}]},
        {"role": "tool", "tool_call_id": c2["id"], "content": [{"type": "text", "text": "RESULT-2"}]},
    ]
    final = stream_reply(model, msgs, tools=tools)
    assert final["finish"] == "stop" and final["calls"] == []
    assert final["text"] == "tools done: RESULT-1 || RESULT-2"


def test_narrate_says_what_each_tool_call_is_for(model):
    tools = [tool_def("terminal")]
    msgs = [SYSTEM, {"role": "user", "content": '[[narrate]] [[tools:terminal {"command": "ls"}]]'}]
    step = stream_reply(model, msgs, tools=tools)
    assert step["text"] == "calling terminal." and step["finish"] == "tool_calls"
    assert [c["name"] for c in step["calls"]] == ["terminal"]
    r = chat(model, msgs, stream=False, tools=tools)
    assert r.json()["choices"][0]["message"]["content"] == "calling terminal."


def test_tool_call_non_stream(model):
    r = chat(model, [SYSTEM, {"role": "user", "content": '[[tools:terminal {"command": "pwd"}]]'}],
             stream=False, tools=[tool_def("terminal")])
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    (tc,) = choice["message"]["tool_calls"]
    assert tc["function"]["name"] == "terminal"
    assert json.loads(tc["function"]["arguments"]) == {"command": "pwd"}


def test_tool_not_offered(model):
    got = stream_reply(model, [SYSTEM, {"role": "user", "content": "[[tools:secret_tool]]"}],
                       tools=[tool_def("terminal")])
    assert got["text"] == "tool not offered: secret_tool"
    assert got["finish"] == "stop"
    got = stream_reply(model, [SYSTEM, {"role": "user", "content": "[[tools:terminal]]"}])
    assert got["text"] == "tool not offered: terminal"


def test_tools_offered(model):
    got = stream_reply(model, [SYSTEM, {"role": "user", "content": "[[tools-offered]]"}],
                       tools=[tool_def("zeta"), tool_def("alpha"), tool_def("mid_one")])
    assert got["text"] == "alpha,mid_one,zeta"
    got = stream_reply(model, [SYSTEM, {"role": "user", "content": "[[tools-offered]]"}])
    assert got["text"] == "(none)"


# -- auxiliary calls / bookkeeping ------------------------------------------------------


@pytest.mark.parametrize("stream", [True, False])
def test_title_generation_is_auxiliary(stream):
    with ScriptedModel() as m:
        msgs = [TITLE_SYSTEM, {"role": "user", "content": "User: [[hang]] [[status:500]]\n\nAssistant: x"}]
        t0 = time.monotonic()
        r = chat(m, msgs, stream=stream, timeout=5)
        assert time.monotonic() - t0 < 2
        if stream:
            assert assemble(sse_frames(r))["text"] == AUX_REPLY
        else:
            assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == AUX_REPLY
        assert len(m.requests) == 1 and m.main_requests() == []
        assert len(m.aux_requests()) == 1


def test_compression_and_review_are_auxiliary(model):
    compression = {"model": "m", "messages": [{"role": "user", "content": "Summarize: [[hang]]"}]}
    review = {"model": "m", "stream": True, "messages": [
        SYSTEM, {"role": "user", "content": "[[hang]]"}, {"role": "assistant", "content": "x"},
        {"role": "user", "content": "Review the conversation above and consider saving to memory"}]}
    main = {"model": "m", "stream": True, "messages": [SYSTEM, {"role": "user", "content": "[[hang]]"}]}
    assert is_auxiliary(compression)
    assert is_auxiliary(review)
    assert not is_auxiliary(main)
    assert not is_auxiliary({"stream": False, "messages": [SYSTEM, {"role": "user", "content": "x"}]})
    r = requests.post(model.base_url + "/chat/completions", json=review, timeout=5)
    assert assemble(sse_frames(r))["text"] == AUX_REPLY


def test_requests_recorded_concurrently_and_main_filter():
    with ScriptedModel() as m:
        errors = []

        def one(i):
            try:
                got = stream_reply(m, [SYSTEM, {"role": "user", "content": f"msg-{i}"}])
                assert got["text"] == f"echo #1: msg-{i}"
            except Exception as e:  # noqa: BLE001 - reported below
                errors.append(e)

        threads = [threading.Thread(target=one, args=(i,)) for i in range(20)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(10)
        chat(m, [TITLE_SYSTEM, {"role": "user", "content": "User: msg"}], stream=False)
        assert not errors
        assert len(m.requests) == 21 and len(m.request_headers) == 21
        assert len(m.main_requests()) == 20
        assert sorted(r["messages"][-1]["content"] for r in m.main_requests()) == sorted(
            f"msg-{i}" for i in range(20))
        assert len(m.requests_with("msg-7")) == 1


def test_keep_alive_session_reuses_connection(model):
    with requests.Session() as s:
        for i in range(3):
            r = s.post(model.base_url + "/chat/completions", timeout=5, json={
                "model": "m", "stream": True, "messages": [SYSTEM, {"role": "user", "content": f"k{i}"}]})
            assert assemble(sse_frames(r))["text"] == f"echo #1: k{i}"
            r = s.get(model.base_url + "/models", timeout=5)
            assert r.status_code == 200


def test_raw_http_chunked_stream(model):
    """The SSE body is valid HTTP/1.1 chunked encoding ending in a zero chunk."""
    body = json.dumps({"stream": True, "messages": [SYSTEM, {"role": "user", "content": "raw"}]}).encode()
    host, port = model.base_url.split("//")[1].split("/")[0].split(":")
    with socket.create_connection((host, int(port)), timeout=5) as s:
        s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Connection: close\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
        data = b""
        while chunk := s.recv(65536):
            data += chunk
    head, _, rest = data.partition(b"\r\n\r\n")
    assert b"Transfer-Encoding: chunked" in head
    assert rest.endswith(b"0\r\n\r\n")
    assert b"data: [DONE]" in rest


# -- hermes home helpers ----------------------------------------------------------------


def test_write_hermes_config(tmp_path):
    import yaml
    path = write_hermes_config(tmp_path / "home", "http://127.0.0.1:1/v1", "m1", "MY_KEY",
                               extra={"plugins": {"enabled": ["p1"]}, "agent": {"max_turns": 5}})
    cfg = yaml.safe_load(path.read_text())
    assert cfg["model"] == {"provider": "custom", "base_url": "http://127.0.0.1:1/v1", "default": "m1",
                            "api_key": "${MY_KEY}", "context_length": 128000}
    assert cfg["agent"] == {"api_max_retries": 1, "environment_probe": False, "max_turns": 5}
    assert cfg["security"] == {"tirith_enabled": False, "allow_lazy_installs": False}
    assert cfg["plugins"] == {"enabled": ["p1"]}
    env = hermes_env(tmp_path, "MY_KEY", "sk-1")
    assert env["HERMES_HOME"] == env["HOME"] == str(tmp_path)
    assert env["MY_KEY"] == "sk-1" and env["HERMES_STREAM_RETRIES"] == "0"
