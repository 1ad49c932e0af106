"""The OpenAI-compatible routes against the real service (waitress on a free port), the real
``hermes acp`` in each user's sandbox and the scripted model, through the official ``openai``
SDK, LangChain's ``ChatOpenAI``, the ``llm-comply`` conformance suite and Open WebUI's request
shapes (docs/openai-api.md). One service for the module."""
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import openai
import pytest
import requests

from support.fixtures import ServiceProcess, base_config, deep_merge
from support.openai_attacks import inflated_turn

pytestmark = pytest.mark.e2e

ALICE, BOB = "alice-key-0123456789abcdef", "bob-key-0123456789abcdef"
FRONT = "front-key-0123456789abcdef"
MODEL = "hermes"


@pytest.fixture(scope="module")
def svc(tmp_path_factory, model):
    tmp = tmp_path_factory.mktemp("openai")
    cfg = deep_merge(base_config(tmp, model.base_url), {
        "openai": {"runner": "acp"},
        "hermes": {"max_concurrent_runs": 2, "max_waiting_requests": 1},
        "security": {"api_keys": [
            {"key": ALICE, "user_id": "alice", "scopes": ["openai"]},
            {"key": BOB, "user_id": "bob", "scopes": ["openai"]},
            {"key": FRONT, "trusted_frontend": True, "scopes": ["openai"]}]}})
    service = ServiceProcess(tmp, cfg).start()
    yield service
    service.stop()


def sdk(svc, key=ALICE, **kw) -> openai.OpenAI:
    return openai.OpenAI(base_url=svc.url + "/v1", api_key=key, max_retries=0, timeout=180,
                         **kw)


def user(text):
    return {"role": "user", "content": text}


def test_an_answer_with_real_usage(svc):
    res = sdk(svc).chat.completions.with_raw_response.create(
        model=MODEL, messages=[user("hello there")])
    done = res.parse()
    assert done.choices[0].message.content == "echo #1: hello there"
    assert done.choices[0].finish_reason == "stop" and done.object == "chat.completion"
    assert done.usage.prompt_tokens > 0 and done.usage.completion_tokens > 0
    assert done.usage.total_tokens == done.usage.prompt_tokens + done.usage.completion_tokens
    assert res.headers["X-Hermes-Session-Id"]


def test_a_stream_and_its_usage_chunk(svc):
    client = sdk(svc)
    raw = client.chat.completions.with_raw_response.create(
        model=MODEL, messages=[user("[[slow:1:4]] streamed words")], stream=True,
        stream_options={"include_usage": True})
    assert raw.headers["X-Hermes-Session-Id"]
    chunks = list(raw.parse())
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == "echo #1: [[slow:1:4]] streamed words"
    assert len([c for c in chunks if c.choices and c.choices[0].delta.content]) > 1
    finishing = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert [c.choices[0].finish_reason for c in finishing] == ["stop"]
    assert chunks[-1].choices == [] and chunks[-1].usage.total_tokens > 0
    assert {c.id for c in chunks} == {chunks[0].id}
    # without include_usage: no usage chunk; the wire has data frames only, then [DONE]
    res = requests.post(svc.url + "/v1/chat/completions", stream=True, timeout=180,
                        headers={"Authorization": f"Bearer {ALICE}"},
                        json={"model": MODEL, "stream": True, "messages": [user("plain")]})
    frames = [f for f in res.text.split("\n\n") if f and not f.startswith(":")]
    assert all(f.startswith("data: ") for f in frames) and frames[-1] == "data: [DONE]"
    assert all(json.loads(f[6:])["choices"] for f in frames[:-1])


def test_two_turns_by_the_session_header(svc):
    client = sdk(svc)
    first = client.chat.completions.with_raw_response.create(
        model=MODEL, messages=[user("remember apples")])
    sid = first.headers["X-Hermes-Session-Id"]
    second = client.chat.completions.with_raw_response.create(
        model=MODEL, messages=[user("[[recall]]")], extra_headers={"X-Hermes-Session-Id": sid})
    assert second.headers["X-Hermes-Session-Id"] == sid
    assert second.parse().choices[0].message.content == "remember apples"


def test_two_turns_by_the_history_and_a_made_up_one(svc):
    client = sdk(svc)
    first = client.chat.completions.with_raw_response.create(
        model=MODEL, messages=[{"role": "system", "content": "be kind"}, user("pears")])
    answer = first.parse().choices[0].message.content
    history = [{"role": "system", "content": "be kind"}, user("pears"),
               {"role": "assistant", "content": answer}]
    stream = client.chat.completions.with_raw_response.create(
        model=MODEL, messages=[*history, user("[[recall]]")], stream=True)
    assert stream.headers["X-Hermes-Session-Id"] == first.headers["X-Hermes-Session-Id"]
    text = "".join(c.choices[0].delta.content or "" for c in stream.parse() if c.choices)
    assert "pears" in text
    # an edited history: a new session, seeded with it (the model sees it as one message)
    edited = client.chat.completions.with_raw_response.create(
        model=MODEL, messages=[user("plums"), {"role": "assistant", "content": "made up"},
                               user("edited question")])
    assert edited.headers["X-Hermes-Session-Id"] != first.headers["X-Hermes-Session-Id"]
    seen = edited.parse().choices[0].message.content
    assert "[The conversation so far]" in seen and "Assistant: made up" in seen


def test_two_users_never_mix(svc):
    a, b = sdk(svc, ALICE), sdk(svc, BOB)
    sid = a.chat.completions.with_raw_response.create(
        model=MODEL, messages=[user("alice secret")]).headers["X-Hermes-Session-Id"]
    with pytest.raises(openai.NotFoundError) as caught:
        b.chat.completions.create(model=MODEL, messages=[user("[[recall]]")],
                                  extra_headers={"X-Hermes-Session-Id": sid})
    assert caught.value.body["code"] == "session_not_found"
    # bob sending alice's exact history gets a session of his own, not hers
    res = b.chat.completions.with_raw_response.create(
        model=MODEL, messages=[user("alice secret"),
                               {"role": "assistant", "content": "echo #1: alice secret"},
                               user("who else was here")])
    assert res.headers["X-Hermes-Session-Id"] != sid
    assert res.parse().choices[0].message.content.startswith("echo #1: ")   # a new session
    # a trusted front end names its users; each gets a home of its own
    front = sdk(svc, FRONT)
    front.chat.completions.create(model=MODEL, messages=[user("carol here")],
                                  extra_headers={"X-OpenWebUI-User-Id": "carol"})
    users = svc.data_dir / "users"
    assert {"alice", "bob", "carol"} <= {p.name for p in users.iterdir()}


def test_a_client_that_disconnects_stops_the_turn(svc):
    client = sdk(svc, BOB)
    raw = client.chat.completions.with_raw_response.create(
        model=MODEL, messages=[user("[[slow:60:60]] a long answer")], stream=True)
    sid = raw.headers["X-Hermes-Session-Id"]
    stream = raw.parse()
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            break
    stream.close()                                    # the client goes away mid-answer
    svc.wait_log("the client went away; stopping the turn", timeout=30)
    # the turn ended (its session is free again) long before the 60 s answer would have
    started = time.monotonic()
    res = client.chat.completions.create(model=MODEL, messages=[user("after")],
                                         extra_headers={"X-Hermes-Session-Id": sid})
    assert res.choices[0].message.content.endswith("after")
    assert time.monotonic() - started < 50


def test_every_refusal_is_the_sdks_exception(svc):
    client = sdk(svc)
    cases = [
        (sdk(svc, "wrong-key-0123456789abcdef"), {}, openai.AuthenticationError, 401),
        (sdk(svc, FRONT), {}, openai.PermissionDeniedError, 403),        # names nobody
        (client, {"model": "gpt-4o"}, openai.NotFoundError, 404),
        (client, {"n": 2}, openai.BadRequestError, 400),
        (client, {"messages": [user("x" * 130000)]}, openai.APIStatusError, 413),
    ]
    for who, extra, exc, status in cases:
        with pytest.raises(exc) as caught:
            who.chat.completions.create(**{"model": MODEL, "messages": [user("x")], **extra})
        assert caught.value.status_code == status
        assert set(caught.value.body) == {"message", "type", "code", "param"}
    with pytest.raises(openai.BadRequestError):      # model is required
        client.post("/chat/completions", body={"messages": [user("x")]}, cast_to=object)


def test_too_many_turns_is_429_with_retry_after(svc, model):
    """Three admission places (2 slots + 1 waiting): held by gated turns, the next is 429."""
    client = sdk(svc, FRONT)
    held = [client.chat.completions.with_raw_response.create(
        model=MODEL, messages=[user(f"[[gate:oa429]] {i}")], stream=True,
        extra_headers={"X-OpenWebUI-User-Id": f"u429{i}"}) for i in range(3)]
    try:
        with pytest.raises(openai.RateLimitError) as caught:
            client.chat.completions.create(model=MODEL, messages=[user("one more")],
                                           extra_headers={"X-OpenWebUI-User-Id": "u429x"})
        assert caught.value.response.headers["Retry-After"]
    finally:
        model.release("oa429")
        for h in held:
            list(h.parse())


def test_langchain_chat_openai_invoke_and_stream(svc):
    from langchain_openai import ChatOpenAI
    chat = ChatOpenAI(model=MODEL, base_url=svc.url + "/v1", api_key=ALICE, max_retries=0,
                      stream_usage=True)
    assert chat.invoke("lang chain").content == "echo #1: lang chain"
    pieces = list(chat.stream("lang stream"))
    assert "".join(p.content for p in pieces) == "echo #1: lang stream"
    usage = [p.usage_metadata for p in pieces if p.usage_metadata]
    assert usage and usage[-1]["total_tokens"] > 0


def test_open_webui_request_shapes(svc):
    """What Open WebUI sends: the models check, a streamed chat with the forwarded user, its
    title task (answered without a turn)."""
    head = {"Authorization": f"Bearer {FRONT}", "X-OpenWebUI-User-Id": "owui-user-1",
            "X-OpenWebUI-User-Name": "Dana", "X-OpenWebUI-Chat-Id": "chat-1"}
    models = requests.get(svc.url + "/v1/models", headers=head, timeout=30)
    assert models.status_code == 200 and models.json()["data"][0]["id"] == MODEL
    body = {"model": MODEL, "stream": True, "messages": [user("open webui hi")],
            "stream_options": {"include_usage": True}, "temperature": 0.7, "user": "ignored"}
    res = requests.post(svc.url + "/v1/chat/completions", headers=head, json=body, timeout=180)
    assert res.status_code == 200 and res.text.endswith("data: [DONE]\n\n")
    title = {"model": MODEL, "stream": False, "metadata": {"task": "title_generation"},
             "messages": [user("### Task:\nGenerate a concise title.\nJSON format: "
                               "{ \"title\": \"t\" }\n<chat_history>\nUSER: open webui hi\n"
                               "</chat_history>")]}
    started = time.monotonic()
    res = requests.post(svc.url + "/v1/chat/completions", headers=head, json=title,
                        timeout=30)
    assert json.loads(res.json()["choices"][0]["message"]["content"]) == \
        {"title": "open webui hi"}
    assert time.monotonic() - started < 2


# llm-comply's openai-chat cases this service does not pass, each with its reason
# (docs/openai-api.md §Conformance)
COMPLY_SKIPPED = {
    "chat-tool-calling": "client-defined tools: Hermes calls its own tools (400 "
                         "tools_unsupported)",
    "chat-image-input": "images: a Hermes turn's message is text (400 unsupported_content)",
}


def test_llm_comply_openai_chat(svc):
    exe = Path(sys.executable).with_name("llm-comply")
    listed = subprocess.run([str(exe), "--format", "openai-chat", "list"], capture_output=True,
                            text=True, check=True).stdout
    ids = [line.split()[0] for line in listed.splitlines()
           if line.strip().startswith("chat-")]
    run = [i for i in ids if i not in COMPLY_SKIPPED]
    out = subprocess.run(
        [str(exe), "--format", "openai-chat", "-u", svc.url + "/v1", "-k", ALICE, "-m", MODEL,
         "--json", "-f", ",".join(run), "--timeout", "120"],
        capture_output=True, text=True, timeout=900, env={**os.environ, "NO_COLOR": "1"})
    report = json.loads(out.stdout)
    results = report["results"] if isinstance(report, dict) else report
    bad = [r for r in results if r.get("status") not in ("passed", "skipped")]
    assert not bad, json.dumps(bad, indent=1)[:4000]
    assert {r["id"] for r in results} == set(run)
    # the suite itself skips only the reasoning case (it asks an o-series model's reasoning)
    assert {r["id"] for r in results if r["status"] == "skipped"} <= {"chat-reasoning-summary"}
    print(json.dumps([(r["id"], r["status"]) for r in results]))


def test_tool_activity_as_opt_in_comments(svc):
    """With ``X-Hermes-Tool-Events: comments`` the turn's tool calls travel as SSE comments
    the SDK skips; without it, none."""
    msg = '[[tools:terminal {"command": "echo tool-ran"}]]'
    head = {"Authorization": f"Bearer {ALICE}", "X-Hermes-Tool-Events": "comments"}
    res = requests.post(svc.url + "/v1/chat/completions", headers=head, timeout=180,
                        json={"model": MODEL, "stream": True, "messages": [user(msg)]})
    notes = [json.loads(f.split(" ", 2)[2]) for f in res.text.split("\n\n")
             if f.startswith(": hermes.tool ")]
    assert [n["event"] for n in notes] == ["tool.started", "tool.completed"], res.text[-2000:]
    assert notes[0]["name"] == "terminal" and "echo tool-ran" in notes[0]["preview"]
    assert res.text.endswith("data: [DONE]\n\n")
    chunks = list(sdk(svc).chat.completions.create(
        model=MODEL, messages=[user(msg)], stream=True,
        extra_headers={"X-Hermes-Tool-Events": "comments"}))
    assert "tools done" in "".join(c.choices[0].delta.content or "" for c in chunks
                                   if c.choices)


def test_an_agent_that_inflates_its_token_counters_is_capped(svc, model):
    usage = inflated_turn(sdk(svc, BOB), model, svc.data_dir / "users" / "bob", "oacounters")
    assert 0 < usage.total_tokens < 100000
