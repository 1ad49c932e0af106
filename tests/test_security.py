"""Auth matrix (issue #2 item 8): IP allowlist, CIDR, IPv6, trusted proxies, keys."""
from datetime import datetime, timedelta, timezone

import pytest

from conftest import API_KEY

FUTURE = (datetime.now(timezone.utc) + timedelta(days=1)).isoformat()
PAST = (datetime.now(timezone.utc) - timedelta(seconds=1)).isoformat()


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


def test_forwarded_for_reaches_the_guard_through_real_waitress(tmp_path):
    """waitress drops X-Forwarded-* by default; the service must keep it for the Guard."""
    from conftest import ServiceProcess, base_config, deep_merge
    cfg = deep_merge(base_config(tmp_path), {
        "security": {"allowed_ips": ["203.0.113.0/24"]},
        "nginx": {"trusted_proxies": ["127.0.0.1"], "enable_real_ip": True}})
    svc = ServiceProcess(tmp_path, cfg).start()
    try:
        ok = svc.get("/api/v1/sessions?user_id=u", headers={"X-Forwarded-For": "203.0.113.5"})
        assert ok.status_code == 200, ok.text
        assert svc.get("/api/v1/sessions?user_id=u").status_code == 403      # the proxy itself
        spoofed = svc.get("/api/v1/sessions?user_id=u",
                          headers={"X-Forwarded-For": "203.0.113.5, 198.51.100.7"})
        assert spoofed.status_code == 403     # rightmost untrusted hop is the real client
    finally:
        svc.stop()


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
