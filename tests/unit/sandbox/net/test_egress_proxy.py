"""The egress proxy's protocol (hermes_service/sandbox/net/egress_proxy.py) against a real origin server on
loopback; the resolver is the one seam stubbed (the real one refuses loopback, which
tests/unit/sandbox/net/test_egress_policy.py shows)."""
from __future__ import annotations

import asyncio
import functools
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from hermes_service.sandbox.net import egress_policy, egress_proxy
from hermes_service.sandbox.net.egress_policy import Policy
from hermes_service.sandbox.net.lookups import Lookups
from support.fixtures import wait_for


class Origin(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    seen: list = []

    def do_GET(self):
        Origin.seen.append((self.requestline, dict(self.headers), self.headers.items()))
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
        a.setblocking(False)
        task = asyncio.create_task(egress_proxy.serve(a, policy, resolver))
        task.add_done_callback(lambda _: a.close())
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
    got, out = exchange(ALLOW, b"GET http://example.org:8080/a/b?q=1 HTTP/1.1\r\nHost: Example.ORG."
                        b":8080\r\nProxy-Authorization: Basic eDp5\r\nProxy-Connection: keep-alive"
                        b"\r\nX-Tool: curl\r\n\r\n", to_loopback(origin))
    assert got.startswith(b"HTTP/1.1 200"), got
    line, headers, items = Origin.seen[-1]
    assert [v for k, v in items if k.lower() == "host"] == ["example.org:8080"]
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
    lookups = Lookups(2, 10.0)
    got, out = exchange(policy, b"CONNECT localhost:80 HTTP/1.1\r\n\r\n",
                        functools.partial(lookups.resolve, egress_policy.resolve))
    lookups.close()
    assert got.startswith(b"HTTP/1.1 403") and out.refused == "denied_address"


@pytest.mark.parametrize("host", [b"api.example.com", b"API.Example.com.", b"api.example.com:80"])
def test_the_origin_gets_only_the_checked_name_as_host(origin, host):
    """Fronting: whatever ``Host`` the tool sends that agrees with the URI, the origin sees one
    ``Host``, the name the proxy checked, in the form the proxy writes."""
    Origin.seen.clear()
    got, _ = exchange(ALLOW, b"GET http://api.example.com/x HTTP/1.1\r\nHost: " + host +
                      b"\r\n\r\n", to_loopback(origin))
    assert got.startswith(b"HTTP/1.1 200"), got
    _, _, items = Origin.seen[-1]
    assert [v for k, v in items if k.lower() == "host"] == ["api.example.com"]


@pytest.mark.parametrize("fields,reason", [
    (b"Host: blocked.example.com\r\n", "host_mismatch"),      # another (allowed-looking) name
    (b"Host: evil.cdn.test\r\n", "host_mismatch"),
    (b"Host: api.example.com:8080\r\n", "host_mismatch"),     # another port
    (b"Host: api.example.com\r\nHost: evil.cdn.test\r\n", "bad_request"),   # two of them
    (b"Host: api.example.com\r\nTransfer-Encoding: chunked\r\n", "length_required"),
])
def test_a_host_that_disagrees_with_the_uri_is_refused(origin, fields, reason):
    Origin.seen.clear()
    got, out = exchange(ALLOW, b"GET http://api.example.com/ HTTP/1.1\r\n" + fields + b"\r\n",
                        to_loopback(origin))
    assert out.refused == reason and f"X-Hermes-Egress-Refused: {reason}".encode() in got
    assert Origin.seen == []


@pytest.mark.parametrize("target", [b"http://api.example.com@evil.test/",
                                    b"http://evil.test#@api.example.com/",
                                    b"http://[api.example.com]/", b"http://::1:80/"])
def test_an_authority_that_could_name_two_hosts_is_refused(origin, target):
    got, out = exchange(ALLOW, b"GET " + target + b" HTTP/1.1\r\n\r\n", to_loopback(origin))
    assert out.refused in ("bad_request", "ip_literal"), out


class RawOrigin:
    """A TCP origin that reads a request head and ``body`` bytes, then answers and keeps
    reading until the proxy closes; records every byte it received (``got_head`` is set once
    the head is in)."""

    def __init__(self, body: int):
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.body = body
        self.got_head = threading.Event()
        self.received: list[bytes] = []
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self):
        conn, _ = self.sock.accept()
        data = b""
        while b"\r\n\r\n" not in data:
            data += conn.recv(65536)
        self.got_head.set()
        while len(data) - data.index(b"\r\n\r\n") - 4 < self.body:
            data += conn.recv(65536)
        conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nConnection: close\r\n\r\nok")
        conn.shutdown(socket.SHUT_WR)
        while chunk := conn.recv(65536):
            data += chunk
        conn.close()
        self.received.append(data)


def test_nothing_after_the_body_reaches_the_origin():
    """A second request pipelined behind the first (with another ``Host``) never reaches the
    origin: only the first request's head and its ``Content-Length`` bytes go up — also when
    the body and the second request come after the proxy has started relaying."""
    raw = RawOrigin(body=4)
    second = b"GET /second HTTP/1.1\r\nHost: evil.cdn.test\r\n\r\n"

    async def main():
        loop = asyncio.get_running_loop()
        a, b = socket.socketpair()
        a.setblocking(False)
        b.setblocking(False)
        task = asyncio.create_task(egress_proxy.serve(a, ALLOW, to_loopback(raw.port)))
        await loop.sock_sendall(b, b"POST http://api.example.com/first HTTP/1.1\r\nHost: "
                                   b"api.example.com\r\nContent-Length: 4\r\n\r\n")
        await loop.run_in_executor(None, raw.got_head.wait, 10)
        await loop.sock_sendall(b, b"body" + second)
        got = b""
        while chunk := await asyncio.wait_for(loop.sock_recv(b, 65536), 10):
            got += chunk
        out = await asyncio.wait_for(task, 10)
        a.close()
        b.close()
        return got, out
    got, out = asyncio.run(main())
    assert got.startswith(b"HTTP/1.1 200"), got
    wait_for(lambda: raw.received, "the origin's record")
    assert raw.received[0] == (b"POST /first HTTP/1.1\r\nHost: api.example.com\r\n"
                               b"Content-Length: 4\r\nConnection: close\r\n\r\nbody")
    assert out.up == len(raw.received[0])
    raw.sock.close()
