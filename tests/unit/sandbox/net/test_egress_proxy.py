"""The egress proxy's protocol (hermes_service/sandbox/net/egress_proxy.py) against a real origin server on
loopback; the resolver is the one seam stubbed (the real one refuses loopback, which
tests/unit/sandbox/net/test_egress_policy.py shows)."""
from __future__ import annotations

import asyncio
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from hermes_service.sandbox.net import egress_proxy
from hermes_service.sandbox.net.egress_policy import Policy


class Origin(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    seen: list = []

    def do_GET(self):
        Origin.seen.append((self.requestline, dict(self.headers)))
        body = b"origin says hi"
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *a):
        pass


@pytest.fixture(scope="module")
def origin():
    srv = ThreadingHTTPServer(("127.0.0.1", 0), Origin)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    yield srv.server_address[1]
    srv.shutdown()


def to_loopback(port):
    async def resolver(host, _port):
        if host == "unknown.example":
            return [], "unresolvable"
        if host == "evil.example":
            return [], "denied_address"
        return [(socket.AF_INET, ("127.0.0.1", port))], None
    return resolver


def exchange(policy: Policy, request: bytes, resolver, then: bytes = b"") -> tuple[bytes, object]:
    """Serve one proxy connection on a socketpair; send ``request`` (and ``then`` once the
    proxy answered), return everything the proxy sent back and the outcome."""
    async def main():
        a, b = socket.socketpair()
        reader, writer = await asyncio.open_connection(sock=a, limit=egress_proxy.MAX_HEAD)
        task = asyncio.create_task(egress_proxy.serve(reader, writer, policy, resolver))
        loop = asyncio.get_running_loop()
        b.setblocking(False)
        await loop.sock_sendall(b, request)
        got = b""
        if then:
            got += await loop.sock_recv(b, 65536)
            await loop.sock_sendall(b, then)
        while True:
            try:
                chunk = await asyncio.wait_for(loop.sock_recv(b, 65536), 5)
            except TimeoutError:
                break
            if not chunk:
                break
            got += chunk
            if then and b"origin says hi" in got:
                b.shutdown(socket.SHUT_WR)
        out = await asyncio.wait_for(task, 5)
        writer.close()
        b.close()
        return got, out
    return asyncio.run(main())


ALLOW = Policy.from_lists(["*.example.com", "example.org:8080"], ["blocked.example.com"])


def test_connect_to_an_allowed_name_tunnels_to_the_checked_address(origin):
    got, out = exchange(ALLOW, b"CONNECT api.example.com:443 HTTP/1.1\r\nHost: x\r\n\r\n",
                        to_loopback(origin),
                        then=b"GET /t HTTP/1.1\r\nHost: api.example.com\r\nConnection: close\r\n\r\n")
    assert got.startswith(b"HTTP/1.1 200 Connection established\r\n\r\n"), got
    assert b"origin says hi" in got
    assert out.refused is None and out.host == "api.example.com" and out.port == 443
    assert out.up > 0 and out.down > 0


def test_plain_http_goes_in_origin_form_without_proxy_fields(origin):
    Origin.seen.clear()
    got, out = exchange(ALLOW, b"GET http://example.org:8080/a/b?q=1 HTTP/1.1\r\nHost: evil.cdn.test"
                        b"\r\nProxy-Authorization: Basic eDp5\r\nProxy-Connection: keep-alive\r\n"
                        b"X-Tool: curl\r\n\r\n", to_loopback(origin))
    assert got.startswith(b"HTTP/1.1 200"), got
    line, headers = Origin.seen[-1]
    assert line == "GET /a/b?q=1 HTTP/1.1"
    assert headers.get("X-Tool") == "curl" and headers.get("Connection") == "close"
    assert headers.get("Host") == "example.org:8080"        # the checked name, not the sent one
    assert "Proxy-Authorization" not in headers and "Proxy-Connection" not in headers
    assert out.refused is None


@pytest.mark.parametrize("request_,reason,status", [
    (b"CONNECT other.org:443 HTTP/1.1\r\n\r\n", "not_allowed", b"403"),
    (b"CONNECT blocked.example.com:443 HTTP/1.1\r\n\r\n", "denied", b"403"),
    (b"CONNECT example.org:443 HTTP/1.1\r\n\r\n", "not_allowed", b"403"),     # port not listed
    (b"CONNECT 127.0.0.1:22 HTTP/1.1\r\n\r\n", "ip_literal", b"403"),
    (b"CONNECT [::1]:22 HTTP/1.1\r\n\r\n", "ip_literal", b"403"),
    (b"CONNECT evil.example.com:443 HTTP/1.1\r\n\r\n", "denied_address", b"403"),
    (b"GET https://api.example.com/ HTTP/1.1\r\n\r\n", "bad_request", b"400"),
    (b"GET /relative HTTP/1.1\r\nHost: api.example.com\r\n\r\n", "bad_request", b"400"),
    (b"CONNECT api.example.com HTTP/1.1\r\n\r\n", "bad_request", b"400"),
    (b"BREW coffee\r\n\r\n", "bad_request", b"400"),
    (b"GET http://api.example.com/" + b"a" * 20000 + b" HTTP/1.1\r\n\r\n", "bad_request", b"400"),
])
def test_refusals_carry_a_reason(origin, request_, reason, status):
    def resolver(port):
        async def r(host, p):
            if host.startswith("evil."):
                return [], "denied_address"
            return [(socket.AF_INET, ("127.0.0.1", port))], None
        return r
    got, out = exchange(ALLOW, request_, resolver(origin))
    assert got.startswith(b"HTTP/1.1 " + status), got
    assert f"X-Hermes-Egress-Refused: {reason}".encode() in got
    assert out.refused == reason


def test_an_allowed_name_that_cannot_be_reached_is_502():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()                          # nothing listens there now
    got, out = exchange(ALLOW, b"CONNECT api.example.com:443 HTTP/1.1\r\n\r\n", to_loopback(port))
    assert got.startswith(b"HTTP/1.1 502") and out.refused == "unreachable"


def test_the_real_resolver_refuses_loopback_names():
    policy = Policy.from_lists(["localhost"], [])
    got, out = exchange(policy, b"CONNECT localhost:80 HTTP/1.1\r\n\r\n",
                        egress_proxy.default_resolver)
    assert got.startswith(b"HTTP/1.1 403") and out.refused == "denied_address"
