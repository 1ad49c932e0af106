"""The egress proxy's protocol: one HTTP proxy connection from inside a sandbox
(docs/sandbox.md §Network; the policy: :mod:`hermes_service.sandbox.net.egress_policy`).

Served by :mod:`hermes_service.sandbox.net.sockets` on each sandbox's ``egress.sock``, which the
sandbox's forwarder offers inside as ``http://127.0.0.1:3128`` (``HTTP_PROXY``,
``HTTPS_PROXY``, ``ALL_PROXY``). Two request forms (RFC 9110 §9.3.6, RFC 9112 §3.2):

* ``CONNECT host:port HTTP/1.1`` — a tunnel (HTTPS, git over TLS, …): ``200 Connection
  established``, then bytes both ways until the origin closes (the sandbox closing its
  side only passes the end of input on).
* ``METHOD http://host[:port]/path HTTP/1.x`` — a plain-HTTP request: sent to the origin in
  origin form (``METHOD /path``) with ``Host`` set to the name and port the proxy checked (the
  client's ``Host`` dropped; one naming another host or port is refused, ``host_mismatch``),
  ``Connection: close`` and without the ``Proxy-*`` fields; then exactly its body
  (``Content-Length`` bytes; ``Transfer-Encoding`` is refused, 411 ``length_required``) —
  nothing the sandbox sends after it reaches the origin, so no second request with another
  ``Host`` rides behind the first — and the answer until the origin closes.

Anything else (an ``https://`` absolute URI, origin form, userinfo in the authority, a head
:mod:`.http_head` refuses, over :data:`MAX_HEAD` bytes or not complete within
:data:`HEAD_TIMEOUT` seconds) is 400. A port or length is ASCII digits only (no ``²``).
A request the policy refuses is **403** with ``X-Hermes-Egress-Refused: <reason>``
(:data:`egress_policy.REASONS`) and a one-line text body; an allowed name that cannot be
reached is 502 (``unreachable``); a name this sandbox cannot look up now is 503
(``lookup_busy``: its lookups in flight at their cap) or 504 (``lookup_timeout``) — each
sandbox's lookups are its own (:mod:`.lookups`).
Why this is the project's own code rather than a packaged proxy: the identity of the caller
is the sandbox socket it came in on, and each request is checked against the addresses the
proxy itself resolved and then connected to — the two things the packaged proxies we could
run (tinyproxy, squid) do not do per socket.
"""
from __future__ import annotations

import asyncio
import socket
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from . import egress_policy, http_head, relay
from .egress_policy import Policy

MAX_HEAD = 16 * 1024            # bytes of a request line and its header fields
HEAD_TIMEOUT = 30.0             # seconds to send them
CONNECT_TIMEOUT = 10.0          # seconds to reach an origin (each resolved address)
IDLE_TIMEOUT = 300.0            # seconds without a byte either way closes a tunnel
MAX_LENGTH_DIGITS = 15          # a Content-Length of more digits is refused (~1 PB)
REFUSED_HEADER = "X-Hermes-Egress-Refused"
#: the status line of each refusal (any other reason: 403)
STATUS = {"bad_request": "400 Bad Request", "host_mismatch": "400 Bad Request",
          "length_required": "411 Length Required", "unreachable": "502 Bad Gateway",
          "lookup_busy": "503 Service Unavailable", "lookup_timeout": "504 Gateway Timeout"}
_DROP = ("proxy-authorization", "proxy-connection", "connection", "keep-alive", "host",
         "content-length")


@dataclass
class Outcome:
    """What one proxy connection did: ``host``/``port`` asked for, ``refused`` (a reason code
    or None), bytes ``up`` (sandbox → origin) and ``down``."""
    host: str | None = None
    port: int | None = None
    refused: str | None = None
    up: int = 0
    down: int = 0


@dataclass(frozen=True)
class Request:
    """A request the proxy may serve: the checked ``host`` (normalized) and ``port``; for a
    plain-HTTP request the ``upstream`` head for the origin and the ``body`` bytes that follow
    (None for ``CONNECT``: a tunnel, no head, no end)."""
    method: str
    host: str
    port: int
    upstream: bytes = b""
    body: int | None = None


async def reply(sock: socket.socket, reason: str) -> None:
    """Refuse with ``reason``'s status (:data:`STATUS`), the reason header and a text line."""
    text = egress_policy.REASONS.get(reason, "") + "\n"
    head = [f"HTTP/1.1 {STATUS.get(reason, '403 Forbidden')}",
            "Content-Type: text/plain; charset=utf-8", f"Content-Length: {len(text.encode())}",
            "Connection: close", f"{REFUSED_HEADER}: {reason}"]
    try:
        async with asyncio.timeout(HEAD_TIMEOUT):
            await relay.send_all(sock, ("\r\n".join(head) + "\r\n\r\n" + text).encode())
    except (TimeoutError, OSError):
        pass


def authority(text: str, default_port: int | None) -> tuple[str, int] | None:
    """``(host, port)`` of an authority (``name[:port]``, ``[v6][:port]``; no userinfo), the
    host normalized (:func:`egress_policy.normalize_host`), the port ``default_port`` when
    absent or empty; None when it is not one, or has no port and no default."""
    if "@" in text:
        return None
    if text.startswith("["):
        host, closed, tail = text[1:].partition("]")
        if not closed or (tail and not tail.startswith(":")) or not egress_policy.is_ip(host):
            return None
        port_text = tail[1:] if tail else ""
    else:
        host, sep, port_text = text.rpartition(":")
        if not sep:
            host, port_text = text, ""
        if ":" in host:
            return None
    port = default_port if not port_text else http_head.number(port_text, 5)
    norm = egress_policy.normalize_host(host)
    if norm is None or port is None or not 0 < port < 65536:
        return None
    return norm, port


def parse_request(head: bytes) -> Request | str:
    """The :class:`Request` a head asks for, or the reason to refuse it (``bad_request``,
    ``host_mismatch``, ``length_required``). Never raises."""
    h = http_head.parse(head)
    if h is None:
        return "bad_request"
    if h.method == "CONNECT":
        dest = authority(h.target, None)
        return "bad_request" if dest is None else Request("CONNECT", *dest)
    if h.target[:7].lower() != "http://":
        return "bad_request"
    rest = h.target[7:]
    cut = min([i for i in (rest.find("/"), rest.find("?")) if i >= 0] or [len(rest)])
    dest, path = authority(rest[:cut], 80), rest[cut:]
    if dest is None or "#" in path:
        return "bad_request"
    hosts, lengths = h.values("host"), h.values("content-length")
    if len(hosts) > 1 or len(lengths) > 1:
        return "bad_request"
    if hosts and authority(hosts[0], 80) != dest:
        return "host_mismatch"
    if h.values("transfer-encoding"):
        return "length_required"
    length = http_head.number(lengths[0], MAX_LENGTH_DIGITS) if lengths else 0
    if length is None:
        return "bad_request"
    host, port = dest
    # the origin is told the name the proxy checked, and only that (no fronting another
    # name behind an allowed one on a shared host)
    named = f"[{host}]" if ":" in host else host
    fields = [f"{h.method} {path if path.startswith('/') else '/' + path} {h.version}",
              f"Host: {named}" + (f":{port}" if port != 80 else ""), *h.without(_DROP)]
    if length:
        fields.append(f"Content-Length: {length}")
    upstream = ("\r\n".join([*fields, "Connection: close"]) + "\r\n\r\n").encode("latin-1")
    return Request(h.method, host, port, upstream, length)


async def _dial(addresses: list[tuple[int, tuple]]) -> socket.socket | None:
    """Connect to the first of the checked ``addresses`` that answers (never by name)."""
    loop = asyncio.get_running_loop()
    for family, sockaddr in addresses:
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setblocking(False)
        try:
            await asyncio.wait_for(loop.sock_connect(sock, sockaddr), CONNECT_TIMEOUT)
            return sock
        except (TimeoutError, OSError):
            sock.close()
    return None


Resolver = Callable[[str, int], Awaitable[tuple[list, str | None]]]


async def serve(sock: socket.socket, policy: Policy, resolver: Resolver) -> Outcome:
    """Serve one proxy connection on the non-blocking ``sock`` to its end (the caller closes
    it); returns what it did (the caller logs and counts it). ``resolver(host, port)``:
    ``(addresses, None)`` or ``([], reason)`` (:func:`egress_policy.resolve` on the
    sandbox's own lookups). Never raises for anything the client or the origin does."""
    out = Outcome()
    got = await relay.read_head(sock, MAX_HEAD, HEAD_TIMEOUT)
    req = parse_request(got[0]) if got is not None else "bad_request"
    if isinstance(req, str):
        out.refused = req
    else:
        out.host, out.port = req.host, req.port
        out.refused = policy.decide(req.host, req.port)
    addresses: list = []
    if out.refused is None:
        addresses, out.refused = await resolver(out.host or "", out.port or 0)
    far = await _dial(addresses) if out.refused is None else None
    if out.refused is None and far is None:
        out.refused = "unreachable"
    if out.refused is not None or far is None or got is None or isinstance(req, str):
        await reply(sock, out.refused or "unreachable")
        return out
    try:
        first = got[1]
        if req.body is None:
            await relay.send_all(sock, b"HTTP/1.1 200 Connection established\r\n\r\n")
            limit = None
        else:
            first = req.upstream + first[:req.body]
            limit = len(req.upstream) + req.body

        def up(n: int) -> None:
            out.up += n

        def down(n: int) -> None:
            out.down += n
        await relay.both(sock, far, first_up=first, up_limit=limit, idle=IDLE_TIMEOUT,
                         up=up, down=down)
    except OSError:
        pass
    finally:
        far.close()
    return out
