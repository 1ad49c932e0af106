"""What the model pass-through forwards (hermes_service/model_proxy/policy.py), and what it counts
(hermes_service/model_proxy/usage.py): every attack a user's agent can make with its own process's
credential — another model, another path, fields that bill more, credential headers, a big or
strange body, a stream without usage, a stream cut early, many requests, a spent budget.
The real Hermes through it: tests/e2e/test_model_proxy_hermes.py; from inside a sandbox:
tests/e2e/test_e2e_costs.py."""
from __future__ import annotations

import dataclasses
import datetime as dt
import json
import select
import socket
import sqlite3
import subprocess
import sys
import threading

import pytest

from hermes_service import metrics
from hermes_service.model_proxy.policy import (
    MIN_REQUEST_BYTES,
    Policy,
    Refusal,
    UsageStripper,
    forward_headers,
    max_request_bytes,
    offered_models,
)
from hermes_service.model_proxy.usage import (
    BUDGET_MARK,
    UsageStore,
    read_usage,
    seconds_to_midnight,
)
from hermes_service.runner import classify_text
from support.fixtures import ROOT, wait_for
from unit.model_proxy.test_proxy import (  # noqa: F401  (fixtures)
    Client,
    chat_body,
    gated,
    make_proxy,
    outcome_count,
    provider_key,
    scripted,
    sse_usage,
    usage_rows,
)


def estimated(kind):
    return metrics.REGISTRY.get_sample_value("hermes_service_model_tokens_estimated_total",
                                             {"kind": kind}) or 0.0


# -- the rules alone -------------------------------------------------------------------------
POLICY = Policy(frozenset({"m1", "m2"}), 1000)


def body(**kw):
    return json.dumps({"model": "m1", "messages": [{"role": "user", "content": "hi"}], **kw})


@pytest.mark.parametrize("raw, ctype, status, code", [
    (body(model="gpt-expensive"), "application/json", 404, "model_not_found"),
    (body(model=["m1"]), "application/json", 404, "model_not_found"),
    (body(model="M1"), "application/json", 404, "model_not_found"),
    (body(model="m1 "), "application/json", 404, "model_not_found"),
    (json.dumps({"messages": []}), "application/json", 404, "model_not_found"),
    (body(n=8), "application/json", 400, "unsupported_parameter"),
    (body(service_tier="priority"), "application/json", 400, "unsupported_parameter"),
    (body(store=True, metadata={"a": "b"}), "application/json", 400, "unsupported_parameter"),
    (body(modalities=["audio"]), "application/json", 400, "unsupported_parameter"),
    (body(web_search_options={}), "application/json", 400, "unsupported_parameter"),
    (body(extra_body={"n": 3}), "application/json", 400, "unsupported_parameter"),
    (body(messages="hi"), "application/json", 400, "invalid_request_body"),
    (body(stream="yes"), "application/json", 400, "invalid_request_body"),
    (body(stream=True, stream_options=[1]), "application/json", 400, "invalid_request_body"),
    ('{"model": "m1", "messages": [], "temperature": NaN}', "application/json", 400,
     "invalid_request_body"),
    ('{"model": "m1", "messages": [], "temperature": 1e999}', "application/json", 400,
     "invalid_request_body"),
    ('{"model": "m1", "messages": [], "seed": ' + "9" * 5000 + "}", "application/json", 400,
     "invalid_request_body"),
    ('{"model": "m1", "messages": [], "tools": [{"type": "function", "function": {"name": '
     '"t", "parameters": {"maximum": ' + "9" * 41 + "}}}]}", "application/json", 400,
     "invalid_request_body"),                    # a long integer anywhere: quadratic to parse
    ("[" * 100000 + "]" * 100000, "application/json", 400, "invalid_request_body"),
    ("[1, 2]", "application/json", 400, "invalid_request_body"),
    ("{bad", "application/json", 400, "invalid_request_body"),
    (body(), "text/plain", 415, "unsupported_media_type"),
    (body(), "application/json; charset=latin-1", 415, "unsupported_media_type"),
    (body(), None, 415, "unsupported_media_type"),
])
def test_a_body_the_config_does_not_offer_is_refused(raw, ctype, status, code):
    with pytest.raises(Refusal) as err:
        POLICY.prepare_chat(raw.encode(), ctype)
    assert (err.value.status, err.value.code) == (status, code), err.value.message


def test_an_integer_of_up_to_40_digits_is_kept():
    tool = {"type": "function", "function": {"name": "t", "parameters": {
        "type": "object", "properties": {"n": {"type": "integer", "maximum": 10 ** 39}}}}}
    sent = POLICY.prepare_chat(body(tools=[tool]).encode(), "application/json")
    params = json.loads(sent.body)["tools"][0]["function"]["parameters"]
    assert params["properties"]["n"]["maximum"] == 10 ** 39


def test_other_encodings_are_refused_and_what_is_sent_is_what_was_checked():
    for raw in (body().encode("utf-16"), body().encode("utf-32"),
                b"\xef\xbb\xbf" + body().encode(), body().encode("utf-16-le")):
        with pytest.raises(Refusal):
            POLICY.prepare_chat(raw, "application/json")
    # a key given twice: the provider gets the one that was checked, once
    twice = b'{"model": "gpt-expensive", "messages": [], "model": "m1"}'
    sent = POLICY.prepare_chat(twice, "application/json; charset=UTF-8")
    assert json.loads(sent.body) == {"model": "m1", "messages": []}
    assert sent.body.count(b'"model"') == 1
    # a lone surrogate (valid JSON, not UTF-8) stays escaped; non-ASCII stays UTF-8
    sent = POLICY.prepare_chat(body(messages=[{"role": "user", "content": "\ud800 字"}]).encode(),
                               "application/json")
    assert json.loads(sent.body)["messages"][0]["content"] == "\ud800 字"
    sent = POLICY.prepare_chat(body(messages=[{"role": "user", "content": "字"}],
                                    ensure_ascii=None).replace(', "ensure_ascii": null', "")
                               .encode(), "application/json")
    assert "字".encode() in sent.body


def test_a_streamed_call_always_asks_for_usage_and_remembers_who_asked():
    plain = POLICY.prepare_chat(body(stream=True).encode(), "application/json")
    assert json.loads(plain.body)["stream_options"] == {"include_usage": True}
    assert plain.stream and not plain.usage_asked
    for opts in ({"include_usage": False}, {"include_usage": "true"}, {}):
        p = POLICY.prepare_chat(body(stream=True, stream_options=opts).encode(),
                                "application/json")
        assert json.loads(p.body)["stream_options"]["include_usage"] is True
        assert not p.usage_asked
    asked = POLICY.prepare_chat(body(stream=True, stream_options={"include_usage": True})
                                .encode(), "application/json")
    assert asked.usage_asked and asked.prompt_estimate == len(asked.body) // 4
    unstreamed = POLICY.prepare_chat(body().encode(), "application/json")
    assert not unstreamed.stream and "stream_options" not in json.loads(unstreamed.body)


def test_only_the_headers_the_provider_needs_are_kept():
    got = forward_headers([("Accept", "a"), ("accept", "b"), ("x-api-key", "k"), ("api-key", "k"),
                           ("X-Forwarded-For", "1"), ("Forwarded", "f"), ("Cookie", "c"),
                           ("OpenAI-Organization", "o"), ("X-Stainless-Lang", "py"),
                           ("X-Stainless-Evil", "e"), ("Authorization", "Bearer x"),
                           ("Host", "h"), ("Content-Length", "9")])
    assert got == [("Accept", "a"), ("X-Stainless-Lang", "py")]
    assert forward_headers([("Accept", "a\r\n x-api-key: k"), ("User-Agent", "u" * 5000)]) == [
        ("Accept", "a x-api-key: k"), ("User-Agent", "u" * 1000)]


def test_the_offered_models_are_the_configs():
    cfg = {"model": {"default": "main"}, "auxiliary": {"vision": {"model": "seer"},
                                                       "web": {"model": ""}, "x": "y"},
           "delegation": {"model": "helper"}}
    assert offered_models(cfg, ["panel", None, " "]) == {"main", "seer", "helper", "panel"}
    assert offered_models({}) == frozenset()


def test_the_body_cap_follows_the_context_length():
    assert max_request_bytes(128000) == MIN_REQUEST_BYTES == 4 * 1024 * 1024
    assert max_request_bytes(1_000_000) == 32_000_000
    assert max_request_bytes(10**9) == 64 * 1024 * 1024


@pytest.mark.parametrize("sep", [b"\n", b"\r\n"])
def test_the_usage_chunk_is_taken_out_wherever_the_pieces_are_cut(sep):
    e = sep + sep
    events = [b'data: {"choices": [{"delta": {"content": "a"}}], "usage": null}' + e,
              b": keepalive" + e,
              b'data: {"choices": [{"delta": {}, "finish_reason": "stop"}]}' + e,
              b'data: {"id": "x", "choices": [], "usage": {"prompt_tokens": 3}}' + e,
              b"data: [DONE]" + e]
    stream = b"".join(events)
    for step in (1, 2, 7, len(stream)):
        s = UsageStripper()
        out = b"".join(s.feed(stream[i:i + step]) for i in range(0, len(stream), step))
        out += s.flush()
        assert out == b"".join(events[:3] + events[4:]), step


# -- through the endpoint ---------------------------------------------------------------------
def test_other_models_and_fields_are_refused_there_and_never_forwarded(scripted, make_proxy):
    proxy = make_proxy(scripted.base_url)
    c = Client(proxy)
    cred = proxy.issue("mallory")
    before = outcome_count("refused"), outcome_count("provider_error")
    for b in (chat_body("x", model="gpt-expensive-4"), chat_body("x", n=50),
              chat_body("x", stream=True, service_tier="priority")):
        status, headers, raw = c.call("POST", "/v1/chat/completions", b, cred)
        assert status in (400, 404) and headers["Content-Type"] == "application/json"
        err = json.loads(raw)["error"]
        assert set(err) == {"message", "type", "param", "code"}
        assert err["code"] in ("model_not_found", "unsupported_parameter")
    assert scripted.requests == []
    assert (outcome_count("refused"), outcome_count("provider_error")) == (before[0] + 3,
                                                                          before[1])
    assert classify_text("HTTP 404: the model 'gpt-x' is not offered here").code == \
        "hermes_failed"          # not taken for the provider being down


def test_a_stream_cut_before_its_usage_is_still_counted_by_estimate(gated, make_proxy):
    proxy = make_proxy(gated.base + "/v1")
    cred = proxy.issue("dora")
    e0 = estimated("completion"), estimated("prompt")
    sent = chat_body("cut " + "p" * 400, stream=True, usage=False)
    resp = Client(proxy).request("POST", "/v1/chat/completions", sent, cred)
    with pytest.raises(Exception):
        resp.read()                       # the provider broke off: so did the answer
    status, _, raw = Client(proxy).call("POST", "/v1/chat/completions",
                                        chat_body("nousage", stream=False), cred)
    assert status == 200 and "usage" not in json.loads(raw)
    [row] = usage_rows(proxy, 2)
    forwarded = [len(s["body"]) for s in gated.seen]
    assert row.requests == 2 and row.estimated_requests == 2
    assert row.prompt_tokens == sum(n // 4 for n in forwarded)
    assert row.completion_tokens == 5 + 10                   # 20 chars, 40 chars: / 4
    assert (estimated("completion") - e0[0], estimated("prompt") - e0[1]) == (
        15, row.prompt_tokens)
    assert json.loads(gated.seen[0]["body"])["stream_options"] == {"include_usage": True}


def test_one_user_cannot_hold_more_than_its_share_of_requests(scripted, make_proxy,
                                                              monkeypatch):
    from hermes_service.model_proxy import limits
    monkeypatch.setattr(limits, "MAX_USER_REQUESTS", 2)
    proxy = make_proxy(scripted.base_url)
    hold = [Client(proxy, timeout=30) for _ in range(2)]
    cred = proxy.issue("greedy")
    for i, c in enumerate(hold):
        c.conn.request("POST", "/v1/chat/completions",
                       chat_body(f"[[gate:share{i}]]", stream=True),
                       {"Authorization": f"Bearer {cred}", "Content-Type": "application/json"})
    wait_for(lambda: len(scripted.requests) == 2, what="both requests at the provider")
    status, headers, raw = Client(proxy).call("POST", "/v1/chat/completions", chat_body("3rd"),
                                              cred)
    assert (status, json.loads(raw)["error"]["code"]) == (429, "too_many_requests")
    assert headers["Retry-After"] == "1"
    assert Client(proxy).call("POST", "/v1/chat/completions", chat_body("other"),
                              proxy.issue("polite"))[0] == 200       # another user is served
    for i, c in enumerate(hold):
        scripted.release(f"share{i}")
        assert c.conn.getresponse().read().endswith(b"[DONE]\n\n")
    assert Client(proxy).call("POST", "/v1/chat/completions", chat_body("now"), cred)[0] == 200


def test_bodies_held_at_once_are_bounded_for_all_users(scripted, make_proxy, monkeypatch):
    from hermes_service.model_proxy import limits
    monkeypatch.setattr(limits, "BODY_BUDGET", 1000)
    proxy = make_proxy(scripted.base_url)
    cred = proxy.issue("big")
    raw = chat_body("x" * 600)
    with socket.create_connection(("127.0.0.1", proxy.port), timeout=10) as s:
        s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: "
                  b"application/json\r\nAuthorization: Bearer " + cred.encode() +
                  b"\r\nContent-Length: %d\r\n\r\n" % len(raw) + raw[:10])   # held, unsent
        wait_for(lambda: proxy._body_bytes == len(raw), what="the first body's place")
        status, _, out = Client(proxy).call("POST", "/v1/chat/completions", raw,
                                            proxy.issue("other"))
        assert (status, json.loads(out)["error"]["code"]) == (503, "server_overloaded")
    wait_for(lambda: proxy._body_bytes == 0, what="the place given back")
    assert Client(proxy).call("POST", "/v1/chat/completions", raw, cred)[0] == 200


def test_a_spent_daily_budget_is_answered_with_its_own_code(scripted, make_proxy):
    proxy = make_proxy(scripted.base_url, daily_tokens=50)
    cred = proxy.issue("spender")
    c = Client(proxy)
    assert c.call("POST", "/v1/chat/completions", chat_body("one [[usage:60]]", stream=True),
                  cred)[0] == 200
    wait_for(lambda: proxy.usage.spent("spender") >= 60, what="the first request counted")
    before = outcome_count("refused")
    status, headers, raw = c.call("POST", "/v1/chat/completions", chat_body("two"), cred)
    err = json.loads(raw)["error"]
    assert (status, err["code"], err["type"]) == (429, "token_budget_exceeded",
                                                  "insufficient_quota")
    assert BUDGET_MARK in err["message"] and 0 < int(headers["Retry-After"]) <= 86401
    assert c.call("GET", "/v1/models", credential=cred)[0] == 429
    assert outcome_count("refused") == before + 2 and len(scripted.requests) == 1
    assert c.call("POST", "/v1/chat/completions", chat_body("x"), proxy.issue("other"))[0] == 200
    proxy.configure(scripted.base_url, proxy._settings.api_key_env, daily_tokens=None)
    assert c.call("POST", "/v1/chat/completions", chat_body("three"), cred)[0] == 200
    turn = classify_text(f"API call failed: HTTP 429: {err['message']}")
    assert (turn.status, turn.code) == (429, "token_budget_exceeded")


def test_requests_in_parallel_cannot_together_overrun_the_daily_budget(scripted, make_proxy):
    """Each request holds its prompt estimate + max_tokens while it runs: with 200 000 tokens
    a day and 65 536 asked per request, the fourth is the last admitted (three hold 196 608
    < 200 000); every later one is refused until they end, whatever they report."""
    proxy = make_proxy(scripted.base_url, daily_tokens=200_000)
    cred = proxy.issue("parallel")
    held, refused = [], []
    for i in range(8):
        c = Client(proxy, timeout=30)
        c.conn.request("POST", "/v1/chat/completions",
                       chat_body(f"[[gate:p{i}]] [[usage:190000]]", stream=True,
                                 max_tokens=65536),
                       {"Authorization": f"Bearer {cred}", "Content-Type": "application/json"})
        before = len(scripted.requests)
        wait_for(lambda: len(scripted.requests) > before or select.select(
            [c.conn.sock], [], [], 0)[0], what="the request forwarded or refused")
        (held if len(scripted.requests) > before else refused).append((i, c))
    assert [i for i, _ in held] == [0, 1, 2, 3]
    for _, c in refused:
        resp = c.conn.getresponse()
        assert (resp.status, json.loads(resp.read())["error"]["code"]) == (
            429, "token_budget_exceeded")
    for i, c in held:
        scripted.release(f"p{i}")
        assert c.conn.getresponse().read().endswith(b"[DONE]\n\n")
    [row] = usage_rows(proxy, 4)
    assert row.requests == 4 and row.prompt_tokens == 4 * 190_000       # no more got through
    assert not proxy._reserved                                          # all given back


def test_a_caller_hanging_up_mid_answer_is_billed_what_the_provider_reports(gated, make_proxy):
    proxy = make_proxy(gated.base + "/v1")
    cred = proxy.issue("quitter")
    resp = Client(proxy).request("POST", "/v1/chat/completions",
                                 chat_body("gated", stream=True), cred)
    assert b"first" in resp.read1(4096)            # the answer started (hidden reasoning next)
    resp.close()                                   # the caller hangs up
    gated.release.set()                            # the provider goes on to its usage
    [row] = usage_rows(proxy, 1)
    assert (row.prompt_tokens, row.completion_tokens, row.estimated_requests) == (11, 7, 0)
    assert gated.finished.wait(10)


def test_a_gone_callers_answer_is_read_within_bounds_then_counted_at_max_tokens(
        scripted, make_proxy, monkeypatch):
    from hermes_service.model_proxy import limits
    monkeypatch.setattr(limits, "ORPHAN_SECONDS", 0.2)
    proxy = make_proxy(scripted.base_url)
    cred = proxy.issue("quitter")
    resp = Client(proxy).request("POST", "/v1/chat/completions",
                                 chat_body("[[slow:2:40]] " + "w " * 40, stream=True,
                                           max_tokens=5000), cred)
    assert resp.read1(4096)
    resp.close()              # the rest comes over 2 s: past the 0.2 s bound
    [row] = usage_rows(proxy, 1)
    assert row.estimated_requests == 1 and row.completion_tokens == 5000


def test_what_a_user_spent_counts_every_process_and_the_queue(tmp_path):
    db = tmp_path / "model_usage.db"
    store = UsageStore(db)
    day = "2026-01-02"
    store.add("u", 10, 5, day=day)
    assert store.spent("u", day) == 15           # queued or written: counted either way
    code = ("import sys; from pathlib import Path; from hermes_service.model_proxy.usage import "
            "UsageStore; s = UsageStore(Path(sys.argv[1])); s.add('u', 100, 0, day='2026-01-02');"
            " s.close()")
    subprocess.run([sys.executable, "-c", code, str(db)], cwd=str(ROOT), check=True)
    store.flush()
    assert store.spent("u", day) == 115 and store.spent("v", day) == 0
    store.add("u", 1, 1, day=day, estimated=True)
    store.close()
    [row] = read_usage(db, days=10000, today=dt.date(2026, 1, 3))
    assert (row.requests, row.estimated_requests) == (3, 1)
    noon = dt.datetime(2026, 1, 2, 12, tzinfo=dt.UTC)
    assert seconds_to_midnight(noon) == 12 * 3600 + 1


def test_an_earlier_usage_db_gains_the_estimated_column(tmp_path):
    import sqlite3
    db = tmp_path / "model_usage.db"
    with sqlite3.connect(db) as conn:
        conn.execute("CREATE TABLE usage (user_id TEXT NOT NULL, day TEXT NOT NULL, requests "
                     "INTEGER NOT NULL DEFAULT 0, prompt_tokens INTEGER NOT NULL DEFAULT 0, "
                     "completion_tokens INTEGER NOT NULL DEFAULT 0, PRIMARY KEY (user_id, day))")
        conn.execute("INSERT INTO usage VALUES ('old', '2026-01-01', 2, 3, 4)")
    assert read_usage(db, days=10000, today=dt.date(2026, 1, 1)) == [
        ("old", None, 2, 3, 4, 0)]
    store = UsageStore(db)
    threads = [threading.Thread(target=store.add, args=("old", 1, 1, "2026-01-01"))
               for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    store.close()
    assert read_usage(db, days=10000, today=dt.date(2026, 1, 1)) == [("old", None, 5, 6, 7, 0)]


def test_a_body_trickled_in_is_cut_off_and_its_share_given_back(scripted, make_proxy,
                                                                monkeypatch):
    from hermes_service.model_proxy import limits
    monkeypatch.setattr(limits, "BODY_SECONDS", 0.5)
    monkeypatch.setattr(limits, "USER_BODY_BUDGET", 1000)
    proxy = make_proxy(scripted.base_url)
    proxy.policy = dataclasses.replace(proxy.policy, max_body=1000)   # the share: at least it
    cred = proxy.issue("slow")
    raw = chat_body("x" * 600)
    with socket.create_connection(("127.0.0.1", proxy.port), timeout=10) as s:
        s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: "
                  b"application/json\r\nAuthorization: Bearer " + cred.encode() +
                  b"\r\nContent-Length: %d\r\n\r\n" % len(raw) + raw[:10])
        wait_for(lambda: proxy._user_bytes.get("slow") == len(raw), what="its place")
        # the same user's next body does not fit its share; another user's does
        status, _, out = Client(proxy).call("POST", "/v1/chat/completions", raw, cred)
        assert (status, json.loads(out)["error"]["code"]) == (429, "too_many_requests")
        assert Client(proxy).call("POST", "/v1/chat/completions", raw,
                                  proxy.issue("other"))[0] == 200
        assert s.recv(200).startswith(b"HTTP/1.1 408 ")        # the trickle is cut off
    wait_for(lambda: not proxy._user_bytes and proxy._body_bytes == 0, what="shares back")
    assert scripted.requests and all("x" * 600 in json.dumps(r) for r in scripted.requests)


def test_usage_that_cannot_be_written_is_kept_and_retried(tmp_path, monkeypatch, caplog):
    """A full disk: the counts stay in what the user spent, are written once there is room,
    and only what still cannot be written when the service stops is logged as lost."""
    from hermes_service.model_proxy import usage as model_usage
    real = model_usage._connect
    full = [True]

    def connect(path, create, shared=False):
        if full[0] and create:
            raise sqlite3.OperationalError("database or disk is full")
        return real(path, create, shared)
    db = tmp_path / "model_usage.db"
    store = UsageStore(db)
    monkeypatch.setattr(model_usage, "_connect", connect)
    monkeypatch.setattr(model_usage, "RETRY_SECONDS", 0.05)
    store.add("u", 100, 20)
    assert store.flush()
    assert store.spent("u") == 120 and read_usage(db) == []
    assert "kept; retried" in caplog.text
    store.add("u", 1, 2)
    full[0] = False                                  # room again: both written
    wait_for(lambda: read_usage(db) == [("u", None, 2, 101, 22, 0)], what="the retried write")
    assert store.spent("u") == 123
    store.close()
    full[0] = False
    store = UsageStore(db)
    full[0] = True                                   # full until the service stops
    store.add("u", 5, 5)
    store.close()
    assert "lost at this stop" in caplog.text
    assert read_usage(db) == [("u", None, 2, 101, 22, 0)]
