"""Connection-level limits of the real service (waitress): connection limit and idle timeout.

No CLI turn is run: these only open sockets against ``python3 main.py``.
"""
import select
import socket

import requests

OLD_WAITRESS_LIMIT = 100


def connect(svc, source="127.0.0.1") -> socket.socket:
    s = socket.create_connection(("127.0.0.1", svc.port), timeout=10, source_address=(source, 0))
    return s


def read_response_head(s: socket.socket, timeout: float = 10.0) -> bytes:
    s.settimeout(timeout)
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = s.recv(65536)
        if not chunk:
            break
        data += chunk
    return data


def test_idle_connections_of_a_refused_peer_do_not_lock_out_allowed_clients(start_service):
    # 127.0.0.2 is not in allowed_ips; its idle connections never send a byte
    svc = start_service()
    idle = []
    try:
        for _ in range(OLD_WAITRESS_LIMIT + 50):
            idle.append(connect(svc, source="127.0.0.2"))
        res = requests.get(svc.url + "/health", timeout=5)   # would wait behind the idle ones
        assert res.status_code == 200
        res = svc.get("/api/v1/sessions?user_id=alice", timeout=5)
        assert res.status_code == 200
    finally:
        for s in idle:
            s.close()


def test_idle_and_incomplete_connections_are_dropped(start_service):
    svc = start_service({"service": {"idle_timeout_seconds": 2}})
    idle = connect(svc)
    partial = connect(svc)
    partial.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n")     # headers never finished
    for s in (idle, partial):
        s.settimeout(20)                                     # far below the old 3600 s
        assert s.recv(1) == b""                              # the service closed it
        s.close()


def test_a_declared_oversized_body_is_refused_before_it_is_sent(start_service):
    svc = start_service()
    s = connect(svc, source="127.0.0.2")                     # neither allowed nor keyed
    s.sendall(b"POST /api/v1/sessions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
              b"Content-Length: 52428800\r\n\r\n")           # 50 MiB announced, none sent
    head = read_response_head(s)
    assert head.startswith(b"HTTP/1.1 413"), head
    s.close()


def test_a_body_of_exactly_max_body_bytes_still_reaches_the_app(start_service):
    svc = start_service({"service": {"max_body_bytes": 1048576}})
    body = b'{"user_id": "alice"' + b" " * (1048576 - 20) + b"}"
    assert len(body) == 1048576
    res = svc.post("/api/v1/sessions", data=body, headers={"Content-Type": "application/json"})
    assert res.status_code == 200, res.text


def test_a_chunked_body_is_cut_at_the_limit(start_service):
    svc = start_service({"service": {"max_body_bytes": 1048576}})
    s = connect(svc)
    s.sendall(b"POST /api/v1/sessions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
              b"Transfer-Encoding: chunked\r\n\r\n")
    chunk = b"x" * 65536
    frame = b"%x\r\n%s\r\n" % (len(chunk), chunk)
    sent, total = 0, 64 * 1048576                           # would be 64 MiB
    answered = b""
    try:
        while sent < total:
            s.sendall(frame)
            sent += len(chunk)
            if select.select([s], [], [], 0)[0]:            # the service answered mid-body
                answered = s.recv(65536)
                break
    except (BrokenPipeError, ConnectionResetError):
        pass                                                # or closed on us: cut as well
    if not answered:
        try:
            answered = read_response_head(s, timeout=5)
        except OSError:
            answered = b""
    s.close()
    assert sent < total / 4, f"the service read {sent} bytes of a chunked body"
    assert not answered or answered.startswith(b"HTTP/1.1 413"), answered
