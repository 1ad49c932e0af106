"""Forwarding one checked request to the provider and relaying its answer (docs/sandbox.md
§Forwarding, §Answers): the allowlisted headers and the real key on the way out, the
provider's status, headers and body back chunk by chunk, the usage counted."""
from __future__ import annotations

import http.client
import json
import logging
import os
import select
import socket
import ssl
import time
from collections.abc import Iterator
from contextlib import AbstractContextManager
from http.server import BaseHTTPRequestHandler
from typing import Protocol

from .. import metrics
from . import limits
from .body_check import BodyChecker
from .policy import Policy, Prepared, Refusal, UsageStripper, forward_headers
from .upstream import Connections, Upstream
from .usage import UsageReader

# RFC 9110 §7.6.1 (plus Proxy-Connection, Keep-Alive of RFC 2068); lower-case
HOP_BY_HOP = frozenset({"connection", "keep-alive", "proxy-connection", "proxy-authenticate",
                        "proxy-authorization", "te", "trailer", "trailers",
                        "transfer-encoding", "upgrade"})
_DROP_RESPONSE = HOP_BY_HOP | {"content-length"}

log = logging.getLogger("hermes_service.model_proxy")


def openai_error(message: str, etype: str, code: str) -> bytes:
    """An OpenAI-style error body: ``{"error": {"message", "type", "param": null, "code"}}``."""
    return json.dumps({"error": {"message": message, "type": etype, "param": None,
                                 "code": code}}).encode()


class Usage(Protocol):
    """Where usage is counted: :class:`~hermes_service.model_proxy.usage.UsageStore`, or the
    shared storage's (:class:`~hermes_service.storage.usage.PgUsageStore`)."""
    def add(self, user_id: str, prompt_tokens: int, completion_tokens: int,
            day: str | None = None, estimated: bool = False) -> None: ...


class Endpoint(Protocol):
    """What a request handler needs of the pass-through (:class:`~.proxy.ModelProxy`)."""
    policy: Policy
    @property
    def usage(self) -> Usage: ...
    connections: Connections
    bodies: BodyChecker

    @property
    def settings(self) -> Upstream | None: ...
    def user_for(self, authorization: str | None) -> str | None: ...
    def check_budget(self, user_id: str) -> None: ...
    def reserve(self, user_id: str, prepared: Prepared) -> AbstractContextManager[None]: ...
    def admit(self, user_id: str, length: int) -> AbstractContextManager[Refusal | None]: ...
    def prepare(self, user_id: str, body: bytes, content_type: str | None) -> Prepared: ...
    def local_location(self, value: str) -> str: ...
    def track(self, conn: socket.socket, add: bool) -> None: ...
    def open_connections(self) -> int: ...


def reply(req: BaseHTTPRequestHandler, status: int, message: str, etype: str, code: str,
          extra_headers: dict | None = None) -> None:
    """Answer ``req`` here, in the OpenAI API's error shape (:func:`openai_error`)."""
    body = openai_error(message, etype, code)
    req.send_response(status)
    req.send_header("Content-Type", "application/json")
    req.send_header("Content-Length", str(len(body)))
    for k, v in (extra_headers or {}).items():
        req.send_header(k, v)
    req.end_headers()
    if req.command != "HEAD":
        req.wfile.write(body)


class Relay:
    """Forwarding one checked request of ``req`` (the :class:`~.handler.Handler` it came
    to, whose connection the answer goes back on) to the provider of ``endpoint``, and
    relaying the answer."""

    def __init__(self, req: BaseHTTPRequestHandler, endpoint: Endpoint):
        self.req = req
        self.endpoint = endpoint
        self._caller_gone = self._unbilled = False
        self._upstream_sock: socket.socket | None = None

    def forward(self, s: Upstream | None, user: str, suffix: str, body: bytes,
                prepared: Prepared | None) -> int | None:
        """Forward the request (``suffix``: its path after ``/v1``; ``body`` as checked,
        ``prepared`` for a chat request) and relay the answer; the status answered, counted
        in the user's usage."""
        proxy = self.endpoint
        if s is None:
            metrics.model_request("unreachable")
            reply(self.req, 502, "model provider unreachable: no model provider is configured",
                            "server_error", "upstream_unreachable")
            return 502
        if s.proxy_error is not None:
            metrics.model_request("unreachable")
            log.warning("model provider %s:%s not tried: %s", s.host, s.port, s.proxy_error)
            reply(self.req, 502, f"model provider unreachable: {s.proxy_error}", "server_error",
                            "upstream_unreachable")
            return 502
        headers = self._upstream_headers(s, body)
        target = s.base_path + suffix
        if not target.startswith("/"):
            target = "/" + target
        if s.proxy is not None and s.scheme == "http":   # RFC 9112 §3.2.2 absolute-form
            target = f"http://{s.netloc}{target}"
            if s.proxy.auth:
                headers.append(("Proxy-Authorization", s.proxy.auth))
        try:
            conn, resp = self._exchange(s, target, headers, body)
        except TimeoutError:
            metrics.model_request("unreachable")
            log.warning("model provider timed out (%s): no answer within %g s", s.where,
                        s.read_timeout)
            self.req.close_connection = True
            reply(self.req, 504, f"model provider timed out (no answer within "
                            f"{s.read_timeout:g} s)", "server_error", "upstream_timeout")
            return 504
        except (OSError, http.client.HTTPException, ssl.SSLError) as exc:
            metrics.model_request("unreachable")
            log.warning("model provider unreachable (%s): %s: %s", s.where,
                        type(exc).__name__, exc)
            reply(self.req, 502, f"model provider unreachable: {type(exc).__name__}",
                            "server_error", "upstream_unreachable")
            return 502
        metrics.model_request("ok" if resp.status < 400 else "provider_error")
        reader = UsageReader(resp.getheader("Content-Type"), resp.getheader("Content-Encoding"))
        strip = (prepared is not None and prepared.stream and not prepared.usage_asked
                 and 200 <= resp.status < 300 and reader.kind == "sse"
                 and (resp.getheader("Content-Encoding") or "identity").lower() == "identity")
        complete = False
        self._upstream_sock = conn.sock
        try:
            complete = self._relay(resp, reader, UsageStripper() if strip else None)
        finally:
            if complete and not resp.will_close:
                proxy.connections.put(s, conn, proxy.settings)
            else:
                conn.close()
            prompt, completion = reader.tokens()
            estimated = False
            if prepared is not None and 200 <= resp.status < 300 and not reader.reported:
                # the provider's usage never came (a stream cut before its usage chunk, a
                # provider that does not report it): counted from what went through — or, when
                # the caller left and its answer was not read to the end within the bounds, at
                # the output it asked for (what the provider may have billed unseen)
                prompt, completion = prepared.prompt_estimate, reader.estimate_completion()
                if self._unbilled:
                    completion = max(completion, prepared.max_output or 0)
                estimated = True
                metrics.model_tokens_estimated(prompt, completion)
            metrics.model_tokens(prompt, completion)
            proxy.usage.add(user, prompt, completion, estimated=estimated)
        return resp.status

    def _upstream_headers(self, s: Upstream, body: bytes) -> list[tuple[str, str]]:
        """What the provider gets: the allowlisted headers of the caller
        (:func:`~hermes_service.model_proxy.policy.forward_headers`), ``Content-Type:
        application/json`` on a body, ``Accept-Encoding: identity``, the service's key and
        the body's length."""
        out = [(k, v) for k, v in forward_headers(self.req.headers.items())
               if k.lower() != "content-type"]
        if self.req.command == "POST":
            out.append(("Content-Type", "application/json"))
        out.append(("Accept-Encoding", "identity"))
        key = os.environ.get(s.api_key_env) if s.api_key_env else None
        if key:
            out.append(("Authorization", f"Bearer {key}"))
        if body or self.req.command in ("POST", "PUT", "PATCH"):
            out.append(("Content-Length", str(len(body))))
        return out

    def _exchange(self, s: Upstream, target: str, headers: list[tuple[str, str]], body: bytes):
        """Send the request; return ``(connection, response)`` once the answer's headers are in.
        A pooled connection the provider already closed is retried once on a fresh one."""
        connections = self.endpoint.connections
        for attempt in (0, 1):
            conn, reused = connections.get(s) if attempt == 0 else (None, False)
            if conn is None:
                conn = connections.new(s)
            try:
                conn.putrequest(self.req.command, target, skip_host=False,
                                skip_accept_encoding=True)
                for k, v in headers:
                    conn.putheader(k, v)
                conn.endheaders(body or None)
                self._await_answer(conn, s.read_timeout)
                return conn, conn.getresponse()
            except (http.client.RemoteDisconnected, BrokenPipeError, ConnectionResetError):
                conn.close()
                if reused and attempt == 0:
                    continue
                raise
            except BaseException:
                conn.close()
                raise
        raise AssertionError("unreachable")

    def _await_answer(self, conn: http.client.HTTPConnection, timeout: float) -> None:
        """Block until the provider starts answering (or ``timeout`` → socket.timeout). A
        caller that disconnects meanwhile is noted (``_caller_gone``): the provider bills the
        request all the same, so its answer is still awaited and read to its usage
        (:meth:`_drain`)."""
        sock = conn.sock
        if sock is None:
            return
        if isinstance(sock, ssl.SSLSocket) and sock.pending():
            return
        poller = select.poll()
        poller.register(sock, select.POLLIN | select.POLLERR | select.POLLHUP)
        watch_client = True
        poller.register(self.req.connection, select.POLLIN | select.POLLERR | select.POLLHUP)
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError("no answer from the model provider")
            for fd, _ev in poller.poll(min(left, 1.0) * 1000):
                if fd == sock.fileno():
                    return
                if watch_client and fd == self.req.connection.fileno():
                    try:
                        gone = self.req.connection.recv(
                            1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b""
                    except BlockingIOError:
                        gone = False
                    except OSError:
                        gone = True
                    if gone:
                        self._caller_gone = True
                        self.req.close_connection = True
                    poller.unregister(self.req.connection)      # gone, or pipelined bytes
                    watch_client = False

    def _relay(self, resp: http.client.HTTPResponse, reader: UsageReader,
               stripper: UsageStripper | None = None) -> bool:
        """Relay status, headers and body (through ``stripper`` when given: the body then
        goes chunked); True when the whole body went through."""
        no_body = (self.req.command == "HEAD" or resp.status in (204, 304)
                   or 100 <= resp.status < 200)
        pieces = self._pieces(resp, reader, stripper)
        chunked = None if self._caller_gone else self._relay_head(resp, no_body, stripper)
        if chunked is None:
            self._drain(pieces, reader)
            return False
        if no_body:
            resp.read()
            return True
        write = self.req.wfile.write
        for data in pieces:
            if data is None:           # the provider broke off: so does our answer
                self._cut()
                return False
            try:
                write(b"%x\r\n%s\r\n" % (len(data), data) if chunked else data)
            except OSError:
                self.req.close_connection = True
                self._drain(pieces, reader)
                return False
        if chunked:
            try:
                write(b"0\r\n\r\n")
            except OSError:
                self.req.close_connection = True
                return False
        return True

    def _drain(self, pieces: Iterator[bytes | None], reader: UsageReader) -> None:
        """The caller is gone: read the rest of the provider's answer (counted by ``reader``,
        sent nowhere) until its usage is in, for at most :data:`~.limits.ORPHAN_BYTES` and
        :data:`~.limits.ORPHAN_SECONDS` (each read within the provider's read timeout) — a
        provider bills an answer whether or not anyone reads it. Cut short before the usage:
        ``_unbilled`` (counted at the output the request asked for)."""
        self.req.close_connection = True
        deadline = time.monotonic() + limits.ORPHAN_SECONDS
        sock = self._upstream_sock
        each = sock.gettimeout() if sock is not None else None
        read = 0
        while (left := deadline - time.monotonic()) > 0 and read <= limits.ORPHAN_BYTES:
            if sock is not None:
                sock.settimeout(min(left, each) if each else left)
            data = next(pieces, None)
            if data is None or reader.usage_seen:
                break
            read += len(data)
        if not reader.reported:
            self._unbilled = True

    def _relay_head(self, resp: http.client.HTTPResponse, no_body: bool,
                    stripper: UsageStripper | None) -> bool | None:
        """Send the answer's status and headers; whether the body goes chunked, or None when
        the caller is gone."""
        named = {t.strip().lower() for v in resp.headers.get_all("Connection", [])
                 for t in v.split(",")}
        self.req.send_response_only(resp.status, resp.reason)
        for k, v in resp.headers.items():
            if k.lower() not in _DROP_RESPONSE and k.lower() not in named:
                if k.lower() in ("location", "content-location"):
                    v = self.endpoint.local_location(v)
                self.req.send_header(k, v)
        length = resp.getheader("Content-Length") \
            if not resp.chunked and (stripper is None or no_body) else None
        chunked = False
        if no_body:
            if length is not None:
                self.req.send_header("Content-Length", length)
        elif length is not None and resp.length is not None:
            self.req.send_header("Content-Length", str(resp.length))
        elif self.req.request_version == "HTTP/1.1":
            chunked = True
            self.req.send_header("Transfer-Encoding", "chunked")
        else:
            self.req.close_connection = True
        if self.req.close_connection:
            self.req.send_header("Connection", "close")
        try:
            self.req.end_headers()
        except OSError:
            self.req.close_connection = True
            return None
        return chunked

    def _pieces(self, resp: http.client.HTTPResponse, reader: UsageReader,
                stripper: UsageStripper | None) -> Iterator[bytes | None]:
        """The body as it arrives (each ``read1``, counted by ``reader``, through
        ``stripper``), then what ``stripper`` held back; None once when the provider broke off
        (the body shorter than it said, or the connection lost)."""
        while True:
            try:
                data = resp.read1(limits.READ_CHUNK)
            except (OSError, http.client.HTTPException):
                yield None
                return
            if not data:
                break
            reader.feed(data)
            if stripper is not None:
                data = stripper.feed(data)
                if not data:
                    continue
            yield data
        if resp.length not in (None, 0):     # shorter than it said
            yield None
            return
        if not resp.isclosed():
            resp.read()          # a Content-Length body fully read: mark the response done
        rest = stripper.flush() if stripper is not None else b""
        if rest:
            yield rest

    def _cut(self) -> None:
        self.req.close_connection = True
        try:
            self.req.connection.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
