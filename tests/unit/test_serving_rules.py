"""What waitress is told (hermes_service/lifecycle.py ``waitress_options``; docs/configuring.md
§Limits), and one real waitress on a free port serving with those options: it passes
``X-Forwarded-For`` to the app (the IP allowlist judges it, security.Guard with
``nginx.trusted_proxies``; a waitress that cleared it would make every client behind the
proxy the proxy), takes a body of exactly ``service.max_body_bytes`` and refuses one byte
more. The counting limit of slots and admission (limits.py) has its own tests in
test_limits.py; its edges are here too."""
from __future__ import annotations

import http.client
import threading

import pytest
from waitress.server import create_server

from hermes_service.installed import build_config
from hermes_service.lifecycle import waitress_options
from hermes_service.limits import Limiter
from support.fixtures import base_config, deep_merge


def config(tmp_path, **service):
    return build_config(deep_merge(base_config(tmp_path), {"service": service}))


def test_the_options_follow_the_service_section(tmp_path):
    cfg = config(tmp_path, threads=27, connection_limit=199, idle_timeout_seconds=40,
                 max_body_bytes=5000)
    assert waitress_options(cfg) == {
        "threads": 27, "connection_limit": 199, "channel_timeout": 40, "cleanup_interval": 10,
        "max_request_body_size": 5001, "channel_request_lookahead": 1,
        "asyncore_use_poll": True, "ident": "hermes-service",
        "clear_untrusted_proxy_headers": False}
    assert waitress_options(cfg, threads=3)["threads"] == 3


@pytest.fixture
def served(tmp_path):
    """A real waitress with the service's options, answering the X-Forwarded-For it got and
    the body's length."""
    def app(environ, start_response):
        body = environ["wsgi.input"].read()
        text = f"{environ.get('HTTP_X_FORWARDED_FOR', '-')} {len(body)}".encode()
        start_response("200 OK", [("Content-Type", "text/plain"),
                                  ("Content-Length", str(len(text)))])
        return [text]
    opts = waitress_options(config(tmp_path, max_body_bytes=1000))
    srv = create_server(app, host="127.0.0.1", port=0, **opts)
    t = threading.Thread(target=srv.run, daemon=True)
    t.start()
    yield srv.effective_port
    srv.close()
    t.join(5)


def post(port, body: bytes, headers=None) -> tuple[int, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        conn.request("POST", "/", body=body, headers=headers or {})
        resp = conn.getresponse()
        return resp.status, resp.read()
    finally:
        conn.close()


def test_waitress_passes_x_forwarded_for_and_caps_the_body_to_the_byte(served):
    assert post(served, b"", {"X-Forwarded-For": "203.0.113.9, 10.0.0.1"}) == \
        (200, b"203.0.113.9, 10.0.0.1 0")
    assert post(served, b"x" * 1000) == (200, b"- 1000")
    assert post(served, b"x" * 1001)[0] == 413


def test_a_limiter_holds_exactly_its_size_and_wakes_a_waiter():
    lim = Limiter(2)
    assert lim.acquire(False) and lim.acquire(False) and not lim.acquire(False)
    assert not lim.acquire(True, timeout=0)
    got = threading.Event()
    waiter = threading.Thread(target=lambda: lim.acquire(True, 10) and got.set())
    waiter.start()
    lim.release()
    assert got.wait(10)
    waiter.join(10)
    lim.release()
    lim.release()
    with pytest.raises(ValueError):
        lim.release()
    assert lim.held == 0
