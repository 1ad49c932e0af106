"""The sandbox's forwarder (hermes_service/hermes_site/netforward.py, run inside Hermes):
loopback ports relayed to Unix sockets, with real sockets on both sides."""
from __future__ import annotations

import socket
import threading

import pytest

from hermes_service.hermes_site import netforward


def free_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


class UnixServer:
    """Answers each connection: everything it read, upper-cased, once the client ended its
    input (so half-close is exercised); or ``big`` bytes at once."""

    def __init__(self, path, big: int = 0):
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.bind(str(path))
        self.sock.listen(16)
        self.big = big
        self.accepted = 0
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self):
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.accepted += 1
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn):
        with conn:
            if self.big:
                conn.recv(10)
                conn.sendall(b"x" * self.big)
                return
            got = b""
            while chunk := conn.recv(65536):
                got += chunk
            conn.sendall(got.upper())


@pytest.fixture
def forward(tmp_path, monkeypatch):
    def make(big: int = 0):
        path = tmp_path / "s.sock"
        server = UnixServer(path, big)
        port = free_port()
        monkeypatch.setenv(netforward.ENV, f"{port}={path}")
        fwd = netforward.start()
        return port, server, fwd
    return make


def test_a_port_relays_both_ways_through_a_half_close(forward):
    port, _server, _fwd = forward()
    c = socket.create_connection(("127.0.0.1", port), timeout=10)
    c.sendall(b"hello " * 30000)
    c.shutdown(socket.SHUT_WR)
    got = b""
    while chunk := c.recv(65536):
        got += chunk
    assert got == b"HELLO " * 30000
    c.close()


def test_a_large_answer_to_a_slow_reader_arrives_whole(forward):
    port, _server, _fwd = forward(big=8 * 1024 * 1024)
    c = socket.create_connection(("127.0.0.1", port), timeout=10)
    c.sendall(b"go")
    got = 0
    while chunk := c.recv(4096):
        got += len(chunk)
    assert got == 8 * 1024 * 1024


def test_the_variable_is_taken_out_and_nothing_runs_without_it(monkeypatch):
    monkeypatch.delenv(netforward.ENV, raising=False)
    assert netforward.start() is None


def test_a_port_at_its_cap_stops_accepting_until_one_ends(forward, monkeypatch):
    monkeypatch.setattr(netforward, "MAX_PER_PORT", 3)
    port, server, fwd = forward()
    held = [socket.create_connection(("127.0.0.1", port), timeout=10) for _ in range(5)]
    from support.fixtures import wait_for
    wait_for(lambda: server.accepted == 3, "three relayed connections")
    assert fwd.open[port] == 3
    held[0].shutdown(socket.SHUT_WR)
    assert held[0].recv(10) == b""
    wait_for(lambda: server.accepted == 4, "the next one let in")
    for c in held:
        c.close()


def test_children_only_keeps_the_proxy_from_hermes_and_gives_it_to_its_children(monkeypatch):
    import subprocess
    import sys
    monkeypatch.setattr(subprocess.Popen, "__init__", subprocess.Popen.__init__)
    monkeypatch.setenv(netforward.CHILDREN_ONLY_ENV, "1")
    monkeypatch.setenv("HTTPS_PROXY", "http://127.0.0.1:3128")
    monkeypatch.setenv("NO_PROXY", "localhost,model.hermes.internal")
    monkeypatch.delenv("no_proxy", raising=False)
    netforward.proxy_for_children_only()
    import os
    assert netforward.CHILDREN_ONLY_ENV not in os.environ
    assert os.environ["NO_PROXY"] == os.environ["no_proxy"] == "*"     # Hermes: no proxy
    show = [sys.executable, "-c", "import os; print(os.environ.get('NO_PROXY'), "
            "os.environ.get('no_proxy'), os.environ.get('HTTPS_PROXY'))"]
    inherited = subprocess.run(show, capture_output=True, text=True).stdout.split()
    given = subprocess.run(show, capture_output=True, text=True,
                           env={**os.environ, "X": "1"}).stdout.split()
    assert inherited == given == ["localhost,model.hermes.internal", "None",
                                  "http://127.0.0.1:3128"]
