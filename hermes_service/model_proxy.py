"""The model pass-through endpoint: Hermes processes reach the provider through the service.

A sandboxed Hermes process must never hold the provider key. Its home's ``config.yaml`` names
this endpoint (:attr:`ModelProxy.base_url`, e.g. ``http://127.0.0.1:PORT/v1``) and a
per-process credential (:meth:`ModelProxy.issue`); the proxy checks the credential, adds the
real key on the way out and relays the provider's answer unchanged, chunk by chunk.

Standard library only: :class:`http.server.ThreadingHTTPServer` (one daemon thread per client
connection, HTTP/1.1 keep-alive) in front, :mod:`http.client` / :mod:`ssl` behind.

Requests (docs/sandbox.md §What the pass-through forwards)
------------------------------------------------------------
The credential is readable in its process's sandbox: every request is the user's agent's
own. Only what :mod:`hermes_service.model_policy` allows is forwarded; everything else is
answered here, in the shape of the OpenAI API's own errors (``{"error": {"message", "type",
"param": null, "code"}}``, https://platform.openai.com/docs/guides/error-codes), never sent:

* ``POST /v1/chat/completions`` and ``GET /v1/models``, the target exactly so (no query) —
  anything else **404** ``not_found`` (not counted: Hermes's own local-server probes), another
  method **405**;
* ``Authorization: Bearer <credential>`` (RFC 6750 §2.1) naming a credential issued and not
  revoked, else **401** ``invalid_api_key``. Credentials are kept as SHA-256 digests only;
  the lookup is by digest, so the raw credential is compared nowhere;
* a body by ``Content-Length`` (RFC 9112 §6.2), at most ``Policy.max_body`` bytes
  (:func:`~hermes_service.model_policy.max_request_bytes` of ``hermes.model.context_length``;
  more → **413**); ``Transfer-Encoding`` → **411** (Hermes's client, httpx, sends a length);
  a refused request's body is read and dropped first (up to :data:`DRAIN_BYTES`, within
  :data:`LINGER_SECONDS`), so the refusal reaches the caller whole;
  a GET with a body → **400**;
* a chat body: UTF-8 JSON whose fields are allowlisted and whose ``model`` the config offers
  (**400** / **404** ``model_not_found`` / **415**), re-encoded from what was checked, with
  ``stream_options.include_usage`` on a streamed call;
* at most :data:`MAX_USER_REQUESTS` requests of one user at once (**429**
  ``too_many_requests``), :data:`USER_BODY_BUDGET` body bytes held for one user (429) and
  :data:`BODY_BUDGET` for every user together (**503** ``server_overloaded``); a body not
  received whole within :data:`BODY_SECONDS` closes the connection (**408**); at most
  :data:`PARSES` bodies are parsed at once (a JSON body takes up to ~30 times its size in
  memory while it is checked); with ``hermes.limits.daily_tokens`` a user who spent it
  today gets **429** ``token_budget_exceeded`` (``Retry-After``: seconds to 00:00 UTC).

Each refusal but the 404 counts as ``refused`` in ``hermes_service_model_requests_total``.

Forwarding
----------
``/v1<suffix>`` goes to ``<upstream_base_url><suffix>``: the upstream base already names its
API root (``https://api.example.com/v1``, ``…/api/v1``). The provider gets only the caller's
headers of :data:`~hermes_service.model_policy.FORWARD_HEADERS` (an allowlist: ``Accept``,
``Content-Type``, ``User-Agent``, the OpenAI SDK's ``X-Stainless-*``), ``Accept-Encoding:
identity``, ``Content-Length`` (recomputed) and ``Authorization: Bearer <key>`` with the real
key read from ``os.environ[api_key_env]`` at each request (no header when ``api_key_env`` is
None or the variable is unset or empty).

Upstream connections are kept alive and reused (at most :data:`POOL_SIZE` idle per upstream
origin and proxy: proxied and direct connections are never mixed); a request whose reused
connection turns out closed by the provider before any answer is sent again once on a fresh
connection. TLS uses :func:`ssl.create_default_context` (system CAs, ``SSL_CERT_FILE``/
``SSL_CERT_DIR`` honoured by OpenSSL). Connect timeout (the proxy's ``CONNECT`` answer
included): ``min(10 s, read_timeout)``; each later socket read: ``read_timeout`` seconds.

Upstream HTTP proxy
-------------------
The pass-through never reads ``HTTP_PROXY``/``HTTPS_PROXY``/``NO_PROXY`` from its own
``os.environ`` (the service's environment is not where an admin routes provider traffic; a
request sent through whatever that names would hand it the real key). It goes through a proxy
only when told: ``upstream_proxy`` (constructor, :meth:`ModelProxy.configure`), which the
service takes from ``hermes.extra_env`` with :func:`upstream_proxy_for` — the variables an
admin sets there for Hermes, read the way curl, requests and httpx read them.

``upstream_proxy`` is ``http://[user:password@]host[:port]`` (no scheme means ``http://``;
port 80 when absent, as httpx and requests assume; a path is ignored). For an ``https``
upstream the connection is a ``CONNECT host:port`` tunnel through the proxy (RFC 9110 §9.3.6,
:meth:`http.client.HTTPConnection.set_tunnel`) and TLS runs end to end inside it, checked
against the provider's name; for an ``http`` upstream each request goes to the proxy with the
absolute URI as its target (RFC 9112 §3.2.2). Credentials in the URL (percent-decoded) go as
``Proxy-Authorization: Basic …`` (RFC 9110 §11.7.2, RFC 7617): on the ``CONNECT`` only for
``https`` (never inside the tunnel, so never to the provider), on each request for ``http``.
A proxy URL the pass-through cannot use (another scheme such as ``socks5://`` or
``https://``, no host, a bad port) is not an error at construction or reload (neither a start
nor a reload stops halfway on it) — requests then
get **502** (``"model provider unreachable: unusable upstream proxy: …"``) and are never sent
direct; a proxy that refuses the tunnel (407, 403, 502 …) or cannot be reached is a 502 as
well. Logs and error bodies never show the proxy's credentials.

Answers
-------
Status, reason, headers (minus hop-by-hop and ``Content-Length``/``Transfer-Encoding``) and
body exactly as the provider sent them, error statuses included (a 401/429/500 looks to Hermes
as it would from the provider itself). Two rewrites: a ``Location``/``Content-Location``
under the upstream base (absolute, or an absolute path) is pointed back at this endpoint, so a
redirect never sends the caller to the provider itself; and the usage chunk the pass-through
asked for is taken out of a stream whose caller did not ask for it
(:class:`~hermes_service.model_policy.UsageStripper`; that stream then goes chunked). The
body is relayed as it arrives — each :meth:`http.client.HTTPResponse.read1` (at most 64 KiB)
is written and flushed at once, no buffering of the whole body — with the provider's
``Content-Length`` when it sent one, else HTTP/1.1 chunked framing (RFC 9112 §7.1;
close-delimited to an HTTP/1.0 caller). A provider stream that breaks mid-answer ends the
caller's connection without the final chunk, so the caller sees the same broken stream.

* provider unreachable (DNS, refused, reset, TLS failure, broken answer before its headers),
  or no upstream configured → **502** ``{"error": {"message": "model provider unreachable:
  …", "type": "server_error", "code": "upstream_unreachable"}}``;
* no answer headers within ``read_timeout`` → **504** (``"model provider timed out"``,
  ``code: "upstream_timeout"``).

Hermes prints either as an HTTP 502/504 (or connection) error, which
:func:`hermes_service.runner.classify_text` maps to ``upstream_unavailable``. While waiting
for the provider's answer headers the proxy watches the caller's socket: a caller that
disconnects (a killed Hermes process) drops the upstream request too.

Usage
-----
Token counts come from the provider's own ``usage`` objects
(:class:`~hermes_service.model_usage.UsageReader`): the JSON body's ``usage`` (OpenAI chat
completions / responses, Anthropic messages), or in a ``text/event-stream`` the ``data:``
lines' (per key the largest value seen counts, right both for one final usage object and for
running totals). A 2xx chat answer that carried none — a stream cut before its usage chunk,
a provider that does not report usage — is counted by estimate: a quarter of the request's
bytes as prompt tokens, a quarter of the answer's characters that went through as
completion tokens (``hermes_service_model_tokens_estimated_total``, and
``estimated_requests`` per user and day). Tokens go to
:func:`hermes_service.metrics.model_tokens` (``hermes_service_model_tokens_total{kind}``, no
user label) and per user and UTC day to :class:`~hermes_service.model_usage.UsageStore`
(SQLite, written by a background thread off the request path). Every forwarded request that
got an answer from the provider counts as one request, whatever its status.

Connections: one thread per caller connection, at most :data:`MAX_CONNECTIONS` at once (more
are closed at accept), each closed after :data:`CLIENT_TIMEOUT` seconds without a request or
without progress writing to it.

Logging: one debug line per forwarded request on ``hermes_service.model_proxy`` (user,
method, status, duration in ms); neither the key nor a credential is ever logged.
"""
from __future__ import annotations

import base64
import hashlib
import http.client
import json
import logging
import os
import secrets
import select
import socket
import sqlite3
import ssl
import sys
import threading
import time
from collections.abc import Mapping
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import NamedTuple
from urllib.parse import unquote, urlsplit
from urllib.request import proxy_bypass_environment

from . import metrics
from .model_policy import (
    Policy,
    Prepared,
    Refusal,
    UsageStripper,
    forward_headers,
    max_request_bytes,
    route,
)
from .model_usage import (
    UsageReader,
    UsageStore,
    budget_message,
    seconds_to_midnight,
    usage_db_path,  # noqa: F401  (usage_db_path: re-exported)
)

log = logging.getLogger("hermes_service.model_proxy")

MAX_USER_REQUESTS = 16               # one user's requests in flight at once (429 above)
USER_BODY_BUDGET = 16 * 1024 * 1024   # request body bytes held at once for one user (429)
BODY_BUDGET = 256 * 1024 * 1024       # request body bytes held at once, every user (503 above)
BODY_SECONDS = 60.0                   # a body must arrive whole within this (408)
PARSES = 2                            # request bodies parsed (checked) at once
LINGER_SECONDS = 2.0                  # reading what a refused caller still sends (s)
DRAIN_BYTES = 64 * 1024 * 1024        # ... at most this much of its body
READ_CHUNK = 64 * 1024                # largest piece relayed per read1()
POOL_SIZE = 8                         # idle upstream connections kept per origin
CONNECT_TIMEOUT = 10.0
CLIENT_TIMEOUT = 120.0                # idle keep-alive / a caller that stops reading or sending
MAX_CONNECTIONS = 512                 # client connections at once (one thread each); more: closed
# RFC 9110 §7.6.1 (plus Proxy-Connection, Keep-Alive of RFC 2068); lower-case
HOP_BY_HOP = frozenset({"connection", "keep-alive", "proxy-connection", "proxy-authenticate",
                        "proxy-authorization", "te", "trailer", "trailers",
                        "transfer-encoding", "upgrade"})
_DROP_RESPONSE = HOP_BY_HOP | {"content-length"}


def _digest(credential: str) -> bytes:
    return hashlib.sha256(credential.encode("utf-8", "surrogatepass")).digest()


def openai_error(message: str, etype: str, code: str) -> bytes:
    """An OpenAI-style error body: ``{"error": {"message", "type", "param": null, "code"}}``."""
    return json.dumps({"error": {"message": message, "type": etype, "param": None,
                                 "code": code}}).encode()


def upstream_proxy_for(env: Mapping[str, str] | None,
                       upstream_base_url: str | None) -> str | None:
    """The HTTP proxy to reach ``upstream_base_url`` through, picked from the environment-style
    mapping ``env`` (``hermes.extra_env``; never ``os.environ``) as curl, requests and httpx
    pick it: ``https_proxy``/``HTTPS_PROXY`` for an ``https`` upstream, ``http_proxy``/
    ``HTTP_PROXY`` for ``http``, else ``all_proxy``/``ALL_PROXY``; the lower-case name first,
    an empty value counts as unset. ``no_proxy``/``NO_PROXY`` (comma-separated host names,
    domain suffixes with or without a leading dot, optional ``:port``; ``*`` for every host)
    is matched by :func:`urllib.request.proxy_bypass_environment` against the upstream's host.

    Returns the variable's value (stripped) as given, credentials included, or None: no
    proxy applies, or ``upstream_base_url`` is None or not an http(s) URL. Never raises; the
    value is checked by :class:`ModelProxy`. Docs:
    https://curl.se/docs/manpage.html#ENVIRONMENT,
    https://www.python-httpx.org/environment_variables/,
    https://docs.python.org/3/library/urllib.request.html#urllib.request.getproxies
    """
    if not env or not upstream_base_url:
        return None
    try:
        parts = urlsplit(upstream_base_url)
        host, port = parts.hostname, parts.port
    except ValueError:
        return None
    scheme = parts.scheme.lower()
    if scheme not in ("http", "https") or not host:
        return None

    def pick(name: str) -> str | None:
        for key in (name, name.upper()):
            value = env.get(key)
            if isinstance(value, str) and value.strip():
                return value.strip()
        return None

    proxy = pick(f"{scheme}_proxy") or pick("all_proxy")
    if proxy is None:
        return None
    no_proxy = pick("no_proxy")
    if no_proxy:
        port = port or (443 if scheme == "https" else 80)
        netloc = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        bypass = {"no": no_proxy}
        if proxy_bypass_environment(host, bypass) or proxy_bypass_environment(netloc, bypass):
            return None
    return proxy


class _Proxy(NamedTuple):
    host: str
    port: int
    auth: str | None         # the Proxy-Authorization value ("Basic …"), None without one
    shown: str               # "http://host:port": for logs (no credentials)


class _Settings(NamedTuple):
    scheme: str              # "http" | "https"
    host: str
    port: int
    base_path: str           # without trailing slash, e.g. "/v1"
    api_key_env: str | None
    read_timeout: float
    proxy: _Proxy | None = None
    proxy_error: str | None = None   # an unusable upstream_proxy: every request gets 502

    @property
    def netloc(self) -> str:
        """``host[:port]`` as in a URL (port left out when it is the scheme's default)."""
        host = f"[{self.host}]" if ":" in self.host else self.host
        default = 443 if self.scheme == "https" else 80
        return host if self.port == default else f"{host}:{self.port}"

    @property
    def pool_key(self) -> tuple:
        return (self.scheme, self.host, self.port, self.proxy)

    @property
    def where(self) -> str:
        """The upstream for logs: ``host:port``, plus `` via http://proxy:port``."""
        via = f" via {self.proxy.shown}" if self.proxy is not None else ""
        return f"{self.host}:{self.port}{via}"


def _proxy(url: str | None) -> tuple[_Proxy | None, str | None]:
    """``(proxy, None)``, ``(None, None)`` for no proxy, or ``(None, why)`` when ``url`` is
    unusable (``why`` never quotes the URL: it may carry credentials)."""
    if url is None or not url.strip():
        return None, None
    raw = url.strip()
    if "://" not in raw:
        raw = "http://" + raw
    try:
        parts = urlsplit(raw)
        host, port = parts.hostname, parts.port
    except ValueError:
        return None, "not a host[:port] URL"
    if parts.scheme.lower() != "http":
        return None, f"{parts.scheme.lower()}:// proxies are not supported (http:// only)"
    if not host:
        return None, "no host in the proxy URL"
    port = port or 80
    auth = None
    if parts.username is not None:
        pair = f"{unquote(parts.username)}:{unquote(parts.password or '')}"
        auth = "Basic " + base64.b64encode(pair.encode("utf-8")).decode("ascii")
    shown = f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"
    return _Proxy(host, port, auth, shown), None


def _settings(upstream_base_url: str | None, api_key_env: str | None,
              read_timeout: float, upstream_proxy: str | None = None) -> _Settings | None:
    if read_timeout is None or read_timeout <= 0:
        raise ValueError("read_timeout must be > 0 seconds")
    if not upstream_base_url:
        return None
    parts = urlsplit(upstream_base_url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"upstream_base_url must be an http(s) URL, got {upstream_base_url!r}")
    if parts.username or parts.password or parts.query or parts.fragment:
        raise ValueError("upstream_base_url must not carry credentials, a query or a fragment")
    port = parts.port or (443 if parts.scheme == "https" else 80)
    proxy, proxy_error = _proxy(upstream_proxy)
    return _Settings(parts.scheme, parts.hostname, port, parts.path.rstrip("/"),
                     api_key_env or None, float(read_timeout), proxy,
                     f"unusable upstream proxy: {proxy_error}" if proxy_error else None)


def _warn_unusable(s: _Settings | None) -> None:
    if s is not None and s.proxy_error is not None:
        log.warning("model pass-through: %s; every model request gets 502 until it is fixed",
                    s.proxy_error)


# ---------------------------------------------------------------------------------------
# the server


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True
    request_queue_size = 128          # listen backlog: many Hermes processes connect at once
    proxy: ModelProxy

    def verify_request(self, request, client_address) -> bool:
        return self.proxy._open_connections() < MAX_CONNECTIONS

    def handle_error(self, request, client_address) -> None:
        """A caller that went away is routine (debug); anything else is a bug (logged with
        its traceback on our logger, never on stderr)."""
        exc = sys.exc_info()[1]
        if isinstance(exc, OSError):
            log.debug("model proxy: connection ended: %s", type(exc).__name__)
        else:
            log.exception("model proxy: unexpected error in a request")


class _Server6(_Server):
    address_family = socket.AF_INET6


class _Abort(Exception):
    """The exchange cannot go on (the caller or the provider went away mid-answer)."""


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: _Server
    server_version = "hermes-service-model-proxy"
    sys_version = ""
    timeout = CLIENT_TIMEOUT

    def log_message(self, format, *args):  # noqa: A002  (no per-request stderr lines)
        pass

    def setup(self):
        super().setup()
        try:
            self.connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        except OSError:
            pass
        self.server.proxy._track(self.connection, True)

    def finish(self):
        try:
            super().finish()
            if getattr(self, "_linger", False):
                self._lingering_close()
        finally:
            self.server.proxy._track(self.connection, False)

    def _lingering_close(self) -> None:
        """After refusing a request whose body was not read: stop writing and read (and
        drop) what the caller still sends, for up to :data:`LINGER_SECONDS`, before the
        connection is closed — closing with unread data makes the kernel reset the
        connection, which can destroy the refusal on its way (RFC 9112 §9.6)."""
        conn = self.connection
        try:
            conn.shutdown(socket.SHUT_WR)
            deadline = time.monotonic() + LINGER_SECONDS
            while (left := deadline - time.monotonic()) > 0:
                conn.settimeout(left)
                if not conn.recv(1 << 16):
                    return
        except OSError:
            return

    def do_GET(self):
        self._handle()

    do_POST = do_PUT = do_PATCH = do_DELETE = do_HEAD = do_OPTIONS = do_GET

    # -- our own answers ------------------------------------------------------------
    def _reply(self, status: int, message: str, etype: str, code: str,
               extra_headers: dict | None = None) -> None:
        body = openai_error(message, etype, code)
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        for k, v in (extra_headers or {}).items():
            self.send_header(k, v)
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def _handle(self) -> None:
        proxy = self.server.proxy
        prepared = None
        try:
            path = route(self.command, self.path)
            user = proxy._user_for(self.headers.get("Authorization"))
            if user is None:
                self._drain_or_close()
                metrics.model_request("unauthorized")
                self._reply(401, "Incorrect API key provided: this endpoint needs the credential "
                            "issued to this Hermes process.", "invalid_request_error",
                            "invalid_api_key", {"WWW-Authenticate": 'Bearer realm="model"'})
                return
            length = self._length(proxy.policy.max_body)
            if self.command == "GET" and length:
                raise Refusal(400, "invalid_request_body", "GET takes no body")
            proxy.check_budget(user)
        except Refusal as refusal:
            self._refuse(refusal)
            return
        with proxy._admit(user, length) as refusal:
            if refusal is not None:
                self._refuse(refusal)
                return
            body = self._read_body(length)
            if body is None:
                return
            if self.command == "POST":
                try:
                    with proxy._parses:
                        prepared = proxy.policy.prepare_chat(body,
                                                             self.headers.get("Content-Type"))
                except Refusal as refusal:
                    self._refuse(refusal, read=True)
                    return
                body = prepared.body
            settings = proxy._settings
            started = time.perf_counter()
            status = None
            try:
                status = self._forward(settings, user, path[len("/v1"):], body, prepared)
            finally:
                ms = (time.perf_counter() - started) * 1000
                log.debug("model request user=%s %s %s status=%s ms=%.1f", user, self.command,
                          path, status if status is not None else "aborted", ms,
                          extra={"status": status, "duration_ms": round(ms, 1)})

    def _read_body(self, length: int) -> bytes | None:
        """The request body, received whole within :data:`BODY_SECONDS` (else 408 and the
        connection closed: a caller trickling a body holds a share of the body budget);
        None when it did not come."""
        if not length:
            return b""
        deadline = time.monotonic() + BODY_SECONDS
        parts, got = [], 0
        while got < length:
            left = deadline - time.monotonic()
            if left <= 0:
                self.close_connection = True
                self._reply(408, f"the request body did not arrive within {BODY_SECONDS:g} s",
                            "invalid_request_error", "request_timeout")
                return None
            self.connection.settimeout(min(left, CLIENT_TIMEOUT))
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
        self.connection.settimeout(CLIENT_TIMEOUT)
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
        self._reply(refusal.status, refusal.message, refusal.etype, refusal.code,
                    refusal.headers)

    def _drain_or_close(self) -> None:
        """Refusing a request whose body was not read: read and drop the body first (up to
        :data:`DRAIN_BYTES`, within :data:`LINGER_SECONDS`), so the caller has sent it all
        before the refusal comes — closing with unread data makes the kernel reset the
        connection, which can destroy the refusal on its way at any hop (the sandbox's
        forwarder, RFC 9112 §9.6). A body of 1 MiB or less keeps the connection usable;
        anything else closes it (a body without a length: after a lingering close)."""
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
        left, deadline = min(length, DRAIN_BYTES), time.monotonic() + LINGER_SECONDS
        try:
            while left > 0 and (room := deadline - time.monotonic()) > 0:
                self.connection.settimeout(room)
                chunk = self.rfile.read1(min(left, 1 << 20))
                if not chunk:
                    break
                left -= len(chunk)
            self.connection.settimeout(CLIENT_TIMEOUT)
        except OSError:
            self.close_connection = True
            return
        if left > 0 or length > DRAIN_BYTES:
            self.close_connection = True
            self._linger = True

    # -- forwarding -----------------------------------------------------------------
    def _forward(self, s: _Settings | None, user: str, suffix: str, body: bytes,
                 prepared: Prepared | None) -> int | None:
        proxy = self.server.proxy
        if s is None:
            metrics.model_request("unreachable")
            self._reply(502, "model provider unreachable: no model provider is configured",
                        "server_error", "upstream_unreachable")
            return 502
        if s.proxy_error is not None:
            metrics.model_request("unreachable")
            log.warning("model provider %s:%s not tried: %s", s.host, s.port, s.proxy_error)
            self._reply(502, f"model provider unreachable: {s.proxy_error}", "server_error",
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
            conn, resp = self._exchange(proxy, s, target, headers, body)
        except _Abort:
            self.close_connection = True
            return None
        except TimeoutError:
            metrics.model_request("unreachable")
            log.warning("model provider timed out (%s): no answer within %g s", s.where,
                        s.read_timeout)
            self.close_connection = True
            self._reply(504, f"model provider timed out (no answer within "
                        f"{s.read_timeout:g} s)", "server_error", "upstream_timeout")
            return 504
        except (OSError, http.client.HTTPException, ssl.SSLError) as exc:
            metrics.model_request("unreachable")
            log.warning("model provider unreachable (%s): %s: %s", s.where,
                        type(exc).__name__, exc)
            self._reply(502, f"model provider unreachable: {type(exc).__name__}",
                        "server_error", "upstream_unreachable")
            return 502
        metrics.model_request("ok" if resp.status < 400 else "provider_error")
        reader = UsageReader(resp.getheader("Content-Type"), resp.getheader("Content-Encoding"))
        strip = (prepared is not None and prepared.stream and not prepared.usage_asked
                 and 200 <= resp.status < 300 and reader.kind == "sse"
                 and (resp.getheader("Content-Encoding") or "identity").lower() == "identity")
        complete = False
        try:
            complete = self._relay(resp, reader, UsageStripper() if strip else None)
        finally:
            if complete and not resp.will_close:
                proxy._pool_put(s, conn)
            else:
                conn.close()
            prompt, completion = reader.tokens()
            estimated = False
            if prepared is not None and 200 <= resp.status < 300 and not reader.reported:
                # the provider's usage never came (a stream cut before its usage chunk, a
                # provider that does not report it): counted from what went through
                prompt, completion = prepared.prompt_estimate, reader.estimate_completion()
                estimated = True
                metrics.model_tokens_estimated(prompt, completion)
            metrics.model_tokens(prompt, completion)
            proxy.usage.add(user, prompt, completion, estimated=estimated)
        return resp.status

    def _upstream_headers(self, s: _Settings, body: bytes) -> list[tuple[str, str]]:
        """What the provider gets: the allowlisted headers of the caller
        (:func:`~hermes_service.model_policy.forward_headers`), ``Content-Type:
        application/json`` on a body, ``Accept-Encoding: identity``, the service's key and
        the body's length."""
        out = [(k, v) for k, v in forward_headers(self.headers.items())
               if k.lower() != "content-type"]
        if self.command == "POST":
            out.append(("Content-Type", "application/json"))
        out.append(("Accept-Encoding", "identity"))
        key = os.environ.get(s.api_key_env) if s.api_key_env else None
        if key:
            out.append(("Authorization", f"Bearer {key}"))
        if body or self.command in ("POST", "PUT", "PATCH"):
            out.append(("Content-Length", str(len(body))))
        return out

    def _exchange(self, proxy: ModelProxy, s: _Settings, target: str,
                  headers: list[tuple[str, str]], body: bytes):
        """Send the request; return ``(connection, response)`` once the answer's headers are in.
        A pooled connection the provider already closed is retried once on a fresh one."""
        for attempt in (0, 1):
            conn, reused = proxy._pool_get(s) if attempt == 0 else (None, False)
            if conn is None:
                conn = proxy._new_connection(s)
            try:
                conn.putrequest(self.command, target, skip_host=False,
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
        """Block until the provider starts answering (or ``timeout`` → socket.timeout),
        dropping the exchange (:class:`_Abort`) if our caller disconnects meanwhile."""
        sock = conn.sock
        if sock is None:
            return
        if isinstance(sock, ssl.SSLSocket) and sock.pending():
            return
        poller = select.poll()
        poller.register(sock, select.POLLIN | select.POLLERR | select.POLLHUP)
        watch_client = True
        poller.register(self.connection, select.POLLIN | select.POLLERR | select.POLLHUP)
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError("no answer from the model provider")
            for fd, _ev in poller.poll(min(left, 1.0) * 1000):
                if fd == sock.fileno():
                    return
                if watch_client and fd == self.connection.fileno():
                    try:
                        gone = self.connection.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b""
                    except BlockingIOError:
                        gone = False
                    except OSError:
                        gone = True
                    if gone:
                        raise _Abort("the caller disconnected before the provider answered")
                    poller.unregister(self.connection)      # pipelined bytes: stop watching
                    watch_client = False

    def _relay(self, resp: http.client.HTTPResponse, reader: UsageReader,
               stripper: UsageStripper | None = None) -> bool:
        """Relay status, headers and body (through ``stripper`` when given: the body then
        goes chunked); True when the whole body went through."""
        no_body = (self.command == "HEAD" or resp.status in (204, 304)
                   or 100 <= resp.status < 200)
        named = {t.strip().lower() for v in resp.headers.get_all("Connection", [])
                 for t in v.split(",")}
        self.send_response_only(resp.status, resp.reason)
        for k, v in resp.headers.items():
            if k.lower() not in _DROP_RESPONSE and k.lower() not in named:
                if k.lower() in ("location", "content-location"):
                    v = self.server.proxy._local_location(v)
                self.send_header(k, v)
        length = resp.getheader("Content-Length") \
            if not resp.chunked and (stripper is None or no_body) else None
        chunked = False
        if no_body:
            if length is not None:
                self.send_header("Content-Length", length)
        elif length is not None and resp.length is not None:
            self.send_header("Content-Length", str(resp.length))
        elif self.request_version == "HTTP/1.1":
            chunked = True
            self.send_header("Transfer-Encoding", "chunked")
        else:
            self.close_connection = True
        if self.close_connection:
            self.send_header("Connection", "close")
        try:
            self.end_headers()
        except OSError:
            self.close_connection = True
            return False
        if no_body:
            resp.read()
            return True
        write = self.wfile.write
        while True:
            try:
                data = resp.read1(READ_CHUNK)
            except (OSError, http.client.HTTPException):
                data = None
            if data is None:          # the provider broke off: so does our answer
                self._cut()
                return False
            if not data:
                break
            reader.feed(data)
            if stripper is not None:
                data = stripper.feed(data)
                if not data:
                    continue
            try:
                write(b"%x\r\n%s\r\n" % (len(data), data) if chunked else data)
            except OSError:
                self.close_connection = True
                return False
        if resp.length not in (None, 0):     # shorter than it said
            self._cut()
            return False
        if not resp.isclosed():
            resp.read()          # a Content-Length body fully read: mark the response done
        rest = stripper.flush() if stripper is not None else b""
        try:
            if rest:
                write(b"%x\r\n%s\r\n" % (len(rest), rest) if chunked else rest)
        except OSError:
            self.close_connection = True
            return False
        if chunked:
            try:
                write(b"0\r\n\r\n")
            except OSError:
                self.close_connection = True
                return False
        return True

    def _cut(self) -> None:
        self.close_connection = True
        try:
            self.connection.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass


class ModelProxy:
    """The pass-through model endpoint (module doc).

    ``upstream_base_url``: the provider's API root (``https://api.example.com/v1``), None while
    no provider is configured (every request then gets 502). ``api_key_env``: the environment
    variable holding the provider key (read at each request), None for no key.
    ``usage_db``: the SQLite file of per-user usage (:class:`UsageStore`, normally
    :func:`usage_db_path` of the data dir). ``read_timeout``: seconds to wait for the
    provider's answer headers and for each later read (> 0). ``host``: the loopback address
    to bind. ``upstream_proxy``: ``http://[user:password@]host[:port]`` to reach the provider
    through (normally :func:`upstream_proxy_for` of ``hermes.extra_env``), None for direct;
    an unusable one is logged and makes every request a 502, never a direct one (module doc).
    Raises ValueError for an unusable upstream URL or timeout.
    """

    def __init__(self, upstream_base_url: str | None, api_key_env: str | None, usage_db: Path,
                 read_timeout: float = 300.0, host: str = "127.0.0.1",
                 upstream_proxy: str | None = None, models=(), context_length: int = 128000,
                 daily_tokens: int | None = None):
        self._settings = _settings(upstream_base_url, api_key_env, read_timeout, upstream_proxy)
        _warn_unusable(self._settings)
        self.policy = Policy(frozenset(models), max_request_bytes(context_length))
        self.daily_tokens = daily_tokens
        self.host = host
        self.usage = UsageStore(Path(usage_db))
        self._creds: dict[bytes, str] = {}
        self._lock = threading.Lock()
        self._pool: dict[tuple, list[http.client.HTTPConnection]] = {}
        self._conns: set[socket.socket] = set()
        self._inflight: dict[str, int] = {}        # user -> requests in flight
        self._body_bytes = 0                       # request body bytes held now
        self._user_bytes: dict[str, int] = {}      # ... per user
        self._parses = threading.BoundedSemaphore(PARSES)
        self._server: _Server | None = None
        self._thread: threading.Thread | None = None
        self._ssl: ssl.SSLContext | None = None

    # -- lifetime ---------------------------------------------------------------------
    def start(self) -> ModelProxy:
        """Bind an ephemeral port on ``host`` and serve in daemon threads. Idempotent."""
        if self._server is not None:
            return self
        cls = _Server6 if ":" in self.host else _Server
        srv = cls((self.host, 0), _Handler)
        srv.proxy = self
        self._server = srv
        self._thread = threading.Thread(target=srv.serve_forever, kwargs={"poll_interval": 0.2},
                                        name=f"model-proxy-{self.port}", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop serving: open exchanges are cut, idle upstream connections closed, queued
        usage written."""
        srv, self._server = self._server, None
        if srv is not None:
            srv.shutdown()
            srv.server_close()
            with self._lock:
                conns = list(self._conns)
            for c in conns:
                try:
                    c.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
            if self._thread is not None:
                self._thread.join(5)
            self._thread = None
        self._clear_pool()
        self.usage.close()

    @property
    def port(self) -> int:
        if self._server is None:
            raise RuntimeError("the model proxy is not started")
        return self._server.server_address[1]

    @property
    def base_url(self) -> str:
        """What a Hermes home names as ``model.base_url``: ``http://127.0.0.1:PORT/v1``.
        RuntimeError before :meth:`start`."""
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}/v1"

    def configure(self, upstream_base_url: str | None, api_key_env: str | None,
                  read_timeout: float = 300.0, upstream_proxy: str | None = None,
                  models=None, context_length: int | None = None,
                  daily_tokens: int | None = None) -> None:
        """Live reload: requests that start from now on use these settings (ones in flight
        finish with the old). ``models``/``context_length`` None keep the current policy's.
        Raises ValueError like the constructor (the old settings stay)."""
        new = _settings(upstream_base_url, api_key_env, read_timeout, upstream_proxy)
        _warn_unusable(new)
        old, self._settings = self._settings, new
        self.policy = Policy(
            self.policy.models if models is None else frozenset(models),
            self.policy.max_body if context_length is None else max_request_bytes(context_length))
        self.daily_tokens = daily_tokens
        if new != old:
            self._clear_pool()

    # -- what a user may spend -----------------------------------------------------------
    def check_budget(self, user_id: str) -> None:
        """Raise :class:`~hermes_service.model_policy.Refusal` 429 ``token_budget_exceeded``
        when ``user_id`` has used ``daily_tokens`` tokens today (UTC; every service process
        on the data dir counted). Nothing without a budget; a usage db that cannot be read
        does not stop a request (logged)."""
        budget = self.daily_tokens
        if not budget:
            return
        try:
            spent = self.usage.spent(user_id)
        except sqlite3.Error as exc:
            log.warning("model usage of user=%s not readable: %s", user_id, exc)
            return
        if spent >= budget:
            raise Refusal(429, "token_budget_exceeded", budget_message(spent, budget),
                          etype="insufficient_quota",
                          headers={"Retry-After": str(seconds_to_midnight())})

    @contextmanager
    def _admit(self, user_id: str, length: int):
        """Hold one of ``user_id``'s :data:`MAX_USER_REQUESTS` places and ``length`` bytes of
        :data:`BODY_BUDGET` (and of :data:`USER_BODY_BUDGET`) while a request is read and
        answered; yields None, or the
        :class:`~hermes_service.model_policy.Refusal` (429 / 503) when either is taken."""
        with self._lock:
            if self._inflight.get(user_id, 0) >= MAX_USER_REQUESTS or \
                    self._user_bytes.get(user_id, 0) + length > USER_BODY_BUDGET:
                refusal = Refusal(429, "too_many_requests", f"more than {MAX_USER_REQUESTS} "
                                  "model requests (or their bodies over "
                                  f"{USER_BODY_BUDGET // (1024 * 1024)} MiB) of this user at "
                                  "once", etype="rate_limit_error", headers={"Retry-After": "1"})
            elif self._body_bytes + length > BODY_BUDGET:
                refusal = Refusal(503, "server_overloaded", "the pass-through holds too many "
                                  "request bodies now; retry", etype="server_error",
                                  headers={"Retry-After": "1"})
            else:
                refusal = None
                self._inflight[user_id] = self._inflight.get(user_id, 0) + 1
                self._user_bytes[user_id] = self._user_bytes.get(user_id, 0) + length
                self._body_bytes += length
        if refusal is not None:
            yield refusal
            return
        try:
            yield None
        finally:
            with self._lock:
                left = self._inflight.get(user_id, 1) - 1
                if left:
                    self._inflight[user_id] = left
                else:
                    self._inflight.pop(user_id, None)
                held = self._user_bytes.get(user_id, length) - length
                if held > 0:
                    self._user_bytes[user_id] = held
                else:
                    self._user_bytes.pop(user_id, None)
                self._body_bytes -= length

    # -- credentials --------------------------------------------------------------------
    def issue(self, user_id: str) -> str:
        """A fresh random credential (``secrets.token_urlsafe(32)``, 256 bits) for one Hermes
        process of ``user_id``; valid until :meth:`revoke`. Only its SHA-256 is kept."""
        if not isinstance(user_id, str) or not user_id:
            raise ValueError("user_id must be a non-empty string")
        credential = "hsm-" + secrets.token_urlsafe(32)
        with self._lock:
            self._creds[_digest(credential)] = user_id
        return credential

    def revoke(self, credential: str) -> None:
        """Make ``credential`` invalid at once (unknown ones are ignored)."""
        with self._lock:
            self._creds.pop(_digest(credential), None)

    def _user_for(self, authorization: str | None) -> str | None:
        if not authorization:
            return None
        scheme, _, token = authorization.strip().partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            return None
        with self._lock:
            return self._creds.get(_digest(token.strip()))

    # -- upstream connections ----------------------------------------------------------
    def _new_connection(self, s: _Settings) -> http.client.HTTPConnection:
        """A connected socket to the provider: direct, through a ``CONNECT`` tunnel (https
        upstream, proxy set; TLS checked against the provider's name) or to the proxy itself
        (http upstream; the request then names the absolute URI)."""
        timeout = min(CONNECT_TIMEOUT, s.read_timeout)
        px = s.proxy
        host, port = (px.host, px.port) if px is not None else (s.host, s.port)
        if s.scheme == "https":
            if self._ssl is None:
                self._ssl = ssl.create_default_context()
            conn = http.client.HTTPSConnection(host, port, timeout=timeout, context=self._ssl)
            if px is not None:
                conn.set_tunnel(s.host, s.port, headers=(
                    {"Proxy-Authorization": px.auth} if px.auth else None))
        else:
            conn = http.client.HTTPConnection(host, port, timeout=timeout)
        try:
            conn.connect()
        except TimeoutError:          # no connection at all: unreachable (502), not 504
            conn.close()
            raise ConnectionError(f"connect timed out after {timeout:g} s") from None
        conn.sock.settimeout(s.read_timeout)
        return conn

    def _pool_get(self, s: _Settings):
        with self._lock:
            idle = self._pool.get(s.pool_key)
            conn = idle.pop() if idle else None
        if conn is not None and conn.sock is not None:
            conn.sock.settimeout(s.read_timeout)
            return conn, True
        return None, False

    def _pool_put(self, s: _Settings, conn: http.client.HTTPConnection) -> None:
        if conn.sock is None or self._settings != s:
            conn.close()
            return
        with self._lock:
            idle = self._pool.setdefault(s.pool_key, [])
            if len(idle) < POOL_SIZE:
                idle.append(conn)
                return
        conn.close()

    def _clear_pool(self) -> None:
        with self._lock:
            pools, self._pool = self._pool, {}
        for idle in pools.values():
            for conn in idle:
                conn.close()

    def _local_location(self, value: str) -> str:
        """A redirect into the upstream base points back at this endpoint (so the caller
        never goes to the provider itself); any other Location stays as sent."""
        s = self._settings
        if s is None or self._server is None:
            return value
        for prefix in (f"{s.scheme}://{s.netloc}{s.base_path}", s.base_path):
            if prefix and value.startswith(prefix) and (
                    len(value) == len(prefix) or value[len(prefix)] in "/?"):
                return (self.base_url if prefix[0] != "/" else "/v1") + value[len(prefix):]
        return value

    def _open_connections(self) -> int:
        with self._lock:
            return len(self._conns)

    def _track(self, conn: socket.socket, add: bool) -> None:
        with self._lock:
            (self._conns.add if add else self._conns.discard)(conn)
