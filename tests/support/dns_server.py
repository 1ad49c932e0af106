"""A minimal DNS server for the tests (RFC 1035 over UDP): answers A and AAAA questions from
a table, a name's answers taken in turn on each question (a name that resolves elsewhere the
second time: DNS rebinding). Names under a ``holes`` suffix are never answered (black-holed);
names under a ``slow`` suffix are answered (NXDOMAIN) after its delay, without holding up
any other answer. Everything else: NXDOMAIN. Standard library only."""
from __future__ import annotations

import ipaddress
import socket
import struct
import threading
from collections import defaultdict


def _name(data: bytes, offset: int) -> tuple[str, int]:
    labels = []
    while True:
        length = data[offset]
        offset += 1
        if length == 0:
            return ".".join(labels).lower(), offset
        labels.append(data[offset:offset + length].decode("ascii", "replace"))
        offset += length


class DnsServer:
    """``answers``: name -> a list of address lists, one list per question in turn (the last
    repeats), e.g. ``{"rebind.test": [["203.0.113.2"], ["127.0.0.1"]]}``. ``questions``
    counts the questions each name got (A and AAAA both)."""

    def __init__(self, answers: dict[str, list[list[str]]], host: str = "127.0.0.77",
                 holes: tuple[str, ...] = (), slow: dict[str, float] | None = None):
        self.answers = {k.lower(): v for k, v in answers.items()}
        self.holes, self.slow = holes, slow or {}
        self.questions: dict[str, int] = defaultdict(int)
        self._turn: dict[tuple[str, int], int] = defaultdict(int)
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.sock.bind((host, 53))
        self.host = host
        threading.Thread(target=self._run, daemon=True).start()

    def close(self) -> None:
        self.sock.close()

    def _run(self) -> None:
        while True:
            try:
                data, peer = self.sock.recvfrom(512)
            except OSError:
                return
            try:
                name = _name(data, 12)[0]
                if name.endswith(self.holes):
                    self.questions[name] += 1
                    continue
                delay = next((d for suffix, d in self.slow.items() if name.endswith(suffix)), 0)
                answer = self._answer(data)
                if delay:
                    threading.Timer(delay, self._send_late, (answer, peer)).start()
                else:
                    self.sock.sendto(answer, peer)
            except (OSError, IndexError, struct.error):
                continue

    def _send_late(self, answer: bytes, peer) -> None:
        try:
            self.sock.sendto(answer, peer)
        except OSError:
            pass

    def _answer(self, data: bytes) -> bytes:
        qid, _flags, qdcount = struct.unpack("!HHH", data[:6])
        name, end = _name(data, 12)
        qtype, _qclass = struct.unpack("!HH", data[end:end + 4])
        question = data[12:end + 4]
        self.questions[name] += 1
        if name not in self.answers:
            return struct.pack("!HHHHHH", qid, 0x8183, 1, 0, 0, 0) + question   # NXDOMAIN
        family = {1: 4, 28: 6}.get(qtype)
        turns = self.answers[name]
        key = (name, qtype)
        addrs = turns[min(self._turn[key], len(turns) - 1)]
        self._turn[key] += 1
        records = []
        for text in addrs:
            addr = ipaddress.ip_address(text)
            if addr.version != family:
                continue
            records.append(b"\xc0\x0c" + struct.pack("!HHIH", qtype, 1, 0, len(addr.packed))
                           + addr.packed)
        head = struct.pack("!HHHHHH", qid, 0x8180, 1, len(records), 0, 0)
        return head + question + b"".join(records)
