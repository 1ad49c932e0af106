"""The OpenAI-compatible routes in process, with the CLI runner stubbed at its seam
(tests/support/fixtures.py StubTurns): shapes, errors, identity, conversation mapping."""
import json

import pytest

KEY, FRONT = "openai-key-0123456789abcdef", "front-key-0123456789abcdef"
CFG = {"openai": {"runner": "cli"},
       "security": {"api_keys": [
           {"key": KEY, "user_id": "alice", "scopes": ["openai"]},
           {"key": FRONT, "trusted_frontend": True, "scopes": ["openai"]},
           {"key": "nouser-key-0123456789abcdef", "scopes": ["openai"]},
           {"key": "v1only-key-0123456789abcdef", "user_id": "bob", "scopes": ["v1"]}]}}


def auth(key=KEY, **extra):
    return {"Authorization": f"Bearer {key}", **extra}


@pytest.fixture
def client(stubbed_app):
    return stubbed_app(CFG).test_client()


def chat(client, messages, headers=None, **body):
    return client.post("/v1/chat/completions", headers=headers or auth(),
                       json={"model": "hermes", "messages": messages, **body})


def user(text):
    return {"role": "user", "content": text}


def test_models_list_the_configured_ids(client):
    res = client.get("/v1/models", headers=auth())
    assert res.status_code == 200
    assert [m["id"] for m in res.json["data"]] == ["hermes"] and res.json["object"] == "list"
    assert client.get("/v1/models/hermes", headers=auth()).json["id"] == "hermes"
    err = client.get("/v1/models/gpt-4", headers=auth())
    assert err.status_code == 404 and err.json["error"]["code"] == "model_not_found"


def test_an_answer_in_openai_shape_with_the_session_header(client, stub):
    res = chat(client, [user("hi")])
    assert res.status_code == 200, res.json
    body = res.json
    assert body["object"] == "chat.completion" and body["id"].startswith("chatcmpl-")
    choice = body["choices"][0]
    assert choice["message"] == {"role": "assistant", "content": "echo #1: hi",
                                 "refusal": None, "annotations": []}
    assert choice["finish_reason"] == "stop" and choice["logprobs"] is None
    assert set(body["usage"]) == {"prompt_tokens", "completion_tokens", "total_tokens"}
    assert res.headers["X-Hermes-Session-Id"]
    assert stub.calls[0]["message"] == "hi"


def test_the_history_continues_the_session_it_came_from(client, stub):
    first = chat(client, [user("one")])
    sid = first.headers["X-Hermes-Session-Id"]
    answer = first.json["choices"][0]["message"]["content"]
    again = chat(client, [user("one"), {"role": "assistant", "content": answer}, user("two")])
    assert again.headers["X-Hermes-Session-Id"] == sid
    assert stub.calls[1]["message"] == "two" and stub.calls[1]["resume_id"]
    # a made-up history starts a new session, seeded with it
    other = chat(client, [{"role": "system", "content": "be brief"}, user("one"),
                          {"role": "assistant", "content": "made up"}, user("three")])
    assert other.headers["X-Hermes-Session-Id"] != sid
    seeded = stub.calls[2]["message"]
    assert "be brief" in seeded and "Assistant: made up" in seeded and seeded.endswith("three")
    assert stub.calls[2]["resume_id"] is None


def test_the_session_header_continues_and_another_users_id_is_404(client, stub):
    sid = chat(client, [user("one")]).headers["X-Hermes-Session-Id"]
    res = chat(client, [user("two")], auth(**{"X-Hermes-Session-Id": sid}))
    assert res.headers["X-Hermes-Session-Id"] == sid and stub.calls[1]["message"] == "two"
    other = chat(client, [user("x")], auth(FRONT, **{"X-Hermes-Session-Id": sid,
                                                      "X-OpenWebUI-User-Id": "mallory"}))
    assert other.status_code == 404 and other.json["error"]["code"] == "session_not_found"


def test_a_stream_is_chunks_then_done(client):
    res = chat(client, [user("hi")], stream=True, stream_options={"include_usage": True})
    assert res.status_code == 200 and res.mimetype == "text/event-stream"
    frames = [f for f in res.get_data(as_text=True).split("\n\n") if f]
    assert all(f.startswith("data: ") for f in frames) and frames[-1] == "data: [DONE]"
    chunks = [json.loads(f[6:]) for f in frames[:-1]]
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks[:-1]) \
        == "echo #1: hi"
    assert chunks[-2]["choices"][0]["finish_reason"] == "stop"
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["total_tokens"] >= 0
    assert {c["id"] for c in chunks} == {chunks[0]["id"]}
    assert res.headers["X-Hermes-Session-Id"]


@pytest.mark.parametrize("body, status, code, param", [
    ({"messages": [{"role": "user", "content": "x"}]}, 400, "invalid_request", "model"),
    ({"model": "hermes", "messages": [{"role": "user", "content": "x"}], "n": 2}, 400,
     "unsupported_parameter", "n"),
    ({"model": "hermes", "messages": [{"role": "user", "content": "x"}],
      "tools": [{"type": "function", "function": {"name": "f"}}]}, 400, "tools_unsupported",
     "tools"),
    ({"model": "hermes", "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,AA"}}]}]}, 400,
     "unsupported_content", "messages[0].content"),
    ({"model": "nope", "messages": [{"role": "user", "content": "x"}]}, 404,
     "model_not_found", "model"),
    ({"model": "hermes", "messages": [{"role": "assistant", "content": "x"}]}, 400,
     "invalid_request", "messages"),
])
def test_refusals_in_openai_shape(client, stub, body, status, code, param):
    res = client.post("/v1/chat/completions", headers=auth(), json=body)
    assert res.status_code == status
    assert res.json["error"]["code"] == code and res.json["error"]["param"] == param
    assert res.json["error"]["type"] and res.json["error"]["message"]
    assert stub.calls == []


def test_open_webui_chores_are_answered_without_a_turn(client, stub):
    prompt = ("### Task:\nGenerate a concise, 3-5 word title with an emoji summarizing the "
              "chat history.\n### Output:\nJSON format: { \"title\": \"your concise title "
              "here\" }\n### Chat History:\n<chat_history>\nUSER: how do I bake bread at "
              "home quickly\nASSISTANT: knead\n</chat_history>")
    res = chat(client, [user(prompt)])
    assert json.loads(res.json["choices"][0]["message"]["content"]) == \
        {"title": "how do I bake bread at"}
    tags = chat(client, [user("### Task:\nGenerate 1-3 broad tags\nJSON format: "
                              "{ \"tags\": [\"tag1\"] }")], metadata={"task": "tags"})
    assert json.loads(tags.json["choices"][0]["message"]["content"]) == {"tags": []}
    assert stub.calls == []


@pytest.mark.parametrize("sid, status, code", [
    ("../etc", 400, "invalid_id"), ("a\tb", 400, "invalid_id"),
    ("never-issued", 404, "session_not_found")])
def test_a_session_header_that_is_no_session_of_this_user(client, stub, sid, status, code):
    res = chat(client, [user("x")], auth(**{"X-Hermes-Session-Id": sid}))
    assert res.status_code == status and res.json["error"]["code"] == code
    assert stub.calls == []


def test_a_v1_session_of_the_same_user_is_not_an_openai_conversation(stubbed_app, stub):
    app = stubbed_app(CFG)
    rec = app.extensions["hermes_service"].conversations.create("alice", "v1-sess", kind="v1")
    res = chat(app.test_client(), [user("x")],
               auth(**{"X-Hermes-Session-Id": rec["session_id"]}))
    assert res.status_code == 404 and stub.calls == []
