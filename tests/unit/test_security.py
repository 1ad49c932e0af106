"""Auth matrix (docs/configuring.md): IP allowlist, CIDR, IPv6, trusted proxies, keys."""
from datetime import UTC, datetime, timedelta

import pytest

from support.fixtures import API_KEY

FUTURE = (datetime.now(UTC) + timedelta(days=1)).isoformat()
PAST = (datetime.now(UTC) - timedelta(seconds=1)).isoformat()


def call(app, path="/api/v1/sessions?user_id=u1", ip="127.0.0.1", headers=None):
    headers = {"X-API-Key": API_KEY} if headers is None else headers
    return app.test_client().get(path, headers=headers,
                                 environ_base={"REMOTE_ADDR": ip})


@pytest.fixture
def app(app_factory):
    return app_factory({"security": {"allowed_ips": ["127.0.0.1", "10.20.0.0/16", "2001:db8::/32"],
                                     "api_keys": [{"key": API_KEY},
                                                  {"key": "expired-key-0123456789", "expires_at": PAST},
                                                  {"key": "future-key-0123456789", "expires_at": FUTURE}]},
                        "nginx": {"trusted_proxies": ["127.0.0.1", "10.99.0.0/24"],
                                  "enable_real_ip": True}})


@pytest.mark.parametrize("ip, status", [
    ("127.0.0.1", 200), ("10.20.3.4", 200), ("10.21.0.1", 403), ("192.0.2.1", 403),
    ("2001:db8::1", 200), ("2001:db9::1", 403), ("::ffff:127.0.0.1", 200),
])
def test_ip_allowlist_single_cidr_ipv6(app, ip, status):
    res = call(app, ip=ip)
    assert res.status_code == status
    if status == 403:
        assert res.json["code"] == "ip_not_allowed"


@pytest.mark.parametrize("headers, code", [
    ({}, "missing_api_key"),
    ({"X-API-Key": "wrong-key-0123456789"}, "invalid_api_key"),
    ({"X-API-Key": "expired-key-0123456789"}, "api_key_expired"),
    ({"Authorization": f"Bearer {API_KEY}"}, "missing_api_key"),   # header mode ignores bearer
])
def test_key_failures_are_401_with_stable_codes(app, headers, code):
    res = call(app, headers=headers)
    assert res.status_code == 401 and res.json["code"] == code
    assert res.json["requestId"] == res.headers["X-Request-Id"]


def test_future_expiry_key_is_accepted(app):
    assert call(app, headers={"X-API-Key": "future-key-0123456789"}).status_code == 200


def test_bearer_mode(app_factory):
    app = app_factory({"security": {"auth_method": "bearer"}})
    assert call(app, headers={"Authorization": f"Bearer {API_KEY}"}).status_code == 200
    res = call(app, headers={"X-API-Key": API_KEY})
    assert res.status_code == 401 and res.headers["WWW-Authenticate"].startswith("Bearer")
    assert call(app, headers={"Authorization": "Basic abc"}).status_code == 401


def test_custom_header_name(app_factory):
    app = app_factory({"security": {"api_key_header": "X-Service-Token"}})
    assert call(app, headers={"X-Service-Token": API_KEY}).status_code == 200
    assert call(app, headers={"X-API-Key": API_KEY}).status_code == 401


def test_blocked_ip_is_403_even_with_a_valid_key_and_before_key_check(app):
    res = call(app, ip="192.0.2.1", headers={})
    assert res.status_code == 403   # IP first: a blocked client learns nothing about keys


def test_spoofed_forwarded_for_from_untrusted_peer_is_ignored(app):
    # peer 10.20.1.1 is allowed but not a trusted proxy: its XFF claim is ignored
    res = call(app, ip="10.20.1.1", headers={"X-API-Key": API_KEY, "X-Forwarded-For": "192.0.2.1"})
    assert res.status_code == 200
    # a blocked peer cannot get in by claiming an allowed address
    res = call(app, ip="192.0.2.9", headers={"X-API-Key": API_KEY, "X-Forwarded-For": "127.0.0.1"})
    assert res.status_code == 403


def test_forwarded_for_from_trusted_proxy_uses_rightmost_untrusted_hop(app):
    h = {"X-API-Key": API_KEY}
    # client forged "127.0.0.1" on the left; the real client (192.0.2.5) is rightmost untrusted
    res = call(app, ip="10.99.0.2", headers={**h, "X-Forwarded-For": "127.0.0.1, 192.0.2.5, 10.99.0.3"})
    assert res.status_code == 403
    res = call(app, ip="10.99.0.2", headers={**h, "X-Forwarded-For": "192.0.2.5, 10.20.7.7"})
    assert res.status_code == 200
    res = call(app, ip="10.99.0.2", headers={**h, "X-Forwarded-For": "garbage"})
    assert res.status_code == 403


def test_forwarded_for_ignored_when_real_ip_disabled(app_factory):
    app = app_factory({"nginx": {"trusted_proxies": ["127.0.0.1"], "enable_real_ip": False}})
    res = call(app, headers={"X-API-Key": API_KEY, "X-Forwarded-For": "192.0.2.5"})
    assert res.status_code == 200


def test_health_exempt_from_key_but_not_ip(app):
    assert call(app, "/health", headers={}).status_code == 200
    assert call(app, "/health", ip="192.0.2.1", headers={}).status_code == 403


def test_health_can_require_a_key(app_factory):
    app = app_factory({"security": {"health_requires_api_key": True}})
    assert call(app, "/health", headers={}).status_code == 401


def test_checks_can_be_disabled(app_factory):
    app = app_factory({"security": {"enable_ip_check": False, "enable_api_key": False}})
    assert call(app, ip="192.0.2.1", headers={}).status_code == 200


def test_request_id_is_echoed_or_generated(app):
    res = call(app, headers={"X-API-Key": API_KEY, "X-Request-Id": "abc-123"})
    assert res.headers["X-Request-Id"] == "abc-123"
    res = call(app, headers={"X-API-Key": API_KEY, "X-Request-Id": "bad id;<script>"})
    assert res.headers["X-Request-Id"].startswith("req_")


def test_options_requests_are_ip_checked_too(app):
    res = app.test_client().options("/api/v1/sessions", environ_base={"REMOTE_ADDR": "192.0.2.1"})
    assert res.status_code == 403


@pytest.mark.parametrize("method, path, body", [
    ("post", "/api/v1/sessions", {"user_id": "bob"}),
    ("get", "/api/v1/sessions?user_id=bob", None),
    ("post", "/api/v1/execute", {"command": ["version"], "user_context": {"user_id": "bob"}}),
    ("post", "/api/v1/sessions/any-session/messages",
     {"message": "x", "user_context": {"user_id": "bob"}}),
])
def test_key_bound_to_an_actor_cannot_act_for_another_user_on_v1(app_factory, method, path, body):
    app = app_factory({"security": {"api_keys": [{"key": API_KEY, "actor_id": "alice",
                                                  "scopes": ["v1", "execute"]}]}})
    c = app.test_client()
    res = getattr(c, method)(path, json=body, headers={"X-API-Key": API_KEY})
    assert res.status_code == 403 and res.json["code"] == "actor_mismatch"


def test_key_bound_to_an_actor_sees_only_its_own_sessions(app_factory):
    app = app_factory({"security": {"api_keys": [{"key": API_KEY, "actor_id": "alice"},
                                                 {"key": "admin-key-0123456789"}]}})
    c = app.test_client()
    bob = c.post("/api/v1/sessions", json={"user_id": "bob"},
                 headers={"X-API-Key": "admin-key-0123456789"}).json["session_id"]
    h = {"X-API-Key": API_KEY}
    assert c.get(f"/api/v1/sessions/{bob}", headers=h).status_code == 404
    assert c.delete(f"/api/v1/sessions/{bob}", headers=h).status_code == 404
    assert c.post(f"/api/v1/sessions/{bob}/messages", json={"message": "x"}, headers=h).status_code == 404
    mine = c.post("/api/v1/sessions", json={"user_id": "alice"}, headers=h)
    assert mine.status_code == 200
    assert c.get(f"/api/v1/sessions/{mine.json['session_id']}", headers=h).status_code == 200


def test_access_log_cannot_be_forged_through_the_path(app, caplog):
    caplog.set_level("INFO", logger="hermes_service.access")
    call(app, "/api/v1/sessions/x%0a2026 INFO hermes_service.access rid=FAKE")
    lines = [r.getMessage() for r in caplog.records if r.name == "hermes_service.access"]
    assert lines and all("\n" not in line for line in lines)


# -- sharper cases (docs/testing.md §Mutation testing: each kills mutants that survived) ------
@pytest.fixture
def same_host_nginx(app_factory):
    """docs/configuring.md §IP rules behind nginx recommends: nginx on this host, so the proxy address is both
    trusted and allowed. Only here does rightmost-vs-rightmost-untrusted decide anything."""
    return app_factory({"security": {"allowed_ips": ["127.0.0.1", "10.20.0.0/16"]},
                        "nginx": {"trusted_proxies": ["127.0.0.1", "10.99.0.0/24"],
                                  "enable_real_ip": True}})


@pytest.mark.parametrize("xff, status", [
    ("192.0.2.5, 127.0.0.1", 403),              # the client is 192.0.2.5, not the proxy hop
    ("192.0.2.5, 10.99.0.7, 127.0.0.1", 403),   # two trusted hops are skipped
    ("10.20.7.7, 127.0.0.1", 200),              # an allowed client behind two proxies
    ("10.20.7.7,127.0.0.1", 200),               # comma without a space
    ("10.20.7.7, 10.99.0.7", 200),
    ("127.0.0.1, 192.0.2.5", 403),              # a forged allowed address on the left
    ("garbage", 403),                           # a garbled chain is not the (allowed) proxy
    ("10.20.7.7, garbage, 127.0.0.1", 403),
    ("127.0.0.1, 10.99.0.7", 200),              # only trusted hops: the peer itself
])
def test_forwarded_for_behind_an_allowed_trusted_proxy(same_host_nginx, xff, status):
    res = call(same_host_nginx, headers={"X-API-Key": API_KEY, "X-Forwarded-For": xff})
    assert res.status_code == status, res.json
    if status == 403:
        assert res.json["code"] == "ip_not_allowed"


def guard(make_config, **security):
    from hermes_service.security import Guard
    cfg = make_config({"security": security,
                       "nginx": {"trusted_proxies": ["127.0.0.1"], "enable_real_ip": True}})
    return Guard(cfg.security, cfg.nginx)


def test_client_address_text(make_config):
    g = guard(make_config, allowed_ips=["fe80::1", "127.0.0.1"])
    assert g.client_ip("fe80::1%eth0", None) == "fe80::1"          # the scope id is dropped
    assert g.client_ip("127.0.0.1%lo", None) == "127.0.0.1"
    assert g.client_ip("::FFFF:127.0.0.1", None) == "::ffff:7f00:1"   # normalized text
    assert g.client_ip("not-an-address", None) == "not-an-address"     # kept for the log ...
    with pytest.raises(Exception) as exc:
        g.check_ip(g.client_ip("not-an-address", None))                # ... and never allowed
    assert exc.value.code == "ip_not_allowed"
    assert "not-an-address" in exc.value.detail
    g.check_ip(g.client_ip("fe80::1%eth0", None))
    g.check_ip("::ffff:127.0.0.1")                     # an IPv4-mapped peer is its IPv4 address
    assert g.client_ip("127.0.0.1", "192.0.2.5, 127.0.0.1") == "192.0.2.5"
    assert g.client_ip("127.0.0.1", "127.0.0.1") == "127.0.0.1"       # only trusted hops


def test_key_expires_at_its_instant(make_config):
    from hermes_service.errors import Unauthorized
    at = datetime(2030, 1, 1, tzinfo=UTC)
    g = guard(make_config, api_keys=[{"key": API_KEY, "expires_at": at.isoformat()}])
    assert g.check_key({"X-API-Key": API_KEY}, now=at - timedelta(microseconds=1)) is not None
    for now in (at, at + timedelta(seconds=1)):
        with pytest.raises(Unauthorized) as exc:
            g.check_key({"X-API-Key": API_KEY}, now=now)
        assert exc.value.code == "api_key_expired"


@pytest.mark.parametrize("auth", [f"Basic {API_KEY}", f"Token {API_KEY}", f"{API_KEY}",
                                  f"Bearer{API_KEY}", "Bearer ", "Bearer"])
def test_bearer_mode_accepts_only_the_bearer_scheme(app_factory, auth):
    app = app_factory({"security": {"auth_method": "bearer"}})
    res = call(app, headers={"Authorization": auth})
    assert res.status_code == 401 and res.json["code"] == "missing_api_key"
    assert res.headers["WWW-Authenticate"] == 'Bearer realm="hermes-service"'
    assert res.json["detail"] == "an API key is required (Authorization: Bearer <key>)"


@pytest.mark.parametrize("auth", [f"Bearer {API_KEY}", f"bearer {API_KEY}", f"Bearer  {API_KEY} ",
                                  f"BEARER\t{API_KEY}".replace("\t", " ")])
def test_bearer_scheme_is_case_insensitive_and_may_be_followed_by_several_spaces(app_factory, auth):
    app = app_factory({"security": {"auth_method": "bearer"}})
    assert call(app, headers={"Authorization": auth}).status_code == 200


def test_every_bearer_refusal_carries_the_challenge(app_factory):
    app = app_factory({"security": {"auth_method": "bearer", "api_keys": [
        {"key": API_KEY}, {"key": "expired-key-0123456789", "expires_at": PAST}]}})
    for auth, code, detail in (("Bearer wrong-key-0123456789", "invalid_api_key", "invalid API key"),
                               ("Bearer expired-key-0123456789", "api_key_expired",
                                "API key expired")):
        res = call(app, headers={"Authorization": auth})
        assert (res.status_code, res.json["code"], res.json["detail"]) == (401, code, detail)
        assert res.headers["WWW-Authenticate"] == 'Bearer realm="hermes-service"'


def test_header_mode_refusals_carry_no_bearer_challenge_and_name_the_header(app):
    for headers, code, detail in (({}, "missing_api_key", "an API key is required (X-API-Key: <key>)"),
                                  ({"X-API-Key": "wrong-key-0123456789"}, "invalid_api_key",
                                   "invalid API key"),
                                  ({"X-API-Key": "expired-key-0123456789"}, "api_key_expired",
                                   "API key expired")):
        res = call(app, headers=headers)
        assert (res.status_code, res.json["code"], res.json["detail"]) == (401, code, detail)
        assert "WWW-Authenticate" not in res.headers


def test_refused_address_is_named_in_the_detail(app):
    res = call(app, ip="192.0.2.1")
    assert res.json["detail"] == "client address 192.0.2.1 is not allowed"


def test_key_bound_to_an_actor_cannot_post_into_another_users_session_via_user_context(
        stubbed_app, stub):
    """user_context.user_id names the session's owner: a key bound to alice may not use it to
    reach bob's session (403 actor_mismatch, the one actor-binding rule); no turn runs."""
    app = stubbed_app({"security": {"api_keys": [{"key": API_KEY, "actor_id": "alice"},
                                                 {"key": "admin-key-0123456789"}]}})
    c, h = app.test_client(), {"X-API-Key": API_KEY}
    bob = c.post("/api/v1/sessions", json={"user_id": "bob"},
                 headers={"X-API-Key": "admin-key-0123456789"}).json["session_id"]
    res = c.post(f"/api/v1/sessions/{bob}/messages",
                 json={"message": "x", "user_context": {"user_id": "bob"}}, headers=h)
    assert res.status_code == 403 and res.json["code"] == "actor_mismatch"
    assert stub.calls == [] and app.extensions["hermes_service"].store.get(bob)["message_count"] == 0
    # alice's own session, with or without her own user_context, runs the turn
    mine = c.post("/api/v1/sessions", json={"user_id": "alice"}, headers=h).json["session_id"]
    for ctx in ({"user_context": {"user_id": "alice"}}, {}):
        res = c.post(f"/api/v1/sessions/{mine}/messages", json={"message": "hi", **ctx}, headers=h)
        assert res.status_code == 200, res.json
    assert len(stub.calls) == 2
