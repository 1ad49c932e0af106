"""What a sandbox may ask of this service through its socket (hermes_service/sandbox/net/service_gate.py):
run-token routes only, one request per connection, exactly its body, paced — against a real
loopback server that records what reached it."""
from __future__ import annotations

import asyncio
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from hermes_service.sandbox.net import service_gate
from hermes_service.sandbox.net.service_gate import Pace, allowed_path

PREFIXES = ("/api/hermes/tools/",)


@pytest.mark.parametrize("path,ok", [
    ("/api/hermes/tools/invoke", True), ("/api/hermes/tools", True),
    ("/api/hermes/tools/invoke?x=1", True), ("/api/v1/sessions", False), ("/metrics", False),
    ("/health", False), ("/api/hermes/toolsX", False), ("/api/hermes/tools/../../v1/x", False),
    ("/api/hermes/tools/%2e%2e/v1", False), ("/api/hermes/tools/a%2fb", False),
    ("http://127.0.0.1/api/hermes/tools/invoke", False), ("*", False),
])
def test_only_the_run_token_routes_are_allowed(path, ok):
    assert allowed_path(path, PREFIXES) is ok


@pytest.mark.parametrize("head,reason", [
    (b"GET /metrics HTTP/1.1\r\n\r\n", "not_a_sandbox_route"),
    (b"POST /api/hermes/tools/invoke HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n",
     "length_required"),
    (b"POST /api/hermes/tools/invoke HTTP/1.1\r\nContent-Length: 1\r\nContent-Length: 2\r\n\r\n",
     "bad_request"),
    (b"POST /api/hermes/tools/invoke HTTP/1.1\r\nContent-Length : 5\r\n\r\n", "bad_request"),
    (b"POST /api/hermes/tools/invoke HTTP/1.1\r\nX: a\r\n folded\r\n\r\n", "bad_request"),
    (b"POST /api/hermes/tools/invoke HTTP/1.1\r\nContent-Length: -1\r\n\r\n", "bad_request"),
    (b"POST /api/hermes/tools/invoke\r\n\r\n", "bad_request"),
])
def test_refused_heads_name_their_reason(head, reason):
    assert service_gate.parse(head, PREFIXES)[1] == reason


def test_an_allowed_head_goes_with_connection_close_and_without_hop_fields():
    head, length = service_gate.parse(
        b"POST /api/hermes/tools/invoke HTTP/1.1\r\nHost: x\r\nConnection: keep-alive\r\n"
        b"Authorization: Bearer t\r\nContent-Length: 12\r\nUpgrade: h2c\r\n\r\n", PREFIXES)
    assert length == 12
    assert head == (b"POST /api/hermes/tools/invoke HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer "
                    b"t\r\nContent-Length: 12\r\nConnection: close\r\n\r\n")


class Recorder(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    seen: list = []

    def do_POST(self):
        body = self.rfile.read(int(self.headers["Content-Length"]))
        Recorder.seen.append((self.path, body))
        self.send_response(200)
        self.send_header("Content-Length", "2")
        self.end_headers()
        self.wfile.write(b"ok")

    do_GET = do_POST

    def log_message(self, *a):
        pass


@pytest.fixture
def server():
    Recorder.seen = []
    srv = ThreadingHTTPServer(("127.0.0.1", 0), Recorder)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    yield srv.server_address
    srv.shutdown()


def serve_one(target, data: bytes) -> tuple[bytes, str | None]:
    async def main():
        a, b = socket.socketpair()
        a.setblocking(False)
        loop = asyncio.get_running_loop()
        b.setblocking(False)
        await loop.sock_sendall(b, data)
        b.shutdown(socket.SHUT_WR)
        task = asyncio.create_task(service_gate.forward(
            a, (socket.AF_INET, target), PREFIXES, Pace()))
        refused = await asyncio.wait_for(task, 10)
        a.close()
        got = b""
        while chunk := await loop.sock_recv(b, 65536):
            got += chunk
        b.close()
        return got, refused
    return asyncio.run(main())


def test_one_request_reaches_the_service_and_a_pipelined_second_never_does(server):
    first = (b"POST /api/hermes/tools/invoke HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\n\r\n"
             b"hello")
    second = b"GET /api/v1/sessions HTTP/1.1\r\nHost: x\r\n\r\n"
    got, refused = serve_one(server, first + second)
    assert refused is None and got.startswith(b"HTTP/1.1 200") and got.endswith(b"ok")
    assert Recorder.seen == [("/api/hermes/tools/invoke", b"hello")]


def test_another_route_is_refused_without_reaching_the_service(server):
    got, refused = serve_one(server, b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
    assert refused == "not_a_sandbox_route"
    assert got.startswith(b"HTTP/1.1 403") and b"X-Hermes-Refused: not_a_sandbox_route" in got
    assert Recorder.seen == []


def test_the_pace_lets_a_burst_through_then_slows_to_its_rate(monkeypatch):
    now = [1000.0]
    slept = []
    monkeypatch.setattr(service_gate.time, "monotonic", lambda: now[0])

    async def sleep(seconds):
        slept.append(seconds)
        now[0] += seconds
    monkeypatch.setattr(service_gate.asyncio, "sleep", sleep)
    pace = Pace(rate=10, burst=3)

    async def take(n):
        for _ in range(n):
            await pace.take()
    asyncio.run(take(3))
    assert slept == []                               # the burst goes at once
    asyncio.run(take(2))
    assert slept == [pytest.approx(0.1), pytest.approx(0.1)]     # then one per 1/rate s
