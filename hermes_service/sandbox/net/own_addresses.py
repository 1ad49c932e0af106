"""The host's own addresses, as they are now (docs/sandbox.md §Network): the egress proxy
refuses a name that resolves to one of them, so an address the host gets later (a new
interface, a rotating IPv6 temporary address, a container network) is refused from the
moment it is there.

:class:`OwnAddresses` reads the addresses of every interface of the service's network
namespace with one rtnetlink dump (``RTM_GETADDR``, RFC 3549: a few hundred bytes per
address, however large the routing table) and keeps them; it reads them again as soon as the
kernel announces an address added or removed (a netlink socket subscribed to the address
groups: checking it is one non-blocking ``recv``), and at the latest every :data:`MAX_AGE`
seconds. Without netlink (another platform) it reads ``/proc/net/fib_trie`` and
``/proc/net/if_inet6`` every :data:`MAX_AGE` seconds.
"""
from __future__ import annotations

import contextlib
import ipaddress
import itertools
import socket
import struct
import threading
import time
from pathlib import Path

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
MAX_AGE = 5.0
_NETLINK_ROUTE, _RTM_NEWADDR, _RTM_GETADDR, _NLMSG_DONE, _NLMSG_ERROR = 0, 20, 22, 3, 2
_NLM_F_REQUEST_DUMP = 0x1 | 0x300
_GROUPS = 0x10 | 0x100                  # RTMGRP_IPV4_IFADDR | RTMGRP_IPV6_IFADDR
_IFA_ADDRESS, _IFA_LOCAL = 1, 2
_HEADER = struct.Struct("=LHHLL")       # nlmsghdr
_RTA = struct.Struct("=HH")             # rtattr


def parse_dump(data: bytes) -> tuple[set[IPAddress], bool]:
    """The addresses in one ``recv`` of an ``RTM_GETADDR`` dump, and whether it was the last
    (``NLMSG_DONE`` or an error). Messages cut short end the parse."""
    found: set[IPAddress] = set()
    off = 0
    while off + _HEADER.size <= len(data):
        length, kind, _flags, _seq, _pid = _HEADER.unpack_from(data, off)
        if length < _HEADER.size or off + length > len(data):
            break
        if kind in (_NLMSG_DONE, _NLMSG_ERROR):
            return found, True
        if kind == _RTM_NEWADDR and length >= _HEADER.size + 8:
            family = data[off + _HEADER.size]
            attrs: dict[int, bytes] = {}
            at = off + _HEADER.size + 8
            while at + _RTA.size <= off + length:
                size, kind_ = _RTA.unpack_from(data, at)
                if size < _RTA.size:
                    break
                attrs[kind_] = data[at + _RTA.size:at + size]
                at += (size + 3) & ~3
            raw = attrs.get(_IFA_LOCAL) or attrs.get(_IFA_ADDRESS) or b""
            if (family, len(raw)) in ((socket.AF_INET, 4), (socket.AF_INET6, 16)):
                found.add(ipaddress.ip_address(raw))
        off += (length + 3) & ~3
    return found, False


def read_netlink() -> frozenset[IPAddress]:
    """Every address of every interface (one ``RTM_GETADDR`` dump). Raises OSError."""
    with socket.socket(socket.AF_NETLINK, socket.SOCK_RAW | socket.SOCK_CLOEXEC,
                       _NETLINK_ROUTE) as sock:
        sock.settimeout(5)
        sock.bind((0, 0))
        sock.send(_HEADER.pack(_HEADER.size + 8, _RTM_GETADDR, _NLM_F_REQUEST_DUMP, 1, 0)
                  + bytes(8))
        found: set[IPAddress] = set()
        while True:
            part, done = parse_dump(sock.recv(1 << 16))
            found |= part
            if done:
                return frozenset(found)


def read_proc() -> frozenset[IPAddress]:
    """The same from ``/proc``: ``fib_trie``'s LOCAL host entries and ``if_inet6``."""
    found: set[IPAddress] = set()
    with contextlib.suppress(OSError, ValueError):
        lines = Path("/proc/net/fib_trie").read_text().splitlines()
        for prev, line in itertools.pairwise(lines):
            if line.strip() == "/32 host LOCAL":
                found.add(ipaddress.ip_address(prev.split()[-1]))
    with contextlib.suppress(OSError, ValueError, IndexError):
        for line in Path("/proc/net/if_inet6").read_text().splitlines():
            found.add(ipaddress.IPv6Address(int(line.split()[0], 16)))
    return frozenset(found)


class OwnAddresses:
    """The host's addresses now (module doc); safe to call from any thread."""

    def __init__(self, max_age: float = MAX_AGE):
        self.max_age = max_age
        self.reads = 0                  # how many times they were read (tests, figures)
        self._lock = threading.Lock()
        self._known: frozenset[IPAddress] | None = None
        self._at = 0.0
        self._changes: socket.socket | None = None
        try:
            self._changes = socket.socket(
                socket.AF_NETLINK, socket.SOCK_RAW | socket.SOCK_NONBLOCK | socket.SOCK_CLOEXEC,
                _NETLINK_ROUTE)
            self._changes.bind((0, _GROUPS))
        except (OSError, AttributeError):
            self._changes = None

    def _changed(self) -> bool:
        """Has the kernel announced an address change since the last call (or lost some
        announcements: its queue overran)?"""
        if self._changes is None:
            return False
        changed = False
        while True:
            try:
                if not self._changes.recv(1 << 16):
                    return changed
                changed = True
            except BlockingIOError:
                return changed
            except OSError:             # ENOBUFS: announcements lost, read again
                return True

    def __call__(self) -> frozenset[IPAddress]:
        with self._lock:
            now = time.monotonic()
            if self._changed() or self._known is None or now - self._at >= self.max_age:
                try:
                    self._known = read_netlink() if self._changes is not None else read_proc()
                except OSError:
                    self._known = read_proc()
                self._at = now
                self.reads += 1
            return self._known


_now: OwnAddresses | None = None
_made = threading.Lock()


def now() -> frozenset[IPAddress]:
    """The host's addresses now, through one :class:`OwnAddresses` for the process."""
    global _now
    with _made:
        if _now is None:
            _now = OwnAddresses()
    return _now()
