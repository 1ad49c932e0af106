"""The host's own addresses, as they are now (docs/sandbox.md §Network): the egress proxy
refuses a name that resolves to one of them, so an address the host gets later (a new
interface, a rotating IPv6 temporary address, a container network) is refused from the
moment it is there.

:class:`OwnAddresses` reads the addresses of every interface of the service's network
namespace with one rtnetlink dump (``RTM_GETADDR``, RFC 3549: a few hundred bytes per
address, however large the routing table), and the prefixes of its ``local`` routes with
another (``RTM_GETROUTE``, only those routes where the kernel filters a dump: AnyIP —
``ip route add local 198.51.100.0/24 dev lo`` — makes the host answer on every address of
a prefix no interface holds), and keeps them; it reads them again as soon as the kernel
announces an address or route added or removed (a netlink socket subscribed to those
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
#: RTMGRP_IPV4_IFADDR | RTMGRP_IPV6_IFADDR | RTMGRP_IPV4_ROUTE | RTMGRP_IPV6_ROUTE
_GROUPS = 0x10 | 0x100 | 0x40 | 0x400
_IFA_ADDRESS, _IFA_LOCAL = 1, 2
_RTM_NEWROUTE, _RTM_GETROUTE, _RTN_LOCAL, _RTA_DST = 24, 26, 2, 1
_HEADER = struct.Struct("=LHHLL")       # nlmsghdr
_RTA = struct.Struct("=HH")             # rtattr
_RTMSG = struct.Struct("=BBBBBBBBI")    # rtmsg
_SOL_NETLINK, _NETLINK_GET_STRICT_CHK = 270, 12
IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network


class Owned(frozenset):
    """The host's addresses (the set's members) and the prefixes of its ``local`` routes
    (``networks``: AnyIP, ``ip route add local 198.51.100.0/24 dev lo``: the host answers on
    every address in them). ``addr in owned`` is true for either."""
    networks: frozenset = frozenset()

    def __new__(cls, addresses=(), networks=()):
        self = super().__new__(cls, addresses)
        self.networks = frozenset(networks)
        return self

    def __contains__(self, addr) -> bool:
        return frozenset.__contains__(self, addr) or any(
            addr.version == net.version and addr in net for net in self.networks)


def _attrs(data: bytes, at: int, end: int) -> dict[int, bytes]:
    attrs: dict[int, bytes] = {}
    while at + _RTA.size <= end:
        size, kind = _RTA.unpack_from(data, at)
        if size < _RTA.size:
            break
        attrs[kind] = data[at + _RTA.size:at + size]
        at += (size + 3) & ~3
    return attrs


def _messages(data: bytes) -> tuple[list[tuple[int, int, int]], bool]:
    """The netlink messages in one ``recv``: ``(kind, offset, length)`` each, and whether the
    dump ended there (``NLMSG_DONE`` or an error). A message cut short ends the list."""
    out: list[tuple[int, int, int]] = []
    off = 0
    while off + _HEADER.size <= len(data):
        length, kind, _flags, _seq, _pid = _HEADER.unpack_from(data, off)
        if length < _HEADER.size or off + length > len(data):
            break
        if kind in (_NLMSG_DONE, _NLMSG_ERROR):
            return out, True
        out.append((kind, off, length))
        off += (length + 3) & ~3
    return out, False


def parse_routes(data: bytes) -> tuple[set[IPNetwork], bool]:
    """The prefixes of the ``local`` routes (``RTN_LOCAL``) in one ``recv`` of an
    ``RTM_GETROUTE`` dump, and whether it was the last. Messages cut short end the parse."""
    found: set[IPNetwork] = set()
    messages, done = _messages(data)
    for kind, off, length in messages:
        if kind == _RTM_NEWROUTE and length >= _HEADER.size + _RTMSG.size:
            family, dst_len, *_, rtype, _f = _RTMSG.unpack_from(data, off + _HEADER.size)
            raw = _attrs(data, off + _HEADER.size + _RTMSG.size, off + length).get(_RTA_DST)
            size = {socket.AF_INET: 4, socket.AF_INET6: 16}.get(family)
            if rtype == _RTN_LOCAL and size is not None:
                raw = bytes(size) if raw is None and dst_len == 0 else raw   # local default
                with contextlib.suppress(ValueError, TypeError):
                    if raw is not None and len(raw) == size:
                        found.add(ipaddress.ip_network((ipaddress.ip_address(raw), dst_len),
                                                       strict=False))
    return found, done


def parse_dump(data: bytes) -> tuple[set[IPAddress], bool]:
    """The addresses in one ``recv`` of an ``RTM_GETADDR`` dump, and whether it was the last
    (``NLMSG_DONE`` or an error). Messages cut short end the parse."""
    found: set[IPAddress] = set()
    messages, done = _messages(data)
    for kind, off, length in messages:
        if kind == _RTM_NEWADDR and length >= _HEADER.size + 8:
            family = data[off + _HEADER.size]
            attrs = _attrs(data, off + _HEADER.size + 8, off + length)
            raw = attrs.get(_IFA_LOCAL) or attrs.get(_IFA_ADDRESS) or b""
            if (family, len(raw)) in ((socket.AF_INET, 4), (socket.AF_INET6, 16)):
                found.add(ipaddress.ip_address(raw))
    return found, done


def _dump(kind: int, body: bytes, parse) -> set:
    with socket.socket(socket.AF_NETLINK, socket.SOCK_RAW | socket.SOCK_CLOEXEC,
                       _NETLINK_ROUTE) as sock:
        sock.settimeout(5)
        sock.bind((0, 0))
        # the kernel then dumps only what ``body`` asks for (the local routes, not a router's
        # whole table); an older one dumps everything and the parser picks
        with contextlib.suppress(OSError):
            sock.setsockopt(_SOL_NETLINK, _NETLINK_GET_STRICT_CHK, 1)
        sock.send(_HEADER.pack(_HEADER.size + len(body), kind, _NLM_F_REQUEST_DUMP, 1, 0)
                  + body)
        found: set = set()
        while True:
            part, done = parse(sock.recv(1 << 16))
            found |= part
            if done:
                return found


def read_netlink() -> Owned:
    """Every address of every interface (one ``RTM_GETADDR`` dump) and the prefixes of the
    ``local`` routes of every table (one ``RTM_GETROUTE`` dump). Raises OSError."""
    return Owned(_dump(_RTM_GETADDR, bytes(8), parse_dump),
                 _dump(_RTM_GETROUTE, _RTMSG.pack(0, 0, 0, 0, 0, 0, 0, _RTN_LOCAL, 0),
                       parse_routes))


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
