"""A small recording HTTP proxy for tests (standard library only).

Records the target of every request it is asked to carry, then carries it:

* ``CONNECT host:port`` (HTTPS through a proxy): recorded as ``("CONNECT", "host:port")``, then
  tunnelled (``502`` when the target cannot be reached — the test machine has no internet);
* an absolute-form request (``GET http://host:port/path``, plain HTTP through a proxy):
  recorded as ``(METHOD, "host:port")`` and forwarded with ``Connection: close`` (and without
  ``Proxy-Authorization``, which is for the proxy); the answer is relayed until the target
  closes (so streamed answers pass through unchanged).

``RecordingProxy(auth=("user", "password"))`` answers either kind with **407** (RFC 9110
§15.5.8) unless it carries ``Proxy-Authorization: Basic`` with those credentials; refused
requests are recorded too. :attr:`RecordingProxy.requests` has each request's headers.

Usage::

    with RecordingProxy() as proxy:       # proxy.url = "http://127.0.0.1:<port>"
        ...                               # HTTP_PROXY=proxy.url HTTPS_PROXY=proxy.url
        proxy.targets()                   # {"127.0.0.1:8000", "pypi.org:443", ...}
"""
from __future__ import annotations

import base64
import select
import socket
import socketserver
import threading
from urllib.parse import urlsplit

__all__ = ["RecordingProxy"]


def _relay(a: socket.socket, b: socket.socket) -> None:
    """Copy bytes both ways until either side closes."""
    socks = [a, b]
    while True:
        readable, _, _ = select.select(socks, [], [], 30)
        if not readable:
            return
        for s in readable:
            try:
                data = s.recv(65536)
            except OSError:
                return
            if not data:
                return
            (b if s is a else a).sendall(data)


class _Handler(socketserver.BaseRequestHandler):
    server: _Server

    def handle(self) -> None:
        conn = self.request
        conn.settimeout(30)
        head = b""
        while b"\r\n\r\n" not in head:
            chunk = conn.recv(65536)
            if not chunk:
                return
            head += chunk
        header_blob, rest = head.split(b"\r\n\r\n", 1)
        lines = header_blob.decode("latin-1").split("\r\n")
        method, target, _version = ([*lines[0].split(" ", 2), "", ""])[:3]
        fields = {}
        for h in lines[1:]:
            name, _, value = h.partition(":")
            fields[name.strip().lower()] = value.strip()
        if method == "CONNECT":
            self.server.record("CONNECT", target, fields)
            if not self.server.authorized(fields):
                conn.sendall(self.server.REFUSED)
                return
            host, _, port = target.rpartition(":")
            try:
                upstream = socket.create_connection((host.strip("[]"), int(port)), timeout=5)
            except (OSError, ValueError):
                conn.sendall(b"HTTP/1.1 502 Bad Gateway\r\nContent-Length: 0\r\n\r\n")
                return
            conn.sendall(b"HTTP/1.1 200 Connection established\r\n\r\n")
            with upstream:
                if rest:
                    upstream.sendall(rest)
                _relay(conn, upstream)
            return
        url = urlsplit(target)
        if not url.hostname:
            conn.sendall(b"HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\n\r\n")
            return
        port = url.port or 80
        self.server.record(method, f"{url.hostname}:{port}", fields)
        if not self.server.authorized(fields):
            conn.sendall(self.server.REFUSED)
            return
        path = (url.path or "/") + (f"?{url.query}" if url.query else "")
        headers = [h for h in lines[1:] if h.split(":", 1)[0].strip().lower()
                   not in ("connection", "proxy-connection", "keep-alive", "proxy-authorization")]
        length = 0
        for h in headers:
            name, _, value = h.partition(":")
            if name.strip().lower() == "content-length":
                length = int(value.strip())
        while len(rest) < length:
            chunk = conn.recv(65536)
            if not chunk:
                break
            rest += chunk
        request = "\r\n".join([f"{method} {path} HTTP/1.1", *headers, "Connection: close", "", ""])
        try:
            upstream = socket.create_connection((url.hostname, port), timeout=5)
        except OSError:
            conn.sendall(b"HTTP/1.1 502 Bad Gateway\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")
            return
        with upstream:
            upstream.settimeout(None)
            upstream.sendall(request.encode("latin-1") + rest[:length])
            while True:
                try:
                    data = upstream.recv(65536)
                except OSError:
                    break
                if not data:
                    break
                conn.sendall(data)


class _Server(socketserver.ThreadingTCPServer):
    daemon_threads = True
    allow_reuse_address = True

    REFUSED = (b"HTTP/1.1 407 Proxy Authentication Required\r\n"
               b'Proxy-Authenticate: Basic realm="proxy"\r\nContent-Length: 0\r\n'
               b"Connection: close\r\n\r\n")

    def __init__(self, auth: tuple[str, str] | None = None):
        super().__init__(("127.0.0.1", 0), _Handler)
        self.seen: list[tuple[str, str]] = []
        self.requests: list[tuple[str, str, dict[str, str]]] = []
        self.lock = threading.Lock()
        self.expected = (None if auth is None else
                         "Basic " + base64.b64encode(":".join(auth).encode()).decode())

    def record(self, method: str, target: str, fields: dict[str, str]) -> None:
        with self.lock:
            self.seen.append((method, target))
            self.requests.append((method, target, fields))

    def authorized(self, fields: dict[str, str]) -> bool:
        return self.expected is None or fields.get("proxy-authorization") == self.expected


class RecordingProxy:
    """Start with :meth:`start` (or ``with``); ``url``, ``seen`` (method, host:port) in order,
    ``requests`` (method, host:port, {lower-case header name: value}) in order. ``auth``:
    ``(user, password)`` the proxy insists on (407 otherwise), None for none."""

    def __init__(self, auth: tuple[str, str] | None = None):
        self._server = _Server(auth)
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever,
                                        kwargs={"poll_interval": 0.1}, daemon=True)

    @property
    def seen(self) -> list[tuple[str, str]]:
        with self._server.lock:
            return list(self._server.seen)

    @property
    def requests(self) -> list[tuple[str, str, dict[str, str]]]:
        with self._server.lock:
            return list(self._server.requests)

    def targets(self) -> set[str]:
        """Every ``host:port`` asked for so far."""
        return {t for _, t in self.seen}

    def start(self) -> RecordingProxy:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()

    def __enter__(self) -> RecordingProxy:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
