"""A sandbox cannot write the service's log (hermes_service/sandbox/net/refusals.py and its
use by the sockets): a flood of refused requests — not allowed, malformed, ports and lengths
in Unicode digits, to the egress proxy and to the service gate — leaves at most two lines per
sandbox and reason an interval, each count in the last one, and no traceback at all."""
from __future__ import annotations

import logging
import os
import socket
import time

import pytest

from hermes_service.sandbox.net.egress_policy import Policy
from hermes_service.sandbox.net.refusals import RefusalLog
from hermes_service.sandbox.net.sockets import SandboxNet
from support.fixtures import wait_for


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self):
        return self.now


def test_the_first_refusal_is_written_the_rest_of_the_interval_counted(caplog):
    clock = Clock()
    log = RefusalLog(logging.getLogger("test.refusals"), interval=60, clock=clock)
    with caplog.at_level(logging.WARNING, "test.refusals"):
        for i in range(1000):
            log.refused("mallory", "not_allowed", f"egress refused: n{i}.test:443")
        log.refused("bob", "not_allowed", "egress refused: x.test:443")     # another sandbox
        log.refused("mallory", "bad_request", "egress refused: ?:?")       # another reason
        clock.now += 30
        log.flush()                                  # mid-interval: nothing more yet
        assert len(caplog.records) == 3
        clock.now += 31
        log.flush()
    lines = [r.getMessage() for r in caplog.records]
    assert lines[:3] == ["egress refused: n0.test:443 (not_allowed)",
                         "egress refused: x.test:443 (not_allowed)",
                         "egress refused: ?:? (bad_request)"]
    assert lines[3:] == ["egress refused: n999.test:443 (not_allowed) and 999 more like it "
                         "in 61 s"]
    assert log.windows == {}


def test_a_sandbox_that_ends_has_its_counts_written(caplog):
    clock = Clock()
    log = RefusalLog(logging.getLogger("test.refusals"), interval=60, clock=clock)
    with caplog.at_level(logging.WARNING, "test.refusals"):
        for _ in range(5):
            log.refused("a", "denied", "d")
        log.refused("b", "denied", "d")
        log.flush("a")
    assert [r.getMessage() for r in caplog.records] == [
        "d (denied)", "d (denied)", "d (denied) and 4 more like it in 0 s"]
    assert list(log.windows) == [("b", "", "denied")]


FLOOD = [
    ("egress", b"CONNECT other.test:443 HTTP/1.1\r\n\r\n", "not_allowed"),
    ("egress", "CONNECT api.example.com:\u00b2 HTTP/1.1\r\n\r\n".encode(), "bad_request"),
    ("egress", "POST http://api.example.com/ HTTP/1.1\r\nContent-Length: \u0663\r\n\r\n"
     .encode(), "bad_request"),
    ("egress", b"\x00\xff garbage\r\n\r\n", "bad_request"),
    ("service", b"GET /metrics HTTP/1.1\r\n\r\n", "not_a_sandbox_route"),
    ("service", "POST /api/hermes/tools/invoke HTTP/1.1\r\nContent-Length: \u00b2\r\n\r\n"
     .encode(), "bad_request"),
]


def send(att, name: str, data: bytes) -> bytes:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(30)
    fd = os.open(att.folder, os.O_RDONLY | os.O_DIRECTORY)
    try:
        s.connect(f"/proc/self/fd/{fd}/{name}.sock")
    finally:
        os.close(fd)
    s.sendall(data)
    got = s.recv(4096)
    s.close()
    return got


@pytest.mark.parametrize("per_kind", [200])
def test_a_flood_of_refusals_leaves_a_few_lines_and_no_traceback(tmp_path, caplog, per_kind):
    net = SandboxNet(tmp_path / "net", Policy.from_lists(["*.example.com"], []))
    net.set_target("service", "127.0.0.1", 9)        # never reached: every request refused
    net.service_paths = ("/api/hermes/tools/",)
    att = net.attach("mallory")
    caplog.set_level(logging.INFO, "hermes_service")
    try:
        t = time.monotonic()
        for _ in range(per_kind):
            for name, data, _reason in FLOOD:
                assert send(att, name, data).startswith((b"HTTP/1.1 4", b"HTTP/1.1 5"))
        took = time.monotonic() - t
        wait_for(lambda: att.open["egress"] == att.open["service"] == 0, "the last connection")
    finally:
        net.close()                       # the sandbox ends: its counts are written
    records = [r for r in caplog.records if r.name.startswith("hermes_service")]
    assert not [r for r in records if r.exc_info], "a traceback for a sandbox's bytes"
    reasons = {(name, reason) for name, _data, reason in FLOOD}
    # the first of each (socket's reason) at once, one count line when the sandbox ended
    assert len(records) == 2 * len(reasons), [r.getMessage() for r in records]
    total = sum(int(r.getMessage().split(" and ")[1].split()[0]) + 1
                for r in records if " more like it " in r.getMessage())
    assert total == per_kind * len(FLOOD)
    print(f"\n{per_kind * len(FLOOD)} refused requests in {took:.2f} s "
          f"({per_kind * len(FLOOD) / took:.0f}/s): {len(records)} log lines")
