"""The one byte pipe (hermes_service/sandbox/net/relay.py), on real socket pairs, with the
kernel's splice and without it: every byte arrives in order and is counted, a request's body
stops at its limit (a second request behind it never goes), the end of one direction is
passed on while the other goes on, a peer that stops reading holds the writer back, and a
head is read with what came after it."""
from __future__ import annotations

import asyncio
import os
import socket

import pytest

from hermes_service.sandbox.net import relay


@pytest.fixture(params=["splice", "buffer"])
def mode(request, monkeypatch):
    if request.param == "buffer":
        monkeypatch.setattr(relay, "SPLICE", None)
    elif relay.SPLICE is None:
        pytest.skip("no os.splice on this platform")
    return request.param


def pair() -> tuple[socket.socket, socket.socket]:
    a, b = socket.socketpair()
    a.setblocking(False)
    b.setblocking(False)
    return a, b


async def read_all(sock: socket.socket) -> bytes:
    loop = asyncio.get_running_loop()
    got = b""
    while chunk := await loop.sock_recv(sock, 1 << 16):
        got += chunk
    return got


def test_every_byte_arrives_in_order_and_is_counted(mode):
    data = os.urandom(3 * relay.BUFFER + 12345)

    async def main():
        src_w, src = pair()
        dst, dst_r = pair()
        counted = []
        task = asyncio.create_task(relay.copy(src, dst, first=b"head:", count=counted.append))
        reader = asyncio.create_task(read_all(dst_r))
        await asyncio.get_running_loop().sock_sendall(src_w, data)
        src_w.shutdown(socket.SHUT_WR)
        moved = await asyncio.wait_for(task, 30)
        got = await asyncio.wait_for(reader, 30)      # ends: the copy half-closed dst
        for s in (src_w, src, dst, dst_r):
            s.close()
        return moved, counted, got
    moved, counted, got = asyncio.run(main())
    assert got == b"head:" + data
    assert moved == sum(counted) == len(data) + 5


def test_a_limit_passes_exactly_the_body_and_nothing_after_it(mode):
    async def main():
        src_w, src = pair()
        dst, dst_r = pair()
        await asyncio.get_running_loop().sock_sendall(
            src_w, b"body!GET / HTTP/1.1\r\nHost: other.example\r\n\r\n")
        moved = await asyncio.wait_for(
            relay.copy(src, dst, first=b"HEAD ", limit=10, half_close=False), 10)
        dst.close()                                  # what the relay sent, then the end
        got = await read_all(dst_r)
        for s in (src_w, src, dst_r):
            s.close()
        return moved, got
    moved, got = asyncio.run(main())
    assert (moved, got) == (10, b"HEAD body!")      # the second request never went


def test_one_direction_ending_leaves_the_other_going(mode):
    async def main():
        loop = asyncio.get_running_loop()
        near_peer, near = pair()
        far, far_peer = pair()
        up, down = [], []
        task = asyncio.create_task(relay.both(near, far, up=up.append, down=down.append))
        await loop.sock_sendall(near_peer, b"request")
        near_peer.shutdown(socket.SHUT_WR)           # the sandbox is done sending
        assert await read_all(far_peer) == b"request"        # its end is passed on ...
        await loop.sock_sendall(far_peer, b"answer after the end")   # ... the answer goes on
        far_peer.shutdown(socket.SHUT_WR)
        got = await read_all(near_peer)
        await asyncio.wait_for(task, 10)
        for s in (near_peer, near, far, far_peer):
            s.close()
        return got, sum(up), sum(down)
    assert asyncio.run(main()) == (b"answer after the end", 7, 20)


def test_a_peer_that_stops_reading_holds_the_writer_back(mode):
    """Back-pressure: with the destination's reader asleep, the relay takes no more from the
    source than the kernel's buffers and one piece in flight hold — never the whole stream."""
    async def main():
        loop = asyncio.get_running_loop()
        src_w, src = pair()
        dst, dst_r = pair()
        counted = []
        task = asyncio.create_task(relay.copy(src, dst, count=counted.append))
        sent = 0
        chunk = b"x" * 65536
        while sent < 64 * relay.BUFFER:
            try:
                sent += src_w.send(chunk)
            except BlockingIOError:
                try:
                    await asyncio.wait_for(loop.sock_sendall(src_w, chunk), 1.0)
                    sent += len(chunk)
                except TimeoutError:
                    break                            # the source is full: held back
        held = sum(counted)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        for s in (src_w, src, dst, dst_r):
            s.close()
        return sent, held
    sent, held = asyncio.run(main())
    assert sent < 64 * relay.BUFFER, "the writer was never held back"
    assert held < 8 * relay.BUFFER


@pytest.mark.parametrize("stream,expected", [
    ([b"GET / HTTP/1.1\r\n\r\nbody"], (b"GET / HTTP/1.1\r\n\r\n", b"body")),
    ([b"GET / HT", b"TP/1.1\r", b"\n\r", b"\nrest"], (b"GET / HTTP/1.1\r\n\r\n", b"rest")),
    ([b"GET / HTTP/1.1\r\n"], None),                                  # ends before its end
    ([b"X" * 200 + b"\r\n\r\n"], None),                               # over the limit
])
def test_a_head_is_read_with_what_came_after_it(stream, expected):
    async def main():
        w, r = pair()
        for part in stream:
            await asyncio.get_running_loop().sock_sendall(w, part)
            await asyncio.sleep(0.01)
        w.shutdown(socket.SHUT_WR)
        got = await relay.read_head(r, 100, 10)
        w.close()
        r.close()
        return got
    assert asyncio.run(main()) == expected


def test_a_head_not_sent_in_time_is_none():
    async def main():
        w, r = pair()
        await asyncio.get_running_loop().sock_sendall(w, b"GET / HTTP/1.1\r\n")
        got = await relay.read_head(r, 100, 0.2)
        w.close()
        r.close()
        return got
    assert asyncio.run(main()) is None
