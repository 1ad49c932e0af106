"""The one byte pipe of a sandbox's sockets (docs/sandbox.md §Network): the egress proxy's
tunnels and plain-HTTP requests, the model socket's relay, and the service gate's body and
answer all move their bytes here.

* :func:`copy` — one direction, from one non-blocking socket to another, on the running
  asyncio loop. Where the platform has ``os.splice`` the bytes go socket → a pipe of its own
  → socket inside the kernel (no byte enters Python; at most :data:`PIPE_BYTES` in flight);
  elsewhere, or for a socket the kernel cannot splice, through one reused buffer of
  :data:`BUFFER` bytes. Nothing more is read while the last piece waits to be written
  (back-pressure: a slow reader slows the writer, no whole body is held). Bytes moved are
  counted (``count``); at most ``limit`` are moved when given; ``idle`` seconds with nothing
  to read or no room to write end it. At the source's end of input it shuts the destination's
  write side (half-close: the other direction goes on) unless ``half_close`` is False.
* :func:`both` — the two directions of one connection until the answer (far side → sandbox)
  ends.
* :func:`read_head` — an HTTP request head (up to its blank line, at most ``limit`` bytes,
  within ``timeout`` seconds) and the bytes that came after it.

Errors of either peer (reset, broken pipe, timeout) end a copy quietly: the caller sees the
bytes moved, never an exception, except cancellation.
"""
from __future__ import annotations

import asyncio
import contextlib
import errno
import fcntl
import os
import socket
from collections.abc import Callable

#: bytes asked of one ``splice``/``recv`` (the pipe's capacity is raised to it where allowed)
BUFFER = 1 << 20
PIPE_BYTES = BUFFER
#: ``os.splice`` where the platform has it; None: every copy goes through the buffer
SPLICE: Callable[..., int] | None = getattr(os, "splice", None)
_SPLICE_FLAGS = getattr(os, "SPLICE_F_MOVE", 0) | getattr(os, "SPLICE_F_NONBLOCK", 0)
_F_SETPIPE_SZ = getattr(fcntl, "F_SETPIPE_SZ", 1031)
#: the errors of a splice the kernel does not do for this pair of files (then: the buffer)
_NO_SPLICE = (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP)
_ENDED = (TimeoutError, ConnectionError, OSError)


def _wake(fut: asyncio.Future) -> None:
    if not fut.done():
        fut.set_result(None)


async def _ready(sock: socket.socket, write: bool) -> None:
    """Wait until ``sock`` can be read (or written)."""
    loop = asyncio.get_running_loop()
    fut = loop.create_future()
    fd = sock.fileno()
    if write:
        loop.add_writer(fd, _wake, fut)
    else:
        loop.add_reader(fd, _wake, fut)
    try:
        await fut
    finally:
        if write:
            loop.remove_writer(fd)
        else:
            loop.remove_reader(fd)


async def send_all(sock: socket.socket, data: bytes | memoryview) -> None:
    """Write all of ``data`` to the non-blocking ``sock``, waiting for room. Raises OSError."""
    view = memoryview(data)
    while view:
        try:
            view = view[sock.send(view):]
        except BlockingIOError:
            await _ready(sock, True)


def _pipe() -> tuple[int, int] | None:
    if SPLICE is None:
        return None
    r, w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
    with contextlib.suppress(OSError):      # a smaller pipe only means more rounds
        fcntl.fcntl(w, _F_SETPIPE_SZ, PIPE_BYTES)
    return r, w


async def _splice_round(src: socket.socket, dst: socket.socket, pipe: tuple[int, int],
                        want: int) -> int:
    """Move up to ``want`` bytes ``src`` → pipe → ``dst``; 0 at ``src``'s end of input."""
    r, w = pipe
    assert SPLICE is not None          # a pipe is made only where splice is
    while True:
        try:
            n = SPLICE(src.fileno(), w, want, flags=_SPLICE_FLAGS)
            break
        except BlockingIOError:
            await _ready(src, False)
    left = n
    while left:
        try:
            left -= SPLICE(r, dst.fileno(), left, flags=_SPLICE_FLAGS)
        except BlockingIOError:
            await _ready(dst, True)
    return n


async def _buffer_round(src: socket.socket, dst: socket.socket, buf: bytearray,
                        want: int) -> int:
    while True:
        try:
            n = src.recv_into(buf, want)
            break
        except BlockingIOError:
            await _ready(src, False)
    await send_all(dst, memoryview(buf)[:n])
    return n


async def copy(src: socket.socket, dst: socket.socket, *, first: bytes = b"",
               limit: int | None = None, idle: float | None = None,
               count: Callable[[int], None] | None = None, half_close: bool = True) -> int:
    """Move bytes ``src`` → ``dst`` (module doc) until ``src``'s end of input, ``limit`` bytes
    (``first``, bytes already read from ``src``, go before and count), an error of either
    peer, or ``idle`` seconds without progress. Returns the bytes moved."""
    moved = 0
    pipe = None
    buf: bytearray | None = None
    try:
        if first:
            first = first if limit is None else first[:limit]
            async with asyncio.timeout(idle):
                await send_all(dst, first)
            moved = len(first)
            if count is not None:
                count(moved)
        pipe = _pipe()
        while limit is None or moved < limit:
            want = BUFFER if limit is None else min(BUFFER, limit - moved)
            async with asyncio.timeout(idle):
                if pipe is not None:
                    try:
                        n = await _splice_round(src, dst, pipe, want)
                    except OSError as exc:
                        if exc.errno not in _NO_SPLICE:
                            raise
                        _close(pipe)
                        pipe = None
                        continue
                else:
                    buf = buf if buf is not None else bytearray(BUFFER)
                    n = await _buffer_round(src, dst, buf, want)
            if not n:
                break
            moved += n
            if count is not None:
                count(n)
    except _ENDED:
        pass
    finally:
        if pipe is not None:
            _close(pipe)
        if half_close:
            with contextlib.suppress(OSError):
                dst.shutdown(socket.SHUT_WR)
    return moved


def _close(pipe: tuple[int, int]) -> None:
    for fd in pipe:
        os.close(fd)


async def both(near: socket.socket, far: socket.socket, *, first_up: bytes = b"",
               up_limit: int | None = None, idle: float | None = None,
               up: Callable[[int], None] | None = None,
               down: Callable[[int], None] | None = None) -> None:
    """Relay ``near`` (the sandbox's side) and ``far`` both ways until the downward copy
    (``far`` → ``near``) ends; the sandbox ending its input only passes that on (half-close).
    ``first_up``: bytes for ``far`` before any read from ``near``; ``up_limit``: at most that
    many bytes go up (``first_up`` included), then nothing more is read from ``near`` and
    ``far`` is not half-closed (a request's exact body); ``up``/``down``: counters."""
    upward = asyncio.ensure_future(copy(near, far, first=first_up, limit=up_limit, idle=idle,
                                        count=up, half_close=up_limit is None))
    try:
        await copy(far, near, idle=idle, count=down)
    finally:
        upward.cancel()
        await asyncio.gather(upward, return_exceptions=True)


async def read_head(sock: socket.socket, limit: int, timeout: float
                    ) -> tuple[bytes, bytes] | None:
    """``(head, rest)``: the bytes up to and including the first blank line (``\\r\\n\\r\\n``)
    and what was read after it; None when the head is longer than ``limit`` bytes, the peer
    ends before it or fails, or it is not complete within ``timeout`` seconds."""
    loop = asyncio.get_running_loop()
    data = b""
    try:
        async with asyncio.timeout(timeout):
            while True:
                chunk = await loop.sock_recv(sock, 65536)
                if not chunk:
                    return None
                start = max(0, len(data) - 3)
                data += chunk
                end = data.find(b"\r\n\r\n", start)
                if end >= 0 and end + 4 <= limit:
                    return data[:end + 4], data[end + 4:]
                if end >= 0 or len(data) > limit:
                    return None
    except _ENDED:
        return None
