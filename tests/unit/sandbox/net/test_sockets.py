"""A sandbox's Unix sockets (hermes_service/sandbox/net/sockets.py): relays to real loopback servers,
the per-sandbox connection caps that keep one sandbox from starving another, detaching."""
from __future__ import annotations

import os
import socket
import threading

import pytest

from hermes_service import instance
from hermes_service.sandbox.net.egress_policy import Policy
from hermes_service.sandbox.net.sockets import Caps, SandboxNet
from support.fixtures import wait_for


class HoldingServer:
    """A TCP server on loopback that answers ``pong`` to each connection's first bytes and
    then holds it open; counts the connections it accepted."""

    def __init__(self):
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.accepted = 0
        self.conns: list[socket.socket] = []
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self):
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.accepted += 1
            self.conns.append(conn)
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn):
        try:
            if conn.recv(100):
                conn.sendall(b"pong")
            conn.recv(100)
        except OSError:
            pass
        conn.close()

    def close(self):
        self.sock.close()
        for c in self.conns:
            c.close()


@pytest.fixture
def net(tmp_path):
    n = SandboxNet(tmp_path / "net", Policy.from_lists(["*.example.com"], []), Caps(2, 2, 2))
    yield n
    n.close()


@pytest.fixture
def server():
    s = HoldingServer()
    yield s
    s.close()


def connect(att, name: str) -> socket.socket:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(10)
    fd = os.open(att.folder, os.O_RDONLY | os.O_DIRECTORY)     # a path of any length
    try:
        s.connect(f"/proc/self/fd/{fd}/{name}.sock")
    finally:
        os.close(fd)
    return s


def ping(s: socket.socket) -> bytes:
    s.sendall(b"ping")
    return s.recv(10)


def test_each_socket_relays_to_its_target_and_detach_removes_everything(net, server):
    net.set_target("model", "127.0.0.1", server.port)
    net.set_target("service", "127.0.0.1", server.port)
    att = net.attach("alice", "acp")
    assert sorted(p.name for p in att.folder.iterdir()) == ["egress.sock", "model.sock",
                                                             "service.sock"]
    m, s = connect(att, "model"), connect(att, "service")
    assert ping(m) == b"pong"
    # the service socket takes HTTP requests to the run-token routes only (sandbox/net/service_gate.py)
    s.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
    assert s.recv(200).startswith(b"HTTP/1.1 403")
    assert server.accepted == 1                          # only the model relay got through
    net.detach(att)
    assert not att.folder.exists()
    assert m.recv(10) == b""               # relays closed with the sandbox
    m.close()
    s.close()


def test_a_sandbox_at_its_cap_waits_and_another_sandbox_is_served(net, server):
    net.set_target("model", "127.0.0.1", server.port)
    hog, other = net.attach("mallory"), net.attach("bob")
    flood = []
    fd = os.open(hog.folder, os.O_RDONLY | os.O_DIRECTORY)
    for _ in range(20):
        c = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        c.setblocking(False)
        try:
            c.connect(f"/proc/self/fd/{fd}/model.sock")
        except BlockingIOError:
            pass
        except OSError:
            c.close()
            continue
        flood.append(c)
    os.close(fd)
    wait_for(lambda: server.accepted == 2, "the hog's two connections")
    assert hog.open["model"] == 2
    b = connect(other, "model")
    assert ping(b) == b"pong"              # bob is served while mallory waits at her cap
    assert server.accepted == 3
    flood[0].close()                         # one of mallory's ends: the next is let in
    wait_for(lambda: server.accepted == 4, "mallory's next connection")
    for c in flood:
        c.close()
    b.close()


def test_egress_is_refused_by_the_policy_and_reported(net):
    seen = []
    net.on_egress = lambda att, out: seen.append((att.user_id, out.refused, out.host))
    att = net.attach("alice")
    e = connect(att, "egress")
    e.sendall(b"CONNECT other.org:443 HTTP/1.1\r\n\r\n")
    answer = e.recv(1000)
    assert answer.startswith(b"HTTP/1.1 403") and b"X-Hermes-Egress-Refused: not_allowed" in answer
    wait_for(lambda: seen, "the egress report")
    assert seen == [("alice", "not_allowed", "other.org")]
    e.close()


def test_long_socket_folders_still_bind(tmp_path):
    deep = tmp_path / ("x" * 100) / ("y" * 100)
    n = SandboxNet(deep / "net")
    try:
        att = n.attach("alice")
        assert (att.folder / "model.sock").exists()
        assert len(str(att.folder / "model.sock")) > 108
    finally:
        n.close()


def test_a_second_process_on_the_data_dir_keeps_the_first_ones_sockets(tmp_path, monkeypatch):
    """Two service processes share ``<data_dir>/sandbox/net`` (a rolling restart): the one
    that starts later removes the folders of processes that died, never a live one's — a
    sandbox of the first process whose folder went could not start (bwrap: no source path)."""
    root = tmp_path / "net"
    (root / "999999-1").mkdir(parents=True)             # a crashed process's sockets
    (root / "0123456789abcdef").mkdir()                 # the layout before owners
    first = SandboxNet(root)
    try:
        att = first.attach("alice")
        assert att.folder.parent == root / instance.current()
        assert not (root / "999999-1").exists() and not (root / "0123456789abcdef").exists()
        monkeypatch.setattr(instance, "current", lambda: "1-1")      # another process starts
        second = SandboxNet(root)
        try:
            other = second.attach("bob")
            assert other.folder.parent == root / "1-1"
            assert (att.folder / "model.sock").exists(), "the live process's sockets went"
        finally:
            second.close()
    finally:
        first.close()
    assert not att.folder.exists()
