"""Checking a pass-through request body at a bounded cost (hermes_service/model_proxy/
body_check.py): small bodies inline, costly ones in a worker process (its time and memory
capped), each user within its bytes a second. The service-wide effect of a flood of costly
bodies is measured in bench/bench_model_body.py."""
from __future__ import annotations

import json

import pytest

from hermes_service.model_proxy import limits
from hermes_service.model_proxy.body_check import BodyChecker, parse_burst
from hermes_service.model_proxy.policy import Policy, Refusal
from hermes_service.model_proxy.proxy import user_body_budget

CAP = 4 * 1024 * 1024
POLICY = Policy(frozenset({"m"}), CAP)
JSON = "application/json"


def small(**kw) -> bytes:
    return json.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}], **kw}).encode()


def costly(valid: bool = True, lists: int = 300_000) -> bytes:
    """``lists`` × ``[],``: as a tool's free-form parameter schema (valid) or as messages."""
    many = b",".join([b"[]"] * lists)
    if valid:
        return (b'{"model":"m","messages":[{"role":"user","content":"x"}],"tools":[{"type":'
                b'"function","function":{"name":"x","parameters":[' + many + b"]}}]}")
    return b'{"model":"m","messages":[' + many + b"]}"


@pytest.fixture
def checker():
    c = BodyChecker()
    yield c
    c.close()


def refusal(fn, *args) -> Refusal:
    with pytest.raises(Refusal) as err:
        fn(*args)
    return err.value


def test_a_small_body_is_checked_inline_and_a_costly_one_in_a_worker(checker):
    assert checker.prepare(POLICY, "u", small(), JSON) == POLICY.prepare_chat(small(), JSON)
    assert not checker._idle                                   # no worker started for it
    body = costly()
    got = checker.prepare(POLICY, "u", body, JSON)
    assert len(checker._idle) == 1                             # the worker is kept
    assert got == POLICY.prepare_chat(body, JSON)              # the same rules, the same bytes
    bad = refusal(checker.prepare, POLICY, "v", costly(valid=False), JSON)
    assert (bad.status, bad.code) == (400, "invalid_request_body")
    assert "messages[0]" in bad.message
    assert checker.prepare(POLICY, "w", small(max_tokens=9), JSON).max_output == 9


def test_a_body_past_the_time_bound_is_refused_and_its_worker_replaced(checker, monkeypatch):
    monkeypatch.setattr(limits, "PARSE_SECONDS", 0.05)
    r = refusal(checker.prepare, POLICY, "u", costly(), JSON)
    assert (r.status, r.code) == (400, "request_too_complex")
    assert not checker._idle                                   # killed, not kept
    monkeypatch.setattr(limits, "PARSE_SECONDS", 30.0)
    assert checker.prepare(POLICY, "u", costly(lists=100_000), JSON).body


def test_a_body_past_the_memory_bound_is_refused(checker, monkeypatch):
    monkeypatch.setattr(limits, "WORKER_BASE_BYTES", 64 * 1024 * 1024)
    monkeypatch.setattr(limits, "WORKER_BYTES_PER_BODY_BYTE", 0)
    r = refusal(checker.prepare, POLICY, "u", costly(lists=1_300_000), JSON)   # ~120 MiB
    assert (r.status, r.code) == (400, "request_too_complex"), r.message


def test_each_user_checks_at_most_its_bytes_a_second(checker, monkeypatch):
    monkeypatch.setattr(limits, "PARSE_BYTES_PER_SECOND", 1000)
    monkeypatch.setattr(limits, "PARSE_BURST_BYTES", 0)
    policy = Policy(frozenset({"m"}), 3000)
    assert parse_burst(policy.max_body) == 6000                # two bodies of the cap
    # charged by its length before it is read: a refused body is never parsed
    checker.admit(policy, "greedy", 3000)
    checker.admit(policy, "greedy", 2500)
    r = refusal(checker.admit, policy, "greedy", 3000)
    assert (r.status, r.code, r.etype) == (429, "too_many_requests", "rate_limit_error")
    assert int(r.headers["Retry-After"]) >= 1
    checker.admit(policy, "polite", 3000)                      # another user's share
    # many small values cost more than their bytes: an inline body is charged per value
    values = json.dumps({"model": "m", "messages": [], "tools": [{"type": "function", "function": {
        "name": "x", "parameters": [[]] * 100}}]}).encode()
    assert len(values) < 1000
    checker.admit(policy, "values", len(values))
    r = refusal(checker.prepare, policy, "values", values, JSON)   # 100+ values x 64 > 6000
    assert r.code == "too_many_requests"
    checker.prepare(policy, "polite", small(), JSON)           # few values: its bytes only


def test_no_worker_free_is_503_and_none_is_held_after(checker, monkeypatch):
    monkeypatch.setattr(limits, "PARSES", 0)
    monkeypatch.setattr(limits, "PARSE_WAIT_SECONDS", 0.05)
    r = refusal(checker.prepare, POLICY, "u", costly(lists=200_000), JSON)
    assert (r.status, r.code) == (503, "server_overloaded")
    assert checker.prepare(POLICY, "u", small(), JSON)           # inline still served


def test_a_lone_body_of_the_cap_always_fits_its_users_share(monkeypatch):
    monkeypatch.setattr(limits, "USER_BODY_BUDGET", 16 * 1024 * 1024)
    assert user_body_budget(Policy(frozenset(), 20 * 1024 * 1024)) == 20 * 1024 * 1024
    assert user_body_budget(Policy(frozenset(), CAP)) == 16 * 1024 * 1024


def test_a_small_body_of_very_many_values_is_never_parsed_in_the_service(checker, monkeypatch):
    body = costly(lists=limits.INLINE_VALUES + 1)
    assert len(body) <= limits.INLINE_BYTES                 # small: only its values are many
    here = []
    original = Policy.prepare_chat

    def counted(self, *args):
        here.append(1)
        return original(self, *args)
    monkeypatch.setattr(Policy, "prepare_chat", counted)
    got = checker.prepare(POLICY, "u", body, JSON)
    assert here == [] and got.body == original(POLICY, body, JSON).body
    checker.prepare(POLICY, "u", small(), JSON)
    assert here == [1]                                       # a plain one is checked here


def test_one_user_holds_one_worker_at_a_time_and_others_go_on(checker, monkeypatch):
    import threading

    from hermes_service.model_proxy.body_check import Worker
    monkeypatch.setattr(limits, "PARSES", 2)
    monkeypatch.setattr(limits, "PARSE_WAIT_SECONDS", 0.3)
    inside, release = threading.Event(), threading.Event()
    ask = Worker.ask

    def held(self, header, body, deadline):
        if b'"held"' in body:
            inside.set()
            release.wait(30)
        return ask(self, header, body, deadline)
    monkeypatch.setattr(Worker, "ask", held)
    first = costly().replace(b'"content":"x"', b'"content":"held"')
    results = []
    t = threading.Thread(target=lambda: results.append(checker.prepare(POLICY, "a", first, JSON)))
    t.start()
    try:
        assert inside.wait(30)
        busy = refusal(checker.prepare, POLICY, "a", costly(), JSON)   # a's second waits, then 503
        assert (busy.status, busy.code) == (503, "server_overloaded")
        assert checker.prepare(POLICY, "b", costly(), JSON).stream is False   # b is not held up
    finally:
        release.set()
        t.join(30)
    assert len(results) == 1
