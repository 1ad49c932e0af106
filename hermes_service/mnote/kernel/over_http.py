"""The kernel over HTTP: ``POST <mnote.page_store.url>`` of the §2 envelope, the §3 answer
back (docs/mnote-tools.md §The kernel adapter).

:class:`HttpKernel` keeps a few connections alive for reuse (the standard library's
:mod:`http.client`: one request at a time per connection, at most :data:`POOL_SIZE` idle),
verifies TLS against the system's trust store or ``mnote.page_store.ca_file``, never goes
through an HTTP proxy, sends ``Authorization: Bearer <credential>`` when
``mnote.page_store.credential_env`` names one (the value is read from the service's
environment at each call and appears in nothing this module logs or raises), and holds every
exchange to its deadline: a socket timeout for each wait, and a watchdog thread that shuts
the socket when the deadline passes (a kernel dripping its answer byte by byte is cut too).
Answers above :data:`~.kernel_wire.MAX_ANSWER_BYTES` are not read.
"""
from __future__ import annotations

import heapq
import http.client
import itertools
import os
import socket
import ssl
import threading
import time
from urllib.parse import urlsplit

from .wire import MAX_ANSWER_BYTES, KernelFailure

#: idle keep-alive connections kept for reuse
POOL_SIZE = 4
#: statuses that mean the kernel was not reached (a gateway in front of it): retried
RETRY_STATUSES = frozenset({502, 503, 504})


class _Watchdog:
    """One thread shutting the sockets of exchanges past their deadline."""

    def __init__(self):
        self._cv = threading.Condition()
        self._heap: list[list] = []
        self._order = itertools.count()
        self._thread: threading.Thread | None = None

    def arm(self, deadline: float, conn: http.client.HTTPConnection) -> list:
        entry = [deadline, next(self._order), conn, False]
        with self._cv:
            heapq.heappush(self._heap, entry)
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name="kernel-watchdog",
                                                daemon=True)
                self._thread.start()
            self._cv.notify()
        return entry

    def disarm(self, entry: list) -> bool:
        """Forget ``entry``; True if its socket was shut (the connection is not reusable)."""
        with self._cv:
            entry[2] = None
            return entry[3]

    def _loop(self) -> None:
        with self._cv:
            while True:
                while self._heap and self._heap[0][2] is None:
                    heapq.heappop(self._heap)
                if not self._heap:
                    self._cv.wait()
                    continue
                wait = self._heap[0][0] - time.monotonic()
                if wait > 0:
                    self._cv.wait(wait)
                    continue
                entry = heapq.heappop(self._heap)
                entry[3] = True
                sock = getattr(entry[2], "sock", None)
                if sock is not None:
                    try:
                        sock.shutdown(socket.SHUT_RDWR)
                    except OSError:
                        pass


_WATCHDOG = _Watchdog()


class HttpKernel:
    """``exchange(body, deadline) -> (status, answer bytes)`` against one kernel URL."""
    transport = "http"

    def __init__(self, url: str, *, credential_env: str | None = None,
                 ca_file: str | None = None, pool_size: int = POOL_SIZE):
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError("the kernel URL must be http(s)://host[:port]/path")
        self.url = url
        self.https = parts.scheme == "https"
        self.host, self.port = parts.hostname, parts.port
        self.path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
        self.credential_env = credential_env
        self.context = ssl.create_default_context(cafile=ca_file) if self.https else None
        self.pool_size = pool_size
        self._idle: list[http.client.HTTPConnection] = []
        self._lock = threading.Lock()

    def _connection(self, timeout: float) -> http.client.HTTPConnection:
        with self._lock:
            conn = self._idle.pop() if self._idle else None
        if conn is None:
            if self.https:
                conn = http.client.HTTPSConnection(self.host, self.port, timeout=timeout,
                                                   context=self.context)
            else:
                conn = http.client.HTTPConnection(self.host, self.port, timeout=timeout)
        else:
            conn.timeout = timeout
            if conn.sock is not None:
                conn.sock.settimeout(timeout)
        return conn

    def _release(self, conn: http.client.HTTPConnection, reusable: bool) -> None:
        if reusable:
            with self._lock:
                if len(self._idle) < self.pool_size:
                    self._idle.append(conn)
                    return
        conn.close()

    def close(self) -> None:
        """Close the idle connections."""
        with self._lock:
            idle, self._idle = self._idle, []
        for conn in idle:
            conn.close()

    def _headers(self, length: int) -> dict:
        headers = {"Content-Type": "application/json", "Accept": "application/json",
                   "Content-Length": str(length), "User-Agent": "hermes-service kernel adapter"}
        if self.credential_env:
            value = os.environ.get(self.credential_env, "")
            if not (value and value.isascii() and value.isprintable() and " " not in value):
                raise KernelFailure("unauthorized", f"{self.credential_env} is unset or not "
                                                    "one header-safe token")
            headers["Authorization"] = f"Bearer {value}"
        return headers

    def exchange(self, body: bytes, deadline: float) -> tuple[int, bytes]:
        """POST ``body``; the status and the answer's bytes. KernelFailure: ``unreachable``
        (retryable: refused, reset, closed before answering, a 502/503/504), ``timeout``
        (the deadline passed), ``tls``, ``too_large``, ``bad_answer`` (not HTTP)."""
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise KernelFailure("timeout", "no time left for another attempt")
        headers = self._headers(len(body))
        conn = self._connection(remaining)
        entry = _WATCHDOG.arm(deadline, conn)
        reusable = False
        try:
            conn.request("POST", self.path, body=body, headers=headers)
            resp = conn.getresponse()
            data = self._read(resp)
            reusable = not resp.will_close
        except KernelFailure:
            raise
        except Exception as exc:   # noqa: BLE001 - every way a request can fail has a reason
            raise self._failure(exc, deadline) from None
        finally:
            fired = _WATCHDOG.disarm(entry)
            self._release(conn, reusable and not fired)
        if resp.status in RETRY_STATUSES:
            self.close()          # a restarted kernel: the idle connections are stale too
            raise KernelFailure("unreachable", f"HTTP {resp.status}", retryable=True)
        return resp.status, data

    @staticmethod
    def _read(resp: http.client.HTTPResponse) -> bytes:
        # the length http.client parsed (None: chunked, or a value it could not read — then
        # read to the cap like a chunked answer)
        if resp.length is not None:
            if resp.length > MAX_ANSWER_BYTES:
                raise KernelFailure("too_large", f"Content-Length {resp.length} (limit "
                                                 f"{MAX_ANSWER_BYTES})")
            return resp.read()                 # IncompleteRead when cut short
        data = resp.read(MAX_ANSWER_BYTES + 1)
        if len(data) > MAX_ANSWER_BYTES:
            raise KernelFailure("too_large", f"more than {MAX_ANSWER_BYTES} bytes")
        return data

    def _failure(self, exc: Exception, deadline: float) -> KernelFailure:
        """The failure of an exchange that raised ``exc`` (its class name, and an errno's
        text, are all the log gets of it)."""
        name = type(exc).__name__
        if time.monotonic() >= deadline or isinstance(exc, (TimeoutError, socket.timeout)):
            return KernelFailure("timeout", f"no complete answer by the deadline ({name})")
        if isinstance(exc, ssl.SSLCertVerificationError):
            return KernelFailure("tls", f"certificate not verified ({exc.verify_message})")
        if isinstance(exc, ssl.SSLError):
            return KernelFailure("tls", f"TLS failed ({exc.reason})")
        if isinstance(exc, http.client.IncompleteRead):
            whole = len(exc.partial) + (exc.expected or 0)
            return KernelFailure("bad_answer", f"the answer was cut short "
                                               f"({len(exc.partial)} of {whole} bytes)")
        if isinstance(exc, http.client.RemoteDisconnected):
            self.close()
            return KernelFailure("unreachable", "closed without answering", retryable=True)
        if isinstance(exc, (http.client.HTTPException, ValueError)):
            return KernelFailure("bad_answer", f"not an HTTP answer ({name})")
        if isinstance(exc, OSError):
            self.close()
            why = exc.strerror or name
            return KernelFailure("unreachable", why, retryable=True)
        return KernelFailure("bad_answer", name)
