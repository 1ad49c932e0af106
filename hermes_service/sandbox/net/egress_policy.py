"""Which destinations a sandbox's tools may reach through the egress proxy
(``hermes.sandbox.egress``; docs/sandbox.md §Network).

Two checks, both before any byte leaves:

* **The name** (:meth:`Policy.decide`): the host a request names must match an ``allow``
  entry and no ``deny`` entry (deny wins). An entry is ``example.com`` (that name only),
  ``*.example.com`` (any name below it, not ``example.com`` itself), or an IP address
  literal (``203.0.113.7``, ``[2001:db8::1]``); each may end in ``:port`` (else any port).
  Names compare lower-case, without a trailing dot, in their IDNA (punycode) form. A request
  naming an IP address literal matches only an entry naming that literal. An empty
  ``allow`` list allows nothing.
* **The addresses** (:func:`denied_address`): the proxy resolves the name itself and refuses
  the request when *any* address it resolves to is one no sandbox may reach —
  :data:`DENIED_NETWORKS` (loopback, private, link-local, carrier-grade NAT, benchmarking,
  multicast, reserved, unspecified and broadcast ranges, IPv4-mapped and NAT64/6to4/Teredo
  addresses that embed a denied IPv4 address), and the host's own addresses as they are at
  that moment (:func:`host_addresses`). It then connects to an address it checked, never
  looking the name up again (no DNS rebinding between the check and the connection).

Refusals carry a stable reason code (:data:`REASONS`), sent to the tool as the
``X-Hermes-Egress-Refused`` header of a 403 and logged.
"""
from __future__ import annotations

import ipaddress
import re
import socket
from dataclasses import dataclass

from . import own_addresses

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address


#: Why a request was refused: the ``X-Hermes-Egress-Refused`` header value.
REASONS = {
    "not_allowed": "the destination is not in hermes.sandbox.egress.allow",
    "denied": "the destination matches hermes.sandbox.egress.deny",
    "ip_literal": "an IP address is reachable only when allow names that address",
    "denied_address": "the name resolves to an address no sandbox may reach (loopback, "
                      "private, link-local, metadata, the host's own …)",
    "unresolvable": "the name does not resolve",
    "lookup_busy": "this sandbox has as many name lookups in flight as it may "
                   "(hermes.sandbox.egress.max_lookups); try again",
    "lookup_timeout": "the name did not resolve within hermes.sandbox.egress.lookup_timeout",
    "host_mismatch": "the Host field names another host or port than the request's URI",
    "length_required": "a plain http:// request with a body needs Content-Length "
                       "(Transfer-Encoding is not passed on)",
    "bad_request": "not an HTTP proxy request this proxy serves (CONNECT host:port, or an "
                   "absolute http:// URI)",
    "unreachable": "the destination did not accept a connection",
}

#: Ranges no sandbox reaches, whatever a name resolves to: the special-purpose ranges of
#: RFC 6890's registries that lead somewhere on a host or its networks (loopback, private,
#: link-local — the cloud metadata endpoint —, carrier-grade NAT, benchmarking, multicast,
#: reserved), and the IPv6 forms that carry an IPv4 address. The documentation ranges
#: (192.0.2/24, 198.51.100/24, 203.0.113/24, 2001:db8::/32) lead nowhere and are not here.
DENIED_NETWORKS = tuple(ipaddress.ip_network(n) for n in (
    "0.0.0.0/8", "10.0.0.0/8", "100.64.0.0/10", "127.0.0.0/8", "169.254.0.0/16",
    "172.16.0.0/12", "192.0.0.0/24", "192.88.99.0/24", "192.168.0.0/16", "198.18.0.0/15",
    "224.0.0.0/4", "240.0.0.0/4",
    "::/128", "::1/128", "::ffff:0:0/96", "::/96", "64:ff9b::/96", "64:ff9b:1::/48",
    "100::/64", "2001::/32", "2001:2::/48", "2001:10::/28", "2002::/16",
    "fc00::/7", "fe80::/10", "fec0::/10", "ff00::/8"))

_LABEL = re.compile(r"^(?!-)[a-z0-9-]{1,63}(?<!-)$")
_PORT = re.compile(r"^[0-9]{1,5}$")


def embedded_ipv4(addr: IPAddress) -> ipaddress.IPv4Address | None:
    """The IPv4 address an IPv6 address carries: IPv4-mapped (``::ffff:a.b.c.d``),
    IPv4-compatible (``::a.b.c.d``), NAT64 (``64:ff9b::/96``), 6to4 (``2002::/16``) or Teredo
    (``2001::/32``, the client's obfuscated address)."""
    if not isinstance(addr, ipaddress.IPv6Address):
        return None
    if addr.ipv4_mapped is not None:
        return addr.ipv4_mapped
    if addr.sixtofour is not None:
        return addr.sixtofour
    if addr.teredo is not None:
        return addr.teredo[1]
    if addr in ipaddress.ip_network("64:ff9b::/96") or addr in ipaddress.ip_network("::/96"):
        return ipaddress.IPv4Address(int(addr) & 0xFFFFFFFF)
    return None


def denied_address(addr: IPAddress, own: frozenset[IPAddress] = frozenset()) -> bool:
    """Is ``addr`` one no sandbox may reach: in :data:`DENIED_NETWORKS`, carrying a denied
    IPv4 address, or one of ``own`` (the host's addresses)?"""
    if addr in own or addr.is_multicast or addr.is_loopback or addr.is_link_local:
        return True
    if any(addr in net for net in DENIED_NETWORKS if net.version == addr.version):
        return True
    inner = embedded_ipv4(addr)
    return inner is not None and denied_address(inner, own)


def host_addresses() -> frozenset[IPAddress]:
    """The host's own addresses now (:mod:`.own_addresses`: read again when the kernel
    announces a change), so an address the host gets later is refused at once."""
    return own_addresses.now()


def normalize_host(host: str) -> str | None:
    """``host`` as rules compare it: an IP address in its compressed form (brackets of an
    IPv6 literal removed), or a lower-case IDNA name without a trailing dot. None when it is
    neither (empty, bad characters, a label too long)."""
    host = host.strip()
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    try:
        return str(ipaddress.ip_address(host))
    except ValueError:
        pass
    name = host.rstrip(".").lower()
    if not name or len(name) > 253:
        return None
    try:
        name = name.encode("idna").decode("ascii")
    except UnicodeError:
        return None
    return name if all(_LABEL.match(label) for label in name.split(".")) else None


def is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
        return True
    except ValueError:
        return False


@dataclass(frozen=True)
class Rule:
    """One ``allow``/``deny`` entry: ``host`` (normalized; ``*.`` kept for a wildcard) and
    ``port`` (None: any)."""
    host: str
    port: int | None

    @classmethod
    def parse(cls, entry: str) -> Rule:
        """``example.com``, ``*.example.com``, ``203.0.113.7``, ``[2001:db8::1]``, each with an
        optional ``:port``. Raises ValueError naming what is wrong."""
        text = entry.strip()
        port = None
        if text.startswith("["):
            host, closed, rest = text[1:].partition("]")
            if not closed:
                raise ValueError(f"{entry!r}: an IPv6 address needs its closing ]")
            if rest:
                if not rest.startswith(":"):
                    raise ValueError(f"{entry!r}: expected [address]:port")
                port = rest[1:]
        elif text.count(":") == 1:
            host, port = text.split(":")
        else:
            host = text
        if port is not None and (not _PORT.match(port) or not 0 < int(port) < 65536):
            raise ValueError(f"{entry!r}: the port must be 1-65535")
        wildcard = host.startswith("*.")
        norm = normalize_host(host[2:] if wildcard else host)
        if norm is None or (wildcard and is_ip(norm)):
            raise ValueError(f"{entry!r}: not a host name, *.name or IP address")
        return cls(("*." + norm) if wildcard else norm, None if port is None else int(port))

    def matches(self, host: str, port: int) -> bool:
        if self.port is not None and self.port != port:
            return False
        if self.host.startswith("*."):
            return not is_ip(host) and host.endswith(self.host[1:])
        return host == self.host


@dataclass(frozen=True)
class Policy:
    """``hermes.sandbox.egress``: ``allow`` and ``deny`` rules (see the module doc)."""
    allow: tuple[Rule, ...] = ()
    deny: tuple[Rule, ...] = ()

    @classmethod
    def from_lists(cls, allow, deny) -> Policy:
        """Raises ValueError for an entry :meth:`Rule.parse` refuses."""
        return cls(tuple(Rule.parse(e) for e in allow), tuple(Rule.parse(e) for e in deny))

    def decide(self, host: str, port: int) -> str | None:
        """None when ``host:port`` may be asked for (its addresses are checked next), else
        the reason code (:data:`REASONS`). ``host`` as the request names it."""
        norm = normalize_host(host)
        if norm is None or not 0 < port < 65536:
            return "bad_request"
        if any(r.matches(norm, port) for r in self.deny):
            return "denied"
        if any(r.matches(norm, port) for r in self.allow):
            return None
        return "ip_literal" if is_ip(norm) else "not_allowed"


def resolve(host: str, port: int, own: frozenset[IPAddress] | None = None
            ) -> tuple[list[tuple[int, tuple]], str | None]:
    """Look ``host`` up once: ``(addresses, None)`` — ``(family, sockaddr)`` pairs to connect
    to, every one checked —, or ``([], reason)`` when it does not resolve
    (``unresolvable``) or any address is denied (``denied_address``: one bad answer taints
    the name)."""
    norm = normalize_host(host)
    if norm is None:
        return [], "bad_request"
    try:
        infos = socket.getaddrinfo(norm, port, type=socket.SOCK_STREAM)
    except (OSError, UnicodeError):
        return [], "unresolvable"
    own = host_addresses() if own is None else own
    out: list[tuple[int, tuple]] = []
    for family, _type, _proto, _name, sockaddr in infos:
        try:
            addr = ipaddress.ip_address(str(sockaddr[0]).split("%", 1)[0])
        except ValueError:
            return [], "denied_address"
        if denied_address(addr, own):
            return [], "denied_address"
        if (family, sockaddr) not in out:
            out.append((family, sockaddr))
    return (out, None) if out else ([], "unresolvable")
