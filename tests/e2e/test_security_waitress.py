"""The Guard behind real waitress (the rest of the Guard: tests/unit/test_security.py)."""


def test_forwarded_for_reaches_the_guard_through_real_waitress(tmp_path):
    """waitress drops X-Forwarded-* by default; the service must keep it for the Guard."""
    from support.fixtures import ServiceProcess, base_config, deep_merge
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
