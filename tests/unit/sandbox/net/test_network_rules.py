"""A sandbox's way out, rule by rule at the public seams (sandbox/net/egress_policy.py, sandbox/net/egress_proxy.py,
sandbox/net/service_gate.py; docs/sandbox.md §Network): a name whose answers include one the policy
cannot read is refused whole; a wildcard never matches an IP literal; a route that does not
end in ``/`` is that path only; the pace's bucket holds at most its burst after a quiet while;
the egress proxy dials the address it checked, never the name again. The resolver is the
stubbed seam (``socket.getaddrinfo``; the proxy's ``resolver``)."""
from __future__ import annotations

import asyncio
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from hermes_service.sandbox.net import egress_policy, egress_proxy, service_gate
from hermes_service.sandbox.net.egress_policy import Policy


def test_one_answer_that_is_no_address_taints_the_name(monkeypatch):
    def getaddrinfo(host, port, type=0):      # socket's own signature
        return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", ("93.184.216.34", port)),
                (socket.AF_INET6, socket.SOCK_STREAM, 6, "", ("not-an-address", port, 0, 0))]
    monkeypatch.setattr(socket, "getaddrinfo", getaddrinfo)
    assert egress_policy.resolve("example.com", 443, own=frozenset()) == ([], "denied_address")


def test_a_wildcard_never_matches_an_ip_literal():
    policy = Policy.from_lists(["*.0.1"], [])
    assert policy.decide("a.0.1", 443) is None
    assert policy.decide("10.0.0.1", 443) == "ip_literal"


def test_a_route_not_ending_in_a_slash_is_that_path_only():
    prefixes = ["/api/hermes/tools/invoke", "/api/hermes/client/"]
    assert service_gate.allowed_path("/api/hermes/tools/invoke?x=1", prefixes)
    assert service_gate.allowed_path("/api/hermes/client/runs/r1", prefixes)
    for path in ("/api/hermes/tools/invoke2", "/api/hermes/tools/invoke/x",
                 "/api/hermes/tools/invokeX?y"):
        assert not service_gate.allowed_path(path, prefixes), path


def test_the_pace_holds_at_most_its_burst_after_a_quiet_while():
    pace = service_gate.Pace(rate=100.0, burst=3)
    pace.at -= 60                              # a minute without requests
    asyncio.run(pace.take())
    assert pace.tokens <= 2


class Origin(BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200)
        self.send_header("Content-Length", "2")
        self.end_headers()
        self.wfile.write(b"ok")

    def log_message(self, *a):
        pass


@pytest.fixture
def origin_on_127_0_0_2():
    srv = ThreadingHTTPServer(("127.0.0.2", 0), Origin)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    yield srv.server_address[1]
    srv.shutdown()
    srv.server_close()


def test_the_proxy_dials_the_address_it_checked(origin_on_127_0_0_2):
    port = origin_on_127_0_0_2

    async def resolver(host, _port):
        return [(socket.AF_INET, ("127.0.0.2", port))], None

    async def main():
        a, b = socket.socketpair()
        a.setblocking(False)
        task = asyncio.create_task(egress_proxy.serve(
            a, Policy.from_lists(["api.example.com"], []), resolver))
        task.add_done_callback(lambda _: a.close())
        loop = asyncio.get_running_loop()
        b.setblocking(False)
        await loop.sock_sendall(b, b"GET http://api.example.com/ HTTP/1.1\r\n"
                                   b"Host: api.example.com\r\nConnection: close\r\n\r\n")
        got = b""
        while chunk := await asyncio.wait_for(loop.sock_recv(b, 65536), 10):
            got += chunk
        out = await asyncio.wait_for(task, 10)
        b.close()
        return got, out
    got, out = asyncio.run(main())
    assert got.startswith(b"HTTP/1.0 200") or got.startswith(b"HTTP/1.1 200"), got
    assert got.endswith(b"ok") and out.refused is None


@pytest.mark.parametrize("v6, v4", [
    ("::ffff:10.0.0.1", "10.0.0.1"),             # IPv4-mapped
    ("::10.0.0.2", "10.0.0.2"),                  # IPv4-compatible
    ("64:ff9b::a00:3", "10.0.0.3"),              # NAT64
    ("2002:a00:4::1", "10.0.0.4"),               # 6to4
    ("2001:0:4136:e378:8000:63bf:f5ff:fffa", "10.0.0.5"),   # Teredo (client, obfuscated)
])
def test_the_ipv4_address_an_ipv6_address_carries_is_read(v6, v4):
    import ipaddress
    assert egress_policy.embedded_ipv4(ipaddress.ip_address(v6)) == ipaddress.ip_address(v4)
    assert egress_policy.embedded_ipv4(ipaddress.ip_address("2606:4700::1111")) is None
