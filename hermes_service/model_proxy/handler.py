"""The pass-through's HTTP server and the intake of each request (docs/sandbox.md §What the
pass-through forwards): the route, the credential, the length, the user's share and the
budget, the body read within its time and checked; every refusal answered here, in the
OpenAI API's error shape, after the caller's body is drained. The request then goes to
:class:`~.relay.Relay`. The handler reaches the pass-through through its public methods
only (:class:`~.relay.Endpoint`)."""
from __future__ import annotations

import logging
import socket
import sys
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from .. import metrics
from . import limits
from .policy import Prepared, Refusal, route
from .relay import Endpoint, Relay, reply

log = logging.getLogger("hermes_service.model_proxy")


class Server(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True
    request_queue_size = 128          # listen backlog: many Hermes processes connect at once
    endpoint: Endpoint

    def verify_request(self, request, client_address) -> bool:
        return self.endpoint.open_connections() < limits.MAX_CONNECTIONS

    def handle_error(self, request, client_address) -> None:
        """A caller that went away is routine (debug); anything else is a bug (logged with
        its traceback on our logger, never on stderr)."""
        exc = sys.exc_info()[1]
        if isinstance(exc, OSError):
            log.debug("model proxy: connection ended: %s", type(exc).__name__)
        else:
            log.exception("model proxy: unexpected error in a request")


class Server6(Server):
    address_family = socket.AF_INET6


class Handler(BaseHTTPRequestHandler):
    """One connection to the pass-through: the intake of each request on it (route,
    credential, length, budget, shares, the body read and checked; every refusal), then its
    :class:`~.relay.Relay`."""
    protocol_version = "HTTP/1.1"
    server: Server
    server_version = "hermes-service-model-proxy"
    sys_version = ""
    timeout = limits.CLIENT_TIMEOUT

    @property
    def endpoint(self) -> Endpoint:
        """The pass-through this request came to (its server's)."""
        return self.server.endpoint

    def log_message(self, format, *args):  # noqa: A002  (no per-request stderr lines)
        pass

    def setup(self):
        super().setup()
        try:
            self.connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        except OSError:
            pass
        self.endpoint.track(self.connection, True)

    def finish(self):
        try:
            super().finish()
            if getattr(self, "_linger", False):
                self._lingering_close()
        finally:
            self.endpoint.track(self.connection, False)

    def _lingering_close(self) -> None:
        """After refusing a request whose body was not read: stop writing and read (and
        drop) what the caller still sends, for up to :data:`~.limits.LINGER_SECONDS`,
        before the connection is closed — closing with unread data makes the kernel reset the
        connection, which can destroy the refusal on its way (RFC 9112 §9.6)."""
        conn = self.connection
        try:
            conn.shutdown(socket.SHUT_WR)
            deadline = time.monotonic() + limits.LINGER_SECONDS
            while (left := deadline - time.monotonic()) > 0:
                conn.settimeout(left)
                if not conn.recv(1 << 16):
                    return
        except OSError:
            return

    def do_GET(self):
        self._handle()

    do_POST = do_PUT = do_PATCH = do_DELETE = do_HEAD = do_OPTIONS = do_GET

    def _handle(self) -> None:
        proxy = self.endpoint
        prepared: Prepared | None = None
        try:
            path = route(self.command, self.path)
            user = proxy.user_for(self.headers.get("Authorization"))
            if user is None:
                self._drain_or_close()
                metrics.model_request("unauthorized")
                reply(self, 401, "Incorrect API key provided: this endpoint needs the credential "
                            "issued to this Hermes process.", "invalid_request_error",
                            "invalid_api_key", {"WWW-Authenticate": 'Bearer realm="model"'})
                return
            length = self._length(proxy.policy.max_body)
            if self.command == "GET" and length:
                raise Refusal(400, "invalid_request_body", "GET takes no body")
            proxy.check_budget(user)
            proxy.bodies.admit(proxy.policy, user, length)
        except Refusal as refusal:
            self._refuse(refusal)
            return
        with proxy.admit(user, length) as denied:
            if denied is not None:
                self._refuse(denied)
                return
            body = self._read_body(length)
            if body is None:
                return
            if self.command == "POST":
                try:
                    prepared = proxy.prepare(user, body, self.headers.get("Content-Type"))
                except Refusal as refusal:
                    self._refuse(refusal, read=True)
                    return
                body = prepared.body
            settings, relay = proxy.settings, Relay(self, proxy)
            started = time.perf_counter()
            status = None
            try:
                if prepared is None:
                    status = relay.forward(settings, user, path[len("/v1"):], body, None)
                else:
                    with proxy.reserve(user, prepared):
                        status = relay.forward(settings, user, path[len("/v1"):], body,
                                               prepared)
            except Refusal as refusal:
                self._refuse(refusal, read=True)
                return
            finally:
                ms = (time.perf_counter() - started) * 1000
                log.debug("model request user=%s %s %s status=%s ms=%.1f", user, self.command,
                          path, status if status is not None else "aborted", ms,
                          extra={"status": status, "duration_ms": round(ms, 1)})

    def _read_body(self, length: int) -> bytes | None:
        """The request body, received whole within :data:`~.limits.BODY_SECONDS` (else 408
        and the connection closed: a caller trickling a body holds a share of the body
        budget); None when it did not come."""
        if not length:
            return b""
        deadline = time.monotonic() + limits.BODY_SECONDS
        parts, got = [], 0
        while got < length:
            left = deadline - time.monotonic()
            if left <= 0:
                self.close_connection = True
                reply(self, 408, f"the request body did not arrive within "
                            f"{limits.BODY_SECONDS:g} s", "invalid_request_error",
                            "request_timeout")
                return None
            self.connection.settimeout(min(left, limits.CLIENT_TIMEOUT))
            try:
                chunk = self.rfile.read1(min(length - got, 1 << 20))
            except (TimeoutError, OSError):
                chunk = b""
            if not chunk:
                self.close_connection = True
                if time.monotonic() >= deadline:
                    continue           # answered above, on the next turn of the loop
                return None
            parts.append(chunk)
            got += len(chunk)
        self.connection.settimeout(limits.CLIENT_TIMEOUT)
        return b"".join(parts)

    def _length(self, cap: int) -> int:
        """The request's ``Content-Length`` (0 without one). Raises :class:`Refusal`: 411 for
        ``Transfer-Encoding`` (Hermes's client sends a length), 400 for a bad length, 413
        above ``cap``."""
        if self.headers.get("Transfer-Encoding"):
            self.close_connection = True
            raise Refusal(411, "length_required", "a request body must be sent with "
                          "Content-Length")
        values = self.headers.get_all("Content-Length") or []
        try:
            if len(set(v.strip() for v in values)) > 1 or \
                    any(not v.strip().isdigit() for v in values):
                raise ValueError
            length = int(values[0]) if values else 0
        except ValueError:
            self.close_connection = True
            raise Refusal(400, "bad_request", "invalid Content-Length") from None
        if length > cap:
            self.close_connection = True
            raise Refusal(413, "request_too_large", f"request body over {cap} bytes (the "
                          "pass-through's cap: docs/sandbox.md)")
        return length

    def _refuse(self, refusal: Refusal, read: bool = False) -> None:
        """Answer a refused request here (never forwarded); ``refused`` in the metric unless
        it is an unknown route (Hermes's own local-server probes). ``read``: its body was
        read already."""
        if not read:
            self._drain_or_close()
        if refusal.counted:
            metrics.model_request("refused")
        reply(self, refusal.status, refusal.message, refusal.etype, refusal.code,
                    refusal.headers)

    def _drain_or_close(self) -> None:
        """Refusing a request whose body was not read: read and drop the body first (up to
        :data:`~.limits.DRAIN_BYTES`, within :data:`~.limits.LINGER_SECONDS`), so the caller
        has sent it all before the refusal comes — closing with unread data makes the kernel
        reset the connection, which can destroy the refusal on its way at any hop (the
        sandbox's forwarder, RFC 9112 §9.6). A body of 1 MiB or less keeps the connection
        usable; anything else closes it (a body without a length: after a lingering
        close)."""
        try:
            length = int(self.headers.get("Content-Length") or 0)
        except ValueError:
            length = -1
        if self.headers.get("Transfer-Encoding") or length < 0:
            self.close_connection = True
            self._linger = True
            return
        if not length:
            return
        if length > 1024 * 1024:
            self.close_connection = True
        left = min(length, limits.DRAIN_BYTES)
        deadline = time.monotonic() + limits.LINGER_SECONDS
        try:
            while left > 0 and (room := deadline - time.monotonic()) > 0:
                self.connection.settimeout(room)
                chunk = self.rfile.read1(min(left, 1 << 20))
                if not chunk:
                    break
                left -= len(chunk)
            self.connection.settimeout(limits.CLIENT_TIMEOUT)
        except OSError:
            self.close_connection = True
            return
        if left > 0 or length > limits.DRAIN_BYTES:
            self.close_connection = True
            self._linger = True
