"""What a sandbox may ask of this service through its ``service.sock`` (docs/sandbox.md
§Network): the routes that take a run token (the mnote tool endpoint), one request per
connection, paced.

:func:`forward` serves one connection from inside a sandbox: it reads the request head
(at most :data:`MAX_HEAD` bytes, within :data:`HEAD_TIMEOUT` seconds), refuses what is not a
request under one of the allowed path prefixes (``allowed``: the run-token route families'
paths, set by the app factory) with **403** and an ``X-Hermes-Refused`` reason, sends the
rest to the service with ``Connection: close`` and exactly the ``Content-Length`` bytes of
body that follow (``Transfer-Encoding`` is refused with 411: a second request pipelined
behind the first never reaches the service), and relays the answer back. Nothing else of the
service — its API keys' routes, ``/metrics``, ``/health`` — is reachable from a sandbox, and
a refused request costs the service no request, no access log line and no thread.

:class:`Pace` is a token bucket per sandbox: at most :data:`RATE` requests a second
(:data:`BURST` at once after a quiet while); a faster caller waits. One sandbox's flood then
reaches the service at a rate that cannot crowd other callers out.
"""
from __future__ import annotations

import asyncio
import time
from collections.abc import Iterable

MAX_HEAD = 16 * 1024
HEAD_TIMEOUT = 30.0
RATE = 20.0          # requests per second per sandbox, sustained
BURST = 40           # requests at once after a quiet while
REFUSED_HEADER = "X-Hermes-Refused"
_DROP = ("connection", "keep-alive", "proxy-connection", "proxy-authorization", "upgrade",
         "te", "trailer")


class Pace:
    """A token bucket (:data:`RATE` a second, :data:`BURST` deep) for one sandbox's requests."""

    def __init__(self, rate: float = RATE, burst: int = BURST):
        self.rate, self.burst = rate, burst
        self.tokens, self.at = float(burst), time.monotonic()

    async def take(self) -> None:
        """Wait until a request may go (never refuses: a fast caller is slowed, not failed)."""
        while True:
            now = time.monotonic()
            self.tokens = min(self.burst, self.tokens + (now - self.at) * self.rate)
            self.at = now
            if self.tokens >= 1:
                self.tokens -= 1
                return
            await asyncio.sleep((1 - self.tokens) / self.rate)


def allowed_path(path: str, prefixes: Iterable[str]) -> bool:
    """Is ``path`` (the request target, query cut off) one a sandbox may call? A prefix
    ending in ``/`` owns everything below it; any other names that path only. A target with
    a dot segment or an encoded dot or slash is never allowed (no way around the check by
    normalisation)."""
    target = path.split("?", 1)[0]
    if not target.startswith("/") or any(seg in (".", "..") for seg in target.split("/")):
        return False
    low = target.lower()
    if any(enc in low for enc in ("%2e", "%2f", "%5c", "\\")):
        return False
    for prefix in prefixes:
        if prefix.endswith("/") and (target.startswith(prefix) or target == prefix[:-1]):
            return True
        if target == prefix:
            return True
    return False


def parse(head: bytes, prefixes: Iterable[str]) -> tuple[bytes, int] | tuple[str, str]:
    """``(head to send, body length)`` for an allowed request head, else ``(status line,
    reason)`` to refuse it with."""
    lines = head.decode("latin-1").split("\r\n")
    parts = lines[0].split(" ")
    if len(parts) != 3 or not parts[2].startswith("HTTP/1."):
        return "400 Bad Request", "bad_request"
    if not allowed_path(parts[1], prefixes):
        return "403 Forbidden", "not_a_sandbox_route"
    length, fields = 0, []
    for line in lines[1:]:
        if not line:
            continue
        name, sep, value = line.partition(":")
        key = name.lower()
        if not sep or not name or name != name.strip():      # no "Name :", no folded line
            return "400 Bad Request", "bad_request"
        if key == "transfer-encoding":
            return "411 Length Required", "length_required"
        if key == "content-length":
            if length or not value.strip().isdigit():
                return "400 Bad Request", "bad_request"
            length = int(value.strip())
        if key not in _DROP:
            fields.append(line)
    out = "\r\n".join([lines[0], *fields, "Connection: close"]) + "\r\n\r\n"
    return out.encode("latin-1"), length


async def refuse(writer: asyncio.StreamWriter, status: str, reason: str) -> None:
    body = f"{reason}\n".encode()
    writer.write((f"HTTP/1.1 {status}\r\nContent-Type: text/plain\r\nContent-Length: "
                  f"{len(body)}\r\n{REFUSED_HEADER}: {reason}\r\nConnection: close\r\n\r\n"
                  ).encode() + body)
    try:
        await writer.drain()
    except (ConnectionError, OSError):
        pass


async def forward(reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                  target: tuple[str, int], prefixes: Iterable[str], pace: Pace,
                  chunk: int = 64 * 1024) -> str | None:
    """Serve one connection (module doc); returns the refusal reason, or None."""
    try:
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), HEAD_TIMEOUT)
    except (TimeoutError, asyncio.IncompleteReadError, asyncio.LimitOverrunError,
            ConnectionError, OSError):
        await refuse(writer, "400 Bad Request", "bad_request")
        return "bad_request"
    parsed = parse(head, prefixes)
    if isinstance(parsed[0], str):
        await refuse(writer, *parsed)
        return parsed[1]
    send, length = parsed
    await pace.take()
    try:
        o_reader, o_writer = await asyncio.wait_for(asyncio.open_connection(*target), 10)
    except (TimeoutError, OSError):
        await refuse(writer, "502 Bad Gateway", "unreachable")
        return "unreachable"
    try:
        o_writer.write(send)
        left = length
        while left:
            data = await reader.read(min(chunk, left))
            if not data:
                return None
            o_writer.write(data)
            await o_writer.drain()
            left -= len(data)
        while data := await o_reader.read(chunk):
            writer.write(data)
            await writer.drain()
    except (ConnectionError, OSError):
        pass
    finally:
        o_writer.close()
    return None
