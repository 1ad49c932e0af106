"""deploy/nginx/rolling.conf forwards requests as docs/operations.md §Deployment → Rolling restart says:
what reaches the service processes, and how often. Real nginx on loopback; the two upstreams
are recording HTTP servers at the service's public seam (its HTTP port), because what is
checked is the exact request line nginx sends and how many times — which a service process
does not report (waitress decodes the path before Flask sees it). The rolling restart itself,
with real services and the real CLI: test_e2e_rolling.py.
"""
from __future__ import annotations

import http.client
import http.server
import socketserver
import threading

import pytest

from support.nginx_harness import DEPLOY, Nginx, free_port, render, require_nginx

pytestmark = pytest.mark.e2e


class _Recorder(http.server.BaseHTTPRequestHandler):
    """Records ``(port, method, request target)``; a target holding ``refuse`` is answered
    503 with ``Retry-After`` (a draining service), anything else 200."""
    protocol_version = "HTTP/1.1"

    def _any(self):
        self.rfile.read(int(self.headers.get("Content-Length") or 0))
        self.server.seen.append((self.server.server_address[1], self.command, self.path))
        body = b'{"ok": true}'
        self.send_response(503 if "refuse" in self.path else 200)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Retry-After", "5")
        self.end_headers()
        self.wfile.write(body)

    do_GET = do_POST = do_DELETE = _any

    def log_message(self, *_args):
        pass


@pytest.fixture
def rolling(tmp_path):
    """rolling.conf in front of two recorders; yields ``(send, seen)``: ``send(method,
    target, key=None)`` sends ``target`` byte for byte and returns the status; ``seen`` is the
    list both recorders append to."""
    require_nginx()
    seen, servers = [], []
    for _ in range(2):
        srv = socketserver.ThreadingTCPServer(("127.0.0.1", 0), _Recorder)
        srv.daemon_threads, srv.seen = True, seen
        threading.Thread(target=srv.serve_forever, daemon=True).start()
        servers.append(srv)
    port = free_port()
    site = render(DEPLOY / "nginx" / "rolling.conf", {
        "127.0.0.1:9123": f"127.0.0.1:{servers[0].server_address[1]}",
        "127.0.0.1:9124": f"127.0.0.1:{servers[1].server_address[1]}",
        "listen 80;": f"listen 127.0.0.1:{port};",
        "/var/log/nginx/": f"{tmp_path}/nginx/logs/"})
    nginx = Nginx(tmp_path / "nginx", site).start(port)

    def send(method: str, target: str, key: str | None = None) -> int:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
        try:
            conn.putrequest(method, target, skip_accept_encoding=True)
            conn.putheader("Content-Length", "2")
            if key:
                conn.putheader("Idempotency-Key", key)
            conn.endheaders(b"{}")
            res = conn.getresponse()
            res.read()
            return res.status
        finally:
            conn.close()
    try:
        yield send, seen
    finally:
        nginx.stop()
        for srv in servers:
            srv.shutdown()
            srv.server_close()


@pytest.mark.parametrize("target", [
    "/api/v1/sessions/a%2Fb/messages?x=%20y&z=a%26b&k=1%2B2",
    "/api/v1/s/%E4%BD%A0%20x//y/../q?",
    "/api/hermes/client/runs/a%3Fb%25c%23d",
])
def test_a_keyed_request_reaches_the_service_exactly_as_sent(rolling, target):
    """The internal /_hermes_keyed/ hop changes nothing: path still percent-encoded, slashes
    and dot segments as sent, query included — the same request line an unkeyed one gets."""
    send, seen = rolling
    for key in (None, "key-1"):
        seen.clear()
        assert send("POST", target, key) == 200
        assert [s[1:] for s in seen] == [("POST", target)], key


def test_the_internal_keyed_location_is_not_reachable_from_outside(rolling):
    send, seen = rolling
    for key in (None, "key-2"):
        assert send("POST", "/_hermes_keyed/api/v1/sessions", key) == 404
        assert send("GET", "/_hermes_keyed/health", key) == 404
    assert seen == []


def test_an_unkeyed_post_is_sent_once_a_keyed_one_may_go_to_the_other_process(rolling):
    """A service answering 503 (draining) to an unkeyed POST: nginx passes the 503 on and
    never sends the POST to the other process (it may have run there already); with an
    Idempotency-Key it tries the other one (the service answers a repeated key once)."""
    send, seen = rolling
    assert send("POST", "/api/v1/sessions/refuse/messages", "key-3") == 503
    assert len(seen) == 2 and seen[0][0] != seen[1][0], seen     # both processes, once each
    seen.clear()
    assert send("POST", "/api/v1/sessions/refuse/messages") == 503
    assert len(seen) == 1, seen
