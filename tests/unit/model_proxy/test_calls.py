"""How each model call ended (hermes_service/model_proxy/calls.py; docs/sandbox.md §How each
call ended): recorded by the real pass-through in front of the scripted model, per
credential, bounded, and summed per turn (docs/runners.md §Outcomes as they were)."""
from __future__ import annotations

import http.client
import json

import pytest

from hermes_service.model_proxy.calls import Call, CallLog, TurnCalls, credential_key
from hermes_service.model_proxy.proxy import ModelProxy
from hermes_service.model_proxy.usage import UsageReader, read_usage, usage_db_path
from hermes_service.scripted_model import ScriptedModel

from .test_proxy import Client, chat_body


@pytest.fixture(scope="module")
def scripted():
    m = ScriptedModel("scripted-model").start()
    yield m
    m.stop()


@pytest.fixture
def proxy(tmp_path, scripted):
    p = ModelProxy(scripted.base_url, None, usage_db_path(tmp_path / "data"),
                   models={"scripted-model"}).start()
    yield p
    p.stop()


def call(proxy, cred, text, stream=True, usage=True):
    c = Client(proxy)
    try:
        return c.call("POST", "/v1/chat/completions", chat_body(text, stream=stream, usage=usage),
                      cred)
    except (OSError, http.client.HTTPException):   # a cut stream ends the read early
        return None
    finally:
        c.close()


def test_each_call_is_recorded_with_how_it_ended(proxy):
    cred = proxy.issue("alice")
    call(proxy, cred, "whole")
    call(proxy, cred, "[[length]] long")
    call(proxy, cred, "a side call", stream=False)     # (the scripted model: auxiliary)
    call(proxy, cred, "[[cut-every]] broken")
    call(proxy, cred, "[[status:503]] down")
    call(proxy, cred, "[[no-usage]] quiet")
    calls = proxy.calls_since(cred).calls      # in the order they were made
    assert [(c.ended, c.finish_reason, c.stream) for c in calls] == [
        ("complete", "stop", True), ("complete", "length", True), ("complete", "stop", False),
        ("broken", None, True), ("error", None, True), ("complete", "stop", True)]
    assert [c.estimated for c in calls] == [False, False, False, True, False, True]
    assert calls[0].prompt_tokens > 0 and calls[0].completion_tokens > 0


def test_a_turn_reads_its_own_calls_only(proxy):
    a, b = proxy.issue("alice"), proxy.issue("alice")     # two processes of one user
    call(proxy, a, "before the turn")
    mark = proxy.call_position(a)
    call(proxy, b, "the other process")
    call(proxy, a, "in the turn")
    turn = proxy.calls_since(a, mark)
    assert len(turn.calls) == 1 and turn.usage()["requests"] == 1
    assert proxy.calls_since("hsm-never-issued").calls == ()
    assert proxy.calls_since(None).calls == () and proxy.call_position(None) == 0


def test_model_list_probes_are_not_model_calls(proxy):
    cred = proxy.issue("bob")
    c = Client(proxy)
    assert c.call("GET", "/v1/models", None, cred)[0] == 200
    c.close()
    call(proxy, cred, "one call")
    assert len(proxy.calls_since(cred).calls) == 1        # (waits for the call's end)
    proxy.usage.flush()
    [row] = read_usage(proxy.usage.path, user_id="bob")
    assert row.requests == 1


def test_a_turn_sums_its_calls_and_says_whether_the_answer_came_whole():
    ok = Call("complete", 200, True, "stop", 10, 2, False)
    cut = Call("broken", 200, True, None, 10, 1, True)
    title = Call("complete", 200, False, "stop", 5, 1, False)      # a side call, not streamed
    # broke once, continued whole: an answer
    assert not TurnCalls((cut, ok, title)).broken
    turn = TurnCalls((ok, cut, cut, cut, title))
    assert turn.broken and turn.tries == 3 and turn.estimated
    assert turn.usage() == {"input_tokens": 45, "output_tokens": 6, "total_tokens": 51,
                            "estimated": True, "requests": 5}
    # Hermes says "length" for a stream that broke off: the provider's own reason wins
    assert turn.finish_reason("length") is None
    assert TurnCalls((Call("complete", 200, True, "length", 1, 1, False),)).finish_reason(
        "length") == "length"
    assert TurnCalls().finish_reason("length") == "length" and not TurnCalls().broken
    assert TurnCalls((Call("error", 502, True, None, 0, 0, False),)).broken


def test_the_log_is_bounded_however_many_calls_an_agent_makes():
    """A hostile agent making endless calls pushes out only its own process's oldest ones;
    past the credential cap the oldest credentials go."""
    log = CallLog(max_processes=3, max_calls=4)
    junk = Call("complete", 200, True, "stop", 1, 1, False)
    for _ in range(1000):
        log.add(credential_key("hostile"), junk)
    assert log.position("hostile") == 1000 and len(log.since("hostile")) == 4
    assert len(log.since("hostile", 998)) == 2 and log.since("hostile", 1000) == []
    log.add(credential_key("victim"), junk)
    for name in ("x", "y", "z"):
        log.add(credential_key(name), junk)
    assert log.since("victim") == [] and log.position("victim") == 0      # evicted, oldest


@pytest.mark.parametrize("reason, kept", [("stop", "stop"), ("length", "length"),
                                          ("tool_calls", "tool_calls"), ("x" * 33, None),
                                          ("STOP", None), ("stop\n", None), (7, None)])
def test_only_a_finish_reason_shaped_like_one_is_kept(reason, kept):
    reader = UsageReader("text/event-stream", None)
    chunk = {"choices": [{"index": 0, "delta": {}, "finish_reason": reason}]}
    reader.feed(b"data: " + json.dumps(chunk).encode() + b"\n\n")
    assert reader.finish_reason == kept
