"""Ambiguous request framing is refused by the real service (waitress), RFC 9112 §6.1/§6.3
(docs/configuring.md §Limits, hermes_service/web/framing.py). Raw sockets against ``python3 main.py``; no CLI
turn is run. Each refused request carries a second, smuggled request after its headers: it
must never be answered, nor reach the app."""
from __future__ import annotations

import json
import socket
import uuid

import pytest

from support.fixtures import API_KEY, ServiceProcess, base_config


@pytest.fixture(scope="module")
def svc(tmp_path_factory, model):
    tmp = tmp_path_factory.mktemp("framing")
    service = ServiceProcess(tmp, base_config(tmp, model.base_url)).start()
    yield service
    service.stop()


def read_responses(s: socket.socket, count: int | None = None) -> tuple[list, bool]:
    """Responses ``(status, headers, body)`` read from ``s``: ``count`` of them, or (None) all
    until the service closes the connection. Returns (responses, closed)."""
    data, responses = b"", []
    while count is None or len(responses) < count:
        head_end = data.find(b"\r\n\r\n")
        if head_end >= 0:
            head = data[:head_end].decode("latin-1").split("\r\n")
            headers = {k.strip().lower(): v.strip()
                       for k, v in (line.split(":", 1) for line in head[1:])}
            length = int(headers.get("content-length", "0"))
            if len(data) >= head_end + 4 + length:
                responses.append((int(head[0].split()[1]), headers,
                                  data[head_end + 4:head_end + 4 + length]))
                data = data[head_end + 4 + length:]
                continue
        chunk = s.recv(65536)
        if not chunk:
            return responses, True
        data += chunk
    return responses, False


def exchange(svc, raw: bytes) -> tuple[list[tuple[int, dict, bytes]], bool]:
    """Send ``raw`` on a new connection; read until the service closes it (a socket timeout
    fails the test). Returns (responses, closed)."""
    with socket.create_connection(("127.0.0.1", svc.port), timeout=10) as s:
        s.sendall(raw)
        return read_responses(s)


def smuggled(user: str) -> bytes:
    """A complete request that creates a session for ``user`` if it is ever served."""
    body = json.dumps({"user_id": user}).encode()
    return (b"POST /api/v1/sessions HTTP/1.1\r\nHost: x\r\nX-API-Key: " + API_KEY.encode()
            + b"\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(body)
            + body)


def chunked(payload: bytes) -> bytes:
    return b"%x\r\n%s\r\n0\r\n\r\n" % (len(payload), payload)


def request(framing: bytes, body: bytes, path: bytes = b"/api/v1/sessions",
            version: bytes = b"HTTP/1.1", extra: bytes = b"") -> bytes:
    return (b"POST " + path + b" " + version + b"\r\nHost: x\r\nX-API-Key: " + API_KEY.encode()
            + b"\r\nContent-Type: application/json\r\n" + extra + framing + b"\r\n" + body)


def sessions_of(svc, user: str) -> list:
    return svc.get(f"/api/v1/sessions?user_id={user}").json()["sessions"]


AMBIGUOUS = {
    # one header line, chunked twice: waitress undid the chunking once
    "chunked-chunked": b"Transfer-Encoding: chunked, chunked\r\n",
    "two-te-lines": b"Transfer-Encoding: chunked\r\nTransfer-Encoding: chunked\r\n",
    "gzip-then-chunked": b"Transfer-Encoding: gzip, chunked\r\n",
    "chunked-not-final": b"Transfer-Encoding: chunked, gzip\r\n",
    "identity": b"Transfer-Encoding: identity\r\n",
    "empty-te": b"Transfer-Encoding: \r\n",
    "te-and-cl": b"Transfer-Encoding: chunked\r\nContent-Length: 4\r\n",
    "cl-and-te": b"Content-Length: 4\r\nTransfer-Encoding: chunked\r\n",
    "cl-twice": b"Content-Length: 4\r\nContent-Length: 4\r\n",
    # header names are case-insensitive (RFC 9110 §5.1): the parser's quick look for the two
    # names must not miss these
    "te-upper-case": b"TRANSFER-ENCODING: chunked, chunked\r\n",
    "cl-twice-mixed-case": b"content-LENGTH: 4\r\nCONTENT-length: 4\r\n",
}


@pytest.mark.parametrize("name", list(AMBIGUOUS))
def test_an_ambiguous_framing_is_refused_and_the_connection_closed(svc, name):
    user = f"smuggled_{name}_{uuid.uuid4().hex[:6]}"
    # the body, read any way, is followed by a complete request: never to be served
    body = b"{}\r\n" + chunked(b'{"user_id": "x"}') + smuggled(user)
    responses, closed = exchange(svc, request(AMBIGUOUS[name], body))
    assert len(responses) == 1 and closed, responses
    status, headers, payload = responses[0]
    assert status == 400
    assert headers["content-type"].startswith("application/json")
    assert headers["connection"] == "close"
    err = json.loads(payload)
    assert err["code"] == "bad_request_framing" and "RFC 9112" in err["detail"]
    assert err["requestId"] == headers["x-request-id"]
    assert sessions_of(svc, user) == []
    svc.wait_log(f"refused POST /api/v1/sessions: {err['detail']}")


def test_transfer_encoding_in_an_http_1_0_request_is_refused(svc):
    user = f"smuggled_http10_{uuid.uuid4().hex[:6]}"
    body = chunked(b'{"user_id": "x"}') + smuggled(user)
    responses, closed = exchange(svc, request(b"Transfer-Encoding: chunked\r\n", body,
                                              version=b"HTTP/1.0",
                                              extra=b"Connection: keep-alive\r\n"))
    assert [r[0] for r in responses] == [400] and closed
    assert json.loads(responses[0][2])["code"] == "bad_request_framing"
    assert sessions_of(svc, user) == []


def test_a_request_of_no_other_header_line_is_refused_in_the_same_shape(svc):
    """Only the framing header (no Host, no key): still our JSON refusal, not waitress's."""
    user = f"smuggled_bare_{uuid.uuid4().hex[:6]}"
    raw = (b"POST /api/v1/sessions HTTP/1.1\r\nTransfer-Encoding: chunked, chunked\r\n\r\n"
           + chunked(b"{}") + smuggled(user))
    responses, closed = exchange(svc, raw)
    assert [r[0] for r in responses] == [400] and closed, responses
    status, headers, payload = responses[0]
    assert headers["content-type"].startswith("application/json")
    assert json.loads(payload)["code"] == "bad_request_framing"
    assert sessions_of(svc, user) == []


def test_the_client_routes_answer_in_their_own_error_shape(svc):
    responses, closed = exchange(svc, request(AMBIGUOUS["chunked-chunked"], chunked(b"{}"),
                                              path=b"/api/hermes/client/runs?traceId=t_1"))
    assert len(responses) == 1 and closed
    status, headers, payload = responses[0]
    err = json.loads(payload)
    assert status == 400 and err["ok"] is False and err["code"] == "hermes_client_bad_request"
    assert err["traceId"] == "t_1" and err["requestId"] == headers["x-request-id"]
    assert "Transfer-Encoding" in err["message"]


def test_plain_chunked_and_content_length_requests_still_work_on_one_connection(svc):
    a, b = f"chunked_{uuid.uuid4().hex[:6]}", f"length_{uuid.uuid4().hex[:6]}"
    first = request(b"Transfer-Encoding: Chunked\r\n",          # codings are case-insensitive
                    b"5\r\n{\"use\r\n" + chunked(f'r_id": "{a}"}}'.encode()))
    second = smuggled(b)              # a well-framed Content-Length request, pipelined
    with socket.create_connection(("127.0.0.1", svc.port), timeout=10) as s:
        s.sendall(first + second)
        responses, closed = read_responses(s, 2)
        assert [r[0] for r in responses] == [200, 200] and not closed, responses
        s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")   # keep-alive: still open
        assert [r[0] for r in read_responses(s, 1)[0]] == [200]
    assert len(sessions_of(svc, a)) == 1 and len(sessions_of(svc, b)) == 1
