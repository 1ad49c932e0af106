"""The pass-through's rules at its public seams, without a server (hermes_service/model_proxy/,
model_proxy/policy.py; docs/sandbox.md §Model pass-through, §What the pass-through forwards): the
credential (``Bearer`` only, issued per process, revoked at once, by digest), what one user and
all users may hold at once (and that a finished request gives it back), the daily budget's
edge, the routes and their methods, the fields, models and headers forwarded, the body cap.
Each in milliseconds; the same rules over HTTP: test_proxy.py, model_proxy/test_policy.py."""
from __future__ import annotations

import dataclasses
import json

import pytest

from hermes_service.model_proxy import limits
from hermes_service.model_proxy.policy import (
    CHAT_FIELDS,
    FORWARD_HEADERS,
    MAX_REQUEST_BYTES,
    MIN_REQUEST_BYTES,
    ROUTES,
    Policy,
    Refusal,
    forward_headers,
    max_request_bytes,
    route,
)
from hermes_service.model_proxy.proxy import ModelProxy
from hermes_service.model_proxy.relay import HOP_BY_HOP


@pytest.fixture
def proxy(tmp_path):
    p = ModelProxy("http://127.0.0.1:9/v1", None, tmp_path / "usage.db", models=["m1"])
    yield p
    p.stop()


# -- the credential --------------------------------------------------------------------------
def test_a_credential_is_bearer_only_and_exact(proxy):
    cred = proxy.issue("alice")
    assert proxy.user_for(f"Bearer {cred}") == "alice"
    assert proxy.user_for(f"bearer  {cred} ") == "alice"        # the scheme is case-insensitive
    for header in (cred, f"Basic {cred}", f"Token {cred}", f"Bearerx {cred}", f"{cred} Bearer",
                   f"Bearer {cred}x", f"Bearer {cred[:-1]}", "Bearer ", "Bearer", "", None):
        assert proxy.user_for(header) is None, header


def test_every_process_gets_its_own_random_credential_revoked_at_once(proxy):
    a1, a2, b = proxy.issue("alice"), proxy.issue("alice"), proxy.issue("bob")
    assert len({a1, a2, b}) == 3
    for c in (a1, a2, b):
        assert c.startswith("hsm-") and len(c) >= 4 + 43 and "alice" not in c
    proxy.revoke(a1)
    assert proxy.user_for(f"Bearer {a1}") is None
    assert proxy.user_for(f"Bearer {a2}") == "alice" and proxy.user_for(f"Bearer {b}") == "bob"
    proxy.revoke(a1)                         # unknown: ignored
    proxy.revoke("never-issued")
    with pytest.raises(ValueError):
        proxy.issue("")


# -- what is held at once --------------------------------------------------------------------
def test_one_user_holds_at_most_its_share_and_gets_it_back(proxy, monkeypatch):
    monkeypatch.setattr(limits, "MAX_USER_REQUESTS", 2)
    with proxy.admit("alice", 10) as d1, proxy.admit("alice", 10) as d2:
        assert d1 is None and d2 is None
        with proxy.admit("alice", 0) as d3:
            assert d3 is not None and (d3.status, d3.code) == (429, "too_many_requests")
            assert d3.headers["Retry-After"] == "1"
        with proxy.admit("bob", 10) as other:
            assert other is None                                # another user's share
    for _ in range(3):                                          # all given back
        with proxy.admit("alice", 10) as again, proxy.admit("alice", 10) as again2:
            assert again is None and again2 is None


def test_a_users_body_bytes_and_everyones_are_bounded_to_the_byte(proxy, monkeypatch):
    monkeypatch.setattr(limits, "USER_BODY_BUDGET", 100)
    monkeypatch.setattr(limits, "BODY_BUDGET", 150)
    # the user's share is at least the body cap (model_proxy.proxy.user_body_budget)
    monkeypatch.setattr(proxy, "policy", dataclasses.replace(proxy.policy, max_body=100))
    with proxy.admit("alice", 100) as d:
        assert d is None
        with proxy.admit("alice", 1) as over:
            assert over is not None and over.status == 429
        with proxy.admit("bob", 50) as fits:
            assert fits is None
            with proxy.admit("carol", 1) as full:
                assert full is not None and (full.status, full.code) == (503, "server_overloaded")
    with proxy.admit("alice", 100) as d, proxy.admit("bob", 50) as e:   # given back whole
        assert d is None and e is None
    with proxy.admit("alice", 101) as big:
        assert big is not None and big.status == 429


def test_a_spent_daily_budget_is_refused_from_the_last_token(proxy, monkeypatch):
    spent = {"alice": 999}
    monkeypatch.setattr(proxy.usage, "spent", lambda user: spent[user])
    proxy.daily_tokens = 1000
    proxy.check_budget("alice")
    spent["alice"] = 1000
    with pytest.raises(Refusal) as exc:
        proxy.check_budget("alice")
    assert (exc.value.status, exc.value.code) == (429, "token_budget_exceeded")
    assert int(exc.value.headers["Retry-After"]) > 0
    proxy.daily_tokens = None
    proxy.check_budget("alice")


# -- what is forwarded -----------------------------------------------------------------------
def test_two_routes_each_with_its_one_method():
    assert ROUTES == {"/v1/chat/completions": "POST", "/v1/models": "GET"}
    assert route("POST", "/v1/chat/completions") == "/v1/chat/completions"
    assert route("GET", "/v1/models") == "/v1/models"
    for method, target in (("GET", "/v1/chat/completions"), ("POST", "/v1/models"),
                           ("PUT", "/v1/chat/completions"), ("DELETE", "/v1/models")):
        with pytest.raises(Refusal) as exc:
            route(method, target)
        assert exc.value.status == 405 and exc.value.headers["Allow"] == ROUTES[target]
    for target in ("/v1/completions", "/v1/chat/completions/", "/v1/chat/completions?x=1",
                   "/v1//chat/completions", "/v1/chat%2Fcompletions", "/V1/models",
                   "/v1/embeddings", "/v1/files", "/v1/models/m1", "/props"):
        with pytest.raises(Refusal) as exc:
            route("POST", target)
        assert exc.value.status == 404 and not exc.value.counted


def test_the_fields_forwarded_are_those_hermes_sends():
    # billed more, or account state: never forwarded
    for field in ("n", "service_tier", "store", "metadata", "audio", "modalities", "user",
                  "web_search_options", "prediction", "logit_bias", "extra_body", "functions"):
        assert field not in CHAT_FIELDS, field
    for field in ("model", "messages", "tools", "stream", "stream_options", "max_tokens",
                  "temperature", "reasoning_effort", "think"):
        assert field in CHAT_FIELDS, field


def test_only_offered_models_pass_and_a_stream_always_counts_its_usage():
    policy = Policy(frozenset({"m1"}), 10_000)
    ok = policy.prepare_chat(json.dumps({"model": "m1", "messages": [], "stream": True})
                             .encode(), "application/json; charset=utf-8")
    sent = json.loads(ok.body)
    assert ok.stream and not ok.usage_asked and sent["stream_options"] == {"include_usage": True}
    for model in ("m2", "", None, 1, ["m1"]):
        with pytest.raises(Refusal) as exc:
            policy.prepare_chat(json.dumps({"model": model, "messages": []}).encode(),
                                "application/json")
        assert exc.value.code == "model_not_found"
    with pytest.raises(Refusal) as exc:
        Policy(frozenset(), 10_000).prepare_chat(b'{"model": "m1", "messages": []}',
                                                  "application/json")
    assert exc.value.code == "model_not_found"


def test_no_credential_or_forwarding_header_reaches_the_provider():
    for name in ("authorization", "proxy-authorization", "x-api-key", "api-key", "cookie",
                 "host", "content-length", "transfer-encoding", "x-forwarded-for", "forwarded",
                 "openai-organization", "openai-project", "connection"):
        assert name not in FORWARD_HEADERS, name
        assert forward_headers([(name.title(), "v"), (name, "v")]) == []
    assert {"connection", "proxy-authorization", "transfer-encoding", "te", "upgrade",
            "keep-alive", "trailer", "proxy-authenticate"} <= HOP_BY_HOP
    assert forward_headers([("Accept", "x" * 2000)]) == [("Accept", "x" * 1000)]
    # a folded value cannot smuggle a header line to the provider
    assert forward_headers([("Accept", "a\r\n x-api-key: k\tb")]) == [("Accept", "a x-api-key: k b")]


def test_the_body_cap_is_32_bytes_a_token_within_4_and_64_mib():
    assert max_request_bytes(128_000) == MIN_REQUEST_BYTES == 4 * 1024 * 1024
    assert max_request_bytes(1_000_000) == 32_000_000
    assert max_request_bytes(10**9) == MAX_REQUEST_BYTES == 64 * 1024 * 1024
    assert max_request_bytes(None) == MIN_REQUEST_BYTES
