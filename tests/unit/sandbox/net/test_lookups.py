"""Each sandbox's own name lookups (hermes_service/sandbox/net/lookups.py): a sandbox holding
every connection it may on slow or black-holed names gets its lookups refused past its cap
and its deadline — and another sandbox's lookup is answered meanwhile, its speed untouched.

The resolver is stubbed at its public boundary (``socket.getaddrinfo``, which
:func:`egress_policy.resolve` calls): names under ``hole.example.com`` never answer until the
test ends, names under ``slow.example.com`` answer after 20 s, any other name answers
at once with a private address (a 403 ``denied_address``: a lookup and nothing else). The
sockets, the proxy and its policy are the service's own."""
from __future__ import annotations

import asyncio
import os
import socket
import threading
import time

import pytest

from hermes_service.sandbox.net.egress_policy import Policy
from hermes_service.sandbox.net.lookups import Lookups
from hermes_service.sandbox.net.sockets import Caps, SandboxNet
from support.fixtures import wait_for

REAL_GETADDRINFO = socket.getaddrinfo


@pytest.fixture
def resolver(monkeypatch):
    """The stubbed ``getaddrinfo``; ``release`` ends every black-holed lookup."""
    release = threading.Event()
    asked: list[str] = []

    def getaddrinfo(host, port, *args, **kwargs):
        if not isinstance(host, str) or not host.endswith("example.com"):
            return REAL_GETADDRINFO(host, port, *args, **kwargs)
        asked.append(host)
        if host.endswith("hole.example.com"):
            release.wait(60)
        elif host.endswith("slow.example.com"):
            release.wait(20.0)
        return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", ("10.1.2.3", port))]
    monkeypatch.setattr(socket, "getaddrinfo", getaddrinfo)
    yield release, asked
    release.set()


@pytest.fixture
def net(tmp_path):
    n = SandboxNet(tmp_path / "net", Policy.from_lists(["*.example.com"], []),
                   Caps(egress=64, lookups=4, lookup_timeout=0.5))
    yield n
    n.close()


def open_egress(att) -> socket.socket:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(30)
    fd = os.open(att.folder, os.O_RDONLY | os.O_DIRECTORY)
    try:
        s.connect(f"/proc/self/fd/{fd}/egress.sock")
    finally:
        os.close(fd)
    return s


def ask(s: socket.socket, name: str) -> None:
    s.sendall(f"CONNECT {name}:443 HTTP/1.1\r\n\r\n".encode())


def answer(s: socket.socket) -> str:
    got = b""
    while b"\r\n\r\n" not in got and (chunk := s.recv(4096)):
        got += chunk
    reason = [ln for ln in got.split(b"\r\n") if ln.startswith(b"X-Hermes-Egress-Refused")]
    return reason[0].split(b": ")[1].decode() if reason else got[:20].decode()


@pytest.mark.parametrize("hole", ["hole", "slow"])
@pytest.mark.parametrize("hogs", [1, 3])
def test_a_sandbox_on_slow_names_never_slows_another_sandboxs_lookup(net, resolver, hole, hogs):
    release, asked = resolver
    victim = net.attach("bob")
    baseline = []
    for _ in range(3):
        t = time.monotonic()
        with open_egress(victim) as s:
            ask(s, "fast.example.com")
            assert answer(s) == "denied_address"      # looked up, then refused by address
        baseline.append(time.monotonic() - t)
    held = []
    attackers = [net.attach(f"mallory{i}") for i in range(hogs)]
    for i, att in enumerate(attackers):
        for j in range(64):                              # every connection it may hold
            s = open_egress(att)
            ask(s, f"n{i}-{j}.{hole}.example.com")
            held.append(s)
    wait_for(lambda: all(a.lookups.busy == 4 for a in attackers), "the attackers' lookups")
    during = []
    for _ in range(3):
        t = time.monotonic()
        with open_egress(victim) as s:
            ask(s, "fast.example.com")
            assert answer(s) == "denied_address"
        during.append(time.monotonic() - t)
    if hole == "hole":
        assert not release.is_set() and all(a.lookups.busy == 4 for a in attackers)
    answers = [answer(s) for s in held]
    # past its cap a lookup is refused at once; one in flight past the deadline is refused
    assert answers.count("lookup_busy") == hogs * 60, answers
    assert answers.count("lookup_timeout") + answers.count("denied_address") == hogs * 4
    assert len([n for n in asked if hole in n]) == hogs * 4     # only its cap was asked
    print(f"\nbob's lookup alone {[round(x * 1000, 1) for x in baseline]} ms; with {hogs} "
          f"sandbox(es) holding 64 {hole} names each {[round(x * 1000, 1) for x in during]} ms")
    for s in held:
        s.close()


def test_the_cap_counts_a_timed_out_lookup_until_its_thread_returns():
    """A lookup past its deadline still holds a thread of this sandbox: its place under the cap
    is freed only when the resolver returns — so a sandbox cannot pile up threads."""
    gate = threading.Event()

    def resolve(host, port):
        gate.wait(30)
        return [], "unresolvable"

    async def main():
        lookups = Lookups(2, 0.1)
        first = await asyncio.gather(*(lookups.resolve(resolve, f"h{i}", 1) for i in range(3)))
        busy_after_deadline = lookups.busy
        gate.set()
        for _ in range(200):
            if not lookups.busy:
                break
            await asyncio.sleep(0.05)
        again = await lookups.resolve(resolve, "h", 1)
        lookups.close()
        return sorted(r[1] for r in first), busy_after_deadline, again
    first, busy, again = asyncio.run(main())
    assert first == ["lookup_busy", "lookup_timeout", "lookup_timeout"]
    assert busy == 2
    assert again == ([], "unresolvable")
