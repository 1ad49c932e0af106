"""The egress proxy's protocol: one HTTP proxy connection from inside a sandbox
(docs/sandbox.md §Network; the policy: :mod:`hermes_service.sandbox.net.egress_policy`).

Served by :mod:`hermes_service.sandbox.net.sockets` on each sandbox's ``egress.sock``, which the
sandbox's forwarder offers inside as ``http://127.0.0.1:3128`` (``HTTP_PROXY``,
``HTTPS_PROXY``, ``ALL_PROXY``). Two request forms (RFC 9110 §9.3.6, RFC 9112 §3.2):

* ``CONNECT host:port HTTP/1.1`` — a tunnel (HTTPS, git over TLS, …): ``200 Connection
  established``, then bytes both ways until the origin closes (the sandbox closing its
  side only passes the end of input on).
* ``METHOD http://host[:port]/path HTTP/1.x`` — a plain-HTTP request: sent to the origin in
  origin form (``METHOD /path``) with ``Connection: close`` and without the ``Proxy-*``
  fields; then bytes both ways until the origin closes (one request per connection).

Anything else (an ``https://`` absolute URI, origin form, a head over :data:`MAX_HEAD`
bytes or not complete within :data:`HEAD_TIMEOUT` seconds) is 400. A request the policy
refuses is **403** with ``X-Hermes-Egress-Refused: <reason>`` (:data:`egress_policy.REASONS`)
and a one-line text body; an allowed name that cannot be reached is 502 (``unreachable``).
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
from urllib.parse import urlsplit

from . import egress_policy
from .egress_policy import Policy

MAX_HEAD = 16 * 1024            # bytes of a request line and its header fields
HEAD_TIMEOUT = 30.0             # seconds to send them
CONNECT_TIMEOUT = 10.0          # seconds to reach an origin (each resolved address)
IDLE_TIMEOUT = 300.0            # seconds without a byte either way closes a tunnel
CHUNK = 64 * 1024
REFUSED_HEADER = "X-Hermes-Egress-Refused"
_DROP = ("proxy-authorization", "proxy-connection", "connection", "keep-alive", "host")


@dataclass
class Outcome:
    """What one proxy connection did: ``host``/``port`` asked for, ``refused`` (a reason code
    or None), bytes ``up`` (sandbox → origin) and ``down``."""
    host: str | None = None
    port: int | None = None
    refused: str | None = None
    up: int = 0
    down: int = 0


async def reply(writer: asyncio.StreamWriter, status: str, reason: str | None) -> None:
    text = (egress_policy.REASONS.get(reason, "") if reason else "") + "\n"
    head = [f"HTTP/1.1 {status}", "Content-Type: text/plain; charset=utf-8",
            f"Content-Length: {len(text.encode())}", "Connection: close"]
    if reason:
        head.append(f"{REFUSED_HEADER}: {reason}")
    writer.write(("\r\n".join(head) + "\r\n\r\n" + text).encode())
    try:
        await writer.drain()
    except (ConnectionError, OSError):
        pass


def parse_head(head: bytes) -> tuple[str, str, int, bytes] | None:
    """``(method, host, port, head to send the origin)`` of a proxy request head (ending in
    the blank line), or None when it is not one this proxy serves. For CONNECT the last item
    is empty."""
    try:
        text = head.decode("latin-1")
    except UnicodeDecodeError:          # latin-1 decodes everything; kept for clarity
        return None
    lines = text.split("\r\n")
    parts = lines[0].split(" ")
    if len(parts) != 3 or not parts[2].startswith("HTTP/1."):
        return None
    method, target, version = parts
    if method == "CONNECT":
        host, sep, port = target.rpartition(":")
        if not sep or not port.isdigit():
            return None
        return method, host, int(port), b""
    url = urlsplit(target)
    if url.scheme.lower() != "http" or not url.hostname:
        return None
    try:
        url_port = url.port or 80
    except ValueError:
        return None
    path = url.path or "/"
    if url.query:
        path += "?" + url.query
    # the origin is told the host the proxy checked, whatever Host the request carried (no
    # fronting another name behind an allowed one)
    fields = [ln for ln in lines[1:] if ln and ln.split(":", 1)[0].strip().lower() not in _DROP]
    host = url.netloc.rpartition("@")[2]
    out = "\r\n".join([f"{method} {path} {version}", f"Host: {host}", *fields,
                        "Connection: close"]) + "\r\n\r\n"
    return method, url.hostname, url_port, out.encode("latin-1")


async def _pipe(src: asyncio.StreamReader, dst: asyncio.StreamWriter, count: Callable[[int], None]
                ) -> None:
    try:
        while True:
            data = await asyncio.wait_for(src.read(CHUNK), IDLE_TIMEOUT)
            if not data:
                break
            count(len(data))
            dst.write(data)
            await dst.drain()
    except (TimeoutError, ConnectionError, OSError):
        pass
    finally:
        try:
            if dst.can_write_eof():
                dst.write_eof()
        except (OSError, RuntimeError):
            pass


async def _dial(addresses: list[tuple[int, tuple]]
                ) -> tuple[asyncio.StreamReader, asyncio.StreamWriter] | None:
    """Connect to the first of the checked ``addresses`` that answers (never by name)."""
    for family, sockaddr in addresses:
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setblocking(False)
        try:
            await asyncio.wait_for(asyncio.get_running_loop().sock_connect(sock, sockaddr),
                                   CONNECT_TIMEOUT)
            return await asyncio.open_connection(sock=sock)
        except (TimeoutError, OSError):
            sock.close()
    return None


async def relay_both(upward: Awaitable, downward: Awaitable) -> None:
    """Run both directions of a relay until the downward one (origin → sandbox) ends; an
    upward end (the sandbox done sending) only passes the end of input on. Either way
    the connection is over once the answer is."""
    down = asyncio.ensure_future(downward)
    up = asyncio.ensure_future(upward)
    try:
        await down
    finally:
        up.cancel()
        await asyncio.gather(up, return_exceptions=True)


Resolver = Callable[[str, int], Awaitable[tuple[list, str | None]]]


async def default_resolver(host: str, port: int) -> tuple[list, str | None]:
    return await asyncio.get_running_loop().run_in_executor(
        None, egress_policy.resolve, host, port)


async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                policy: Policy, resolver: Resolver = default_resolver) -> Outcome:
    """Serve one proxy connection to its end and close it; returns what it did (the caller
    logs and counts it). Never raises for anything the client or the origin does."""
    try:
        return await _serve(reader, writer, policy, resolver)
    finally:
        writer.close()


async def _serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                 policy: Policy, resolver: Resolver) -> Outcome:
    out = Outcome()
    try:
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), HEAD_TIMEOUT)
    except (TimeoutError, asyncio.IncompleteReadError, asyncio.LimitOverrunError,
            ConnectionError, OSError):
        out.refused = "bad_request"
        await reply(writer, "400 Bad Request", "bad_request")
        return out
    parsed = parse_head(head)
    if parsed is None:
        out.refused = "bad_request"
        await reply(writer, "400 Bad Request", "bad_request")
        return out
    method, out.host, out.port, upstream_head = parsed
    why = policy.decide(out.host, out.port)
    addresses: list = []
    if why is None:
        addresses, why = await resolver(out.host, out.port)
    if why is not None:
        out.refused = why
        await reply(writer, "403 Forbidden", why)
        return out
    conn = await _dial(addresses)
    if conn is None:
        out.refused = "unreachable"
        await reply(writer, "502 Bad Gateway", "unreachable")
        return out
    o_reader, o_writer = conn
    try:
        if method == "CONNECT":
            writer.write(b"HTTP/1.1 200 Connection established\r\n\r\n")
            await writer.drain()
        else:
            o_writer.write(upstream_head)
            out.up += len(upstream_head)

        def up(n: int) -> None:
            out.up += n

        def down(n: int) -> None:
            out.down += n
        await relay_both(_pipe(reader, o_writer, up), _pipe(o_reader, writer, down))
    except (ConnectionError, OSError):
        pass
    finally:
        o_writer.close()
    return out
